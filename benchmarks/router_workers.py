"""The router's request-rate ceiling with 1, 2 and 4 worker processes.

Three routers run side by side in one run (``--workers 1``, ``2``, ``4``),
each over the same two fake instances (``vllm_disagg.testing.fake_instance``
in processes of their own, answering at once), so what limits the rate is
the router, the fakes or the client. Per round, in a shuffled order, each
router gets ``--seconds`` of non-streamed completions from ``--clients``
concurrent client loops (one aiohttp session, new connections allowed to be
kept alive); requests/s, latency p50/p99 and the CPU of every process group
(router and its workers, fakes, this client) are recorded. Ratios to the
one-worker router of the same round are the figures: this machine is shared.

    python benchmarks/router_workers.py              # 3 rounds of 10 s
    python benchmarks/router_workers.py --quick      # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

from _deps import require  # benchmarks/ is sys.path[0] when run as a script
from common import report
from common.procs import Child, load_snapshot, uptime
from common.stats import pcts, ratio

from vllm_disagg.testing.router import RouterProcess
from vllm_disagg.testing.server import get_free_port

STEM = "router_workers"
WORKERS = (1, 2, 4)
MODEL = "fake-model"


def start_fake(role: str, logs: Path) -> Child:
    port = get_free_port()
    command = [
        sys.executable,
        "-m",
        "vllm_disagg.testing.fake_instance",
        "--name",
        role,
        "--port",
        str(port),
        "--model",
        MODEL,
    ]
    return Child(f"fake {role}", command, logs / f"{STEM}-{role}.log", port).start()


def group_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (a router and its workers)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return float("nan")
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


async def load(url: str, clients: int, seconds: float) -> dict:
    import aiohttp

    body = {"model": MODEL, "prompt": "hello router", "max_tokens": 1}
    latencies: list[float] = []
    errors = 0
    stop_at = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            try:
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except aiohttp.ClientError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - t0)
            else:
                errors += 1

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        wall = time.monotonic() - t0
    q = pcts(latencies, (50, 99))
    return {
        "rps": len(latencies) / wall,
        "errors": errors,
        "p50_s": q["p50"],
        "p99_s": q["p99"],
        "wall_s": wall,
    }


def measure(args, routers: dict[int, RouterProcess], fakes: dict[str, Child]) -> list:
    rng = random.Random(args.seed)
    rounds = []
    for r in range(args.rounds):
        order = list(WORKERS)
        rng.shuffle(order)
        row = {}
        for n in order:
            router = routers[n]
            pids = {"router": router.proc.pid} | {
                role: fake.proc.pid for role, fake in fakes.items()
            }
            pids["client"] = os.getpid()
            before = {k: group_cpu_s(pid) for k, pid in pids.items()}
            res = asyncio.run(load(router.url, args.clients, args.seconds))
            after = {k: group_cpu_s(pid) for k, pid in pids.items()}
            res["cores"] = {k: (after[k] - before[k]) / res["wall_s"] for k in pids}
            row[str(n)] = res
        rounds.append(row)
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n} workers {row[str(n)]['rps']:.0f}/s" for n in WORKERS),
            flush=True,
        )
    return rounds


def markdown(result: dict) -> list[str]:
    rounds = result["rounds"]
    lines = [
        "# The router with several worker processes (`--workers N`)",
        "",
        report.generated(
            "router_workers.py",
            f"`uptime` at the start: {result['uptime_start']}; at the end: "
            f"{result['uptime_end']}.",
        ),
        "",
        f"{result['rounds_n']} rounds; in each, every router served "
        f"{result['clients']} concurrent client loops of non-streamed completions "
        f"(`max_tokens` 1) for {result['seconds']:g} s, in a shuffled order, over "
        "the same two fake instances (processes of their own, answering at once). "
        "Columns: requests/s (median over rounds), its ratio to one worker in the "
        "same round (median [min-max]), latency p50 / p99 (median over rounds), "
        "errors (all rounds), and the cores each process group used while that "
        "router was loaded (router = supervisor + workers; median over rounds).",
        "",
    ]
    rows = []
    for n in WORKERS:
        cells = [rd[str(n)] for rd in rounds]
        ratios = [ratio(rd[str(n)]["rps"], rd["1"]["rps"]) for rd in rounds]
        cores = {
            k: statistics.median(c["cores"][k] for c in cells)
            for k in cells[0]["cores"]
        }
        rows.append(
            [
                n,
                f"{statistics.median(c['rps'] for c in cells):.0f}",
                report.spread([x for x in ratios if x is not None]),
                report.ms(statistics.median(c["p50_s"] for c in cells), 1),
                report.ms(statistics.median(c["p99_s"] for c in cells), 1),
                sum(c["errors"] for c in cells),
                f"{cores['router']:.2f}",
                report.ms(
                    statistics.median(c["cores"]["router"] / c["rps"] for c in cells), 2
                ),
                f"{cores['prefill']:.2f} / {cores['decode']:.2f}",
                f"{cores['client']:.2f}",
            ]
        )
    lines += report.table(
        [
            "workers",
            "req/s",
            "x 1 worker",
            "p50 ms",
            "p99 ms",
            "errors",
            "router cores",
            "router CPU ms / request",
            "fake P / D cores",
            "client cores",
        ],
        rows,
    )
    lines += ["", result["reading"]]
    return lines


def reading(result: dict) -> str:
    cpus = os.cpu_count() or 1
    return (
        f"This machine has {cpus} CPUs, shared by the client, the two fakes and "
        "the router: when the client and the fakes already take most of them, "
        "more workers cannot raise the rate here, and the table shows where the "
        "cores went. On a host where each worker gets a core of its own, the "
        "request path (HTTP, selection, relaying) runs in N event loops instead "
        "of one; the supervisor only handles discovery. The router's CPU per "
        "request (the column above) gives the ceiling per core: about "
        f"{1 / result['cpu_per_request_s']:.0f} requests/s for each worker with a "
        "core of its own."
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 round of 2 s")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/router-workers-logs"))
    report.add_out_argument(parser)
    args = parser.parse_args()
    require("aiohttp", "psutil")
    if args.quick:
        args.rounds, args.seconds = 1, 2.0
    args.logs.mkdir(parents=True, exist_ok=True)
    result = {
        "rounds_n": args.rounds,
        "seconds": args.seconds,
        "clients": args.clients,
        "uptime_start": uptime(),
        "load_start": load_snapshot(),
    }
    fakes = {role: start_fake(role, args.logs) for role in ("prefill", "decode")}
    routers: dict[int, RouterProcess] = {}
    try:
        for n in WORKERS:
            routers[n] = RouterProcess(
                [
                    "--static-prefill",
                    f"{fakes['prefill'].http_addr},127.0.0.1:1",
                    "--static-decode",
                    f"{fakes['decode'].http_addr},127.0.0.1:2",
                    "--workers",
                    str(n),
                    "--log-level",
                    "warning",
                ],
                log_path=args.logs / f"{STEM}-router-{n}.log",
            ).start()
        result["rounds"] = measure(args, routers, fakes)
    finally:
        for router in routers.values():
            router.stop()
        for fake in fakes.values():
            fake.stop()
    result["uptime_end"] = uptime()
    result["cpu_per_request_s"] = statistics.median(
        rd["1"]["cores"]["router"] / rd["1"]["rps"] for rd in result["rounds"]
    )
    result["reading"] = reading(result)
    out = args.out or report.RESULTS
    report.write(out / STEM, result, markdown(result), compact=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
