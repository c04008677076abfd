r"""What the fleet survives: a steady soak and one fault per scenario, under traffic.

Each scenario starts its own fleet on loopback (the router, 2 prefill
instances and a DP=2 decode instance of the tiny MoE, float32, every
instance registered with the router, P2P over tcp; plus a colocated
reference server, stopped once the reference outputs are taken), sends a
warm-up pass, then ``--requests`` requests of a deterministic mix
(completions and chats, streamed or not, some cancelled by the client,
shared prefixes, lists of 2 prompts, n=2 seeded; concurrency 8), injects its
fault, does what an operator would (restart, resume), stops everything it
started, and writes benchmarks/results/chaos/<scenario>.{json,md,png}.
The logic lives in vllm_disagg/testing/{fleet,traffic,chaos}.py, which
tests/chaos/test_chaos.py runs in a bounded version on every commit.

Scenarios: steady, hostile, stop-peer, kill-prefill, kill-router, kill-decode-rank,
kill-decode (see vllm_disagg/testing/chaos.py). ``all`` runs each in turn.

    flock /tmp/vllm-e2e.lock timeout 3600 \
        .venv/bin/python benchmarks/chaos.py all --requests 300

``--render DIR`` rewrites the md, png and summary.md from the JSON files.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _deps import (
    machine,
    require,
)  # benchmarks/_deps.py: sys.path[0] when run as a script

from vllm_disagg.testing.chaos import SCENARIOS, Options, run_scenario, warm_up
from vllm_disagg.testing.fleet import Fleet, FleetConfig
from vllm_disagg.testing.tiny_models import build_all
from vllm_disagg.testing.traffic import compute_references, make_specs

RESULTS = Path(__file__).parent / "results" / "chaos"
LOGS = Path(__file__).parent / "results" / "logs" / "chaos"  # ignored by git
SEED = 20261125

# What each fault costs, said once for the tables.
FAULT_WORDS = {
    "steady": "no fault",
    "hostile": (
        "strangers flood every port with {hostile_per_port} hostile messages each"
    ),
    "stop-peer": "SIGSTOP prefill p1 for {stop_s:.0f} s, then SIGCONT",
    "kill-prefill": (
        "kill -9 prefill p1 (process group), restarted {restart_after_s:.0f} s later"
    ),
    "kill-router": (
        "kill -9 the router, restarted on the same ports {router_restart_delay_s:.0f} "
        "s later"
    ),
    "kill-decode-rank": (
        "kill -9 the engine core of decode DP rank 1; the decode restarted "
        "{restart_after_s:.0f} s later"
    ),
    "kill-decode": "kill -9 both DP ranks of the decode (every process), restarted "
    "{restart_after_s:.0f} s later",
}


def run_one(
    name: str, args: argparse.Namespace, models: dict, out: Path
) -> dict[str, Any]:
    log_dir = LOGS / name
    if log_dir.exists():
        for old in log_dir.glob("*.log"):
            old.unlink()
    config = FleetConfig(
        model=str(models["tiny-mixtral"]),
        log_dir=log_dir,
        vllm_omp_defaults=args.vllm_omp_defaults,
    )
    if args.prefill_timeout_s is not None:
        router_args = list(config.router_args)
        router_args[router_args.index("--prefill-timeout-s") + 1] = str(
            args.prefill_timeout_s
        )
        config.router_args = tuple(router_args)
    opts = Options(
        requests=args.requests,
        duration_s=args.duration_s,
        concurrency=args.concurrency,
        fault_after=args.fault_after,
        hostile_per_port=args.hostile_per_port,
    )
    print(f"[{name}] starting the fleet", flush=True)
    with Fleet(config) as fleet:
        print(f"[{name}] fleet up in {fleet.startup_s:.0f}s", flush=True)
        model = fleet.model
        warm_specs, mix = make_specs(SEED, model, count=args.warmup, start=10_000_000)
        specs, mix2 = make_specs(SEED, model)
        mix.references.update(mix2.references)
        ref_server = fleet.members["ref"].server
        references = compute_references(ref_server.url, mix)
        ref_server.stop()  # its cores are the fleet's now
        warm = warm_up(fleet, list(warm_specs), references)
        warm_bad = [r.as_dict() for r in warm if r.outcome in ("failed", "wrong")]
        print(
            f"[{name}] {len(references)} references, warm-up {len(warm)} requests, "
            f"{len(warm_bad)} bad",
            flush=True,
        )
        started = time.monotonic()
        result = run_scenario(name, fleet, specs, references, opts)
        result["wall_s"] = round(time.monotonic() - started, 1)
        result["startup_s"] = round(fleet.startup_s, 1)
        result["warmup"] = {"requests": len(warm), "bad": warm_bad}
    result["machine"] = machine()
    result["date"] = time.strftime("%Y-%m-%d %H:%M")
    result["fault_words"] = FAULT_WORDS[name].format(**vars(opts))
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    render(result, out)
    r = result["requests"]
    print(
        f"[{name}] {r['issued']} requests: ok {r['ok']}, failed {r['failed']}, "
        f"wrong {r['wrong']}, cancelled {r['cancelled']}, hangs {r['hangs']}; "
        f"recovery {result.get('recovery')}",
        flush=True,
    )
    return result


# --- rendering -------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def _growth_figures(result: dict[str, Any]) -> dict[str, Any]:
    rows = result["growth"]
    if not rows:
        return {
            "max_rss_pct": None,
            "late_rss_pct": None,
            "threads": 0,
            "fds": 0,
            "procs": 0,
        }
    worst = max(rows, key=lambda r: r["rss_change_pct"])
    late = result.get("growth_second_half") or []
    return {
        "max_rss_pct": worst["rss_change_pct"],
        "late_rss_pct": max((r["rss_change_pct"] for r in late), default=None),
        "max_rss_proc": f"{worst['member']} {worst['name']}",
        "threads": sum(r["threads_after"] - r["threads_before"] for r in rows),
        "fds": sum(r["fds_after"] - r["fds_before"] for r in rows),
        "procs": len(rows),
    }


def scenario_row(result: dict[str, Any]) -> dict[str, Any]:
    r, rec, fault = result["requests"], result.get("recovery") or {}, result["fault"]
    g = _growth_figures(result)
    return {
        "scenario": result["scenario"],
        "requests": r["issued"],
        "ok": r["ok"],
        "failed": r["failed"],
        "wrong": r["wrong"],
        "cancelled": r["cancelled"],
        "hangs": r["hangs"],
        "p50": r["latency_s"]["p50"],
        "p99": r["latency_s"]["p99"],
        "max": r["latency_s"]["max"],
        "retried": result["router"]["prefill_retries"]
        + result["router"]["decode_retries"],
        "recomputed": result["decode"]["failed_loads"],
        "recovered_s": rec.get("recovered_s"),
        "errors_until_s": rec.get("errors_until_s"),
        "removed_s": fault.get("removed_after_s"),
        "quiet": result["quiet"],
        "rss_pct": g["max_rss_pct"],
        "late_rss_pct": g["late_rss_pct"],
        "threads": g["threads"],
        "fds": g["fds"],
    }


def _hostile_lines(result: dict[str, Any]) -> list[str]:
    """The hostile scenario's table: per port, what was sent and what was counted."""
    fault = result["fault"]
    if "ports" not in fault:
        return []
    lines = [
        f"Hostile input: {fault['messages_sent']} messages or connections on "
        f"{len(fault['ports'])} ports at once; processes gone: "
        f"{fault['processes_gone'] or 'none'}.",
        "",
        "| port | kind | sent | by kind | seconds | counted by |",
        "|---|---|---|---|---|---|",
    ]
    for port in fault["ports"]:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(port["by_kind"].items()) if v)
        lines.append(
            f"| {port['target']} | {port['kind']} | {port['sent']} | {kinds} | "
            f"{port['seconds']} | {port['counted_by']} |"
        )
    lines += [
        "",
        "Rejections counted on /metrics (bounds: what reached the application; libzmq "
        "drops a frame over the socket's size limit before it does, and a client that "
        "abandons a truncated request is not refused):",
        "",
        "| counted by | counted | at least | at most |",
        "|---|---|---|---|",
    ]
    for name, c in fault["counted"].items():
        lines.append(
            f"| {name} | {c['counted']:.0f} | {c['at_least']} | {c['at_most']} |"
        )
    return [*lines, ""]


def render(result: dict[str, Any], out: Path) -> None:
    name = result["scenario"]
    row = scenario_row(result)
    r = result["requests"]
    lines = [
        f"# Chaos: {name}",
        "",
        f"Generated by `benchmarks/chaos.py {name}` on {result['date']} "
        f"({result['machine']}).",
        f"Fault: {result['fault_words']}. Fleet: router, {result['fleet']['prefills']} "
        f"prefills, a DP={result['fleet']['decode_dp']} decode (tiny MoE, float32, P2P "
        f"tcp, PUT_ASYNC); fleet start {result['startup_s']} s, scenario "
        f"{result['wall_s']} s.",
        "",
        "| requests | ok | failed | wrong | cancelled | hangs | p50 s | p99 s | max s "
        "| retried | recomputed | recovered s | errors until s | quiet after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {row['requests']} | {row['ok']} | {row['failed']} | {row['wrong']} | "
        f"{row['cancelled']} | {row['hangs']} | {row['p50']} | {row['p99']} | "
        f"{row['max']} | {row['retried']:.0f} | {row['recomputed']:.0f} | "
        f"{row['recovered_s']} | {row['errors_until_s']} | "
        f"{'yes' if result['quiet'] else 'NO'} |",
        "",
        *_hostile_lines(result),
        "Fault timings (seconds; `*_at` from the start of the scenario's traffic):",
        "",
        "```json",
        json.dumps(
            {k: v for k, v in result["fault"].items() if k not in ("ports", "counted")},
            indent=1,
        ),
        "```",
        "",
        f"Router: {json.dumps(result['router'])}",
        "",
        f"Decode: {json.dumps(result['decode'])}; prefill: "
        f"{json.dumps(result['prefill'])}",
        "",
        f"By request shape: {json.dumps(r['by_shape'])}",
        "",
        f"Load after: {json.dumps(result['load_after'])}",
        "",
        "## Processes before and after (same pid)",
        "",
        "| member | process | RSS MiB before | after | change % | threads | fds |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in result["growth"]:
        lines.append(
            f"| {g['member']} | {g['name']} | {_mib(g['rss_before'])} | "
            f"{_mib(g['rss_after'])} | {g['rss_change_pct']:+.2f} | "
            f"{g['threads_before']} -> {g['threads_after']} | {g['fds_before']} -> "
            f"{g['fds_after']} |"
        )
    late = result.get("growth_second_half") or []
    if late:
        lines += [
            "",
            "RSS change over the second half of the traffic (a leak grows as much "
            "there as in the first half):",
            "",
            "| process | RSS MiB at the middle | at the end | change % |",
            "|---|---|---|---|",
        ]
        for g in late:
            lines.append(
                f"| {g['process']} | {_mib(g['rss_middle'])} | {_mib(g['rss_end'])} | "
                f"{g['rss_change_pct']:+.2f} |"
            )
    flushes = result.get("gauge_flushes") or []
    if flushes:
        lines += [
            "",
            "P2P gauges read while idle that needed a step to be fresh: "
            f"{len(flushes)} (see Fleet.wait_quiet); first readings: "
            + "; ".join(
                f"{f['member']} at {f['t']} s: buffer "
                f"{f['before'].get('p2p_buffer_bytes')} pool "
                f"{f['before'].get('p2p_pool_bytes')}"
                for f in flushes[:4]
            ),
        ]
    failed = [x for x in result["records"] if x["outcome"] in ("failed", "wrong")]
    if failed:
        lines += ["", f"## Failed and wrong requests ({len(failed)}; first 15)", ""]
        for x in failed[:15]:
            lines.append(
                f"* #{x['index']} {x['shape']} at {x['start']:.1f}-{x['end']:.1f} s: "
                f"{x['outcome']}, {x['detail'][:200]}"
            )
    lines.append("")
    (out / f"{name}.md").write_text("\n".join(lines))
    plot(result, out / f"{name}.png")
    write_summary(out)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = result["records"]
    fig, (ax1, ax2, ax3) = plt.subplots(
        3, 1, figsize=(10, 9), sharex=True, gridspec_kw={"height_ratios": [3, 1.3, 1.3]}
    )
    colors = {
        "ok": "tab:green",
        "cancelled": "tab:gray",
        "failed": "tab:red",
        "wrong": "tab:purple",
    }
    for outcome, color in colors.items():
        xs = [x["start"] for x in records if x["outcome"] == outcome]
        ys = [x["end"] - x["start"] for x in records if x["outcome"] == outcome]
        if xs:
            ax1.scatter(xs, ys, s=8, c=color, label=f"{outcome} ({len(xs)})", alpha=0.7)
    ax1.set_ylabel("latency (s), at request start")
    ax1.set_yscale("log")
    ax1.legend(loc="upper left", fontsize=8)
    ax1.set_title(f"chaos: {result['scenario']} ({result['fault_words']})", fontsize=10)
    end = max((x["end"] for x in records), default=1.0)
    bins = list(range(0, int(end) + 2))
    for outcome, color in (
        ("ok", "tab:green"),
        ("failed", "tab:red"),
        ("wrong", "tab:purple"),
    ):
        ends = [x["end"] for x in records if x["outcome"] == outcome]
        if ends:
            ax2.hist(ends, bins=bins, color=color, alpha=0.6, label=f"{outcome} / s")
    ax2.set_ylabel("answers per s")
    ax2.legend(loc="upper left", fontsize=8)
    members = sorted({m for p in result["series"] for m in p["members"]})
    for m in members:
        pts = [
            (p["t"], p["members"][m]["rss"] / 2**20)
            for p in result["series"]
            if m in p["members"]
        ]
        if pts:  # a restart starts a new process tree: its line jumps
            ax3.plot(
                [t for t, _ in pts], [v - pts[0][1] for _, v in pts], label=m, lw=1
            )
    ax3.set_ylabel("RSS change, MiB\n(process tree)")
    ax3.set_xlabel("seconds since the scenario's traffic started")
    ax3.legend(loc="upper left", fontsize=7, ncol=len(members))
    for ax in (ax1, ax2, ax3):
        for t, what in result["events"]:
            ax.axvline(t, color="black", ls="--", lw=0.8)
            if ax is ax1:
                ax.annotate(
                    what,
                    (t, 1.0),
                    xycoords=("data", "axes fraction"),
                    rotation=90,
                    va="top",
                    ha="right",
                    fontsize=7,
                )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_summary(out: Path) -> None:
    results = []
    for name in SCENARIOS:
        path = out / f"{name}.json"
        if path.exists():
            results.append(json.loads(path.read_text()))
    lines = [
        "# Chaos and soak: what the fleet survives",
        "",
        "One fleet per scenario, started by `benchmarks/chaos.py`: the router, 2",
        "prefills and a DP=2 decode of the tiny MoE (float32, P2P over tcp,",
        "PUT_ASYNC), on one 2-core machine. `failed`: an error answer, a broken stream",
        "or no answer; `wrong`: greedy token ids that differ from the colocated run;",
        "`hangs`: no answer within the client's 120 s. `retried`: the router's prefill",
        "and decode retries; `recomputed`: decode KV loads that failed and were",
        "recomputed; `recovered s`: from the fault to the first request after which",
        "every request succeeded; `removed s`: until the router stopped listing what",
        "the fault took. RSS %: the largest change of one process from after the",
        "warm-up to the end; RSS % 2nd half: the largest change of one process over",
        "the second half of the traffic; threads and fds: summed change over the",
        "processes alive before and after. The fault scenarios warm up with 40",
        "requests, steady with 200: prefill workers fill oneDNN's primitive cache over",
        "their first few thousand prefills (a plain `vllm serve` does the same), which",
        "is most of their RSS change (docs/operations.md, Steady state).",
        "",
        "| scenario | fault | requests | ok | failed | wrong | cancelled | hangs "
        "| p50 s | max s | retried | recomputed | recovered s | removed s | quiet "
        "| RSS % | RSS % 2nd half | threads | fds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        row = scenario_row(result)
        lines.append(
            f"| [{row['scenario']}]({row['scenario']}.md) | {result['fault_words']} | "
            f"{row['requests']} | {row['ok']} | {row['failed']} | {row['wrong']} | "
            f"{row['cancelled']} | {row['hangs']} | {row['p50']} | {row['max']} | "
            f"{row['retried']:.0f} | {row['recomputed']:.0f} | {row['recovered_s']} | "
            f"{row['removed_s']} | {'yes' if row['quiet'] else 'NO'} | "
            f"{row['rss_pct']} | {row['late_rss_pct']} | {row['threads']:+d} | "
            f"{row['fds']:+d} |"
        )
    lines.append("")
    (out / "summary.md").write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "scenarios",
        nargs="*",
        default=["all"],
        help=f"one or more of {', '.join(SCENARIOS)}, or all",
    )
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument(
        "--duration-s",
        type=float,
        default=600.0,
        help="no request is sent after this many seconds of a scenario",
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--fault-after", type=int, default=80, help="requests answered before the fault"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=40,
        help="requests sent before the scenario's 'before' snapshot",
    )
    parser.add_argument(
        "--hostile-per-port",
        type=int,
        default=10_000,
        help="hostile: messages (ZMQ) or connections (TCP) per port",
    )
    parser.add_argument(
        "--prefill-timeout-s",
        type=float,
        default=None,
        help="the router's --prefill-timeout-s (default: the fleet's 10 s; "
        "the router's own default is 300 s)",
    )
    parser.add_argument(
        "--vllm-omp-defaults",
        action="store_true",
        help="start every server with vLLM's own OpenMP defaults (a pinned team "
        "per worker) instead of one unpinned thread each",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--render",
        action="store_true",
        help="only rewrite md, png and summary.md from the JSON files in --out",
    )
    args = parser.parse_args()
    require("matplotlib", "psutil", "aiohttp")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render:
        for name in SCENARIOS:
            path = args.out / f"{name}.json"
            if path.exists():
                render(json.loads(path.read_text()), args.out)
        return 0
    names = list(SCENARIOS) if args.scenarios in (["all"], []) else args.scenarios
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(
            f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)} or all"
        )
    with tempfile.TemporaryDirectory(prefix="chaos-models-") as tmp:
        models = build_all(Path(tmp))
        bad = 0
        for name in names:
            result = run_one(name, args, models, args.out)
            r = result["requests"]
            bad += r["wrong"] + r["hangs"] + (0 if result["quiet"] else 1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
