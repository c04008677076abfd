"""Patch: show every DP rank's step-sync metrics on ``/metrics``.

Upstream: ``vllm.entrypoints.serve.instrumentator.metrics.get_prometheus_registry``
(the name ``attach_router`` calls to get the registry ``/metrics`` serves).
With one API server the wrapper registers a
:class:`vllm_disagg.v1.metrics.step_sync.StepSyncCollector` on that registry;
with several, engine cores already write prometheus multiprocess files and
the wrapper changes nothing.
"""

from __future__ import annotations

import vllm.entrypoints.serve.instrumentator.metrics as upstream

from vllm_disagg.v1.metrics.step_sync import (
    StepSyncCollector,
    ensure_metrics_dir,
    prometheus_multiprocess,
)

_upstream_get_registry = upstream.get_prometheus_registry
_registered_on: set[int] = set()


def get_prometheus_registry():
    registry = _upstream_get_registry()
    if prometheus_multiprocess():
        # Engine cores write prometheus multiprocess files themselves, and
        # the instrumentator reads that directory with a registry of its own.
        return registry
    if id(registry) not in _registered_on:
        registry.register(StepSyncCollector(ensure_metrics_dir()))
        _registered_on.add(id(registry))
    return registry


def apply() -> None:
    # Engine cores inherit the directory from the process that starts them.
    ensure_metrics_dir()
    upstream.get_prometheus_registry = get_prometheus_registry


def is_applied() -> bool:
    return upstream.get_prometheus_registry is get_prometheus_registry
