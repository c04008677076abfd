"""Patch: make spawned engine-core processes load the patch set first.

Upstream: ``vllm.v1.engine.core.EngineCoreProc.run_engine_core`` is the
``multiprocessing`` target of every engine-core process. Under the ``spawn``
start method the child is a fresh interpreter; it only loads general plugins
inside ``EngineCore.__init__``, after ``run_engine_core`` has already picked
the engine class (``DPEngineCoreProc`` or ``EngineCoreProc``). Replacing the
target with a function of this package means unpickling the target imports
``vllm_disagg`` in the child, and the wrapper applies every patch before the
upstream body runs.
"""

from __future__ import annotations

import os

from vllm.logger import configure_logging_if_needed
from vllm.v1.engine.core import EngineCoreProc

from vllm_disagg.logger import init_logger

logger = init_logger(__name__)

_upstream_run_engine_core = EngineCoreProc.__dict__["run_engine_core"].__func__


def run_engine_core(*args, dp_rank: int = 0, local_dp_rank: int = 0, **kwargs):
    """Engine-core process entry: apply the patch set, then run upstream's."""
    import vllm_disagg
    from vllm_disagg.patches import verify_applied

    # Upstream configures logging first thing too; do it before our own line.
    if logging_config := getattr(kwargs.get("vllm_config"), "logging_config", None):
        configure_logging_if_needed(logging_config)
    vllm_disagg.register()
    status = verify_applied()
    missing = [name for name, ok in status.items() if not ok]
    if missing:
        raise RuntimeError(f"vllm_disagg patches not in place in engine core: {missing}")
    logger.info(
        "vllm_disagg: engine core dp_rank=%d pid=%d verified patches: %s",
        dp_rank,
        os.getpid(),
        ", ".join(status),
    )
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
    import vllm.v1.engine.core as upstream_core

    from vllm_disagg.v1.engine.core import StepSyncDPEngineCoreProc

    return upstream_core.DPEngineCoreProc is StepSyncDPEngineCoreProc
