"""DP=2 on CPU, for real: `vllm serve` tiny Mixtral with --data-parallel-size 2.

In bf16, greedy output must match a --data-parallel-size 1 run of the same
model by vLLM's logprob rule (without expert parallelism the experts are
sharded across DP ranks, partial sums are reduced in another order, and bf16
greedy output may legitimately diverge). Token-for-token equality in float32
is checked by tests/v1/distributed/test_step_sync_dp.py
(test_200_mixed_requests_match_dp1_and_ranks_stay_in_lockstep), so this
module starts only the two bf16 servers (the DP=1 one only with ``--full``:
CI runs the patch check on the DP=2 server alone).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from vllm_disagg.patches import PATCHES
from vllm_disagg.testing.compare import GreedyResult, close_by_logprobs
from vllm_disagg.testing.openai_client import WORDS

pytestmark = pytest.mark.e2e

NUM_PROMPTS = 20
MAX_TOKENS = 24
TOP_K = 5
COMMON_ARGS = ["--max-model-len", "512", "--max-num-seqs", "32", "--seed", "0"]


def _prompts() -> list[str]:
    # Different lengths so that DP ranks schedule uneven token counts.
    return [
        " ".join(WORDS[i % 7 : i % 7 + 2 + (i * 3) % 17]) for i in range(NUM_PROMPTS)
    ]


def _greedy(server) -> list[GreedyResult]:
    def one(prompt):
        body = server.complete(
            prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            logprobs=TOP_K,
            return_token_ids=True,
            return_tokens_as_token_ids=True,
            ignore_eos=True,
        )
        return GreedyResult.from_completion(body["choices"][0])

    with ThreadPoolExecutor(max_workers=NUM_PROMPTS) as pool:
        return list(pool.map(one, _prompts()))


def _run(start_server, model, dp: int):
    """Greedy results of a bf16 server with ``dp`` ranks, its pid and children
    (while it ran) and its log; servers run one at a time (2 cores)."""
    args = [*COMMON_ARGS, "--dtype", "bfloat16", "--data-parallel-size", str(dp)]
    server = start_server(model, args, name=f"mixtral-bfloat16-dp{dp}")
    try:
        results = _greedy(server)
        pids = (server.proc.pid, _descendants(server.proc.pid))
    finally:
        server.stop()
    return results, pids, server.log_text()


@pytest.fixture(scope="module")
def dp2_run(tiny_models, start_server):
    return _run(start_server, tiny_models["tiny-mixtral"], 2)


@pytest.fixture(scope="module")
def dp1_run(tiny_models, start_server):
    return _run(start_server, tiny_models["tiny-mixtral"], 1)


def _descendants(pid: int) -> set[int]:
    return {p.pid for p in psutil.Process(pid).children(recursive=True)}


@pytest.mark.full
def test_dp2_bfloat16_close_to_dp1(dp1_run, dp2_run):
    dp1, dp2 = dp1_run[0], dp2_run[0]
    assert len(dp1) == len(dp2) == NUM_PROMPTS
    for i, (a, b) in enumerate(zip(dp1, dp2)):
        ok, why = close_by_logprobs(a, b)
        assert ok, f"prompt {i}: {why}"


def test_patches_active_inside_engine_and_worker_processes(dp2_run):
    """The engine cores and workers of the DP=2 server logged, from inside
    themselves, that every patch is in place."""
    _, (server_pid, children), text = dp2_run
    # Probes are measurement-only and off unless VLLM_DISAGG_PROBE=1.
    names = {p.name for p in PATCHES if p.kind != "probe"}

    engine_lines = re.findall(
        r"\((EngineCore_DP\d) pid=(\d+)\).*vllm_disagg: engine core dp_rank=(\d) "
        r"pid=(\d+) verified patches: (.*)",
        text,
    )
    assert {line[2] for line in engine_lines} == {"0", "1"}, text[-4000:]
    for _title, prefix_pid, _rank, pid, verified in engine_lines:
        assert prefix_pid == pid and int(pid) in children
        assert set(verified.strip().split(", ")) == names

    # Workers are spawned by each engine core and load the plugin themselves.
    engine_pids = {int(line[1]) for line in engine_lines}
    worker_lines = re.findall(
        r"\((?:VllmWorker|Worker)[-_\w]* pid=(\d+)\).*vllm_disagg: pid=(\d+) "
        r"applied \d+ patches: (.*)",
        text,
    )
    worker_pids = {int(pid) for pid, _, _ in worker_lines}
    assert len(worker_pids) == 2 and not worker_pids & engine_pids, text[-4000:]
    for prefix_pid, pid, applied in worker_lines:
        assert prefix_pid == pid and int(pid) in children
        assert set(applied.strip().split(", ")) == names
    assert server_pid not in children
