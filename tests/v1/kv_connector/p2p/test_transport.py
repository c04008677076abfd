"""The P2P data-plane transports against the contract in ``transport/base.py``.

In-process contract tests run on every CPU transport (tcp, gloo, fake); the
tcp and gloo ones are also run between two real processes, including a peer
killed mid-stream. NCCL needs CUDA (and two GPUs for a channel): those tests
skip elsewhere, except the checks that it refuses to run without CUDA.

Peer processes come from a forkserver that has imported torch and vLLM once,
so each peer starts in milliseconds instead of re-importing vLLM.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import threading
import time
from multiprocessing import forkserver

import pytest
import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport import (
    TRANSPORT_NAMES,
    Channel,
    TransportError,
    create_transport,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    MAX_SETUP_BYTES,
    Endpoint,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.fake import (
    FakeTransport,
)

_PKG = "vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport"
CPU = torch.device("cpu")
HOST = "127.0.0.1"
CPU_TRANSPORTS = ("tcp", "gloo", "fake")
PROCESS_TRANSPORTS = ("tcp", "gloo")
# How late past its deadline a failing call may return.
SLACK_S = 3.0

_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(
    ["torch", "vllm.distributed.utils", f"{_PKG}.tcp", f"{_PKG}.gloo"]
)


@pytest.fixture(scope="module", autouse=True)
def _start_forkserver():
    """Start the peers' forkserver first: its one-time import of vLLM then
    overlaps the in-process tests."""
    forkserver.ensure_running()


def _in(seconds: float) -> float:
    return time.monotonic() + seconds


# --- messages: the same bytes cut differently on the two sides ---------------


def _layout(kind: str, nbytes: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """``one`` tensor, or 5 ``blocks``: every other row of a pool (views that
    are not adjacent in memory, like a request's KV blocks)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if kind == "one":
        return [torch.zeros(nbytes // itemsize, dtype=dtype)]
    assert kind == "blocks" and nbytes % (5 * itemsize) == 0
    pool = torch.zeros(10, nbytes // 5 // itemsize, dtype=dtype)
    return [pool[i] for i in range(0, 10, 2)]


def _payload(seed: int, nbytes: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
        .numpy()
        .tobytes()
    )


def _bytes_of(tensors: list[torch.Tensor]) -> bytes:
    return b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)


def _message(
    kind: str, dtype: torch.dtype, seed: int, nbytes: int
) -> list[torch.Tensor]:
    tensors = _layout(kind, nbytes, dtype)
    data = torch.frombuffer(bytearray(_payload(seed, nbytes)), dtype=torch.uint8)
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        t.reshape(-1).view(torch.uint8).copy_(data[offset : offset + n])
        offset += n
    return tensors


def _pair(name: str) -> tuple[Channel, Channel, list]:
    """(initiator channel, acceptor channel, transports), set up in this process."""
    a, b = create_transport(name, CPU, HOST), create_transport(name, CPU, HOST)
    setup, finish_initiator = a.initiate()
    reply, finish_acceptor = b.accept(setup)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(ch=finish_acceptor(_in(20))))
    thread.start()
    try:
        initiator = finish_initiator(reply, _in(20))
    finally:
        thread.join(timeout=25)
    return initiator, box["ch"], [a, b]


@pytest.fixture(params=CPU_TRANSPORTS)
def pair(request):
    initiator, acceptor, transports = _pair(request.param)
    yield initiator, acceptor
    for obj in (initiator, acceptor, *transports):
        obj.close()


def _in_thread(fn, *args):
    """Run fn in a thread; the returned join() gives its result or raises its error."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args)
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join(timeout: float = 20.0):
        thread.join(timeout)
        assert not thread.is_alive(), "the call did not return"
        if "error" in box:
            raise box["error"]
        return box.get("result")

    return join


def _raises_by(fn, deadline: float, match: str | None = None) -> TransportError:
    with pytest.raises(TransportError, match=match) as info:
        fn()
    assert time.monotonic() < deadline + SLACK_S, "returned long after its deadline"
    return info.value


# --- the contract, in one process --------------------------------------------


def test_both_directions_different_partitions(pair):
    a, b = pair
    n = 3 * 5 * 4096  # several 32 KiB-ish blocks
    sends = [
        (a, b, "blocks", "one", torch.bfloat16, 1),  # sender blocks -> receiver staging
        (b, a, "one", "blocks", torch.uint8, 2),
    ]

    def stream(src, dst, send_kind, recv_kind, dtype, seed):
        sender = _in_thread(
            lambda: [
                src.send(_message(send_kind, dtype, seed + i, n), _in(10))
                for i in range(3)
            ]
        )
        for i in range(3):  # in order
            got = _layout(recv_kind, n, dtype)
            dst.recv(got, _in(10))
            assert _bytes_of(got) == _payload(seed + i, n)
        sender()

    # Both directions at once: one sending and one receiving thread per side.
    joins = [_in_thread(stream, *s) for s in sends]
    for join in joins:
        join()


def test_empty_and_single_byte_messages(pair):
    a, b = pair
    join = _in_thread(
        lambda: (
            a.send([], _in(5)),
            a.send([torch.tensor([7], dtype=torch.uint8)], _in(5)),
        )
    )
    b.recv([torch.empty(0)], _in(5))
    got = torch.zeros(1, dtype=torch.uint8)
    b.recv([got], _in(5))
    join()
    assert got.item() == 7


def test_recv_without_sender_times_out_and_breaks(pair):
    a, b = pair
    deadline = _in(0.5)
    _raises_by(lambda: b.recv([torch.empty(16)], deadline), deadline)
    # Broken for good, on both sides.
    with pytest.raises(TransportError):
        b.send([torch.empty(16)], _in(2))
    deadline = _in(5)
    _raises_by(lambda: a.recv([torch.empty(16)], deadline), deadline)


def test_size_mismatch_breaks_channel(pair):
    a, b = pair
    join = _in_thread(a.send, [torch.zeros(100, dtype=torch.uint8)], _in(5))
    with pytest.raises(TransportError, match="100 bytes"):
        b.recv([torch.zeros(64, dtype=torch.uint8)], _in(5))
    with pytest.raises(TransportError):
        b.recv([torch.zeros(100, dtype=torch.uint8)], _in(5))
    with contextlib.suppress(TransportError):
        join()  # done, or failed when the receiver broke the channel
    # The sender's side learns at once, not at its deadline.
    _raises_by(lambda: a.recv([torch.zeros(1)], _in(10)), _in(2))


def test_close_wakes_blocked_calls_on_both_sides(pair):
    a, b = pair
    blocked_here = _in_thread(b.recv, [torch.empty(16)], _in(20))
    blocked_peer = _in_thread(a.recv, [torch.empty(16)], _in(20))
    time.sleep(0.2)
    start = time.monotonic()
    b.close()
    b.close()  # idempotent
    with pytest.raises(TransportError):
        blocked_here(timeout=5)
    with pytest.raises(TransportError):
        blocked_peer(timeout=5)
    assert time.monotonic() - start < 5
    with pytest.raises(TransportError):
        b.send([torch.empty(4)], _in(1))


# More than loopback's socket buffers hold: a sender waits for room in them.
BEYOND_SOCKET_BUFFERS = 64 << 20


@pytest.fixture
def tcp_pair():
    initiator, acceptor, transports = _pair("tcp")
    yield initiator, acceptor
    for obj in (initiator, acceptor, *transports):
        obj.close()


def test_tcp_send_beyond_the_socket_buffers_reaches_a_slow_reader_whole(tcp_pair):
    """The sender's calls return when the buffer is full and it waits for
    room (MSG_DONTWAIT, then poll): every byte arrives, in order, however the
    reader paces itself."""
    a, b = tcp_pair
    data = torch.randint(0, 256, (BEYOND_SOCKET_BUFFERS,), dtype=torch.uint8)
    halves = list(data.chunk(2))
    join = _in_thread(a.send, halves, _in(30))
    time.sleep(0.3)  # the sender has filled the buffers and waits
    got = torch.zeros_like(data)
    b.recv(list(got.chunk(2)), _in(30))
    join()
    assert torch.equal(got, data)


def test_tcp_send_to_a_peer_that_never_reads_fails_at_its_deadline(tcp_pair):
    a, _ = tcp_pair
    data = torch.zeros(BEYOND_SOCKET_BUFFERS, dtype=torch.uint8)
    deadline = _in(0.5)
    _raises_by(lambda: a.send([data], deadline), deadline, match="deadline")
    with pytest.raises(TransportError):  # broken for good
        a.send([torch.zeros(1)], _in(1))


def test_tcp_close_wakes_a_send_waiting_for_room(tcp_pair):
    a, _ = tcp_pair
    data = torch.zeros(BEYOND_SOCKET_BUFFERS, dtype=torch.uint8)
    blocked = _in_thread(a.send, [data], _in(20))
    time.sleep(0.3)
    start = time.monotonic()
    a.close()
    with pytest.raises(TransportError):
        blocked(timeout=5)
    assert time.monotonic() - start < 5


def test_bad_tensors_are_refused(pair):
    a, _ = pair
    with pytest.raises(TransportError, match="contiguous"):
        a.send([torch.zeros(4, 4).t()], _in(1))


@pytest.mark.parametrize("name", CPU_TRANSPORTS)
@pytest.mark.parametrize(
    "setup", [b"", b"\x00" * 3, b"\xff" * 17, b"x" * (MAX_SETUP_BYTES + 1)]
)
def test_accept_refuses_malformed_setup(name, setup):
    transport = create_transport(name, CPU, HOST)
    try:
        with pytest.raises(TransportError):
            transport.accept(setup)
    finally:
        transport.close()


@pytest.mark.parametrize("name", CPU_TRANSPORTS)
def test_initiator_refuses_malformed_reply(name):
    transport = create_transport(name, CPU, HOST)
    _, finish = transport.initiate()
    deadline = _in(2)
    _raises_by(lambda: finish(b"\xc1garbage", deadline), deadline)


def test_a_data_endpoint_on_another_host_than_the_peer_is_refused():
    """tcp: the initiator connects where the acceptor's reply says; gloo: the
    acceptor connects where the setup says. Either must be the control peer's
    own host, or a peer could point this side at a third machine."""
    elsewhere = Endpoint("127.0.0.2", 9).encode()
    _, finish = create_transport("tcp", CPU, HOST).initiate(peer_host=HOST)
    with pytest.raises(TransportError, match="another host"):
        finish(elsewhere, _in(2))
    with pytest.raises(TransportError, match="another host"):
        create_transport("gloo", CPU, HOST).accept(elsewhere, peer_host=HOST)
    # The same host in another spelling is the same host.
    with pytest.raises(TransportError, match="another host"):
        create_transport("gloo", CPU, "::1").accept(
            Endpoint("::2", 9).encode(), peer_host="::1"
        )
    create_transport("gloo", CPU, "::1").accept(
        Endpoint("0:0::1", 9).encode(), peer_host="[::1]"
    )


@pytest.mark.parametrize("name", CPU_TRANSPORTS)
def test_acceptor_finish_without_initiator_times_out(name):
    a, b = create_transport(name, CPU, HOST), create_transport(name, CPU, HOST)
    try:
        setup, _ = a.initiate()
        _, finish = b.accept(setup)
        deadline = _in(0.5)
        _raises_by(lambda: finish(deadline), deadline)
    finally:
        a.close()
        b.close()


# --- tcp specifics -----------------------------------------------------------


def test_tcp_strangers_on_the_data_port_do_not_break_set_up():
    a, b = create_transport("tcp", CPU, HOST), create_transport("tcp", CPU, HOST)
    rejected = []
    # the engine counts them (vllm:p2p_rejected_messages)
    b.on_rejected = rejected.append
    strangers = []
    try:
        setup, finish_initiator = a.initiate()
        reply, finish_acceptor = b.accept(setup)
        # Anyone who finds the data port can connect to it before the peer.
        port = Endpoint.decode(reply).port
        for token in (b"wrong token 16b!", b"", b"short"):
            s = socket.create_connection((HOST, port), timeout=5)
            s.sendall(token)  # the empty and short ones just sit there
            strangers.append(s)
        join = _in_thread(finish_acceptor, _in(10))
        initiator = finish_initiator(reply, _in(10))
        acceptor = join()
        strangers[0].settimeout(5)
        assert strangers[0].recv(16) == b""  # the wrong token was hung up on
        assert rejected == ["data_unknown_token"]
        strangers[1].close()  # one that leaves without a token
        deadline = time.monotonic() + 5
        while rejected == ["data_unknown_token"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rejected == ["data_unknown_token", "data_no_token"]
        send = _in_thread(initiator.send, [torch.arange(10, dtype=torch.uint8)], _in(5))
        got = torch.zeros(10, dtype=torch.uint8)
        acceptor.recv([got], _in(5))
        send()
        assert got.tolist() == list(range(10))
        initiator.close()
        acceptor.close()
    finally:
        for s in strangers:
            s.close()
        a.close()
        b.close()


def test_tcp_over_ipv6():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    a, b = create_transport("tcp", CPU, "::1"), create_transport("tcp", CPU, "::1")
    try:
        setup, finish_initiator = a.initiate()
        try:
            reply, finish_acceptor = b.accept(setup)
        except TransportError as e:
            pytest.skip(f"no IPv6 loopback: {e}")
        join = _in_thread(finish_acceptor, _in(10))
        initiator, acceptor = finish_initiator(reply, _in(10)), join()
        send = _in_thread(initiator.send, [torch.ones(3, dtype=torch.bfloat16)], _in(5))
        got = torch.zeros(3, dtype=torch.bfloat16)
        acceptor.recv([got], _in(5))
        send()
        assert got.tolist() == [1.0, 1.0, 1.0]
        initiator.close()
        acceptor.close()
    finally:
        a.close()
        b.close()


# --- fake specifics ----------------------------------------------------------


def test_fake_failure_hooks():
    a, b, _ = _pair("fake")
    a.fail_next_send = True
    with pytest.raises(TransportError, match="injected"):
        a.send([torch.zeros(1)], _in(1))
    with pytest.raises(TransportError):  # the link is down for the peer too
        b.recv([torch.zeros(1)], _in(1))

    c, d, _ = _pair("fake")
    blocked = _in_thread(d.recv, [torch.zeros(1)], _in(20))
    time.sleep(0.1)
    FakeTransport.break_all("network down")
    with pytest.raises(TransportError, match="network down"):
        blocked(timeout=5)
    with pytest.raises(TransportError, match="network down"):
        c.send([torch.zeros(1)], _in(1))


def test_fake_accept_refuses_unknown_token():
    with pytest.raises(TransportError, match="unknown"):
        FakeTransport(CPU, HOST).accept(b"\x00" * 16)


# --- two real processes ------------------------------------------------------


def _peer(name: str, conn) -> None:
    """A transport in another process, driven by commands over ``conn``."""
    transport = create_transport(name, CPU, HOST)
    channel = None
    while True:
        cmd, *args = conn.recv()
        try:
            result = None
            if cmd == "initiate":
                setup, finish = transport.initiate()
                conn.send(setup)
                channel = finish(conn.recv(), _in(20))
            elif cmd == "accept":
                reply, finish = transport.accept(args[0])
                conn.send(reply)
                channel = finish(_in(20))
            elif cmd == "send":  # kind, dtype, seed, nbytes, count
                kind, dtype, seed, nbytes, count = args
                for i in range(count):
                    channel.send(_message(kind, dtype, seed + i, nbytes), _in(20))
            elif cmd == "recv":
                kind, dtype, nbytes, count = args
                result = []
                for _ in range(count):
                    got = _layout(kind, nbytes, dtype)
                    channel.recv(got, _in(20))
                    result.append(_bytes_of(got))
            elif cmd == "exit":
                return
            conn.send(("ok", result))
        except TransportError as e:
            conn.send(("error", str(e)))


class _Peer:
    def __init__(self, name: str):
        self.conn, child = _ctx.Pipe()
        self.process = _ctx.Process(target=_peer, args=(name, child), daemon=True)
        self.process.start()

    def ask(self, *cmd) -> None:
        self.conn.send(cmd)

    def answer(self, timeout: float = 30.0):
        assert self.conn.poll(timeout), "the peer process did not answer"
        return self.conn.recv()

    def stop(self) -> None:
        try:
            if self.process.is_alive():
                self.conn.send(("exit",))
        except OSError:
            pass
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


@pytest.fixture(params=PROCESS_TRANSPORTS)
def remote(request):
    """(local transport, connected local channel, peer): the peer accepted."""
    name = request.param
    transport = create_transport(name, CPU, HOST)
    peer = _Peer(name)
    channel = None
    try:
        setup, finish = transport.initiate()
        peer.ask("accept", setup)
        # The first answer waits for the forkserver to import torch: minutes on a loaded
        # host.
        channel = finish(peer.answer(timeout=180), _in(30))
        assert peer.answer() == ("ok", None)
        yield channel, peer
    finally:
        if channel is not None:
            channel.close()
        transport.close()
        peer.stop()


def test_two_processes_exchange_both_ways(remote):
    channel, peer = remote
    n = 5 * 2 * 16384  # five 32 KiB blocks of bf16
    # Here -> peer: sent as blocks, received into one staging tensor, bf16.
    peer.ask("recv", "one", torch.bfloat16, n, 3)
    for i in range(3):
        channel.send(_message("blocks", torch.bfloat16, 10 + i, n), _in(20))
    status, got = peer.answer()
    assert status == "ok" and got == [_payload(10 + i, n) for i in range(3)]
    # Peer -> here: sent as one tensor, received into blocks, uint8.
    peer.ask("send", "one", torch.uint8, 20, n, 3)
    for i in range(3):
        dst = _layout("blocks", n, torch.uint8)
        channel.recv(dst, _in(20))
        assert _bytes_of(dst) == _payload(20 + i, n)
    assert peer.answer() == ("ok", None)


def test_two_processes_peer_killed_mid_stream(remote):
    channel, peer = remote
    n = 1 << 20
    peer.ask(
        "send", "one", torch.uint8, 0, n, 100_000
    )  # a stream that outlives the peer
    for i in range(3):
        dst = _layout("one", n, torch.uint8)
        channel.recv(dst, _in(20))
        assert _bytes_of(dst) == _payload(i, n)
    peer.process.kill()
    start = time.monotonic()
    with pytest.raises(TransportError):
        for _ in range(100_000):
            channel.recv([torch.zeros(n, dtype=torch.uint8)], _in(20))
    assert time.monotonic() - start < 10, (
        "the dead peer went unnoticed until the deadline"
    )


@pytest.mark.parametrize("blocked_in", ["recv", "send"])
def test_two_processes_peer_killed_while_blocked(remote, blocked_in):
    """The survivor waits for a peer that dies: in recv (nothing comes) or in
    send (the peer takes nothing: far more than the socket buffers hold)."""
    channel, peer = remote
    if blocked_in == "recv":
        call = _in_thread(
            channel.recv, [torch.zeros(1 << 20, dtype=torch.uint8)], _in(20)
        )
    else:
        call = _in_thread(
            channel.send, [torch.zeros(256 << 20, dtype=torch.uint8)], _in(20)
        )
    time.sleep(0.3)
    start = time.monotonic()
    peer.process.kill()
    with pytest.raises(TransportError):
        call(timeout=15)
    assert time.monotonic() - start < 10


# --- create_transport --------------------------------------------------------


def test_create_transport_names():
    assert TRANSPORT_NAMES == ("auto", "tcp", "gloo", "nccl", "fake")
    assert create_transport("auto", CPU, HOST).name == "tcp"
    for name in ("tcp", "gloo", "fake"):
        transport = create_transport(name, CPU, HOST)
        assert transport.name == name and transport.receives_into_host
        transport.close()
    with pytest.raises(ValueError, match="auto, tcp, gloo, nccl, fake"):
        create_transport("rdma", CPU, HOST)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
@pytest.mark.parametrize("name", ["tcp", "gloo"])
def test_wildcard_bind_host_is_refused(name, host):
    with pytest.raises(ValueError, match="wildcard"):
        create_transport(name, CPU, host)


# --- nccl --------------------------------------------------------------------

_GPUS = torch.accelerator.device_count() if torch.cuda.is_available() else 0


def test_nccl_refuses_to_run_without_cuda():
    if _GPUS:
        pytest.skip("CUDA is available")
    for device in (CPU, torch.device("cuda", 0)):
        with pytest.raises(TransportError, match="CUDA"):
            create_transport("nccl", device, HOST)


@pytest.mark.skipif(not _GPUS, reason="needs CUDA")
def test_nccl_finish_without_peer_times_out():
    transport = create_transport("nccl", torch.device("cuda", 0), HOST)
    assert not transport.receives_into_host
    setup, _ = transport.initiate()
    assert len(setup) == 256
    _, finish = transport.accept(setup)  # rank 1 waiting for a rank 0 that never comes
    deadline = _in(2)
    _raises_by(lambda: finish(deadline), deadline, match="deadline")
    with pytest.raises(TransportError):
        transport.accept(setup[:128])


def _nccl_peer(setup: bytes, conn) -> None:
    transport = create_transport("nccl", torch.device("cuda", 1), HOST)
    _, finish = transport.accept(setup)
    channel = finish(_in(60))
    n = 5 * 32768
    dst = [t.cuda(1) for t in _layout("one", n, torch.bfloat16)]
    channel.recv(dst, _in(30))
    channel.send([t.cuda(1) for t in _message("one", torch.uint8, 2, n)], _in(30))
    conn.send(_bytes_of([t.cpu() for t in dst]))
    channel.close()


@pytest.mark.skipif(_GPUS < 2, reason="an NCCL channel needs two GPUs")
def test_nccl_two_gpus_exchange():
    ctx = mp.get_context("spawn")
    transport = create_transport("nccl", torch.device("cuda", 0), HOST)
    setup, finish = transport.initiate()
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_nccl_peer, args=(setup, child), daemon=True)
    process.start()
    try:
        channel = finish(b"", _in(60))
        n = 5 * 32768
        channel.send(
            [t.cuda(0) for t in _message("blocks", torch.bfloat16, 1, n)], _in(30)
        )
        dst = [t.cuda(0) for t in _layout("blocks", n, torch.uint8)]
        channel.recv(dst, _in(30))
        assert _bytes_of([t.cpu() for t in dst]) == _payload(2, n)
        assert conn.poll(30) and conn.recv() == _payload(1, n)
        channel.close()
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def test_a_host_name_peer_matches_the_address_its_listener_advertises():
    """kv_ip given as a name: the listener advertises the address it bound."""
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
        check_peer_endpoint,
    )

    check_peer_endpoint(Endpoint("127.0.0.1", 9), "localhost")
    with pytest.raises(TransportError, match="another host"):
        check_peer_endpoint(Endpoint("127.0.0.2", 9), "localhost")
