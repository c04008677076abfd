"""The per-transfer rate histograms: recorded once per completed transfer on
each side, carried through an interval's aggregation, and put on
``/metrics`` in their buckets."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.utils import floatToGoString

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
    RATE_BUCKETS,
    P2pKVConnectorStats,
    P2pPromMetrics,
    P2pStatsRecorder,
)

from .test_engine import LAYERS, PAGE, receive, send, wait_done


@pytest.mark.parametrize("mode", ["PUT", "GET"])
def test_each_completed_transfer_records_its_rate_once_on_each_side(make_engine, mode):
    prefill = make_engine("tcp", mode, seed=1)
    decode = make_engine("tcp", mode, seed=2)
    prefill.stats.take(), decode.stats.take()  # nothing from the set-up
    for i, key in enumerate(["a", "b"]):
        xfer = send(prefill, decode, key, [3, 5, 7], mode=mode)
        receive(decode, key, [20 + 3 * i, 21 + 3 * i, 22 + 3 * i], 0)
        assert wait_done(xfer).ok, xfer.reason
    sent, got = prefill.stats.take().data, decode.stats.take().data
    nbytes = LAYERS * 3 * PAGE
    for data, side in ((sent, "send"), (got, "recv")):
        seconds = data[f"{side}_seconds"]
        rates = data[f"{side}_rate_bytes_per_second"]
        assert len(seconds) == len(rates) == 2
        assert rates == pytest.approx([nbytes / s for s in seconds])
        # The other side's histogram is empty: one observation per side.
        other = "recv" if side == "send" else "send"
        assert data[f"{other}_rate_bytes_per_second"] == []


def test_failures_and_empty_transfers_record_no_rate():
    recorder = P2pStatsRecorder()
    recorder.record_failed_send()
    recorder.record_failed_load()
    recorder.record_send(0, 0, 0.01)  # nothing moved
    recorder.record_recv(1 << 20, 4, 0.0)  # no time to divide by
    data = recorder.take().data
    assert data["send_rate_bytes_per_second"] == []
    assert data["recv_rate_bytes_per_second"] == []


def test_an_interval_aggregates_rates_and_reduces_to_their_mean():
    one, two = P2pStatsRecorder(), P2pStatsRecorder()
    one.record_send(4_000_000, 1, 2.0)  # 2 MB/s
    two.record_send(8_000_000, 2, 2.0)  # 4 MB/s
    merged = P2pKVConnectorStats().aggregate(one.take()).aggregate(two.take())
    assert merged.data["send_rate_bytes_per_second"] == [2e6, 4e6]
    assert merged.reduce()["avg_send_rate_bytes_per_second"] == 3e6
    assert not merged.is_empty()


def test_rates_reach_prometheus_in_their_buckets():
    registry = CollectorRegistry()
    bound = {
        cls: functools.partial(cls, registry=registry)
        for cls in (Counter, Gauge, Histogram)
    }
    metrics = P2pPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        bound,
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    recorder = P2pStatsRecorder()
    recorder.record_send(3_000_000, 1, 1.0)  # 3 MB/s: a starved link
    recorder.record_recv(8 << 30, 64, 2.0)  # ~4.3 GB/s
    metrics.observe(recorder.take().data, engine_idx=0)

    def bucket(name: str, le: float) -> float:
        return registry.get_sample_value(
            f"vllm:p2p_{name}_bucket",
            {"model_name": "m", "engine": "0", "le": floatToGoString(le)},
        )

    assert bucket("send_rate_bytes_per_second", 1e6) == 0
    assert bucket("send_rate_bytes_per_second", 1e7) == 1
    assert bucket("recv_rate_bytes_per_second", 2e9) == 0
    assert bucket("recv_rate_bytes_per_second", 5e9) == 1
    assert bucket("recv_rate_bytes_per_second", RATE_BUCKETS[-1]) == 1
    total = registry.get_sample_value(
        "vllm:p2p_recv_rate_bytes_per_second_sum", {"model_name": "m", "engine": "0"}
    )
    assert total == pytest.approx((8 << 30) / 2.0)
