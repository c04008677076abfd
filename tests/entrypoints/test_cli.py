"""The `vllm` console script: starts on a CPU install, and bad input fails cleanly.

Each case runs the real console script; bad configuration must end with exit
status 2 and a one-line message, no traceback. Every case spends most of its
time importing vLLM, so all of them start together (one module fixture) and
each test waits for its own.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from vllm_disagg import envs
from vllm_disagg.testing.server import cpu_test_env, vllm_executable
from vllm_disagg.testing.tiny_models import build_model

TIMEOUT_S = 300
BAD_STEP_SYNC_OPTIONS = {
    "lookahead-0": (
        '{"step_sync_lookahead": 0}',
        "step_sync_lookahead: 0 is not an integer in 1..1024",
    ),
    "timeout-not-a-number": (
        '{"step_sync_peer_timeout_s": "soon"}',
        "step_sync_peer_timeout_s: 'soon' is not a number of seconds",
    ),
    "misspelt": (
        '{"step_sync_lookahed": 4}',
        "step sync options are step_sync_lookahead",
    ),
}


def _run(args) -> subprocess.CompletedProcess:
    env = cpu_test_env()
    for name in (envs.VLLM_DISAGG_DP_SECRET, envs.VLLM_DISAGG_DP_SECRET_FILE):
        env.pop(name, None)
    return subprocess.run(
        args, capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )


@pytest.fixture(scope="module")
def cli(tiny_models, tmp_path_factory):
    """Every case started at once; ``cli[name]`` waits for that one's result."""
    tmp = tmp_path_factory.mktemp("cli")
    vllm = vllm_executable()
    mixtral = str(tiny_models["tiny-mixtral"])
    (tmp / "no-config").mkdir()
    other_version = (
        "import sys, vllm.version\n"
        "vllm.version.__version__ = '0.31.0'\n"
        "from vllm_disagg.entrypoints.cli.main import main\n"
        f"sys.argv = ['vllm', 'serve', {str(tmp)!r}]\n"
        "sys.exit(main())\n"
    )
    cases = {
        "version": [vllm, "--version"],
        "missing": [vllm, "serve", str(tmp / "no-such-model")],
        "no-config": [vllm, "serve", str(tmp / "no-config")],
        "head-dim": [vllm, "serve", str(build_model("tiny-llama", tmp, head_dim=16))],
        "ray": [
            vllm,
            "serve",
            mixtral,
            "--data-parallel-size",
            "2",
            "--distributed-executor-backend",
            "ray",
        ],
        "other-version": [sys.executable, "-c", other_version],
        # One rank of an external-LB group spanning hosts, without a DP secret.
        "dp-secret-missing": [
            vllm,
            "serve",
            mixtral,
            "--data-parallel-size",
            "2",
            "--data-parallel-rank",
            "1",
            "--data-parallel-address",
            "192.0.2.1",
        ],
        **{
            f"step-sync-{name}": [
                vllm,
                "serve",
                mixtral,
                "--data-parallel-size",
                "2",
                "--additional-config",
                options,
            ]
            for name, (options, _) in BAD_STEP_SYNC_OPTIONS.items()
        },
    }
    with ThreadPoolExecutor(4) as pool:  # more only thrash 2 cores
        yield CliRuns(
            tmp, {name: pool.submit(_run, args) for name, args in cases.items()}
        )


class CliRuns:
    def __init__(self, tmp: Path, futures: dict[str, Future]):
        self.tmp = tmp
        self._futures = futures

    def __getitem__(self, name: str) -> subprocess.CompletedProcess:
        return self._futures[name].result()


def _assert_clean_error(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr[-3000:]


def test_version_flag_works_on_this_install(cli):
    import vllm.version

    result = cli["version"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().startswith(vllm.version.__version__)


def test_missing_model_dir(cli):
    missing = cli.tmp / "no-such-model"
    _assert_clean_error(cli["missing"], str(missing), "no such file or directory")


def test_directory_without_config(cli):
    _assert_clean_error(cli["no-config"], "has no config.json")


def test_unsupported_head_dim_on_cpu(cli):
    _assert_clean_error(
        cli["head-dim"], "head size 16", "supported head sizes: 32, 48, 64"
    )


def test_ray_executor_refused_on_cpu(cli):
    """cpu-ray-dp gives CPU a Ray device key; Ray's executor still cannot
    start CPU workers, so startup-validation names the backend that can."""
    _assert_clean_error(
        cli["ray"],
        "--distributed-executor-backend ray does not run on the CPU platform",
        "use --distributed-executor-backend mp",
    )


@pytest.mark.parametrize("name", list(BAD_STEP_SYNC_OPTIONS))
def test_bad_step_sync_option(cli, name):
    _, expected = BAD_STEP_SYNC_OPTIONS[name]
    _assert_clean_error(cli[f"step-sync-{name}"], expected)


def test_refuses_other_vllm_version(cli):
    _assert_clean_error(cli["other-version"], "supports vLLM 0.32.0 only", "0.31.0")


def test_separate_dp_ranks_beyond_loopback_need_a_dp_secret(cli):
    """Step sync's group secret: ranks started separately, with a DP address
    beyond loopback, are refused before any engine starts, naming the variable."""
    _assert_clean_error(
        cli["dp-secret-missing"],
        f"set {envs.VLLM_DISAGG_DP_SECRET} (or {envs.VLLM_DISAGG_DP_SECRET_FILE})",
        "--data-parallel-address 192.0.2.1 is not a loopback address",
    )
