"""One KV transfer end to end through the real P2P engines, against the raw socket.

Two processes on loopback, a prefill (sender) and a decode (receiver), each
with one ``P2pEngine`` per mode (PUT and GET, ``tcp`` transport, no
checksum) over a KV cache shaped like the connector's: 32 layers of 32 KiB
pages (the tiny Llama's page: 128 tokens x 128 bytes of K and V in bf16),
the transfer's blocks every other block of the cache, so no two are
adjacent. A third link is a plain loopback socket (``sendall`` of one
buffer, ``recv_into`` one buffer, both touched before).

One sample is one transfer of 4, 16 or 64 MiB, timed from its start to the
decode's last byte placed, i.e. the moment ``poll()`` hands the decode its
complete slot:

* PUT: from the prefill's ``start_send`` (every layer saved);
* PUT-after-pass: ``start_send`` 20 ms earlier (the worker offers before the
  forward pass), timed from the moment every layer is saved: what a PUT
  request waits for after its forward pass;
* GET: from the decode's ``expect`` with ``get_from`` (the prefill holds the
  KV already): its ``Get``, the prefill's ``Offer``, the data;
* raw: from the sender's ``sendall`` to the receiver's last byte;
* channel: the engine's data messages (its runs of layers, read from the
  KV cache as the engine reads them) over a bare tcp channel, from the
  first read to the last byte: the wire format without the engine's
  threads, control messages and state.

Both processes read one clock (``CLOCK_MONOTONIC`` is system-wide). Within
every round each engine sample runs between two raw samples (the order
reversed every other round) and is divided by their mean: these machines
are shared and noisy, and the neighbouring samples follow the drift. The
result is the median of those ratios over rounds.

``--compare`` runs a second pair of processes side by side (each round
samples both) set to work as the engine did before this benchmark's first
findings: the decode takes a fresh receive buffer for every transfer
(``Room.reuse`` off), the prefill sends a torch view per block
(``read_blocks``, not ``read_block_bytes``) and one data message per layer
(``protocol.LAYER_MESSAGE_BYTES`` 0, not runs of layers); it also adds a raw sample into
a fresh buffer (``torch.empty``) each time. The decode process's minor page
faults are counted for every sample.

``--message-bytes N,M`` adds a pair per value, side by side, whose data
messages carry runs of layers up to that many bytes
(``protocol.LAYER_MESSAGE_BYTES``; 0: one layer per message).

``--timeline`` cuts each engine sample of the first pair into the phases of
its critical path (``benchmarks/common/p2p_timeline.py``): thread hand-offs,
control round trips, the first layers' reads, the data, the poll.

``--breakdown`` also times the engine's pieces in both processes (wrapped
from here, the engine is unchanged): the control round trips, the receive
room's allocation, the per-layer reads of the KV cache and the socket calls.

Writes benchmarks/results/p2p_transfer.{json,md} (``--out DIR``: elsewhere;
``--tag NAME``: p2p_transfer-NAME.*).

    .venv/bin/python benchmarks/p2p_transfer.py [--rounds 15] [--breakdown] [--compare]
        [--message-bytes 0,1048576]
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import time

import torch
from _deps import require  # benchmarks/_deps.py: sys.path[0] as a script
from common import p2p_timeline, report

KIB, MIB = 1 << 10, 1 << 20
HOST = "127.0.0.1"
DIGEST = b"\x01" * 16
LAYERS, PAGE = 32, 32 * KIB
SIZES = (4 * MIB, 16 * MIB, 64 * MIB)
ENGINE_MODES = ("PUT", "GET")  # one engine of each per process
# Samples: PUT from start_send with every layer saved (the Offer's round trip
# included), GET, and PUT-after-pass: offered FORWARD_PASS_S before its
# layers are saved, timed from then, as the worker does (it offers in bind,
# before the forward pass, and saves in wait_for_save, after it).
MODES = ("PUT", "GET", "PUT-after-pass")
FORWARD_PASS_S = 0.02
OP_TIMEOUT_S = 60.0
POLL_SLEEP_S = 20e-6
# The engine's data messages over a bare tcp channel (first pair only): the
# wire format and the KV cache reads, without the engine's threads and state.
CHANNEL = "channel"
BEFORE = "_before"  # --compare: the engine as before it kept buffers


# --- time breakdown (--breakdown): wrappers installed in each process ---------

TIMERS: dict[str, list[float]] = collections.defaultdict(list)
# Off during a channel sample: it calls some of the wrapped pieces too.
TIMING = {"on": True}


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not TIMING["on"]:
            return fn(*args, **kwargs)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMERS[name].append(time.perf_counter() - start)

    return wrapper


def install_timers() -> None:
    """Time the engine's pieces on every call (one list per piece)."""
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import (
        layout,
        peer,
        room,
    )
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport import tcp

    tcp.TcpChannel.send = _timed("channel.send (per message)", tcp.TcpChannel.send)
    tcp.TcpChannel.recv = _timed("channel.recv (per message)", tcp.TcpChannel.recv)
    tcp._memoryviews = _timed("memoryviews of the parts", tcp._memoryviews)
    peer.Peer.request = _timed("control round trip", peer.Peer.request)
    layout.KVLayout.read_blocks = _timed(
        "read_blocks (per layer)", layout.KVLayout.read_blocks
    )
    layout.KVLayout.read_block_bytes = _timed(
        "read_block_bytes (per layer)", layout.KVLayout.read_block_bytes
    )
    room.Room.take = _timed("receive room allocation", room.Room.take)


def take_timers() -> dict[str, list[float]]:
    out = {k: list(v) for k, v in TIMERS.items()}
    TIMERS.clear()
    return out


# --- the two processes -----------------------------------------------------------


def _engines(*, receiver: bool, before: bool = False, message_bytes=None):
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import (
        KVLayout,
        P2pEngine,
    )
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport import (
        create_transport,
    )
    from vllm_disagg.testing.server import get_free_port

    blocks = 2 * max(SIZES) // (LAYERS * PAGE)
    kv = {
        f"model.layers.{i}.self_attn.attn": torch.randint(
            0, 256, (blocks, PAGE), dtype=torch.uint8
        )
        for i in range(LAYERS)
    }
    engines = {}
    for mode in ENGINE_MODES:
        engines[mode] = P2pEngine(
            layout=KVLayout(kv, 16),
            host=HOST,
            port=get_free_port(),
            transport=create_transport("tcp", torch.device("cpu"), HOST),
            send_type=mode,
            kv_buffer_size=(1 << 30) if receiver else 0,
            mem_pool_size_bytes=0,
            hold_timeout_s=OP_TIMEOUT_S,
        )
        if before:  # --compare: as before (see the docstring)
            engines[mode].receiver.room.reuse = False
            engines[mode].local.transport.sends_host_bytes = False
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import protocol

    if before:  # one data message per layer (both processes of the pair)
        protocol.LAYER_MESSAGE_BYTES = 0
    elif message_bytes is not None:  # --message-bytes: both processes of a pair
        protocol.LAYER_MESSAGE_BYTES = message_bytes
    return engines


def _default_message_bytes() -> int:
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import protocol

    return protocol.LAYER_MESSAGE_BYTES


def _block_ids(size: int) -> list[int]:
    return list(range(0, 2 * size // (LAYERS * PAGE), 2))


def _raw_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.numpy())


class _BareChannel:
    """The tcp channel's own send and recv, not the wrappers --breakdown and
    --timeline put on the class (the channel sample is not the engine's)."""

    def __init__(self, sock: socket.socket):
        from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport import (
            tcp,
        )

        self.channel = tcp.TcpChannel(sock)
        self._send = inspect.unwrap(tcp.TcpChannel.send)
        self._recv = inspect.unwrap(tcp.TcpChannel.recv)

    def send(self, parts, deadline: float) -> None:
        self._send(self.channel, parts, deadline)

    def recv(self, parts, deadline: float) -> None:
        self._recv(self.channel, parts, deadline)


def _layer_groups(layer_bytes: int) -> list[range]:
    """The runs of layers the engine sends as one data message each."""
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import protocol

    return list(protocol.layer_groups(LAYERS, layer_bytes))


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def receiver(
    ctrl, breakdown: bool, before: bool, message_bytes=None, timeline=False
) -> None:
    if breakdown:
        install_timers()
    if timeline:
        p2p_timeline.install()
    engines = _engines(receiver=True, before=before, message_bytes=message_bytes)
    with socket.create_server((HOST, 0)) as server:
        ctrl.send(
            {
                "addrs": {m: e.addr for m, e in engines.items()},
                "raw": server.getsockname()[1],
            }
        )
        server.settimeout(OP_TIMEOUT_S)
        raw, _ = server.accept()
        chan = _BareChannel(server.accept()[0])
    raw.settimeout(OP_TIMEOUT_S)
    staging = torch.ones(max(SIZES), dtype=torch.uint8)  # touched once
    while (job := ctrl.recv()) is not None:
        if job[0] == "timers":
            ctrl.send(take_timers())
            continue
        if job[0] == "timeline":
            ctrl.send(p2p_timeline.take())
            continue
        kind, key, size, prefill = job
        faults = _minor_faults()
        if kind in ("raw", "raw_fresh"):
            buf = staging if kind == "raw" else torch.empty(size, dtype=torch.uint8)
            view = _raw_view(buf[:size])
            ctrl.send("ready")
            got = 0
            while got < size:
                n = raw.recv_into(view[got:])
                if n == 0:
                    raise ConnectionError("peer closed")
                got += n
            ctrl.send((time.monotonic(), "", _minor_faults() - faults))
            continue
        if kind == CHANNEL:
            per_layer = size // LAYERS
            TIMING["on"] = False
            ctrl.send("ready")
            for group in _layer_groups(per_layer):
                chan.recv(
                    [staging[i * per_layer : (i + 1) * per_layer] for i in group],
                    time.monotonic() + OP_TIMEOUT_S,
                )
            ctrl.send((time.monotonic(), "", _minor_faults() - faults))
            TIMING["on"] = True
            continue
        engine = engines["GET" if kind == "GET" else "PUT"]
        deadline = time.monotonic() + OP_TIMEOUT_S
        if kind != "GET":
            engine.expect(key, 0, deadline, get_from=None, prompt_digest=DIGEST)
            ctrl.send("ready")
        else:
            assert ctrl.recv() == "held"
            ctrl.send(time.monotonic())
            engine.expect(key, 0, deadline, get_from=prefill, prompt_digest=DIGEST)
        slot = None
        while slot is None and time.monotonic() < deadline:
            slot = engine.poll(key)
            if slot is None:
                time.sleep(POLL_SLEEP_S)
        end = time.monotonic()
        faults = _minor_faults() - faults
        reason = "no KV" if slot is None else slot.reason
        if slot is not None:
            engine.release(slot)
        ctrl.send((end, reason, faults))
    raw.close()
    for engine in engines.values():
        engine.close()


def sender(
    ctrl, breakdown: bool, before: bool, message_bytes=None, timeline=False
) -> None:
    if breakdown:
        install_timers()
    if timeline:
        p2p_timeline.install()
    engines = _engines(receiver=False, before=before, message_bytes=message_bytes)
    peers = ctrl.recv()
    raw = socket.create_connection((HOST, peers["raw"]), timeout=OP_TIMEOUT_S)
    chan = _BareChannel(
        socket.create_connection((HOST, peers["raw"]), timeout=OP_TIMEOUT_S)
    )
    layout = engines["PUT"].local.layout
    payload = torch.randint(0, 256, (max(SIZES),), dtype=torch.uint8)
    ctrl.send({m: e.addr for m, e in engines.items()})
    seq = 0
    while (job := ctrl.recv()) is not None:
        if job[0] == "timers":
            ctrl.send(take_timers())
            continue
        if job[0] == "timeline":
            ctrl.send(p2p_timeline.take())
            continue
        kind, key, size = job
        seq += 1
        if kind in ("raw", "raw_fresh"):
            start = time.monotonic()
            raw.sendall(_raw_view(payload[:size]))
            ctrl.send((start, ""))
            continue
        if kind == CHANNEL:  # what the engine puts on the wire, without it
            blocks = _block_ids(size)
            TIMING["on"] = False
            start = time.monotonic()
            for group in _layer_groups(len(blocks) * PAGE):
                parts = []
                for layer in group:
                    parts += layout.read_block_bytes(layer, blocks)
                chan.send(parts, start + OP_TIMEOUT_S)
            TIMING["on"] = True
            ctrl.send((start, ""))
            continue
        engine = engines["GET" if kind == "GET" else "PUT"]
        if kind != "GET":
            start = time.monotonic()
            xfer = engine.start_send(
                key,
                f"req-{seq}",
                peers["addrs"]["PUT"],
                _block_ids(size),
                all_saved=kind == "PUT",
                prompt_digest=DIGEST,
            )
            if kind != "PUT":  # the forward pass, then its end
                time.sleep(FORWARD_PASS_S)
                start = time.monotonic()
                xfer.all_saved()
        else:
            start = None  # the decode's expect()
            xfer = engine.hold(
                key, f"req-{seq}", _block_ids(size), prompt_digest=DIGEST
            )
            ctrl.send("held")
        xfer.done.wait(OP_TIMEOUT_S)
        engine.take_finished_sends()
        ctrl.send((start, "" if xfer.ok else xfer.reason or "not sent"))
    raw.close()
    for engine in engines.values():
        engine.close()


class Pair:
    """The two processes and the parent's side of their pipes."""

    def __init__(
        self,
        breakdown: bool,
        before: bool = False,
        message_bytes=None,
        timeline: bool = False,
    ):
        ctx = mp.get_context("spawn")
        self.to_send, send_end = ctx.Pipe()
        self.to_recv, recv_end = ctx.Pipe()
        how = (breakdown, before, message_bytes, timeline)
        self.procs = [
            ctx.Process(target=sender, args=(send_end, *how), name="sender"),
            ctx.Process(target=receiver, args=(recv_end, *how), name="receiver"),
        ]
        for p in self.procs:
            p.start()
        recv_info = self._get(self.to_recv)
        self.to_send.send(recv_info)
        self.prefill = self._get(self.to_send)
        self.seq = 0
        self.faults: list[int] = []  # the decode's minor faults, last sample

    def _get(self, conn):
        if not conn.poll(OP_TIMEOUT_S + 10):
            raise TimeoutError("a benchmark process did not answer")
        return conn.recv()

    def sample(self, kind: str, size: int) -> float:
        """Seconds for one transfer of ``size`` bytes by ``kind`` (raw, PUT, GET)."""
        self.seq += 1
        key = f"k{self.seq}"
        if kind == "GET":
            self.to_recv.send((kind, key, size, self.prefill["GET"]))
            self.to_send.send((kind, key, size))
            assert self._get(self.to_send) == "held"
            self.to_recv.send("held")
            start = self._get(self.to_recv)
            _, send_failed = self._get(self.to_send)
        else:
            self.to_recv.send((kind, key, size, None))
            assert self._get(self.to_recv) == "ready"
            self.to_send.send((kind, key, size))
            start, send_failed = self._get(self.to_send)
        end, recv_failed, faults = self._get(self.to_recv)
        self.faults.append(faults)
        self.span = (start, end)
        if send_failed or recv_failed:
            raise RuntimeError(f"{kind} {size}: failed: {send_failed} {recv_failed}")
        return end - start

    def stamps(self) -> list[tuple[str, float, float]]:
        """Both processes' timeline stamps since the last call (--timeline)."""
        out = []
        for side, conn in (("prefill", self.to_send), ("decode", self.to_recv)):
            conn.send(("timeline",))
            out += [(f"{side} {name}", s, e) for name, s, e in self._get(conn)]
        return out

    def timers(self) -> dict[str, dict[str, list[float]]]:
        out = {}
        for side, conn in (("prefill", self.to_send), ("decode", self.to_recv)):
            conn.send(("timers",))
            out[side] = self._get(conn)
        return out

    def close(self) -> None:
        for conn in (self.to_send, self.to_recv):
            conn.send(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def measure(args) -> dict:
    # column -> (pair, kind): the engine columns of each pair, and the raw ones
    pairs = {"": Pair(args.breakdown, timeline=args.timeline)}
    if args.compare:
        pairs[BEFORE] = Pair(False, before=True)
    for n in args.message_bytes:  # side by side: other LAYER_MESSAGE_BYTES
        pairs[f"_mb{n}"] = Pair(False, message_bytes=n)
    columns = ["raw", CHANNEL, *(("raw_fresh",) if args.compare else ())]
    columns += [m + suffix for suffix in pairs for m in MODES]
    seconds = {c: {s: [] for s in SIZES} for c in columns}
    faults = {c: {s: [] for s in SIZES} for c in columns}
    ratios = {
        c: {s: [] for s in SIZES}
        for c in columns
        if c.split("_")[0] in MODES or c == CHANNEL
    }

    timeline: dict[str, dict[int, list[list[float]]]] = {}

    def sample(pair: Pair, column: str, kind: str, size: int) -> float:
        value = pair.sample(kind, size)
        seconds[column][size].append(value)
        faults[column][size].append(pair.faults[-1])
        if args.timeline and pair is pairs[""]:
            stamps = pair.stamps()
            if kind in p2p_timeline.PHASES:
                cut = p2p_timeline.phases(kind, stamps, *pair.span)
                if cut is not None:
                    timeline.setdefault(kind, {}).setdefault(size, []).append(cut)
        return value

    try:
        for suffix, pair in pairs.items():
            kinds = (*MODES, CHANNEL) if suffix == "" else MODES
            for size in SIZES:  # warm-up: channels, TCP windows, allocator
                for kind in ("raw", *kinds, "raw", *kinds):
                    pair.sample(kind, size)
            pair.timers()  # the warm-up's are not counted
            if args.timeline and pair is pairs[""]:
                pair.stamps()
        for r in range(args.rounds):
            for size in SIZES:
                order = list(pairs.items())
                for suffix, pair in order if r % 2 == 0 else order[::-1]:
                    raw = [sample(pair, "raw", "raw", size)]
                    kinds = (*MODES, CHANNEL) if suffix == "" else MODES
                    for mode in kinds if r % 2 == 0 else kinds[::-1]:
                        column = CHANNEL if mode == CHANNEL else mode + suffix
                        value = sample(pair, column, mode, size)
                        raw.append(sample(pair, "raw", "raw", size))
                        ratios[column][size].append(statistics.fmean(raw[-2:]) / value)
                    if suffix == BEFORE:
                        sample(pair, "raw_fresh", "raw_fresh", size)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        timers = pairs[""].timers() if args.breakdown else {}
    finally:
        for pair in pairs.values():
            pair.close()
    return {
        "seconds": seconds,
        "ratios": ratios,
        "faults": faults,
        "timers": timers,
        "timeline": timeline,
    }


def summarize(result: dict) -> dict:
    out = {}
    for size in SIZES:
        row = {}
        for kind, per_size in result["seconds"].items():
            row[kind] = {
                "seconds_median": statistics.median(per_size[size]),
                "gbps_median": size / statistics.median(per_size[size]) / 1e9,
                "minor_faults_median": statistics.median(result["faults"][kind][size]),
            }
            if kind in result["ratios"]:
                r = result["ratios"][kind][size]
                row[kind]["ratio_to_raw_median"] = statistics.median(r)
                row[kind]["ratio_to_raw_min_max"] = [min(r), max(r)]
        out[size] = row
    return out


def breakdown_rows(timers: dict, transfers: int) -> list[list[str]]:
    """Per side and piece: calls and milliseconds per transfer."""
    rows = []
    for side, pieces in timers.items():
        for name, values in sorted(pieces.items()):
            rows.append(
                [
                    side,
                    name,
                    f"{len(values) / transfers:.1f}",
                    report.ms(sum(values) / transfers, 3),
                    report.ms(statistics.median(values), 3),
                ]
            )
    return rows


def markdown(summary: dict, result: dict, args) -> list[str]:
    def cell(kind: str, size: int) -> str:
        s = summary[size][kind]
        text = f"{report.ms(s['seconds_median'])} ms, {s['gbps_median']:.2f} GB/s"
        if "ratio_to_raw_median" in s:
            lo, hi = s["ratio_to_raw_min_max"]
            text += f" (**{s['ratio_to_raw_median']:.2f}x**, {lo:.2f}-{hi:.2f})"
        return text + f"; {s['minor_faults_median']:.0f} faults"

    kinds = list(summary[SIZES[0]])

    lines = [
        "# One P2P KV transfer end to end vs the raw loopback socket",
        "",
        report.generated(
            "p2p_transfer.py",
            f"Two processes on loopback; {LAYERS} layers x {PAGE // KIB} KiB pages, "
            "every other block of the cache; PUT from `start_send`, "
            f"PUT-after-pass from saving every layer {FORWARD_PASS_S * 1e3:.0f} ms "
            "after `start_send` (the worker's early offer), GET from the "
            "decode's `expect`, to the decode's `poll()` returning the complete "
            "slot; raw: one `sendall` into one `recv_into`; channel: the "
            "engine's data messages (runs of layers, the KV cache read as it "
            "reads it) over a bare tcp channel, without the engine's threads, "
            f"control messages and state. {args.rounds} rounds; "
            "in each, every engine sample runs between two raw samples and the "
            "ratio is their mean time over its time (1.0: as fast as the raw "
            "socket; the goal is >= 0.8). Times are medians; the ratio is the "
            "median (min-max) of the ratios. Load average (1 min) before and "
            f"after the run: {args.load_average[0]:.1f}, {args.load_average[1]:.1f}. "
            "Faults: the decode process's minor page faults during the sample "
            "(median)."
            + (
                " `_before`: the second pair of processes (same rounds), set to "
                "work as before: a fresh receive buffer per transfer, a torch "
                "view per block sent, one message per layer; `raw_fresh`: "
                "`recv_into` a fresh `torch.empty` each time."
                if args.compare
                else ""
            )
            + (
                " `_mb<N>`: another pair (same rounds) whose data messages "
                "group layers up to N bytes (`protocol.LAYER_MESSAGE_BYTES`; 0: "
                "one layer per message); the unsuffixed pair runs the default, "
                f"{_default_message_bytes()}."
                if args.message_bytes
                else ""
            )
            + (f" Code: {args.tag}." if args.tag else ""),
        ),
        "",
        *report.table(
            ["sample", *(f"{size // MIB} MiB" for size in SIZES)],
            [[k, *(cell(k, size) for size in SIZES)] for k in kinds],
        ),
    ]
    if result["timers"]:
        transfers = args.rounds * len(SIZES) * len(MODES)
        lines += [
            "",
            "## Where the time goes",
            "",
            f"Every timed call of the {transfers} engine transfers, both modes and "
            "sizes together (the raw samples call none of these; with "
            "`--compare`, the first pair's only).",
            "",
            *report.table(
                [
                    "side",
                    "piece",
                    "calls per transfer",
                    "ms per transfer",
                    "median ms per call",
                ],
                breakdown_rows(result["timers"], transfers),
            ),
        ]
    if result.get("timeline"):
        lines += [
            "",
            "## One transfer's critical path",
            "",
            "`--timeline`: each engine sample of the first pair cut into phases "
            "at milestones stamped in both processes (one clock; "
            "`benchmarks/common/p2p_timeline.py` says which); median ms of each phase, "
            "so a column adds up to about the sample's median time.",
            "",
            *report.table(
                ["mode", "phase", *(f"{size // MIB} MiB" for size in SIZES)],
                p2p_timeline.rows(result["timeline"], SIZES),
            ),
        ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also a pair working as before (fresh buffers, views per block)",
    )
    parser.add_argument("--tag", default="", help="suffix of the result files")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="cut each engine sample of the first pair into phases at stamped "
        "milestones (benchmarks/common/p2p_timeline.py)",
    )
    parser.add_argument(
        "--message-bytes",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[],
        help="comma-separated: one more pair (columns _mb<N>) for each, with "
        "protocol.LAYER_MESSAGE_BYTES N (0: one layer per message)",
    )
    report.add_out_argument(parser)
    args = parser.parse_args()
    require()  # nothing beyond torch, which the target's requirements install
    start = time.monotonic()
    load_before = os.getloadavg()[0]
    result = measure(args)
    args.load_average = [load_before, os.getloadavg()[0]]
    summary = summarize(result)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    name = "p2p_transfer" + (f"-{args.tag}" if args.tag else "")
    report.write(
        (args.out or report.RESULTS) / name,
        {"args": settings, "summary": summary, **result},
        markdown(summary, result, args),
        None,
    )
    print(f"took {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
