"""How fast does a busy rank's step request wake an idle peer?

No vLLM: the real Coordinator and Participant classes on loopback. DP rank 0
(with the coordinator thread, as in the engine) starts a pass nobody granted
yet and then keeps its thread busy in Python, as an engine thread preparing a
forward pass does. DP rank 1 runs in another process and records when the
grant reaches it. Measured with the grant wait of ``Participant`` (the
default) and with it switched off (``MAX_GRANT_WAIT_S = 0``), side by side.

Writes benchmarks/results/step_sync_grant_latency.{json,md} (``--out DIR``: elsewhere).

    .venv/bin/python benchmarks/step_sync_grant_latency.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import statistics
import sys
import time

from _deps import require  # benchmarks/_deps.py: sys.path[0] when run as a script
from common import report

from vllm_disagg.v1.engine.step_sync import (
    Coordinator,
    Participant,
    StepSyncConfig,
    new_group_secret,
    participant,
)


def idle_peer(
    address: str, secret: bytes, grants: mp.Queue, ready: mp.Event, stop: mp.Event
) -> None:
    """DP rank 1: blocked, as an idle engine is; reports when each grant lands."""
    inbox: queue.Queue = queue.Queue()
    config = StepSyncConfig(dp_size=2)
    part = Participant(
        config, 1, address, secret, on_grant=inbox.put, on_failure=lambda reason: None
    ).start()
    ready.set()
    while not stop.is_set():
        try:
            step = inbox.get(timeout=0.2)
        except queue.Empty:
            continue
        grants.put((step, time.monotonic()))  # CLOCK_MONOTONIC: system-wide
    part.close()


def keep_busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(busy_s: float, trials: int, wait: bool) -> list[float]:
    participant.MAX_GRANT_WAIT_S = 0.02 if wait else 0.0  # where Participant reads it
    config = StepSyncConfig(dp_size=2)
    secret = new_group_secret()
    coordinator = Coordinator(config, "tcp://127.0.0.1:0", secret).start()
    ctx = mp.get_context("spawn")
    grants, ready, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    peer = ctx.Process(
        target=idle_peer, args=(coordinator.address, secret, grants, ready, stop)
    )
    peer.start()
    rank0 = Participant(
        config, 0, coordinator.address, secret, lambda s: None, lambda reason: None
    )
    rank0.start()
    latencies = []
    try:
        assert ready.wait(30), "peer did not start"
        time.sleep(0.5)  # both registered; drain the registration grants
        while not grants.empty():
            grants.get()
        for _ in range(trials):
            start = time.monotonic()
            rank0.begin_forward(dummy=False)  # the pass that wakes the group
            keep_busy(busy_s)  # preparing the forward pass
            while True:
                step, landed = grants.get(timeout=5)
                if step >= rank0.local_step:
                    break
            latencies.append(landed - start)
            # The group is idle again at the granted step.
            core = rank0.core
            core.local_step = core.coord_step = core.requested = step
            rank0.observe_grant(step)
            time.sleep(0.05)
    finally:
        stop.set()
        peer.join(10)
        rank0.close()
        coordinator.close()
    return latencies


def markdown(rows: list[dict], trials: int) -> list[str]:
    return [
        "# Wake-up latency: busy rank 0 asks for a step, idle rank 1 gets the grant",
        "",
        report.generated(
            "step_sync_grant_latency.py",
            f"{trials} trials per row; rank 0 holds the coordinator thread, as in the "
            "engine.",
        ),
        "",
        *report.table(
            [
                "rank 0 busy in Python after asking",
                "grant wait",
                "median ms",
                "p90 ms",
                "max ms",
            ],
            [
                [
                    f"{r['busy_ms']:.0f} ms",
                    "on" if r["grant_wait"] else "off",
                    f"{r['median_ms']:.2f}",
                    f"{r['p90_ms']:.2f}",
                    f"{r['max_ms']:.2f}",
                ]
                for r in rows
            ],
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--busy-ms", type=float, nargs="+", default=[0.0, 5.0, 20.0])
    report.add_out_argument(parser)
    args = parser.parse_args()
    require()  # nothing beyond the runtime's requirements (yet)
    rows = []
    for busy_ms in args.busy_ms:
        for wait in (False, True):
            lat = measure(busy_ms / 1000, args.trials, wait)
            rows.append(
                {
                    "busy_ms": busy_ms,
                    "grant_wait": wait,
                    "median_ms": 1000 * statistics.median(lat),
                    "p90_ms": 1000 * statistics.quantiles(lat, n=10)[-1],
                    "max_ms": 1000 * max(lat),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    stem = (args.out or report.RESULTS) / "step_sync_grant_latency"
    report.write(stem, rows, markdown(rows, args.trials))
    return 0


if __name__ == "__main__":
    sys.exit(main())
