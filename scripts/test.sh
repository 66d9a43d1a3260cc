#!/usr/bin/env bash
# Runs the whole test suite (CPU: FakeStore, LocalTensorMode, gloo).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python -m pytest -q "$@" tests
