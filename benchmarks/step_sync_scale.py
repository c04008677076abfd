"""Step sync at DP=2..256 against upstream's waves: a scale model with one process per
rank.

The real Coordinator (a thread of rank 0's process, as in the engine) and the real
Participant in every rank; simulated passes (a sleep, then a barrier standing in for
the MoE collective); an injected one-way delay on every step-sync message (a relay
thread in each rank's process), and the same delay on every hop of the waves model
(its all-reduce and its start-wave messages). benchmarks/common/stepsim.py has the
processes. Per point: group passes/s against the ideal (1 / pass time) and against
the harness alone (``none``: the same processes and barrier, no coordination), the
wait for a grant per pass, the coordinator's CPU and messages, rank 0's own time per
pass against the other ranks', idle-wake latency and wasted passes per drain.

Writes benchmarks/results/step_sync_scale.{json,md,png} (``--out DIR``: elsewhere).
Run it alone on the machine (``flock /tmp/heavy.lock``); ``--quick`` is the CI smoke
preset (two tiny groups, seconds).

    .venv/bin/python benchmarks/step_sync_scale.py [--quick] [--points dp|delay]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import re
import secrets
import socket
import statistics
import sys
import time
from pathlib import Path

from _deps import missing_modules, require  # benchmarks/: sys.path[0] as a script
from common import report, stepsim
from common.procs import uptime
from common.stats import pct

MODELS = ("step_sync", "waves", "none")
CORES = os.cpu_count() or 1
# Above this share of the machine's cores the figures measure the machine, not the
# protocol: such points are flagged, not presented as the protocol's.
BUSY_SHARE = 0.8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def threads_cpu_s(pids: list[int]) -> dict[str, float]:
    """CPU seconds of every thread of ``pids``, summed by thread name (digits dropped:
    one entry for all ranks' participant threads)."""
    out: dict[str, float] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            name = text[text.index("(") + 1 : text.rindex(")")]
            if tid == str(pid):
                name = "main"
            kind = re.sub(r"[0-9]+", "", name).rstrip("/-_ ") or name
            out[kind] = out.get(kind, 0.0) + stepsim.stat_cpu_s(text)
    return out


def run(sc: stepsim.Scenario, timeout_s: float = 240.0) -> dict:
    """One group of ``sc.dp`` rank processes through the steady phase and the wake
    trials; the records of every rank."""
    # Imported here, once: the forked ranks inherit it (256 imports of vLLM would
    # take minutes of the machine's CPU).
    from vllm_disagg.v1.engine import step_sync  # noqa: F401

    ctx = mp.get_context("fork")
    ports = {
        "pull": f"tcp://127.0.0.1:{free_port()}",
        "pub": f"tcp://127.0.0.1:{free_port()}",
        "coordinator": f"tcp://127.0.0.1:{free_port()}",
        "secret": secrets.token_hex(32),
    }
    deadline = time.monotonic() + timeout_s
    gc.freeze()  # the forked ranks share the parent's objects without copying them
    hub = ctx.Process(target=stepsim.hub_main, args=(sc, ports["pull"], ports["pub"]))
    hub.start()
    procs, conns = [], []
    for rank in range(sc.dp):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=stepsim.rank_main, args=(sc, rank, ports, child))
        proc.start()
        procs.append(proc)
        conns.append(parent)
    push = stepsim.control_socket(ports["pull"])

    def gather(expect: bytes | None) -> list:
        out = []
        for conn in conns:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{sc}: a rank did not answer in time")
            data = conn.recv_bytes()
            if data.startswith(b"{") and b'"error"' in data[:40]:
                raise RuntimeError(f"{sc}: {data.decode()}")
            out.append(data if expect is None else data == expect)
        return out

    try:
        gather(b"ready")
        pids = [p.pid for p in procs] + [hub.pid]
        pids += children(procs[0].pid)  # the coordinator's process, if any
        cpu0, t0 = sum(map(stepsim.process_cpu_s, pids)), time.monotonic()
        threads0 = threads_cpu_s(pids)
        push.send(b"C load %d" % sc.load_passes)
        # The steady phase: every rank has work for load_passes passes.
        busy_s = sc.load_passes * sc.pass_s * 1.02 + 0.2
        time.sleep(busy_s)
        load = os.getloadavg()[0]
        cpu_used = sum(map(stepsim.process_cpu_s, pids)) - cpu0
        threads1 = threads_cpu_s(pids)
        wall = time.monotonic() - t0
        settle = (sc.lookahead + sc.sync_interval + 4) * sc.pass_s + 8 * sc.delay_s
        time.sleep(max(0.5, settle))
        rng = __import__("random").Random(sc.dp)
        for _ in range(sc.wakes):
            target = rng.randrange(sc.dp)
            push.send(b"C work %d %d" % (target, sc.drain_passes))
            time.sleep((sc.drain_passes * sc.pass_s + settle) * 1.5 + 0.3)
        push.send(b"C report")
        records = [json.loads(b) for b in gather(None)]
        push.send(b"C exit")
    finally:
        for proc in procs:
            proc.join(max(0.1, min(5.0, deadline - time.monotonic())))
            if proc.is_alive():
                proc.kill()
        hub.join(5)
        if hub.is_alive():
            hub.kill()
        push.close()
        gc.unfreeze()
    by_thread = {
        name: (cpu - threads0.get(name, 0.0)) / wall
        for name, cpu in threads1.items()
        if cpu - threads0.get(name, 0.0) > 0
    }
    return {
        "records": records,
        "cores_used": cpu_used / wall,
        "cores_by_thread": by_thread,
        "loadavg_1m": load,
    }


def analyse(sc: stepsim.Scenario, raw: dict) -> dict:
    records = sorted(raw["records"], key=lambda r: r["rank"])
    skip = max(2, sc.load_passes // 10)  # warm-up passes
    rates, waits, own = [], [], {}
    for rec in records:
        load = [p for p in rec["passes"] if p[3] >= rec["snaps"][0]["t"]]
        load = [p for p in load if p[4]][: sc.load_passes]
        ends = [p[3] for p in load]
        if len(ends) > skip + 1:
            rates.append((len(ends) - 1 - skip) / (ends[-1] - ends[skip]))
        waits += [p[5] for p in load[skip:]]
        own[rec["rank"]] = statistics.fmean(
            b[2] - a[3] for a, b in zip(load[skip:], load[skip + 1 :])
        )
    rate = statistics.median(rates)
    out = {
        "scenario": json.loads(sc.key()),
        "passes_per_s": rate,
        "ideal_passes_per_s": 1 / sc.pass_s,
        "of_ideal": rate * sc.pass_s,
        "sync_wait_ms": {"p50": 1000 * pct(waits, 50), "p99": 1000 * pct(waits, 99)},
        "rank0_own_ms": 1000 * own[0],
        "others_own_ms": 1000 * statistics.median(v for r, v in own.items() if r),
        "cores_used": raw["cores_used"],
        # Per thread kind, ms of CPU per group pass per rank: where the extra goes.
        "cpu_ms_per_rank_pass": {
            name: 1000 * cores / rate / sc.dp
            for name, cores in sorted(raw["cores_by_thread"].items())
        },
        "loadavg_1m": raw["loadavg_1m"],
        "over_capacity": raw["cores_used"] > BUSY_SHARE * CORES,
    }
    snaps = records[0]["snaps"]
    if sc.model == "step_sync" and len(snaps) >= 2:
        a, b = snaps[0], snaps[1]
        passes = rate * (b["t"] - a["t"])
        msgs = b["msgs_in"] + b["msgs_out"] - a["msgs_in"] - a["msgs_out"]
        out["coordinator"] = {
            "cpu_ms_per_pass": 1000 * (b["coord_cpu_s"] - a["coord_cpu_s"]) / passes,
            "core_share": (b["coord_cpu_s"] - a["coord_cpu_s"]) / (b["t"] - a["t"]),
            "msgs_per_s": msgs / (b["t"] - a["t"]),
            "msgs_per_pass": msgs / passes,
            "cpu_us_per_msg": 1e6
            * (b["coord_cpu_s"] - a["coord_cpu_s"])
            / max(1, msgs),
        }
    if sc.model != "none":
        out.update(wakes_and_drains(records))
    return out


def wakes_and_drains(records: list[dict]) -> dict:
    trials = sorted((w[0], w[1], rec["rank"]) for rec in records for w in rec["wakes"])
    wake, wasted = [], []
    for i, (t_add, step0, target) in enumerate(trials):
        t_next = trials[i + 1][0] if i + 1 < len(trials) else float("inf")
        firsts, final, last_real = [], step0, step0
        for rec in records:
            mine = [p for p in rec["passes"] if p[0] > step0 and t_add <= p[1] < t_next]
            if mine:
                firsts.append(mine[0][1] - t_add)
                final = max(final, mine[-1][0])
            if rec["rank"] == target:
                last_real = max([p[0] for p in mine if p[4]], default=step0)
        if len(firsts) == len(records):
            wake.append(max(firsts))
        wasted.append(final - last_real)
    return {
        "wake_ms": {
            "p50": 1000 * statistics.median(wake) if wake else None,
            "max": 1000 * max(wake) if wake else None,
        },
        "wasted_per_drain": statistics.fmean(wasted) if wasted else None,
    }


def points(which: str, quick: bool) -> list[stepsim.Scenario]:
    if quick:
        return [
            stepsim.Scenario(m, 2, 5, d, load_passes=20, wakes=1)
            for m, d in (("step_sync", 0.0), ("step_sync", 1.0), ("waves", 1.0))
        ] + [stepsim.Scenario("none", 2, 5, 0.0, load_passes=20, wakes=0)]
    out = []
    if which in ("dp", "all"):
        for dp in (2, 8, 32, 64, 128, 256):
            for m in MODELS:
                out.append(stepsim.Scenario(m, dp, 20, 0.0 if m == "none" else 1.0))
    if which == "lookahead":
        # Does a longer lease (fewer grant round trips per pass) keep rank 0
        # and the group at pace where the coordinator's messages add up?
        for dp in (32, 64, 128):
            out.append(stepsim.Scenario("none", dp, 20, 0.0))
            out.append(stepsim.Scenario("waves", dp, 20, 1.0))
            for lookahead in (2, 4, 8):
                out.append(stepsim.Scenario("step_sync", dp, 20, 1.0, lookahead))
    if which == "coordinator":
        # The coordinator in rank 0's thread against its own process
        # (step_sync_coordinator), beside waves and the harness alone.
        for dp in (32, 64, 128):
            out.append(stepsim.Scenario("none", dp, 20, 0.0))
            out.append(stepsim.Scenario("waves", dp, 20, 1.0))
            for host in ("thread", "process"):
                out.append(stepsim.Scenario("step_sync", dp, 20, 1.0, coordinator=host))
            out.append(
                stepsim.Scenario("step_sync", dp, 20, 1.0, 8, coordinator="process")
            )
    if which in ("delay", "all"):
        # Step sync as its defaults run a group of 32 (`auto`: the coordinator's
        # own process, look-ahead 8).
        auto = auto_settings(32)
        for pass_ms in (5, 20, 50):
            load = max(40, int(2000 / pass_ms))
            out.append(stepsim.Scenario("none", 32, pass_ms, 0.0, load_passes=load))
            for d in (0.0, 0.1, 1.0, 5.0):
                out.append(
                    stepsim.Scenario(
                        "step_sync", 32, pass_ms, d, load_passes=load, **auto
                    )
                )
                out.append(stepsim.Scenario("waves", 32, pass_ms, d, load_passes=load))
    return out


def auto_settings(dp: int) -> dict:
    """The look-ahead and coordinator host `auto` picks for a group of ``dp``."""
    from vllm_disagg.v1.engine.step_sync.config import StepSyncConfig

    config = StepSyncConfig(dp)
    host = "process" if config.coordinator_in_process else "thread"
    return {"lookahead": config.lookahead, "coordinator": host}


def baseline_ratios(results: list[dict]) -> None:
    """Each point's rate against the harness alone at the same size and pass time."""
    base = {
        (r["scenario"]["dp"], r["scenario"]["pass_ms"]): r["passes_per_s"]
        for r in results
        if r["scenario"]["model"] == "none"
    }
    for r in results:
        s = r["scenario"]
        harness = base.get((s["dp"], s["pass_ms"]))
        r["of_harness"] = r["passes_per_s"] / harness if harness else None


def saturation(results: list[dict]) -> dict:
    """Where one core of coordinator would be spent: from the measured CPU per message
    and messages per pass per rank."""
    coord = [r for r in results if "coordinator" in r]
    if not coord:
        return {}
    us_per_msg = statistics.median(r["coordinator"]["cpu_us_per_msg"] for r in coord)
    per_rank = statistics.median(
        r["coordinator"]["msgs_per_pass"] / r["scenario"]["dp"] for r in coord
    )
    if not us_per_msg or not per_rank:  # runs too short for the CPU clock's ticks
        return {}
    return {
        "cpu_us_per_msg": us_per_msg,
        "msgs_per_pass_per_rank": per_rank,
        "formula": "N_sat = pass_s / (cpu_per_msg * msgs_per_pass_per_rank)",
        "n_at_one_core": {
            str(ms): (ms / 1000) / (us_per_msg / 1e6 * per_rank) for ms in (5, 20, 50)
        },
    }


def _f(value, spec=".2f") -> str:
    return "" if value is None else format(value, spec)


def markdown(results: list[dict], sat: dict, args) -> list[str]:
    rows = []
    for r in results:
        s, c = r["scenario"], r.get("coordinator", {})
        model = s["model"]
        notes = []
        if model == "step_sync" and s.get("coordinator", "thread") != "thread":
            notes.append(f"coordinator {s['coordinator']}")
        if model == "step_sync" and s["lookahead"] != 2:
            notes.append(f"lookahead {s['lookahead']}")
        if notes:
            model += f" ({', '.join(notes)})"
        rows.append(
            [
                model,
                s["dp"],
                s["pass_ms"],
                s["delay_ms"],
                _f(r["passes_per_s"], ".1f"),
                _f(r["of_ideal"]),
                _f(r["of_harness"]),
                f"{_f(r['sync_wait_ms']['p50'])} / {_f(r['sync_wait_ms']['p99'])}",
                _f(c.get("cpu_ms_per_pass"), ".3f"),
                _f(c.get("msgs_per_s"), ".0f"),
                f"{_f(r['rank0_own_ms'])} / {_f(r['others_own_ms'])}",
                _f(r.get("wake_ms", {}).get("p50")),
                _f(r.get("wasted_per_drain"), ".1f"),
                _f(r["cores_used"], ".2f") + (" (over)" if r["over_capacity"] else ""),
            ]
        )
    lines = [
        "# Step sync at scale: a model with one process per rank",
        "",
        report.generated(
            "step_sync_scale.py",
            "The real Coordinator (a thread of rank 0's process, or with "
            "`coordinator process` a child process of rank 0, as "
            "`step_sync_coordinator` picks) and Participants; passes are "
            "sleeps, the MoE collective a barrier over a hub process (no injected "
            "delay: it is not step sync's transport); every step-sync message, and "
            "every hop of the waves' all-reduce and start-wave, delayed one way by "
            "`delay`. `none`: the same processes and barrier with no coordination "
            "(the harness's own limit).",
            f"Machine: {CORES} cores; `uptime` at the start: {args.load_before}; at "
            f"the end: {args.load_after}.",
        ),
        "",
        "Columns: group passes/s; its share of the ideal (1 / pass time) and of the "
        "harness alone (`none`); wait for a grant per pass (step sync: in "
        "`begin_forward`; waves: in the all-reduce) p50 / p99 ms; coordinator CPU ms "
        "per group pass (a thread: that thread only; a process: the whole child, "
        "its ZMQ I/O thread included) and messages (in + out) per second; rank 0's "
        "own time per pass "
        "(from the last collective to the next, pass included) against the other "
        "ranks' median, ms; idle-wake latency p50 ms (work arrives at one idle rank "
        "until every rank started the first pass); wasted passes per drain (one "
        f"rank gets {results[0]['scenario']['drain_passes']} passes of work with a "
        "known end); CPU cores all processes used in the steady phase, `(over)` "
        f"above {BUSY_SHARE:.0%} of the machine: those rows measure the machine, not "
        "the protocol.",
        "",
        *report.table(
            [
                "model",
                "DP",
                "pass ms",
                "delay ms",
                "passes/s",
                "of ideal",
                "of harness",
                "grant wait p50/p99",
                "coord ms/pass",
                "coord msgs/s",
                "rank 0 / others ms",
                "wake ms",
                "wasted/drain",
                "cores",
            ],
            rows,
        ),
    ]
    if sat:
        lines += [
            "",
            "Coordinator saturation, extrapolated: "
            f"{sat['formula']}, with {sat['cpu_us_per_msg']:.1f} us per message and "
            f"{sat['msgs_per_pass_per_rank']:.2f} messages per group pass per rank "
            "(medians of the step-sync rows): one full core at N = "
            + ", ".join(
                f"{float(n):.0f} ({ms} ms passes)"
                for ms, n in sat["n_at_one_core"].items()
            )
            + ".",
        ]
    return lines


def plot(results: list[dict], path: Path) -> None:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"step_sync": "#2a7ab9", "waves": "#999999", "none": "#cccccc"}
    dp_rows = [
        r
        for r in results
        if r["scenario"]["pass_ms"] == 20
        and r["scenario"]["lookahead"] == 2
        and r["scenario"].get("coordinator", "thread") == "thread"
        and r["scenario"]["delay_ms"] in (1.0, 0.0)
        and (r["scenario"]["delay_ms"] == 1.0 or r["scenario"]["model"] == "none")
    ]
    for model, color in colors.items():
        pts = sorted(
            (r["scenario"]["dp"], r) for r in dp_rows if r["scenario"]["model"] == model
        )
        if not pts:
            continue
        xs = [p[0] for p in pts]
        axes[0].plot(
            xs, [p[1]["of_ideal"] for p in pts], "o-", color=color, label=model
        )
        if model != "none":
            axes[1].plot(
                xs, [p[1]["wake_ms"]["p50"] or 0 for p in pts], "o-", color=color
            )
        if model == "step_sync":
            axes[2].plot(
                xs,
                [p[1]["coordinator"]["core_share"] for p in pts],
                "o-",
                color=color,
            )
    axes[0].axhline(0.95, color="#cc4444", linewidth=1, linestyle="--")
    axes[0].set_title("group passes/s / ideal (20 ms passes, 1 ms delay)", fontsize=9)
    axes[1].set_title("idle-wake latency p50 (ms)", fontsize=9)
    axes[2].set_title("coordinator thread, share of one core", fontsize=9)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("DP ranks")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke: tiny groups")
    parser.add_argument(
        "--points",
        choices=["dp", "delay", "lookahead", "coordinator", "all"],
        default="all",
        help="all: dp and delay; lookahead: step sync at look-ahead 2, 4, 8 "
        "for DP = 32, 64, 128 beside waves; coordinator: the coordinator in "
        "rank 0's thread against its own process, DP = 32, 64, 128",
    )
    parser.add_argument(
        "--no-plot", action="store_true", help="tables only (no matplotlib)"
    )
    report.add_out_argument(parser)
    args = parser.parse_args()
    require()  # matplotlib only for the plot: without it, tables only (below)
    if not args.quick and not args.no_plot and missing_modules(["matplotlib"]):
        print("matplotlib is missing: tables only, no plot", file=sys.stderr)
        args.no_plot = True
    args.load_before = uptime()
    results = []
    for sc in points(args.points, args.quick):
        started = time.monotonic()
        result = analyse(sc, run(sc))
        result["wall_s"] = time.monotonic() - started
        results.append(result)
        print(
            json.dumps(
                {k: result[k] for k in ("scenario", "of_ideal", "wall_s")}
                | {"wasted": result.get("wasted_per_drain")}
            ),
            flush=True,
        )
    args.load_after = uptime()
    baseline_ratios(results)
    sat = saturation(results)
    name = "step_sync_scale" + ("-quick" if args.quick else "")
    if args.points != "all" and not args.quick:
        name += f"-{args.points}"
    stem = (args.out or report.RESULTS) / name
    summary = {"results": results, "saturation": sat, "cores": CORES}
    summary["load"] = {"start": args.load_before, "end": args.load_after}
    report.write(
        stem,
        summary,
        markdown(results, sat, args),
        None if args.no_plot or args.quick else (lambda png: plot(results, png)),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
