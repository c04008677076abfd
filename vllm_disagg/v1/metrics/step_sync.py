"""Step-sync metrics of every DP rank on the API server's ``/metrics``.

The counters live in the engine-core processes, the ``/metrics`` endpoint in
the API server process(es). Two cases, as vLLM itself has them:

* several API servers (``PROMETHEUS_MULTIPROC_DIR`` set before any process
  started): engine cores update ordinary prometheus_client metrics, which
  multiprocess mode writes to that directory, and every API server's
  ``/metrics`` reads them back;
* one API server: each engine core writes a small JSON snapshot of its
  counters to ``VLLM_DISAGG_METRICS_DIR`` (set by the ``vllm`` command
  before anything starts, :func:`command_metrics_dir`, inherited by every
  child) and a collector on the
  API server's registry reads the snapshots when scraped.

Either way engine cores publish at most every :data:`WRITE_INTERVAL_S`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vllm_disagg import envs
from vllm_disagg.errors import ConfigError
from vllm_disagg.logger import init_logger
from vllm_disagg.v1.metrics import read_json_files, write_json_atomically

logger = init_logger(__name__)

WRITE_INTERVAL_S = 0.5
PREFIX = "vllm_disagg:step_sync_"
# dp_group: the group's id (wire/groups.py, also in the router's /instances),
# the same on every rank of one group whether its ranks share an API server
# (internal launch) or each has its own ``vllm serve`` (one scrape target per
# rank): the label that lets rules compare the ranks of a group across targets.
LABELS = ("dp_rank", "dp_group")

# snapshot key -> (metric name without prefix, type, help)
METRICS: dict[str, tuple[str, str, str]] = {
    "forward_steps": (
        "forward_steps",
        "counter",
        "Real forward passes run by this DP rank.",
    ),
    "dummy_steps": (
        "dummy_steps",
        "counter",
        "Dummy forward passes run to match peers.",
    ),
    "requests_sent": (
        "requests_sent",
        "counter",
        "Step requests sent to the coordinator.",
    ),
    "grants_received": (
        "grants_received",
        "counter",
        "Grants received from the coordinator.",
    ),
    "grant_waits": (
        "grant_waits",
        "counter",
        "Waits (at most 20 ms each) for a grant this rank asked for: wake-ups of an "
        "idle group.",
    ),
    "malformed_messages": (
        "malformed_messages",
        "counter",
        "Malformed or foreign step-sync messages rejected by this rank.",
    ),
    "local_step": ("local_step", "gauge", "Forward passes (real + dummy) run so far."),
    "coord_step": ("coordinator_step", "gauge", "Latest step granted to every rank."),
    "coordinator_grants_sent": (
        "coordinator_grants_sent",
        "counter",
        "Group-state messages (grants, acknowledgements, heartbeats) sent by the "
        "coordinator (DP rank 0 only).",
    ),
    "coordinator_frames_received": (
        "coordinator_frames_received",
        "counter",
        "Frames the coordinator read, valid or not: with grants_sent, its message "
        "rate, which sets its CPU (DP rank 0 only).",
    ),
    "coordinator_requests_received": (
        "coordinator_requests_received",
        "counter",
        "Step requests received by the coordinator (DP rank 0 only).",
    ),
    "coordinator_malformed_messages": (
        "coordinator_malformed_messages",
        "counter",
        "Malformed or foreign messages rejected by the coordinator (DP rank 0 only).",
    ),
    "coordinator_unauthenticated_messages": (
        "coordinator_unauthenticated_messages",
        "counter",
        "Frames without a valid group MAC dropped by the coordinator (DP rank 0 only).",
    ),
    "coordinator_stale_messages": (
        "coordinator_stale_messages",
        "counter",
        "Replayed or out-of-date frames dropped by the coordinator (DP rank 0 only).",
    ),
    "resends": (
        "resends",
        "counter",
        "State messages re-sent because the coordinator had not acknowledged them yet.",
    ),
    "coordinator_pause_violations": (
        "coordinator_pause_violations",
        "counter",
        "Step requests from paused ranks (granted to avoid deadlock; a bug).",
    ),
    "start_dp_wave_received": (
        "start_dp_wave_received",
        "counter",
        "START_DP_WAVE messages that reached this engine (expected 0).",
    ),
    "wave_stamped_requests": (
        "wave_stamped_requests",
        "counter",
        "Requests that arrived carrying a DP wave number (expected 0).",
    ),
    "wave_outputs_sent": (
        "wave_outputs_sent",
        "counter",
        "Engine outputs carrying wave_complete/start_wave (expected 0).",
    ),
}


def ensure_metrics_dir() -> Path:
    """The snapshot directory of this process tree, created on first use
    (children inherit the environment variable)."""
    if path := envs.metrics_dir():
        return Path(path)
    return new_metrics_dir()


def new_metrics_dir() -> Path:
    """A fresh snapshot directory for the process tree rooted here, removed
    when this process exits (marked as created by this package)."""
    path = tempfile.mkdtemp(prefix="vllm-disagg-metrics-")
    envs.set_metrics_dir(path, created=True)
    owner = os.getpid()
    atexit.register(
        lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True)
    )
    return Path(path)


def command_metrics_dir() -> Path:
    """The directory of the process tree a ``vllm`` command roots, set before
    any API server or engine core starts.

    One chosen by whoever launched the command (``VLLM_DISAGG_METRICS_DIR``
    set by hand: the step-sync benchmark gives each server its own and reads
    the probe counts there) is used as it is, created if missing, and left in
    place. Otherwise a fresh one (:func:`new_metrics_dir`): in particular not
    one the patch set created in the launcher (a test runner that applied it
    in-process), which would make unrelated servers read each other's
    snapshots.
    """
    if chosen := envs.chosen_metrics_dir():
        path = Path(chosen)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"{envs.VLLM_DISAGG_METRICS_DIR}: cannot create {chosen!r} "
                f"({e.strerror})"
            ) from None
        return path
    return new_metrics_dir()


def prometheus_multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class _MultiprocessExporter:
    """Mirrors snapshots into prometheus_client metrics (multiprocess mode)."""

    def __init__(self, dp_rank: int, dp_group: str):
        from prometheus_client import Counter, Gauge

        self.labels = (str(dp_rank), dp_group)
        self.metrics = {}
        for key, (name, kind, doc) in METRICS.items():
            if kind == "counter":
                self.metrics[key] = Counter(PREFIX + name, doc, list(LABELS))
            else:
                self.metrics[key] = Gauge(
                    PREFIX + name, doc, list(LABELS), multiprocess_mode="livemax"
                )
        self.last: dict[str, int] = {}

    def update(self, data: dict[str, int]) -> None:
        for key, value in data.items():
            metric = self.metrics.get(key)
            if metric is None:
                continue
            child = metric.labels(*self.labels)
            if METRICS[key][1] == "counter":
                delta = value - self.last.get(key, 0)
                if delta > 0:
                    child.inc(delta)
            else:
                child.set(value)
        self.last = dict(data)


class StepSyncMetricsWriter:
    """Engine-core side: publishes this rank's counters, rate-limited."""

    def __init__(
        self,
        dp_rank: int,
        snapshot: Callable[[], dict[str, int]],
        dp_group: str = "",
    ):
        self.dp_rank = dp_rank
        self.dp_group = dp_group
        self._snapshot = snapshot
        self._exporter = (
            _MultiprocessExporter(dp_rank, dp_group)
            if prometheus_multiprocess()
            else None
        )
        directory = envs.metrics_dir()
        self._path = (
            Path(directory) / f"step_sync_dp{dp_rank}.json" if directory else None
        )
        self._next_write = 0.0
        self._last: dict[str, int] | None = None

    def maybe_write(self, force: bool = False) -> None:
        if self._path is None and self._exporter is None:
            return
        now = time.monotonic()
        if not force and now < self._next_write:
            return
        self._next_write = now + WRITE_INTERVAL_S
        data = self._snapshot()
        if data == self._last and not force:
            return
        self._last = data
        if self._exporter is not None:
            self._exporter.update(data)
            return
        try:
            write_json_atomically(
                self._path,
                {"dp_rank": self.dp_rank, "dp_group": self.dp_group, "stats": data},
            )
        except OSError as e:  # metrics must never take the engine down
            logger.warning("step sync metrics: cannot write %s: %s", self._path, e)

    def close(self) -> None:
        self.maybe_write(force=True)


class StepSyncCollector(Collector):
    """API-server side: turns the snapshots into Prometheus metrics."""

    def __init__(self, directory: Path):
        self.directory = directory

    def read_snapshots(self) -> dict[tuple[int, str], dict[str, int]]:
        """{(dp_rank, dp_group): stats} of every rank's snapshot."""
        snapshots: dict[tuple[int, str], dict[str, int]] = {}
        for doc in read_json_files(self.directory, "step_sync_dp*.json"):
            try:
                group = doc.get("dp_group", "")
                if not isinstance(group, str):
                    continue
                snapshots[(int(doc["dp_rank"]), group)] = {
                    k: int(v) for k, v in doc["stats"].items() if k in METRICS
                }
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a foreign file: skip it
        return snapshots

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        snapshots = self.read_snapshots()
        for key, (name, kind, doc) in METRICS.items():
            family_type = (
                CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            )
            family = family_type(PREFIX + name, doc, labels=list(LABELS))
            for (dp_rank, dp_group), stats in snapshots.items():
                if key in stats:
                    family.add_metric([str(dp_rank), dp_group], stats[key])
            yield family
