"""The chaos harness without a fleet: the request mix, the judge, the driver
against a small fake server, recovery figures, counter totals and probes."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest
from aiohttp import web

from vllm_disagg.testing.chaos import _Accumulator, late_growth
from vllm_disagg.testing.fleet import Fleet, FleetConfig, probe_tree
from vllm_disagg.testing.traffic import (
    SHAPES,
    Record,
    Spec,
    TrafficRun,
    judge,
    make_specs,
    recovery,
    summarize,
)


def test_the_mix_is_deterministic_and_has_every_shape():
    a, mix_a = make_specs(7, "m", count=400)
    b, mix_b = make_specs(7, "m", count=400)
    specs_a, specs_b = list(a), list(b)
    assert [(s.shape, s.body) for s in specs_a] == [(s.shape, s.body) for s in specs_b]
    assert {s.shape for s in specs_a} == set(SHAPES)
    # Every reference a spec names is registered up front, once.
    assert all(key in mix_a.references for s in specs_a for key, _ in s.expect)
    assert mix_a.references == mix_b.references
    lists = [s for s in specs_a if s.shape == "prompt-list"]
    assert all(len(s.body["prompt"]) == 2 and len(s.expect) == 2 for s in lists)
    seeded = [s for s in specs_a if s.shape == "n2-seeded"]
    assert all(s.body["n"] == 2 and s.expect[0][0] == s.expect[1][0] for s in seeded)
    assert all(
        s.cancel_after and s.stream for s in specs_a if s.shape.startswith("cancel")
    )


def test_judge_compares_every_choice_and_cancelled_prefixes():
    spec = Spec(0, "prompt-list", "/v1/completions", {}, (("a", 0), ("b", 0)))
    refs = {"a": [[1, 2, 3]], "b": [[4, 5]]}
    assert judge(spec, {0: [1, 2, 3], 1: [4, 5]}, False, refs) == ("ok", "")
    assert judge(spec, {0: [1, 2, 3], 1: [4, 6]}, False, refs)[0] == "wrong"
    assert judge(spec, {0: [1, 2, 3]}, False, refs)[0] == "wrong"  # a choice missing
    cancel = Spec(
        1, "cancel-chat", "/v1/chat/completions", {}, (("a", 0),), cancel_after=3
    )
    assert judge(cancel, {0: [1, 2]}, True, refs) == ("cancelled", "")
    assert judge(cancel, {0: [1, 9]}, True, refs)[0] == "wrong"


def _record(i, start, end, outcome):
    return Record(i, "completion", start, end, 200, outcome)


def test_recovery_figures():
    records = [
        _record(0, 0, 1, "ok"),
        _record(1, 4, 5, "failed"),
        _record(2, 6, 6.5, "failed"),
        _record(3, 7, 8, "ok"),
        _record(4, 9, 10, "ok"),
    ]
    rec = recovery(records, fault_at=3.0)
    assert rec == {
        "recovered_s": 4.0,
        "errors_until_s": 3.5,
        "failed_after_fault": 2,
        "failed_before_fault": 0,
    }
    assert recovery(records[:1], 3.0)["recovered_s"] == 0.0
    assert recovery(records[:3], 3.0)["recovered_s"] is None  # never recovered
    s = summarize(records)
    assert (s["issued"], s["ok"], s["failed"]) == (5, 3, 2)


def test_counter_totals_survive_restarts_and_late_label_sets():
    acc = _Accumulator()
    acc.add(("p1", 0, "m"), 10, baseline=True)  # before the scenario: not counted
    acc.add(("p1", 0, "m"), 15, baseline=False)
    acc.add(("p1", 0, "m"), 3, baseline=False)  # the process restarted: 0 -> 3
    acc.add(("p1", 0, "new"), 2, baseline=False)  # a label set's first increment
    assert acc.total[("p1", 0, "m")] == 8
    assert acc.total[("p1", 0, "new")] == 2


def test_late_growth_compares_the_middle_with_the_end():
    series = [{"t": t, "rss": {"p1 1 Worker": 100 + t}} for t in range(0, 101, 10)]
    (row,) = late_growth(series, 0, 100)
    assert (row["rss_middle"], row["rss_end"]) == (150, 200)


def test_first_errors_leads_with_the_earliest_failure_and_skips_rejections(tmp_path):
    fleet = Fleet(FleetConfig(model="m", log_dir=tmp_path))
    (tmp_path / "router.log").write_text(
        "2026-11-28 09:56:30,001 WARNING vllm_disagg.router.proxy: decode failed\n"
        "2026-11-28 09:56:31,001 ERROR vllm_disagg.router.app: boom\n"
    )
    (tmp_path / "d1.log").write_text(
        "(EngineCore_DP1 pid=7) WARNING 11-28 09:56:01 [x.py:1] P2P offer rejected\n"
        "(EngineCore_DP1 pid=7) ERROR 11-28 09:56:21 [core.py:9] StepSyncFailure: "
        "DP rank 0 silent for 10.2s\n"
        "(EngineCore_DP1 pid=7) ERROR 11-28 09:56:22 [core.py:9] later\n"
    )
    (tmp_path / "p1.log").write_text("INFO all fine\n")
    assert fleet.first_errors() == (
        "d1: (EngineCore_DP1 pid=7) ERROR 11-28 09:56:21 [core.py:9] StepSyncFailure: "
        "DP rank 0 silent for 10.2s | router: 2026-11-28 09:56:31,001 ERROR "
        "vllm_disagg.router.app: boom"
    )
    (tmp_path / "d1.log").unlink()
    (tmp_path / "router.log").unlink()
    assert fleet.first_errors() == "no error line in any log"


def test_probe_tree_sees_children():
    stats = probe_tree(os.getpid())
    assert stats and stats[0].pid == os.getpid()
    assert stats[0].rss > 0 and stats[0].threads >= 1 and stats[0].fds >= 3


@pytest.fixture
def fake_server():
    """A completions endpoint answering token ids [1, 2, 3], streamed or not;
    prompt "fail" answers 503, prompt "hang" answers after the client gave up."""

    async def completions(request):
        body = await request.json()
        if body["prompt"] == "fail":
            return web.json_response({"error": {"message": "down"}}, status=503)
        if body["prompt"] == "hang":
            await asyncio.sleep(3)  # past the client timeout of 2 s
        if not body.get("stream"):
            return web.json_response(
                {
                    "choices": [
                        {"index": 0, "token_ids": [1, 2, 3], "finish_reason": "length"}
                    ]
                }
            )
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i, tok in enumerate((1, 2, 3)):
            choice = {
                "index": 0,
                "token_ids": [tok],
                "finish_reason": "length" if i == 2 else None,
            }
            await resp.write(
                b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
            )
        await resp.write(b"data: [DONE]\n\n")
        return resp

    ready = threading.Event()
    holder: dict = {}

    def serve():
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        holder["url"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        holder["loop"], holder["runner"] = loop, runner
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield holder["url"]
    holder["loop"].call_soon_threadsafe(holder["loop"].stop)
    thread.join(10)


def test_the_driver_records_every_outcome(fake_server):
    def spec(i, prompt, stream=False, cancel=None):
        return Spec(
            i,
            "completion",
            "/v1/completions",
            {"prompt": prompt, "stream": stream},
            (("ref", 0),),
            cancel_after=cancel,
        )

    specs = [
        spec(0, "a"),
        spec(1, "a", stream=True),
        spec(2, "b"),
        spec(3, "fail"),
        spec(4, "hang"),
        spec(5, "a", stream=True, cancel=2),
    ]
    refs = {"ref": [[1, 2, 3]]}
    refs_wrong = {"ref": [[1, 2, 4]]}
    run = TrafficRun(
        fake_server,
        specs[:2] + specs[3:],
        refs,
        concurrency=3,
        duration_s=20,
        request_timeout_s=2,
        error_backoff_s=0.01,
    ).start()
    assert run.wait(30)
    by_index = {r.index: r for r in run.records}
    assert by_index[0].outcome == by_index[1].outcome == "ok"
    assert by_index[3].outcome == "failed" and by_index[3].status == 503
    assert by_index[4].outcome == "failed" and by_index[4].hang
    assert by_index[5].outcome == "cancelled"
    run = TrafficRun(
        fake_server, specs[2:3], refs_wrong, concurrency=1, duration_s=10
    ).start()
    assert run.wait(20)
    assert run.records[0].outcome == "wrong"
