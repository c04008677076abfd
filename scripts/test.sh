#!/usr/bin/env bash
# Set up the environment (scripts/bootstrap.sh) and run the whole test suite.
# Extra arguments go to pytest, e.g.:  bash scripts/test.sh -m "not e2e"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
exec "${VLLM_DISAGG_VENV:-.venv}/bin/python" -m pytest tests "$@"
