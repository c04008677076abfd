"""The xPyD router: its own overhead, its ceiling, and what it costs end to end.

Two parts, each with its configurations side by side in one run.

1. **Router overhead against fake backends**, so that the router alone is
   timed. Fake prefill and decode instances (each a process of its own:
   ``python -m vllm_disagg.testing.fake_instance --tokens``, the router tests'
   fake) answer ``/v1/completions`` at once: a JSON completion, or SSE chunks like
   vLLM's (one per token, ``max_tokens`` of them, then ``[DONE]``), optionally
   paced by a delay between chunks that the request names. Two routers run
   as subprocesses (``python -m vllm_disagg.router --static-prefill ...
   --static-decode ...``), one per hand-off style. This process is the load
   generator (asyncio + aiohttp, pooled keep-alive connections), the same
   client and the same request bodies for every target:

   * ``direct``: the fake decode instance alone (a client without a router);
   * ``direct_pd``: the client does the hand-off itself: the fake prefill
     (``max_tokens`` 1, not streamed), then the fake decode;
   * ``router_seq`` / ``router_conc``: through the router, ``--handoff
     sequential`` / ``concurrent``.

   In interleaved rounds (every target once per scenario and concurrency per
   round, in a fresh random order), closed-loop batches at concurrency 1, 8
   and 32: per-request latency (time to the first byte and to the last),
   the router's ``added_latency_seconds`` histogram (scraped around each
   batch), and the CPU time every process spent per request. Router-added
   latency at a percentile = that percentile through the router minus the
   same percentile of the baseline. Then the request-rate ceiling: a fixed
   window at growing concurrency until throughput stops growing.

2. **Real servers with** ``vllm bench serve`` (random dataset) on the tiny
   Llama (float32, ``--enforce-eager``, block size 32): a colocated
   ``vllm serve`` directly, and one prefill plus one decode instance
   (``P2pNcclConnector``, PUT_ASYNC) behind the router, both hand-off styles
   (two routers; each instance registers with both through
   ``proxy_ip``/``proxy_port``/``http_port``). TTFT, TPOT, ITL and E2E
   percentiles, in shuffled rounds. Every run has prompts of its own (a seed
   per run: no prefix-cache hit on any server, the same token counts).

Writes benchmarks/results/router.{json,md,png} (``--part overhead``: router-overhead.*;
``--quick``: *-quick.*; ``--out DIR``: elsewhere).
Part 1 takes about 3 minutes, part 2 about 10 (3 ``vllm serve`` at once, each
``vllm bench serve`` spends ~25 s importing vLLM). ``--render JSON`` rewrites
the md and png of a result file from its raw numbers.

    .venv/bin/python benchmarks/router.py [--part overhead|serving|both] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from _deps import (
    machine,
    require,
)  # benchmarks/_deps.py: sys.path[0] when run as a script
from common import report
from common.procs import (
    Child,
    cpu_seconds,
    http,
    label,
    load_snapshot,
    run_logged,
    scrape,
    uptime,
)
from common.report import fmt, load_line, ms, percent, table
from common.stats import diff, hist_quantile, pct, pcts, ratio

from vllm_disagg.testing.fake_instance import DELAY_KEY
from vllm_disagg.testing.p2p import free_kv_port, kv_transfer_config
from vllm_disagg.testing.router import RouterProcess
from vllm_disagg.testing.server import (
    VllmServer,
    cpu_test_env,
    get_free_port,
    vllm_executable,
)

STEM = "router"

# --- part 1 settings -----------------------------------------------------------

TARGETS = ("direct", "direct_pd", "router_seq", "router_conc", "router_hyper")
ROUTERS = {"router_seq": "sequential", "router_conc": "concurrent"}
# The router flags of each target: one router per hand-off style ...
ROUTER_FLAGS = {target: ["--handoff", handoff] for target, handoff in ROUTERS.items()}
# ... and part 1 also runs the sequential router on hypercorn, the HTTP server
# it used before uvicorn, so the default's choice stays measured.
OVERHEAD_ROUTERS = {
    **ROUTER_FLAGS,
    "router_hyper": ["--handoff", "sequential", "--http-server", "hypercorn"],
}
# scenario -> (stream, chunks (= max_tokens), ms between chunks, concurrencies)
SCENARIOS = {
    "stream": (True, 4, 0.0, (1, 8, 32)),
    "nonstream": (False, 4, 0.0, (1, 8, 32)),
    # 32 streams that stay open like a decode's (16 tokens, 10 ms apart):
    # the router holds them without being driven to saturation.
    "paced": (True, 16, 10.0, (8, 32)),
    # 32 streams as a decode instance serves them: 48 tokens 25 ms apart, the
    # clients' starts spread over one stream's length (STAGGERED), so requests
    # arrive one by one, not in bursts of 32 as in the closed loops above.
    "decode": (True, 48, 25.0, (32,)),
}
STAGGERED = frozenset({"decode"})
# Router-added latency: (through a router, baseline) pairs of targets.
ADDED = (
    ("router_seq", "direct_pd"),
    ("router_seq", "direct"),
    ("router_conc", "direct"),
    ("router_hyper", "direct_pd"),
)
GOAL_SCENARIO, GOAL_CONCURRENCY, GOAL_P50_S = "stream", 32, 0.002
CEILING_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128)
CEILING_TARGETS = ("direct", "router_seq", "router_conc", "router_hyper")
FAKE_MODEL = "fake-model"
PROMPT_WORDS = 200  # ~1.2 KB of prompt in every request body
REQUEST_TIMEOUT_S = 30.0
BATCH_TIMEOUT_S = 300.0
FAKE_START_TIMEOUT_S = 60.0
HIST = "vllm_disagg_router_added_latency_seconds"

# --- part 2 settings -----------------------------------------------------------

CONFIGS = ("colocated", "router_seq", "router_conc")
DTYPE = "float32"
BLOCK_SIZE = 32
SERVER_ARGS = [
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "32",
    "--seed",
    "0",
    "--dtype",
    DTYPE,
    "--block-size",
    str(BLOCK_SIZE),
    "--enforce-eager",
]
# As benchmarks/p2p_send_modes.py: vLLM's automatic binding reserves a core
# for the scheduler and one more with a KV connector, which 2 cores cannot
# give; one OpenMP thread each, placed by the OS, keeps the servers comparable.
SERVER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
KV_LOAD_TIMEOUT_S = 30.0
BENCH_PERCENTILES = (50, 90, 99)
BENCH_METRICS = ("ttft", "tpot", "itl", "e2el")
GREEDY_PROMPT = (
    "Prefill instances compute the key value cache and send it to decode instances"
)


def start_fake(role: str, log_path: Path) -> Child:
    """A fake instance in a process of its own, answering ``max_tokens`` tokens."""
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
        FAKE_MODEL,
        "--tokens",
    ]
    return Child(f"fake {role}", command, log_path, port).start(FAKE_START_TIMEOUT_S)


def scrape_hist(url: str) -> dict[float, float]:
    """Bucket le -> cumulative count of the router's added-latency histogram."""
    samples = scrape(f"{url}/metrics", f"{HIST}_bucket")
    return {float(label(name, "le")): n for name, n in samples.items()}


def start_routers_over_fakes(
    stack: contextlib.ExitStack,
    fakes: dict[str, Child],
    tag: str,
    targets: dict[str, list[str]],
    logs: Path,
) -> dict[str, RouterProcess]:
    """One router per target (its flags in ``targets``), its instances the fake
    prefill and decode (static: the fakes do not register); stopped by ``stack``."""
    routers = {}
    for target, flags in targets.items():
        router = RouterProcess(
            [
                "--static-prefill",
                f"{fakes['prefill'].http_addr},127.0.0.1:1",
                "--static-decode",
                f"{fakes['decode'].http_addr},127.0.0.1:2",
                *flags,
                "--log-level",
                "warning",
            ],
            log_path=logs / f"{STEM}-{tag}-{target}.log",
        )
        stack.callback(router.stop)
        routers[target] = router.start()
    return routers


# =============================================================================
# Part 1: the router against fake backends
# =============================================================================


class LoadGenerator:
    """The client: one aiohttp session, the same bodies for every target."""

    def __init__(self, urls: dict[str, str], prefill_url: str):
        self.urls = urls  # target -> base URL of what the client posts to
        self.prefill_url = prefill_url
        words = (
            "the router relays every chunk of the decode instance to the client " * 40
        ).split()
        self.prompt = " ".join(words[:PROMPT_WORDS])
        self.bodies: dict[str, tuple[bytes, bytes]] = {}
        for name, (stream, chunks, delay_ms, _) in SCENARIOS.items():
            body = {
                "model": FAKE_MODEL,
                "prompt": self.prompt,
                "max_tokens": chunks,
                "temperature": 0.0,
                "stream": stream,
            }
            if delay_ms:
                body[DELAY_KEY] = delay_ms
            prefill = {**body, "max_tokens": 1, "stream": False}
            self.bodies[name] = (
                json.dumps(body).encode(),
                json.dumps(prefill).encode(),
            )
        self.session: aiohttp.ClientSession | None = None
        self.rng = random.Random(0)

    async def __aenter__(self) -> LoadGenerator:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def _post(self, url: str, body: bytes, stream: bool) -> tuple[float, bool]:
        """(perf_counter at the first byte, answer complete and well-formed)."""
        headers = {"Content-Type": "application/json"}
        async with self.session.post(
            f"{url}/v1/completions", data=body, headers=headers
        ) as resp:
            if not stream:
                data = await resp.read()
                return time.perf_counter(), resp.status == 200 and data[:1] == b"{"
            tail = await resp.content.readany()
            first = time.perf_counter()
            while chunk := await resp.content.readany():
                tail = (tail + chunk)[-64:]
            return first, resp.status == 200 and tail.endswith(b"data: [DONE]\n\n")

    async def request(self, target: str, scenario: str) -> tuple[float, float, bool]:
        """One request: (ttfb, total, ok), seconds from sending it (``direct_pd``:
        the prefill leg's), as the client sees them."""
        body, prefill_body = self.bodies[scenario]
        stream = SCENARIOS[scenario][0]
        t0 = time.perf_counter()
        ok_p = True
        if target == "direct_pd":
            _, ok_p = await self._post(self.prefill_url, prefill_body, False)
        first, ok = await self._post(self.urls[target], body, stream)
        return first - t0, time.perf_counter() - t0, ok and ok_p

    async def batch(self, target: str, scenario: str, concurrency: int, n: int) -> dict:
        """``n`` requests by ``concurrency`` closed-loop workers (in a STAGGERED
        scenario each worker starts at a random point of one stream's length)."""
        samples: list[tuple[float, float]] = []
        errors: list[str] = []
        todo = iter(range(n))
        _, chunks, delay_ms, _ = SCENARIOS[scenario]
        stagger_s = chunks * delay_ms / 1000 if scenario in STAGGERED else 0.0

        async def worker(start_s: float) -> None:
            await asyncio.sleep(start_s)
            for _ in todo:
                try:
                    ttfb, total, ok = await self.request(target, scenario)
                except (TimeoutError, aiohttp.ClientError, OSError) as e:
                    errors.append(f"{type(e).__name__}: {e}")
                    continue
                if ok:
                    samples.append((ttfb, total))
                else:
                    errors.append("bad answer")

        starts = [self.rng.uniform(0, stagger_s) for _ in range(concurrency)]
        t0 = time.perf_counter()
        async with asyncio.timeout(BATCH_TIMEOUT_S):
            await asyncio.gather(*(worker(start) for start in starts))
        return {
            "samples": samples,
            "errors": errors,
            "wall_s": time.perf_counter() - t0,
        }

    async def sustained(
        self,
        target: str,
        scenario: str,
        concurrency: int,
        duration_s: float,
        warm_s: float,
    ) -> dict:
        """Closed loop for ``warm_s + duration_s``: requests completed in the
        last ``duration_s`` per second, and their latency."""
        start = time.perf_counter()
        begin, end = start + warm_s, start + warm_s + duration_s
        done: list[float] = []
        errors = 0

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < end:
                try:
                    _, total, ok = await self.request(target, scenario)
                except (TimeoutError, aiohttp.ClientError, OSError):
                    errors += 1
                    continue
                now = time.perf_counter()
                if ok and begin <= now <= end:
                    done.append(total)
                elif not ok:
                    errors += 1

        async with asyncio.timeout(duration_s + warm_s + REQUEST_TIMEOUT_S + 10):
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return {
            "rps": len(done) / duration_s,
            "completed": len(done),
            "errors": errors,
            "latency": pcts(done),
        }


def batch_size(scenario: str, concurrency: int, quick: bool) -> int:
    if scenario == "decode":
        n = (
            3 * concurrency
        )  # ~5 s a batch: 3 streams of 1.2 s a worker, plus the stagger
    elif scenario == "paced":
        n = max(4 * concurrency, 64)
    else:
        n = {1: 60, 8: 120}.get(concurrency, 6 * concurrency)
    return max(concurrency, n // 4) if quick else n


async def measure_overhead(
    gen: LoadGenerator, routers: dict[str, RouterProcess], pids: dict[str, int], args
) -> dict:
    """Interleaved rounds of closed-loop batches; raw per-request numbers."""
    raw: dict = {
        s: {
            str(c): {
                t: {
                    "ttfb": [],
                    "total": [],
                    "errors": [],
                    "router_hist": {},
                    "cpu_s": {},
                    "requests": 0,
                }
                for t in TARGETS
            }
            for c in conc
        }
        for s, (_, _, _, conc) in SCENARIOS.items()
    }
    rng = random.Random(args.seed)
    # Warm-up: connections, code paths, the routers' upstream pools.
    for target in TARGETS:
        for scenario in SCENARIOS.keys() - STAGGERED:  # "paced" warms the same paths
            await gen.batch(target, scenario, 8, 40)
    for r in range(args.rounds):
        t_round = time.monotonic()
        items = [
            (s, c, t)
            for s, (_, _, _, conc) in SCENARIOS.items()
            for c in conc
            for t in TARGETS
        ]
        rng.shuffle(items)
        for scenario, conc, target in items:
            router = routers.get(target)
            before_hist = scrape_hist(router.url) if router else None
            before_cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
            out = await gen.batch(
                target, scenario, conc, batch_size(scenario, conc, args.quick)
            )
            after_cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
            cell = raw[scenario][str(conc)][target]
            cell["ttfb"].extend(s[0] for s in out["samples"])
            cell["total"].extend(s[1] for s in out["samples"])
            cell["errors"].extend(out["errors"][:5])
            cell["requests"] += len(out["samples"]) + len(out["errors"])
            for name in pids:
                used = after_cpu[name] - before_cpu[name]
                cell["cpu_s"][name] = cell["cpu_s"].get(name, 0.0) + used
            if router:
                after_hist = scrape_hist(router.url)
                for le, count in after_hist.items():
                    key = repr(le)
                    cell["router_hist"][key] = (
                        cell["router_hist"].get(key, 0.0)
                        + count
                        - before_hist.get(le, 0.0)
                    )
        took = time.monotonic() - t_round
        print(f"  overhead round {r + 1}/{args.rounds}: {took:.0f}s", flush=True)
    return raw


async def measure_ceiling(gen: LoadGenerator, pids: dict[str, int], args) -> dict:
    """Growing concurrency, every target per level in a random order."""
    rng = random.Random(args.seed + 7)
    out: dict = {t: {} for t in CEILING_TARGETS}
    for level in args.ceiling_levels:
        targets = list(CEILING_TARGETS)
        rng.shuffle(targets)
        for target in targets:
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            t0 = time.perf_counter()
            res = await gen.sustained(
                target, "stream", level, args.ceiling_s, args.ceiling_warm_s
            )
            wall = time.perf_counter() - t0
            after = {name: cpu_seconds(pid) for name, pid in pids.items()}
            res["cpu_share"] = {
                name: (after[name] - before[name]) / wall for name in pids
            }
            out[target][str(level)] = res
        rates = ", ".join(
            f"{t} {out[t][str(level)]['rps']:.0f}/s" for t in CEILING_TARGETS
        )
        print(f"  ceiling at concurrency {level:d}: {rates}", flush=True)
    return out


def run_overhead(args) -> dict:
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        fakes = {}
        for role in ("prefill", "decode"):
            fakes[role] = start_fake(role, args.logs / f"{STEM}-fake-{role}.log")
            stack.callback(fakes[role].stop)
        routers = start_routers_over_fakes(
            stack, fakes, "fakes", OVERHEAD_ROUTERS, args.logs
        )
        pids = {
            **{target: router.proc.pid for target, router in routers.items()},
            "fake_prefill": fakes["prefill"].proc.pid,
            "fake_decode": fakes["decode"].proc.pid,
            "client": os.getpid(),
        }
        mine = {fakes[r].proc.pid for r in fakes} | {
            r.proc.pid for r in routers.values()
        }
        load_before = load_snapshot(mine)
        urls = {
            "direct": fakes["decode"].url,
            "direct_pd": fakes["decode"].url,
            **{t: r.url for t, r in routers.items()},
        }
        uvloop_in_router = "uvloop" if _has("uvloop") else "asyncio"

        async def go() -> tuple[dict, dict]:
            async with LoadGenerator(urls, fakes["prefill"].url) as gen:
                t = time.monotonic()
                raw = await measure_overhead(gen, routers, pids, args)
                print(
                    f"overhead batches done in {time.monotonic() - t:.0f}s", flush=True
                )
                ceiling = await measure_ceiling(gen, pids, args)
                return raw, ceiling

        raw, ceiling = asyncio.run(go())
        outcomes = {
            t: scrape(f"{r.url}/metrics", "vllm_disagg_router_requests_total")
            for t, r in routers.items()
        }
        load_after = load_snapshot(mine)
    return {
        "meta": {
            "rounds": args.rounds,
            "scenarios": {
                k: {
                    "stream": v[0],
                    "chunks": v[1],
                    "chunk_delay_ms": v[2],
                    "concurrency": list(v[3]),
                }
                for k, v in SCENARIOS.items()
            },
            "batch_sizes": {
                s: {str(c): batch_size(s, c, args.quick) for c in v[3]}
                for s, v in SCENARIOS.items()
            },
            "prompt_chars": len(LoadGenerator({}, "").prompt),
            "ceiling_levels": list(args.ceiling_levels),
            "ceiling_window_s": args.ceiling_s,
            "ceiling_warm_s": args.ceiling_warm_s,
            "router_event_loop": uvloop_in_router,
            "load_before": load_before,
            "load_after": load_after,
            "took_s": time.monotonic() - began,
        },
        "raw": raw,
        "ceiling": ceiling,
        "router_outcomes": outcomes,
    }


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def summarize_overhead(part: dict) -> dict:
    raw = part["raw"]
    latency: dict = {}
    added: dict = {}
    router_hist: dict = {}
    cpu: dict = {}
    for scenario, by_conc in raw.items():
        for conc, by_target in by_conc.items():
            key = f"{scenario}/{conc}"
            latency[key] = {
                t: {
                    "n": len(c["total"]),
                    "errors": c["requests"] - len(c["total"]),
                    "ttfb": pcts(c["ttfb"]),
                    "total": pcts(c["total"]),
                }
                for t, c in by_target.items()
            }
            lat = latency[key]

            added[key] = {
                f"{a} - {b}": {
                    what: {q: diff(x, lat[b][what][q]) for q, x in lat[a][what].items()}
                    for what in ("total", "ttfb")
                }
                for a, b in ADDED
            }
            router_hist[key] = {}
            for target in OVERHEAD_ROUTERS:
                h = by_target[target]["router_hist"]
                buckets = sorted((float(le), n) for le, n in h.items())
                total = buckets[-1][1] if buckets else 0
                le2 = next((n for le, n in buckets if abs(le - 0.002) < 1e-12), None)
                router_hist[key][target] = {
                    "count": total,
                    **{f"p{q}": hist_quantile(buckets, q) for q in (50, 90, 99)},
                    "share_le_2ms": (le2 / total)
                    if total and le2 is not None
                    else None,
                }
            cpu[key] = {}
            for target, c in by_target.items():
                n = c["requests"]
                cpu[key][target] = {
                    name: (s / n if n else None) for name, s in c["cpu_s"].items()
                }
    ceiling = {}
    for target, levels in part["ceiling"].items():
        rates = {int(k): v["rps"] for k, v in levels.items()}
        best = max(rates.values()) if rates else 0.0
        knee = min((k for k, v in rates.items() if v >= 0.95 * best), default=None)
        ceiling[target] = {
            "max_rps": best,
            "at_concurrency": max(rates, key=rates.get),
            "knee_concurrency": knee,
        }
    for row in ceiling.values():
        row["vs_direct"] = ratio(
            row["max_rps"], ceiling.get("direct", {}).get("max_rps")
        )
    goal_key = f"{GOAL_SCENARIO}/{GOAL_CONCURRENCY}"

    def alone(key: str, what: str, q: str) -> float | None:
        """router_seq - direct_pd of a scenario/concurrency that may not have run."""
        return added.get(key, {}).get("router_seq - direct_pd", {}).get(what, {}).get(q)

    goal = {
        "key": goal_key,
        "client_p50_s": added[goal_key]["router_seq - direct_pd"]["total"]["p50"],
        "client_p50_vs_direct_s": added[goal_key]["router_seq - direct"]["total"][
            "p50"
        ],
        "client_p50_conc_s": added[goal_key]["router_conc - direct"]["total"]["p50"],
        "router_hist_p50_s": router_hist[goal_key]["router_seq"]["p50"],
        "client_p50_hypercorn_s": added[goal_key]["router_hyper - direct_pd"]["total"][
            "p50"
        ],
        "paced_p50_s": alone("paced/32", "total", "p50"),
        # Streams as a decode serves them: what the router adds to the first token.
        "decode_ttfb_p50_s": alone("decode/32", "ttfb", "p50"),
        "decode_ttfb_p90_s": alone("decode/32", "ttfb", "p90"),
        "decode_p50_s": alone("decode/32", "total", "p50"),
    }
    goal["met_client"] = (
        goal["client_p50_s"] is not None and goal["client_p50_s"] < GOAL_P50_S
    )
    goal["met_router_hist"] = (
        goal["router_hist_p50_s"] is not None and goal["router_hist_p50_s"] < GOAL_P50_S
    )
    return {
        "latency": latency,
        "added": added,
        "router_hist": router_hist,
        "cpu": cpu,
        "ceiling": ceiling,
        "goal": goal,
    }


# =============================================================================
# Part 2: real servers, vllm bench serve
# =============================================================================


def ensure_model(path: Path) -> Path:
    if not (path / "config.json").exists():
        from vllm_disagg.testing.tiny_models import build_all

        print(f"building the tiny models into {path.parent}", flush=True)
        build_all(path.parent)
    return path


def bench_command(
    url: str, model: Path, args, concurrency: int, seed: int, out: Path
) -> list[str]:
    return [
        vllm_executable(),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--model",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--percentile-metrics",
        ",".join(BENCH_METRICS),
        "--metric-percentiles",
        ",".join(str(p) for p in BENCH_PERCENTILES),
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]


BENCH_KEEP = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_input_tokens",
    "total_output_tokens",
)


def keep_bench(result: dict) -> dict:
    keep = {k: result.get(k) for k in BENCH_KEEP}
    for m in BENCH_METRICS:
        for stat in ("mean", "median"):
            keep[f"{stat}_{m}_ms"] = result.get(f"{stat}_{m}_ms")
        for p in BENCH_PERCENTILES:
            keep[f"p{p}_{m}_ms"] = result.get(f"p{p}_{m}_ms")
    return keep


def greedy_text(url: str, model: str) -> str | None:
    body = {
        "model": model,
        "prompt": GREEDY_PROMPT,
        "max_tokens": 16,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    try:
        status, data = http(f"{url}/v1/completions", body, timeout_s=120)
        return (
            json.loads(data)["choices"][0]["text"]
            if status == 200
            else f"<{status}: {data!r}>"
        )
    except (OSError, KeyError, IndexError, ValueError) as e:
        return f"<error: {e}>"


async def warm_up(url: str, model: str, n: int, concurrency: int) -> int:
    """``n`` streamed completions of a few hundred tokens; how many succeeded."""
    prompt = " ".join(["prefill instances compute the key value cache"] * 40)
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": 8,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    ok = 0
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=180)
    ) as session:

        async def one() -> None:
            nonlocal ok
            async with (
                sem,
                session.post(
                    f"{url}/v1/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as resp,
            ):
                data = await resp.read()
                ok += resp.status == 200 and data.rstrip().endswith(b"[DONE]")

        await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    return ok


def start_dry_fleet(stack: contextlib.ExitStack, args) -> tuple[dict, dict[str, Child]]:
    """Part 2 on fake instances (no vLLM servers): a dry run of the pipeline."""
    fakes = {}
    for role in ("prefill", "decode", "colocated"):
        fakes[role] = start_fake(role, args.logs / f"{STEM}-dry-fake-{role}.log")
        stack.callback(fakes[role].stop)
    routers = start_routers_over_fakes(stack, fakes, "dry", ROUTER_FLAGS, args.logs)
    return routers, fakes


def start_vllm_fleet(
    stack: contextlib.ExitStack, args, model: Path, began: float
) -> tuple[dict, dict[str, VllmServer]]:
    """One router per hand-off style; a colocated server, and a prefill and a decode
    instance registered with both routers. All stopped by ``stack``."""
    routers = {}
    for target, flags in ROUTER_FLAGS.items():
        router = RouterProcess(
            [*flags, "--log-level", "warning"],
            log_path=args.logs / f"{STEM}-{target}.log",
        )
        stack.callback(router.stop)
        routers[target] = router.start()
    proxy_ip = ",".join(f"127.0.0.1:{r.discovery_port}" for r in routers.values())
    env = cpu_test_env(**SERVER_ENV)

    def server(name: str, extra: list[str], port: int | None = None) -> VllmServer:
        return VllmServer(
            model,
            [*SERVER_ARGS, *extra],
            log_path=args.logs / f"{STEM}-{name}.log",
            env=env,
            port=port,
            startup_timeout_s=args.startup_timeout_s,
        )

    servers = {"colocated": server("colocated", [])}
    for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        port = get_free_port()
        config = kv_transfer_config(
            role,
            free_kv_port(),
            send_type="PUT_ASYNC",
            kv_load_timeout_s=KV_LOAD_TIMEOUT_S,
            proxy_ip=proxy_ip,
            http_port=str(port),
        )
        servers[name] = server(name, ["--kv-transfer-config", config], port)
    for s in servers.values():  # all at once: start-up is mostly waiting
        stack.callback(s.stop)
        s.launch()
    for name, s in servers.items():
        s.wait_ready()
        print(f"  {name} ready ({time.monotonic() - began:.0f}s)", flush=True)
    for target, router in routers.items():
        router.wait_for_instances(
            lambda found: {i["role"] for i in found} >= {"prefill", "decode"},
            timeout_s=120,
            what="a prefill and a decode instance",
        )
        if not router.healthy():
            raise RuntimeError(f"{target} not healthy: {router.instances()}")
    return routers, servers


def bench_rounds(
    args, urls: dict[str, str], model: Path, tmp: Path, log: Path
) -> list[dict]:
    """``vllm bench serve`` against every configuration, rounds x concurrencies, in
    a random order within each."""
    runs: list[dict] = []
    rng = random.Random(args.seed + 11)
    for r in range(args.serving_rounds):
        for conc in args.concurrency:
            order = list(CONFIGS)
            rng.shuffle(order)
            for position, config in enumerate(order):
                out = tmp / f"r{r}-c{conc}-{config}.json"
                # A seed per run: fresh random prompts of the same lengths, so
                # no server (P serves both routers) ever hits its prefix cache.
                seed = args.seed + 1000 * r + 10 * conc + CONFIGS.index(config)
                cmd = bench_command(urls[config], model, args, conc, seed, out)
                t0 = time.monotonic()
                rc = run_logged(cmd, log, args.bench_timeout_s, cpu_test_env())
                took = time.monotonic() - t0
                result = json.loads(out.read_text()) if out.exists() else {}
                runs.append(
                    {
                        "round": r,
                        "concurrency": conc,
                        "config": config,
                        "position": position,
                        "seed": seed,
                        "rc": rc,
                        "took_s": took,
                        **keep_bench(result),
                    }
                )
                print(
                    f"  round {r + 1} c={conc} {config}: rc {rc}, "
                    f"{result.get('completed')}/{args.num_prompts} in {took:.0f}s, "
                    f"TTFT p50 {result.get('p50_ttft_ms') or float('nan'):.0f} ms",
                    flush=True,
                )
    return runs


def run_serving(args) -> dict:
    began = time.monotonic()
    bench_log = args.logs / f"{STEM}-bench.log"
    bench_log.parent.mkdir(parents=True, exist_ok=True)
    bench_log.write_text("")
    with contextlib.ExitStack() as stack:
        tmp = Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-router-"))
        )
        model = ensure_model(Path(args.model))  # the tokenizer of vllm bench serve
        if args.serving_fakes:
            routers, servers = start_dry_fleet(stack, args)
        else:
            routers, servers = start_vllm_fleet(stack, args, model, began)
        urls = {
            "colocated": servers["colocated"].url,
            **{t: r.url for t, r in routers.items()},
        }
        startup_s = time.monotonic() - began
        print(f"servers and routers ready after {startup_s:.0f}s", flush=True)
        mine = {p.proc.pid for p in [*routers.values(), *servers.values()]}
        load_before = load_snapshot(mine)
        model_name = str(model)
        greedy = {c: greedy_text(urls[c], model_name) for c in CONFIGS}
        t = time.monotonic()
        warm = {c: asyncio.run(warm_up(urls[c], model_name, 8, 4)) for c in CONFIGS}
        warm_s = time.monotonic() - t
        print(
            f"warm-up done in {warm_s:.0f}s: {warm}; greedy same as colocated: "
            f"{ {c: greedy[c] == greedy['colocated'] for c in CONFIGS} }",
            flush=True,
        )
        t = time.monotonic()
        runs = bench_rounds(args, urls, model, tmp, bench_log)
        measure_s = time.monotonic() - t
        router_metrics = {
            t: scrape(f"{r.url}/metrics", "vllm_disagg_router_")
            for t, r in routers.items()
        }
        router_metrics = {
            t: {
                k: v
                for k, v in m.items()
                if not k.startswith(HIST) and v and "_created" not in k
            }
            for t, m in router_metrics.items()
        }
        decode_p2p = {}
        if not args.serving_fakes:
            with contextlib.suppress(Exception):  # requests' errors, via VllmServer
                decode_p2p = {
                    name: sum(values.values())
                    for name, values in servers["decode"]
                    .metrics(prefix="vllm:p2p_")
                    .items()
                    if name.endswith("_total")
                }
        load_after = load_snapshot(mine)
    return {
        "meta": {
            "dry_run_on_fakes": bool(args.serving_fakes),
            "model": str(model)
            if args.serving_fakes
            else (
                f"{model} (tiny Llama: 2 layers, hidden 128, 1 KV head of 64), {DTYPE}"
            ),
            "server_args": SERVER_ARGS,
            "server_env": SERVER_ENV,
            "kv_transfer": (
                f"P2pNcclConnector PUT_ASYNC, kv_load_timeout_s={KV_LOAD_TIMEOUT_S:g}, "
                "instances register with both routers (proxy_ip lists both)"
            ),
            "bench": {
                "input_len": args.input_len,
                "output_len": args.output_len,
                "num_prompts": args.num_prompts,
                "concurrency": list(args.concurrency),
                "rounds": args.serving_rounds,
                "backend": "vllm",
                "dataset": "random",
                "ignore_eos": True,
            },
            "startup_s": startup_s,
            "warm_up_s": warm_s,
            "measure_s": measure_s,
            "took_s": time.monotonic() - began,
            "load_before": load_before,
            "load_after": load_after,
        },
        "greedy": greedy,
        "warm_up_ok": warm,
        "runs": runs,
        "router_metrics": router_metrics,
        "decode_p2p_totals": decode_p2p,
    }


def summarize_serving(part: dict) -> dict:
    by: dict = {}
    for run in part["runs"]:
        by.setdefault(str(run["concurrency"]), {}).setdefault(run["config"], []).append(
            run
        )
    table: dict = {}
    for conc, configs in by.items():
        table[conc] = {}
        for config, runs in configs.items():
            good = [r for r in runs if r.get("completed")]
            row: dict = {
                "runs": len(runs),
                "completed": sum(r.get("completed") or 0 for r in runs),
                "failed": sum(r.get("failed") or 0 for r in runs),
            }
            for key in (
                "request_throughput",
                "output_throughput",
                *(f"p{p}_{m}_ms" for m in BENCH_METRICS for p in BENCH_PERCENTILES),
            ):
                values = [r[key] for r in good if r.get(key) is not None]
                # Rounds: the median of the per-run percentiles.
                row[key] = pct(values, 50) if values else None
            table[conc][config] = row
        base = table[conc].get("colocated", {})
        for config, row in table[conc].items():
            row["vs_colocated"] = {
                key: ratio(row.get(key) or None, base.get(key))
                for key in (
                    "p50_ttft_ms",
                    "p50_tpot_ms",
                    "p50_e2el_ms",
                    "p90_ttft_ms",
                    "p99_ttft_ms",
                    "request_throughput",
                )
            }
        seq, conc_row = table[conc].get("router_seq"), table[conc].get("router_conc")
        if seq and conc_row:
            table[conc]["concurrent_vs_sequential"] = {
                key: ratio(conc_row.get(key) or None, seq.get(key))
                for key in (
                    "p50_ttft_ms",
                    "p90_ttft_ms",
                    "p50_tpot_ms",
                    "p50_e2el_ms",
                    "request_throughput",
                )
            }
    return table


# =============================================================================
# Output: tables and figures; what they mean is for docs/router.md to say
# =============================================================================


def write_markdown(result: dict) -> list[str]:
    meta = result["meta"]
    lines = [
        "# The xPyD router: overhead, ceiling, and end-to-end cost",
        "",
        report.generated(
            "router.py",
            "A `--quick` run." if meta.get("quick") else "",
            "Every process below (load generator, fake instances, routers, vLLM "
            "servers, `vllm bench serve`) shares the machine's cores with whatever "
            "else runs on it (counted as vLLM processes this run did not start). Load "
            "average (1, 5, 15 min) "
            + "; ".join(
                f"{k.replace('_', ' ')} {load_line(v)}" for k, v in meta["load"].items()
            )
            + ".",
            date=meta["date"],
            on=meta["machine"],
        ),
        "",
    ]
    if "overhead" in result:
        lines += overhead_markdown(result["overhead"])
    if "serving" in result:
        lines += serving_markdown(result["serving"])
    return lines


def scenario_text(name: str, v: dict) -> str:
    pace = (
        f" {v['chunk_delay_ms']:g} ms apart"
        if v["chunk_delay_ms"]
        else (" sent at once" if v["stream"] else "")
    )
    stagger = ", each client's first request at a random point of one stream's length"
    return (
        f"`{name}`: {'SSE' if v['stream'] else 'JSON'}, {v['chunks']} tokens{pace}, "
        f"concurrency {', '.join(map(str, v['concurrency']))}"
        + (stagger if name in STAGGERED else "")
    )


def overhead_markdown(part: dict) -> list[str]:
    s = part["summary"]
    return [
        *overhead_setup(part["meta"]),
        *added_tables(s),
        *latency_tables(s),
        *ceiling_tables(part),
    ]


def overhead_setup(meta: dict) -> list[str]:
    batches = "; ".join(
        f"{k} " + ", ".join(f"{n} at {c}" for c, n in v.items())
        for k, v in meta["batch_sizes"].items()
    )
    return [
        "## 1. Router overhead against fake backends",
        "",
        "Fake prefill and decode instances (`vllm_disagg.testing.fake_instance`, one "
        "process each) answer at once; the router (`python -m vllm_disagg.router "
        f"--static-prefill ... --static-decode ...`, {meta['router_event_loop']} event "
        "loop, one process per hand-off style) and the load generator (this script: "
        "asyncio + aiohttp, keep-alive connections) are processes of their own. "
        f"Request: a completion with a {meta['prompt_chars']}-character prompt; "
        + "; ".join(scenario_text(k, v) for k, v in meta["scenarios"].items())
        + f". {meta['rounds']} interleaved rounds (every target once per scenario and "
        f"concurrency per round, in a random order); closed-loop batches of {batches} "
        "requests per round.",
        "",
        "Targets: `direct` = the fake decode instance alone; `direct_pd` = the client "
        "does the hand-off itself (fake prefill with `max_tokens` 1, then fake "
        "decode); `router_seq` / `router_conc` = through the router, `--handoff "
        "sequential` / `concurrent`, on uvicorn (the default); `router_hyper` = "
        "`--handoff sequential --http-server hypercorn`. Latency: the client's, "
        "request sent .. last byte (`total`) and .. first byte (`ttfb`). Added latency "
        "at a percentile = that percentile through the router minus the same "
        "percentile of the baseline (not a per-request difference).",
        "",
        "### Router-added latency (ms)",
        "",
        "`router alone` = router_seq - direct_pd; `vs direct` = router_seq - direct; "
        "`concurrent vs direct` = router_conc - direct; `hypercorn alone` = "
        "router_hyper - direct_pd. `histogram` = the router's own "
        "`vllm_disagg_router_added_latency_seconds` over the same requests (time to "
        "the client's first byte minus time waiting on instances, inside the handler; "
        "quantiles interpolated in buckets 0.5/1/2/5/10/25 ms), and the share of its "
        "requests at or under 2 ms (a bucket bound: exact).",
        "",
    ]


def added_tables(s: dict) -> list[str]:
    rows = []
    for key, a in s["added"].items():
        alone, vs = (
            a["router_seq - direct_pd"]["total"],
            a["router_seq - direct"]["total"],
        )
        cc, hy = (
            a["router_conc - direct"]["total"],
            a["router_hyper - direct_pd"]["total"],
        )
        h = s["router_hist"][key]
        rows.append(
            [
                *key.split("/"),
                ms(alone["p10"]),
                f"**{ms(alone['p50'])}**",
                ms(alone["p90"]),
                ms(alone["p99"]),
                ms(vs["p50"]),
                ms(vs["p99"]),
                ms(cc["p50"]),
                ms(cc["p99"]),
                ms(hy["p50"]),
                ms(hy["p99"]),
                ms(h["router_seq"]["p50"]),
                ms(h["router_conc"]["p50"]),
                percent(h["router_seq"]["share_le_2ms"]),
                percent(h["router_conc"]["share_le_2ms"]),
            ]
        )
    lines = table(
        [
            "scenario",
            "concurrency",
            "router alone p10",
            "p50",
            "p90",
            "p99",
            "vs direct p50",
            "p99",
            "concurrent vs direct p50",
            "p99",
            "hypercorn alone p50",
            "p99",
            "histogram p50 seq",
            "conc",
            "<= 2 ms seq",
            "conc",
        ],
        rows,
    )
    g = s["goal"]

    def met(x: float | None) -> str:
        return "" if x is None else ("yes" if x < GOAL_P50_S else "no")

    goal_rows = [
        (f"router alone, client side ({g['key']})", g["client_p50_s"]),
        (f"router's own histogram ({g['key']})", g["router_hist_p50_s"]),
        (f"router alone on hypercorn ({g['key']})", g["client_p50_hypercorn_s"]),
        ("router alone, paced/32", g.get("paced_p50_s")),
        ("router alone, time to first byte, decode/32", g.get("decode_ttfb_p50_s")),
    ]
    lines += [
        "",
        f"Goal (issue 10): router-added p50 under {GOAL_P50_S * 1000:g} ms at "
        f"{GOAL_CONCURRENCY} concurrent streams.",
        "",
        *table(
            ["measure", "p50 ms", f"< {GOAL_P50_S * 1000:g} ms"],
            [(what, ms(x), met(x)) for what, x in goal_rows],
        ),
        "",
    ]
    return lines


def latency_tables(s: dict) -> list[str]:
    rows = []
    for key, by_target in s["latency"].items():
        for target, row in by_target.items():
            t, b = row["total"], row["ttfb"]
            rows.append(
                [
                    *key.split("/"),
                    target,
                    row["n"],
                    row["errors"],
                    *(ms(t[q]) for q in ("p10", "p50", "p90", "p99")),
                    *(ms(b[q]) for q in ("p50", "p90", "p99")),
                ]
            )
    lines = ["### Latency per target (ms, client side)", ""]
    lines += table(
        [
            "scenario",
            "concurrency",
            "target",
            "requests",
            "errors",
            "total p10",
            "p50",
            "p90",
            "p99",
            "ttfb p50",
            "p90",
            "p99",
        ],
        rows,
    )
    lines += [
        "",
        "### CPU time per request (microseconds, all cores)",
        "",
        "CPU time (user + system, psutil) each process spent over a target's batches, "
        "divided by the requests of those batches.",
        "",
    ]
    procs = (
        "router_seq",
        "router_conc",
        "router_hyper",
        "fake_prefill",
        "fake_decode",
        "client",
    )
    rows = [
        [*key.split("/"), target, *(fmt(row.get(n), ".0f", 1e6) for n in procs)]
        for key, by_target in s["cpu"].items()
        for target, row in by_target.items()
    ]
    return [*lines, *table(["scenario", "concurrency", "target", *procs], rows), ""]


def ceiling_tables(part: dict) -> list[str]:
    meta, c = part["meta"], part["summary"]["ceiling"]
    lines = [
        "### Request-rate ceiling",
        "",
        "Streaming (`stream` scenario), closed loop at each concurrency for "
        f"{meta['ceiling_warm_s']:g} s warm-up + {meta['ceiling_window_s']:g} s "
        "counted; requests/s completed in the window, and the CPU share (1.0 = one "
        "core busy) of the router in use and of the client over the level.",
        "",
    ]
    ceiling = part["ceiling"]
    rows = []
    for level in meta["ceiling_levels"]:
        rs, rc = ceiling["router_seq"][str(level)], ceiling["router_conc"][str(level)]
        share = rs["cpu_share"]
        fakes = share["fake_prefill"] + share["fake_decode"]
        rows.append(
            [
                level,
                *(f"{ceiling[t][str(level)]['rps']:.0f}" for t in CEILING_TARGETS),
                f"{share['router_seq']:.2f}",
                f"{rc['cpu_share']['router_conc']:.2f}",
                f"{share['client']:.2f}",
                f"{fakes:.2f}",
                ms(rs["latency"]["p50"], 1),
            ]
        )
    lines += table(
        [
            "concurrency",
            *(f"{t} req/s" for t in CEILING_TARGETS),
            "router_seq CPU",
            "router_conc CPU",
            "client CPU (router_seq)",
            "fakes CPU (router_seq)",
            "router_seq p50 ms",
        ],
        rows,
    )
    lines += [
        "",
        "Highest rate per target; knee = the lowest concurrency within 5 % of it; x "
        "direct = its ratio to the highest rate of `direct`.",
        "",
        *table(
            ["target", "max req/s", "knee concurrency", "x direct"],
            [
                (
                    t,
                    f"{c[t]['max_rps']:.0f}",
                    c[t]["knee_concurrency"],
                    fmt(c[t]["vs_direct"], ".2f"),
                )
                for t in CEILING_TARGETS
            ],
        ),
        "",
        f"Part 1 took {meta['took_s']:.0f} s; load average before "
        f"{load_line(meta['load_before'])}, after {load_line(meta['load_after'])}. "
        "Router outcomes over the part: "
        + "; ".join(
            f"{t}: "
            + ", ".join(
                f"{label(k, 'outcome')} {v:.0f}"
                for k, v in o.items()
                if "outcome=" in k
            )
            for t, o in part["router_outcomes"].items()
        )
        + ".",
        "",
    ]
    return lines


def serving_markdown(part: dict) -> list[str]:
    s, meta = part["summary"], part["meta"]
    b = meta["bench"]
    lines = [
        "## 2. Real servers: `vllm bench serve`",
        "",
        (
            "**DRY RUN on fake instances (no vLLM servers): the pipeline, not a "
            "result.** "
            if meta["dry_run_on_fakes"]
            else ""
        )
        + (
            f"Model: {meta['model']}. Servers: `{' '.join(meta['server_args'])}`, "
            "environment "
            f"`{' '.join(f'{k}={v}' for k, v in meta['server_env'].items())}`. "
            "`colocated` = one plain `vllm serve`, requests sent to it directly; "
            "`router_seq` / `router_conc` = one prefill and one decode `vllm serve` "
            f"({meta['kv_transfer']}) behind the router, `--handoff sequential` / "
            "`concurrent`; all on the same machine. `vllm bench serve --backend vllm "
            f"--dataset-name random --random-input-len {b['input_len']} "
            f"--random-output-len {b['output_len']} --num-prompts {b['num_prompts']} "
            "--ignore-eos --max-concurrency C`, C in "
            f"{', '.join(map(str, b['concurrency']))}; {b['rounds']} round(s), the "
            "configurations of a round in a random order; a seed per run, so fresh "
            "random prompts of the same token counts (no prefix-cache hit on any "
            "server). Figures: the median over rounds of each run's percentile (ms)."
        ),
        "",
    ]
    cols = [
        (m, p)
        for m, ps in (
            ("ttft", (50, 90, 99)),
            ("tpot", (50, 90, 99)),
            ("itl", (50,)),
            ("e2el", (50, 90, 99)),
        )
        for p in ps
    ]
    rows = []
    for conc, by_config in s.items():
        for config in CONFIGS:
            if r := by_config.get(config):
                figures = (
                    fmt(r.get(f"p{p}_{m}_ms"), ".1f" if m in ("tpot", "itl") else ".0f")
                    for m, p in cols
                )
                rows.append(
                    [
                        conc,
                        config,
                        r["completed"],
                        r["failed"],
                        fmt(r["request_throughput"], ".2f"),
                        *figures,
                    ]
                )
    header = [
        "concurrency",
        "config",
        "completed",
        "failed",
        "req/s",
        "TTFT p50",
        "p90",
        "p99",
        "TPOT p50",
        "p90",
        "p99",
        "ITL p50",
        "E2E p50",
        "p90",
        "p99",
    ]
    lines += table(header, rows)
    keys = (
        "p50_ttft_ms",
        "p90_ttft_ms",
        "p99_ttft_ms",
        "p50_tpot_ms",
        "p50_e2el_ms",
        "request_throughput",
    )
    rows = []
    for conc, by_config in s.items():
        for config in ("router_seq", "router_conc"):
            if v := by_config.get(config, {}).get("vs_colocated"):
                rows.append([conc, config, *(fmt(v.get(k), ".2f") for k in keys)])
        if cs := by_config.get("concurrent_vs_sequential"):
            rows.append(
                [
                    conc,
                    "concurrent / sequential",
                    *(fmt(cs.get(k), ".2f") for k in keys),
                ]
            )
    lines += [
        "",
        "Ratios (x colocated; concurrent / sequential: router_conc over router_seq):",
        "",
        *table(
            [
                "concurrency",
                "config",
                "TTFT p50",
                "TTFT p90",
                "TTFT p99",
                "TPOT p50",
                "E2E p50",
                "req/s",
            ],
            rows,
        ),
        "",
        "TTFT p50 of each run (ms), by round:",
        "",
        *table(
            ["concurrency", "config", *(f"round {r + 1}" for r in range(b["rounds"]))],
            [
                [*key, *(fmt(v, ".0f") for v in values)]
                for key, values in round_values(part, "p50_ttft_ms").items()
            ],
        ),
    ]
    greedy = part["greedy"]
    decode = sorted(part["decode_p2p_totals"].items())
    rm = part["router_metrics"]
    lines += [
        "",
        "Checks: greedy 16-token completion of one prompt equal to the colocated "
        "server's: "
        + ", ".join(
            f"{c} {'yes' if greedy[c] == greedy['colocated'] else 'NO'}"
            for c in CONFIGS
            if c != "colocated"
        )
        + (
            f"; warm-up requests answered: {part['warm_up_ok']}. Decode instance's "
            "connector counters at the end: "
        )
        + (
            ", ".join(
                f"{k.removeprefix('vllm:p2p_').removesuffix('_total')} {v:.0f}"
                for k, v in decode
            )
            or "n/a"
        )
        + ". Router counters at the end: "
        + "; ".join(
            f"{t}: "
            + ", ".join(
                f"{k.removeprefix('vllm_disagg_router_')} {v:.0f}"
                for k, v in sorted(m.items())
            )
            for t, m in rm.items()
        )
        + ".",
        "",
        "Runs in order: "
        + "; ".join(
            f"r{r['round'] + 1} c{r['concurrency']} {r['config']} {r['took_s']:.0f}s "
            f"(rc {r['rc']}, {r.get('total_input_tokens')} prompt tokens, TTFT p50 "
            f"{fmt(r.get('p50_ttft_ms'), '.0f')} ms)"
            for r in part["runs"]
        )
        + ".",
        "",
        f"Part 2 took {meta['took_s']:.0f} s (start-up {meta['startup_s']:.0f} s, "
        f"warm-up {meta['warm_up_s']:.0f} s, benchmark runs {meta['measure_s']:.0f} s, "
        "each including `vllm bench serve`'s import of vLLM); load average before "
        f"{load_line(meta['load_before'])}, after {load_line(meta['load_after'])}.",
        "",
    ]
    return lines


def round_values(part: dict, key: str) -> dict[tuple[str, str], list]:
    found: dict = {}
    for run in part["runs"]:
        found.setdefault((str(run["concurrency"]), run["config"]), []).append(
            run.get(key)
        )
    return found


def plot(result: dict, path: Path) -> None:
    plt = report.pyplot()
    panels = []
    if "overhead" in result:
        panels += ["added", "ceiling"]
    if "serving" in result:
        panels += ["ttft", "e2e"]
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + 1) // 2
    fig, grid = plt.subplots(
        rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False
    )
    axes = dict(zip(panels, grid.flat))
    colors = {
        "direct": "#999999",
        "direct_pd": "#666666",
        "router_seq": "#2a7ab9",
        "router_conc": "#e08a2c",
        "router_hyper": "#8a5fb0",
        "colocated": "#999999",
    }
    if "overhead" in result:
        s = result["overhead"]["summary"]
        ax = axes["added"]
        keys = [k for k in s["added"] if k.split("/")[0] in SCENARIOS]
        xs = range(len(keys))
        width = 0.27
        for j, q in enumerate(("p50", "p90", "p99")):
            vals = [
                (s["added"][k]["router_seq - direct_pd"]["total"][q] or 0) * 1000
                for k in keys
            ]
            ax.bar(
                [x + (j - 1) * width for x in xs],
                vals,
                width,
                label=f"{q} router alone",
                color=("#2a7ab9", "#7fb2dc", "#c9def0")[j],
            )
        hyper = [
            (s["added"][k]["router_hyper - direct_pd"]["total"]["p50"] or 0) * 1000
            for k in keys
        ]
        ax.plot(
            list(xs),
            hyper,
            "s",
            color="#8a5fb0",
            markersize=5,
            label="p50 on hypercorn",
        )
        hist = [(s["router_hist"][k]["router_seq"]["p50"] or 0) * 1000 for k in keys]
        ax.plot(list(xs), hist, "kD", markersize=5, label="p50 router histogram")
        ax.axhline(
            GOAL_P50_S * 1000,
            color="#c23b3b",
            linestyle="--",
            linewidth=1,
            label="goal: p50 < 2 ms @ 32",
        )
        ax.set_xticks(list(xs), [k.replace("/", "\nc=") for k in keys], fontsize=8)
        ax.set_ylabel("ms added (router_seq - direct_pd)")
        ax.set_yscale("symlog", linthresh=1)
        ax.set_title("Router-added latency, fake backends", fontsize=10)
        ax.legend(fontsize=7)

        ax = axes["ceiling"]
        ceiling = result["overhead"]["ceiling"]
        for target in CEILING_TARGETS:
            levels = sorted(int(k) for k in ceiling[target])
            ax.plot(
                levels,
                [ceiling[target][str(k)]["rps"] for k in levels],
                "o-",
                label=target,
                color=colors[target],
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.set_ylabel("requests/s (streamed, instant fakes)")
        ax.set_title("Request-rate ceiling", fontsize=10)
        ax.legend(fontsize=8)
    if "serving" in result:
        s = result["serving"]["summary"]
        concs = list(s)
        for panel, metric, name in (
            ("ttft", "ttft", "TTFT"),
            ("e2e", "e2el", "E2E latency"),
        ):
            ax = axes[panel]
            width = 0.27
            for j, config in enumerate(CONFIGS):
                xs = [i + (j - 1) * width for i in range(len(concs))]
                p50 = [s[c].get(config, {}).get(f"p50_{metric}_ms") or 0 for c in concs]
                p90 = [s[c].get(config, {}).get(f"p90_{metric}_ms") or 0 for c in concs]
                ax.bar(xs, p50, width, color=colors[config], label=f"{config} p50")
                ax.plot(
                    xs, p90, "k_", markersize=12, mew=2, label="p90" if j == 0 else None
                )
                for x, v in zip(xs, p50):
                    ax.annotate(
                        f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=7
                    )
            ax.set_xticks(range(len(concs)), [f"concurrency {c}" for c in concs])
            ax.set_ylabel(f"{name} (ms)")
            ax.set_title(f"vllm bench serve: {name}", fontsize=10)
            ax.legend(fontsize=7)
    fig.suptitle(f"xPyD router ({result['meta']['machine'].split(' (')[0]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(result: dict) -> None:
    if "overhead" in result:
        result["overhead"]["summary"] = summarize_overhead(result["overhead"])
    if "serving" in result:
        result["serving"]["summary"] = summarize_serving(result["serving"])


def round_raw(result: dict) -> None:
    """Per-request latencies to microseconds (tens of thousands of them)."""
    for by_conc in result.get("overhead", {}).get("raw", {}).values():
        for by_target in by_conc.values():
            for cell in by_target.values():
                for key in ("ttfb", "total"):
                    cell[key] = [round(x, 6) for x in cell[key]]


def write_outputs(result: dict, stem: Path) -> None:
    round_raw(result)
    summarize(result)
    report.write(
        stem,
        result,
        write_markdown(result),
        lambda png: plot(result, png),
        compact=True,
    )


def render(path: Path, out: Path) -> int:
    result = json.loads(path.read_text())
    write_outputs(result, out / path.stem)
    return 0


# =============================================================================
# main
# =============================================================================


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--part", choices=("overhead", "serving", "both"), default="both"
    )
    parser.add_argument("--rounds", type=int, default=4, help="part 1 rounds")
    parser.add_argument(
        "--ceiling-levels", type=int, nargs="+", default=list(CEILING_LEVELS)
    )
    parser.add_argument(
        "--ceiling-s", type=float, default=2.5, help="counted window per level"
    )
    parser.add_argument("--ceiling-warm-s", type=float, default=0.5)
    parser.add_argument(
        "--model",
        default="/tmp/models/tiny-llama",
        help="built with vllm_disagg.testing.tiny_models when missing",
    )
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--serving-rounds", type=int, default=2)
    parser.add_argument("--startup-timeout-s", type=float, default=900.0)
    parser.add_argument("--bench-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 round of smaller batches, ceiling up to 32, "
        "16 prompts at concurrency 4, 1 round",
    )
    parser.add_argument("--seed", type=int, default=20261123)
    parser.add_argument(
        "--render",
        metavar="JSON",
        help="no run: summarize the raw numbers of a result file again and "
        "write its md and png next to it (or in --out)",
    )
    parser.add_argument("--serving-fakes", action="store_true", help=argparse.SUPPRESS)
    report.add_out_argument(parser)
    args = parser.parse_args()
    require("aiohttp", "matplotlib", "psutil")  # before any process starts
    if args.render:
        return render(Path(args.render), args.out or Path(args.render).parent)
    if args.quick:
        args.rounds = 1
        args.ceiling_levels = [1, 4, 16, 32]
        args.ceiling_s, args.ceiling_warm_s = 1.0, 0.3
        args.num_prompts, args.concurrency, args.serving_rounds = 16, [4], 1
    args.out = args.out or report.RESULTS
    args.logs = args.out / "logs"
    args.logs.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    result: dict = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine(),
            "quick": args.quick,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "uptime_at_start": uptime(),
            "load": {"at_start": load_snapshot()},
        }
    }
    if args.part in ("overhead", "both"):
        print("part 1: router overhead against fake backends", flush=True)
        result["overhead"] = run_overhead(args)
        result["meta"]["load"]["after_part_1"] = load_snapshot()
    if args.part in ("serving", "both"):
        print("part 2: real servers, vllm bench serve", flush=True)
        result["serving"] = run_serving(args)
        result["meta"]["load"]["after_part_2"] = load_snapshot()
    result["meta"]["uptime_at_end"] = uptime()
    result["meta"]["total_s"] = time.monotonic() - began
    name = STEM
    if args.part != "both":
        name += f"-{args.part}"  # a one-part run keeps the full run's files
    if args.quick:
        name += "-quick"
    if args.serving_fakes:
        name += "-dry"
    write_outputs(result, args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
