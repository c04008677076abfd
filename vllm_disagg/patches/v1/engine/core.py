"""Patches of ``vllm/v1/engine/core.py``: four registry entries.

* ``engine-core-spawn`` (enabler): spawned engine cores load the patch set
  first (below);
* ``step-sync-dp-engine`` (feature): ``DPEngineCoreProc`` becomes
  :class:`vllm_disagg.v1.engine.core.StepSyncDPEngineCoreProc`;
* ``step-sync-ray-actor`` (feature): ``DPMoEEngineCoreActor`` (the Ray DP
  backend's engine class) becomes
  :class:`vllm_disagg.v1.engine.core_actor.StepSyncDPMoEEngineCoreActor`;
* ``forward-pass-probe`` (probe): counts real and dummy passes for the
  benchmark.

engine-core-spawn:

Upstream: ``vllm.v1.engine.core.EngineCoreProc.run_engine_core`` is the
``multiprocessing`` target of every engine-core process. Under the ``spawn``
start method the child is a fresh interpreter; it only loads general plugins
inside ``EngineCore.__init__``, after ``run_engine_core`` has already picked
the engine class (``DPEngineCoreProc`` or ``EngineCoreProc``). Replacing the
target with a function of this package means unpickling the target imports
``vllm_disagg`` in the child, and the wrapper applies every patch
(:func:`vllm_disagg.plugin.load_patch_set`) before the upstream body runs.
"""

from __future__ import annotations

from vllm.v1.engine.core import EngineCore, EngineCoreProc

from vllm_disagg.plugin import load_patch_set
from vllm_disagg.v1.metrics.probe import PROBE

_upstream_run_engine_core = EngineCoreProc.__dict__["run_engine_core"].__func__


def run_engine_core(*args, dp_rank: int = 0, local_dp_rank: int = 0, **kwargs):
    """Engine-core process entry: apply the patch set, then run upstream's."""
    load_patch_set(kwargs.get("vllm_config"), dp_rank)
    return _upstream_run_engine_core(
        *args, dp_rank=dp_rank, local_dp_rank=local_dp_rank, **kwargs
    )


def apply() -> None:
    EngineCoreProc.run_engine_core = staticmethod(run_engine_core)


def is_applied() -> bool:
    return EngineCoreProc.__dict__["run_engine_core"].__func__ is run_engine_core


# --- step-sync-dp-engine (feature) ---


def apply_step_sync() -> None:
    import vllm.v1.engine.core as upstream_core

    from vllm_disagg.v1.engine.core import StepSyncDPEngineCoreProc

    upstream_core.DPEngineCoreProc = StepSyncDPEngineCoreProc


def is_step_sync_applied() -> bool:
    """Step sync's class, or a subclass of it someone put there after us."""
    import vllm.v1.engine.core as upstream_core

    from vllm_disagg.v1.engine.core import StepSyncDPEngineCoreProc

    found = upstream_core.DPEngineCoreProc
    return isinstance(found, type) and issubclass(found, StepSyncDPEngineCoreProc)


def is_step_sync_used(vllm_config, dp_rank: int) -> bool:
    """Whether an engine core with this configuration runs step sync's engine
    class: upstream's run_engine_core picks ``DPEngineCoreProc`` only for an
    MoE model with data parallelism (DP size > 1 or a DP rank > 0); every other
    engine core (DP size 1, or a dense model, whose DP ranks are independent)
    is an ``EngineCoreProc`` and never looks at step sync's classes. Shared by
    ``step-sync-ray-actor``, the same engine as a Ray actor."""
    parallel_config = vllm_config.parallel_config
    data_parallel = parallel_config.data_parallel_size > 1 or dp_rank > 0
    return data_parallel and bool(getattr(vllm_config.model_config, "is_moe", False))


# --- step-sync-ray-actor (feature) ---


def apply_ray_actor() -> None:
    import vllm.v1.engine.core as upstream_core

    from vllm_disagg.v1.engine.core_actor import StepSyncDPMoEEngineCoreActor

    upstream_core.DPMoEEngineCoreActor = StepSyncDPMoEEngineCoreActor


def is_ray_actor_applied() -> bool:
    import vllm.v1.engine.core as upstream_core

    from vllm_disagg.v1.engine.core_actor import StepSyncDPMoEEngineCoreActor

    return upstream_core.DPMoEEngineCoreActor is StepSyncDPMoEEngineCoreActor


# --- forward-pass-probe (probe, benchmarks only) ---

_upstream_post_step = EngineCore.post_step
_upstream_execute_dummy_batch = EngineCore.execute_dummy_batch


def _dp_rank(engine) -> int:
    return engine.vllm_config.parallel_config.data_parallel_rank


def _probed_post_step(self, model_executed: bool) -> None:
    if model_executed:
        PROBE.count("real_passes", _dp_rank(self))
    return _upstream_post_step(self, model_executed)


def _probed_execute_dummy_batch(self):
    PROBE.count("dummy_passes", _dp_rank(self))
    return _upstream_execute_dummy_batch(self)


def apply_probe() -> None:
    EngineCore.post_step = _probed_post_step
    EngineCore.execute_dummy_batch = _probed_execute_dummy_batch


def is_probe_applied() -> bool:
    return (
        EngineCore.post_step is _probed_post_step
        and EngineCore.execute_dummy_batch is _probed_execute_dummy_batch
    )
