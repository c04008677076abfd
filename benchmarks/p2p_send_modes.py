"""P2P KV transfer send modes on CPU: PUT_ASYNC vs GET vs PUT; prefix-aware transfer.

Eight ``vllm serve`` instances of a benchmark-sized tiny Llama (8 layers,
4 KV heads of 64, float32: 16 KiB of KV per token) stay up for the whole run:
one colocated server (no connector), a prefill/decode pair per send mode, and
a second GET decode with ``"skip_cached_blocks": false``. Requests are driven
one at a time the way the design document's proxy drives them: prefill with
``max_tokens=1``, then decode with the same ``X-Request-Id``, streamed.

Measured, in interleaved rounds (every configuration once per prompt length
per round, in a fresh random order, so the load other tenants put on a
shared machine falls on all alike):

* decode TTFT as the client sees the proxy flow (sending to prefill .. the
  decode's first streamed token), prefill request latency, the decode's next
  token interval (one decode step), and per request the connector's send /
  receive times (``vllm:p2p_send_seconds`` / ``vllm:p2p_recv_seconds``
  sum/count deltas) and bytes received; the TTFT of the colocated server and
  of a plain request (no transfer) to each mode's prefill server ("prefill
  alone"), same prompt length, same round;
* the share of the transfer hidden behind the prefill:
  exposed = TTFT_disagg - TTFT_prefill_alone - decode step,
  hidden = 1 - exposed / transfer time, clamped to [0, 1];
* prefix-aware transfer: prompts of a shared prefix (cached on decode) plus
  distinct tokens: decode TTFT and bytes received with ``skip_cached_blocks``
  true vs false (GET, where decode knows its cache before the offer), and with
  PUT_ASYNC (the offer arrives before decode has seen the request).

Writes benchmarks/results/p2p_send_modes.{json,md,png} (about 9 minutes on
2 shared cores, half of it server start-up; the 8 servers take about 19 GiB; ``--out
DIR``: elsewhere). ``--render`` rewrites the md and png of a result file from its raw
numbers.

    .venv/bin/python benchmarks/p2p_send_modes.py [--rounds 10] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from _deps import (
    machine,
    require,
)  # benchmarks/_deps.py: sys.path[0] when run as a script
from common import report
from common.report import spread, table
from common.stats import med, ratio

from vllm_disagg.testing import openai_client
from vllm_disagg.testing.p2p import (
    P2pInstance,
    free_kv_port,
    kv_transfer_config,
    peer_naming,
)
from vllm_disagg.testing.server import VllmServer, cpu_test_env
from vllm_disagg.testing.tiny_models import HEAD_DIM, build_model

STEM = "p2p_send_modes"

MODES = ("PUT_ASYNC", "GET", "PUT")
CONFIGS = ("colocated", *MODES)
# Benchmark-sized: megabytes of KV per request (head_dim 64: the CPU kernel's minimum).
MODEL_DIMS = dict(layers=8, heads=4, kv_heads=4, hidden=256, intermediate=512)
DTYPE, DTYPE_BYTES = "float32", 4
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
LENGTHS = (256, 1024, 2000)
SHARED_PREFIX, DISTINCT_TAIL = 1536, 64
# Prefix-aware runs: (label, prefill mode, decode instance name)
PREFIX_CONFIGS = (
    ("GET, skip_cached_blocks=true", "GET", "d_GET"),
    ("GET, skip_cached_blocks=false", "GET", "d_GET_noskip"),
    ("PUT_ASYNC, skip_cached_blocks=true", "PUT_ASYNC", "d_PUT_ASYNC"),
)
KV_LOAD_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 120.0
METRICS_SETTLE_S = 5.0

WATCHED = (
    "vllm:p2p_send_seconds_sum",
    "vllm:p2p_send_seconds_count",
    "vllm:p2p_recv_seconds_sum",
    "vllm:p2p_recv_seconds_count",
    "vllm:p2p_bytes_sent_total",
    "vllm:p2p_bytes_received_total",
    "vllm:p2p_blocks_received_total",
    "vllm:p2p_failed_loads_total",
    "vllm:p2p_failed_sends_total",
    "vllm:p2p_dropped_total",
    "vllm:p2p_spills_total",
    "vllm:external_prefix_cache_hits_total",
)


def kv_bytes_per_token() -> int:
    return 2 * MODEL_DIMS["layers"] * MODEL_DIMS["kv_heads"] * HEAD_DIM * DTYPE_BYTES


# --- servers -----------------------------------------------------------------


def server_args(args: argparse.Namespace) -> list[str]:
    return [
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "8",
        "--seed",
        "0",
        "--dtype",
        DTYPE,
        "--block-size",
        str(BLOCK_SIZE),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        *([] if args.compile else ["--enforce-eager"]),
    ]


def make_servers(
    model: Path, args: argparse.Namespace
) -> dict[str, VllmServer | P2pInstance]:
    """Not started: name -> server (P2pInstance for the connector's)."""
    logs = args.out / "logs"
    omp = omp_env(args)
    env = cpu_test_env(**omp)
    if "OMP_NUM_THREADS" not in omp and "OMP_NUM_THREADS" not in os.environ:
        del env[
            "OMP_NUM_THREADS"
        ]  # cpu_test_env's default; a binding chooses its own count

    def server(name: str, extra: list[str]) -> VllmServer:
        return VllmServer(
            model,
            [*server_args(args), *extra],
            log_path=logs / f"{STEM}-{name}.log",
            env=env,
            startup_timeout_s=args.startup_timeout_s,
        )

    def p2p(name: str, role: str, mode: str, **extra) -> P2pInstance:
        port = free_kv_port()
        config = kv_transfer_config(
            role,
            port,
            send_type=mode,
            kv_load_timeout_s=KV_LOAD_TIMEOUT_S,
            mem_pool_size_gb=0.25,
            **extra,
        )
        return P2pInstance(server(name, ["--kv-transfer-config", config]), port)

    servers: dict = {"colocated": server("colocated", [])}
    for mode in MODES:
        servers[f"p_{mode}"] = p2p(f"p_{mode}", "kv_producer", mode)
        servers[f"d_{mode}"] = p2p(f"d_{mode}", "kv_consumer", mode)
    servers["d_GET_noskip"] = p2p(
        "d_GET_noskip", "kv_consumer", "GET", skip_cached_blocks=False
    )
    return servers


def omp_env(args: argparse.Namespace) -> dict[str, str]:
    """The same CPU threading for every server. vLLM's automatic binding
    reserves one core for the scheduler and, with a KV connector, another:
    on 2 cores that fails, and connector servers get 2 OpenMP threads on
    cores 0-1 while the colocated one gets 1 thread on core 0."""
    if args.omp_bind == "nobind":
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    return {"VLLM_CPU_OMP_THREADS_BIND": args.omp_bind}


def base(server) -> VllmServer:
    return server.server if isinstance(server, P2pInstance) else server


def thread_affinity(server: VllmServer) -> dict[str, list[str]]:
    """CPUs each thread of the server's process group may run on, by process."""
    import psutil

    found: dict[str, set[str]] = {}
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if os.getpgid(proc.pid) != server.proc.pid:
                continue
            tasks = Path(f"/proc/{proc.pid}/task")
            for tid in tasks.iterdir():
                comm = (tid / "comm").read_text().strip()
                status = (tid / "status").read_text()
                cpus = next(
                    line.split(":", 1)[1].strip()
                    for line in status.splitlines()
                    if line.startswith("Cpus_allowed_list")
                )
                found.setdefault(proc.info["name"], set()).add(f"{comm}: {cpus}")
        except (OSError, ProcessLookupError, psutil.Error, StopIteration):
            continue
    return {name: sorted(threads) for name, threads in sorted(found.items())}


# --- one request -------------------------------------------------------------


def snapshot(server) -> dict[str, float]:
    metrics = base(server).metrics(prefix="vllm:")
    return {name: sum(metrics.get(name, {}).values()) for name in WATCHED}


def settled(
    server, before: dict[str, float], count_key: str
) -> tuple[dict[str, float], bool]:
    """Metrics once ``count_key`` moved past ``before`` (stats reach the API
    server with the engine's outputs); (metrics, moved)."""
    deadline = time.monotonic() + METRICS_SETTLE_S
    while True:
        now = snapshot(server)
        if now[count_key] > before[count_key]:
            return now, True
        if time.monotonic() > deadline:
            return now, False
        time.sleep(0.1)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in WATCHED}


def per_transfer(d: dict[str, float], what: str) -> float | None:
    count = d[f"vllm:p2p_{what}_seconds_count"]
    return d[f"vllm:p2p_{what}_seconds_sum"] / count if count > 0 else None


def stream_times(
    server, prompt, headers=None, **params
) -> tuple[list[float], list[int], float]:
    """Seconds from now to each streamed chunk with tokens, the token ids, and
    the start time. Two tokens in one chunk (the API server merges outputs a
    slow reader has not taken yet) leave one time."""
    start = time.perf_counter()
    times, ids = [], []
    chunks = openai_client.stream_completion(
        server,
        prompt,
        headers=headers,
        timeout_s=REQUEST_TIMEOUT_S,
        max_tokens=2,
        temperature=0.0,
        ignore_eos=True,
        return_token_ids=True,
        **params,
    )
    for chunk in chunks:
        new = openai_client.token_ids(chunk)
        if new or chunk["choices"][0].get("text"):
            times.append(time.perf_counter() - start)
            ids.extend(new)
    return times, ids, start


def step_s(times: list[float]) -> float | None:
    return times[1] - times[0] if len(times) > 1 else None


def colocated_once(server: VllmServer, prompt: list[int]) -> dict:
    times, ids, _ = stream_times(server, prompt)
    return {"ttft_s": times[0], "decode_step_s": step_s(times), "token_ids": ids}


def disagg_once(prefill: P2pInstance, decode: P2pInstance, prompt: list[int]) -> dict:
    """The proxy flow, timed from the client; the connector metrics' deltas."""
    headers, params = peer_naming(prefill.kv_addr, decode.kv_addr)
    p_before, d_before = snapshot(prefill), snapshot(decode)
    start = time.perf_counter()
    openai_client.complete(
        prefill,
        prompt,
        headers=headers,
        timeout_s=REQUEST_TIMEOUT_S,
        max_tokens=1,
        temperature=0.0,
        **params,
    )
    prefill_s = time.perf_counter() - start
    times, ids, decode_start = stream_times(decode, prompt, headers, **params)
    offset = decode_start - start
    p_after, p_moved = settled(prefill, p_before, "vllm:p2p_send_seconds_count")
    d_after, d_moved = settled(decode, d_before, "vllm:p2p_recv_seconds_count")
    p_delta, d_delta = delta(p_after, p_before), delta(d_after, d_before)
    return {
        "ttft_s": offset + times[0],
        "prefill_s": prefill_s,
        "decode_ttft_s": times[0],
        "decode_step_s": step_s(times),
        "send_s": per_transfer(p_delta, "send") if p_moved else None,
        "recv_s": per_transfer(d_delta, "recv") if d_moved else None,
        "sends": p_delta["vllm:p2p_send_seconds_count"],
        "recvs": d_delta["vllm:p2p_recv_seconds_count"],
        "bytes_received": d_delta["vllm:p2p_bytes_received_total"],
        "blocks_received": d_delta["vllm:p2p_blocks_received_total"],
        "bytes_sent": p_delta["vllm:p2p_bytes_sent_total"],
        "external_hits": d_delta["vllm:external_prefix_cache_hits_total"],
        "failed_loads": d_delta["vllm:p2p_failed_loads_total"],
        "token_ids": ids,
    }


# --- the run -----------------------------------------------------------------


class Prompts:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.shared = self.tokens(SHARED_PREFIX)

    def tokens(self, n: int) -> list[int]:
        """Fresh random token ids: no prefix-cache hit anywhere."""
        return [self.rng.randrange(3, 500) for _ in range(n)]

    def with_prefix(self) -> list[int]:
        return self.shared + self.tokens(DISTINCT_TAIL)


def warm_up(servers: dict, prompts: Prompts, lengths: tuple[int, ...]) -> dict:
    """Every shape once on every server (CPU torch.compile and first requests
    are slow); a disaggregated request of each length per mode checked
    against the colocated server's greedy tokens."""
    checks = {}
    coloc = servers["colocated"]
    for length in lengths:
        prompt = prompts.tokens(length)
        reference = colocated_once(coloc, prompt)["token_ids"]
        for mode in MODES:
            out = disagg_once(servers[f"p_{mode}"], servers[f"d_{mode}"], prompt)
            checks[f"{mode}/{length}"] = {
                "same_tokens_as_colocated": out["token_ids"] == reference,
                "external_hits": out["external_hits"],
                "failed_loads": out["failed_loads"],
            }
        out = disagg_once(servers["p_GET"], servers["d_GET_noskip"], prompt)
        checks[f"GET noskip/{length}"] = {
            "same_tokens_as_colocated": out["token_ids"] == reference,
            "failed_loads": out["failed_loads"],
        }
    # The shared prefix into every prefix-aware decode's cache (a plain,
    # local request), then one disaggregated prefix request each.
    for _, mode, decode in PREFIX_CONFIGS:
        colocated_once(base(servers[decode]), prompts.with_prefix())
        disagg_once(servers[f"p_{mode}"], servers[decode], prompts.with_prefix())
    return checks


def measure(servers: dict, prompts: Prompts, args: argparse.Namespace) -> dict:
    """Rounds; in each, every prompt length in turn, and for each length every
    configuration once in a fresh random order (no configuration always
    follows the same one), then the prefix-aware configurations, also shuffled.
    ``alone`` is a plain request (no peers: no transfer) to a mode's own prefill
    server: the prefill alone, on the server that prefills for that mode."""
    raw: dict = {
        "send_modes": {c: {str(n): [] for n in args.lengths} for c in CONFIGS},
        "prefill_alone": {m: {str(n): [] for n in args.lengths} for m in MODES},
        "prefix": {label: [] for label, _, _ in PREFIX_CONFIGS},
    }
    order_rng = random.Random(args.seed + 1)
    for r in range(args.rounds):
        t0 = time.monotonic()
        for length in args.lengths:
            items = [*CONFIGS, *(f"alone:{m}" for m in MODES)]
            order_rng.shuffle(items)
            for position, item in enumerate(items):
                prompt = prompts.tokens(length)
                if item == "colocated":
                    out = colocated_once(servers["colocated"], prompt)
                    target = raw["send_modes"][item]
                elif item.startswith("alone:"):
                    mode = item.split(":", 1)[1]
                    out = colocated_once(base(servers[f"p_{mode}"]), prompt)
                    target = raw["prefill_alone"][mode]
                else:
                    out = disagg_once(
                        servers[f"p_{item}"], servers[f"d_{item}"], prompt
                    )
                    target = raw["send_modes"][item]
                after = items[position - 1] if position else ""
                out.update(round=r, position=position, after=after)
                target[str(length)].append(out)
        prefix = list(PREFIX_CONFIGS)
        order_rng.shuffle(prefix)
        for label, mode, decode in prefix:
            out = disagg_once(
                servers[f"p_{mode}"], servers[decode], prompts.with_prefix()
            )
            out["round"] = r
            raw["prefix"][label].append(out)
        print(
            f"round {r + 1}/{args.rounds} done in {time.monotonic() - t0:.1f}s",
            flush=True,
        )
    return raw


# --- summary -----------------------------------------------------------------


def summarize(raw: dict, args: argparse.Namespace) -> dict:
    """Medians over rounds; exposed time and hidden share from the medians
    (robust to the outliers of a shared machine); per-round orders of the modes."""
    summary: dict = {"send_modes": {}, "prefix": {}}
    for length in map(str, args.lengths):
        coloc = raw["send_modes"]["colocated"][length]
        rows: dict = {
            "colocated": {
                "ttft_s": med(o["ttft_s"] for o in coloc),
                "best_ttft_s": min(o["ttft_s"] for o in coloc),
                "decode_step_s": med(o["decode_step_s"] for o in coloc),
            }
        }
        for mode in MODES:
            outs = raw["send_modes"][mode][length]
            for o in outs:
                o["recv_mib_per_s"] = (
                    o["bytes_received"] / (1 << 20) / o["recv_s"]
                    if o["recv_s"]
                    else None
                )
            row = {
                key: med(o[key] for o in outs)
                for key in (
                    "ttft_s",
                    "prefill_s",
                    "decode_ttft_s",
                    "decode_step_s",
                    "send_s",
                    "recv_s",
                    "bytes_received",
                    "blocks_received",
                    "recv_mib_per_s",
                )
            }
            alone = raw.get("prefill_alone", {}).get(mode, {}).get(length)
            row["alone_ttft_s"] = med(o["ttft_s"] for o in alone) if alone else None
            baseline = row["alone_ttft_s"] or rows["colocated"]["ttft_s"]
            row["exposed_s"] = row["ttft_s"] - baseline - row["decode_step_s"]
            # Best of the rounds: interference only ever adds time.
            row["best_ttft_s"] = min(o["ttft_s"] for o in outs)
            row["best_alone_s"] = min(o["ttft_s"] for o in alone) if alone else None
            row["best_exposed_s"] = (
                row["best_ttft_s"] - row["best_alone_s"] - row["decode_step_s"]
                if alone
                else None
            )
            row["hidden_share"] = hidden(row["exposed_s"], row["send_s"])
            row["ttft_vs_colocated"] = row["ttft_s"] / rows["colocated"]["ttft_s"]
            row["metrics_missing"] = sum(
                o["send_s"] is None or o["recv_s"] is None for o in outs
            )
            row["failed_loads"] = sum(o["failed_loads"] for o in outs)
            rows[mode] = row
        by_round: dict[int, dict[str, float]] = {}
        for mode in MODES:
            for o in raw["send_modes"][mode][length]:
                by_round.setdefault(o["round"], {})[mode] = o["ttft_s"]
        rounds = [t for t in by_round.values() if len(t) == len(MODES)]
        for mode in MODES:
            per_round = [t[mode] / t["PUT_ASYNC"] for t in rounds]
            rows[mode]["ttft_vs_put_async"] = (
                rows[mode]["ttft_s"] / rows["PUT_ASYNC"]["ttft_s"]
            )
            rows[mode]["ttft_vs_put_async_per_round"] = per_round
        orders = [" < ".join(sorted(MODES, key=t.get)) for t in rounds]
        rows["round_orders"] = {
            o: orders.count(o)
            for o in sorted(set(orders), key=orders.count, reverse=True)
        }
        rows["order_fastest_first"] = sorted(MODES, key=lambda m: rows[m]["ttft_s"])
        if all(rows[m]["best_exposed_s"] is not None for m in MODES):
            rows["order_best_exposed"] = sorted(
                MODES, key=lambda m: rows[m]["best_exposed_s"]
            )
        rows["put_wire_s"] = rows["PUT"]["send_s"]
        summary["send_modes"][length] = rows
    for label, _, _ in PREFIX_CONFIGS:
        outs = raw["prefix"][label]
        summary["prefix"][label] = {
            key: med(o[key] for o in outs)
            for key in (
                "ttft_s",
                "prefill_s",
                "decode_ttft_s",
                "recv_s",
                "send_s",
                "bytes_received",
                "blocks_received",
            )
        }
        summary["prefix"][label]["failed_loads"] = sum(o["failed_loads"] for o in outs)
    on, off = (summary["prefix"][label] for label, _, _ in PREFIX_CONFIGS[:2])
    summary["prefix_ratios"] = {
        "bytes_received_false_over_true": ratio(
            off["bytes_received"], on["bytes_received"]
        ),
        "ttft_false_over_true": ratio(off["ttft_s"], on["ttft_s"]),
        "decode_ttft_false_over_true": ratio(off["decode_ttft_s"], on["decode_ttft_s"]),
        "recv_false_over_true": ratio(off["recv_s"], on["recv_s"]),
    }
    # The prefix-aware runs of one round ran back to back: ratios per round.
    labels = [label for label, _, _ in PREFIX_CONFIGS[:2]]
    pairs = {}
    for label in labels:
        for o in raw["prefix"][label]:
            pairs.setdefault(o["round"], {})[label] = o
    for key in ("ttft_s", "decode_ttft_s"):
        summary["prefix_ratios"][f"{key[:-2]}_false_over_true_per_round"] = [
            p[labels[1]][key] / p[labels[0]][key] for p in pairs.values() if len(p) == 2
        ]
    return summary


def hidden(exposed: float | None, transfer: float | None) -> float | None:
    if exposed is None or not transfer:
        return None
    return min(1.0, max(0.0, 1.0 - exposed / transfer))


# --- output ------------------------------------------------------------------


def fmt(value, spec=".3f", scale=1.0) -> str:
    return report.fmt(value, spec, scale, missing="n/a")


def ms(value) -> str:
    return fmt(value, ".0f", 1000)


def markdown(result: dict) -> list[str]:
    s, meta = result["summary"], result["meta"]
    mib = 1 << 20
    send_rows = []
    for length, rows in s["send_modes"].items():
        c = rows["colocated"]
        send_rows.append(
            [
                length,
                "colocated",
                ms(c["ttft_s"]),
                "1.00",
                *[""] * 4,
                ms(c["decode_step_s"]),
                *[""] * 7,
            ]
        )
        for mode in MODES:
            m = rows[mode]
            send_rows.append(
                [
                    length,
                    mode,
                    ms(m["ttft_s"]),
                    fmt(m["ttft_vs_colocated"], ".2f"),
                    fmt(m["ttft_vs_put_async"], ".2f"),
                    ms(m.get("alone_ttft_s")),
                    ms(m["prefill_s"]),
                    ms(m["decode_ttft_s"]),
                    ms(m["decode_step_s"]),
                    ms(m["send_s"]),
                    ms(m["recv_s"]),
                    ms(m["exposed_s"]),
                    fmt(m["hidden_share"], ".0%", 1),
                    fmt(m["bytes_received"], ".1f", 1 / mib),
                    fmt(m["recv_mib_per_s"], ".0f", 1),
                    f"{m['failed_loads']:.0f}",
                ]
            )
    lines = [
        "# P2P KV transfer send modes on CPU (tiny Llama, 8 layers x 4 KV heads)",
        "",
        report.generated(
            f"{STEM}.py",
            f"{meta['rounds']} interleaved rounds; medians over rounds. Model: "
            f"{meta['model']}; **{meta['kv_bytes_per_token']} B of KV per token** "
            f"({meta['kv_bytes_per_token'] * 2000 / mib:.1f} MiB for a 2000-token "
            f"prompt). Servers: `{' '.join(meta['server_args'])}`, environment "
            f"`{' '.join(f'{k}={v}' for k, v in meta.get('server_env', {}).items())}`; "
            f"transport `{meta['transport']}`.",
            date=meta["date"],
            on=meta["machine"],
        ),
        "",
        "## Send modes: TTFT through the proxy flow",
        "",
        "TTFT = sending the prompt to prefill (`max_tokens=1`) .. decode's first "
        "streamed token (same `X-Request-Id`), the way the design document's proxy "
        "drives it. Colocated = one plain server (no connector) streaming the same "
        "kind of prompt. Every request has a fresh random prompt (no prefix-cache hit "
        "anywhere). Columns: alone = TTFT of a plain request (no peers, so no "
        "transfer) to that mode's own prefill server; prefill req = the prefill "
        "request's latency (PUT includes its blocking send); decode req = decode "
        "request sent .. its first token; decode step = decode's first .. second "
        "token; send / recv = the connector's per-transfer times (prefill worker: "
        "offer .. last byte sent; decode worker: first .. last byte received); recv "
        "MiB/s = bytes received / recv time.",
        "",
        *table(
            [
                "prompt",
                "config",
                "TTFT ms",
                "x colocated",
                "x PUT_ASYNC",
                "alone ms",
                "prefill req ms",
                "decode req ms",
                "decode step ms",
                "send ms",
                "recv ms",
                "exposed ms",
                "hidden",
                "MiB received",
                "recv MiB/s",
                "failed loads",
            ],
            send_rows,
        ),
        "",
        "Order by median TTFT, fastest first: "
        + "; ".join(
            f"{length} tokens: {' < '.join(rows['order_fastest_first'])}"
            for length, rows in s["send_modes"].items()
        )
        + ". Order within each round (rounds with that order): "
        + "; ".join(
            f"{length} tokens: "
            + ", ".join(f"{order} ({n})" for order, n in rows["round_orders"].items())
            for length, rows in s["send_modes"].items()
        )
        + ".",
        "",
        "Per-round TTFT ratio to PUT_ASYNC (the modes of one round ran back to back), "
        "median [min-max]: "
        + "; ".join(
            f"{length} tokens: "
            + ", ".join(
                f"{mode} {spread(rows[mode]['ttft_vs_put_async_per_round'])}"
                for mode in MODES[1:]
            )
            for length, rows in s["send_modes"].items()
        )
        + ".",
        "",
        f"Best of the {meta['rounds']} rounds: TTFT, and the best-case exposed time "
        "`best TTFT - best prefill alone (same server) - median decode step`.",
        "",
        *table(
            [
                "prompt",
                "best TTFT colocated",
                "PUT_ASYNC",
                "GET",
                "PUT",
                "best-case exposed PUT_ASYNC",
                "GET",
                "PUT",
            ],
            [
                [
                    length,
                    ms(rows["colocated"].get("best_ttft_s")),
                    *(ms(rows[m].get("best_ttft_s")) for m in MODES),
                    *(ms(rows[m].get("best_exposed_s")) for m in MODES),
                ]
                for length, rows in s["send_modes"].items()
            ],
        ),
        "",
        "### How the hidden share is computed",
        "",
        "From the medians of each prompt length:",
        "",
        "* `exposed = TTFT_disagg - TTFT_alone - decode_step`: TTFT_alone is the "
        "prefill alone on the mode's own prefill server (one forward over the prompt "
        "plus one HTTP round trip, no transfer; measured on the same server because "
        "identically configured servers can differ by more than the transfer); "
        "decode_step is the interval between decode's first and second streamed token "
        "(one forward of one token over the prompt's context), standing for the "
        "decode's own first step after the KV arrived. What is left is the transfer's "
        "part of TTFT, plus the second HTTP request and the decode scheduler's wait "
        "for the load (so `exposed` is an upper bound of the transfer's cost, and the "
        "hidden share a lower bound).",
        "* `hidden = clamp(1 - exposed / transfer, 0, 1)` with `transfer` the prefill "
        "worker's send time (`vllm:p2p_send_seconds` sum/count delta around each "
        "request: offer .. last byte sent). In PUT_ASYNC the offer is made when the "
        "prompt's forward pass starts, so this window contains the forward pass it "
        "streams behind; in PUT and GET it is the bare transfer (after the forward "
        "pass, resp. after decode's `Get`). A negative exposed time (the disaggregated "
        "TTFT below the prefill alone) clamps to 100 %.",
        "",
        "## Prefix-aware transfer",
        "",
        f"Prompts: a {SHARED_PREFIX}-token shared prefix + {DISTINCT_TAIL} distinct "
        f"tokens ({(SHARED_PREFIX + DISTINCT_TAIL) // BLOCK_SIZE} blocks of "
        f"{BLOCK_SIZE}); the prefix was put into each decode's prefix cache by a plain "
        "request before timing (the prefill's cache holds it too). Same prefill "
        "instance for the two GET decodes. With PUT_ASYNC (and PUT) the prefill offers "
        "the KV before decode has seen the request, so decode cannot yet say which "
        "blocks it holds and takes all of them.",
        "",
        *table(
            [
                "config",
                "TTFT ms",
                "decode req ms",
                "recv ms",
                "blocks received",
                "MiB received",
                "failed loads",
            ],
            [
                [
                    label,
                    ms(row["ttft_s"]),
                    ms(row["decode_ttft_s"]),
                    ms(row["recv_s"]),
                    fmt(row["blocks_received"], ".0f", 1),
                    fmt(row["bytes_received"], ".2f", 1 / mib),
                    f"{row['failed_loads']:.0f}",
                ]
                for label, row in s["prefix"].items()
            ],
        ),
    ]
    pr = s["prefix_ratios"]
    lines += [
        "",
        "GET, skip_cached_blocks false / true: bytes received "
        f"x{fmt(pr['bytes_received_false_over_true'], '.1f', 1)}, receive time "
        f"x{fmt(pr['recv_false_over_true'], '.0f', 1)}, decode request (sent .. first "
        f"token) x{fmt(pr['decode_ttft_false_over_true'], '.2f', 1)} of the medians, "
        f"{spread(pr.get('decode_ttft_false_over_true_per_round', []))} per round "
        "(median [min-max]); whole proxy flow TTFT "
        f"x{fmt(pr['ttft_false_over_true'], '.2f', 1)} of the medians, "
        f"{spread(pr.get('ttft_false_over_true_per_round', []))} per round.",
        "",
        "## Checks and run",
        "",
        *checks(result),
    ]
    return lines


def checks(result: dict) -> list[str]:
    """What the run checked and what it cost, as figures."""
    meta = result["meta"]
    bad = [
        k
        for k, v in result["warm_up_checks"].items()
        if not v["same_tokens_as_colocated"]
    ]
    trouble = {
        f"{name}: {key.removeprefix('vllm:p2p_').removesuffix('_total')} {value:.0f}"
        for name, totals in result["metric_totals_at_end"].items()
        for key, value in totals.items()
        if value and any(w in key for w in ("failed", "dropped", "spills"))
    }
    return [
        "* Warm-up check (decode's two greedy tokens equal the colocated server's for "
        "the same prompt, every mode and length): "
        + ("all equal." if not bad else f"DIFFERENT for {', '.join(bad)}."),
        "* Connector errors during the run (failed loads or sends, dropped, spills): "
        + ("; ".join(sorted(trouble)) if trouble else "none")
        + ".",
        "* Load average at the end of the run: "
        + ", ".join(f"{x:.1f}" for x in meta["load_average_at_end"])
        + ".",
        f"* Run time: start-up {meta['startup_s']:.0f} s (all servers at once), "
        f"warm-up {meta['warm_up_s']:.0f} s, measurement {meta['measure_s']:.0f} s, "
        f"total {meta['total_s']:.0f} s.",
    ]


def plot(result: dict, path: Path) -> None:
    plt = report.pyplot()
    s = result["summary"]
    lengths = list(s["send_modes"])
    colors = {
        "colocated": "#999999",
        "PUT_ASYNC": "#2a7ab9",
        "GET": "#e08a2c",
        "PUT": "#c23b3b",
    }
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    ax = axes[0]
    width = 0.2
    for j, config in enumerate(CONFIGS):
        values = [s["send_modes"][n][config]["ttft_s"] * 1000 for n in lengths]
        xs = [i + (j - 1.5) * width for i in range(len(lengths))]
        ax.bar(xs, values, width, label=config, color=colors[config])
        for x, v in zip(xs, values):
            ax.annotate(f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_ylabel("TTFT through the proxy flow (ms, median)")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.08)
    ax.set_title("TTFT by send mode", fontsize=10)
    ax.legend(fontsize=8)

    ax = axes[1]
    width = 0.25
    for j, mode in enumerate(MODES):
        xs = [i + (j - 1) * width for i in range(len(lengths))]
        values = [(s["send_modes"][n][mode]["exposed_s"] or 0) * 1000 for n in lengths]
        ax.bar(xs, values, width, label=f"{mode} (median)", color=colors[mode])
        best = [s["send_modes"][n][mode].get("best_exposed_s") for n in lengths]
        ax.plot(
            [x for x, b in zip(xs, best) if b is not None],
            [b * 1000 for b in best if b is not None],
            "kv",
            markersize=5,
            label="best case" if j == 0 else None,
        )
    wire = [(s["send_modes"][n]["put_wire_s"] or 0) * 1000 for n in lengths]
    ax.plot(
        range(len(lengths)),
        wire,
        "k_",
        markersize=30,
        mew=2,
        label="PUT send (bare wire)",
    )
    ax.axhline(0, color="#999999", linewidth=0.8)
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_ylabel("ms")
    ax.set_title("exposed = TTFT - prefill alone - decode step", fontsize=10)
    ax.legend(fontsize=8)

    ax = axes[2]
    labels = list(s["prefix"])
    short = [
        k.replace("skip_cached_blocks", "skip").replace(", ", "\n") for k in labels
    ]
    mib = [(s["prefix"][k]["bytes_received"] or 0) / (1 << 20) for k in labels]
    dec = [(s["prefix"][k]["decode_ttft_s"] or 0) * 1000 for k in labels]
    xs = list(range(len(labels)))
    ax.bar([x - 0.2 for x in xs], mib, 0.4, color="#2a7ab9", label="MiB received")
    ax2 = ax.twinx()
    ax2.bar([x + 0.2 for x in xs], dec, 0.4, color="#999999", label="decode request ms")
    ax.set_xticks(xs, short, fontsize=8)
    ax.set_ylabel("MiB received per request (median)")
    ax2.set_ylabel("decode request ms (median)")
    ax.set_title(
        f"shared {SHARED_PREFIX}-token prefix + {DISTINCT_TAIL} new", fontsize=10
    )
    for x, v in zip(xs, mib):
        ax.annotate(f"{v:.1f}", (x - 0.2, v), ha="center", va="bottom", fontsize=8)
    for x, v in zip(xs, dec):
        ax2.annotate(f"{v:.0f}", (x + 0.2, v), ha="center", va="bottom", fontsize=8)
    handles = ax.get_legend_handles_labels()
    handles2 = ax2.get_legend_handles_labels()
    ax.legend(
        handles[0] + handles2[0], handles[1] + handles2[1], fontsize=8, loc="upper left"
    )
    fig.suptitle("P2P connector on CPU: send modes and prefix-aware transfer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- main --------------------------------------------------------------------


def transport_of(server: VllmServer) -> str:
    for line in server.log_text().splitlines():
        if "P2P engine listening on" in line and "transport" in line:
            return line.split("transport ", 1)[1].split(",", 1)[0]
    return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=MAX_MODEL_LEN,
        help="default: the whole prompt in one forward pass",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="CPU torch.compile (default --enforce-eager: 8 servers compiling "
        "at once on 2 cores take over 10 minutes to start)",
    )
    parser.add_argument(
        "--omp-bind",
        default="nobind",
        help="VLLM_CPU_OMP_THREADS_BIND of every server (nobind: one OpenMP "
        "thread each, placed by the OS; or e.g. 0: all on core 0; auto)",
    )
    parser.add_argument("--startup-timeout-s", type=float, default=900.0)
    parser.add_argument("--quick", action="store_true", help="2 rounds (smoke run)")
    parser.add_argument("--seed", type=int, default=20261122)
    parser.add_argument(
        "--render",
        metavar="JSON",
        help="no run: summarize the raw numbers of a result file again and "
        "write its md and png next to it (or in --out)",
    )
    report.add_out_argument(parser)
    args = parser.parse_args()
    require("matplotlib", "psutil")  # before any server starts
    if args.render:
        return render(Path(args.render), args.out or Path(args.render).parent)
    if args.quick:
        args.rounds = 2
    args.lengths = tuple(args.lengths)
    assert (
        max(args.lengths) + 2 <= MAX_MODEL_LEN
        and SHARED_PREFIX + DISTINCT_TAIL < MAX_MODEL_LEN
    )
    args.out = args.out or report.RESULTS
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-p2p-modes-") as tmp:
        model = build_model("tiny-llama", Path(tmp) / "models", **MODEL_DIMS)
        servers = make_servers(model, args)
        with contextlib.ExitStack() as stack:
            for server in servers.values():  # all at once: start-up is mostly waiting
                stack.callback(base(server).stop)
                base(server).launch()
            for name, server in servers.items():
                base(server).wait_ready()
            startup_s = time.monotonic() - began
            print(f"{len(servers)} servers ready after {startup_s:.0f}s", flush=True)
            affinity = thread_affinity(base(servers["p_PUT_ASYNC"]))
            transport = transport_of(base(servers["p_PUT_ASYNC"]))
            prompts = Prompts(args.seed)
            t = time.monotonic()
            checks = warm_up(servers, prompts, args.lengths)
            warm_s = time.monotonic() - t
            print(f"warm-up done in {warm_s:.0f}s: {json.dumps(checks)}", flush=True)
            t = time.monotonic()
            raw = measure(servers, prompts, args)
            measure_s = time.monotonic() - t
            totals = {
                name: snapshot(server)
                for name, server in servers.items()
                if isinstance(server, P2pInstance)
            }
    summary = summarize(raw, args)
    result = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine(),
            "load_average_at_end": os.getloadavg(),
            "model": f"tiny-llama {MODEL_DIMS}, head_dim {HEAD_DIM}, {DTYPE}",
            "kv_bytes_per_token": kv_bytes_per_token(),
            "server_args": server_args(args),
            "server_env": omp_env(args),
            "transport": transport,
            "rounds": args.rounds,
            "lengths": list(args.lengths),
            "shared_prefix": SHARED_PREFIX,
            "distinct_tail": DISTINCT_TAIL,
            "startup_s": startup_s,
            "warm_up_s": warm_s,
            "measure_s": measure_s,
            "total_s": time.monotonic() - began,
            "worker_thread_affinity_p_PUT_ASYNC": affinity,
        },
        "warm_up_checks": checks,
        "summary": summary,
        "metric_totals_at_end": totals,
        "raw": raw,
    }
    write_outputs(result, args.out / (f"{STEM}-quick" if args.quick else STEM))
    return 0


def write_outputs(result: dict, stem: Path) -> None:
    report.write(stem, result, markdown(result), lambda png: plot(result, png))


def render(path: Path, out: Path) -> int:
    result = json.loads(path.read_text())
    for generated_prose in ("discussion", "caveats"):  # written by earlier versions
        result.pop(generated_prose, None)
    meta = result["meta"]
    args = argparse.Namespace(lengths=tuple(meta["lengths"]), rounds=meta["rounds"])
    result["summary"] = summarize(result["raw"], args)
    write_outputs(result, out / path.stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
