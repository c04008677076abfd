"""Offline data parallelism on the tiny MoE model: one ``LLM`` per DP rank.

The pattern of upstream's offline data-parallel example
(``examples/offline_inference/data_parallel.py`` in vLLM): one process per DP
rank, each with ``VLLM_DP_RANK``, ``VLLM_DP_RANK_LOCAL``, ``VLLM_DP_SIZE``,
``VLLM_DP_MASTER_IP`` and ``VLLM_DP_MASTER_PORT`` set, each building its own
``LLM`` and calling ``generate()`` on its share of the prompts. This package
loads as a vLLM plugin, so the engines are step-synchronized.

Two rounds of greedy generation:

1. every rank generates its share of the prompts (uneven counts and lengths,
   so one rank finishes first while its engine keeps stepping for the other);
2. after the group went idle, only the last rank generates: with step sync a
   request handed to one engine is enough, the other ranks do not call
   ``generate()`` (upstream needs a placeholder prompt on every rank).

Token ids go to ``--output`` as JSON (``{prompt: [ids]}``), which is what the
end-to-end test compares with ``--dp-size 1``. Every wait is bounded: a rank
that has not finished in time is killed with the engine processes it started.

    python examples/offline_inference/data_parallel_tiny_moe.py \\
        [--dp-size 2] [--models .cache/models] [--output tokens.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from pathlib import Path

# (prompt, max_tokens). Round 0 is dealt to the ranks round-robin; round 1
# goes to the last rank only.
ROUNDS: list[list[tuple[str, int]]] = [
    [
        ("The quick brown fox", 16),
        ("Data parallel engines step together", 6),
        ("Prefill instances compute the key value cache", 12),
        ("Once upon a time there was a tiny model", 16),
        ("A proxy chooses one prefill", 3),
    ],
    [
        ("The coordinator grants steps", 16),
        ("Small models make fast tests", 9),
    ],
]

# Between rounds: long enough for the group's last dummy passes (at most
# step_sync_lookahead of them) to run, so round 1 starts on an idle group.
IDLE_BEFORE_NEXT_ROUND_S = 1.0


def prompts_for(rank: int, dp_size: int, round_no: int) -> list[tuple[str, int]]:
    jobs = ROUNDS[round_no]
    if round_no == 0:
        return jobs[rank::dp_size]
    return jobs if rank == dp_size - 1 else []


def run_rank(
    rank: int,
    dp_size: int,
    master_ip: str,
    master_port: int,
    engine_kwargs: dict,
    events,
    barrier,
    barrier_timeout_s: float,
) -> None:
    """One DP rank: its own LLM (and engine-core process), its share of prompts."""
    try:
        if dp_size > 1:
            os.environ["VLLM_DP_RANK"] = str(rank)
            os.environ["VLLM_DP_RANK_LOCAL"] = str(rank)
            os.environ["VLLM_DP_SIZE"] = str(dp_size)
            os.environ["VLLM_DP_MASTER_IP"] = master_ip
            os.environ["VLLM_DP_MASTER_PORT"] = str(master_port)

        from vllm import LLM, SamplingParams

        llm = LLM(**engine_kwargs)
        client = type(llm.llm_engine.engine_core)
        events.put(("ready", rank, f"{client.__module__}.{client.__qualname__}"))
        barrier.wait(barrier_timeout_s)

        tokens: dict[str, list[int]] = {}
        for round_no in range(len(ROUNDS)):
            jobs = prompts_for(rank, dp_size, round_no)
            started = time.monotonic()
            if jobs:
                outputs = llm.generate(
                    [prompt for prompt, _ in jobs],
                    [
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                        for _, n in jobs
                    ],
                    use_tqdm=False,
                )
                for (prompt, _), output in zip(jobs, outputs):
                    tokens[prompt] = list(output.outputs[0].token_ids)
            events.put(("round", rank, round_no, len(jobs), time.monotonic() - started))
            # Every rank is done with this round; let the group go idle.
            barrier.wait(barrier_timeout_s)
            time.sleep(IDLE_BEFORE_NEXT_ROUND_S)

        events.put(("result", rank, tokens))
        # Nobody shuts its engine down while a peer may still need it.
        barrier.wait(barrier_timeout_s)
        # Shut the engine down here: on return, multiprocessing joins this
        # process's children (the engine core) before the interpreter's exit
        # handlers would run LLM's finalizer, and would wait forever.
        del llm
        gc.collect()
    except BaseException:
        events.put(("error", rank, traceback.format_exc()))
        raise


def kill_tree(proc: mp.process.BaseProcess) -> None:
    """SIGKILL one rank's process and the engine processes it started."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        victims = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for victim in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()
    psutil.wait_procs(victims, timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--model", help="model directory (default: build tiny-mixtral)")
    parser.add_argument(
        "--models", default=".cache/models", help="where tiny models are built"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--output", help="write {prompt: token ids} as JSON here")
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds for every rank to build its LLM",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=180.0,
        help="seconds for all rounds of generate() once every rank is ready",
    )
    args = parser.parse_args(argv)

    if args.model:
        model = args.model
    else:
        from vllm_disagg.testing.tiny_models import build_all

        model = str(build_all(args.models)["tiny-mixtral"])

    from vllm.utils.network_utils import get_open_port

    engine_kwargs = dict(
        model=model,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        max_num_seqs=8,
        seed=0,
    )
    dp_size = args.dp_size
    master_ip, master_port = "127.0.0.1", get_open_port()

    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    barrier = ctx.Barrier(dp_size)
    barrier_timeout_s = args.startup_timeout + args.timeout
    procs = [
        ctx.Process(
            target=run_rank,
            args=(
                rank,
                dp_size,
                master_ip,
                master_port,
                engine_kwargs,
                events,
                barrier,
                barrier_timeout_s,
            ),
            name=f"dp-rank-{rank}",
        )
        for rank in range(dp_size)
    ]
    for proc in procs:
        proc.start()
    print(f"started DP ranks (pids {[p.pid for p in procs]}) on {model}", flush=True)

    ready: set[int] = set()
    results: dict[int, dict[str, list[int]]] = {}
    failed: str | None = None
    deadline = time.monotonic() + args.startup_timeout
    while failed is None and len(results) < dp_size:
        waiting_for = "start-up" if len(ready) < dp_size else "generate()"
        try:
            event = events.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            dead = [p.name for p in procs if p.exitcode is not None]
            if dead:
                failed = f"{', '.join(dead)} exited during {waiting_for}"
            elif time.monotonic() >= deadline:
                missing = sorted(set(range(dp_size)) - set(results))
                failed = f"ranks {missing} not done with {waiting_for} in time"
            continue
        kind, rank, *rest = event
        if kind == "ready":
            print(f"rank {rank}: LLM ready, client {rest[0]}", flush=True)
            ready.add(rank)
            if len(ready) == dp_size:
                deadline = time.monotonic() + args.timeout
        elif kind == "round":
            round_no, count, seconds = rest
            print(
                f"rank {rank}: round {round_no}: {count} prompts in {seconds:.2f}s",
                flush=True,
            )
        elif kind == "result":
            results[rank] = rest[0]
        elif kind == "error":
            failed = f"rank {rank} failed:\n{rest[0]}"

    exit_code = 0
    if failed is not None:
        print(f"FAILED: {failed}", file=sys.stderr, flush=True)
        exit_code = 1
    else:
        tokens = {
            prompt: ids for part in results.values() for prompt, ids in part.items()
        }
        for prompt, ids in tokens.items():
            print(f"{prompt!r}: {ids}")
        if args.output:
            Path(args.output).write_text(json.dumps(tokens, indent=1, sort_keys=True))

    # Ranks shut their engines down on exit; bounded, then killed.
    shutdown_deadline = time.monotonic() + (60.0 if failed is None else 0.0)
    for proc in procs:
        proc.join(timeout=max(0.0, shutdown_deadline - time.monotonic()))
        if proc.exitcode is None:
            print(f"killing {proc.name} (pid {proc.pid}) and its engine", flush=True)
            kill_tree(proc)
            proc.join(timeout=10)
            exit_code = 1
        elif proc.exitcode:
            print(
                f"{proc.name} exited with {proc.exitcode}", file=sys.stderr, flush=True
            )
            exit_code = exit_code or 1
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
