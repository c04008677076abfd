"""The `vllm` console script: starts on a CPU install, and bad input fails cleanly.

Each case runs the real console script; bad configuration must end with exit
status 2 and a one-line message, no traceback.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_disagg.testing.server import cpu_test_env, vllm_executable
from vllm_disagg.testing.tiny_models import build_model


def _run(args, timeout=180, **kwargs):
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=cpu_test_env(), **kwargs
    )


def _assert_clean_error(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr[-3000:]


def test_version_flag_works_on_this_install():
    import vllm.version

    result = _run([vllm_executable(), "--version"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().startswith(vllm.version.__version__)


def test_missing_model_dir(tmp_path):
    missing = tmp_path / "no-such-model"
    result = _run([vllm_executable(), "serve", str(missing)])
    _assert_clean_error(result, str(missing), "no such file or directory")


def test_directory_without_config(tmp_path):
    result = _run([vllm_executable(), "serve", str(tmp_path)])
    _assert_clean_error(result, "has no config.json")


def test_unsupported_head_dim_on_cpu(tmp_path):
    model = build_model("tiny-llama", tmp_path, head_dim=16)
    result = _run([vllm_executable(), "serve", str(model)])
    _assert_clean_error(result, "head size 16", "supported head sizes: 32, 64")


def test_ray_executor_refused_on_cpu(tiny_models):
    """cpu-ray-dp gives CPU a Ray device key; Ray's executor still cannot
    start CPU workers, so startup-validation names the backend that can."""
    model = tiny_models["tiny-mixtral"]
    args = ["serve", str(model), "--data-parallel-size", "2"]
    result = _run([vllm_executable(), *args, "--distributed-executor-backend", "ray"])
    _assert_clean_error(
        result, "--distributed-executor-backend ray does not run on the CPU platform",
        "use --distributed-executor-backend mp",
    )


@pytest.mark.parametrize(
    "options, expected",
    [
        ('{"step_sync_lookahead": 0}', "step_sync_lookahead must be an integer in [1, 1024]"),
        ('{"step_sync_peer_timeout_s": "soon"}', "step_sync_peer_timeout_s must be a number"),
        ('{"step_sync_lookahed": 4}', "step sync options are step_sync_lookahead"),
    ],
)
def test_bad_step_sync_option(tiny_models, options, expected):
    model = tiny_models["tiny-mixtral"]
    args = ["serve", str(model), "--data-parallel-size", "2", "--additional-config", options]
    result = _run([vllm_executable(), *args])
    _assert_clean_error(result, expected)


def test_refuses_other_vllm_version(tmp_path):
    code = (
        "import sys, vllm.version\n"
        "vllm.version.__version__ = '0.31.0'\n"
        "from vllm_disagg.entrypoints.cli.main import main\n"
        f"sys.argv = ['vllm', 'serve', {str(tmp_path)!r}]\n"
        "sys.exit(main())\n"
    )
    result = _run([sys.executable, "-c", code])
    _assert_clean_error(result, "supports vLLM 0.32.0 only", "0.31.0")
