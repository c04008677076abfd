"""Chaos and soak, bounded for CI: one fleet (router, 2 prefills, a DP=2
decode of the tiny MoE, float32, P2P over tcp; conftest.py), traffic of every
request shape (vllm_disagg/testing/traffic.py), and one fault per test, in
this order: steady, strangers flooding every port, a stopped prefill, a killed router, a
killed prefill, a killed decode (restarted), and last a killed engine core of one decode
rank.

Every test fails on a wrong greedy output, a request with no answer within
the client's timeout (a hang), or a fault step that did not happen in time;
the fault-free and survivable cases also on any failed request; the steady
case on growth past the bounds below. Where a fault takes the only decode
away, what users must get is an error, fast, and the router must stop
listing what died. CI runs steady, strangers, killed prefill and killed
decode rank; the stopped prefill, the killed router and the restarted decode
run with ``pytest --full`` (about 3 min more). The full-size runs and their
figures: benchmarks/chaos.py, benchmarks/results/chaos/.
"""

from __future__ import annotations

import json

import pytest

from vllm_disagg.testing.chaos import Options, run_scenario

pytestmark = pytest.mark.e2e

# Steady state bounds, per process alive before and after (same pid):
RSS_GROWTH_PCT = 5.0  # the bound
# Threads: none may appear for good. Fds: an API server's count moves with the
# router's keep-alive connections to it (aiohttp's pool) and the scrapes; a leak of
# one per request would add dozens here.
THREAD_SLACK = 2
FD_SLACK = 8
# The fleet's timeouts (FleetConfig): router heartbeat expiry 10 s, heartbeats
# every 3 s.
HEARTBEAT_TIMEOUT_S = 10.0
HEARTBEAT_INTERVAL_S = 3.0
# Hostile input: messages (ZMQ) or connections (TCP) per port (the benchmark
# sends 10,000), and the memory a flood may leave behind: each rejected frame
# is freed; what grows is the allocator's high-water mark (measured: see
# benchmarks/results/chaos/hostile.md).
HOSTILE_PER_PORT = 400
HOSTILE_RSS_GROWTH_PCT = 10.0
# A request that fails must fail within this (the client's timeout is 120 s).
FAIL_FAST_S = 30.0


def _bad(result, *outcomes):
    return [r for r in result["records"] if r["outcome"] in outcomes or r["hang"]]


def _why(result, *outcomes) -> str:
    """A failed check's message: the fleet's first error lines lead (a CI
    summary shows one line), then the first offending requests."""
    return f"fleet: {result['first_errors']}; requests: {_bad(result, *outcomes)[:3]}"


def _check_common(result):
    """Nothing wrong, nothing hung, the traffic ended, the fault happened."""
    assert result["fault_error"] is None, (
        f"{result['fault_error']}; fleet: {result['first_errors']}"
    )
    assert result["traffic_ended"], "traffic did not end within its bound"
    r = result["requests"]
    assert r["hangs"] == 0, _why(result)
    assert r["wrong"] == 0, _why(result, "wrong")
    assert r["issued"] > 0


def _check_survived(result):
    """A fault the fleet absorbs: no request failed, and it ended quiet."""
    _check_common(result)
    assert result["requests"]["failed"] == 0, _why(result, "failed")
    assert result["quiet"], result["load_after"]


def _summary(fleet, result) -> str:
    """One line for the test's output; the whole result next to the fleet's logs."""
    (fleet.log_dir / f"{result['scenario']}.json").write_text(
        json.dumps(result, indent=1)
    )
    r = result["requests"]
    return (
        f"{result['scenario']}: {r['issued']} requests, ok {r['ok']}, failed "
        f"{r['failed']}, cancelled {r['cancelled']}, max {r['latency_s']['max']} s; "
        f"fault { {k: v for k, v in result['fault'].items() if k != 'ports'} }; "
        f"recovery {result.get('recovery')}"
    )


def test_steady_state_loses_nothing_and_grows_nothing(chaos_fleet):
    fleet, references, specs = chaos_fleet
    result = run_scenario(
        "steady", fleet, specs, references, Options(requests=48, duration_s=150)
    )
    print(_summary(fleet, result))
    _check_survived(result)
    assert (
        result["requests"]["cancelled"] > 0
    )  # the mix cancels some; they leave nothing behind
    too_much = [
        g
        for g in result["growth"]
        if g["rss_change_pct"] > RSS_GROWTH_PCT
        or g["threads_after"] > g["threads_before"] + THREAD_SLACK
        or g["fds_after"] > g["fds_before"] + FD_SLACK
    ]
    assert not too_much, too_much
    assert result["decode"]["failed_loads"] == 0  # every prompt's KV came over
    assert result["decode"]["bytes_received"] > 0


def test_strangers_on_every_port_cost_clients_nothing(chaos_fleet):
    """Malformed, truncated, oversized, forged and type-confused messages on
    every port the fleet opens, all at once, while it serves: no process
    dies, no request fails or differs, memory stays bounded, and every
    rejection that reached the application is counted on /metrics."""
    fleet, references, specs = chaos_fleet
    result = run_scenario(
        "hostile",
        fleet,
        specs,
        references,
        Options(
            requests=40,
            tail_requests=8,
            duration_s=150,
            fault_after=6,
            hostile_per_port=HOSTILE_PER_PORT,
            hostile_time_s=60,
        ),
    )
    print(_summary(fleet, result))
    _check_survived(result)
    fault = result["fault"]
    assert not fault["processes_gone"], fault["processes_gone"]
    services = {p["service"] for p in fault["ports"]}
    assert services == {"http", "discovery", "p2p control", "p2p data", "step sync"}, (
        services
    )
    assert all(p["sent"] > 0 for p in fault["ports"]), fault["ports"]
    for name, c in fault["counted"].items():
        assert c["at_least"] <= c["counted"] <= c["at_most"], (name, c)
    too_much = [
        g
        for g in result["growth"]
        if g["rss_change_pct"] > HOSTILE_RSS_GROWTH_PCT
        or g["threads_after"] > g["threads_before"] + THREAD_SLACK
    ]
    assert not too_much, too_much


@pytest.mark.full
def test_a_stopped_prefill_costs_latency_not_requests(chaos_fleet):
    """SIGSTOP past every timeout: its prefill legs time out and are retried on
    the other prefill, the router drops it after the heartbeat timeout, and
    after SIGCONT it registers again within a heartbeat."""
    fleet, references, specs = chaos_fleet
    result = run_scenario(
        "stop-peer",
        fleet,
        specs,
        references,
        Options(
            requests=48, tail_requests=16, duration_s=150, fault_after=6, stop_s=13
        ),
    )
    print(_summary(fleet, result))
    _check_survived(result)
    fault = result["fault"]
    assert fault["removed_after_s"] is not None
    assert fault["removed_after_s"] <= HEARTBEAT_TIMEOUT_S + HEARTBEAT_INTERVAL_S, fault
    assert fault["registered_after_resume_s"] is not None
    assert fault["registered_after_resume_s"] <= HEARTBEAT_INTERVAL_S + 2, fault


@pytest.mark.full
def test_a_killed_router_restarted_knows_the_fleet_within_a_heartbeat(chaos_fleet):
    fleet, references, specs = chaos_fleet
    result = run_scenario(
        "kill-router",
        fleet,
        specs,
        references,
        Options(requests=40, tail_requests=16, duration_s=120, fault_after=6),
    )
    print(_summary(fleet, result))
    _check_common(result)
    fault = result["fault"]
    assert fault["instances_back_after_http_up_s"] is not None, fault
    assert fault["instances_back_after_http_up_s"] <= HEARTBEAT_INTERVAL_S + 1, fault
    # Only requests in flight at the kill or sent while no router listened failed.
    back = (
        fault["restart_at"]
        + fault["http_up_after_restart_s"]
        + fault["instances_back_after_http_up_s"]
    )
    after = [r for r in result["records"] if r["start"] > back]
    assert after, "no request was sent after the router was back"
    late = [r for r in after if r["outcome"] not in ("ok", "cancelled")]
    assert not late, late[:5]
    assert result["quiet"], result["load_after"]


def test_a_killed_prefill_is_routed_around(chaos_fleet):
    fleet, references, specs = chaos_fleet
    result = run_scenario(
        "kill-prefill",
        fleet,
        specs,
        references,
        Options(
            requests=40, tail_requests=16, duration_s=120, fault_after=6, restart=False
        ),
    )
    print(_summary(fleet, result))
    _check_survived(result)
    assert result["fault"]["removed_after_s"] is not None
    assert (
        result["fault"]["removed_after_s"] <= HEARTBEAT_TIMEOUT_S + HEARTBEAT_INTERVAL_S
    )


@pytest.mark.full
def test_a_killed_decode_fails_requests_fast_and_recovers_when_restarted(chaos_fleet):
    """The only decode dies: requests fail at once (503) instead of waiting,
    the router drops both ranks, and the restarted decode serves right."""
    fleet, references, specs = chaos_fleet
    result = run_scenario(
        "kill-decode",
        fleet,
        specs,
        references,
        Options(
            requests=32,
            tail_requests=16,
            duration_s=240,
            fault_after=6,
            restart_after_s=5,
        ),
    )
    print(_summary(fleet, result))
    _check_common(result)
    fault = result["fault"]
    assert fault["removed_after_s"] is not None
    assert fault["removed_after_s"] <= HEARTBEAT_TIMEOUT_S + HEARTBEAT_INTERVAL_S, fault
    slow = [r for r in _bad(result, "failed") if r["end"] - r["start"] > FAIL_FAST_S]
    assert not slow, slow[:5]
    assert fault["registered_after_restart_s"] is not None, fault
    after = [
        r
        for r in result["records"]
        if r["start"]
        > fault["restart_at"]
        + fault["ready_after_restart_s"]
        + fault["registered_after_restart_s"]
    ]
    assert after and all(r["outcome"] in ("ok", "cancelled") for r in after), [
        r for r in after if r["outcome"] not in ("ok", "cancelled")
    ][:5]
    assert result["quiet"], result["load_after"]


def test_a_killed_decode_rank_takes_its_group_down_fast(chaos_fleet):
    """Send kill -9 to the engine core of DP rank 1. vLLM cannot re-form a DP group
    around a lost rank (neither can step sync): what users must get is an
    error within FAIL_FAST_S, never a hang, and the router must stop
    sending to the dead ranks."""
    fleet, references, specs = chaos_fleet
    result = run_scenario(
        "kill-decode-rank",
        fleet,
        specs,
        references,
        Options(
            requests=24, tail_requests=8, duration_s=120, fault_after=6, restart=False
        ),
    )
    print(_summary(fleet, result))
    _check_common(result)
    fault = result["fault"]
    slow = [r for r in _bad(result, "failed") if r["end"] - r["start"] > FAIL_FAST_S]
    assert not slow, slow[:5]
    assert not fault["still_running"], fault  # a rank without its group must not linger
    assert fault["removed_after_s"] is not None, fault
    assert fault["removed_after_s"] <= HEARTBEAT_TIMEOUT_S + HEARTBEAT_INTERVAL_S, fault
