"""``python -m localmap_fx inspect DIR``: see :mod:`localmap_fx.debug.cli`."""

import sys

from .debug.cli import main

sys.exit(main())
