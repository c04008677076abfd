#!/usr/bin/env bash
# Set up the environment, build the tiny models, and run the main job:
# `vllm serve` with --data-parallel-size 2 on the tiny MoE model on CPU,
# a few completions printed, then the server stopped.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
exec "${VLLM_DISAGG_VENV:-.venv}/bin/python" \
    examples/online_serving/data_parallel_tiny_moe.py "$@"
