"""Start-up validation: upstream's options (an enabler) and this project's
step-sync options (a feature that adds its check through the enabler's hook).

The end-to-end behaviour (`vllm serve` exits 2 naming the key) is in
tests/entrypoints/test_cli.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from vllm_disagg import envs
from vllm_disagg.errors import ConfigError
from vllm_disagg.patches import PATCHES
from vllm_disagg.patches.engine import arg_utils, arg_utils_step_sync

BY_NAME = {p.name: p for p in PATCHES}


def _config(additional_config, dp_size=2, *, moe=True, fault_tolerance=False):
    return SimpleNamespace(
        model_config=SimpleNamespace(is_moe=moe),
        parallel_config=SimpleNamespace(
            data_parallel_size=dp_size,
            enable_fault_tolerance=fault_tolerance,
            # One `vllm serve --data-parallel-size N` on loopback.
            data_parallel_size_local=dp_size,
            data_parallel_backend="mp",
            local_engines_only=False,
            data_parallel_master_ip="127.0.0.1",
        ),
        additional_config=additional_config,
    )


@pytest.fixture(autouse=True)
def _no_launch_secret_left(monkeypatch):
    """The step-sync check hands engine cores a secret in this process's
    environment; it is gone after each test."""
    monkeypatch.setenv(envs.VLLM_DISAGG_DP_LAUNCH_SECRET, "")
    monkeypatch.delenv(envs.VLLM_DISAGG_DP_LAUNCH_SECRET)


def test_step_sync_options_are_a_feature_next_to_the_enabler():
    enabler, feature = BY_NAME["startup-validation"], BY_NAME["step-sync-options"]
    assert (enabler.kind, feature.kind) == ("enabler", "feature")
    assert (enabler.module, feature.module) == (
        arg_utils.__name__,
        arg_utils_step_sync.__name__,
    )
    assert PATCHES.index(enabler) < PATCHES.index(feature)


def test_the_always_on_enabler_imports_no_feature():
    """Features add their checks through the enabler's hooks; the enabler
    module, loaded alone, pulls in neither the P2P config nor step sync."""
    code = (
        "import sys\n"
        "import vllm_disagg.patches.engine.arg_utils\n"
        "print(sorted(m for m in sys.modules if 'p2p' in m or 'step_sync' in m))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "options, key",
    [
        ({"step_sync_lookahead": 0}, "step_sync_lookahead"),
        ({"step_sync_peer_timeout_s": "soon"}, "step_sync_peer_timeout_s"),
        ({"step_sync_lookahed": 4}, "step_sync_lookahed"),
    ],
)
def test_bad_step_sync_options_name_the_key(options, key):
    with pytest.raises(ConfigError, match=key):
        arg_utils_step_sync.check_step_sync_options(_config(options))


def test_good_or_absent_step_sync_options_pass():
    arg_utils_step_sync.check_step_sync_options(_config({"step_sync_lookahead": 4}))
    arg_utils_step_sync.check_step_sync_options(_config(None, dp_size=1))


def test_fault_tolerance_is_refused_for_moe_dp():
    """Upstream vLLM's fault-tolerance retry re-forms the DP group, not the step-sync
    group: refused at start-up, pointing at upstream's waves."""
    with pytest.raises(
        ConfigError,
        match=(
            r"step sync does not support "
            r"--enable-fault-tolerance.*VLLM_DISAGG_DISABLE=1"
        ),
    ):
        arg_utils_step_sync.check_step_sync_options(_config(None, fault_tolerance=True))


@pytest.mark.parametrize(
    "dp_size, moe", [(1, True), (2, False)], ids=["dp1-moe", "dp2-dense"]
)
def test_fault_tolerance_without_step_sync_passes(dp_size, moe):
    """Step sync runs only for MoE models with DP > 1; elsewhere fault
    tolerance is upstream's business."""
    config = _config(None, dp_size, moe=moe, fault_tolerance=True)
    arg_utils_step_sync.check_step_sync_options(config)


_APPLY = (
    "from vllm_disagg.patches import apply_all, verify_applied\n"
    "from vllm_disagg.patches.engine import arg_utils\n"
    "applied = apply_all()\n"
    "assert verify_applied() and all(verify_applied().values())\n"
    "print(sorted(applied))\n"
    "print([c.__name__ for c in arg_utils._feature_config_checks])\n"
)


@pytest.mark.parametrize("disabled", [False, True], ids=["features-on", "features-off"])
def test_feature_check_follows_the_feature_switch(disabled):
    """With VLLM_DISAGG_DISABLE=1 the enabler still wraps create_engine_config,
    but the wrapper runs no step-sync check."""
    env = {k: v for k, v in os.environ.items() if k != envs.VLLM_DISAGG_DISABLE}
    if disabled:
        env[envs.VLLM_DISAGG_DISABLE] = "1"
    out = subprocess.run(
        [sys.executable, "-c", _APPLY],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    applied, checks = out.stdout.strip().splitlines()[-2:]
    assert "'startup-validation'" in applied
    assert "'cpu-ray-dp'" in applied  # every enabler stays on
    assert ("'step-sync-options'" in applied) is not disabled
    assert checks == (
        "[]" if disabled else "['check_step_sync_options', 'check_p2p_config']"
    )


# --- the model-path check leaves what vLLM resolves without the filesystem alone

# Upstream 0.32.0's tests/engine/test_arg_utils.py
# (test_cloud_storage_uri_skips_get_model_path, ..._tokenizer_...) use these.
OBJECT_STORE_URIS = ["s3://bucket/model", "gs://bucket/model", "az://container/model"]


@pytest.mark.parametrize("uri", [*OBJECT_STORE_URIS, "S3://Bucket/org/model"])
def test_object_store_uris_are_not_local_paths(uri):
    """Decided by vLLM's own is_cloud_storage, as in upstream's __post_init__."""
    assert not arg_utils.looks_like_local_path(uri)
    arg_utils.check_model_path(uri)  # no ConfigError


@pytest.fixture
def patched_post_init(monkeypatch):
    """The startup-validation wrapper of __post_init__, called directly with
    upstream's __post_init__ and the features' fix-ups stubbed out: what the
    wrapper hands upstream, without loading the plugin into this process."""
    reached = []
    monkeypatch.setattr(arg_utils, "_upstream_post_init", reached.append)
    monkeypatch.setattr(arg_utils, "_feature_args_fixups", [])

    def post_init(**fields):
        args = SimpleNamespace(**{"tokenizer": None, **fields})
        arg_utils.__post_init__(args)
        return reached

    return post_init


@pytest.mark.parametrize("uri", OBJECT_STORE_URIS)
def test_post_init_leaves_object_store_models_to_upstream(uri, patched_post_init):
    reached = patched_post_init(model=uri)
    assert [args.model for args in reached] == [uri]


def test_post_init_leaves_object_store_tokenizers_to_upstream(patched_post_init):
    reached = patched_post_init(
        model="s3://bucket/model", tokenizer="s3://bucket/tokenizer"
    )
    assert [(a.model, a.tokenizer) for a in reached] == [
        ("s3://bucket/model", "s3://bucket/tokenizer")
    ]


def test_post_init_still_refuses_a_missing_local_model(tmp_path, patched_post_init):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError) as refused:
        patched_post_init(model=missing)
    assert str(refused.value) == f"--model {missing!r}: no such file or directory"
    # Refused before upstream runs; a Hub id still goes through.
    assert [a.model for a in patched_post_init(model="org/name")] == ["org/name"]


_UPSTREAM_CLOUD_TESTS = (
    "from vllm_disagg.patches import apply_all, verify_applied\n"
    "apply_all()\n"
    "assert verify_applied()['startup-validation']\n"
    "from vllm.engine.arg_utils import EngineArgs\n"
    f"for uri in {OBJECT_STORE_URIS!r}:\n"
    "    assert EngineArgs(model=uri).model == uri\n"
    "args = EngineArgs(model='s3://bucket/model', tokenizer='s3://bucket/tokenizer')\n"
    "assert (args.model, args.tokenizer) == "
    "('s3://bucket/model', 's3://bucket/tokenizer')\n"
    "print('OK')\n"
)


@pytest.mark.parametrize("disabled", [False, True], ids=["features-on", "features-off"])
def test_upstream_cloud_storage_tests_pass_with_the_plugin(disabled):
    """What upstream's two tests do (HF_HUB_OFFLINE, EngineArgs with object-store
    URIs), through the patched EngineArgs, with and without the features."""
    env = {k: v for k, v in os.environ.items() if k != envs.VLLM_DISAGG_DISABLE}
    env["HF_HUB_OFFLINE"] = "1"
    if disabled:
        env[envs.VLLM_DISAGG_DISABLE] = "1"
    out = subprocess.run(
        [sys.executable, "-c", _UPSTREAM_CLOUD_TESTS],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "OK"
