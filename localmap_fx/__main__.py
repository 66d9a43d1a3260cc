"""``python -m localmap_fx inspect DIR``: see :mod:`localmap_fx.inspect.cli`."""

import sys

from .inspect.cli import main

sys.exit(main())
