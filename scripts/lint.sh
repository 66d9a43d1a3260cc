#!/usr/bin/env bash
# Lint (ruff: pyflakes, import order, bugbear) and type check (mypy over
# localmap_fx/); configuration in pyproject.toml.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -m ruff check .
python -m mypy
