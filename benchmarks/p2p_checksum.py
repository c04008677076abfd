"""What ``kv_checksum`` costs a P2P KV transfer on CPU, per algorithm.

Two parts, one run:

* **Hash throughput**, this process, one thread: each installed algorithm
  over 64 MiB, once as one call and once the way the engine hashes (one
  call per block, through ``checksum.py``'s own code), for several block
  sizes. Algorithms whose library is missing are listed as such.
* **GIL stalls**, this process: while a second thread hashes 32 MiB over and
  over the engine's way (8 and 32 KiB blocks), how late this thread wakes from
  0.5 ms sleeps. A receive thread that hashes with the GIL held would stall
  the worker's model thread just like that.
* **Transfer time**, two processes on loopback (a sender and a receiver),
  the real engines (``P2pEngine``, ``tcp`` transport, PUT with every layer
  saved): for each KV shape, one engine pair per algorithm plus one with
  ``kv_checksum: none``. A sample is ``count`` transfers queued at once,
  from the sender's first ``start_send`` to the receiver's last complete
  slot (checksums verified), every slot released without a copy into the
  cache (so the figure is the transfer alone; a copy would only dilute it).
  The blocks are every other block of the cache, so no two are adjacent.
  Within every round each algorithm's sample runs between two samples without
  a checksum (the order reversed every other round), and its time is divided
  by their mean: these machines are shared and noisy, and the neighbouring
  samples follow the drift. The result is the median of those ratios over
  rounds; ``ratio - 1`` is the share of transfer time the checksum costs.

Writes benchmarks/results/p2p_checksum.{json,md,png} (about two minutes;
``--out DIR``: elsewhere). The load average before and after is in the report.

    .venv/bin/python benchmarks/p2p_checksum.py [--rounds 9] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from _deps import require  # benchmarks/_deps.py: sys.path[0] when run as a script
from common import report

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.checksum import (
    ALGORITHMS,
    NONE,
    ChecksumUnavailable,
    make_checksum,
)

KIB, MIB = 1 << 10, 1 << 20
HOST = "127.0.0.1"
DIGEST = b"\x01" * 16
HASH_BYTES = 64 * MIB
HASH_BLOCKS = (8 * KIB, 32 * KIB, 64 * KIB, 256 * KIB)
GIL_BLOCKS = (8 * KIB, 32 * KIB)
# (label, layers, page bytes, blocks per transfer)
SHAPES = (
    ("8 layers x 64 KiB blocks x 64 (32 MiB)", 8, 64 * KIB, 64),
    ("32 layers x 32 KiB blocks x 32 (32 MiB)", 32, 32 * KIB, 32),
    ("32 layers x 8 KiB blocks x 128 (32 MiB)", 32, 8 * KIB, 128),
    ("8 layers x 64 KiB blocks x 4 (2 MiB)", 8, 64 * KIB, 4),
)
SETUP_TIMEOUT_S = 60.0
OP_TIMEOUT_S = 60.0


def available() -> list[str]:
    found = []
    for name in ALGORITHMS:
        try:
            make_checksum(name)
        except ChecksumUnavailable:
            continue
        found.append(name)
    return found


# --- hash throughput (this process) ------------------------------------------


def hash_throughput(algorithms: list[str], rounds: int) -> dict:
    """GB/s per algorithm: one call over HASH_BYTES, and per block of each size
    through Checksum.digests (what the sender runs; the receiver's check is
    the same loop over one tensor)."""
    data = torch.randint(0, 256, (HASH_BYTES,), dtype=torch.uint8)
    whole = {name: [] for name in algorithms}
    per_block = {name: {b: [] for b in HASH_BLOCKS} for name in algorithms}
    for _ in range(rounds):
        for name in algorithms:
            checksum = make_checksum(name)
            start = time.perf_counter()
            checksum.digests([data], HASH_BYTES)
            whole[name].append(HASH_BYTES / (time.perf_counter() - start) / 1e9)
            for block in HASH_BLOCKS:
                start = time.perf_counter()
                checksum.digests([data], block)
                per_block[name][block].append(
                    HASH_BYTES / (time.perf_counter() - start) / 1e9
                )
    return {
        name: {
            "one_call_gbps": statistics.median(whole[name]),
            "per_block_gbps": {
                b: statistics.median(per_block[name][b]) for b in HASH_BLOCKS
            },
        }
        for name in algorithms
    }


# --- GIL stalls (this process) ------------------------------------------------


def gil_stalls(algorithms: list[str], wakeups: int) -> dict:
    """How late this thread wakes from 0.5 ms sleeps (ms: p50, p90, max) while
    another thread hashes per block; ``"none"``: no other thread."""
    data = torch.randint(0, 256, (32 * MIB,), dtype=torch.uint8)
    out: dict = {}
    for name in [NONE, *algorithms]:
        for block in GIL_BLOCKS:
            if name == NONE and block != GIL_BLOCKS[0]:
                continue
            stop = threading.Event()

            def work(name=name, block=block, stop=stop) -> None:
                checksum = make_checksum(name)
                while not stop.is_set():
                    checksum.digests([data], block)

            thread = threading.Thread(target=work) if name != NONE else None
            if thread is not None:
                thread.start()
                time.sleep(0.05)
            late = []
            for _ in range(wakeups):
                start = time.perf_counter()
                time.sleep(0.0005)
                late.append((time.perf_counter() - start - 0.0005) * 1000)
            stop.set()
            if thread is not None:
                thread.join()
            late.sort()
            out[f"{name} {_size(block)}" if name != NONE else NONE] = {
                "p50_ms": late[len(late) // 2],
                "p90_ms": late[int(len(late) * 0.9)],
                "max_ms": late[-1],
            }
    return out


# --- transfers (two processes) -----------------------------------------------


def _engines(shape, algorithms: list[str], *, receiver: bool):
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import (
        KVLayout,
        P2pEngine,
    )
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport import (
        create_transport,
    )
    from vllm_disagg.testing.server import get_free_port

    _, layers, page, blocks = shape
    # Every other block of a cache twice as large: no two blocks adjacent.
    kv = {
        f"model.layers.{i}.self_attn.attn": torch.randint(
            0, 256, (2 * blocks, page), dtype=torch.uint8
        )
        for i in range(layers)
    }
    engines = {}
    for name in [NONE, *algorithms]:
        engines[name] = P2pEngine(
            layout=KVLayout(kv, 16),
            host=HOST,
            port=get_free_port(),
            transport=create_transport("tcp", torch.device("cpu"), HOST),
            send_type="PUT",
            kv_buffer_size=(1 << 30) if receiver else 0,
            mem_pool_size_bytes=0,
            hold_timeout_s=OP_TIMEOUT_S,
            checksum=name,
        )
    return engines, list(range(0, 2 * blocks, 2))


def receiver(ctrl) -> None:
    engines: dict = {}
    while (job := ctrl.recv()) is not None:
        if job[0] == "setup":
            for engine in engines.values():
                engine.close()
            engines, _ = _engines(job[1], job[2], receiver=True)
            ctrl.send({name: e.addr for name, e in engines.items()})
            continue
        _, name, keys = job
        engine = engines[name]
        deadline = time.monotonic() + OP_TIMEOUT_S
        for key in keys:
            engine.expect(key, 0, deadline, get_from=None, prompt_digest=DIGEST)
        ctrl.send("ready")
        pending, failed = set(keys), []
        while pending and time.monotonic() < deadline:
            for key in list(pending):
                slot = engine.poll(key)
                if slot is not None:
                    if slot.reason:
                        failed.append(slot.reason)
                    engine.release(slot)
                    pending.discard(key)
            if pending:
                time.sleep(0.001)
        ctrl.send((time.monotonic(), failed + [f"{k}: no KV" for k in pending]))
    for engine in engines.values():
        engine.close()


def sender(ctrl) -> None:
    engines: dict = {}
    peers: dict = {}
    block_ids: list[int] = []
    seq = 0
    while (job := ctrl.recv()) is not None:
        if job[0] == "setup":
            for engine in engines.values():
                engine.close()
            engines, block_ids = _engines(job[1], job[2], receiver=False)
            peers = job[3]
            ctrl.send("ok")
            continue
        _, name, keys = job
        engine = engines[name]
        seq += 1
        start = time.monotonic()
        xfers = [
            engine.start_send(
                key,
                f"req-{seq}-{key}",
                peers[name],
                block_ids,
                all_saved=True,
                prompt_digest=DIGEST,
            )
            for key in keys
        ]
        for xfer in xfers:
            xfer.done.wait(OP_TIMEOUT_S)
        for engine in engines.values():
            engine.take_finished_sends()
        ctrl.send((start, [x.reason for x in xfers if not x.ok]))
    for engine in engines.values():
        engine.close()


class Pair:
    """The two processes and the parent's side of their pipes."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.to_send, send_end = ctx.Pipe()
        self.to_recv, recv_end = ctx.Pipe()
        self.procs = [
            ctx.Process(target=sender, args=(send_end,), name="sender"),
            ctx.Process(target=receiver, args=(recv_end,), name="receiver"),
        ]
        for p in self.procs:
            p.start()
        self.seq = 0

    def _get(self, conn):
        if not conn.poll(OP_TIMEOUT_S + 10):
            raise TimeoutError("a benchmark process did not answer")
        return conn.recv()

    def setup(self, shape, algorithms: list[str]) -> None:
        self.to_recv.send(("setup", shape, algorithms))
        addrs = self._get(self.to_recv)
        self.to_send.send(("setup", shape, algorithms, addrs))
        assert self._get(self.to_send) == "ok"

    def sample(self, name: str, count: int) -> float:
        """Seconds for ``count`` transfers with kv_checksum ``name``."""
        self.seq += 1
        keys = [f"s{self.seq}-{i}" for i in range(count)]
        self.to_recv.send(("batch", name, keys))
        assert self._get(self.to_recv) == "ready"
        self.to_send.send(("batch", name, keys))
        start, send_failed = self._get(self.to_send)
        end, recv_failed = self._get(self.to_recv)
        if send_failed or recv_failed:
            raise RuntimeError(f"{name}: transfers failed: {send_failed + recv_failed}")
        return end - start

    def close(self) -> None:
        for conn in (self.to_send, self.to_recv):
            conn.send(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def measure_transfers(args, algorithms: list[str], shapes) -> dict:
    pair = Pair()
    out = {}
    try:
        for shape in shapes:
            label, layers, page, blocks = shape
            nbytes = layers * page * blocks
            pair.setup(shape, algorithms)
            # Warm-up, which also sizes the samples: about --sample-s each,
            # at least 2 transfers, the receive buffer's worth at most.
            warm = min(pair.sample(NONE, 2) for _ in range(3)) / 2
            for name in algorithms:
                pair.sample(name, 2)
            count = max(2, min(int(args.sample_s / warm), (256 * MIB) // nbytes))
            seconds = {name: [] for name in [NONE, *algorithms]}
            ratios = {name: [] for name in algorithms}
            for r in range(args.rounds):
                order = algorithms if r % 2 == 0 else algorithms[::-1]
                base = [pair.sample(NONE, count)]
                for name in order:
                    value = pair.sample(name, count)
                    base.append(pair.sample(NONE, count))
                    seconds[name].append(value / count)
                    ratios[name].append(value / statistics.fmean(base[-2:]))
                seconds[NONE].extend(b / count for b in base)
            out[label] = {
                "bytes": nbytes,
                "transfers_per_sample": count,
                "seconds_per_transfer": seconds,
                "ratios": ratios,
            }
            print(f"{label}: done", flush=True)
    finally:
        pair.close()
    return out


def summarize(transfers: dict) -> dict:
    summary = {}
    for label, data in transfers.items():
        row = {}
        for name, values in data["seconds_per_transfer"].items():
            entry = {
                "ms_median": statistics.median(values) * 1000,
                "gbps_median": data["bytes"] / statistics.median(values) / 1e9,
            }
            if name in data["ratios"]:
                ratios = data["ratios"][name]
                entry["ratio_median"] = statistics.median(ratios)
                entry["ratio_min_max"] = [min(ratios), max(ratios)]
            row[name] = entry
        summary[label] = row
    return summary


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def markdown(
    hashes: dict, stalls: dict, summary: dict, args, algorithms, missing
) -> list[str]:
    names = [NONE, *algorithms]

    def cell(label: str, name: str) -> str:
        s = summary[label][name]
        text = f"{s['ms_median']:.1f} ms"
        if "ratio_median" in s:
            lo, hi = s["ratio_min_max"]
            text += f" ({s['ratio_median']:.3f}x; {lo:.2f}-{hi:.2f})"
        return text

    lines = [
        "# kv_checksum: what per-block checksums cost a P2P KV transfer on CPU",
        "",
        report.generated(
            "p2p_checksum.py",
            "Load average (1 min) before and after the run: "
            f"{args.load_average[0]:.1f}, {args.load_average[1]:.1f}.",
            f"Not installed (not measured): {', '.join(missing)}." if missing else "",
        ),
        "",
        "## Hash throughput (one thread, 64 MiB of random bytes)",
        "",
        "One call over the whole buffer, and one call per block as the engine "
        "hashes (`checksum.py`: a memoryview per block, digests into an array). "
        f"GB/s, median of {args.hash_rounds} rounds.",
        "",
        *report.table(
            ["algorithm", "one call", *(f"per {_size(b)} block" for b in HASH_BLOCKS)],
            [
                [
                    name,
                    f"{hashes[name]['one_call_gbps']:.2f}",
                    *(f"{hashes[name]['per_block_gbps'][b]:.2f}" for b in HASH_BLOCKS),
                ]
                for name in algorithms
            ],
        ),
        "",
        "## GIL stalls",
        "",
        "How late a thread wakes from 0.5 ms sleeps while another thread of the "
        "same process hashes 32 MiB over and over, per block of the size given "
        f"(ms over {args.wakeups} wake-ups; `none`: no hashing thread). A receive "
        "thread that holds the GIL while it hashes stalls the worker's model thread "
        "this way.",
        "",
        *report.table(
            ["hashing thread", "p50 ms", "p90 ms", "max ms"],
            [
                [label, *(f"{v[k]:.2f}" for k in ("p50_ms", "p90_ms", "max_ms"))]
                for label, v in stalls.items()
            ],
        ),
        "",
        "## Transfer time with and without a checksum",
        "",
        "Two processes on loopback, `P2pEngine` pairs over the `tcp` transport, "
        "PUT with every layer saved; per transfer: the sender's `start_send` .. the "
        "receiver's complete slot (digests checked), batches of transfers queued at "
        f"once. {args.rounds} rounds; in each, every algorithm's sample runs between "
        "two samples without a checksum and is divided by their mean. Cells: median "
        "ms per transfer; in brackets the median ratio to no checksum and its range "
        "over rounds (ratio - 1 is the share of transfer time the checksum costs).",
        "",
        *report.table(
            ["KV per transfer", *names],
            [[label, *(cell(label, n) for n in names)] for label in summary],
        ),
    ]
    return lines


def plot(summary: dict, algorithms: list[str], path: Path) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.8))
    labels = list(summary)
    width = 0.8 / max(1, len(algorithms))
    for i, name in enumerate(algorithms):
        ax.bar(
            [x + i * width for x in range(len(labels))],
            [summary[label][name]["ratio_median"] for label in labels],
            width,
            label=name,
        )
    ax.axhline(1.05, color="#999999", linewidth=1)
    ax.set_ylim(bottom=0.9)
    ax.set_xticks(
        [x + width * (len(algorithms) - 1) / 2 for x in range(len(labels))],
        [label.split(" (")[0] for label in labels],
        fontsize=7,
    )
    ax.set_ylabel("transfer time / no checksum")
    ax.legend(fontsize=8)
    ax.set_title("kv_checksum on CPU (loopback tcp; line: +5 %)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--hash-rounds", type=int, default=5)
    parser.add_argument("--wakeups", type=int, default=300)
    parser.add_argument(
        "--sample-s", type=float, default=0.25, help="target seconds per sample"
    )
    parser.add_argument(
        "--quick", action="store_true", help="3 rounds, the first shape only"
    )
    report.add_out_argument(parser)
    args = parser.parse_args()
    require("matplotlib")  # before the measurement, not at the plot
    if args.quick:
        args.rounds, args.hash_rounds, args.wakeups = 3, 2, 100
    start = time.monotonic()
    algorithms = available()
    missing = [name for name in ALGORITHMS if name not in algorithms]
    load_before = os.getloadavg()[0]
    hashes = hash_throughput(algorithms, args.hash_rounds)
    stalls = gil_stalls(algorithms, args.wakeups)
    transfers = measure_transfers(
        args, algorithms, SHAPES[:1] if args.quick else SHAPES
    )
    args.load_average = [load_before, os.getloadavg()[0]]
    summary = summarize(transfers)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    result = {
        "args": settings,
        "not_installed": missing,
        "hash_gbps": hashes,
        "gil_stalls": stalls,
        "summary": summary,
        "transfers": transfers,
    }
    report.write(
        (args.out or report.RESULTS) / "p2p_checksum",
        result,
        markdown(hashes, stalls, summary, args, algorithms, missing),
        lambda png: plot(summary, algorithms, png),
    )
    print(f"took {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
