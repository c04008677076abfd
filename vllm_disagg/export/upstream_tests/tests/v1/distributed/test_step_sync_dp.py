"""Step-synchronized DP end to end on CPU: `vllm serve` of a tiny Mixtral
(built locally, no download) with --data-parallel-size 2
--data-parallel-sync step answers greedy requests with the token ids of a
DP=1 server, both ranks run the group's step count, and no DP wave message
reaches an engine (vllm:step_sync_wave_messages_total stays 0)."""

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import regex as re

from tests.v1.kv_connector.p2p_utils.openai_client import complete, random_prompt
from tests.v1.kv_connector.p2p_utils.server import VllmServer, cpu_test_env
from tests.v1.kv_connector.p2p_utils.tiny_models import build_model

pytestmark = pytest.mark.cpu_test

ARGS = [
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "16",
    "--seed",
    "0",
    "--dtype",
    "float32",
    # Compiling the tiny MoE costs more than the requests; eager float32
    # gives the same greedy tokens.
    "--enforce-eager",
]
NUM_REQUESTS = 24
_ENGINE = re.compile(r'engine="(\d+)"')


def _jobs() -> list[tuple[str, int]]:
    rng = random.Random(1234)
    return [
        (random_prompt(rng, 1, 32), rng.randint(1, 24)) for _ in range(NUM_REQUESTS)
    ]


def _run(server: VllmServer) -> list[list[int]]:
    def one(job: tuple[str, int]) -> list[int]:
        prompt, max_tokens = job
        body = complete(
            server,
            prompt,
            timeout_s=120,
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            return_token_ids=True,
        )
        return body["choices"][0]["token_ids"]

    with ThreadPoolExecutor(max_workers=NUM_REQUESTS) as pool:
        return list(pool.map(one, _jobs()))


def _step_sync(server: VllmServer, name: str) -> dict[int, float]:
    """vllm:step_sync_<name> per engine (DP rank)."""
    values = server.metrics("vllm:step_sync_").get(f"vllm:step_sync_{name}", {})
    return {int(_ENGINE.search(labels)[1]): v for labels, v in values.items()}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model("tiny-mixtral", tmp_path_factory.mktemp("models"))


def _serve(model, args, tmp_path_factory, name) -> VllmServer:
    logs = tmp_path_factory.mktemp(name)
    return VllmServer(
        model, [*ARGS, *args], log_path=logs / "server.log", env=cpu_test_env()
    )


def test_step_sync_dp2_matches_dp1_without_waves(model, tmp_path_factory):
    with _serve(model, [], tmp_path_factory, "dp1") as dp1:
        expected = _run(dp1)
    dp2_args = ["--data-parallel-size", "2", "--data-parallel-sync", "step"]
    with _serve(model, dp2_args, tmp_path_factory, "dp2") as dp2:
        got = _run(dp2)
        assert got == expected
        assert [len(ids) for ids in got] == [n for _, n in _jobs()]
        # The engines report their counters at most every half second once
        # idle: wait until both ranks settled at the coordinator's step.
        deadline = time.monotonic() + 60
        while True:
            local = _step_sync(dp2, "local_step")
            coordinator = _step_sync(dp2, "coordinator_step")
            settled = set(local) == {0, 1} and local == coordinator
            if (settled and len(set(local.values())) == 1) or (
                time.monotonic() > deadline
            ):
                break
            time.sleep(0.5)
        assert settled and local[0] == local[1] > 0, (local, coordinator)
        forward = _step_sync(dp2, "forward_steps_total")
        dummy = _step_sync(dp2, "dummy_steps_total")
        assert forward[0] > 0 and forward[1] > 0, forward
        for rank in (0, 1):
            assert forward[rank] + dummy.get(rank, 0.0) == local[rank]
        assert _step_sync(dp2, "wave_messages_total") == {0: 0.0, 1: 0.0}
        assert _step_sync(dp2, "rejected_frames_total") == {0: 0.0, 1: 0.0}
