#!/usr/bin/env bash
# Runs the test suite (CPU: FakeStore, LocalTensorMode, gloo).
#   bash scripts/test.sh            the whole suite: the README's test command
#   bash scripts/test.sh --quick    the quick tier (tests/conftest.py): no `slow`
#                                   tests, parametrized cases sampled
# Other arguments go to pytest (e.g. -m "not gloo", -x).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# -rs: the summary lists every skipped test with its reason
exec python -m pytest -q -rs "$@" tests
