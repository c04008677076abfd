"""InstanceRegistry: membership, heartbeat expiry and circuit breakers, on
an injected clock (no sleeps)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_disagg.router.registry import (
    REMOVAL_REASONS,
    BreakerState,
    InstanceRegistry,
    RegistryRefused,
)
from vllm_disagg.wire.discovery import DISCOVERY_VERSION, Register, Role

from .conftest import FakeClock


def reg(
    instance_id: str, role: Role = Role.PREFILL, port: int = 20001, **fields
) -> Register:
    model = fields.pop("model", "m")
    http, kv = f"10.0.0.1:{port}", f"10.0.0.1:{port + 1000}"
    return Register(DISCOVERY_VERSION, instance_id, role, http, kv, model, **fields)


def make(**kwargs) -> tuple[InstanceRegistry, FakeClock]:
    clock = FakeClock()
    return InstanceRegistry(clock=clock, **kwargs), clock


def ids(instances) -> list[str]:
    return [i.instance_id for i in instances]


def test_roles_decide_which_side_an_instance_serves():
    registry, _ = make()
    registry.register(reg("p", Role.PREFILL, 1))
    registry.register(reg("d", Role.DECODE, 2))
    registry.register(reg("b", Role.BOTH, 3))
    assert ids(registry.healthy(Role.PREFILL)) == ["p", "b"]
    assert ids(registry.healthy(Role.DECODE)) == ["d", "b"]
    assert registry.counts() == {"prefill": 1, "decode": 1, "both": 1}


def test_heartbeats_keep_an_instance_and_silence_expires_it():
    registry, clock = make(heartbeat_timeout_s=10.0)
    assert registry.register(reg("p")) is True
    clock.advance(9.0)
    assert registry.register(reg("p", seq=1)) is False  # a heartbeat, not a join
    clock.advance(9.0)
    assert ids(registry.healthy(Role.PREFILL)) == ["p"]
    clock.advance(1.5)
    assert registry.healthy(Role.PREFILL) == [] and registry.removals["expired"] == 1


def test_slow_heartbeat_interval_stretches_the_timeout():
    registry, clock = make(heartbeat_timeout_s=10.0)
    registry.register(reg("p", interval_s=5.0))  # 3 missed beats = 15 s
    clock.advance(14.0)
    assert len(registry.expire()) == 0
    clock.advance(2.0)
    assert ids(registry.expire()) == ["p"]


def test_new_incarnation_at_the_same_address_replaces_the_old():
    registry, _ = make()
    registry.register(reg("old", port=1))
    old = registry.get("old")
    old.outstanding = 5
    registry.register(reg("new", port=1))
    assert ids(registry.healthy(Role.PREFILL)) == ["new"]
    assert registry.get("new").outstanding == 0 and registry.removals["replaced"] == 1


def test_a_heartbeat_refreshes_what_may_change_and_keeps_the_load():
    registry, _ = make()
    registry.register(reg("p", port=1))
    lease = registry.reserve(registry.get("p"))  # held: the load stays
    registry.register(reg("p", port=1, dp_rank=1, dp_size=2, seq=1))
    instance = registry.get("p")
    assert (instance.dp_rank, instance.dp_size, instance.outstanding) == (1, 2, 1)
    lease.release(True)
    assert instance.outstanding == 0


@pytest.mark.parametrize(
    "change",
    [
        {"port": 2},
        {"model": "other"},
        {"aliases": ("x",)},
    ],
)
def test_a_frame_under_a_known_id_that_moves_its_addresses_or_names_is_refused(change):
    """An incarnation keeps its addresses and names: without a token, a
    forged frame under a victim's id (ids are listed) moved its KV address."""
    registry, _ = make()
    registry.register(reg("p", port=1))
    with pytest.raises(RegistryRefused) as e:
        registry.register(reg("p", **{"port": 1, "seq": 1, **change}))
    assert e.value.kind == "stale"
    assert registry.get("p").kv_addr == reg("p", port=1).kv_addr


def test_a_name_that_already_names_another_model_is_refused():
    """Two models sharing an alias answered its requests in turn."""
    registry, _ = make()
    registry.register(reg("a", port=1, model="a", aliases=("shared",)))
    with pytest.raises(RegistryRefused) as e:
        registry.register(reg("b", port=2, model="b", aliases=("shared",)))
    assert e.value.kind == "conflict"
    with pytest.raises(RegistryRefused):
        registry.register(reg("c", port=3, model="shared"))
    registry.register(
        reg("a2", port=4, model="a", aliases=("shared",))
    )  # the same model: fine
    registry.deregister("a")
    registry.deregister("a2")
    registry.register(reg("b", port=2, model="b", aliases=("shared",)))  # free again


def test_deregister_and_unreachable_remove_at_once():
    registry, _ = make()
    registry.register(reg("a", port=1))
    registry.register(reg("b", port=2))
    assert registry.deregister("a") and not registry.deregister("a")
    registry.mark_unreachable("10.0.0.1:2")
    assert len(registry) == 0
    assert +registry.removals == {"deregistered": 1, "unreachable": 1}
    # Every reason is exported from the start (at 0), so an alert's increase()
    # sees the first removal of each kind.
    assert set(registry.removals) == set(REMOVAL_REASONS)


def test_static_instances_never_expire_and_unreachable_opens_their_breaker():
    registry, clock = make(breaker_cooldown_s=5.0)
    static = registry.add_static(Role.DECODE, "10.0.0.9:8000", "10.0.0.9:9000", None)
    clock.advance(3600.0)
    assert registry.healthy(Role.DECODE, model="anything") == [static]
    registry.mark_unreachable("10.0.0.9:8000")
    assert registry.healthy(Role.DECODE) == [] and len(registry) == 1
    clock.advance(5.0)
    assert registry.healthy(Role.DECODE) == [static]  # half-open: one trial
    assert registry.breaker_opens == 1


def test_breaker_counts_consecutive_failures_only():
    registry, _ = make(breaker_failures=3)
    registry.register(reg("p"))
    instance = registry.get("p")
    for ok in (False, False, True, False, False, None):
        registry.reserve(instance).release(ok)
    assert registry.breaker_state(instance) is BreakerState.CLOSED
    registry.reserve(instance).release(False)
    assert registry.breaker_state(instance) is BreakerState.OPEN
    assert registry.healthy(Role.PREFILL) == [] and instance.outstanding == 0


def test_half_open_allows_one_trial_that_closes_or_reopens():
    registry, clock = make(breaker_failures=1, breaker_cooldown_s=10.0)
    registry.register(reg("p"))
    instance = registry.get("p")
    registry.reserve(instance).release(False)
    clock.advance(9.0)
    registry.register(reg("p", seq=1))
    assert registry.healthy(Role.PREFILL) == []
    clock.advance(1.0)
    assert registry.healthy(Role.PREFILL) == [instance]
    trial = registry.reserve(instance)  # the trial
    assert registry.healthy(Role.PREFILL) == []
    trial.release(False)  # failed: open for another cool-down
    assert registry.breaker_state(instance) is BreakerState.OPEN
    clock.advance(10.0)
    registry.register(reg("p", seq=2))
    # The client left: no verdict, the trial slot is freed.
    registry.reserve(instance).release(None)
    assert registry.healthy(Role.PREFILL) == [instance]
    registry.reserve(instance).release(True)
    assert registry.breaker_state(instance) is BreakerState.CLOSED
    assert registry.breaker_opens == 2


def test_models_and_model_filter():
    registry, _ = make()
    registry.register(reg("a", port=1, model="x"))
    registry.register(reg("b", port=2, model="y"))
    assert registry.models() == ["x", "y"]
    assert ids(registry.healthy(Role.PREFILL, model="y")) == ["b"]
    assert registry.serves_model("x") and not registry.serves_model("z")


def test_snapshot_shows_role_age_load_and_breaker():
    registry, clock = make()
    registry.register(reg("p", dp_rank=1, dp_size=2))
    _held = registry.reserve(registry.get("p"))  # the load stays while held
    clock.advance(4.0)
    registry.register(reg("p", dp_rank=1, dp_size=2, seq=1))
    clock.advance(1.0)
    [entry] = registry.snapshot()
    assert entry == {
        "instance_id": "p",
        "role": "prefill",
        "http_addr": "10.0.0.1:20001",
        "kv_addr": "10.0.0.1:21001",
        "model": "m",
        "aliases": [],
        "dp_rank": 1,
        "dp_size": 2,
        "dp_group": "",
        "tokens_in_flight": 0,
        "static": False,
        "age_s": 5.0,
        "last_heartbeat_s": 1.0,
        "outstanding": 1,
        "breaker": "closed",
        "consecutive_failures": 0,
        "state": "ready",
        "stalled_s": 0.0,
        "fingerprint": "",
        "max_model_len": 0,  # not sent: not known
        "paired": False,  # no decode registered
    }


def test_only_instances_of_one_model_fingerprint_pair():
    registry, _ = make()
    registry.register(reg("p-old", port=1, fingerprint="aa" * 16))
    registry.register(reg("d-new", role=Role.DECODE, port=2, fingerprint="bb" * 16))
    p_old, d_new = registry.get("p-old"), registry.get("d-new")
    assert registry.partners(d_new) == [] and registry.partners(p_old) == []
    assert registry.unpaired_counts() == {"prefill": 1, "decode": 1, "both": 0}
    registry.register(reg("p-new", port=3, fingerprint="bb" * 16))
    assert registry.partners(d_new) == [registry.get("p-new")]
    assert registry.unpaired_counts() == {"prefill": 1, "decode": 0, "both": 0}
    listed = {e["instance_id"]: e for e in registry.snapshot()}
    assert listed["p-old"]["paired"] is False and listed["d-new"]["paired"] is True
    # An instance that sends no fingerprint (static, older) is taken at its word.
    registry.register(reg("d-any", role=Role.DECODE, port=4))
    assert registry.get("p-old") in registry.partners(registry.get("d-any"))
    # An incarnation keeps its fingerprint: a frame that changes it is refused.
    with pytest.raises(RegistryRefused):
        registry.register(reg("p-new", port=3, fingerprint="cc" * 16, seq=5))


def test_registry_and_policy_import_neither_quart_nor_vllm():
    code = (
        "import sys, vllm_disagg.router.registry, vllm_disagg.router.policy\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('quart', 'vllm', "
        "'torch', 'aiohttp', 'hypercorn', 'uvicorn', 'zmq', 'prometheus_client'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_registration_is_constant_time_and_the_registry_bounded():
    """40,000 registrations slowed registration from 4,155/s to 797/s: each
    scanned every instance. 20,000 here take well under a second without
    the scan (about 20 s with it)."""
    import time

    import pytest

    from vllm_disagg.router.registry import RegistryFull

    registry = InstanceRegistry(clock=FakeClock(), max_instances=20_000)
    start = time.monotonic()
    for i in range(20_000):
        registry.register(reg(f"i{i}", port=1 + i))
    assert time.monotonic() - start < 5.0
    assert len(registry) == 20_000
    with pytest.raises(RegistryFull):
        registry.register(reg("one-more", port=30_000))
    registry.register(reg("i7", port=8, seq=1))  # a known instance still refreshes
    # A new incarnation at a known address still replaces the old one.
    registry.register(reg("i7-again", port=8))
    assert registry.get("i7") is None and registry.get("i7-again") is not None


def test_a_lease_ends_its_reservation_once():
    registry, _ = make(breaker_failures=1)
    registry.register(reg("p"))
    instance = registry.get("p")
    lease = registry.reserve(instance)
    lease.release(True)
    lease.release(False)  # a second release: nothing (no failure counted)
    assert instance.outstanding == 0 and instance.consecutive_failures == 0
    assert registry.breaker_state(instance) is BreakerState.CLOSED


def test_a_transferred_lease_holds_the_reservation_until_the_new_one_ends():
    registry, _ = make()
    registry.register(reg("p"))
    instance = registry.get("p")
    first = registry.reserve(instance)
    second = first.transfer()
    first.release(False)  # moved: the old lease ends nothing
    assert instance.outstanding == 1 and instance.consecutive_failures == 0
    second.release(False)
    assert instance.outstanding == 0 and instance.consecutive_failures == 1
    with pytest.raises(RuntimeError):
        first.transfer()


def test_a_lease_collected_unreleased_is_released_counted_and_logged(caplog):
    import gc

    registry, _ = make(breaker_failures=1)
    registry.register(reg("p"))
    instance = registry.get("p")
    with caplog.at_level("WARNING"):
        registry.reserve(instance)  # dropped at once
        registry.reserve(instance)
        gc.collect()
    assert instance.outstanding == 0 and registry.leaked_leases == 2
    # No verdict: a lost lease is the router's bug, not the instance's.
    assert registry.breaker_state(instance) is BreakerState.CLOSED
    logged = [r for r in caplog.records if "never released" in r.getMessage()]
    assert len(logged) == 1  # rate-limited: the counter has the rest
