#!/usr/bin/env bash
# Runs the whole test suite (CPU: FakeStore, LocalTensorMode, gloo).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# -rs: the summary lists every skipped test with its reason
exec python -m pytest -q -rs "$@" tests
