"""Step-synchronized DP (`--data-parallel-sync step`) in vLLM's metrics.

An engine core's step-sync counters travel to the front end in
`SchedulerStats.step_sync_stats` (`StepSyncStatsReporter`, in the engine
core), and `PrometheusStatLogger` exports them per engine (`StepSyncProm`):

- `vllm:step_sync_forward_steps_total`, `vllm:step_sync_dummy_steps_total`:
  real and dummy forward passes; per rank, their sum is the coordinator step
  once the group is idle.
- `vllm:step_sync_grant_waits_total`: waits for a step a rank asked for.
- `vllm:step_sync_rejected_frames_total`: frames dropped by the group's
  authentication and checks.
- `vllm:step_sync_wave_messages_total`: DP wave traffic; expected 0.
- `vllm:step_sync_local_step`, `vllm:step_sync_coordinator_step`.
"""

import time
from collections.abc import Callable
from dataclasses import asdict, fields
from typing import Any

import prometheus_client

from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import SchedulerStats, StepSyncStats
from vllm.v1.metrics.utils import create_metric_per_engine

# At most one stats-only report per this many seconds (and one before the
# engine core blocks for input); real steps' stats need no extra report.
REPORT_INTERVAL_S = 0.5

_GAUGES = ("local_step", "coordinator_step")
_COUNTERS = tuple(f.name for f in fields(StepSyncStats) if f.name not in _GAUGES)
# Snapshot keys of the protocol's counters summed into one metric.
_REJECTED = (
    "malformed_messages",
    "coordinator_malformed_messages",
    "coordinator_unauthenticated_messages",
    "coordinator_stale_messages",
)
_WAVES = ("start_dp_wave_received", "wave_stamped_requests", "wave_outputs_sent")


def stats_from_snapshot(snapshot: dict[str, int]) -> StepSyncStats:
    """Totals of an engine core's counters (its `_metrics_snapshot()`)."""
    return StepSyncStats(
        forward_steps=snapshot.get("forward_steps", 0),
        dummy_steps=snapshot.get("dummy_steps", 0),
        grant_waits=snapshot.get("grant_waits", 0),
        rejected_frames=sum(snapshot.get(k, 0) for k in _REJECTED),
        wave_messages=sum(snapshot.get(k, 0) for k in _WAVES),
        local_step=snapshot.get("local_step", 0),
        coordinator_step=snapshot.get("coord_step", 0),
    )


class StepSyncStatsReporter:
    """Engine-core side: sends the counters' increments in a stats-only
    output (to the first front end, as the scheduler's own stats go) when they
    changed, at most every `REPORT_INTERVAL_S` unless forced."""

    def __init__(self, engine_core: Any, snapshot: Callable[[], dict[str, int]]):
        self._engine_core = engine_core
        self._snapshot = snapshot
        self._next_report = 0.0
        self._reported = StepSyncStats()

    def maybe_report(self, force: bool = False) -> None:
        engine_core = self._engine_core
        if not engine_core.log_stats:
            return
        now = time.monotonic()
        if not force and now < self._next_report:
            return
        self._next_report = now + REPORT_INTERVAL_S
        totals = stats_from_snapshot(self._snapshot())
        if totals == self._reported:
            return
        increments = {
            name: getattr(totals, name) - getattr(self._reported, name)
            for name in _COUNTERS
        }
        self._reported = totals
        stats = engine_core.scheduler.make_stats() or SchedulerStats()
        stats.step_sync_stats = StepSyncStats(
            **increments, **{name: getattr(totals, name) for name in _GAUGES}
        )
        outputs = EngineCoreOutputs(scheduler_stats=stats)
        engine_core.output_queue.put_nowait((0, outputs))


_DOCS = {
    "forward_steps": "Real forward passes run by this DP rank (step sync).",
    "dummy_steps": "Dummy forward passes run to keep up with the other DP ranks.",
    "grant_waits": "Waits of this DP rank for a step it asked for (step sync).",
    "rejected_frames": "Step-sync frames dropped as malformed, unauthenticated "
    "or replayed.",
    "wave_messages": "DP wave messages that reached a step-sync engine (expected 0).",
    "local_step": "Forward passes (real and dummy) this DP rank ran so far.",
    "coordinator_step": "Steps granted to every DP rank so far (step sync).",
}


class StepSyncProm:
    """Front-end side: the step-sync metrics of every engine."""

    _counter_cls = prometheus_client.Counter
    _gauge_cls = prometheus_client.Gauge

    def __init__(
        self, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
    ):
        self.metrics: dict[str, dict[int, Any]] = {}
        for name in _COUNTERS:
            counter = self._counter_cls(
                name=f"vllm:step_sync_{name}",
                documentation=_DOCS[name],
                labelnames=labelnames,
            )
            self.metrics[name] = create_metric_per_engine(
                counter, per_engine_labelvalues
            )
        for name in _GAUGES:
            gauge = self._gauge_cls(
                name=f"vllm:step_sync_{name}",
                documentation=_DOCS[name],
                multiprocess_mode="mostrecent",
                labelnames=labelnames,
            )
            self.metrics[name] = create_metric_per_engine(gauge, per_engine_labelvalues)

    def observe(self, stats: StepSyncStats, engine_idx: int = 0) -> None:
        for name, value in asdict(stats).items():
            metric = self.metrics[name][engine_idx]
            if name in _GAUGES:
                metric.set(value)
            elif value:
                metric.inc(value)
