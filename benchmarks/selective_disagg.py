"""Selective disaggregation: TTFT of short and long prompts with the router's
``--decode-alone-below-tokens`` on and off, side by side in one run.

Real servers on the tiny Llama (float32, ``--enforce-eager``, block size
32): one prefill and one decode instance (``P2pNcclConnector``, PUT_ASYNC),
each registered with three routers that differ only in the threshold:

* ``off``: 0, every prompt disaggregated (the router's behaviour before);
* ``on``: ``--threshold`` tokens (default 256): shorter prompts go to the
  decode alone, longer ones through the prefill;
* ``alone``: 2**24, every prompt to the decode alone (the other end of the
  trade-off, for choosing the threshold).

Prompts are random token ids (exact lengths, and a fresh prompt every
request: no prefix-cache hit on either instance), streamed, ``max_tokens``
8, one request at a time (TTFT without queueing) and 4 at once. Every
(router, length, concurrency) cell runs once per round, rounds in a fresh
random order. The routers' ``routes_total`` counters, scraped at the end,
show which way the requests went. The load average is sampled around every
round.

Writes benchmarks/results/selective_disagg.{json,md} (``--out DIR``: elsewhere).
About 5 minutes (two ``vllm serve`` start-ups, then the rounds).

    .venv/bin/python benchmarks/selective_disagg.py [--rounds 3] [--per-cell 6]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import time
from pathlib import Path

import aiohttp
from _deps import (  # benchmarks/_deps.py: sys.path[0] when run as a script
    machine,
    require,
)
from common import report
from common.procs import load_snapshot, scrape
from common.report import load_line, ms, table
from common.stats import pct, ratio

from vllm_disagg.testing.p2p import free_kv_port, kv_transfer_config
from vllm_disagg.testing.router import RouterProcess
from vllm_disagg.testing.server import VllmServer, cpu_test_env, get_free_port
from vllm_disagg.testing.tiny_models import VOCAB_SIZE

STEM = "selective_disagg"
LENGTHS = (16, 64, 256, 900)
CONCURRENCIES = (1, 4)
MAX_TOKENS = 8
DTYPE = "float32"
SERVER_ARGS = [
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "16",
    "--seed",
    "0",
    "--dtype",
    DTYPE,
    "--block-size",
    "32",
    "--enforce-eager",
]
SERVER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
REQUEST_TIMEOUT_S = 60.0


def router_flags(threshold: int) -> dict[str, list[str]]:
    return {
        "off": ["--decode-alone-below-tokens", "0"],
        "on": ["--decode-alone-below-tokens", str(threshold)],
        "alone": ["--decode-alone-below-tokens", str(1 << 24)],
    }


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, length: int, rng
) -> tuple[float, float]:
    """(TTFT, E2E) of one streamed completion of a fresh prompt."""
    body = {
        "model": model,
        "prompt": [rng.randrange(3, VOCAB_SIZE) for _ in range(length)],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    first = None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {await resp.text()}")
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("no token streamed")
    return first - started, time.perf_counter() - started


async def cell(url: str, model: str, length: int, concurrency: int, n: int, rng):
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        sem = asyncio.Semaphore(concurrency)

        async def limited():
            async with sem:
                return await one_request(session, url, model, length, rng)

        return await asyncio.gather(*(limited() for _ in range(n)))


def run(args) -> dict:
    model = args.model
    rng = random.Random(args.seed)
    began = time.monotonic()
    result: dict = {
        "meta": {
            "machine": machine(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "model": str(model),
            "dtype": DTYPE,
            "threshold": args.threshold,
            "lengths": LENGTHS,
            "concurrencies": CONCURRENCIES,
            "max_tokens": MAX_TOKENS,
            "rounds": args.rounds,
            "per_cell": args.per_cell,
            "cpus": os.cpu_count(),
        },
        "load": [],
        "samples": {},
    }
    with contextlib.ExitStack() as stack:
        routers = {}
        for name, flags in router_flags(args.threshold).items():
            router = RouterProcess(
                [*flags, "--log-level", "warning"],
                log_path=args.logs / f"{STEM}-router-{name}.log",
                model=str(model),
            )
            stack.callback(router.stop)
            routers[name] = router.start()
        proxy_ip = ",".join(f"127.0.0.1:{r.discovery_port}" for r in routers.values())
        env = cpu_test_env(**SERVER_ENV)
        servers = {}
        for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            port = get_free_port()
            config = kv_transfer_config(
                role, free_kv_port(), proxy_ip=proxy_ip, http_port=str(port)
            )
            servers[name] = VllmServer(
                model,
                [*SERVER_ARGS, "--kv-transfer-config", config],
                log_path=args.logs / f"{STEM}-{name}.log",
                env=env,
                port=port,
                startup_timeout_s=300,
            )
            stack.callback(servers[name].stop)
            servers[name].launch()
        for name, server in servers.items():
            server.wait_ready()
            print(f"  {name} ready ({time.monotonic() - began:.0f}s)", flush=True)
        for router in routers.values():
            router.wait_for_instances(
                lambda found: len(found) == 2, timeout_s=60, what="1P1D"
            )
        # Warm-up: the first transfer of a pair opens its channel.
        for router in routers.values():
            asyncio.run(cell(router.url, str(model), 300, 2, 4, rng))
        cells = [
            (r, length, c) for r in routers for length in LENGTHS for c in CONCURRENCIES
        ]
        for round_ in range(args.rounds):
            rng.shuffle(cells)
            result["load"].append(load_snapshot())
            for name, length, conc in cells:
                n = args.per_cell * conc
                out = asyncio.run(
                    cell(routers[name].url, str(model), length, conc, n, rng)
                )
                key = f"{name}/{length}/{conc}"
                result["samples"].setdefault(key, []).extend(out)
            print(f"  round {round_ + 1} done ({time.monotonic() - began:.0f}s)")
        result["load"].append(load_snapshot())
        result["routes"] = {
            name: scrape(r.url + "/metrics", "vllm_disagg_router_routes_total")
            for name, r in routers.items()
        }
    return result


def summarize(result: dict) -> dict:
    summary = {}
    for key, samples in result["samples"].items():
        ttft = [s[0] for s in samples]
        e2e = [s[1] for s in samples]
        summary[key] = {
            "n": len(samples),
            "ttft_p50": pct(ttft, 50),
            "ttft_p90": pct(ttft, 90),
            "e2e_p50": pct(e2e, 50),
        }
    result["summary"] = summary
    return summary


def markdown(result: dict) -> list[str]:
    meta, s = result["meta"], result["summary"]
    lines = [
        "# Selective disaggregation: TTFT with the threshold on and off",
        "",
        report.generated(
            "selective_disagg.py",
            f"Tiny Llama ({meta['dtype']}), 1P1D P2pNcclConnector PUT_ASYNC, "
            f"{meta['rounds']} rounds x {meta['per_cell']} requests per cell "
            "(x concurrency), fresh random token-id prompts, streamed, "
            f"max_tokens {meta['max_tokens']}. `on` = "
            f"--decode-alone-below-tokens {meta['threshold']}.",
            date=meta["date"],
            on=meta["machine"],
        ),
        "",
        "Load during the run: " + "; ".join(load_line(x) for x in result["load"]),
        "",
    ]
    for conc in meta["concurrencies"]:
        lines += [f"## Concurrency {conc}", ""]
        rows = []
        for length in meta["lengths"]:
            cells = {r: s.get(f"{r}/{length}/{conc}") for r in ("off", "on", "alone")}
            if None in cells.values():
                continue
            off_p50 = cells["off"]["ttft_p50"]
            rows.append(
                [
                    length,
                    ms(cells["off"]["ttft_p50"], 1),
                    ms(cells["on"]["ttft_p50"], 1),
                    ms(cells["alone"]["ttft_p50"], 1),
                    f"{ratio(cells['on']['ttft_p50'], off_p50):.2f}",
                    f"{ratio(cells['alone']['ttft_p50'], off_p50):.2f}",
                    ms(cells["off"]["ttft_p90"], 1),
                    ms(cells["on"]["ttft_p90"], 1),
                    ms(cells["off"]["e2e_p50"], 1),
                    ms(cells["on"]["e2e_p50"], 1),
                ]
            )
        lines += table(
            [
                "prompt tokens",
                "TTFT p50 off (ms)",
                "on",
                "alone",
                "on/off",
                "alone/off",
                "TTFT p90 off",
                "on",
                "E2E p50 off",
                "on",
            ],
            rows,
        )
        lines.append("")
    lines += ["## Which way the requests went (routes_total)", ""]
    rows = []
    for name, samples in sorted(result.get("routes", {}).items()):
        for sample, value in sorted(samples.items()):
            if value:
                rows.append([name, sample, int(value)])
    lines += table(["router", "series", "requests"], rows)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("/tmp/models/tiny-llama"))
    parser.add_argument("--threshold", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-cell", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/selective-logs"))
    report.add_out_argument(parser)
    args = parser.parse_args()
    require("aiohttp")
    if not (args.model / "config.json").exists():
        from vllm_disagg.testing.tiny_models import build_all

        build_all(args.model.parent)
    args.logs.mkdir(parents=True, exist_ok=True)
    result = run(args)
    summarize(result)
    out = args.out or report.RESULTS
    report.write(out / STEM, result, markdown(result), compact=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
