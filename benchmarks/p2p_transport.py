"""P2P data-plane transports on CPU: tcp and gloo against the raw socket ceiling.

Two processes (a sender and a receiver) keep three links up for the whole
run: a plain loopback TCP connection (the ceiling: ``sendall`` of one buffer,
``recv_into`` one buffer, default socket options), a ``tcp`` transport
channel and a ``gloo`` transport channel. For each message size, messages
go one way, either as one tensor or cut into 32 KiB blocks (every other block
of a larger pool, like a request's KV blocks) received into one staging
tensor, as the P2P engine does. Throughput is bytes / (first send .. the
receiver's last byte), over enough messages to take about ``--sample-s``
(sized in the warm-up; at least 3 messages, at most ``--bytes-per-sample``).

Within every round each transport configuration runs between two samples
of the raw socket (the order reversed every other round), and its ratio is
taken against their mean: these machines are shared and noisy, and the
neighbouring samples follow the drift. The result is the median over rounds.
Writes benchmarks/results/p2p_transport.{json,md,png} (about a minute; ``--out DIR``:
elsewhere).

    .venv/bin/python benchmarks/p2p_transport.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
from _deps import require  # benchmarks/_deps.py: sys.path[0] when run as a script
from common import report

KIB, MIB = 1 << 10, 1 << 20
BLOCK_BYTES = 32 * KIB
SIZES = (64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB)
# (label, link, sender cuts the message into blocks)
CONFIGS = (
    ("raw socket", "raw", False),
    ("tcp, 1 part", "tcp", False),
    ("tcp, 32 KiB blocks", "tcp", True),
    ("gloo, 1 part", "gloo", False),
    ("gloo, 32 KiB blocks", "gloo", True),
)
SETUP_TIMEOUT_S = 60.0
OP_TIMEOUT_S = 60.0


def _transport(name: str):
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport import (
        create_transport,
    )

    return create_transport(name, torch.device("cpu"), "127.0.0.1")


def _connect_links(ctrl, sender: bool) -> dict:
    """The raw socket and both transport channels, set up over ``ctrl``."""
    links = {}
    if sender:
        links["raw"] = socket.create_connection(
            ("127.0.0.1", ctrl.recv()), timeout=OP_TIMEOUT_S
        )
    else:
        with socket.create_server(("127.0.0.1", 0)) as server:
            ctrl.send(server.getsockname()[1])
            server.settimeout(SETUP_TIMEOUT_S)
            links["raw"], _ = server.accept()
            links["raw"].settimeout(OP_TIMEOUT_S)
    for name in ("tcp", "gloo"):
        transport = _transport(name)
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        if sender:
            setup, finish = transport.initiate()
            ctrl.send(setup)
            links[name] = finish(ctrl.recv(), deadline)
        else:
            reply, finish = transport.accept(ctrl.recv())
            ctrl.send(reply)
            links[name] = finish(deadline)
    return links


def _message(size: int, blocks: bool) -> list[torch.Tensor]:
    """The tensors one side hands over: one tensor, or every other block of a pool."""
    n = size // BLOCK_BYTES if blocks else 1
    pool = torch.randn(2 * n if blocks else 1, size // n // 2).to(torch.bfloat16)
    return [pool[i] for i in range(0, 2 * n, 2)] if blocks else [pool[0]]


def _raw_send(sock: socket.socket, tensor: torch.Tensor) -> None:
    sock.sendall(memoryview(tensor.view(torch.uint8).numpy()))


def _raw_recv(sock: socket.socket, tensor: torch.Tensor) -> None:
    view = memoryview(tensor.view(torch.uint8).numpy())
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def receiver(ctrl) -> None:
    links = _connect_links(ctrl, sender=False)
    # Allocated and touched once: page faults are not what is measured.
    stagings = {size: torch.zeros(size // 2, dtype=torch.bfloat16) for size in SIZES}
    while (job := ctrl.recv()) is not None:
        link, size, count = job
        staging = stagings[size]
        ctrl.send("ready")
        for _ in range(count):
            if link == "raw":
                _raw_recv(links["raw"], staging)
            else:
                links[link].recv([staging], time.monotonic() + OP_TIMEOUT_S)
        ctrl.send("done")


def sender(ctrl, args: argparse.Namespace, results) -> None:
    links = _connect_links(ctrl, sender=True)
    messages = {
        (size, blocks): _message(size, blocks)
        for size in SIZES
        for blocks in (False, True)
    }

    def sample(link: str, size: int, blocks: bool, count: int) -> float:
        tensors = messages[(size, blocks)]
        ctrl.send((link, size, count))
        assert ctrl.recv() == "ready"
        start = time.perf_counter()
        for _ in range(count):
            if link == "raw":
                _raw_send(links["raw"], tensors[0])
            else:
                links[link].send(tensors, time.monotonic() + OP_TIMEOUT_S)
        assert ctrl.recv() == "done"
        return count * size / (time.perf_counter() - start) / 1e9

    # Warm-up (buffers, page faults, TCP windows), which also sizes every
    # configuration's samples: about --sample-s each, at most
    # --bytes-per-sample, at least 3 messages.
    counts = {}
    for _, link, blocks in CONFIGS:
        for size in SIZES:
            warm_gbps = sample(link, size, blocks, max(3, 8 * MIB // size))
            fit = int(args.sample_s * warm_gbps * 1e9 / size)
            counts[(link, size, blocks)] = max(
                3, min(args.bytes_per_sample // size, fit)
            )

    def timed(link: str, size: int, blocks: bool) -> float:
        return sample(link, size, blocks, counts[(link, size, blocks)])

    # Every transport sample sits between two raw-socket samples: its ratio
    # is taken against their mean, which follows the machine's drift.
    gbps = {label: {size: [] for size in SIZES} for label, _, _ in CONFIGS}
    ratios = {label: {size: [] for size in SIZES} for label, _, _ in CONFIGS[1:]}
    for r in range(args.rounds):
        for size in SIZES:
            raw = [timed("raw", size, False)]
            for label, link, blocks in (
                CONFIGS[1:] if r % 2 == 0 else reversed(CONFIGS[1:])
            ):
                value = timed(link, size, blocks)
                raw.append(timed("raw", size, False))
                gbps[label][size].append(value)
                ratios[label][size].append(value / statistics.fmean(raw[-2:]))
            gbps["raw socket"][size].extend(raw)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    ctrl.send(None)
    for link in links.values():
        link.close()
    results.put((gbps, ratios))


def measure(args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    ctrl_a, ctrl_b = ctx.Pipe()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=sender, args=(ctrl_a, args, results), name="sender"),
        ctx.Process(target=receiver, args=(ctrl_b,), name="receiver"),
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a benchmark process failed: {procs}") from None
        raise TimeoutError(f"no result in {args.timeout_s} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def summarize(gbps: dict, ratios: dict) -> dict:
    summary = {}
    for label, per_size in gbps.items():
        summary[label] = {}
        for size, samples in per_size.items():
            summary[label][size] = {"gbps_median": statistics.median(samples)}
            if label in ratios:
                summary[label][size]["ratio_to_raw_median"] = statistics.median(
                    ratios[label][size]
                )
                summary[label][size]["ratio_to_raw_min_max"] = [
                    min(ratios[label][size]),
                    max(ratios[label][size]),
                ]
    return summary


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def markdown(summary: dict, args: argparse.Namespace) -> list[str]:
    labels = [label for label, _, _ in CONFIGS]

    def cell(label: str, size: int) -> str:
        s = summary[label][size]
        ratio = "" if label == "raw socket" else f" ({s['ratio_to_raw_median']:.2f}x)"
        return f"{s['gbps_median']:.2f} GB/s{ratio}"

    return [
        "# P2P transports on CPU: tcp and gloo vs the raw socket ceiling",
        "",
        report.generated(
            "p2p_transport.py",
            '2 processes, loopback, one direction; a "32 KiB blocks" message is '
            "sent as every other block of a pool and received into one tensor. "
            f"{args.rounds} rounds; in each, every transport sample runs between two "
            "raw-socket samples and is divided by their mean. GB/s is the median over "
            "rounds, the ratio (in brackets) the median of those ratios; the goal is "
            ">= 0.8x the raw socket. Load average (1 min) before and after the run: "
            f"{args.load_average[0]:.1f}, {args.load_average[1]:.1f}.",
        ),
        "",
        *report.table(
            ["message", *labels],
            [[_size(size), *(cell(label, size) for label in labels)] for size in SIZES],
        ),
    ]


def plot(summary: dict, path: Path) -> None:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    x = range(len(SIZES))
    for label, _, _ in CONFIGS:
        style = "k--" if label == "raw socket" else "o-"
        axes[0].plot(
            x, [summary[label][s]["gbps_median"] for s in SIZES], style, label=label
        )
        if label != "raw socket":
            axes[1].plot(
                x,
                [summary[label][s]["ratio_to_raw_median"] for s in SIZES],
                "o-",
                label=label,
            )
    axes[1].axhline(0.8, color="#999999", linewidth=1)
    for ax, title in zip(
        axes, ("throughput (GB/s, median)", "throughput / raw socket"), strict=True
    ):
        ax.set_xticks(list(x), [_size(s) for s in SIZES])
        ax.set_xlabel("message size")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle("P2P transports on CPU (loopback, one direction)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--bytes-per-sample", type=int, default=32 * MIB)
    parser.add_argument(
        "--sample-s", type=float, default=0.1, help="target seconds per sample"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=170.0, help="bound on the whole run"
    )
    report.add_out_argument(parser)
    args = parser.parse_args()
    require("matplotlib")  # before the measurement, not at the plot
    start = time.monotonic()
    load_before = os.getloadavg()[0]
    gbps, ratios = measure(args)
    args.load_average = [load_before, os.getloadavg()[0]]  # 1-minute, before and after
    summary = summarize(gbps, ratios)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    result = {"args": settings, "summary": summary, "gbps": gbps, "ratios": ratios}
    report.write(
        (args.out or report.RESULTS) / "p2p_transport",
        result,
        markdown(summary, args),
        lambda png: plot(summary, png),
    )
    print(f"took {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
