#!/usr/bin/env bash
# Runs every benchmark (CPU + gloo, and CUDA/NCCL when 2 GPUs are present),
# writes benchmarks/out/results.{json,md,png} and updates docs/benchmarks.md
# and docs/benchmarks.png, then the deep-model sweep (P8, P9: benchmarks/depth_bench.py,
# docs/benchmarks_depth.png).  Extra arguments go to `python -m benchmarks.run`.
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
python -m benchmarks.run --out benchmarks/out --docs docs "$@"
exec python -m benchmarks.depth_bench --out benchmarks/out --docs docs
