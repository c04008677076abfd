"""The one rate-limited log every component uses for what strangers trigger."""

from __future__ import annotations

import logging
import threading

from vllm_disagg.wire import logs
from vllm_disagg.wire.logs import RateLimitedLog


def test_one_line_per_kind_per_interval_then_the_count_held_back(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: now[0])
    log = RateLimitedLog(logging.getLogger("t"), interval_s=10.0)
    with caplog.at_level(logging.WARNING):
        assert log.warning("a", "first %s", 1)
        assert not log.warning("a", "again")
        assert not log.warning("a", "again")
        assert log.warning("b", "other kind")  # kinds are independent
        now[0] += 10.0
        assert log.warning("a", "later %s", 2)
    assert [r.getMessage() for r in caplog.records] == [
        "first 1",
        "other kind",
        "later 2 (2 more since the last report)",
    ]


def test_threads_share_it_without_losing_counts(caplog):
    log = RateLimitedLog(logging.getLogger("t2"), interval_s=3600.0)
    logged = []

    def hammer():
        for _ in range(2000):
            logged.append(log.warning("k", "x"))

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert logged.count(True) == 1 and log._held["k"] == 7999  # noqa: SLF001
