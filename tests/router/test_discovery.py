"""Service discovery over real ZMQ on loopback: registrations, tokens,
rejected frames and a flood of garbage."""

from __future__ import annotations

import asyncio
import os
import random
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from vllm_disagg import envs
from vllm_disagg.wire.discovery import (
    DISCOVERY_VERSION,
    MIN_DISCOVERY_VERSION,
    Ack,
    Deregister,
    Register,
    Role,
    open_frame,
    seal,
)

from .conftest import WAIT_S

TOKEN = b"fleet-secret"


def register(instance_id: str = "i-1", **fields) -> Register:
    values = dict(
        version=DISCOVERY_VERSION,
        instance_id=instance_id,
        role=Role.DECODE,
        http_addr="127.0.0.1:20002",
        kv_addr="127.0.0.1:22001",
        model="m",
        sent_at=time.time(),
    )
    return Register(**{**values, **fields})


class Instance:
    """The instance side of discovery: one DEALER socket to the router."""

    def __init__(
        self, port: int, token: bytes | None, router_token: bytes | None
    ) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.token = token
        self.router_token = router_token

    async def send(self, frames: list[bytes]) -> Ack:
        async with asyncio.timeout(WAIT_S):
            await self.sock.send_multipart(frames)
            reply = await self.sock.recv_multipart()
        # Acks are signed with the router's token.
        return open_frame(self.router_token, reply)

    async def message(self, msg) -> Ack:
        return await self.send(seal(self.token, msg))

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
async def discovery(start_router):
    """(router, connect) where connect(token) gives a connected Instance."""
    made: list[Instance] = []

    async def make(token: bytes | None = None):
        router = await start_router(
            registration_token=token.decode() if token else None
        )
        router_token = router.state.config.token

        def connect(instance_token: bytes | None = router_token) -> Instance:
            instance = Instance(
                router.state.discovery.port, instance_token, router_token
            )
            made.append(instance)
            return instance

        return router, connect

    yield make
    for instance in made:
        instance.close()


async def test_register_heartbeat_deregister(discovery):
    router, connect = await discovery()
    instance = connect()
    ack = await instance.message(register())
    assert ack == Ack(DISCOVERY_VERSION, "i-1", True)
    [listed] = router.registry.snapshot()
    assert (listed["instance_id"], listed["role"], listed["http_addr"]) == (
        "i-1",
        "decode",
        "127.0.0.1:20002",
    )

    router.clock.advance(8.0)
    assert (await instance.message(register(seq=1))).accepted
    router.clock.advance(8.0)  # 16 s after joining, 8 s after the heartbeat
    assert router.registry.get("i-1") is not None
    router.clock.advance(3.0)
    assert router.registry.snapshot() == []  # silent 11 s > 10 s: expired

    # Its last heartbeat, replayed, does not bring it back; its next one does.
    assert not (await instance.message(register(seq=1))).accepted
    assert (await instance.message(register(seq=2))).accepted
    assert (
        await instance.message(Deregister(DISCOVERY_VERSION, "i-1", time.time()))
    ).accepted
    assert len(router.registry) == 0
    assert (
        router.metric("vllm_disagg_router_discovery_accepted_total", type="register")
        == 3
    )
    assert (
        router.metric("vllm_disagg_router_instance_removals_total", reason="expired")
        == 1
    )


class RegisterV3(msgspec.Struct, forbid_unknown_fields=True, tag="register"):
    """Register as a router speaking only version 3 decodes it."""

    version: int
    instance_id: str
    role: Role
    http_addr: str
    kv_addr: str
    model: str
    aliases: tuple[str, ...] = ()
    dp_rank: int = 0
    dp_size: int = 1
    seq: int = 0
    interval_s: float = 3.0
    sent_at: float = 0.0
    stalled_s: float = 0.0
    fingerprint: str = ""
    max_model_len: int = 0


GROUP = "0123456789abcdef"


async def test_version_4_names_dp_groups_and_version_3_still_registers(discovery):
    router, connect = await discovery()
    instance = connect()
    # A version-3 instance (no dp_group): taken, answered in version 3.
    ack = await instance.message(register("old", version=MIN_DISCOVERY_VERSION))
    assert ack == Ack(MIN_DISCOVERY_VERSION, "old", True)
    # A DP=1 instance of this version sends 3, and a router speaking only 3
    # (unknown fields forbidden) decodes its frame: dp_group is not in it.
    payload = seal(None, register("new", version=MIN_DISCOVERY_VERSION))[0]
    assert b"dp_group" not in payload
    old_router = msgspec.msgpack.Decoder(RegisterV3 | Ack)
    assert old_router.decode(payload).instance_id == "new"
    # The ranks of one DP group, version 4: listed with their group.
    for rank in (0, 1):
        ack = await instance.message(
            register(
                f"r{rank}",
                http_addr=f"127.0.0.1:{20010 + rank}",
                kv_addr=f"127.0.0.1:{22010 + rank}",
                dp_rank=rank,
                dp_size=2,
                dp_group=GROUP,
            )
        )
        assert ack == Ack(DISCOVERY_VERSION, f"r{rank}", True)
    listed = {i["instance_id"]: i["dp_group"] for i in router.registry.snapshot()}
    assert listed == {"old": "", "r0": GROUP, "r1": GROUP}
    assert router.registry.dp_groups() == {f"decode/{GROUP}": ["r0", "r1"]}
    # Bounded: hex, at most 32 digits, only with DP above 1 and version 4.
    for bad in (
        {"dp_group": "x" * 8, "dp_size": 2},
        {"dp_group": "a" * 33, "dp_size": 2},
        {"dp_group": GROUP},  # dp_size 1
        {"dp_group": GROUP, "dp_size": 2, "version": MIN_DISCOVERY_VERSION},
    ):
        ack = await instance.message(register("bad", **bad))
        assert ack.reason.startswith("malformed") and "dp_group" in ack.reason, bad
    # An incarnation keeps its group: a frame under its id naming another is
    # not from it.
    ack = await instance.message(
        register(
            "r0",
            http_addr="127.0.0.1:20010",
            kv_addr="127.0.0.1:22010",
            dp_size=2,
            dp_group="f" * 16,
            seq=1,
        )
    )
    assert not ack.accepted and ack.reason.startswith("stale")


async def test_token_required_when_set(discovery):
    router, connect = await discovery(TOKEN)
    assert (await connect().message(register("good"))).accepted

    for token in (None, b"wrong"):
        ack = await connect(token).message(register("bad"))
        assert not ack.accepted and ack.reason.startswith("unauthenticated")
    assert (
        router.registry.get("bad") is None and router.registry.get("good") is not None
    )
    assert (
        router.metric(
            "vllm_disagg_router_discovery_rejected_total", kind="unauthenticated"
        )
        == 2
    )

    # A captured, signed frame replayed much later is refused as stale.
    old = register("late", sent_at=time.time() - 3600)
    ack = await connect().message(old)
    assert not ack.accepted and ack.reason.startswith("stale")


async def test_token_from_the_environment(discovery, monkeypatch):
    monkeypatch.setenv(envs.VLLM_DISAGG_ROUTER_TOKEN, TOKEN.decode())
    router, connect = await discovery()
    assert (await connect(TOKEN).message(register())).accepted
    assert not (await connect(None).message(register("unsigned"))).accepted
    assert [i["instance_id"] for i in router.registry.snapshot()] == ["i-1"]


async def test_malformed_and_foreign_messages_are_rejected_and_counted(discovery):
    router, connect = await discovery()
    instance = connect()
    cases = {
        "malformed": [b"\x93garbage", b""],
        "oversized": [b"x" * 5000, b""],
    }
    for kind, frames in cases.items():
        ack = await instance.send(frames)
        assert not ack.accepted and ack.reason.startswith(kind)
    wrong_version = msgspec.msgpack.encode(
        {"type": "register", **msgspec.to_builtins(register()), "version": 99}
    )
    ack = await instance.send([wrong_version, b""])
    assert ack.reason.startswith("version")
    ack = await instance.message(register(http_addr="no port"))
    assert ack.reason.startswith("malformed") and "http_addr" in ack.reason
    ack = await instance.message(Ack(DISCOVERY_VERSION, "i-1", True))
    assert ack.reason.startswith("malformed")
    ack = await instance.message(register(aliases=tuple(f"a{i}" for i in range(9))))
    assert ack.reason.startswith("malformed") and "aliases" in ack.reason
    # A newline in a name would forge a line in the router's log.
    ack = await instance.message(register(model="m\nINFO forged"))
    assert ack.reason.startswith("malformed") and "printable" in ack.reason
    ack = await instance.message(register(sent_at=float("nan")))
    assert ack.reason.startswith("malformed") and "sent_at" in ack.reason
    # Without a token too, a clock from the future would lock an address.
    ack = await instance.message(register(sent_at=time.time() + 1e6))
    assert ack.reason.startswith("stale")
    ack = await instance.message(register(seq=2**62))
    assert ack.reason.startswith("malformed") and "seq" in ack.reason
    ack = await instance.message(register(max_model_len=-1))
    assert ack.reason.startswith("malformed") and "max_model_len" in ack.reason
    assert len(router.registry) == 0
    assert (
        router.metric("vllm_disagg_router_discovery_rejected_total", kind="malformed")
        == 8
    )
    assert (
        router.metric("vllm_disagg_router_discovery_rejected_total", kind="version")
        == 1
    )


async def test_flood_of_garbage_is_survived(discovery):
    """Random bytes in random frame counts: every one answered and counted,
    quickly, and a real registration still goes through afterwards."""
    router, connect = await discovery(TOKEN)
    instance = connect()
    rng = random.Random(0)
    count = 2000
    started = time.monotonic()
    async with asyncio.timeout(30):
        for _ in range(count):
            frames = [
                os.urandom(rng.randint(0, 300))
                for _ in range(rng.choice((1, 2, 2, 3, 7)))
            ]
            await instance.sock.send_multipart(frames)
        for _ in range(count):
            await instance.sock.recv_multipart()
    elapsed = time.monotonic() - started
    rejected = router.state.discovery.rejected
    assert sum(rejected.values()) == count
    assert set(rejected) >= {"malformed", "unauthenticated"}
    assert elapsed < 15.0
    assert (await instance.message(register())).accepted
    assert router.registry.get("i-1") is not None


def test_replays_and_stale_incarnations_are_refused_even_with_a_token():
    """A captured Register replayed within the clock-skew window rolled a
    live instance back, and an old incarnation's frame evicted its successor."""
    from vllm_disagg.router.discovery import DiscoveryServer
    from vllm_disagg.router.registry import InstanceRegistry

    registry = InstanceRegistry()
    server = DiscoveryServer(registry, host="127.0.0.1", port=0, token=TOKEN)
    now = time.time()
    old = register("old", seq=7, sent_at=now - 60)
    new = register("new", seq=0, sent_at=now - 5)

    def ack(msg, source="127.0.0.1"):
        return open_frame(TOKEN, server.handle(seal(TOKEN, msg), source))

    assert ack(old).accepted and ack(new).accepted  # a restart: the new one takes over
    assert registry.get("old") is None
    assert not ack(old).accepted  # the old incarnation's frame, replayed
    assert registry.get("new") is not None
    assert ack(register("new", seq=3, sent_at=now)).accepted
    refused = ack(register("new", seq=2, sent_at=now))  # an earlier heartbeat, replayed
    assert not refused.accepted and refused.reason.startswith("replayed")
    # Another instance may not take the kv_addr with an older registration.
    thief = register("thief", http_addr="127.0.0.1:29999", sent_at=now - 30)
    assert not ack(thief).accepted and registry.get("new").kv_addr == "127.0.0.1:22001"
    # The old incarnation's replay is refused twice over: replaced (retired)
    # and removed after heartbeat 7; its seq says "replayed" first.
    assert server.rejected["replayed"] == 2 and server.rejected["stale"] == 1


def test_unsigned_registrations_only_from_loopback_unless_told_otherwise():
    from vllm_disagg.router.discovery import DiscoveryServer
    from vllm_disagg.router.registry import InstanceRegistry

    registry = InstanceRegistry()
    server = DiscoveryServer(registry, host="127.0.0.1", port=0, token=None)
    remote = open_frame(None, server.handle(seal(None, register()), "10.1.2.3"))
    assert not remote.accepted and "loopback" in remote.reason and len(registry) == 0
    assert open_frame(None, server.handle(seal(None, register()), "::1")).accepted
    server.allow_remote_unsigned = True
    assert open_frame(
        None, server.handle(seal(None, register("i-2", seq=1)), "10.1.2.3")
    ).accepted


# --- timing and replay edges (issue 28) ---------------------------------------


def _server(token: bytes | None = TOKEN):
    """(server, registry clock, wall clock, ack): a DiscoveryServer on
    injected clocks; ack(frames) opens the Ack it answers with."""
    from vllm_disagg.router.discovery import DiscoveryServer
    from vllm_disagg.router.registry import InstanceRegistry

    from .conftest import FakeClock

    clock, wall = FakeClock(), [time.time()]
    registry = InstanceRegistry(clock=clock)
    server = DiscoveryServer(
        registry, host="127.0.0.1", port=0, token=token, wall_clock=lambda: wall[0]
    )

    def ack(frames: list[bytes]) -> Ack:
        return open_frame(token, server.handle(frames, "127.0.0.1"))

    return server, clock, wall, ack


def test_a_heartbeat_replayed_unchanged_keeps_no_dead_instance_listed():
    """An equal seq was accepted: one captured heartbeat, replayed every few
    seconds, kept a dead instance listed (and paired) until its sent_at
    left the clock window."""
    server, clock, wall, ack = _server()
    assert ack(seal(TOKEN, register(seq=0, sent_at=wall[0]))).accepted
    beat = seal(TOKEN, register(seq=1, sent_at=wall[0]))
    assert ack(beat).accepted
    for _ in range(4):  # the instance died; its last heartbeat is replayed
        clock.advance(3.0)
        wall[0] += 3.0
        refused = ack(beat)
        assert not refused.accepted and refused.reason.startswith("replayed")
        assert "each must be newer" in refused.reason
    assert server.registry.expire() and server.registry.get("i-1") is None
    assert server.rejected["replayed"] == 4


@pytest.mark.parametrize("removal", ["deregistered", "expired", "unreachable"])
def test_a_removed_instance_is_not_revived_by_its_old_frames(removal):
    server, clock, wall, ack = _server()
    registry = server.registry
    frames = [seal(TOKEN, register(seq=seq, sent_at=wall[0])) for seq in range(3)]
    assert all(ack(f).accepted for f in frames)
    if removal == "deregistered":
        assert ack(seal(TOKEN, Deregister(DISCOVERY_VERSION, "i-1", wall[0]))).accepted
    elif removal == "expired":
        clock.advance(11.0)
        wall[0] += 11.0
        assert registry.expire()
    else:
        registry.mark_unreachable("127.0.0.1:20002")
    assert registry.get("i-1") is None and registry.removals[removal] == 1

    for old in frames:  # the last one and older ones, within the clock window
        refused = ack(old)
        assert not refused.accepted and refused.reason.startswith("replayed")
        assert "removed after heartbeat 2" in refused.reason
    assert registry.get("i-1") is None
    # Still remembered just before REMOVED_TTL_S; after it, the frame's
    # sent_at is far outside the clock window: refused by the other rule.
    from vllm_disagg.router.departures import REMOVED_TTL_S
    from vllm_disagg.wire.clocks import MAX_CLOCK_SKEW_S

    assert REMOVED_TTL_S >= 2 * MAX_CLOCK_SKEW_S
    clock.advance(REMOVED_TTL_S - 12.0)
    with pytest.raises(Exception, match="removed after heartbeat 2"):
        registry.register(register(seq=2))
    clock.advance(2.0)
    wall[0] += REMOVED_TTL_S
    assert ack(frames[-1]).reason.startswith("stale")
    # A live instance (an unreachable one, a partition that healed) comes
    # back with its next heartbeat.
    assert ack(seal(TOKEN, register(seq=3, sent_at=wall[0]))).accepted
    assert registry.get("i-1") is not None


def test_forgetting_removed_instances_when_full_refuses_rather_than_revives(
    monkeypatch,
):
    """The memory of removed instances is bounded; one forgotten early is
    still refused (its frames are no newer than the newest forgotten)."""
    from vllm_disagg.router import departures

    monkeypatch.setattr(departures, "MAX_REMOVED", 2)
    server, _, wall, ack = _server()
    captured = {}
    for n, name in enumerate(("a", "b", "c")):
        msg = register(
            name,
            http_addr=f"127.0.0.1:{20010 + n}",
            kv_addr=f"127.0.0.1:{22010 + n}",
            sent_at=wall[0] - 10 + n,
        )
        captured[name] = seal(TOKEN, msg)
        assert ack(captured[name]).accepted
        assert ack(seal(TOKEN, Deregister(DISCOVERY_VERSION, name, wall[0]))).accepted
    assert "a" not in server.registry._departed.removed  # forgotten: the memory is full
    refused = ack(captured["a"])
    assert not refused.accepted and "could not remember" in refused.reason
    assert not ack(captured["c"]).accepted  # still remembered
    # A new instance (a fresh sent_at) is not held up.
    fresh = register("fresh", http_addr="127.0.0.1:20020", kv_addr="127.0.0.1:22020")
    assert ack(seal(TOKEN, fresh)).accepted


@pytest.mark.parametrize("token", [None, TOKEN], ids=["unsigned", "signed"])
def test_one_clock_rule_for_discovery_and_the_p2p_handshake(token):
    """The router accepted clocks 300 s off its own while a decode refused
    Hellos 300 s off its own: a prefill and a decode 600 s apart were
    paired and every transfer refused. Now the router accepts at most half
    what a Hello may be off (less slack), both ways, with or without token."""
    from vllm_disagg.wire import clocks, discovery

    assert discovery.MAX_CLOCK_SKEW_S is clocks.MAX_CLOCK_SKEW_S
    skew = clocks.MAX_CLOCK_SKEW_S
    hello_age, slack = clocks.MAX_HELLO_AGE_S, clocks.CLOCK_SLACK_S
    assert hello_age == 2 * skew + slack and slack > 0
    now = time.time()
    for offset in (-skew + 1, skew - 1):
        msg = open_frame(token, seal(token, register(sent_at=now + offset)), now=now)
        assert msg.sent_at == now + offset
    for offset, direction in ((-skew - 1, "behind"), (skew + 1, "ahead of")):
        with pytest.raises(discovery.DiscoveryError) as e:
            open_frame(token, seal(token, register(sent_at=now + offset)), now=now)
        assert e.value.kind == "stale"
        assert f"{skew + 1:.0f} s {direction} the router's" in str(e.value)
        assert f"at most {skew:.0f} s" in str(e.value) and "NTP" in str(e.value)


def test_a_prefill_and_a_decode_too_far_apart_are_refused_at_registration():
    """The issue's pair: 300 s ahead and 300 s behind the router (each was
    accepted, they could not talk). Both are refused now, each told why;
    nothing is paired."""
    server, _, wall, ack = _server()
    for name, role, offset in (
        ("p", Role.PREFILL, 299.0),
        ("d", Role.DECODE, -299.0),
    ):
        msg = register(
            name,
            role=role,
            http_addr=f"127.0.0.1:{20030 + len(name)}",
            kv_addr=f"127.0.0.1:{22030 + (role is Role.DECODE)}",
            sent_at=wall[0] + offset,
        )
        refused = ack(seal(TOKEN, msg))
        assert not refused.accepted and refused.reason.startswith("stale")
        assert "clock is 299 s" in refused.reason
    assert len(server.registry) == 0


# Addresses the rest of the project refuses, which discovery used to accept.
BAD_ADDRS = [
    "999.1.1.1:80",  # not an IPv4 address, not a host name either
    "10.0.0:80",
    "127.0.0.1:80\n",  # "$" matched before a trailing newline
    "127.0.0.1:0",
    "127.0.0.1:65536",
    "-leading-dash.example:80",
    "::1:80",  # IPv6 unbracketed: ambiguous
    "[::g]:80",
    "under_score:80",
]
GOOD_ADDRS = [
    "[::1]:80",
    "[0:0:0:0:0:0:0:1]:80",
    "decode-1.example:65535",
    "Decode-1.Example.internal:1",
    "localhost:8000",
    "10.0.0.1:22001",
]


@pytest.mark.parametrize("addr", BAD_ADDRS)
@pytest.mark.parametrize("field", ["http_addr", "kv_addr"])
def test_discovery_refuses_addresses_the_router_could_not_name(field, addr):
    """A registered kv_addr the router's request naming refuses turned every
    request paired with that instance into a 500."""
    _, _, wall, ack = _server()
    refused = ack(seal(TOKEN, register(**{field: addr, "sent_at": wall[0]})))
    assert not refused.accepted and refused.reason.startswith("malformed")
    assert field in refused.reason


async def test_every_address_discovery_accepts_is_paired_without_a_500(
    start_router, fakes
):
    """What discovery accepts, the router names in kv_transfer_params and
    grants (the same grammar): a pairing never becomes a 500. The bad
    instance is refused at registration, so requests go to the good ones."""
    token = "fleet-token"
    router = await start_router(registration_token=token)
    discovery = router.state.discovery
    p, d, bad = await fakes("p"), await fakes("d"), await fakes("bad")
    registrations = [
        (p, Role.PREFILL, "[0:0:0:0:0:0:0:1]:23001", True),
        (d, Role.DECODE, "Decode-1.Example:24001", True),
        (bad, Role.PREFILL, "999.1.1.1:80", False),
    ]
    replies = []
    for fake, role, kv_addr, _ in registrations:
        msg = register(fake.name, role=role, http_addr=fake.http_addr, kv_addr=kv_addr)
        replies.append(
            open_frame(
                token.encode(),
                discovery.handle(seal(token.encode(), msg), "127.0.0.1"),
            )
        )
    statuses = []
    for _ in range(4):
        status, _, _ = await router.post(
            "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}
        )
        statuses.append(status)
    assert statuses == [200] * 4
    assert [r.accepted for r in replies] == [a for *_, a in registrations]
    assert replies[-1].reason.startswith("malformed") and "999.1.1.1" in (
        replies[-1].reason
    )
    assert len(p.requests) == 4 and not bad.requests
    params = d.requests[0].body["kv_transfer_params"]
    assert params["p2p_prefill_addr"] == "[0:0:0:0:0:0:0:1]:23001"
    assert params["p2p_decode_addr"] == "Decode-1.Example:24001"
