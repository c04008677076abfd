"""Step-synchronized DP end to end: real `vllm serve` on tiny Mixtral (CPU, f32).

* internal LB (one server, DP=2): 200 requests of random lengths, some
  streamed, some cancelled mid-generation; the rest must equal a DP=1 run
  token for token, both ranks must end at the same forward-pass count, and no
  wave traffic may cross an engine's boundary;
* pause/resume through the RL endpoints: both ranks stop at one step, run
  nothing while paused, and frozen requests finish correctly after resume;
* a rank whose only request is unschedulable (its KV lookup is pending, as on
  a decode instance waiting for a prefill) neither stalls its busy peer nor
  spins dummy passes once the peer is idle; SIGTERM then stops every process
  of the server by itself, with no rank reporting a failed group;
* what the DP group's TCP store serves lets no local process stop the group;
* external LB (one server per rank): requests sent only to rank 1 complete
  while rank 0 runs the matching dummy passes; killing rank 1 makes rank 0
  fail within a bounded time instead of hanging.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import pytest
import requests
import zmq

from vllm_disagg.testing.openai_client import (
    WORDS,
    complete,
    random_prompt,
    stream_completion,
)
from vllm_disagg.testing.openai_client import (
    token_ids as chunk_token_ids,
)
from vllm_disagg.testing.server import VllmServer, get_free_port
from vllm_disagg.testing.step_sync import keys_from, read_store, step_sync_metric
from vllm_disagg.v1.engine.step_sync import (
    PROTOCOL_VERSION,
    TO_COORDINATOR,
    RankState,
    seal,
)
from vllm_disagg.v1.engine.step_sync.rendezvous import STORE_KEY

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 200
COMMON_ARGS = [
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "32",
    "--seed",
    "0",
    "--dtype",
    "float32",
]
# torch.compile is the subject of the DP=1 reference and the shared DP=2
# server only (their outputs must agree, test_200_mixed_...). The other
# servers test step sync, and compiling the tiny MoE for each DP=2 start
# costs about 45 s on 2 cores; eager float32 gives the same greedy tokens.
EAGER_ARGS = ["--enforce-eager"]
DRAIN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Job:
    index: int
    prompt: str
    max_tokens: int
    mode: str  # "plain" | "stream" | "cancel"


# A cancelled stream is cut after its third token. On a loaded machine the
# API server may batch many steps into one SSE chunk (a 40-token stream once
# arrived whole before the client could cut it), so cancelled requests ask
# for far more tokens than one such chunk can hold.
CANCEL_MAX_TOKENS = 256


def _workload() -> list[Job]:
    rng = random.Random(1234)
    jobs = []
    for i in range(NUM_REQUESTS):
        prompt = random_prompt(rng, 1, 48)
        mode = "cancel" if i % 10 == 3 else "stream" if i % 3 == 0 else "plain"
        max_tokens = CANCEL_MAX_TOKENS if mode == "cancel" else rng.randint(1, 32)
        jobs.append(Job(i, prompt, max_tokens, mode))
    return jobs


# Long enough that none can finish between its first token and the pause: on a
# loaded 2-core machine the engines run well ahead of the streamed chunks.
PAUSE_MAX_TOKENS = 256
PAUSE_JOBS = [
    Job(1000 + i, " ".join(WORDS[i : i + 6]), PAUSE_MAX_TOKENS, "stream")
    for i in range(6)
]
HELD_JOB = Job(2000, " ".join(WORDS[3:20]), 16, "plain")
BUSY_JOBS = [Job(2001 + i, " ".join(WORDS[i : i + 10]), 16, "plain") for i in range(6)]
# In flight on rank 1 when SIGTERM arrives (rank 0 idle): one generating, one
# still waiting for its (delayed) KV lookup. Drain must finish both.
DRAIN_STREAM_JOB = Job(2100, " ".join(WORDS[2:14]), 192, "stream")
DRAIN_HELD_JOB = Job(2101, " ".join(WORDS[5:25]), 24, "plain")
SLEEP_JOBS = [Job(2200 + i, " ".join(WORDS[i : i + 8]), 12, "plain") for i in range(4)]
# Held requests wait for a file the test creates when it is ready for them
# (a fixed delay had to guess how long a loaded host needs to get there);
# this is only the backstop.
HOLD_S = 100.0
BUSY_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 60.0


def _params(job: Job, stream: bool) -> dict:
    return {
        "max_tokens": job.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }


def run_job(
    server: VllmServer,
    job: Job,
    on_first_chunk=None,
    dp_rank: int | None = None,
    progress: dict[int, int] | None = None,
    **extra,
) -> list[int]:
    """Token ids generated for ``job``; a cancelled job returns what it got
    before the client hung up. ``dp_rank`` pins the request to one engine;
    ``progress[job.index]`` follows the number of tokens streamed so far."""
    headers = {} if dp_rank is None else {"X-data-parallel-rank": str(dp_rank)}
    if job.mode == "plain":
        params = {**_params(job, False), **extra}
        body = complete(server, job.prompt, headers=headers, timeout_s=300, **params)
        return body["choices"][0]["token_ids"]
    token_ids: list[int] = []
    params = {**_params(job, True), **extra}
    stream = stream_completion(
        server, job.prompt, headers=headers, timeout_s=300, **params
    )
    with contextlib.closing(stream) as chunks:
        for chunk in chunks:
            token_ids += chunk_token_ids(chunk)
            if progress is not None:
                progress[job.index] = len(token_ids)
            if on_first_chunk is not None and token_ids:
                on_first_chunk()
                on_first_chunk = None
            if job.mode == "cancel" and len(token_ids) >= 3:
                break  # leaving the block closes the connection mid-generation
    return token_ids


def run_all(
    server: VllmServer, jobs: list[Job], workers: int = 48
) -> dict[int, list[int]]:
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(lambda job: (job.index, run_job(server, job)), jobs)
        return dict(results)


def wait_until_still(
    read, timeout_s: float, what: str, ok=lambda value: True, interval_s: float = 1.0
):
    """Read until two reads ``interval_s`` apart are equal (and ``ok``);
    return that value, or fail after ``timeout_s`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        value = read()
        if ok(value) and value == previous:
            return value
        previous = value if ok(value) else None
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: {value}")
        time.sleep(interval_s)


def wait_for_settled_steps(
    servers: list[VllmServer], timeout_s: float = DRAIN_TIMEOUT_S
):
    """Wait until every rank reports local_step == coordinator_step and the
    values stop moving; return {rank: local_step}."""

    def read() -> tuple[dict, dict]:
        local, coord = {}, {}
        for server in servers:
            local.update(step_sync_metric(server, "local_step"))
            coord.update(step_sync_metric(server, "coordinator_step"))
        return local, coord

    def settled(steps: tuple[dict, dict]) -> bool:
        local, coord = steps
        return bool(local) and local == coord and len(set(local.values())) == 1

    local, _ = wait_until_still(
        read, timeout_s, "ranks did not settle (local, coordinator)", ok=settled
    )
    return local


@pytest.fixture(scope="module")
def dp1_reference(tiny_models, start_server):
    server = start_server(tiny_models["tiny-mixtral"], COMMON_ARGS, name="stepsync-dp1")
    try:
        jobs = [
            Job(j.index, j.prompt, j.max_tokens, "plain")
            for j in [
                *_workload(),
                *PAUSE_JOBS,
                HELD_JOB,
                *BUSY_JOBS,
                DRAIN_STREAM_JOB,
                DRAIN_HELD_JOB,
                *SLEEP_JOBS,
            ]
        ]
        return run_all(server, jobs)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def dp2_server(tiny_models, start_server):
    server = start_server(
        tiny_models["tiny-mixtral"],
        [*COMMON_ARGS, "--data-parallel-size", "2"],
        name="stepsync-dp2",
        VLLM_SERVER_DEV_MODE="1",
    )
    yield server
    server.stop()


def test_200_mixed_requests_match_dp1_and_ranks_stay_in_lockstep(
    dp1_reference, dp2_server
):
    jobs = _workload()
    got = run_all(dp2_server, jobs)
    cancelled = [job for job in jobs if job.mode == "cancel"]
    assert len(cancelled) == 20 and sum(job.mode == "stream" for job in jobs) > 50
    for job in jobs:
        if job.mode == "cancel":
            assert 3 <= len(got[job.index]) < job.max_tokens, job
            continue
        assert len(got[job.index]) == job.max_tokens, job
        assert got[job.index] == dp1_reference[job.index], (
            f"request {job.index} ({job.mode})"
        )

    steps = wait_for_settled_steps([dp2_server])
    assert set(steps) == {0, 1}
    forward = step_sync_metric(dp2_server, "forward_steps_total")
    dummy = step_sync_metric(dp2_server, "dummy_steps_total")
    # Both ranks served requests; each ran exactly the group's step count.
    assert forward[0] > 0 and forward[1] > 0
    assert forward[0] + dummy[0] == forward[1] + dummy[1] == steps[0]
    # Cancelled requests were aborted in the engines: nothing is left running.
    running = dp2_server.metrics("vllm:num_requests_running")[
        "vllm:num_requests_running"
    ]
    assert sum(running.values()) == 0, running


def test_no_wave_traffic_on_the_wire(dp2_server):
    """Every engine counts wave traffic crossing its boundary: START_DP_WAVE
    received, requests stamped with a wave, outputs carrying wave_complete /
    start_wave. Step sync produces none of it."""
    run_all(dp2_server, _workload()[:20])
    wait_for_settled_steps([dp2_server])
    for name in (
        "start_dp_wave_received",
        "wave_stamped_requests",
        "wave_outputs_sent",
    ):
        values = step_sync_metric(dp2_server, f"{name}_total")
        assert values == {0: 0.0, 1: 0.0}, (name, values)
    malformed = step_sync_metric(dp2_server, "malformed_messages_total")
    assert malformed == {0: 0.0, 1: 0.0}
    assert step_sync_metric(dp2_server, "coordinator_pause_violations_total") == {
        0: 0.0
    }


def _coordinator_address(server: VllmServer) -> str:
    match = re.search(
        r"step sync DP engine core dp_rank=0/\d+ .*coordinator=(tcp://\S+)",
        server.log_text(),
    )
    assert match, "rank 0 did not log its coordinator address"
    return match.group(1)


def _stranger_frames(rng: random.Random) -> list[bytes]:
    """What someone without the group secret can send to the coordinator port:
    garbage, truncated or oversized frames, and registrations and step
    requests for the real ranks with made-up MACs."""
    state = RankState(
        version=PROTOCOL_VERSION,
        dp_rank=rng.randrange(2),
        dp_size=2,
        lookahead=2,
        incarnation=rng.choice(["intruder", "restarted"]),
        seq=rng.randint(1, 2**40),
        requested=rng.randint(0, 10**6),
        local_step=0,
        intent=rng.randint(0, 9),
        want_pause=rng.random() < 0.5,
        pause_ready=rng.random() < 0.5,
        leaving=rng.random() < 0.2,
        left=rng.random() < 0.2,
    )
    payload = msgspec.msgpack.encode(state)
    kind = rng.randrange(3)
    if kind == 0:
        return [rng.randbytes(rng.randint(0, 300))]
    if kind == 1:
        return [payload[: rng.randint(0, len(payload))], rng.randbytes(16)]
    return [payload, rng.randbytes(16)]


def test_foreign_frames_flooding_the_coordinator_change_no_output(
    dp1_reference, dp2_server
):
    """Thousands of foreign frames at the coordinator port while requests
    flow: every output equals DP=1, nothing is aborted, all are counted."""
    address = _coordinator_address(dp2_server)
    before = step_sync_metric(dp2_server, "coordinator_unauthenticated_messages_total")
    stop = threading.Event()
    sent = [0]

    def flood():
        rng = random.Random(99)
        # Frames over the 1 KiB bound make ZMQ drop the connection they came
        # on, so they get a connection of their own.
        sock, big = (zmq.Context.instance().socket(zmq.DEALER) for _ in range(2))
        for s in (sock, big):
            s.setsockopt(zmq.SNDTIMEO, 1000)
            s.connect(address)
        deadline = time.monotonic() + 120
        try:
            while not stop.is_set() and sent[0] < 5000 and time.monotonic() < deadline:
                with contextlib.suppress(zmq.ZMQError):
                    if sent[0] % 10 == 0:
                        big.send_multipart(
                            [rng.randbytes(2000), rng.randbytes(16)], zmq.NOBLOCK
                        )
                    else:
                        sock.send_multipart(_stranger_frames(rng))
                sent[0] += 1
                if sent[0] % 100 == 0:
                    time.sleep(0.01)
        finally:
            sock.close(linger=2000)
            big.close(linger=0)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        jobs = [j for j in _workload() if j.mode == "plain"][:32]
        got = run_all(dp2_server, jobs)
    finally:
        flooder.join(150)
        stop.set()
    for job in jobs:
        assert got[job.index] == dp1_reference[job.index], f"request {job.index}"
    assert sent[0] >= 1000, sent[0]
    steps = wait_for_settled_steps([dp2_server])
    assert steps[0] == steps[1]
    after = step_sync_metric(dp2_server, "coordinator_unauthenticated_messages_total")
    assert after.get(0, 0.0) - before.get(0, 0.0) > 100, (before, after)
    assert requests.get(f"{dp2_server.url}/health", timeout=10).status_code == 200


def _dp_store(server: VllmServer) -> tuple[str, int]:
    match = re.search(
        r"step sync DP engine core dp_rank=0/\d+ .*dp_store=(\S+):(\d+) ",
        server.log_text(),
    )
    assert match, "rank 0 did not log its DP store"
    return match.group(1), int(match.group(2))


def test_a_local_process_reading_the_dp_store_cannot_stop_the_group(
    dp1_reference, dp2_server
):
    """Everything the DP group's TCP store serves to anyone who connects gives no
    one the key to speak for a rank: a new incarnation of each rank, forged under
    every value read and every key derived from them (one such frame, under the
    secret the store used to serve, aborted the group), changes nothing."""
    served = read_store(*_dp_store(dp2_server))
    published = json.loads(served[STORE_KEY])
    address = _coordinator_address(dp2_server)
    assert published["address"] == address
    keys = sorted(keys_from(served))
    before = step_sync_metric(dp2_server, "coordinator_unauthenticated_messages_total")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDTIMEO, 1000)
    sock.connect(address)
    try:
        for seq, key in enumerate(keys, start=2**40):
            for rank in (0, 1):
                state = RankState(
                    PROTOCOL_VERSION,
                    rank,
                    2,
                    2,
                    "a stranger",
                    seq,
                    0,
                    0,
                    0,
                    False,
                    False,
                    False,
                    rank == 1,
                )
                sock.send_multipart(seal(key, TO_COORDINATOR, state))
    finally:
        sock.close(linger=5000)
    jobs = [j for j in _workload() if j.mode == "plain"][:8]
    got = run_all(dp2_server, jobs)
    for job in jobs:
        assert got[job.index] == dp1_reference[job.index], f"request {job.index}"
    after = step_sync_metric(dp2_server, "coordinator_unauthenticated_messages_total")
    assert after[0] - before.get(0, 0.0) >= 2 * len(keys), (len(keys), after)
    log = dp2_server.log_text()
    assert "re-registered" not in log and "aborted the DP group" not in log
    assert requests.get(f"{dp2_server.url}/health", timeout=10).status_code == 200


def test_idle_group_runs_no_steps(dp2_server):
    before = wait_for_settled_steps([dp2_server])
    time.sleep(3.0)
    assert wait_for_settled_steps([dp2_server]) == before


def test_pause_stops_all_ranks_at_one_step_and_resume_restarts_them(
    dp1_reference, dp2_server
):
    # Pause as soon as the first token streams. Waiting for every stream to
    # start instead let the earliest ones run to max_tokens on a busy machine
    # before the pause landed; requests not yet running must freeze as well.
    generating = threading.Event()
    progress: dict[int, int] = {}
    with ThreadPoolExecutor(max_workers=len(PAUSE_JOBS)) as pool:
        futures = {
            job.index: pool.submit(
                run_job,
                dp2_server,
                job,
                on_first_chunk=generating.set,
                progress=progress,
            )
            for job in PAUSE_JOBS
        }
        assert generating.wait(timeout=120), "no request started generating"
        r = requests.post(
            f"{dp2_server.url}/pause", params={"mode": "keep"}, timeout=120
        )
        assert r.status_code == 200, r.text
        paused = wait_for_settled_steps([dp2_server])
        # Chunks made before the pause may still be in flight.
        frozen = wait_until_still(
            lambda: dict(progress), 30, "tokens kept arriving while paused"
        )
        time.sleep(2.0)
        assert wait_for_settled_steps([dp2_server]) == paused, (
            "a rank stepped while paused"
        )
        # The streams drained what was generated before the pause, then stopped.
        assert progress == frozen, "tokens arrived while paused"
        done = {i: f.exception() or "finished" for i, f in futures.items() if f.done()}
        assert not done, f"keep mode must freeze requests: {done}"
        assert all(n < PAUSE_MAX_TOKENS for n in frozen.values()), frozen
        r = requests.post(f"{dp2_server.url}/resume", timeout=60)
        assert r.status_code == 200, r.text
        for index, future in futures.items():
            assert future.result(timeout=300) == dp1_reference[index], (
                f"request {index}"
            )
    resumed = wait_for_settled_steps([dp2_server])
    assert resumed[0] > paused[0]


def engine_cpu_seconds(server: VllmServer) -> float:
    """CPU time used so far by the server's engine-core processes."""
    import psutil

    total = 0.0
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in " ".join(child.cmdline()):
                times = child.cpu_times()
                total += times.user + times.system
    return total


def test_sleep_under_dp_freezes_every_rank_without_spinning(dp1_reference, dp2_server):
    """Sleep (level 0 on CPU: vLLM has no weight offload there) pauses the
    whole group at one step; sleeping engines block instead of spinning, a
    request sent meanwhile waits, and wake-up runs it as DP=1 would."""
    url = dp2_server.url
    r = requests.post(f"{url}/sleep", params={"level": 0, "mode": "keep"}, timeout=120)
    assert r.status_code == 200, r.text
    assert requests.get(f"{url}/is_sleeping", timeout=10).json()["is_sleeping"] is True
    asleep = wait_for_settled_steps([dp2_server])
    with ThreadPoolExecutor(max_workers=len(SLEEP_JOBS)) as pool:
        futures = {
            job.index: pool.submit(run_job, dp2_server, job) for job in SLEEP_JOBS
        }
        cpu_before = engine_cpu_seconds(dp2_server)
        time.sleep(3.0)
        cpu_used = engine_cpu_seconds(dp2_server) - cpu_before
        assert wait_for_settled_steps([dp2_server]) == asleep, (
            "a rank stepped while asleep"
        )
        assert not any(f.done() for f in futures.values()), "a request ran while asleep"
        # Two engines blocked on their queues use next to nothing; one
        # spinning would burn about a core for the whole interval.
        assert cpu_used < 1.5, f"engine cores used {cpu_used:.2f} CPU-s in 3 s asleep"
        r = requests.post(f"{url}/wake_up", params={"tags": "scheduling"}, timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "awake", r.text
        for index, future in futures.items():
            assert future.result(timeout=120) == dp1_reference[index], (
                f"request {index}"
            )
    assert requests.get(f"{url}/is_sleeping", timeout=10).json()["is_sleeping"] is False
    awake = wait_for_settled_steps([dp2_server])
    assert awake[0] > asleep[0]


@pytest.fixture(scope="module")
def dp2_delayed_lookup_server(tiny_models, start_server):
    connector = {
        "kv_connector": "DelayedLookupConnector",
        "kv_connector_module_path": "vllm_disagg.testing.kv_connectors",
        "kv_role": "kv_both",
    }
    server = start_server(
        tiny_models["tiny-mixtral"],
        [
            *COMMON_ARGS,
            *EAGER_ARGS,
            "--data-parallel-size",
            "2",
            "--kv-transfer-config",
            json.dumps(connector),
            # Drain on SIGTERM; one API server, which upstream drains too
            # (with one per rank, upstream's API servers cut streams at once).
            "--shutdown-timeout",
            str(int(SHUTDOWN_TIMEOUT_S)),
            "--api-server-count",
            "1",
            # The coordinator in rank 0's child process (the default from DP = 32):
            # the drain and the group's exit below run through its pipe.
            "--additional-config",
            json.dumps({"step_sync_coordinator": "process"}),
        ],
        name="stepsync-dp2-delayed-lookup",
    )
    yield server
    server.stop()


def waiting_requests(server: VllmServer, dp_rank: int) -> float:
    # Absent until the engines' first stats reach the front end.
    waiting = server.metrics("vllm:num_requests_waiting").get(
        "vllm:num_requests_waiting", {}
    )
    return sum(v for labels, v in waiting.items() if f'engine="{dp_rank}"' in labels)


def _hold(release_file) -> dict:
    return {"lookup_delay_s": HOLD_S, "lookup_release_file": str(release_file)}


def test_rank_holding_only_unschedulable_requests_neither_stalls_nor_spins(
    dp1_reference, dp2_delayed_lookup_server, tmp_path
):
    """Upstream failure mode: a rank whose requests all wait for remote KV
    either skips its dummy pass (its peer deadlocks in the MoE collective) or
    runs dummy passes forever. Here rank 1 holds one such request."""
    server = dp2_delayed_lookup_server
    steps_before = wait_for_settled_steps([server])
    dummy_before = step_sync_metric(server, "dummy_steps_total")
    pool = ThreadPoolExecutor(max_workers=1 + len(BUSY_JOBS))
    try:
        release = tmp_path / "release-held"
        held = pool.submit(
            run_job, server, HELD_JOB, dp_rank=1, kv_transfer_params=_hold(release)
        )
        deadline = time.monotonic() + 30
        while waiting_requests(server, 1) < 1:
            assert time.monotonic() < deadline and not held.done(), (
                "held request never queued"
            )
            time.sleep(0.2)

        # Rank 0 works while rank 1 holds nothing schedulable: rank 1 must
        # run the matching dummy passes or rank 0 would block in a collective.
        busy = {
            job.index: pool.submit(run_job, server, job, dp_rank=0) for job in BUSY_JOBS
        }
        for index, future in busy.items():
            assert future.result(timeout=BUSY_TIMEOUT_S) == dp1_reference[index], (
                f"request {index}"
            )

        # Rank 0 is done; rank 1 still holds its request: the group is idle.
        idle = wait_for_settled_steps([server])
        time.sleep(2.0)
        assert wait_for_settled_steps([server]) == idle, (
            "a rank kept stepping while idle"
        )
        assert not held.done() and waiting_requests(server, 1) == 1, (
            "the held request was released before the idle check; raise HOLD_S "
            f"({HOLD_S})"
        )
        release.touch()
        assert (
            held.result(timeout=HOLD_S + BUSY_TIMEOUT_S)
            == dp1_reference[HELD_JOB.index]
        )
    finally:
        # After a failure a request may hang in a stuck engine: do not wait
        # for it here; stopping the server ends it.
        pool.shutdown(wait=False, cancel_futures=True)

    steps = wait_for_settled_steps([server])
    forward = step_sync_metric(server, "forward_steps_total")
    dummy = step_sync_metric(server, "dummy_steps_total")
    assert forward[0] + dummy[0] == forward[1] + dummy[1] == steps[0]
    assert idle[1] > steps_before[1] and dummy[1] > dummy_before.get(1, 0.0), (
        "rank 1 ran no dummy passes for rank 0's work"
    )
    assert steps[1] > idle[1], "the released request ran no real passes"


def test_sigterm_drains_in_flight_work_and_the_group_leaves_at_one_step(
    dp1_reference, dp2_delayed_lookup_server, tmp_path
):
    """Drain shutdown is a group phase: rank 0 is idle, rank 1 is generating
    one request and waiting for remote KV for another when SIGTERM arrives.
    The idle rank must not leave (rank 1's passes need it); both requests
    complete; every process exits by itself, and no rank mistakes its peers
    leaving for a failure of the group."""
    server = dp2_delayed_lookup_server
    wait_for_settled_steps([server])
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        started = threading.Event()
        progress: dict[int, int] = {}
        stream = pool.submit(
            run_job,
            server,
            DRAIN_STREAM_JOB,
            on_first_chunk=started.set,
            dp_rank=1,
            progress=progress,
        )
        release = tmp_path / "release-held"
        held = pool.submit(
            run_job,
            server,
            DRAIN_HELD_JOB,
            dp_rank=1,
            kv_transfer_params=_hold(release),
        )
        assert started.wait(60), "the stream never started"
        deadline = time.monotonic() + 30
        while waiting_requests(server, 1) < 1:
            assert time.monotonic() < deadline and not held.done(), (
                "held request never queued"
            )
            time.sleep(0.2)
        group = server.proc.pid  # the server leads its own process group
        server.proc.send_signal(signal.SIGTERM)
        assert progress[DRAIN_STREAM_JOB.index] < DRAIN_STREAM_JOB.max_tokens, (
            "the stream finished before SIGTERM; the test proves nothing"
        )
        release.touch()  # its KV "arrives" during the drain
        assert (
            stream.result(timeout=SHUTDOWN_TIMEOUT_S)
            == dp1_reference[DRAIN_STREAM_JOB.index]
        )
        assert (
            held.result(timeout=SHUTDOWN_TIMEOUT_S)
            == dp1_reference[DRAIN_HELD_JOB.index]
        )
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    returncode = server.proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
    while process_group_alive(group):
        assert time.monotonic() < deadline, (
            "engine or worker processes outlived the server"
        )
        time.sleep(0.2)
    log = server.log_text()
    assert returncode == 0, server.log_tail()
    assert "step sync: DP group leaves at step" in log, server.log_tail()
    for failure in (
        "StepSyncFailure",
        "silent for",
        "aborted the DP group",
        "did not stop",
        "leaves the DP group alone",
    ):
        assert failure not in log, f"{failure!r} in the log of a clean shutdown"


def process_group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def external_lb(tiny_models, start_server):
    rpc_port = get_free_port()
    options = json.dumps({"step_sync_peer_timeout_s": 5})
    servers = [
        start_server(
            tiny_models["tiny-mixtral"],
            [
                *COMMON_ARGS,
                *EAGER_ARGS,
                "--data-parallel-size",
                "2",
                "--data-parallel-rank",
                str(rank),
                "--data-parallel-address",
                "127.0.0.1",
                "--data-parallel-rpc-port",
                str(rpc_port),
                "--additional-config",
                options,
            ],
            name=f"stepsync-extlb-rank{rank}",
            wait=False,
        )
        for rank in (0, 1)
    ]
    for server in servers:
        server.wait_ready()
    yield servers
    for server in servers:
        server.stop()


def test_external_lb_requests_to_one_rank_complete(dp1_reference, external_lb):
    rank0, rank1 = external_lb
    jobs = [j for j in _workload() if j.mode == "plain"][:16]
    got = run_all(rank1, jobs)
    for job in jobs:
        assert got[job.index] == dp1_reference[job.index], f"request {job.index}"
    # Each server shows its own rank; together they ran one step count.
    steps = wait_for_settled_steps([rank0, rank1])
    assert steps[0] == steps[1] > 0
    assert step_sync_metric(rank0, "forward_steps_total") == {0: 0.0}
    assert step_sync_metric(rank0, "dummy_steps_total") == {0: steps[0]}
    assert step_sync_metric(rank1, "forward_steps_total")[1] > 0


def test_killing_one_rank_fails_the_other_fast(external_lb):
    rank0, rank1 = external_lb
    killed_at = time.monotonic()
    rank1.kill()
    # peer timeout 5 s, then the engine stops and the server goes down.
    deadline = killed_at + 45.0
    while time.monotonic() < deadline:
        if rank0.proc.poll() is not None:
            break
        try:
            if requests.get(f"{rank0.url}/health", timeout=2).status_code != 200:
                break
        except requests.Timeout:
            pass  # busy, not failed: ask again
        except requests.RequestException:
            break
        time.sleep(0.5)
    else:
        pytest.fail("rank 0 still healthy 45 s after rank 1 was killed")
    elapsed = time.monotonic() - killed_at
    # The reason is logged before the engine stops; the log file may lag a moment.
    reason = "step sync coordinator: DP rank 1 silent"
    log_deadline = time.monotonic() + 30
    while reason not in rank0.log_text() and time.monotonic() < log_deadline:
        time.sleep(0.5)
    assert reason in rank0.log_text(), rank0.log_tail()
    print(f"rank 0 failed {elapsed:.1f}s after rank 1 was killed")
