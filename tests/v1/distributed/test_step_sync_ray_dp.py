"""Step-synchronized DP with the Ray DP backend, end to end on CPU.

``vllm serve --data-parallel-size 2 --data-parallel-backend ray`` on tiny
Mixtral: vLLM starts a local Ray cluster in the server process and one Ray
actor per DP rank. The actors must be step-sync engine cores
(``step-sync-ray-actor``) that load the patch set themselves, stay in
lockstep, serve requests pinned to one rank while the other runs only the
matching dummy passes, send no wave traffic, and stop when the server stops.

Needs ``ray`` (``requirements/ray.txt``, which ``scripts/bootstrap.sh``
installs; skipped without it). The server is plain ``vllm serve``: the
``cpu-ray-dp`` enabler gives the CPU platform its Ray device key, and
``startup-validation`` starts each rank's workers with the ``mp`` executor
(``--distributed-executor-backend`` is left unset on purpose). The local Ray
cluster needs ``dp_size * (world_size + 1)`` = 4 logical CPUs, more than a
2-core CI machine reports, so the test raises Ray's count with
``RAY_OVERRIDE_RESOURCES`` (logical only: the engines share the real cores).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_disagg.testing import openai_client
from vllm_disagg.testing.server import VllmServer, cpu_test_env
from vllm_disagg.testing.step_sync import step_sync_metric

pytest.importorskip("ray")

pytestmark = pytest.mark.e2e

ARGS = [
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "32",
    "--seed",
    "0",
    "--dtype",
    "float32",
    "--data-parallel-size",
    "2",
    "--data-parallel-backend",
    "ray",
    # Step sync over Ray is the subject, not torch.compile (about 45 s of it).
    "--enforce-eager",
]
RAY_ENV = {
    # 2 DP ranks x (1 worker bundle + 1 engine-actor bundle) logical CPUs.
    "RAY_OVERRIDE_RESOURCES": '{"CPU": 8}',
    "RAY_USAGE_STATS_ENABLED": "0",
    # Every actor line in the server log, not one per line "across cluster".
    "RAY_DEDUP_LOGS": "0",
}
PROMPTS = [f"step sync over ray keeps rank {i} in lockstep" for i in range(8)]
MAX_TOKENS = 12
# Ray adds its cluster start and actor scheduling to a DP=2 start-up that
# already takes 2-3 minutes on 2 cores (ready after 171 s in one run); a busy
# machine pushed it past the default 300 s once.
STARTUP_TIMEOUT_S = 480.0
SETTLE_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def ray_dp2_server(tiny_models, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("ray-server-logs")
    server = VllmServer(
        tiny_models["tiny-mixtral"],
        ARGS,
        log_path=log_dir / "stepsync-ray-dp2.log",
        env=cpu_test_env(**RAY_ENV),
        startup_timeout_s=STARTUP_TIMEOUT_S,
    )
    started = time.monotonic()
    server.start()
    print(f"Ray DP=2 server ready after {time.monotonic() - started:.0f}s")
    yield server
    server.stop()


def complete(server: VllmServer, prompt: str, dp_rank: int) -> list[int]:
    body = openai_client.complete(
        server,
        prompt,
        headers={"X-data-parallel-rank": str(dp_rank)},
        timeout_s=300,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        return_token_ids=True,
    )
    return body["choices"][0]["token_ids"]


def settled_steps(server: VllmServer) -> dict[int, float]:
    """Wait until both ranks report local_step == coordinator_step, unchanged
    over two scrapes; return {rank: local_step}."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    previous = None
    local, coord = {}, {}
    while time.monotonic() < deadline:
        local = step_sync_metric(server, "local_step")
        coord = step_sync_metric(server, "coordinator_step")
        settled = len(local) == 2 and local == coord and len(set(local.values())) == 1
        if settled and local == previous:
            return local
        previous = local if settled else None
        time.sleep(1.0)
    raise AssertionError(f"ranks did not settle: local={local} coordinator={coord}")


def test_ray_actors_are_step_sync_engines(ray_dp2_server):
    log = ray_dp2_server.log_text()
    # Plain `vllm serve`: the executor backend was left unset and became mp.
    assert "workers with --distributed-executor-backend mp" in log, (
        ray_dp2_server.log_tail()
    )
    for rank in (0, 1):
        assert f"Ray engine actor dp_rank={rank} " in log, ray_dp2_server.log_tail()
        assert f"step sync DP engine core dp_rank={rank}/2" in log, (
            ray_dp2_server.log_tail()
        )
    verified = [
        line for line in log.splitlines() if "Ray engine actor dp_rank=" in line
    ]
    assert all(
        "step-sync-ray-actor" in line and "step-sync-dp-engine" in line
        for line in verified
    )


def test_requests_to_one_rank_complete_and_ranks_stay_in_lockstep(ray_dp2_server):
    server = ray_dp2_server
    before = settled_steps(server)
    forward_before = step_sync_metric(server, "forward_steps_total")
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        outputs = list(pool.map(lambda p: complete(server, p, dp_rank=1), PROMPTS))
    assert all(len(tokens) == MAX_TOKENS for tokens in outputs)
    after = settled_steps(server)
    assert after[0] == after[1] > before[0]
    forward = step_sync_metric(server, "forward_steps_total")
    # Rank 0 had nothing to do: it ran only the dummy passes matching rank 1's.
    assert forward[0] == forward_before.get(0, 0.0)
    assert forward[1] > forward_before.get(1, 0.0)
    for name in (
        "start_dp_wave_received_total",
        "wave_stamped_requests_total",
        "wave_outputs_sent_total",
    ):
        assert set(step_sync_metric(server, name).values()) == {0.0}, name


def test_sigterm_stops_the_ray_dp_server(ray_dp2_server):
    server = ray_dp2_server
    started = time.monotonic()
    returncode = server.stop(timeout_s=STOP_TIMEOUT_S)
    elapsed = time.monotonic() - started
    log = server.log_text()
    print(f"Ray DP=2 server stopped with {returncode} after {elapsed:.1f}s")
    assert elapsed < STOP_TIMEOUT_S, server.log_tail()
    for failure in ("StepSyncFailure", "silent for", "did not stop"):
        assert failure not in log, f"{failure!r} in the log of a clean shutdown"
