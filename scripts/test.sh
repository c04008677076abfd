#!/usr/bin/env bash
# Set up the environment (scripts/bootstrap.sh), run the lint and format
# checks (pre-commit) and the whole test suite.
# Extra arguments go to pytest, e.g.:  bash scripts/test.sh -m "not e2e"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
venv="${VLLM_DISAGG_VENV:-.venv}"
# Lint and format (.pre-commit-config.yaml: local hooks, the venv's ruff).
if git rev-parse --git-dir >/dev/null 2>&1; then
    PATH="${venv}/bin:${PATH}" PRE_COMMIT_HOME="${venv}/.pre-commit" \
        "${venv}/bin/pre-commit" run --all-files --show-diff-on-failure
fi
exec "${venv}/bin/python" -m pytest tests "$@"
