"""An engine core verifies the patches it uses, not the ones it never looks at.

Upstream 0.32.0's tests/v1/engine/test_engine_core_shutdown_signal.py replaces
``vllm.v1.engine.core.EngineCoreProc`` and ``DPEngineCoreProc`` with a stub
and calls ``EngineCoreProc.run_engine_core`` (with the plugin: this package's
wrapper, which loads and verifies the patch set) for a DP size 1, dense model
config. The stub is no ``StepSyncDPEngineCoreProc``, but such an engine core
never picks ``DPEngineCoreProc``: it must start, as it does upstream.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import vllm_disagg.patches as patches_pkg
from vllm_disagg import envs, plugin
from vllm_disagg.patches import PATCHES
from vllm_disagg.patches.v1.engine import core as core_patch

BY_NAME = {p.name: p for p in PATCHES}

# Upstream's situation, in a fresh interpreter with the patch set applied
# (as a spawned engine core has it): its stubs, then run_engine_core for
# several configs none of which runs DPEngineCoreProc.
_UPSTREAM_SHUTDOWN_SIGNAL_TEST = """
import logging, queue, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)  # the stub skips vLLM's
from vllm_disagg.patches import apply_all
applied = apply_all()
from vllm.v1.engine import core as core_module
from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState

class ParallelConfig:
    def __init__(self, dp_size):
        self.data_parallel_size = dp_size
        self.data_parallel_rank_local = 0
        self.data_parallel_index = 0
        self.data_parallel_rank = 0
        self.numa_bind = False
    def reconfigure_for_independent_dp_rank(self):
        pass

class VllmConfig:
    def __init__(self, dp_size, moe):
        self.parallel_config = ParallelConfig(dp_size)
        self.model_config = type("ModelConfig", (), {"is_moe": moe})()
        self.logging_config = None
        self.kv_transfer_config = None
        self.shutdown_timeout = 0

ran = []

class StubEngineCoreProc:
    def __init__(self, *args, **kwargs):
        self.shutdown_state = EngineShutdownState.RUNNING
        self.input_queue = queue.Queue()
        self.vllm_config = kwargs.get("vllm_config")
    def run_busy_loop(self):
        ran.append(self.vllm_config)
    def shutdown(self):
        pass
    def _send_engine_dead(self):
        pass
    def has_work(self):
        return False

class Signal:
    import signal as _s
    SIGTERM, SIGINT, SIG_DFL, Signals = _s.SIGTERM, _s.SIGINT, _s.SIG_DFL, _s.Signals
    def signal(self, signum, handler):
        pass

class SignalCallback:
    def __init__(self, callback):
        pass
    def stop(self):
        pass

nothing = lambda *a, **k: None
core_module.signal = Signal()
core_module.SignalCallback = SignalCallback
core_module.EngineCoreProc = StubEngineCoreProc
core_module.DPEngineCoreProc = StubEngineCoreProc
for name in ("configure_logging", "maybe_register_config_serialize_by_value",
             "set_process_title", "maybe_init_worker_tracer", "decorate_logs"):
    setattr(core_module, name, nothing)

# DP size 1 dense (upstream's test), DP size 1 MoE, a dense model's DP rank 1.
for dp_size, moe, dp_rank in ((1, False, 0), (1, True, 0), (2, False, 1)):
    config = VllmConfig(dp_size, moe)
    EngineCoreProc.run_engine_core(vllm_config=config, dp_rank=dp_rank)
assert len(ran) == 3, ran
print("OK", "step-sync-dp-engine" in applied)
"""


@pytest.mark.parametrize("disabled", [False, True], ids=["features-on", "features-off"])
def test_engine_core_starts_when_a_test_replaced_the_engine_classes(disabled):
    env = {k: v for k, v in os.environ.items() if k != envs.VLLM_DISAGG_DISABLE}
    if disabled:
        env[envs.VLLM_DISAGG_DISABLE] = "1"
    out = subprocess.run(
        [sys.executable, "-c", _UPSTREAM_SHUTDOWN_SIGNAL_TEST],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == f"OK {not disabled}"
    if not disabled:  # told, once per engine core, not raised
        told = [
            line
            for line in (out.stdout + out.stderr).splitlines()
            if "not used by this configuration, not verified: " in line
        ]
        assert len(told) == 3, out.stdout[-3000:]
        assert all(
            "replaced after the patch set: step-sync-dp-engine" in t for t in told
        )


def _config(dp_size, moe):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=dp_size),
        model_config=SimpleNamespace(is_moe=moe),
        logging_config=None,
    )


@pytest.mark.parametrize(
    "dp_size, moe, dp_rank, used",
    [
        (1, False, 0, False),
        (1, True, 0, False),
        (2, False, 0, False),
        (2, False, 1, False),
        (2, True, 0, True),
        (2, True, 1, True),
        (1, True, 1, True),  # upstream: a DP rank > 0 is data parallel too
    ],
)
def test_step_sync_classes_are_used_only_by_moe_dp_engine_cores(
    dp_size, moe, dp_rank, used
):
    for name in ("step-sync-dp-engine", "step-sync-ray-actor"):
        assert BY_NAME[name].is_used(_config(dp_size, moe), dp_rank) is used
    # Patches without a condition are used by every engine core.
    assert BY_NAME["engine-core-spawn"].is_used(_config(dp_size, moe), dp_rank)


def test_unknown_config_verifies_everything():
    assert all(p.is_used(None, 0) for p in PATCHES)


@pytest.fixture
def step_sync_applied(monkeypatch):
    """This process as load_patch_set sees it with only step sync's DP engine
    patch applied (register() is not run: no patch lands in the test process)."""
    import vllm.v1.engine.core as upstream_core

    from vllm_disagg.v1.engine.core import StepSyncDPEngineCoreProc

    monkeypatch.setattr(plugin, "register", lambda: None)
    monkeypatch.setattr(patches_pkg, "_applied", ["step-sync-dp-engine"])
    monkeypatch.setattr(upstream_core, "DPEngineCoreProc", StepSyncDPEngineCoreProc)
    return upstream_core


class ThirdPartyDPEngineCoreProc:
    """Another plugin's engine class, in place of step sync's."""


def test_moe_dp_engine_core_refuses_a_replaced_step_sync_engine(
    step_sync_applied, monkeypatch
):
    plugin.load_patch_set(_config(2, True), dp_rank=1)  # in place: starts
    monkeypatch.setattr(
        step_sync_applied, "DPEngineCoreProc", ThirdPartyDPEngineCoreProc
    )
    plugin.load_patch_set(_config(1, False), dp_rank=0)  # not used: starts
    with pytest.raises(RuntimeError) as refused:
        plugin.load_patch_set(_config(2, True), dp_rank=1)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        "vllm_disagg: engine core dp_rank=1 needs patches that are not in place: "
        "step-sync-dp-engine (vllm.v1.engine.core.DPEngineCoreProc is "
        f"{__name__}.ThirdPartyDPEngineCoreProc, not this package's)"
    ), message
    assert "VLLM_DISAGG_DISABLE=1" in message


def test_a_subclass_of_step_sync_engine_keeps_step_sync_in_place(
    step_sync_applied, monkeypatch
):
    from vllm_disagg.v1.engine.core import StepSyncDPEngineCoreProc

    class Extended(StepSyncDPEngineCoreProc):
        pass

    monkeypatch.setattr(step_sync_applied, "DPEngineCoreProc", Extended)
    assert core_patch.is_step_sync_applied()
    plugin.load_patch_set(_config(2, True), dp_rank=0)
