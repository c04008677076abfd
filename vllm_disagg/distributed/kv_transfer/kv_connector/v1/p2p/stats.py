"""Connector stats and Prometheus metrics, through vLLM's connector stats hooks.

The worker's engine threads record into a :class:`P2pStatsRecorder`; each step
the worker hands vLLM a :class:`P2pKVConnectorStats` snapshot
(``get_kv_connector_stats``), vLLM ships it to the API server, aggregates it
and calls :class:`P2pPromMetrics.observe`, which puts it on ``/metrics`` as
``vllm:p2p_*`` series.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# counters: name -> help text (all are summed over an interval)
COUNTERS = {
    "bytes_sent": "KV bytes sent to peers",
    "bytes_received": "KV bytes received from peers",
    "blocks_sent": "KV blocks sent to peers",
    "blocks_received": "KV blocks received from peers",
    "failed_sends": "KV sends that failed or that no peer took",
    "failed_loads": "KV loads that failed or timed out (recomputed locally)",
    "spills": "received transfers stored in the host tensor pool (receive buffer full)",
    "dropped": "offered transfers refused for lack of room (recomputed locally)",
    "unclaimed_evicted": "received transfers no request had claimed, freed to make "
    "room for a new one (a request that claims one later is recomputed)",
    "rejected_messages": (
        "control-plane messages rejected (malformed, unauthenticated, unknown)"
    ),
    "refused_peers": "requests whose named peers no grant or allowed_peers vouched for "
    "(computed locally)",
    "digest_mismatches": "offered KV whose prompt digest differed from the request's "
    "(refused; recomputed locally)",
    "checksum_mismatches": "received KV whose block checksums (kv_checksum) differed "
    "from the sender's (discarded; recomputed locally)",
}
# gauges: last value wins
GAUGES = {
    "buffer_bytes": "bytes of the receive buffer in use",
    "pool_bytes": "bytes of the host tensor pool in use",
}
# observations (seconds per transfer)
HISTOGRAMS = {
    "send_seconds": "time from offer to last byte sent, per transfer",
    "recv_seconds": "time from first to last byte received, per transfer",
}
# observations (bytes per second per transfer: its bytes over the time above).
# None of the peers' connectors publishes a rate per transfer; a counter of
# bytes over time averages one slow transfer away among fast ones.
RATE_HISTOGRAMS = {
    "send_rate_bytes_per_second": "achieved rate of one completed send: its KV bytes "
    "over send_seconds",
    "recv_rate_bytes_per_second": "achieved rate of one completed receive: its KV "
    "bytes over recv_seconds",
}
# 1 MB/s (a stalled or starved link) to 100 GB/s (NVLink-class), about 2-2.5x apart.
RATE_BUCKETS = [
    1e6, 1e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2e9, 5e9, 1e10, 2.5e10, 5e10, 1e11,
]  # fmt: skip
SECONDS_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
ALL_HISTOGRAMS = {**HISTOGRAMS, **RATE_HISTOGRAMS}


def _rate(nbytes: int, seconds: float) -> float | None:
    """Bytes per second of one transfer; None when there is nothing to divide."""
    return nbytes / seconds if nbytes > 0 and seconds > 0 else None


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
    data.update(dict.fromkeys(GAUGES, -1))  # -1: no observation this interval
    data.update({name: [] for name in ALL_HISTOGRAMS})
    return data


@dataclass
class P2pKVConnectorStats(KVConnectorStats):
    """A serialisable interval of connector stats (plain dict of numbers and lists)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key in COUNTERS:
                self.data[key] = self.data.get(key, 0) + value
            elif key in GAUGES:
                if value >= 0:
                    self.data[key] = value
            elif key in ALL_HISTOGRAMS:
                self.data.setdefault(key, []).extend(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTERS}
        for key in ALL_HISTOGRAMS:
            values = self.data.get(key, [])
            digits = 4 if key in HISTOGRAMS else None
            out[f"avg_{key}"] = (
                round(sum(values) / len(values), digits) if values else 0
            )
        return out

    def is_empty(self) -> bool:
        return (
            not any(self.data.get(k, 0) for k in COUNTERS)
            and not any(self.data.get(k) for k in ALL_HISTOGRAMS)
            and all(self.data.get(k, -1) < 0 for k in GAUGES)
        )


class P2pStatsRecorder:
    """Thread-safe accumulation by the engine's threads; drained once per step."""

    def __init__(self):
        self._lock = threading.Lock()
        self._data = _empty()

    def _add(self, **counts: int) -> None:
        with self._lock:
            for key, n in counts.items():
                self._data[key] += n

    def record_send(self, nbytes: int, nblocks: int, seconds: float) -> None:
        with self._lock:
            self._data["bytes_sent"] += nbytes
            self._data["blocks_sent"] += nblocks
            self._data["send_seconds"].append(seconds)
            rate = _rate(nbytes, seconds)
            if rate is not None:
                self._data["send_rate_bytes_per_second"].append(rate)

    def record_recv(self, nbytes: int, nblocks: int, seconds: float) -> None:
        with self._lock:
            self._data["bytes_received"] += nbytes
            self._data["blocks_received"] += nblocks
            self._data["recv_seconds"].append(seconds)
            rate = _rate(nbytes, seconds)
            if rate is not None:
                self._data["recv_rate_bytes_per_second"].append(rate)

    def record_failed_send(self) -> None:
        self._add(failed_sends=1)

    def record_failed_load(self) -> None:
        self._add(failed_loads=1)

    def record_spill(self) -> None:
        self._add(spills=1)

    def record_dropped(self) -> None:
        self._add(dropped=1)

    def record_unclaimed_evicted(self) -> None:
        self._add(unclaimed_evicted=1)

    def record_rejected(self, kind: str) -> None:
        self._add(rejected_messages=1)

    def record_refused_peers(self) -> None:
        self._add(refused_peers=1)

    def record_digest_mismatch(self) -> None:
        self._add(digest_mismatches=1)

    def record_checksum_mismatch(self) -> None:
        self._add(checksum_mismatches=1)

    def set_occupancy(self, buffer_bytes: int, pool_bytes: int) -> None:
        with self._lock:
            self._data["buffer_bytes"] = buffer_bytes
            self._data["pool_bytes"] = pool_bytes

    def take(self) -> P2pKVConnectorStats | None:
        """The interval since the last call, or None when nothing happened."""
        with self._lock:
            data, self._data = self._data, _empty()
        stats = P2pKVConnectorStats(data=copy.deepcopy(data))
        return None if stats.is_empty() else stats


class P2pPromMetrics(KVConnectorPromMetrics):
    """``vllm:p2p_<name>`` counters, gauges and histograms, one series per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from prometheus_client import Counter, Gauge, Histogram
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(cls, name, doc, **kw):
            metric = metric_types[cls](
                name=f"vllm:p2p_{name}", documentation=doc, labelnames=labelnames, **kw
            )
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self._counters = {k: per_engine(Counter, k, doc) for k, doc in COUNTERS.items()}
        self._gauges = {k: per_engine(Gauge, k, doc) for k, doc in GAUGES.items()}
        self._histograms = {
            k: per_engine(Histogram, k, doc, buckets=SECONDS_BUCKETS)
            for k, doc in HISTOGRAMS.items()
        }
        self._histograms.update(
            (k, per_engine(Histogram, k, doc, buckets=RATE_BUCKETS))
            for k, doc in RATE_HISTOGRAMS.items()
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, metrics in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                metrics[engine_idx].inc(value)
        for key, metrics in self._gauges.items():
            value = transfer_stats_data.get(key, -1)
            if value >= 0:
                metrics[engine_idx].set(value)
        for key, metrics in self._histograms.items():
            for value in transfer_stats_data.get(key, []):
                metrics[engine_idx].observe(value)
