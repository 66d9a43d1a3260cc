#!/usr/bin/env bash
# Runs the test suite (CPU: FakeStore, LocalTensorMode, gloo), as one pytest
# shard per CPU at once (scripts/pytest_shards.py; tests/shards.py).
#   bash scripts/test.sh            the whole suite: the README's test command
#   bash scripts/test.sh --quick    the quick tier (tests/conftest.py): no `slow`
#                                   tests, parametrized cases sampled
#   bash scripts/test.sh --jobs 1   one plain pytest process (e.g. for --lf, --pdb)
#   bash scripts/test.sh --update-times   also refresh tests/module_seconds.json
# Other arguments go to pytest (e.g. -m "not gloo", -x, tests/unit); each
# shard lists its skipped tests with their reasons (-rs).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python scripts/pytest_shards.py "$@"
