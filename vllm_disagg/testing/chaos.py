"""Chaos and soak scenarios on a :class:`~vllm_disagg.testing.fleet.Fleet`
under traffic from :class:`~vllm_disagg.testing.traffic.TrafficRun`.

Each scenario sends a bounded number of requests (and stops at a time bound),
injects its fault after ``fault_after`` requests have ended, does what an
operator or a supervisor would (restart what died, resume what was stopped),
and returns its figures as a JSON-able dict: requests ok / failed / wrong /
cancelled / hung, latency, seconds to recover, the router's retries and
removals, the decode's recomputes (failed KV loads), what each process held
before and after (RSS, threads, fds), and whether the fleet ended quiet
(no request running, receive buffers and host pools empty).

``benchmarks/chaos.py`` runs them one fleet each and writes the results;
``tests/chaos/test_chaos.py`` runs bounded versions on one shared fleet.

Scenarios:

* ``steady``: traffic only.
* ``kill-prefill``: ``kill -9`` one prefill's process group; later restarted.
* ``kill-decode``: ``kill -9`` every process of the decode (both DP ranks); later
  restarted.
* ``kill-decode-rank``: ``kill -9`` only the engine core of decode DP rank 1;
  what died is restarted.
* ``kill-router``: ``kill -9`` the router, restarted on the same ports.
* ``stop-peer``: ``SIGSTOP`` one prefill past the router's heartbeat and
  prefill timeouts and the decode's KV load timeout, then ``SIGCONT``.
* ``hostile``: strangers flood every port the project opens (the router's
  HTTP and discovery ports, each instance's P2P control port and tcp data
  ports, the decode's step sync coordinator) with malformed, truncated,
  oversized, forged and type-confused messages (vllm_disagg/testing/
  hostile.py), all at once, while the traffic runs; per port, what was sent
  and what the target counted on /metrics.
"""

from __future__ import annotations

import contextlib
import random
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import requests

from vllm_disagg.testing import hostile
from vllm_disagg.testing.fleet import Fleet, FleetError, ProcStat, instance_summary
from vllm_disagg.testing.traffic import Record, Spec, TrafficRun, recovery, summarize

SCENARIOS = (
    "steady",
    "hostile",
    "stop-peer",
    "kill-prefill",
    "kill-router",
    "kill-decode-rank",
    "kill-decode",
)

# Counters sampled on every vLLM member (summed over labels) ...
MEMBER_COUNTERS = (
    "vllm:p2p_failed_loads",
    "vllm:p2p_dropped",
    "vllm:p2p_failed_sends",
    "vllm:p2p_rejected_messages",
    "vllm:p2p_bytes_received",
    "vllm:p2p_bytes_sent",
    "vllm:external_prefix_cache_hits",
    "vllm:request_success",
)
# ... and on the router, per label set.
ROUTER_COUNTERS = (
    "vllm_disagg_router_requests",
    "vllm_disagg_router_prefill_retries",
    "vllm_disagg_router_decode_retries",
    "vllm_disagg_router_prefill_failures",
    "vllm_disagg_router_instance_removals",
    "vllm_disagg_router_decode_prefill_fallbacks",
    "vllm_disagg_router_breaker_opens",
)


@dataclass
class Options:
    requests: int = 300  # at least this many requests in all
    # ... and at least this many sent after the fault's last step (restart,
    # resume): what recovery is judged on.
    tail_requests: int = 40
    duration_s: float = (
        600.0  # no request is sent after this; the run ends within it + timeouts
    )
    concurrency: int = 8
    request_timeout_s: float = (
        120.0  # the client's: more than the router's --request-timeout-s
    )
    fault_after: int = 60  # requests ended before the fault
    # stop-peer: how long the prefill stays stopped; past the fleet's heartbeat (10 s),
    # prefill (10 s) and KV load (10 s) timeouts.
    stop_s: float = 20.0
    restart: bool = True  # restart what was killed (kill-router always restarts)
    restart_after_s: float = 10.0  # traffic on the degraded fleet before the restart
    router_restart_delay_s: float = 1.0
    quiet_timeout_s: float = 60.0
    sample_interval_s: float = 2.0
    # hostile: messages (ZMQ) or connections (TCP) per port, and a time bound per port.
    hostile_per_port: int = 10_000
    hostile_time_s: float = 300.0
    hostile_seed: int = 0


# --- sampling --------------------------------------------------------------------


class _Accumulator:
    """Totals of counters since a baseline. A series first seen after the
    baseline (a label set's first increment, a restarted process, a new
    router) counts from 0; a series that goes down restarted from 0."""

    def __init__(self) -> None:
        self.last: dict[tuple, float] = {}
        self.total: dict[tuple, float] = {}

    def add(self, key: tuple, value: float, baseline: bool) -> None:
        prev = self.last.get(key)
        if prev is None:
            prev = value if baseline else 0.0
        self.total[key] = self.total.get(key, 0.0) + (
            value - prev if value >= prev else value
        )
        self.last[key] = value


class Sampler:
    """Every ``interval_s``: each member's RSS, threads and fds (summed over
    its processes) and the counters above, into time series and totals."""

    def __init__(self, fleet: Fleet, t0: float, interval_s: float = 2.0):
        self.fleet = fleet
        self.t0 = t0
        self.interval_s = interval_s
        self.series: list[dict[str, Any]] = []
        self.counters = _Accumulator()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)

    def start(self) -> Sampler:
        self.sample(baseline=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            # A sample is best effort; the next one comes.
            with contextlib.suppress(Exception):
                self.sample()

    def sample(self, baseline: bool = False) -> None:
        fleet = self.fleet
        point: dict[str, Any] = {
            "t": round(time.monotonic() - self.t0, 3),
            "members": {},
            "rss": {},
        }
        for name, stats in fleet.probes().items():
            point["members"][name] = {
                "rss": sum(s.rss for s in stats),
                "threads": sum(s.threads for s in stats),
                "fds": sum(s.fds for s in stats),
            }
            for s in stats:  # per process: "member pid name" -> bytes
                point["rss"][f"{name} {s.pid} {s.name}"] = s.rss
        self.series.append(point)
        for m in fleet.serving():
            if m.pid is None or m.name in fleet._paused:
                continue
            try:
                values = m.server.metrics(prefix="vllm:")
            except requests.RequestException:
                continue
            for metric in MEMBER_COUNTERS:
                total = sum(
                    v
                    for name, labels in values.items()
                    if name in (metric, f"{metric}_total")
                    for v in labels.values()
                )
                self.counters.add((m.name, m.restarts, metric), total, baseline)
        try:
            values = fleet.metrics("router", prefix="vllm_disagg_router_")
        except (requests.RequestException, AssertionError):
            return
        incarnation = len(fleet.old_routers)
        for metric in ROUTER_COUNTERS:
            for name, labels in values.items():
                if name in (metric, f"{metric}_total"):
                    for label, v in labels.items():
                        self.counters.add(
                            ("router", incarnation, metric, label), v, baseline
                        )

    def member_total(self, metric: str, role: str | None = None) -> float:
        names = {m.name for m in self.fleet.serving() if role is None or m.role == role}
        return sum(
            v
            for key, v in self.counters.total.items()
            if key[0] in names and key[2] == metric
        )

    def router_total(self, metric: str) -> dict[str, float]:
        """{label string: total over router incarnations}."""
        out: dict[str, float] = {}
        for key, v in self.counters.total.items():
            if key[0] == "router" and key[2] == metric:
                out[key[3]] = out.get(key[3], 0.0) + v
        return {k: v for k, v in out.items() if v}


# --- process growth ------------------------------------------------------------------


def growth(
    before: dict[str, list[ProcStat]], after: dict[str, list[ProcStat]]
) -> list[dict]:
    """Per process present in both snapshots (same pid): RSS, threads, fds
    before and after and the RSS change in percent."""
    rows = []
    for member, stats in before.items():
        later = {s.pid: s for s in after.get(member, [])}
        for s in stats:
            a = later.get(s.pid)
            if a is None:
                continue
            rows.append(
                {
                    "member": member,
                    "pid": s.pid,
                    "name": s.name,
                    "rss_before": s.rss,
                    "rss_after": a.rss,
                    "rss_change_pct": round(100.0 * (a.rss - s.rss) / max(1, s.rss), 2),
                    "threads_before": s.threads,
                    "threads_after": a.threads,
                    "fds_before": s.fds,
                    "fds_after": a.fds,
                }
            )
    return rows


def late_growth(series: list[dict[str, Any]], start: float, end: float) -> list[dict]:
    """Per process: RSS at the sample nearest the middle of [start, end] and
    at the last sample up to ``end``, and the change in percent: a leak grows
    as much in the second half of a run as in the first, a cache that fills
    up does not."""
    points = [p for p in series if start <= p["t"] <= end + 5]
    if len(points) < 3:
        return []
    middle = min(points, key=lambda p: abs(p["t"] - (start + end) / 2))
    last = points[-1]
    rows = []
    for proc, rss in middle.get("rss", {}).items():
        later = last.get("rss", {}).get(proc)
        if later is None:
            continue
        rows.append(
            {
                "process": proc,
                "t_middle": middle["t"],
                "t_end": last["t"],
                "rss_middle": rss,
                "rss_end": later,
                "rss_change_pct": round(100.0 * (later - rss) / max(1, rss), 2),
            }
        )
    return rows


def _probe_dict(probes: dict[str, list[ProcStat]]) -> dict[str, list[dict]]:
    return {member: [s.as_dict() for s in stats] for member, stats in probes.items()}


# --- faults ------------------------------------------------------------------------


def _until(
    predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.2
) -> float | None:
    """Seconds until ``predicate()`` held, or None at the deadline."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return round(time.monotonic() - started, 3)
        time.sleep(step_s)
    return None


def _since(at: float, predicate: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds from ``at`` (time.monotonic()) until ``predicate()`` held, or None."""
    return (
        None
        if _until(predicate, timeout_s) is None
        else round(time.monotonic() - at, 3)
    )


def _fault_steady(fleet: Fleet, traffic: TrafficRun, opts: Options) -> dict[str, Any]:
    return {}


def _fault_kill_prefill(
    fleet: Fleet, traffic: TrafficRun, opts: Options
) -> dict[str, Any]:
    victim = fleet.prefills()[0].name
    traffic.wait_for(opts.fault_after, timeout_s=opts.duration_s)
    at = fleet.kill(victim)
    out: dict[str, Any] = {"victim": victim, "at": at}
    out["removed_after_s"] = _since(at, lambda: victim not in fleet.registered(), 60)
    if opts.restart:
        time.sleep(max(0.0, opts.restart_after_s - (time.monotonic() - at)))
        restart_at = fleet.restart([victim])
        out["restart_at"] = restart_at
        out["ready_after_restart_s"] = round(time.monotonic() - restart_at, 3)
        out["registered_after_restart_s"] = _until(
            lambda: victim in fleet.registered(), 60
        )
    return out


def _fault_kill_decode(
    fleet: Fleet, traffic: TrafficRun, opts: Options
) -> dict[str, Any]:
    names = [m.name for m in fleet.decodes()]
    traffic.wait_for(opts.fault_after, timeout_s=opts.duration_s)
    at = fleet.note(f"kill -9 {','.join(names)}")
    for name in names:
        fleet.members[name].server.kill()
    out: dict[str, Any] = {"victims": names, "at": at}
    out["removed_after_s"] = _since(
        at, lambda: not (set(names) & fleet.registered()), 60
    )
    if opts.restart:
        time.sleep(max(0.0, opts.restart_after_s - (time.monotonic() - at)))
        restart_at = fleet.restart(names)
        out["restart_at"] = restart_at
        out["ready_after_restart_s"] = round(time.monotonic() - restart_at, 3)
        out["registered_after_restart_s"] = _until(
            lambda: set(names) <= fleet.registered(), 60
        )
    return out


def _fault_kill_decode_rank(
    fleet: Fleet, traffic: TrafficRun, opts: Options
) -> dict[str, Any]:
    decodes = fleet.decodes()
    victim = decodes[-1].name
    others = [m.name for m in decodes[:-1]]
    traffic.wait_for(opts.fault_after, timeout_s=opts.duration_s)
    at = fleet.kill_engine_core(victim)
    out: dict[str, Any] = {"victim": f"{victim} engine core", "at": at}
    # What the rest of the decode does about it (step sync: the group fails fast).
    died = fleet.wait_dead(
        [victim, *others], timeout_s=3 * fleet.config.step_sync_peer_timeout_s + 30
    )
    out["exited_after_s"] = {n: round(t - at, 3) for n, t in died.items()}
    out["still_running"] = sorted({victim, *others} - set(died))
    gone = set(died) | {victim}
    out["removed_after_s"] = _since(at, lambda: not (gone & fleet.registered()), 60)
    if opts.restart:
        time.sleep(max(0.0, opts.restart_after_s - (time.monotonic() - at)))
        # A rank cannot rejoin a DP group alone: the whole decode is restarted.
        names = [m.name for m in decodes]
        restart_at = fleet.restart(names)
        out["restart_at"] = restart_at
        out["ready_after_restart_s"] = round(time.monotonic() - restart_at, 3)
        out["registered_after_restart_s"] = _until(
            lambda: set(names) <= fleet.registered(), 60
        )
    return out


def _fault_kill_router(
    fleet: Fleet, traffic: TrafficRun, opts: Options
) -> dict[str, Any]:
    traffic.wait_for(opts.fault_after, timeout_s=opts.duration_s)
    at = fleet.kill("router")
    time.sleep(opts.router_restart_delay_s)
    restart_at = fleet.restart_router()
    up_at = time.monotonic()
    back = _until(
        lambda: {m.name for m in fleet.serving()} <= fleet.registered(), 60, 0.05
    )
    return {
        "at": at,
        "restart_at": restart_at,
        "http_up_after_restart_s": round(up_at - restart_at, 3),
        "instances_back_after_http_up_s": back,
        "instances_back_after_kill_s": None
        if back is None
        else round(up_at + back - at, 3),
    }


def _fault_stop_peer(
    fleet: Fleet, traffic: TrafficRun, opts: Options
) -> dict[str, Any]:
    victim = fleet.prefills()[0].name
    traffic.wait_for(opts.fault_after, timeout_s=opts.duration_s)
    at = fleet.pause(victim)
    out: dict[str, Any] = {"victim": victim, "at": at, "stopped_s": opts.stop_s}
    out["removed_after_s"] = _since(
        at, lambda: victim not in fleet.registered(), opts.stop_s
    )
    time.sleep(max(0.0, opts.stop_s - (time.monotonic() - at)))
    resumed = fleet.resume(victim)
    out["resume_at"] = resumed
    out["registered_after_resume_s"] = _until(lambda: victim in fleet.registered(), 60)
    return out


# --- hostile input ----------------------------------------------------------------

_DATA_PORT_LINE = re.compile(r"P2P tcp data port listening on (\S+)")
_COORDINATOR_LINE = re.compile(r"step sync DP engine core .* coordinator=tcp://(\S+)")
# Where each target's rejections are counted: (member, metric names summed over labels).
_ROUTER_HTTP_COUNTERS = ("vllm_disagg_router_client_connections_closed_total",)
# Requests refused: by the router (bad body, unknown model) or relayed from a decode
# (4xx).
_REFUSED_OUTCOMES = ("bad_request", "no_instance", "upstream_client_error")
_STEP_SYNC_COUNTERS = tuple(
    f"vllm_disagg:step_sync_coordinator_{k}_messages"
    for k in ("malformed", "unauthenticated", "stale")
)


@dataclass(frozen=True)
class Target:
    """One port of the fleet and where its rejections show on /metrics."""

    label: str  # "router http", "p1 p2p data 127.0.0.1:4242", ...
    service: str  # "http", "discovery", "p2p control", "p2p data" or "step sync"
    kind: str  # "http", "zmq" or "stream"
    address: str  # host:port
    counter: str  # what counts its rejections: "router http", "router discovery",
    #               "<member> p2p", "<member> step sync"
    protocol: hostile.ZmqProtocol | None = None


def _log_addresses(fleet: Fleet, name: str, pattern: re.Pattern) -> list[str]:
    text = fleet.members[name].server.log_path.read_text(errors="replace")
    return sorted(set(pattern.findall(text)))


def hostile_targets(fleet: Fleet) -> list[Target]:
    """Every port the project opens in ``fleet``: the router's HTTP and
    discovery ports, each instance's P2P control port and the tcp data ports
    its log names, and the step sync coordinator the decode's log names."""
    router = fleet.router
    assert router is not None
    targets = [
        Target(
            "router http", "http", "http", f"127.0.0.1:{router.port}", "router http"
        ),
        Target(
            "router discovery",
            "discovery",
            "zmq",
            f"127.0.0.1:{router.discovery_port}",
            "router discovery",
            hostile.discovery_protocol(),
        ),
    ]
    control = hostile.p2p_control_protocol()
    for m in fleet.serving():
        if m.kv_addr is None:
            continue
        targets.append(
            Target(
                f"{m.name} p2p control",
                "p2p control",
                "zmq",
                m.kv_addr,
                f"{m.name} p2p",
                control,
            )
        )
        for addr in _log_addresses(fleet, m.name, _DATA_PORT_LINE):
            targets.append(
                Target(
                    f"{m.name} p2p data {addr}",
                    "p2p data",
                    "stream",
                    addr,
                    f"{m.name} p2p",
                )
            )
    step_sync = hostile.step_sync_protocol()
    for m in fleet.decodes():
        for addr in _log_addresses(fleet, m.name, _COORDINATOR_LINE):
            if not any(t.address == addr for t in targets):
                targets.append(
                    Target(
                        f"{m.name} step sync {addr}",
                        "step sync",
                        "zmq",
                        addr,
                        f"{m.name} step sync",
                        step_sync,
                    )
                )
    return targets


def _counted(fleet: Fleet, counter: str) -> float:
    """Rejections counted so far by ``counter`` (see :class:`Target`)."""
    member, _, what = counter.partition(" ")
    if member == "router":
        values = fleet.metrics("router", prefix="vllm_disagg_router_")
        if what == "discovery":
            names: tuple[str, ...] = ("vllm_disagg_router_discovery_rejected_total",)
        else:
            names = _ROUTER_HTTP_COUNTERS
        total = sum(v for n in names for v in values.get(n, {}).values())
        if (
            what == "http"
        ):  # requests answered with an error (the router's or a decode's)
            total += sum(
                v
                for labels, v in values.get(
                    "vllm_disagg_router_requests_total", {}
                ).items()
                if any(f'outcome="{o}"' in labels for o in _REFUSED_OUTCOMES)
            )
        return total
    if what == "p2p":
        return fleet.metric_sum(member, "vllm:p2p_rejected_messages")
    values = fleet.metrics(member, prefix="vllm_disagg:step_sync_coordinator_")
    return sum(
        v
        for n in _STEP_SYNC_COUNTERS
        for n2, labels in values.items()
        if n2 in (n, f"{n}_total")
        for v in labels.values()
    )


def _flood(target: Target, opts: Options, seed: int) -> hostile.Sent:
    if target.kind == "zmq":
        assert target.protocol is not None
        # Strangers: no key (a captured frame replayed is refused by the
        # protocols' own replay rules, tested in their unit tests).
        return hostile.flood_zmq(
            target.address,
            target.protocol,
            count=opts.hostile_per_port,
            time_s=opts.hostile_time_s,
            seed=seed,
        )
    payloads = (
        hostile.http_payloads if target.kind == "http" else hostile.stream_payloads
    )
    return _flood_tcp_parallel(target.address, payloads, opts, seed)


def _flood_tcp_parallel(
    address: str, payloads, opts: Options, seed: int, parts: int = 8
) -> hostile.Sent:
    """``parts`` clients at a time. Each reads until the target closes the
    connection (a request it answered: every request sent says ``Connection:
    close``), except that a truncated message is abandoned after 0.2 s, as a
    careless client does: a client that leaves is not refused, and not counted."""
    host, _, port = address.rpartition(":")
    count = opts.hostile_per_port

    def one(i: int) -> hostile.Sent:
        return hostile.flood_tcp(
            host.strip("[]"),
            int(port),
            payloads(random.Random(seed * 100 + i)),
            count=count // parts + (i < count % parts),
            time_s=opts.hostile_time_s,
            read_s=10.0,
            read_s_by_kind={"truncated": 0.2},
        )

    with ThreadPoolExecutor(parts) as pool:
        sent = list(pool.map(one, range(parts)))
    by_kind: dict[str, int] = {}
    for s in sent:
        for k, v in s.by_kind.items():
            by_kind[k] = by_kind.get(k, 0) + v
    return hostile.Sent(by_kind, max(s.seconds for s in sent))


def expected_rejections(target: Target, sent: hostile.Sent) -> tuple[int, int]:
    """(at least, at most) rejections ``target`` must count for ``sent``.

    ZMQ: everything but what libzmq may drop before the application sees
    it (a frame over the socket's size limit, with its connection). HTTP:
    everything but truncated requests the client abandoned (a client that
    goes away is not refused). Data ports: every connection, once.
    """
    if target.kind == "zmq":
        return sent.total - sent.alone, sent.total
    if target.kind == "http":
        return sent.total - sent.by_kind.get("truncated", 0), sent.total
    return sent.total, sent.total


def _fault_hostile(fleet: Fleet, traffic: TrafficRun, opts: Options) -> dict[str, Any]:
    traffic.wait_for(opts.fault_after, timeout_s=opts.duration_s)
    targets = hostile_targets(fleet)
    counters = sorted({t.counter for t in targets})
    before = {c: _counted(fleet, c) for c in counters}
    pids_before = {
        name: sorted(s.pid for s in stats) for name, stats in fleet.probes().items()
    }
    at = fleet.note(f"hostile floods on {len(targets)} ports")
    with ThreadPoolExecutor(len(targets)) as pool:
        sent = dict(
            zip(
                targets,
                pool.map(
                    lambda it: _flood(it[1], opts, opts.hostile_seed + it[0]),
                    enumerate(targets),
                ),
            )
        )
    ended_at = fleet.note("hostile floods ended")
    bounds: dict[str, list[int]] = {c: [0, 0] for c in counters}
    for t, s in sent.items():
        low, high = expected_rejections(t, s)
        bounds[t.counter][0] += low
        bounds[t.counter][1] += high

    def counted() -> dict[str, float]:
        return {c: _counted(fleet, c) - before[c] for c in counters}

    # Counters reach /metrics with the next engine step or scrape: the traffic goes on.
    now = counted()
    deadline = time.monotonic() + 60.0
    while any(now[c] < bounds[c][0] for c in counters) and time.monotonic() < deadline:
        time.sleep(1.0)
        now = counted()
    pids_after = {
        name: sorted(s.pid for s in stats) for name, stats in fleet.probes().items()
    }
    return {
        "at": at,
        "ended_at": ended_at,
        "ports": [
            {
                "target": t.label,
                "service": t.service,
                "kind": t.kind,
                "address": t.address,
                "counted_by": t.counter,
                "sent": s.total,
                "by_kind": s.by_kind,
                "seconds": round(s.seconds, 3),
            }
            for t, s in sent.items()
        ],
        "counted": {
            c: {"counted": now[c], "at_least": bounds[c][0], "at_most": bounds[c][1]}
            for c in counters
        },
        "messages_sent": sum(s.total for s in sent.values()),
        "processes_gone": sorted(
            f"{name} {pid}"
            for name, pids in pids_before.items()
            for pid in pids
            if pid not in pids_after.get(name, ())
        ),
    }


FAULTS: dict[str, Callable[[Fleet, TrafficRun, Options], dict[str, Any]]] = {
    "steady": _fault_steady,
    "hostile": _fault_hostile,
    "kill-prefill": _fault_kill_prefill,
    "kill-decode": _fault_kill_decode,
    "kill-decode-rank": _fault_kill_decode_rank,
    "kill-router": _fault_kill_router,
    "stop-peer": _fault_stop_peer,
}


# --- one scenario -------------------------------------------------------------------


def run_scenario(
    name: str,
    fleet: Fleet,
    specs,
    references: dict[str, list[list[int]]],
    opts: Options,
) -> dict[str, Any]:
    """Run scenario ``name`` on a started fleet; its figures."""
    if name not in FAULTS:
        raise ValueError(f"unknown scenario {name!r}; one of {', '.join(SCENARIOS)}")
    t0 = time.monotonic()
    sampler = Sampler(fleet, t0, opts.sample_interval_s).start()
    probes_before = fleet.probes()
    load_before = fleet.load()
    flushes = len(fleet.gauge_flushes)
    traffic = TrafficRun(
        fleet.url,
        specs,
        references,
        concurrency=opts.concurrency,
        duration_s=opts.duration_s,
        request_timeout_s=opts.request_timeout_s,
        t0=t0,
    ).start()
    fault: dict[str, Any] = {}
    fault_error = None
    try:
        fault = FAULTS[name](fleet, traffic, opts)
    except (FleetError, TimeoutError, OSError) as e:
        fault_error = f"{type(e).__name__}: {e}"
    finally:
        tail = 0 if name == "steady" else opts.tail_requests
        tail_from = traffic.now()
        while traffic.running() and not (
            len(traffic.records) >= opts.requests
            and sum(r.start >= tail_from for r in traffic.records) >= tail
        ):
            time.sleep(0.2)
        traffic.stop()
        ended = traffic.wait()
    quiet_started = time.monotonic()
    quiet, load_after = fleet.wait_quiet(timeout_s=opts.quiet_timeout_s)
    quiet_s = round(time.monotonic() - quiet_started, 3)
    probes_after = fleet.probes()
    sampler.stop()
    records = sorted(traffic.records, key=lambda r: r.start)

    # Times as seconds since t0.
    for key in [k for k, v in fault.items() if k == "at" or k.endswith("_at")]:
        fault[key] = round(fault[key] - t0, 3)
    summary = summarize(records)
    result: dict[str, Any] = {
        "scenario": name,
        "options": vars(opts),
        "fleet": fleet.config.describe(),
        "requests": summary,
        "traffic_ended": ended,
        "tail_from": round(tail_from, 3),
        "fault": fault,
        "fault_error": fault_error,
        "first_errors": fleet.first_errors(),
        "events": [(round(t - t0, 3), what) for t, what in fleet.events if t >= t0],
        "router": {
            "prefill_retries": sum(
                sampler.router_total("vllm_disagg_router_prefill_retries").values()
            ),
            "decode_retries": sum(
                sampler.router_total("vllm_disagg_router_decode_retries").values()
            ),
            "prefill_failures": sampler.router_total(
                "vllm_disagg_router_prefill_failures"
            ),
            "instance_removals": sampler.router_total(
                "vllm_disagg_router_instance_removals"
            ),
            "requests": sampler.router_total("vllm_disagg_router_requests"),
            "decode_prefill_fallbacks": sampler.router_total(
                "vllm_disagg_router_decode_prefill_fallbacks"
            ),
            "breaker_opens": sum(
                sampler.router_total("vllm_disagg_router_breaker_opens").values()
            ),
        },
        "decode": {
            "failed_loads": sampler.member_total("vllm:p2p_failed_loads", "decode"),
            "dropped": sampler.member_total("vllm:p2p_dropped", "decode"),
            "bytes_received": sampler.member_total("vllm:p2p_bytes_received", "decode"),
            "external_prefix_cache_hits": sampler.member_total(
                "vllm:external_prefix_cache_hits", "decode"
            ),
            "rejected_messages": sampler.member_total(
                "vllm:p2p_rejected_messages", "decode"
            ),
        },
        "prefill": {
            "failed_sends": sampler.member_total("vllm:p2p_failed_sends", "prefill"),
            "bytes_sent": sampler.member_total("vllm:p2p_bytes_sent", "prefill"),
            "rejected_messages": sampler.member_total(
                "vllm:p2p_rejected_messages", "prefill"
            ),
        },
        "quiet": quiet,
        "quiet_after_s": quiet_s,
        # Readings of P2P gauges, idle, that needed a step to be fresh (see
        # Fleet.wait_quiet).
        "gauge_flushes": [
            {**f, "t": round(f["t"] - t0, 3)} for f in fleet.gauge_flushes[flushes:]
        ],
        "load_before": load_before,
        "load_after": load_after,
        "instances_after": instance_summary(fleet),
        "processes_before": _probe_dict(probes_before),
        "processes_after": _probe_dict(probes_after),
        "growth": growth(probes_before, probes_after),
        "growth_second_half": late_growth(
            sampler.series, 0.0, max((r.end for r in records), default=0.0)
        ),
        "series": sampler.series,
        "records": [r.as_dict() for r in records],
    }
    if "at" in fault:
        result["recovery"] = recovery(records, fault["at"])
    return result


def warm_up(
    fleet: Fleet,
    specs: list[Spec],
    references: dict[str, list[list[int]]],
    *,
    concurrency: int = 8,
    timeout_s: float = 300.0,
) -> list[Record]:
    """Send ``specs`` through the router (every P-D channel set up, every
    thread pool grown); the records."""
    run = TrafficRun(
        fleet.url, specs, references, concurrency=concurrency, duration_s=timeout_s
    ).start()
    run.wait()
    return run.records
