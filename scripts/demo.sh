#!/usr/bin/env bash
# Runs the tensor-parallel demo on 2 CPU processes (gloo) with torchrun.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec torchrun --standalone --nproc-per-node 2 examples/tp_mlp_demo.py "$@"
