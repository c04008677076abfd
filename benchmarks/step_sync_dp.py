"""Step sync vs upstream DP waves, side by side, on one install.

Starts `vllm serve` on tiny Mixtral with --data-parallel-size 2 twice: with
the patch set's features off (VLLM_DISAGG_DISABLE=1: upstream waves) and on
(step sync). Both servers stay up and take turns, so the load other tenants
put on a shared machine falls on both modes alike. Both load the
measurement-only probe (VLLM_DISAGG_PROBE=1), which counts each rank's real
and dummy forward passes and the blocking DP all-reduces of the busy loop.
Measured, the same way for both:

* output tokens/s under load (concurrent requests, ignore_eos);
* TTFT of a single request arriving at an idle group;
* forward passes per rank beyond the busiest rank's real passes, per drain
  (one request, then idle): the dummy passes wasted after the work ended;
* blocking DP collectives per 1000 forward passes.

With ``--before TREE`` (a checkout of the code before a change, e.g. a git
worktree of main), a third server runs step sync from TREE, so a change is
measured before/after side by side in the same run; that run writes
step_sync_dp-before-after.{json,md,png}. Three DP=2 servers take about 9 GiB:
on 2026-11-28 a shared 24 GiB machine OOM-killed a worker of the third.

Writes benchmarks/results/step_sync_dp.{json,md,png} (``--out DIR``: elsewhere).
Ratios, not absolute numbers, are the result: these machines are shared and
noisy. Run it with nothing else busy on the machine (about 15 minutes on 2 cores).

    .venv/bin/python benchmarks/step_sync_dp.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _deps import require  # benchmarks/_deps.py: sys.path[0] when run as a script
from common import report
from common.procs import uptime

from vllm_disagg import envs
from vllm_disagg.testing.openai_client import random_prompt, stream_completion
from vllm_disagg.testing.server import VllmServer, cpu_test_env
from vllm_disagg.testing.tiny_models import build_model
from vllm_disagg.v1.metrics.probe import read_probes

MODES = {"waves": {envs.VLLM_DISAGG_DISABLE: "1"}, "step_sync": {}}
BEFORE = "step_sync_before"
LABELS = {
    "waves": "waves (upstream)",
    "step_sync": "step sync",
    BEFORE: "step sync before",
}


def stream_first_token_s(server: VllmServer, prompt: str, max_tokens: int) -> float:
    start = time.perf_counter()
    first = None
    chunks = stream_completion(
        server,
        prompt,
        timeout_s=120,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
    )
    for _ in chunks:  # read to the end, as a client does
        if first is None:
            first = time.perf_counter() - start
    return first


def complete(server: VllmServer, prompt: str, max_tokens: int) -> int:
    body = server.complete(
        prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
    )
    return body["usage"]["completion_tokens"]


def settled_probe(
    directory: Path, quiet_s: float = 1.0, timeout_s: float = 60.0
) -> dict:
    """Probe counts once they stop moving (the group is idle)."""
    deadline = time.monotonic() + timeout_s
    last = read_probes(directory)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = read_probes(directory)
        if now == last and len(now) == 2:
            return now
        last = now
    raise RuntimeError(f"probe counts in {directory} did not settle: {last}")


def delta(after: dict, before: dict, rank: int, key: str) -> int:
    return after[rank][key] - before.get(rank, {}).get(key, 0)


class ModeUnderTest:
    """One DP=2 server in one mode, with its probe directory."""

    def __init__(
        self, mode: str, model: Path, work: Path, logs: Path, env: dict[str, str]
    ):
        self.mode = mode
        self.metrics_dir = work / f"metrics-{mode}"
        self.metrics_dir.mkdir()
        env = cpu_test_env(
            **{
                envs.VLLM_DISAGG_PROBE: "1",
                envs.VLLM_DISAGG_METRICS_DIR: str(self.metrics_dir),
            },
            **env,
        )
        self.server = VllmServer(
            model,
            [
                "--max-model-len",
                "512",
                "--max-num-seqs",
                "64",
                "--seed",
                "0",
                "--data-parallel-size",
                "2",
            ],
            log_path=logs / f"step_sync_dp-{mode}.log",
            env=env,
        )
        self.rng = random.Random(7)
        self.result: dict = {
            "mode": mode,
            "idle_ttft_s": [],
            "wasted_passes_per_drain": [],
            "output_tokens_per_s": [],
            "blocking_collectives_per_1000_passes": [],
        }

    def prompt(self) -> str:
        return random_prompt(self.rng, 4, 40)

    def warm_up(self, args: argparse.Namespace) -> None:
        for _ in range(4):
            complete(self.server, self.prompt(), 8)
        self.load_round(args, record=False)  # first large batches are slower

    def idle_ttft(self) -> None:
        settled_probe(self.metrics_dir)  # idle group
        self.result["idle_ttft_s"].append(
            stream_first_token_s(self.server, self.prompt(), 1)
        )

    def drain(self) -> None:
        before = settled_probe(self.metrics_dir)
        complete(self.server, self.prompt(), 8)
        after = settled_probe(self.metrics_dir)
        passes = [
            delta(after, before, r, "real_passes")
            + delta(after, before, r, "dummy_passes")
            for r in (0, 1)
        ]
        real = [delta(after, before, r, "real_passes") for r in (0, 1)]
        assert passes[0] == passes[1], f"{self.mode}: ranks ran {passes} passes"
        self.result["wasted_passes_per_drain"].append(passes[0] - max(real))

    def load_round(self, args: argparse.Namespace, record: bool = True) -> None:
        before = settled_probe(self.metrics_dir)
        prompts = [self.prompt() for _ in range(args.concurrency)]
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            tokens = sum(
                pool.map(lambda p: complete(self.server, p, args.max_tokens), prompts)
            )
        elapsed = time.perf_counter() - start
        after = settled_probe(self.metrics_dir)
        if record:
            passes = sum(
                delta(after, before, 0, key) for key in ("real_passes", "dummy_passes")
            )
            self.result["output_tokens_per_s"].append(tokens / elapsed)
            self.result["blocking_collectives_per_1000_passes"].append(
                1000 * delta(after, before, 0, "blocking_collectives") / passes
            )


def measure(model: Path, work: Path, args: argparse.Namespace) -> dict[str, dict]:
    """Both servers stay up (an idle group uses no CPU); the modes take turns
    in every repeat, first one then the other (load rounds alternate one by
    one), so drift in the machine's load falls on both alike."""
    modes = dict(MODES)
    if args.before:
        # The code before the change, imported ahead of this tree's.
        modes[BEFORE] = {"PYTHONPATH": str(args.before.resolve())}
    runs = {
        mode: ModeUnderTest(mode, model, work, args.out / "logs", env)
        for mode, env in modes.items()
    }
    with contextlib.ExitStack() as stack:
        for run in runs.values():  # one at a time: start-up is CPU-bound
            print(f"[{run.mode}] starting server", flush=True)
            stack.enter_context(run.server.start())
            run.warm_up(args)
        order = list(runs.values())
        for repeat in range(args.repeats):
            for run in order if repeat % 2 == 0 else reversed(order):
                for _ in range(args.trials):
                    run.idle_ttft()
                for _ in range(args.trials):
                    run.drain()
            # Load rounds are short: alternate them one by one (ABBA...).
            for i in range(args.rounds):
                for run in order if (repeat + i) % 2 == 0 else reversed(order):
                    run.load_round(args)
            print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    for run in runs.values():
        print(f"[{run.mode}] {json.dumps(run.result)}", flush=True)
    return {mode: run.result for mode, run in runs.items()}


def paired_ratios(
    runs: dict[str, dict], key: str, per_repeat: int, stat, base: str = "waves"
) -> list[float]:
    """Step sync / ``base``, one ratio per repeat (the two ran back to back)."""
    w, s = runs[base][key], runs["step_sync"][key]
    chunks = range(0, len(w), per_repeat)
    return [stat(s[i : i + per_repeat]) / stat(w[i : i + per_repeat]) for i in chunks]


def summarize(runs: dict[str, dict], args: argparse.Namespace) -> dict:
    mean = statistics.fmean
    median = statistics.median
    throughput = paired_ratios(runs, "output_tokens_per_s", args.rounds, mean)
    ttft = paired_ratios(runs, "idle_ttft_s", args.trials, median)
    stats = {
        "wasted_passes_per_drain": mean,
        "blocking_collectives_per_1000_passes": mean,
        "output_tokens_per_s": median,
    }
    figures = {
        key: {mode: stat(run[key]) for mode, run in runs.items()}
        for key, stat in stats.items()
    }
    figures["idle_ttft_median_s"] = {
        mode: median(run["idle_ttft_s"]) for mode, run in runs.items()
    }
    before = {}
    if BEFORE in runs:
        after_before = [
            paired_ratios(runs, "output_tokens_per_s", args.rounds, mean, BEFORE),
            paired_ratios(runs, "idle_ttft_s", args.trials, median, BEFORE),
        ]
        before = {
            "throughput_ratio_after_before": median(after_before[0]),
            "throughput_ratio_after_before_per_repeat": after_before[0],
            "idle_ttft_ratio_after_before": median(after_before[1]),
            "idle_ttft_ratio_after_before_per_repeat": after_before[1],
        }
    return {
        "throughput_ratio": median(throughput),
        "throughput_ratio_per_repeat": throughput,
        "idle_ttft_ratio": median(ttft),
        "idle_ttft_ratio_per_repeat": ttft,
        **figures,
        **before,
    }


def spread(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def markdown(summary: dict, args: argparse.Namespace) -> list[str]:
    f = summary
    rows = [
        (
            "output tokens/s under load, median",
            "output_tokens_per_s",
            "{:.1f}",
            f"{f['throughput_ratio']:.2f} (repeats "
            f"{spread(f['throughput_ratio_per_repeat'])}; goal >= 1.0)",
        ),
        (
            "idle-group TTFT, median (s)",
            "idle_ttft_median_s",
            "{:.3f}",
            f"{f['idle_ttft_ratio']:.2f} (repeats "
            f"{spread(f['idle_ttft_ratio_per_repeat'])}; goal <= 1.0)",
        ),
        (
            "wasted passes per drain",
            "wasted_passes_per_drain",
            "{:.1f}",
            "goal <= 1 (step sync)",
        ),
        (
            "blocking collectives / 1000 passes",
            "blocking_collectives_per_1000_passes",
            "{:.1f}",
            "goal 0 (step sync)",
        ),
    ]
    modes = list(f["output_tokens_per_s"])
    after_before = {
        "output_tokens_per_s": "throughput_ratio_after_before",
        "idle_ttft_median_s": "idle_ttft_ratio_after_before",
    }
    header = ["metric", *(LABELS[m] for m in modes), "ratio / goal"]
    if BEFORE in modes:
        header.append("after / before (repeats)")

    def after_before_cell(key: str) -> list[str]:
        if BEFORE not in modes:
            return []
        if key not in after_before:
            return [""]
        k = after_before[key]
        return [f"{f[k]:.2f} ({spread(f[k + '_per_repeat'])})"]

    return [
        "# Step sync vs upstream DP waves (DP=2 tiny Mixtral, CPU)",
        "",
        report.generated(
            "step_sync_dp.py",
            f"Both servers stay up and take turns, {args.repeats} turns each; a turn "
            f"is {args.trials} idle-group TTFTs, {args.trials} drains (one 8-token "
            f"request, then idle) and {args.rounds} load rounds of {args.concurrency} "
            f"concurrent requests x {args.max_tokens} tokens. Ratios are step sync / "
            "waves: the median over turns, each turn paired with the other mode's turn "
            "next to it."
            + (
                " The third server runs step sync from the code before the change "
                f"({args.before}); after / before pairs its turns with step sync's."
                if BEFORE in modes
                else ""
            ),
            f"Machine load (`uptime`) at the start: {args.load_before}; at the end: "
            f"{args.load_after}.",
        ),
        "",
        *report.table(
            header,
            [
                [
                    label,
                    *(fmt.format(f[key][m]) for m in modes),
                    note,
                    *after_before_cell(key),
                ]
                for label, key, fmt, note in rows
            ],
        ),
    ]


def plot(summary: dict, path: Path) -> None:
    plt = report.pyplot()
    panels = [
        ("output tokens/s", "output_tokens_per_s"),
        ("idle TTFT (s, median)", "idle_ttft_median_s"),
        ("wasted passes / drain", "wasted_passes_per_drain"),
        ("blocking collectives / 1000 passes", "blocking_collectives_per_1000_passes"),
    ]
    fig, axes = plt.subplots(1, 5, figsize=(17, 3.4))
    for ax, (title, key) in zip(axes, panels):
        modes = list(summary[key])
        values = [summary[key][m] for m in modes]
        colors = {"waves": "#999999", "step_sync": "#2a7ab9", BEFORE: "#9ecae1"}
        ax.bar(
            [LABELS[m].replace(" (upstream)", "") for m in modes],
            values,
            color=[colors[m] for m in modes],
        )
        ax.tick_params(axis="x", labelsize=8)
        ax.set_title(title, fontsize=10)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=9)
    ax = axes[-1]
    for x, key in enumerate(
        ("throughput_ratio_per_repeat", "idle_ttft_ratio_per_repeat")
    ):
        ax.plot([x] * len(summary[key]), summary[key], "o", color="#2a7ab9", alpha=0.7)
    ax.axhline(1.0, color="#999999", linewidth=1)
    ax.set_xticks([0, 1], ["tokens/s", "idle TTFT"])
    ax.set_xlim(-0.5, 1.5)
    ax.set_title("step sync / waves, each turn", fontsize=10)
    fig.suptitle("DP=2 tiny Mixtral on CPU: upstream waves vs step sync")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=4, help="turns each mode takes")
    parser.add_argument(
        "--trials", type=int, default=6, help="idle TTFTs and drains per turn"
    )
    parser.add_argument("--rounds", type=int, default=4, help="load rounds per turn")
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--quick", action="store_true", help="fewer trials (smoke run)")
    parser.add_argument(
        "--before",
        type=Path,
        metavar="TREE",
        help="also run step sync from this checkout (the code before a change)",
    )
    report.add_out_argument(parser)
    args = parser.parse_args()
    require("matplotlib")  # before any server starts, not at the plot
    if args.quick:
        args.repeats, args.trials, args.rounds = 2, 2, 1
        args.concurrency, args.max_tokens = 8, 8
    args.out = args.out or report.RESULTS
    args.load_before = uptime()
    with tempfile.TemporaryDirectory(prefix="bench-step-sync-") as tmp:
        work = Path(tmp)
        model = build_model("tiny-mixtral", work / "models")
        runs = measure(model, work, args)
    args.load_after = uptime()
    summary = summarize(runs, args)
    name = "step_sync_dp-before-after" if args.before else "step_sync_dp"
    stem = args.out / (name + ("-quick" if args.quick else ""))
    report.write(
        stem,
        {
            "summary": summary,
            "runs": runs,
            "load": {"start": args.load_before, "end": args.load_after},
        },
        markdown(summary, args),
        lambda png: plot(summary, png),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
