"""The step-sync DP engine core as a Ray actor (``--data-parallel-backend ray``).

With the Ray DP backend, ``CoreEngineActorManager`` (in the process that runs
``launch_core_engines``) looks up ``vllm.v1.engine.core.DPMoEEngineCoreActor``
and starts one Ray actor of that class per DP rank. Upstream's class subclasses
upstream's ``DPEngineCoreProc`` and its ``__init__`` calls the *module global*
``DPEngineCoreProc.__init__``, which the ``step-sync-dp-engine`` patch has
replaced: step sync's ``__init__`` then runs on an instance that is not a
``StepSyncDPEngineCoreProc`` and ``super()`` raises ``TypeError``.

:class:`StepSyncDPMoEEngineCoreActor` is upstream's actor with
:class:`~vllm_disagg.v1.engine.core.StepSyncDPEngineCoreProc` as its engine
class, and names the ``__init__`` it calls explicitly. The
``step-sync-ray-actor`` patch puts it in place of upstream's class.

A Ray actor runs in a Ray worker process, which starts neither through
``vllm serve`` nor through ``run_engine_core`` (the ``engine-core-spawn``
enabler): Ray unpickles the class by reference, which imports this module, and
``__init__`` applies and verifies the patch set before anything else runs,
as ``run_engine_core`` does for engine-core processes.
"""

from __future__ import annotations

from vllm.v1.engine.core import EngineCoreActorMixin

from vllm_disagg.plugin import load_patch_set
from vllm_disagg.v1.engine.core import StepSyncDPEngineCoreProc


class StepSyncDPMoEEngineCoreActor(EngineCoreActorMixin, StepSyncDPEngineCoreProc):
    """Ray actor for one MoE DP rank, kept in lockstep by step sync.

    Same constructor as upstream's ``DPMoEEngineCoreActor`` (the
    ``CoreEngineActorManager`` calls it with keyword arguments).
    """

    def __init__(
        self,
        vllm_config,
        local_client: bool,
        addresses,
        executor_class,
        log_stats: bool,
        dp_rank: int = 0,
        local_dp_rank: int = 0,
    ):
        load_patch_set(vllm_config, dp_rank, process="Ray engine actor")
        vllm_config.parallel_config.data_parallel_rank = dp_rank
        EngineCoreActorMixin.__init__(
            self, vllm_config, addresses, dp_rank, local_dp_rank
        )
        # Named explicitly (upstream resolves the module global at call time).
        StepSyncDPEngineCoreProc.__init__(
            self, vllm_config, local_client, "", executor_class, log_stats
        )


__all__ = ["StepSyncDPMoEEngineCoreActor"]
