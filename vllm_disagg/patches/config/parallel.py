"""Patch (probe): count the blocking DP collectives of the engine busy loop.

Upstream: ``vllm.config.parallel.ParallelConfig.sync_dp_state`` and
``has_unfinished_dp``, the gloo all-reduces upstream's ``DPEngineCoreProc``
makes every ``dp_sync_interval`` steps (and on resume). Wrapped to count
calls for the benchmark; only applied with ``VLLM_DISAGG_PROBE=1``.
"""

from __future__ import annotations

import functools

from vllm.config.parallel import ParallelConfig

from vllm_disagg.v1.metrics.probe import PROBE

_NAMES = ("sync_dp_state", "has_unfinished_dp")
_upstream = {name: ParallelConfig.__dict__[name].__func__ for name in _NAMES}


def _counting(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        PROBE.count("blocking_collectives")
        return fn(*args, **kwargs)

    wrapper.__vllm_disagg_probe__ = True
    return wrapper


def apply() -> None:
    for name, fn in _upstream.items():
        setattr(ParallelConfig, name, staticmethod(_counting(fn)))


def is_applied() -> bool:
    return all(
        getattr(ParallelConfig.__dict__[name].__func__, "__vllm_disagg_probe__", False)
        for name in _NAMES
    )
