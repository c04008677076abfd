"""Step sync under every DP launch mode: the Ray DP backend's engine class.

With ``--data-parallel-backend ray``, upstream's ``CoreEngineActorManager``
starts one Ray actor per DP rank, of the class it finds as
``vllm.v1.engine.core.DPMoEEngineCoreActor``. These tests check, without Ray
or a model, that with the ``step-sync-ray-actor`` patch that class is a step
sync engine core, that its ``__init__`` runs step sync's ``__init__`` on
itself (upstream's calls the patched module global on an instance of the
wrong class: ``TypeError``), and that a Ray worker process can load it by
reference and gets the patch set applied.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import vllm.v1.engine.core as upstream_core
from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreActorMixin

from vllm_disagg import envs
from vllm_disagg.patches import PATCHES
from vllm_disagg.patches.v1.engine import core as core_patches
from vllm_disagg.v1.engine import core_actor
from vllm_disagg.v1.engine.core import StepSyncDPEngineCoreProc
from vllm_disagg.v1.engine.core_actor import StepSyncDPMoEEngineCoreActor

UPSTREAM_ACTOR = upstream_core.DPMoEEngineCoreActor


@pytest.fixture
def ray_actor_patch():
    """Apply step-sync-ray-actor in this process for one test, then undo it."""
    saved = upstream_core.DPMoEEngineCoreActor
    core_patches.apply_ray_actor()
    yield
    upstream_core.DPMoEEngineCoreActor = saved


def test_registry_entry_names_the_patch_functions():
    (patch,) = [p for p in PATCHES if p.name == "step-sync-ray-actor"]
    assert patch.kind == "feature"
    assert patch.module == core_patches.__name__
    assert getattr(core_patches, patch.apply_fn) is core_patches.apply_ray_actor
    assert getattr(core_patches, patch.check_fn) is core_patches.is_ray_actor_applied


def test_apply_replaces_the_actor_class(ray_actor_patch):
    assert core_patches.is_ray_actor_applied()
    actor = upstream_core.DPMoEEngineCoreActor
    assert actor is StepSyncDPMoEEngineCoreActor
    assert issubclass(actor, StepSyncDPEngineCoreProc)
    assert issubclass(actor, EngineCoreActorMixin)
    assert not issubclass(actor, UPSTREAM_ACTOR)


def test_actor_mro_keeps_the_actor_mixin_and_step_sync_overrides():
    mro = StepSyncDPMoEEngineCoreActor.__mro__
    assert mro[1:4] == (
        EngineCoreActorMixin,
        StepSyncDPEngineCoreProc,
        DPEngineCoreProc,
    )
    cls = StepSyncDPMoEEngineCoreActor
    # The mixin's Ray-specific pieces (no ZMQ handshake, run() entry) ...
    assert cls._perform_handshakes is EngineCoreActorMixin._perform_handshakes
    assert cls.run is EngineCoreActorMixin.run
    assert cls.wait_for_init is EngineCoreActorMixin.wait_for_init
    # ... and step sync's busy loop, set-up and request handling.
    for name in ("run_busy_loop", "_init_data_parallel", "add_request", "shutdown"):
        assert getattr(cls, name) is getattr(StepSyncDPEngineCoreProc, name), name


class _ReachedUpstreamInit(Exception):
    pass


def _vllm_config(dp_size: int = 2):
    parallel = SimpleNamespace(
        enable_elastic_ep=False,
        data_parallel_size=dp_size,
        data_parallel_size_local=dp_size,
        data_parallel_backend="ray",
        local_engines_only=False,
        data_parallel_master_ip="127.0.0.1",
        data_parallel_rank=0,
    )
    return SimpleNamespace(parallel_config=parallel, additional_config={})


def test_actor_init_runs_step_sync_init_on_itself(monkeypatch, ray_actor_patch):
    """Construct the actor as CoreEngineActorManager does (keyword arguments),
    with the mixin and upstream's DPEngineCoreProc.__init__ replaced by
    recorders: step sync's __init__ must run on the instance and reach the
    upstream base through super() (upstream's actor class gets TypeError)."""
    calls = []

    def load_patch_set(config, dp_rank, process):
        calls.append(("patches", dp_rank))

    monkeypatch.setattr(core_actor, "load_patch_set", load_patch_set)
    # What the launcher hands every actor (with the other VLLM_* variables).
    monkeypatch.setenv(envs.VLLM_DISAGG_DP_LAUNCH_SECRET, "ab" * 32)

    def mixin_init(self, vllm_config, addresses, dp_rank, local_dp_rank):
        calls.append(("mixin", addresses, dp_rank, local_dp_rank))

    def upstream_dp_init(self, vllm_config, *args, **kwargs):
        calls.append(("upstream", type(self), args, kwargs))
        raise _ReachedUpstreamInit

    monkeypatch.setattr(EngineCoreActorMixin, "__init__", mixin_init)
    monkeypatch.setattr(DPEngineCoreProc, "__init__", upstream_dp_init)

    actor_class = upstream_core.DPMoEEngineCoreActor
    config = _vllm_config()
    executor = object()
    with pytest.raises(_ReachedUpstreamInit):
        actor_class(
            vllm_config=config,
            executor_class=executor,
            log_stats=False,
            local_client=True,
            addresses="ADDRS",
            dp_rank=1,
            local_dp_rank=1,
        )
    assert calls == [
        ("patches", 1),
        ("mixin", "ADDRS", 1, 1),
        ("upstream", StepSyncDPMoEEngineCoreActor, (True, "", executor, False), {}),
    ]
    assert config.parallel_config.data_parallel_rank == 1


def test_actor_init_refuses_elastic_ep_with_a_message(monkeypatch):
    monkeypatch.setattr(core_actor, "load_patch_set", lambda config, dp_rank, **_: None)
    monkeypatch.setattr(EngineCoreActorMixin, "__init__", lambda self, *a: None)
    config = _vllm_config()
    config.parallel_config.enable_elastic_ep = True
    with pytest.raises(Exception, match=r"(?i)elastic"):
        StepSyncDPMoEEngineCoreActor(config, True, None, object(), False, dp_rank=0)


def _fake_ray(monkeypatch, captured: list):
    """Just enough of the ``ray`` package for CoreEngineActorManager to reach
    ``ray.remote(actor_class)``, which records the class and stops."""

    class Stop(Exception):
        pass

    def remote(actor_class):
        captured.append(actor_class)
        raise Stop

    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: True
    ray.remote = remote
    runtime_env = types.ModuleType("ray.runtime_env")
    runtime_env.RuntimeEnv = lambda **kwargs: kwargs
    util = types.ModuleType("ray.util")
    strategies = types.ModuleType("ray.util.scheduling_strategies")
    strategies.PlacementGroupSchedulingStrategy = lambda **kwargs: kwargs
    ray.runtime_env, ray.util, util.scheduling_strategies = (
        runtime_env,
        util,
        strategies,
    )
    for name, module in {
        "ray": ray,
        "ray.runtime_env": runtime_env,
        "ray.util": util,
        "ray.util.scheduling_strategies": strategies,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    return Stop


def test_upstream_ray_launch_path_starts_the_step_sync_actor(
    monkeypatch, ray_actor_patch
):
    """CoreEngineActorManager (launch_core_engines, --data-parallel-backend
    ray) hands the step-sync actor class to ray.remote."""
    from vllm.v1.engine.utils import CoreEngineActorManager

    captured: list[type] = []
    stop = _fake_ray(monkeypatch, captured)
    parallel = SimpleNamespace(
        data_parallel_size=2,
        data_parallel_size_local=2,
        world_size=1,
        enable_elastic_ep=False,
        placement_group=None,
    )
    config = SimpleNamespace(
        parallel_config=parallel,
        model_config=SimpleNamespace(is_moe=True),
        instance_id="test",
        kv_transfer_config=None,
    )
    with pytest.raises(stop):
        CoreEngineActorManager(
            vllm_config=config,
            addresses=None,
            executor_class=object,
            log_stats=False,
            placement_groups=[object(), object()],
            local_dp_ranks=[0, 1],
        )
    assert captured == [StepSyncDPMoEEngineCoreActor]


def test_actor_class_pickles_by_reference():
    """Ray ships the actor class to its worker process with cloudpickle: by
    reference, so the worker imports this package's module."""
    import cloudpickle

    for dumps in (pickle.dumps, cloudpickle.dumps):
        payload = dumps(StepSyncDPMoEEngineCoreActor)
        assert b"vllm_disagg.v1.engine.core_actor" in payload
        assert pickle.loads(payload) is StepSyncDPMoEEngineCoreActor


def test_fresh_worker_process_loads_the_actor_and_the_patch_set():
    """What a Ray worker does: unpickle the class in a fresh interpreter (no
    patches applied yet), then the actor's first step applies them all."""
    code = (
        "import pickle, sys\n"
        "cls = pickle.loads(sys.stdin.buffer.read())\n"
        "import vllm.v1.engine.core as core\n"
        "assert core.DPMoEEngineCoreActor is not cls  # nothing applied yet\n"
        "from vllm_disagg.plugin import load_patch_set\n"
        "load_patch_set(None, dp_rank=1)\n"
        "from vllm_disagg.v1.engine.core import StepSyncDPEngineCoreProc\n"
        "assert core.DPMoEEngineCoreActor is cls, core.DPMoEEngineCoreActor\n"
        "assert core.DPEngineCoreProc is StepSyncDPEngineCoreProc\n"
        "print('OK', cls.__module__, cls.__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(StepSyncDPMoEEngineCoreActor),
        capture_output=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-3000:]
    assert (
        b"OK vllm_disagg.v1.engine.core_actor StepSyncDPMoEEngineCoreActor"
        in out.stdout
    )
