"""The connector's registration client against a real ZMQ ROUTER playing the
router (loopback only): registration, heartbeats, token, refusals, several
routers, dead and late routers, Deregister on close, and the vLLM path that
closes it (Scheduler.shutdown -> connector.shutdown)."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest
import zmq

from vllm_disagg import envs
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import registration
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import P2pConfig
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.progress import (
    EngineProgress,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.registration import (
    DEREGISTER_TIMEOUT_S,
    RegistrationClient,
    make_instance_id,
    start_registration,
)
from vllm_disagg.wire.discovery import (
    DISCOVERY_VERSION,
    MAX_ID_CHARS,
    MIN_DISCOVERY_VERSION,
    Ack,
    Deregister,
    DiscoveryError,
    Register,
    Role,
    open_frame,
    seal,
)
from vllm_disagg.wire.groups import dp_group_of

INTERVAL = 0.1
KV_ADDR = "127.0.0.1:22001"
HTTP_ADDR = "127.0.0.1:20002"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeRouter:
    """A ROUTER socket that opens every frame as the router would and answers
    with an Ack (``accept``/``reason`` decide which). A frame that does not
    open is answered as the router does, refused with the reason and no
    instance id (``rejected`` counts them)."""

    def __init__(self, port: int | None = None, token: bytes | None = None):
        self.token = token
        self.accept = True
        self.reason = ""
        self.rejected = 0
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port is None:
            self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        else:
            self.port = port
            self.sock.bind(f"tcp://127.0.0.1:{port}")

    @property
    def addr(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def receive(self, n: int = 1, timeout_s: float = 10.0, kind: type = object) -> list:
        """The next ``n`` messages of ``kind`` (others are answered and
        skipped), or fewer when ``timeout_s`` runs out."""
        got: list = []
        deadline = time.monotonic() + timeout_s
        while len(got) < n and (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                break
            identity, *frames = self.sock.recv_multipart()
            try:
                msg = open_frame(self.token, frames)
            except DiscoveryError as e:
                self.rejected += 1
                ack = Ack(
                    version=DISCOVERY_VERSION,
                    instance_id="unknown",
                    accepted=False,
                    reason=str(e),
                )
                self.sock.send_multipart([identity, *seal(self.token, ack)])
                continue
            ack = Ack(
                version=DISCOVERY_VERSION,
                instance_id=msg.instance_id,
                accepted=self.accept,
                reason=self.reason,
            )
            self.sock.send_multipart([identity, *seal(self.token, ack)])
            if isinstance(msg, kind):
                got.append(msg)
        return got

    def serve_until(self, condition, timeout_s: float = 10.0) -> bool:
        """Keep answering until ``condition()`` holds (what the client does
        with an answer happens on its own thread)."""
        deadline = time.monotonic() + timeout_s
        while not condition() and time.monotonic() < deadline:
            self.receive(1, timeout_s=0.05)
        return condition()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def routers():
    made: list[FakeRouter] = []

    def make(**kwargs) -> FakeRouter:
        made.append(FakeRouter(**kwargs))
        return made[-1]

    yield make
    for router in made:
        router.close()


@pytest.fixture
def clients():
    made: list[RegistrationClient] = []

    def make(router_addrs, **kwargs) -> RegistrationClient:
        kwargs = {
            "role": Role.DECODE,
            "http_addr": HTTP_ADDR,
            "kv_addr": KV_ADDR,
            "model": "tiny",
            "interval_s": INTERVAL,
            "wait_for_http": False,
            **kwargs,
        }
        made.append(RegistrationClient(routers=router_addrs, **kwargs).start())
        return made[-1]

    yield make
    for client in made:
        client.close()


@pytest.fixture
def logs(monkeypatch):
    lines: dict[str, list[str]] = {"warning": [], "info": []}
    for level, out in lines.items():
        monkeypatch.setattr(
            registration.logger,
            level,
            lambda fmt, *args, out=out: out.append(fmt % args),
        )
    return lines


def test_registers_within_one_interval_and_deregisters_on_close(routers, clients):
    router = routers()
    started = time.monotonic()
    client = clients([router.addr], interval_s=10.0, dp_rank=1, dp_size=2)
    [msg] = router.receive(1, timeout_s=5.0)
    assert time.monotonic() - started < 5.0  # at once, not after the first interval
    assert msg == Register(
        # No DP group named: the oldest version that carries the message.
        version=MIN_DISCOVERY_VERSION,
        instance_id=client.instance_id,
        role=Role.DECODE,
        http_addr=HTTP_ADDR,
        kv_addr=KV_ADDR,
        model="tiny",
        dp_rank=1,
        dp_size=2,
        seq=0,
        interval_s=10.0,
        sent_at=msg.sent_at,
    )
    assert abs(msg.sent_at - time.time()) < 5
    client.close()
    [bye] = router.receive(1, kind=Deregister)
    assert bye.instance_id == client.instance_id
    client._thread.join(timeout=5)
    assert not client._thread.is_alive()
    client.close()  # idempotent


def test_heartbeats_carry_incrementing_seq(routers, clients):
    router = routers()
    client = clients([router.addr])
    msgs = router.receive(4, kind=Register)
    assert [m.seq for m in msgs] == [0, 1, 2, 3]
    assert {m.instance_id for m in msgs} == {client.instance_id}
    assert [m.sent_at for m in msgs] == sorted(m.sent_at for m in msgs)


def test_token_signs_and_a_refusal_is_logged_once_while_the_client_keeps_going(
    routers, clients, logs
):
    router = routers(token=b"s3cret")
    router.accept, router.reason = False, "model 'tiny' is not served here"
    client = clients([router.addr], token=b"s3cret")
    refused = router.receive(5, kind=Register)  # open_frame checked every MAC
    assert [m.seq for m in refused] == [0, 1, 2, 3, 4]
    # A frame signed with another token does not open.
    frames = seal(b"other", refused[0])
    with pytest.raises(DiscoveryError, match="unauthenticated"):
        open_frame(b"s3cret", frames)
    assert router.serve_until(lambda: logs["warning"])
    assert len(router.receive(5, kind=Register)) == 5  # the client keeps going
    assert logs["warning"] == [
        f"router 127.0.0.1:{router.port} refused the registration of "
        f"{client.instance_id}: model 'tiny' is not served here"
    ]  # once: at most one line per router per minute
    router.accept = True
    assert router.serve_until(lambda: logs["info"])
    assert logs["info"][0].startswith(
        f"registered with router 127.0.0.1:{router.port} as {client.instance_id} "
        f"(decode, http {HTTP_ADDR}, kv {KV_ADDR}, DP rank 0/1)"
    )


def test_a_wrong_token_is_refused_and_the_reason_logged(routers, clients, logs):
    """A router with another token cannot open the frame, so its refusal names
    no instance; the client still logs the reason."""
    router = routers(token=b"router-token")
    client = clients([router.addr], token=b"other-token")
    assert router.serve_until(lambda: logs["warning"])
    assert router.rejected >= 1
    assert logs["warning"] == [
        f"router 127.0.0.1:{router.port} refused the registration of "
        f"{client.instance_id}: unauthenticated: bad or missing registration token"
    ]


def test_two_routers_both_receive_registrations(routers, clients):
    first, second = routers(), routers()
    client = clients([first.addr, second.addr])
    for router in (first, second):
        msgs = router.receive(2, kind=Register)
        assert [m.instance_id for m in msgs] == [client.instance_id] * 2
    client.close()
    for router in (first, second):
        assert router.receive(1, kind=Deregister)


def test_a_dead_router_blocks_neither_the_others_nor_close(routers, clients, logs):
    dead = ("127.0.0.1", free_port())  # nothing listens there
    live = routers()
    client = clients([dead, live.addr])
    assert live.serve_until(lambda: logs["warning"])
    assert len(live.receive(5, kind=Register)) == 5
    assert logs["warning"] == [
        f"router 127.0.0.1:{dead[1]} is not reachable; still trying every 0.1 s"
    ]  # once, after 5 intervals, whatever the number that follow
    started = time.monotonic()
    client.close()
    assert (
        time.monotonic() - started < DEREGISTER_TIMEOUT_S + 3
    )  # not the dead router's retries
    client._thread.join(timeout=5)
    assert not client._thread.is_alive()
    assert live.receive(1, kind=Deregister)


def test_a_router_that_starts_late_or_restarts_gets_registrations(routers, clients):
    port = free_port()
    client = clients([("127.0.0.1", port)])
    time.sleep(3 * INTERVAL)
    bound_at = time.time()
    router = routers(port=port)
    first = router.receive(1, kind=Register)[0]
    assert first.instance_id == client.instance_id
    # Heartbeats to nobody were dropped, not queued and delivered stale.
    assert first.seq == 0 and first.sent_at >= bound_at
    router.close()
    router = routers(port=port)  # a restarted router learns the instance again
    again = router.receive(1, kind=Register)[0]
    assert again.seq > first.seq


def test_instance_ids_are_unique_and_bounded():
    assert make_instance_id(KV_ADDR) != make_instance_id(KV_ADDR)
    assert make_instance_id(KV_ADDR).startswith(KV_ADDR + "@")
    long_host = ".".join(["a" * 60] * 4)
    assert len(make_instance_id(f"{long_host}:1")) <= MAX_ID_CHARS


def test_start_registration_waits_for_the_api_server(routers, monkeypatch):
    """What the connector starts: the Register names the DP rank's address,
    the served model names and the env token, and the first one waits
    until the API server accepts connections."""
    router = routers(token=b"tok")
    monkeypatch.setenv(envs.VLLM_DISAGG_ROUTER_TOKEN, "tok")
    http_port = free_port()
    config = P2pConfig(
        role="kv_producer",
        base_port=21001,
        host="127.0.0.1",
        proxy_ip=f"127.0.0.1:{router.port}",
        http_port=http_port,
    )
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(
            served_model_name=["served", "alias"], model="/m", max_model_len=512
        ),
        parallel_config=SimpleNamespace(
            data_parallel_rank=1,
            data_parallel_size=2,
            data_parallel_external_lb=True,
            data_parallel_master_ip="10.0.0.7",
            data_parallel_rpc_port=13345,
        ),
    )
    assert (
        start_registration(vllm_config, P2pConfig(role="kv_both", base_port=1), "x:1")
        is None
    )
    client = start_registration(vllm_config, config, "127.0.0.1:21002")
    try:
        assert router.receive(1, timeout_s=0.6) == []  # the API server is not up yet
        with socket.create_server(("127.0.0.1", http_port)):
            [msg] = router.receive(1, timeout_s=3.0)
        assert (
            msg.role,
            msg.model,
            msg.http_addr,
            msg.kv_addr,
            msg.dp_rank,
            msg.dp_size,
            msg.version,
        ) == (
            Role.PREFILL,
            "served",
            f"127.0.0.1:{http_port}",
            "127.0.0.1:21002",
            1,
            2,
            DISCOVERY_VERSION,  # it names a DP group
        )
        assert msg.dp_group == dp_group_of(vllm_config.parallel_config)
        assert msg.aliases == ("alias",)  # --served-model-name's other names route too
    finally:
        client.close()


@pytest.mark.parametrize(
    "external_lb, hybrid_lb, index, local_rank, registers",
    [
        (True, False, 1, 0, True),  # one `vllm serve` per rank: every rank
        (False, False, 0, None, True),  # no DP, or rank 0 behind one API server
        (False, False, 1, 1, False),  # rank 1 behind the same API server
        (False, False, 2, 0, False),  # rank 2 on a headless node
        (False, True, 2, 0, True),  # hybrid: the first rank of each node's API server
        (False, True, 3, 1, False),
    ],
)
def test_one_registration_per_api_server(
    external_lb, hybrid_lb, index, local_rank, registers
):
    parallel = SimpleNamespace(
        data_parallel_external_lb=external_lb,
        data_parallel_hybrid_lb=hybrid_lb,
        data_parallel_index=index,
        data_parallel_rank_local=local_rank,
    )
    assert registration.registers_for_its_api_server(parallel) is registers


def test_the_ranks_of_one_dp_group_name_the_same_group_and_no_other():
    def parallel(rank=0, size=2, ip="10.0.0.7", port=13345):
        return SimpleNamespace(
            data_parallel_rank=rank,
            data_parallel_size=size,
            data_parallel_master_ip=ip,
            data_parallel_rpc_port=port,
        )

    group = dp_group_of(parallel(0))
    assert len(group) == 16 and group == dp_group_of(parallel(1))
    assert dp_group_of(parallel(size=1)) == ""  # no group at DP=1
    others = {
        dp_group_of(p)
        for p in (parallel(port=13346), parallel(ip="10.0.0.8"), parallel(size=4))
    }
    assert group not in others and len(others) == 3
    # Loopback rendezvous: the host's name makes it this host's group.
    assert dp_group_of(parallel(ip="127.0.0.1")) != (
        dp_group_of(parallel(ip="127.0.0.2"))
    )


def test_scheduler_shutdown_deregisters(routers, tmp_path, monkeypatch):
    """The real path: vLLM's Scheduler.shutdown (called by EngineCore.shutdown)
    calls the connector's shutdown, which deregisters."""
    from vllm_disagg.testing.scheduler import (
        make_scheduler,
        make_vllm_config,
        write_model_config,
    )

    monkeypatch.setattr(
        registration.RegistrationClient, "_http_ready", lambda self, s: True
    )
    monkeypatch.delenv(envs.VLLM_DISAGG_ROUTER_TOKEN, raising=False)
    router = routers()
    vllm_config = make_vllm_config(write_model_config(tmp_path), "kv_consumer")
    vllm_config.kv_transfer_config.kv_connector_extra_config.update(
        proxy_ip=f"127.0.0.1:{router.port}", http_port=20002, allowed_peers="127.0.0.1"
    )
    scheduler = make_scheduler(vllm_config, num_blocks=16)
    [msg] = router.receive(1, kind=Register)
    assert (msg.role, msg.kv_addr, msg.http_addr) == (
        Role.DECODE,
        "127.0.0.1:21001",
        HTTP_ADDR,
    )
    scheduler.shutdown()
    [bye] = router.receive(1, kind=Deregister)
    assert bye.instance_id == msg.instance_id


def test_an_advertised_http_address_where_vllm_serve_does_not_listen_is_said_at_start():
    """With the seed's JSON and `vllm serve --host 127.0.0.1`, instances used
    to register an address nothing listened on, after 120 s of silence."""
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.api_address import (
        advertised_http_problems,
    )

    assert advertised_http_problems("127.0.0.1:20001", "127.0.0.1", 20001) == []
    assert advertised_http_problems("localhost:20001", "127.0.0.1", 20001) == []
    assert (
        advertised_http_problems("127.0.0.1:20001", None, None) == []
    )  # wildcard, local
    [port] = advertised_http_problems("127.0.0.1:20001", "127.0.0.1", 8000)
    assert "http_port 20001" in port and "--port 8000" in port
    [host] = advertised_http_problems("127.0.0.2:20001", "127.0.0.1", 20001)
    assert "http_ip 127.0.0.2" in host and "--host 127.0.0.1" in host
    [foreign] = advertised_http_problems("192.0.2.7:20001", None, 20001)  # TEST-NET-1
    assert "not an address of this machine" in foreign
    [unresolved] = advertised_http_problems("no-such-host.invalid:20001", None, None)
    assert "does not resolve" in unresolved
    # IPv6, bracketed as every address of the fleet is written.
    assert advertised_http_problems("[::1]:20001", "::1", 20001) == []


def test_peer_worker_addresses_keep_ipv6_brackets():
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.worker import (
        shift_port,
    )

    assert shift_port("10.0.0.1:21001", 2) == "10.0.0.1:21003"
    assert shift_port("[::1]:21001", 1) == "[::1]:21002"


# --- health: progress and a live API server (issue 27) ------------------------


def test_heartbeats_carry_how_long_the_engine_has_not_stepped(routers, clients):
    router = routers()
    now = [100.0]
    progress = EngineProgress(clock=lambda: now[0])
    clients([router.addr], progress=progress)
    assert router.receive(1, kind=Register)[0].stalled_s == 0.0
    progress.request_added("r1")
    now[0] += 7.5  # requests held, no step since
    assert router.receive(1, kind=Register)[0].stalled_s == 7.5
    progress.step_scheduled()
    assert router.receive(1, kind=Register)[0].stalled_s == 0.0


def test_no_heartbeats_while_the_api_server_refuses_connections(routers, clients, logs):
    """The engine core outlives a killed API server (seen: it kept its
    instance listed and routers flapped between "unreachable" and "joined")."""
    router = routers()
    api = socket.socket()
    api.bind(("127.0.0.1", 0))
    api.listen(8)
    http_addr = f"127.0.0.1:{api.getsockname()[1]}"
    clients([router.addr], http_addr=http_addr, wait_for_http=True)
    assert router.receive(2, kind=Register)
    api.close()  # the API server is gone
    # At most the heartbeats already due before the check noticed.
    router.receive(5, kind=Register, timeout_s=5 * INTERVAL)
    assert router.receive(1, kind=Register, timeout_s=10 * INTERVAL) == []
    assert any("refuses connections" in line for line in logs["warning"])
    again = socket.socket()
    again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    again.bind(("127.0.0.1", int(http_addr.rsplit(":", 1)[1])))
    again.listen(8)
    try:
        assert router.receive(1, kind=Register, timeout_s=20 * INTERVAL)
    finally:
        again.close()


def test_engine_progress_counts_only_while_requests_wait():
    now = [0.0]
    progress = EngineProgress(clock=lambda: now[0])
    now[0] = 50.0
    assert progress.stalled_s() == 0.0  # idle for ages: not stalled
    progress.request_added("a")
    now[0] = 53.0
    assert progress.stalled_s() == 3.0  # counted from the request's arrival
    progress.step_scheduled()
    now[0] = 54.0
    assert progress.stalled_s() == 1.0
    progress.request_finished("a")
    assert progress.stalled_s() == 0.0


def test_heartbeats_carry_the_model_fingerprint(routers, clients):
    router = routers()
    clients([router.addr], fingerprint="ab" * 16)
    assert router.receive(1, kind=Register)[0].fingerprint == "ab" * 16
