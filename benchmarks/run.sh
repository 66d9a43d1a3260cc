#!/usr/bin/env bash
# Runs every benchmark (CPU + gloo, and CUDA/NCCL when 2 GPUs are present),
# writes benchmarks/out/results.{json,md,png} and updates docs/benchmarks.md
# and docs/benchmarks.png.  Extra arguments go to `python -m benchmarks.run`.
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
exec python -m benchmarks.run --out benchmarks/out --docs docs "$@"
