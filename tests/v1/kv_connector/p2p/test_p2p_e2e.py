"""End to end: real prefill and decode `vllm serve` instances on the tiny Llama.

Driven the way the design document's proxy drives them (prefill gets the
request with ``max_tokens=1``, then decode gets the original with the same
id). Decode's greedy token ids (float32) must equal a colocated run, and its
metrics must show which path the KV took: the connector
(``vllm:external_prefix_cache_hits``, ``vllm:p2p_bytes_received``), the host
pool (``vllm:p2p_spills``) or a local recompute (``vllm:p2p_failed_loads``).

Through the router too: every PUT_ASYNC instance registers itself with the
routers its ``proxy_ip`` lists (1P1D, 1P2D and 2P1D routers over the same
instances), and completions, streams and chats through each router equal the
colocated run; a decode instance started while traffic flows starts taking
requests, and once killed it is removed and later requests succeed.

Server sets are module fixtures, started concurrently: the PUT_ASYNC set
(2 prefills, 3 decodes with different buffers) and the GET + PUT set. The
colocated reference is the second prefill instance answering requests that
name no peers (the connector then does nothing: a plain `vllm serve` run),
before it takes part in any transfer.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_disagg.testing import openai_client
from vllm_disagg.testing.p2p import (
    P2pInstance,
    disaggregated_completion,
    free_kv_port,
    kv_transfer_config,
)
from vllm_disagg.testing.server import get_free_port

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 32
MAX_BATCHED = 256
COMMON_ARGS = [
    "--max-model-len", "1024", "--max-num-seqs", "16", "--seed", "0", "--dtype", "float32",
    "--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", str(MAX_BATCHED),
    # No torch.compile: a compile of a new shape at run time holds the worker's
    # GIL for tens of seconds on these 2-core machines and starves the P2P threads.
    "--enforce-eager",
]  # fmt: skip
# Shorter than a block, one block, three blocks + 5, longer than one chunk.
PROMPT_LENGTHS = (1, BLOCK_SIZE, 3 * BLOCK_SIZE + 5, MAX_BATCHED + 2 * BLOCK_SIZE + 7)
MAX_TOKENS = 12
# Generous: the first transfer of a pair sets up its channel, and CI machines
# are busy starting servers; a load that times out is still right (recomputed)
# but fails the "came over the connector" checks.
LOAD_TIMEOUT_S = 20.0


def token_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(length)]


_rng = random.Random(20261122)
LENGTH_PROMPTS = [token_prompt(_rng, n) for n in PROMPT_LENGTHS]
# Many requests in flight: shared prefixes too, so prefix-cache hits happen on both sides.
_shared = token_prompt(_rng, 2 * BLOCK_SIZE)
MANY_PROMPTS = [
    (_shared if i % 3 == 0 else []) + token_prompt(_rng, _rng.randint(5, 150)) for i in range(32)
]
ALL_PROMPTS = [*LENGTH_PROMPTS, *MANY_PROMPTS]
CHATS = [
    [{"role": "user", "content": "Tell me about prefill and decode."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a block?"}],
]
# Which routers each instance of the PUT_ASYNC set registers with.
ROUTER_NAMES = ("1p1d", "1p2d", "2p1d", "join")
REGISTERS_WITH = {
    "p1": ("1p1d", "1p2d", "2p1d", "join"),
    "p2": ("2p1d",),
    "d1": ("1p1d", "1p2d", "2p1d", "join"),
    "d_pool": ("1p2d",),
    "d_none": (),
}


def _ids(response: dict) -> list[int]:
    return list(response["choices"][0]["token_ids"])


def _key(prompt: list[int]) -> tuple[int, ...]:
    return tuple(prompt)


def _chat_key(messages: list[dict]) -> str:
    return repr(messages)


@pytest.fixture(scope="module")
def reference(put_async_set) -> dict:
    """Greedy outputs of a colocated run for every prompt and chat of this module:
    the second prefill instance, asked with no peers named."""
    server = put_async_set["p2"]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(
            lambda p: _ids(server.complete(p, max_tokens=MAX_TOKENS, temperature=0.0,
                                           return_token_ids=True)),
            ALL_PROMPTS,
        ))  # fmt: skip
    ref: dict = {_key(p): o for p, o in zip(ALL_PROMPTS, outs)}
    for messages in CHATS:
        body = openai_client.chat(server, messages, max_tokens=MAX_TOKENS, temperature=0.0)
        ref[_chat_key(messages)] = body["choices"][0]["message"]["content"]
    return ref


@pytest.fixture(scope="module")
def routers(tiny_models, start_router):
    model = str(tiny_models["tiny-llama"])
    started = {name: start_router(name=f"router-{name}", model=model) for name in ROUTER_NAMES}
    yield started
    for router in started.values():
        router.stop()


def _start(start_server, model, name, role, *, routers=(), env=None, **extra) -> P2pInstance:
    port, http_port = free_kv_port(), get_free_port()
    if routers:
        # Several routers, each "host:port", as one comma-separated proxy_ip.
        extra["proxy_ip"] = ",".join(f"127.0.0.1:{r.discovery_port}" for r in routers)
        extra["http_port"] = str(http_port)
    server = start_server(
        model,
        [*COMMON_ARGS, "--kv-transfer-config", kv_transfer_config(role, port, **extra)],
        name=name,
        wait=False,
        port=http_port,
        **(env or {}),
    )
    return P2pInstance(server, port)


def _wait_all(instances: dict[str, P2pInstance]) -> None:
    for inst in instances.values():
        inst.server.wait_ready()


@pytest.fixture(scope="module")
def put_async_set(tiny_models, start_server, routers):
    model = tiny_models["tiny-llama"]
    common = {"kv_load_timeout_s": LOAD_TIMEOUT_S}

    def start(name, label, role, **extra):
        mine = [routers[r] for r in REGISTERS_WITH[name]]
        return _start(start_server, model, label, role, routers=mine, **common, **extra)

    instances = {
        "p1": start("p1", "p2p-pa-p1", "kv_producer"),
        "p2": start("p2", "p2p-pa-p2", "kv_producer"),
        "d1": start("d1", "p2p-pa-d1", "kv_consumer"),
        # receive buffer of one byte: every transfer goes to the host pool
        "d_pool": start("d_pool", "p2p-pa-dpool", "kv_consumer",
                        kv_buffer_size="1", mem_pool_size_gb=0.25),
        # no buffer, no pool: every transfer is refused and recomputed
        "d_none": start("d_none", "p2p-pa-dnone", "kv_consumer",
                        kv_buffer_size="1", mem_pool_size_gb=0),
    }  # fmt: skip
    _wait_all(instances)
    yield instances
    for inst in instances.values():
        inst.server.stop()


def _metric(inst: P2pInstance, name: str) -> float:
    values = inst.server.metrics(prefix=name)
    return sum(v for metric, labels in values.items() if metric in (name, f"{name}_total")
               for v in labels.values())


def _check_lengths(prefill, decode, reference, *, via_params=False) -> None:
    for length, prompt in zip(PROMPT_LENGTHS, LENGTH_PROMPTS):
        out = disaggregated_completion(
            prefill, decode, prompt, max_tokens=MAX_TOKENS, via_params=via_params,
            return_token_ids=True,
        )
        assert _ids(out) == reference[_key(prompt)], f"prompt of {length} tokens"


def _wait_metric(inst, name, at_least, timeout_s=15.0) -> float:
    # Stats reach the API server with the engine's periodic outputs.
    deadline = time.monotonic() + timeout_s
    while True:
        value = _metric(inst, name)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_put_async_every_prompt_length_equals_colocated(put_async_set, reference):
    p, d = put_async_set["p1"], put_async_set["d1"]
    hits_before = _metric(d, "vllm:external_prefix_cache_hits")
    _check_lengths(p, d, reference)
    # Every prompt token but the last is loaded (decode recomputes the last one).
    expected_hits = sum(PROMPT_LENGTHS)
    hits = _wait_metric(d, "vllm:external_prefix_cache_hits", hits_before + expected_hits - 4)
    assert hits - hits_before >= expected_hits - len(PROMPT_LENGTHS)
    assert _wait_metric(d, "vllm:p2p_bytes_received", 1) > 0
    assert _metric(d, "vllm:p2p_failed_loads") == 0
    assert _wait_metric(p, "vllm:p2p_bytes_sent", 1) > 0


def test_peers_in_kv_transfer_params_work_like_the_request_id(put_async_set, reference):
    _check_lengths(put_async_set["p2"], put_async_set["d1"], reference, via_params=True)


def test_a_full_receive_buffer_spills_to_the_host_pool(put_async_set, reference):
    d = put_async_set["d_pool"]
    _check_lengths(put_async_set["p1"], d, reference)
    assert _wait_metric(d, "vllm:p2p_spills", len(PROMPT_LENGTHS)) >= len(PROMPT_LENGTHS)
    assert _metric(d, "vllm:p2p_failed_loads") == 0


def test_no_room_anywhere_recomputes_with_the_same_output(put_async_set, reference):
    d = put_async_set["d_none"]
    _check_lengths(put_async_set["p1"], d, reference)
    assert _wait_metric(d, "vllm:p2p_failed_loads", len(PROMPT_LENGTHS)) >= len(PROMPT_LENGTHS)
    assert _metric(d, "vllm:p2p_dropped") >= len(PROMPT_LENGTHS)
    assert _metric(d, "vllm:p2p_bytes_received") == 0


def test_1p2d_and_2p1d_with_many_requests_in_flight_have_no_cross_talk(put_async_set, reference):
    pairs = [
        (put_async_set["p1"], put_async_set["d1"]),
        (put_async_set["p1"], put_async_set["d_pool"]),  # 1P2D
        (put_async_set["p2"], put_async_set["d1"]),  # 2P1D
    ]

    def run(i_prompt):
        i, prompt = i_prompt
        p, d = pairs[i % len(pairs)]
        return _ids(disaggregated_completion(p, d, prompt, max_tokens=MAX_TOKENS,
                                             return_token_ids=True))

    failed_before = _metric(put_async_set["d1"], "vllm:p2p_failed_loads")
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(run, enumerate(MANY_PROMPTS)))
    for i, (prompt, out) in enumerate(zip(MANY_PROMPTS, outs)):
        assert out == reference[_key(prompt)], f"request {i}"
    assert _metric(put_async_set["d1"], "vllm:p2p_failed_loads") == failed_before


# --- through the router ------------------------------------------------------

ROUTER_PAIRS = {  # router -> (prefills, decodes) that registered with it
    "1p1d": (("p1",), ("d1",)),
    "1p2d": (("p1",), ("d1", "d_pool")),
    "2p1d": (("p1", "p2"), ("d1",)),
}


def _served(inst: P2pInstance) -> float:
    return _metric(inst, "vllm:request_success")


def _wait_registered(router, expected: int) -> None:
    router.wait_for_instances(lambda found: len(found) >= expected, timeout_s=30,
                              what=f"{expected} registered instances")  # fmt: skip


@pytest.mark.parametrize("name", list(ROUTER_PAIRS))
def test_router_completions_streams_and_chats_equal_colocated(put_async_set, routers, reference,
                                                              name):  # fmt: skip
    router = routers[name]
    prefills, decodes = ROUTER_PAIRS[name]
    _wait_registered(router, len(prefills) + len(decodes))
    members = [put_async_set[i] for i in (*prefills, *decodes)]
    served_before = {id(m): _served(m) for m in members}
    prompts = [*LENGTH_PROMPTS, *MANY_PROMPTS[:4]]

    def completion(prompt):
        return _ids(openai_client.complete(router, prompt, max_tokens=MAX_TOKENS,
                                           temperature=0.0, return_token_ids=True))  # fmt: skip

    def streamed(prompt):
        chunks = openai_client.stream_completion(router, prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0.0, return_token_ids=True)  # fmt: skip
        return [t for chunk in chunks for t in openai_client.token_ids(chunk)]

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(completion, prompts))
        streams = list(pool.map(streamed, prompts[:3]))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out == reference[_key(prompt)], f"completion {i}"
    for i, (prompt, out) in enumerate(zip(prompts, streams)):
        assert out == reference[_key(prompt)], f"streamed completion {i}"
    for messages in CHATS:
        body = openai_client.chat(router, messages, max_tokens=MAX_TOKENS, temperature=0.0)
        assert body["choices"][0]["message"]["content"] == reference[_chat_key(messages)]
        chunks = openai_client.stream_chat(router, messages, max_tokens=MAX_TOKENS,
                                           temperature=0.0)  # fmt: skip
        assert openai_client.streamed_text(chunks) == reference[_chat_key(messages)]
    # Round-robin: every prefill and every decode of this router took requests.
    for name_, member in zip((*prefills, *decodes), members):
        deadline = time.monotonic() + 15
        while _served(member) <= served_before[id(member)] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _served(member) > served_before[id(member)], f"{name_} served nothing"


# One client, a pause between its requests: traffic flows, but leaves the
# joining server CPU to start on a 2-core machine (busy workers starve it).
JOIN_TRAFFIC_PACE_S = 2.0


def test_a_decode_joining_then_dying_while_traffic_flows(
    tiny_models, start_server, put_async_set, routers, reference
):
    """A new decode instance registers while requests flow through the router and
    starts taking them; killed, it is removed and later requests succeed."""
    router = routers["join"]
    _wait_registered(router, 2)
    results: list[tuple[float, float, bool, str]] = []  # (sent, done, ok, detail)
    stop = threading.Event()

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            prompt = MANY_PROMPTS[i % len(MANY_PROMPTS)]
            i += 1
            sent = time.monotonic()
            try:
                out = _ids(openai_client.complete(router, prompt, max_tokens=MAX_TOKENS,
                                                  temperature=0.0, return_token_ids=True,
                                                  timeout_s=60))  # fmt: skip
                ok = out == reference[_key(prompt)]
                detail = "" if ok else f"wrong output: {out}"
            except Exception as e:  # noqa: BLE001 - recorded and judged below
                ok, detail = False, repr(e)[:300]
            results.append((sent, time.monotonic(), ok, detail))
            stop.wait(JOIN_TRAFFIC_PACE_S)

    workers = [threading.Thread(target=traffic, daemon=True)]
    for w in workers:
        w.start()
    joined = _start(start_server, tiny_models["tiny-llama"], "p2p-pa-djoin", "kv_consumer",
                    routers=[router], kv_load_timeout_s=LOAD_TIMEOUT_S)  # fmt: skip
    try:
        joined.server.wait_ready()
        _wait_registered(router, 3)
        deadline = time.monotonic() + 60
        while _served(joined) < 2:
            assert time.monotonic() < deadline, "the new decode instance never took requests"
            time.sleep(0.5)
        joined.server.kill()
        killed_at = time.monotonic()
        router.wait_for_instances(
            lambda found: all(i["http_addr"] != f"127.0.0.1:{joined.server.port}" for i in found),
            timeout_s=30, what="the killed instance removed",
        )  # fmt: skip
        removed_at = time.monotonic()
        time.sleep(5)  # traffic after the removal
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=90)
        joined.server.stop()
    assert removed_at - killed_at < 15  # a refused connection drops it before heartbeats expire
    after = [r for r in results if r[0] > removed_at]
    assert len(after) >= 2 and all(ok for _, _, ok, _ in after), after
    # Only requests in flight to the dying instance may have failed.
    failed = [r for r in results if not r[2]]
    assert all(sent <= removed_at for sent, _, _, _ in failed), failed
    assert len(failed) <= 1, failed
    assert sum(ok for _, _, ok, _ in results) >= 5


@pytest.fixture(scope="module")
def get_put_set(tiny_models, start_server, reference):
    model = tiny_models["tiny-llama"]
    common = {"kv_load_timeout_s": LOAD_TIMEOUT_S}
    instances = {
        "p_get": _start(start_server, model, "p2p-get-p", "kv_producer", send_type="GET", **common),
        "d_get": _start(start_server, model, "p2p-get-d", "kv_consumer", send_type="GET", **common),
        "p_put": _start(start_server, model, "p2p-put-p", "kv_producer", send_type="PUT", **common),
        "d_put": _start(start_server, model, "p2p-put-d", "kv_consumer", send_type="PUT", **common),
    }  # fmt: skip
    _wait_all(instances)
    yield instances
    for inst in instances.values():
        inst.server.stop()


@pytest.mark.parametrize("mode", ["get", "put"])
def test_get_and_put_every_prompt_length_equals_colocated(get_put_set, reference, mode):
    p, d = get_put_set[f"p_{mode}"], get_put_set[f"d_{mode}"]
    _check_lengths(p, d, reference)
    assert _wait_metric(d, "vllm:p2p_bytes_received", 1) > 0
    # Known open bug (issue 9): a GET transfer on these 2-core machines now and
    # then stalls past kv_load_timeout_s and is recomputed (the output above is
    # still checked); PUT has no such stall.
    assert _metric(d, "vllm:p2p_failed_loads") <= (1 if mode == "get" else 0)


def test_get_pulls_only_blocks_missing_from_the_decode_prefix_cache(get_put_set, reference):
    p, d = get_put_set["p_get"], get_put_set["d_get"]
    prompt = MANY_PROMPTS[0]  # starts with the two-block shared prefix
    disaggregated_completion(p, d, prompt, max_tokens=2, return_token_ids=True)
    # Same shared prefix, different tails: decode holds the first two blocks
    # itself. Up to three tries, for the known GET stall (see above).
    for other in (MANY_PROMPTS[3], MANY_PROMPTS[6], MANY_PROMPTS[9]):
        assert other[: 2 * BLOCK_SIZE] == prompt[: 2 * BLOCK_SIZE]
        blocks_before = _wait_metric(d, "vllm:p2p_blocks_received", 1)
        failed_before = _metric(d, "vllm:p2p_failed_loads")
        out = disaggregated_completion(p, d, other, max_tokens=MAX_TOKENS, return_token_ids=True)
        assert _ids(out) == reference[_key(other)]
        # Stats reach /metrics with the engine's periodic outputs: wait for either.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            received = _metric(d, "vllm:p2p_blocks_received") - blocks_before
            failed = _metric(d, "vllm:p2p_failed_loads") > failed_before
            if received or failed:
                break
            time.sleep(0.5)
        if failed:
            continue
        assert received == -(-len(other) // BLOCK_SIZE) - 2
        return
    pytest.fail("three GET loads in a row were recomputed")


def test_a_dead_prefill_costs_a_recompute_within_the_deadline(get_put_set, reference):
    p, d = get_put_set["p_get"], get_put_set["d_get"]
    p.server.kill()
    prompt = LENGTH_PROMPTS[2]
    # The prefill is gone, so only the decode half of the proxy flow runs.
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.metadata import make_request_id
    from vllm_disagg.testing.openai_client import complete

    start = time.monotonic()
    out = complete(
        d, prompt, headers={"X-Request-Id": make_request_id(p.kv_addr, d.kv_addr)},
        max_tokens=MAX_TOKENS, temperature=0.0, return_token_ids=True,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert _ids(out) == reference[_key(prompt)]
    assert elapsed < LOAD_TIMEOUT_S + 10
    assert _wait_metric(d, "vllm:p2p_failed_loads", 1) >= 1
