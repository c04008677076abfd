"""Step sync vs upstream DP waves, side by side, on one install.

Starts `vllm serve` on tiny Mixtral with --data-parallel-size 2 twice: with
the patch set's features off (VLLM_DISAGG_DISABLE=1: upstream waves) and on
(step sync). Both runs load the measurement-only probe (VLLM_DISAGG_PROBE=1),
which counts each rank's real and dummy forward passes and the blocking DP
all-reduces of the busy loop. Measured, the same way for both:

* output tokens/s under load (concurrent requests, ignore_eos);
* TTFT of a single request arriving at an idle group;
* forward passes per rank beyond the busiest rank's real passes, per drain
  (one request, then idle): the dummy passes wasted after the work ended;
* blocking DP collectives per 1000 forward passes.

Writes benchmarks/results/step_sync_dp.{json,md,png}. Ratios, not absolute
numbers, are the result: these machines are shared and noisy.

    .venv/bin/python benchmarks/step_sync_dp.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from vllm_disagg.testing.server import VllmServer, cpu_test_env
from vllm_disagg.testing.tiny_models import build_model
from vllm_disagg.v1.metrics.probe import read_probes

RESULTS = Path(__file__).parent / "results"
WORDS = (
    "step sync keeps every data parallel engine in lockstep while the proxy sends "
    "each request to one prefill and one decode instance over loopback"
).split()
MODES = {"waves": {"VLLM_DISAGG_DISABLE": "1"}, "step_sync": {}}


def stream_first_token_s(server: VllmServer, prompt: str, max_tokens: int) -> float:
    body = {
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    start = time.perf_counter()
    first = None
    with requests.post(f"{server.url}/v1/completions", json=body, stream=True, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - start
    return first


def complete(server: VllmServer, prompt: str, max_tokens: int) -> int:
    body = server.complete(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return body["usage"]["completion_tokens"]


def settled_probe(directory: Path, quiet_s: float = 1.0, timeout_s: float = 60.0) -> dict:
    """Probe counts once they stop moving (the group is idle)."""
    deadline = time.monotonic() + timeout_s
    last = read_probes(directory)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = read_probes(directory)
        if now == last and len(now) == 2:
            return now
        last = now
    raise RuntimeError(f"probe counts did not settle: {last}")


def delta(after: dict, before: dict, rank: int, key: str) -> int:
    return after[rank][key] - before.get(rank, {}).get(key, 0)


def measure(mode: str, model: Path, work: Path, args: argparse.Namespace) -> dict:
    metrics_dir = work / f"metrics-{mode}"
    metrics_dir.mkdir()
    env = cpu_test_env(
        VLLM_DISAGG_PROBE="1", VLLM_DISAGG_METRICS_DIR=str(metrics_dir), **MODES[mode]
    )
    server = VllmServer(
        model,
        ["--max-model-len", "512", "--max-num-seqs", "64", "--seed", "0",
         "--data-parallel-size", "2"],  # fmt: skip
        log_path=RESULTS / "logs" / f"step_sync_dp-{mode}.log",
        env=env,
    )
    rng = random.Random(7)
    prompt = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))  # noqa: E731
    result: dict = {"mode": mode}
    print(f"[{mode}] starting server", flush=True)
    with server.start():
        for _ in range(4):  # warm-up
            complete(server, prompt(), 8)

        ttfts = []
        for _ in range(args.trials):
            settled_probe(metrics_dir)  # idle group
            ttfts.append(stream_first_token_s(server, prompt(), 1))
        result["idle_ttft_s"] = ttfts

        wasted, collectives_per_drain = [], []
        for _ in range(args.trials):
            before = settled_probe(metrics_dir)
            complete(server, prompt(), 8)
            after = settled_probe(metrics_dir)
            passes = [
                delta(after, before, r, "real_passes") + delta(after, before, r, "dummy_passes")
                for r in (0, 1)
            ]
            real = [delta(after, before, r, "real_passes") for r in (0, 1)]
            assert passes[0] == passes[1], f"{mode}: ranks ran {passes} passes"
            wasted.append(passes[0] - max(real))
            collectives_per_drain.append(delta(after, before, 0, "blocking_collectives"))
        result["wasted_passes_per_drain"] = wasted

        tokens_per_s, per_1000 = [], []
        for _ in range(args.rounds):
            before = settled_probe(metrics_dir)
            prompts = [prompt() for _ in range(args.concurrency)]
            start = time.perf_counter()
            with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
                tokens = sum(pool.map(lambda p: complete(server, p, args.max_tokens), prompts))
            elapsed = time.perf_counter() - start
            after = settled_probe(metrics_dir)
            tokens_per_s.append(tokens / elapsed)
            passes = delta(after, before, 0, "real_passes") + delta(after, before, 0, "dummy_passes")
            per_1000.append(1000 * delta(after, before, 0, "blocking_collectives") / passes)
        result["output_tokens_per_s"] = tokens_per_s
        result["blocking_collectives_per_1000_passes"] = per_1000
    print(f"[{mode}] {json.dumps(result)}", flush=True)
    return result


def summarize(runs: dict[str, dict]) -> dict:
    mean = statistics.fmean
    median = statistics.median
    w, s = runs["waves"], runs["step_sync"]
    return {
        "throughput_ratio": mean(s["output_tokens_per_s"]) / mean(w["output_tokens_per_s"]),
        "idle_ttft_ratio": median(s["idle_ttft_s"]) / median(w["idle_ttft_s"]),
        "wasted_passes_per_drain": {
            "waves": mean(w["wasted_passes_per_drain"]),
            "step_sync": mean(s["wasted_passes_per_drain"]),
        },
        "blocking_collectives_per_1000_passes": {
            "waves": mean(w["blocking_collectives_per_1000_passes"]),
            "step_sync": mean(s["blocking_collectives_per_1000_passes"]),
        },
        "output_tokens_per_s": {
            "waves": mean(w["output_tokens_per_s"]),
            "step_sync": mean(s["output_tokens_per_s"]),
        },
        "idle_ttft_median_s": {
            "waves": median(w["idle_ttft_s"]),
            "step_sync": median(s["idle_ttft_s"]),
        },
    }


def write_markdown(summary: dict, args: argparse.Namespace, path: Path) -> None:
    f = summary
    rows = [
        ("output tokens/s under load", "output_tokens_per_s", "{:.1f}",
         f"{f['throughput_ratio']:.2f} (goal >= 1.0)"),
        ("idle-group TTFT, median (s)", "idle_ttft_median_s", "{:.3f}",
         f"{f['idle_ttft_ratio']:.2f} (goal <= 1.0)"),
        ("wasted passes per drain", "wasted_passes_per_drain", "{:.1f}", "goal <= 2 (step sync)"),
        ("blocking collectives / 1000 passes", "blocking_collectives_per_1000_passes",
         "{:.1f}", "goal 0 (step sync)"),
    ]  # fmt: skip
    lines = [
        "# Step sync vs upstream DP waves (DP=2 tiny Mixtral, CPU)",
        "",
        f"Generated by `benchmarks/step_sync_dp.py` on {time.strftime('%Y-%m-%d')}: "
        f"{args.trials} idle-TTFT and drain trials, {args.rounds} load rounds of "
        f"{args.concurrency} concurrent requests x {args.max_tokens} tokens.",
        "",
        "| metric | waves (upstream) | step sync | ratio / goal |",
        "|---|---|---|---|",
    ]
    for label, key, fmt, note in rows:
        lines.append(
            f"| {label} | {fmt.format(f[key]['waves'])} | {fmt.format(f[key]['step_sync'])} "
            f"| {note} |"
        )
    path.write_text("\n".join(lines) + "\n")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("output tokens/s", "output_tokens_per_s"),
        ("idle TTFT (s, median)", "idle_ttft_median_s"),
        ("wasted passes / drain", "wasted_passes_per_drain"),
        ("blocking collectives / 1000 passes", "blocking_collectives_per_1000_passes"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.4))
    for ax, (title, key) in zip(axes, panels):
        values = [summary[key]["waves"], summary[key]["step_sync"]]
        ax.bar(["waves", "step sync"], values, color=["#999999", "#2a7ab9"])
        ax.set_title(title, fontsize=10)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=9)
    fig.suptitle("DP=2 tiny Mixtral on CPU: upstream waves vs step sync")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--quick", action="store_true", help="fewer trials (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.rounds, args.concurrency, args.max_tokens = 2, 1, 8, 8
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-step-sync-") as tmp:
        work = Path(tmp)
        model = build_model("tiny-mixtral", work / "models")
        runs = {mode: measure(mode, model, work, args) for mode in MODES}
    summary = summarize(runs)
    stem = "step_sync_dp-quick" if args.quick else "step_sync_dp"
    (RESULTS / f"{stem}.json").write_text(
        json.dumps({"summary": summary, "runs": runs}, indent=2) + "\n"
    )
    write_markdown(summary, args, RESULTS / f"{stem}.md")
    plot(summary, RESULTS / f"{stem}.png")
    print((RESULTS / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
