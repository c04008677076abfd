#!/usr/bin/env bash
# Set up the environment, build the tiny models, and run the main job on CPU:
# the xPyD router + 1 prefill instance + 1 decode instance running DP=2 (one
# `vllm serve` per rank, step sync between them) on the tiny MoE model;
# completions, a streamed completion and a chat through the router, each
# printed next to a colocated run, then everything shut down.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
exec "${VLLM_DISAGG_VENV:-.venv}/bin/python" \
    examples/online_serving/disaggregated_serving_p2p_nccl_xpyd/tiny_xpyd_demo.py "$@"
