"""The router at fleet scale: discovery, selection and memory at 10 to 1,000
instances, with no model and no HTTP.

Fake instances register through the router's real discovery socket (ZMQ,
loopback, signed frames sealed by the project's wire code), from a few
registrant processes holding one DEALER socket per instance, as the
connector's registration thread does. The router side is the real
``DiscoveryServer`` and ``InstanceRegistry`` on this process's event loop.
Then prompts go through the real per-request selection (the proxy's
``Picker``: ``pick`` with the prefix-aware prefill policy and
``pick_paired_decode``)
while the registrants keep heartbeating on the same loop, as in the router.

Per fleet size it measures: registration time, heartbeat processing (CPU of
this process per heartbeat, under a flood), selection cost p50/p99 (distinct
prompts and prompts sharing long prefixes), ``/instances`` (snapshot and
JSON) size and time, and memory (tracemalloc) of the registry and of the
prefix index as prompts grow. The machine's load is recorded with the figures.

    python benchmarks/router_scale.py            # 10/100/1,000, 100,000 prompts
    python benchmarks/router_scale.py --quick    # CI smoke: a few seconds
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import resource
import sys
import time
import tracemalloc
from types import SimpleNamespace

import msgspec
from _deps import require  # benchmarks/ is sys.path[0] when run as a script
from common.procs import uptime
from common.report import RESULTS, add_out_argument, generated, table, write
from common.stats import pcts

from vllm_disagg.router.app import build_registry
from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.discovery import DiscoveryServer
from vllm_disagg.router.picking import Picker
from vllm_disagg.router.policy import Policies
from vllm_disagg.testing.fake_registrants import MODEL, Registrants, fake_register
from vllm_disagg.wire.discovery import HEARTBEAT_INTERVAL_S, Role, seal

TOKEN = b"router-scale-benchmark-token-32b"
SYSTEM_PROMPTS = 32  # shared prefixes (chat system prompts)
YIELD_EVERY = 1  # selections per turn of the loop: a request awaits, at least once


# --- prompts and selection ---------------------------------------------------


def prompts(count: int, shared_share: float, seed: int = 0):
    """``(kind, body)``: distinct completion prompts (1-4 KB) and chats that
    open with one of SYSTEM_PROMPTS 4 KB system prompts."""
    rng = random.Random(seed)
    systems = [rng.randbytes(2048).hex() for _ in range(SYSTEM_PROMPTS)]
    for _ in range(count):
        if rng.random() < shared_share:
            messages = [
                {"role": "system", "content": rng.choice(systems)},
                {"role": "user", "content": rng.randbytes(256).hex()},
            ]
            yield "shared", {"model": MODEL, "messages": messages}
        else:
            text = rng.randbytes(rng.randint(512, 2048)).hex()
            yield "distinct", {"model": MODEL, "prompt": text}


def selector(registry, policies) -> Picker:
    """The proxy's own selection over ``registry`` and ``policies``."""
    return Picker(registry, policies)


async def select_prompts(registry, policies, count, shared_share, in_flight):
    """Per request, what the proxy does to choose: the decode, then the prefill;
    each request holds both for the next ``in_flight`` requests (load the
    policies see). Returns the timings and the index size."""
    proxy = selector(registry, policies)
    times: dict[str, list[float]] = {"distinct": [], "shared": []}
    cpu_times: list[float] = []  # this thread's CPU: without the machine's load
    held: list = []
    kept, last_holder = 0, {}
    clock, cpu_clock = time.perf_counter, time.thread_time
    for n, (kind, body) in enumerate(prompts(count, shared_share)):
        ex = SimpleNamespace(model=MODEL, body=body)
        start, cpu_start = clock(), cpu_clock()
        decode = proxy.pick_paired_decode(ex)
        prefill = proxy.pick(
            Role.PREFILL, ex, {decode.instance_id}, model=decode.model, partner=decode
        )
        times[kind].append(clock() - start)
        cpu_times.append(cpu_clock() - cpu_start)
        if kind == "shared":
            system = body["messages"][0]["content"]
            kept += last_holder.get(system) == prefill.instance_id
            last_holder[system] = prefill.instance_id
        held += [registry.reserve(decode), registry.reserve(prefill)]
        if len(held) > 2 * in_flight:
            for lease in held[:2]:
                lease.release(True)
            del held[:2]
        if n % YIELD_EVERY == 0:
            await asyncio.sleep(0)  # discovery's turn, as between requests
    for lease in held:
        lease.release(True)
    shared = len(times["shared"])
    kept_share = kept / max(1, shared - len(last_holder))
    return times, cpu_times, kept_share, len(policies.prefill)


def instances_listing(registry, rounds: int) -> dict:
    """``/instances``: the registry's snapshot encoded as the app does."""
    spent = []
    for _ in range(rounds):
        start = time.perf_counter()
        body = msgspec.json.encode(registry.snapshot())
        spent.append(time.perf_counter() - start)
    return {"bytes": len(body), **{k: v for k, v in pcts(spent, (50, 99)).items()}}


# --- memory ------------------------------------------------------------------


def registry_memory(size: int) -> int:
    """Bytes tracemalloc sees the registry take for ``size`` instances
    registered through discovery's message handling (no sockets)."""
    gc.collect()
    tracemalloc.start()
    registry = build_registry(RouterConfig())
    server = DiscoveryServer(registry, host="127.0.0.1", port=0, token=TOKEN)
    base = tracemalloc.get_traced_memory()[0]
    for i in range(size):
        server.handle(seal(TOKEN, fake_register(i)), "127.0.0.1")
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(registry) == size
    return used


def index_memory(checkpoints: list[int], shared_share: float) -> list[dict]:
    """The prefix index's entries and traced bytes as prompts go through it."""
    registry = build_registry(RouterConfig())
    for i in range(8):
        registry.add_static(Role.PREFILL, f"127.0.0.1:{20000 + i}", "k", MODEL)
    candidates = registry.healthy(Role.PREFILL)
    policy = Policies.from_config(RouterConfig(policy_prefill="prefix_aware")).prefill
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    out, todo = [], sorted(checkpoints)
    for n, (_, body) in enumerate(prompts(todo[-1], shared_share, seed=1), 1):
        policy.select(candidates, body)
        if n == todo[0]:
            todo.pop(0)
            used = tracemalloc.get_traced_memory()[0] - base
            out.append({"prompts": n, "entries": len(policy), "bytes": used})
    tracemalloc.stop()
    return out


# --- one fleet ---------------------------------------------------------------


async def fleet(size: int, opts: argparse.Namespace) -> dict:
    config = RouterConfig(
        policy_prefill="prefix_aware", policy_decode="least_outstanding"
    )
    registry = build_registry(config)
    policies = Policies.from_config(config)
    server = DiscoveryServer(registry, host="127.0.0.1", port=0, token=TOKEN)
    await server.start()
    procs = await Registrants.start(
        server.endpoint, size, min(opts.processes, size), token=TOKEN
    )
    try:
        start = time.perf_counter()
        acked = await procs.command("go")
        registration_s = time.perf_counter() - start
        assert acked == size == len(registry), (acked, size, len(registry))

        before = (time.process_time(), server.accepted["register"])
        start = time.perf_counter()
        flooded = await procs.command(f"flood {opts.flood_s}")
        wall = time.perf_counter() - start
        cpu = time.process_time() - before[0]
        handled = server.accepted["register"] - before[1]
        rejected = sum(server.rejected.values())

        await procs.command("steady", reply=False)
        before = (time.process_time(), server.accepted["register"])
        start = time.perf_counter()
        times, cpu_times, kept, entries = await select_prompts(
            registry, policies, opts.prompts, opts.shared, opts.in_flight
        )
        select_wall = time.perf_counter() - start
        steady_hb = server.accepted["register"] - before[1]
        listing = instances_listing(registry, opts.listing_rounds)
        await procs.command("stop")
        assert len(registry) == size, (len(registry), size)  # nobody expired
    finally:
        await procs.close()
        await server.close()
    every = times["distinct"] + times["shared"]
    return {
        "instances": size,
        "registrant_processes": len(procs.procs),
        "registration_s": registration_s,
        "heartbeats": {
            "flood_s": wall,
            "handled": handled,
            "acked_by_registrants": flooded,
            "rejected": rejected,
            "per_s": handled / wall,
            "cpu_per_heartbeat_s": cpu / max(1, handled),
            "core_share_at_real_interval": size
            / HEARTBEAT_INTERVAL_S
            * cpu
            / max(1, handled),
        },
        "selection": {
            "prompts": len(every),
            "shared_prompts": len(times["shared"]),
            "all": pcts(every, (50, 90, 99)),
            "distinct": pcts(times["distinct"], (50, 99)),
            "shared": pcts(times["shared"], (50, 99)),
            "max": max(every),
            "cpu": pcts(cpu_times, (50, 90, 99)),
            "prefix_kept": kept,
            "index_entries": entries,
            "heartbeats_meanwhile": steady_hb,
            "wall_s": select_wall,
        },
        "instances_listing": listing,
    }


def report(result: dict, out) -> None:
    us = lambda s: "" if s is None else f"{s * 1e6:.0f}"  # noqa: E731
    rows = []
    for f in result["fleets"]:
        hb, sel = f["heartbeats"], f["selection"]
        rows.append(
            [
                f["instances"],
                f"{f['registration_s'] * 1000:.0f}",
                us(hb["cpu_per_heartbeat_s"]),
                f"{hb['per_s']:.0f}",
                f"{hb['core_share_at_real_interval'] * 100:.1f} %",
                us(sel["cpu"]["p50"]),
                us(sel["cpu"]["p99"]),
                us(sel["all"]["p50"]),
                us(sel["all"]["p99"]),
                us(sel["distinct"]["p99"]),
                us(sel["shared"]["p99"]),
                f"{sel['prefix_kept'] * 100:.0f} %",
                f"{f['instances_listing']['bytes'] / 1024:.0f}",
                f"{f['instances_listing']['p50'] * 1000:.2f}",
                f"{result['registry_bytes'][str(f['instances'])] / f['instances']:.0f}",
            ]
        )
    md = [
        "# Router at fleet scale",
        "",
        generated(
            "router_scale.py",
            f"Load before: `{result['load_before']}`; after: `{result['load_after']}`.",
        ),
        "",
        f"{result['prompts']} prompts per fleet size ({result['shared'] * 100:.0f} %"
        f" chats opening with one of {SYSTEM_PROMPTS} 4 KB system prompts, the rest"
        " distinct 1-4 KB prompts), each holding its prefill and decode for the next"
        f" {result['in_flight']} requests; half the instances prefill, half decode;"
        f" heartbeats every {HEARTBEAT_INTERVAL_S:.0f} s meanwhile. Selection: the"
        " proxy's decode and prefill picks for one request (prefix_aware prefill,"
        " least_outstanding decode), in microseconds; CPU: this thread's CPU time"
        " (what the code costs), wall: with the machine's load (preemption).",
        "",
        *table(
            [
                "instances",
                "registration ms",
                "CPU µs/heartbeat",
                "heartbeats/s (flood)",
                "core at 3 s interval",
                "select CPU p50 µs",
                "select CPU p99 µs",
                "select wall p50 µs",
                "select wall p99 µs",
                "wall p99 distinct",
                "wall p99 shared",
                "prefix kept",
                "/instances KiB",
                "/instances ms",
                "registry B/instance",
            ],
            rows,
        ),
        "",
        "Prefix index as prompts go through it (prefix_aware defaults:"
        f" {RouterConfig().prefix_index_max_entries} entries,"
        f" {RouterConfig().prefix_chunk_chars}-character chunks):",
        "",
        *table(
            ["prompts", "entries", "traced MiB"],
            [
                [m["prompts"], m["entries"], f"{m['bytes'] / 2**20:.1f}"]
                for m in result["index_memory"]
            ],
        ),
        "",
        f"Process peak RSS: {result['peak_rss_mib']:.0f} MiB.",
    ]
    write(out / "router_scale", result, md)


async def run(opts: argparse.Namespace) -> dict:
    fleets = [await fleet(size, opts) for size in opts.sizes]
    return {"fleets": fleets}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke: seconds")
    parser.add_argument("--sizes", default="10,100,1000", help="fleet sizes")
    parser.add_argument("--prompts", type=int, default=100_000)
    parser.add_argument("--shared", type=float, default=0.3, help="shared-prefix share")
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--flood-s", type=float, default=5.0)
    parser.add_argument("--processes", type=int, default=4, help="registrants")
    parser.add_argument("--listing-rounds", type=int, default=20)
    add_out_argument(parser)
    opts = parser.parse_args()
    require("msgspec")
    if opts.quick:
        opts.sizes, opts.prompts, opts.flood_s, opts.listing_rounds = (
            "4,16",
            400,
            0.5,
            3,
        )
        opts.processes = 1
    opts.sizes = [int(s) for s in opts.sizes.split(",")]
    out = opts.out or RESULTS
    load_before = uptime()
    result = asyncio.run(run(opts))
    checkpoints = sorted({min(n, opts.prompts) for n in (1000, 10_000, 50_000)})
    result.update(
        prompts=opts.prompts,
        shared=opts.shared,
        in_flight=opts.in_flight,
        registry_bytes={str(s): registry_memory(s) for s in opts.sizes},
        index_memory=index_memory(sorted({*checkpoints, opts.prompts}), opts.shared),
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        load_before=load_before,
        load_after=uptime(),
    )
    report(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
