"""The registry's per-request lookups at fleet scale: ``healthy()`` ran a
heartbeat-expiry scan and a candidate scan over every instance on each call,
three calls per request (2 ms of selection per request at 1,000 instances,
benchmarks/router_scale.py). Now expiry scans only once a deadline may have
passed, and candidate lists are rebuilt only when membership or roles change;
these tests pin that, and that the answers are still those of a scan."""

from __future__ import annotations

import random

from vllm_disagg.router.registry import InstanceRegistry
from vllm_disagg.wire.discovery import DISCOVERY_VERSION, Register, Role

from .conftest import FakeClock


class ScanCounter(dict):
    """The registry's instance table, counting full scans."""

    scans = 0

    def values(self):
        self.scans += 1
        return super().values()


def reg(instance_id: str, role: Role, port: int, **fields) -> Register:
    model = fields.pop("model", "m")
    http, kv = f"10.0.0.1:{port}", f"10.0.0.1:{port + 5000}"
    return Register(DISCOVERY_VERSION, instance_id, role, http, kv, model, **fields)


def make(**kwargs) -> tuple[InstanceRegistry, FakeClock, ScanCounter]:
    clock = FakeClock()
    registry = InstanceRegistry(clock=clock, **kwargs)
    registry._instances = table = ScanCounter()
    return registry, clock, table


def ids(instances) -> list[str]:
    return [i.instance_id for i in instances]


def scan(registry: InstanceRegistry, side: Role, model: str | None = None):
    """What healthy() answered before: every instance checked."""
    now = registry.clock()
    return [
        i.instance_id
        for i in dict.values(registry._instances)
        if i.serves(side)
        and i.answers_to(model)
        and not i.stalled
        and i.breaker.admits(now)
    ]


def test_requests_do_not_scan_the_registry_between_changes():
    registry, clock, table = make(heartbeat_timeout_s=10.0)
    for n in range(200):
        registry.register(reg(f"i{n}", Role.PREFILL if n % 2 else Role.DECODE, n))
    table.scans = 0
    for _ in range(100):  # 100 requests' lookups, heartbeats between them
        assert len(registry.healthy(Role.PREFILL, "m")) == 100
        assert len(registry.healthy(Role.DECODE, "m")) == 100
    registry.register(reg("i3", Role.PREFILL, 3, seq=1))
    clock.advance(1.0)
    assert len(registry.healthy(Role.PREFILL, "m")) == 100
    # One expiry scan (two passes), one list per (side, model); it was two
    # scans per call, 400 here.
    assert table.scans <= 4, table.scans


def test_candidates_follow_joins_leaves_roles_breakers_and_stalls():
    registry, clock, _ = make(breaker_failures=1, breaker_cooldown_s=5.0)
    registry.register(reg("p", Role.PREFILL, 1))
    registry.register(reg("d", Role.DECODE, 2, aliases=("alias",)))
    registry.register(reg("b", Role.BOTH, 3))
    registry.register(reg("o", Role.PREFILL, 4, model="other"))
    for model in (None, "m", "alias", "other"):
        assert ids(registry.healthy(Role.PREFILL, model)) == scan(
            registry, Role.PREFILL, model
        )
    assert ids(registry.healthy(Role.DECODE, "alias")) == ["d"]
    assert ids(registry.healthy(Role.PREFILL, "m")) == ["p", "b"]

    registry.register(reg("p2", Role.PREFILL, 5))  # a join
    assert ids(registry.healthy(Role.PREFILL, "m")) == ["p", "b", "p2"]
    registry.register(reg("p", Role.DECODE, 1, seq=1))  # a role change
    assert ids(registry.healthy(Role.PREFILL, "m")) == ["b", "p2"]
    assert ids(registry.healthy(Role.DECODE, "m")) == ["p", "d", "b"]
    registry.deregister("b")  # a leave
    assert ids(registry.healthy(Role.DECODE, "m")) == ["p", "d"]

    registry.report(registry.get("d"), False)  # its breaker opens
    assert ids(registry.healthy(Role.DECODE, "m")) == ["p"]
    clock.advance(5.0)  # half-open: one trial may go
    assert ids(registry.healthy(Role.DECODE, "m")) == ["p", "d"]
    lease = registry.reserve(registry.get("d"))
    assert ids(registry.healthy(Role.DECODE, "m")) == ["p"]
    lease.release(True)
    assert ids(registry.healthy(Role.DECODE, "m")) == ["p", "d"]

    registry.register(reg("p", Role.DECODE, 1, seq=2, stalled_s=60.0))
    assert ids(registry.healthy(Role.DECODE, "m")) == ["d"]
    registry.register(reg("p", Role.DECODE, 1, seq=3))
    assert ids(registry.healthy(Role.DECODE, "m")) == ["p", "d"]


def test_a_client_naming_many_models_keeps_the_candidate_lists_bounded():
    from vllm_disagg.router.registry import MAX_SERVING_LISTS

    registry, _, _ = make()
    registry.register(reg("p", Role.PREFILL, 1))
    for n in range(3 * MAX_SERVING_LISTS):
        assert registry.healthy(Role.PREFILL, f"no-such-model-{n}") == []
    assert len(registry._serving) <= MAX_SERVING_LISTS
    assert ids(registry.healthy(Role.PREFILL, "m")) == ["p"]


def test_expiry_without_a_scan_per_request_removes_each_on_time():
    """Random heartbeats, intervals (which stretch or shrink a timeout),
    leaves and clock steps: after each, healthy() answers what a scan of
    every deadline says."""
    rng = random.Random(7)
    registry, clock, _ = make(heartbeat_timeout_s=10.0)
    # name -> (last heartbeat, timeout), compared as the registry's scan does
    deadline: dict[str, tuple[float, float]] = {}
    seqs: dict[str, int] = {}
    for _ in range(3000):
        op = rng.random()
        name = f"i{rng.randrange(40)}"
        if op < 0.45:
            interval = rng.choice([1.0, 3.0, 5.0, 8.0])
            seqs[name] = seqs.get(name, 0) + 1
            registry.register(
                reg(
                    name,
                    Role.PREFILL,
                    int(name[1:]),
                    seq=seqs[name],
                    interval_s=interval,
                )
            )
            deadline[name] = (clock.now, max(10.0, 3 * interval))
        elif op < 0.5:
            registry.deregister(name)
            deadline.pop(name, None)
        else:
            clock.advance(rng.choice([0.1, 0.5, 1.0, 2.5, 7.0]))
        alive = {n for n, (at, after) in deadline.items() if clock.now - at <= after}
        assert set(ids(registry.healthy(Role.PREFILL))) == alive
        for gone in set(deadline) - alive:
            del deadline[gone]
    assert registry.removals["expired"] > 50


def test_only_suspect_instances_are_checked_and_each_leaves_when_well():
    """healthy() checks one by one only the instances stalled or with a
    breaker not closed; one that recovers (or leaves) is dropped from them."""
    registry, clock, _ = make(breaker_failures=1, breaker_cooldown_s=5.0)
    for n in range(6):
        registry.register(reg(f"p{n}", Role.PREFILL, n))
    static = registry.add_static(Role.PREFILL, "10.0.0.9:1", "10.0.0.9:2", "m")
    registry.mark_unreachable("10.0.0.9:1")  # a static one: its breaker opens
    registry.report(registry.get("p1"), False)
    registry.register(reg("p2", Role.PREFILL, 2, seq=1, stalled_s=60.0))
    assert set(registry._suspects) == {static.instance_id, "p1", "p2"}
    assert ids(registry.healthy(Role.PREFILL)) == ["p0", "p3", "p4", "p5"]
    assert ids(registry.healthy(Role.PREFILL)) == scan(registry, Role.PREFILL)

    clock.advance(5.0)  # half-open: back for one trial each
    assert ids(registry.healthy(Role.PREFILL)) == scan(registry, Role.PREFILL)
    assert ids(registry.healthy(Role.PREFILL)) == [
        "p0",
        "p1",
        "p3",
        "p4",
        "p5",
        static.instance_id,
    ]
    registry.reserve(registry.get("p1")).release(True)  # the trial closes it
    registry.reserve(static).release(True)
    registry.register(reg("p2", Role.PREFILL, 2, seq=2))  # steps again
    assert registry._suspects == {}
    assert len(registry.healthy(Role.PREFILL)) == 7

    registry.report(registry.get("p4"), False)
    registry.deregister("p4")
    assert registry._suspects == {}
