"""Offline data parallelism with step sync: one ``LLM`` per DP rank (tiny Mixtral, f32).

Runs ``examples/offline_inference/data_parallel_tiny_moe.py``, upstream's
offline DP pattern (one process per rank, ``VLLM_DP_*`` environment), with
DP=2 and with DP=1, and requires:

* every ``generate()`` returns, including after the group went idle and on a
  rank whose peer does not call ``generate()`` at all. Upstream's sync client
  kept ``dp_engines_running()`` true until an output carrying
  ``wave_complete``, which step-sync engines never send, so ``generate()``
  blocked forever after its last request (patch ``step-sync-clients``);
* the DP=2 token ids equal DP=1, token for token.

Each run is bounded; on timeout the processes the run started are killed and
its output is attached to the failure.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from vllm_disagg.testing.server import cpu_test_env

pytestmark = pytest.mark.e2e

EXAMPLE = (
    Path(__file__).resolve().parents[3]
    / "examples/offline_inference/data_parallel_tiny_moe.py"
)
STARTUP_TIMEOUT_S = 420.0
# All rounds of generate() once every rank is up: a few seconds when it works.
GENERATE_TIMEOUT_S = 90.0
# The driver's own shutdown wait (60 s) and kill, plus slack.
RUN_TIMEOUT_S = STARTUP_TIMEOUT_S + GENERATE_TIMEOUT_S + 120.0


def _kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and every process it started (its own process group)."""
    try:
        victims = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        victims = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for victim in victims:  # in case one left the group
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()
    proc.wait(timeout=30)


def _run_example(model: Path, dp_size: int, workdir: Path) -> tuple[dict, str, float]:
    out = workdir / f"tokens-dp{dp_size}.json"
    log_path = workdir / f"offline-dp{dp_size}.log"
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--model",
        str(model),
        "--dp-size",
        str(dp_size),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--output",
        str(out),
        "--startup-timeout",
        str(STARTUP_TIMEOUT_S),
        "--timeout",
        str(GENERATE_TIMEOUT_S),
    ]
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=cpu_test_env(),
            start_new_session=True,
        )
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            _kill_run(proc)
            timed_out = True
        else:
            timed_out = False
    elapsed = time.monotonic() - started
    text = log_path.read_text(errors="replace")
    tail = "\n".join(text.splitlines()[-150:])
    if timed_out or proc.returncode != 0:
        pytest.fail(
            f"offline DP={dp_size} run "
            + (
                f"killed after {elapsed:.0f}s"
                if timed_out
                else f"exited {proc.returncode}"
            )
            + f" ({log_path}):\n{tail}"
        )
    return json.loads(out.read_text()), text, elapsed


def _load_example():
    spec = importlib.util.spec_from_file_location("data_parallel_tiny_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_offline_dp_llm_per_rank_matches_dp1(tiny_models, tmp_path):
    example = _load_example()
    model = tiny_models["tiny-mixtral"]
    dp2, log, dp2_s = _run_example(model, 2, tmp_path)

    # Every rank's generate() returned in every round, on the patched client;
    # in round 1 only rank 1 had prompts and rank 0 did not call generate().
    assert (
        log.count("client vllm_disagg.v1.engine.core_client.StepSyncSyncMPClient") == 2
    )
    done = set(re.findall(r"^rank (\d+): round (\d+): (\d+) prompts", log, re.M))
    assert done == {
        (str(rank), str(round_no), str(len(example.prompts_for(rank, 2, round_no))))
        for rank in range(2)
        for round_no in range(len(example.ROUNDS))
    }
    assert ("0", "1", "0") in done

    dp1, _, dp1_s = _run_example(model, 1, tmp_path)
    expected = {prompt: n for jobs in example.ROUNDS for prompt, n in jobs}
    assert {prompt: len(ids) for prompt, ids in dp1.items()} == expected
    assert dp2 == dp1, (
        f"DP=2 and DP=1 differ (DP=2 run {dp2_s:.0f}s, DP=1 run {dp1_s:.0f}s)"
    )
