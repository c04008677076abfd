"""DP groups placed as one: ``dp_balanced`` against ``least_outstanding`` on a
skewed workload, in a model with simulated step costs.

**A simulation, said plainly.** No vLLM runs here (a real DP=2 decode takes
minutes to start on 2 cores and its CPU steps say nothing about a GPU's).
What is real is the router's placement: the real ``InstanceRegistry`` (the
ranks registered with a discovery ``Register`` naming their DP group), its
leases (``reserve`` with the router's token estimate, ``release`` when the
request ends) and the real policy classes choosing a rank from the request
body the router would get. What is modelled is the engines:

* a DP group of ``--ranks`` decode ranks steps together (step sync): every
  step of the group lasts as long as its busiest rank's step;
* a rank's step costs ``C0 + C_SEQ * sequences + C_CTX * context tokens``
  (fixed weight reads, per-sequence work, and the attention's KV reads,
  which grow with every running sequence's prompt and output so far);
* requests arrive as a Poisson process, their KV already transferred (the
  decode side of 1PnD): each joins its rank's batch at the next step and
  produces one token a step until its output length, then leaves.

The workload is skewed: ``--long-share`` of the prompts are long
(``--long-tokens``), the rest short (``--short-tokens``); outputs are drawn
uniformly up to ``max_tokens``. Each policy gets the same arrivals (same
seed). Figures: the group's step rate (steps per simulated second), TPOT
(each request's mean step time over its decode) and how far the ranks'
context loads were apart at each step.

Writes benchmarks/results/dp_placement.{json,md} (``--out DIR``: elsewhere).
Takes well under a minute.

    .venv/bin/python benchmarks/dp_placement.py
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field

from _deps import (  # benchmarks/_deps.py: sys.path[0] when run as a script
    machine,
    require,
)
from common import report
from common.report import table
from common.stats import pct, ratio

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.policy import make_policy
from vllm_disagg.router.registry import InstanceRegistry, Lease
from vllm_disagg.wire.discovery import DISCOVERY_VERSION, Register, Role

STEM = "dp_placement"
POLICIES = ("least_outstanding", "dp_balanced", "round_robin")
# Step cost model (seconds): fixed, per running sequence, per context token.
C0 = 0.008
C_SEQ = 0.00002
C_CTX = 0.00000005


@dataclass
class Running:
    lease: Lease
    context: int  # prompt + tokens so far
    left: int  # tokens still to produce
    steps: list[float] = field(default_factory=list)


@dataclass
class Arrival:
    at: float
    prompt: int
    max_tokens: int
    output: int
    ids: list[int]


def workload(args) -> list[Arrival]:
    rng = random.Random(args.seed)
    now, out = 0.0, []
    for _ in range(args.requests):
        now += rng.expovariate(args.rate)
        long = rng.random() < args.long_share
        prompt = args.long_tokens if long else args.short_tokens
        max_tokens = args.max_tokens
        out.append(
            Arrival(
                now,
                prompt,
                max_tokens,
                rng.randint(max(1, max_tokens // 8), max_tokens),
                [rng.randrange(3, 30000) for _ in range(prompt)],
            )
        )
    return out


def simulate(policy_name: str, arrivals: list[Arrival], args) -> dict:
    clock = [0.0]
    registry = InstanceRegistry(clock=lambda: clock[0], heartbeat_timeout_s=1e9)
    group = "ab" * 8
    for r in range(args.ranks):
        registry.register(
            Register(
                DISCOVERY_VERSION,
                f"rank{r}",
                Role.DECODE,
                f"10.0.0.1:{20000 + r}",
                f"10.0.0.1:{21000 + r}",
                "m",
                dp_rank=r,
                dp_size=args.ranks,
                dp_group=group,
                interval_s=600,
            )
        )
    ranks = registry.healthy(Role.DECODE)
    policy = make_policy(policy_name, RouterConfig(local_cookie=False))
    batches: dict[str, list[Running]] = {r.instance_id: [] for r in ranks}
    pending = list(reversed(arrivals))
    now, steps, done = 0.0, 0, 0
    spreads, tpots, step_times = [], [], []
    while done < len(arrivals):
        while pending and pending[-1].at <= now:
            a = pending.pop()
            body = {"model": "m", "prompt": a.ids, "max_tokens": a.max_tokens}
            rank = policy.select(ranks, body)
            lease = registry.reserve(rank, a.prompt + a.max_tokens)
            batches[rank.instance_id].append(Running(lease, a.prompt, a.output))
        if not any(batches.values()):
            now = pending[-1].at  # idle until the next arrival
            continue
        costs, contexts = [], []
        for batch in batches.values():
            ctx = sum(r.context for r in batch)
            contexts.append(ctx)
            costs.append(C0 + C_SEQ * len(batch) + C_CTX * ctx)
        step = max(costs)  # the group steps at its busiest rank's pace
        spreads.append(max(contexts) - min(contexts))
        step_times.append(step)
        now += step
        clock[0] = now
        steps += 1
        for key, batch in batches.items():
            still = []
            for r in batch:
                r.steps.append(step)
                r.context += 1
                r.left -= 1
                if r.left <= 0:
                    r.lease.release(True)
                    tpots.append(sum(r.steps) / len(r.steps))
                    done += 1
                else:
                    still.append(r)
            batches[key] = still
    busy = sum(step_times)
    return {
        "steps": steps,
        "busy_s": busy,
        "sim_s": now,
        "step_rate": steps / busy,
        "step_p50_ms": pct(step_times, 50) * 1000,
        "step_p90_ms": pct(step_times, 90) * 1000,
        "tpot_p50_ms": pct(tpots, 50) * 1000,
        "tpot_p90_ms": pct(tpots, 90) * 1000,
        "tpot_mean_ms": sum(tpots) / len(tpots) * 1000,
        "context_spread_p50": pct(spreads, 50),
        "context_spread_p90": pct(spreads, 90),
        "tokens_per_s": sum(a.output for a in arrivals) / now,
        "left_in_flight": sum(r.tokens_in_flight for r in ranks),
    }


def markdown(result: dict) -> list[str]:
    meta = result["meta"]
    lines = [
        "# DP groups placed as one: dp_balanced vs least_outstanding (simulated steps)",
        "",
        report.generated(
            "dp_placement.py",
            "A model with simulated step costs driven by the real router policy "
            "and registry code (no vLLM runs; see the script's docstring).",
            date=meta["date"],
            on=meta["machine"],
        ),
        "",
        f"Step cost of a rank: {C0 * 1000:g} ms + {C_SEQ * 1e6:g} us per sequence "
        f"+ {C_CTX * 1e9:g} ns per context token; a group's step = its busiest "
        "rank's. Workload per scenario: "
        f"{meta['requests']} requests, Poisson at the rate given, "
        f"{meta['long_share'] * 100:.0f} % long prompts of {meta['long_tokens']} "
        f"tokens, the rest {meta['short_tokens']}; outputs uniform in "
        f"[{meta['max_tokens'] // 8}, {meta['max_tokens']}] (max_tokens "
        f"{meta['max_tokens']}). Seed {meta['seed']}, the same arrivals for every "
        f"policy. Load while it ran: {meta['load']}.",
        "",
    ]
    for scenario, by_policy in result["scenarios"].items():
        lines += [f"## {scenario}", ""]
        base = by_policy["least_outstanding"]
        rows = []
        for name, r in by_policy.items():
            rows.append(
                [
                    name,
                    f"{r['step_rate']:.1f}",
                    f"{ratio(r['step_rate'], base['step_rate']):.2f}",
                    f"{r['tpot_p50_ms']:.2f}",
                    f"{r['tpot_p90_ms']:.2f}",
                    f"{ratio(r['tpot_p50_ms'], base['tpot_p50_ms']):.2f}",
                    f"{ratio(r['tpot_p90_ms'], base['tpot_p90_ms']):.2f}",
                    f"{r['context_spread_p50']:.0f}",
                    f"{r['tokens_per_s']:.0f}",
                ]
            )
        lines += table(
            [
                "policy",
                "group steps/s",
                "vs least_outstanding",
                "TPOT p50 (ms)",
                "TPOT p90 (ms)",
                "p50 ratio",
                "p90 ratio",
                "rank context spread p50 (tokens)",
                "output tokens/s",
            ],
            rows,
        )
        lines.append("")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--long-share", type=float, default=0.2)
    parser.add_argument("--long-tokens", type=int, default=16000)
    parser.add_argument("--short-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    report.add_out_argument(parser)
    args = parser.parse_args()
    require()  # the router's own code only
    started = time.time()
    scenarios = {}
    for ranks, rate in ((2, 40.0), (4, 80.0)):
        args.ranks, args.rate = ranks, rate
        arrivals = workload(args)
        name = f"DP={ranks}, {rate:g} requests/s"
        scenarios[name] = {p: simulate(p, arrivals, args) for p in POLICIES}
        print(f"  {name} done ({time.time() - started:.0f}s)", flush=True)
    meta = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "requests": args.requests,
        "long_share": args.long_share,
        "long_tokens": args.long_tokens,
        "short_tokens": args.short_tokens,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "cost_model": {"c0_s": C0, "c_seq_s": C_SEQ, "c_ctx_s": C_CTX},
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg())
        + " (simulated time: machine load does not enter the figures)",
    }
    result = {"meta": meta, "scenarios": scenarios}
    out = args.out or report.RESULTS
    report.write(out / STEM, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
