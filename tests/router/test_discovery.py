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

    assert (await instance.message(register())).accepted
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
    assert len(router.registry) == 0
    assert (
        router.metric("vllm_disagg_router_discovery_rejected_total", kind="malformed")
        == 7
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
    assert server.rejected["replayed"] == 1 and server.rejected["stale"] == 2


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
