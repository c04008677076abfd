"""End to end: xPyD on DP engines. A DP=2 prefill and a DP=2 decode of the
tiny MoE (one `vllm serve` per DP rank, step sync between the ranks of each
instance), every rank registered with the router as an instance of its own.

* Through the router: completions, streams and chats equal the colocated
  run, and every rank of both instances serves. The router learned the DP
  groups from registration (``/instances``: the ranks of each instance share
  one ``dp_group``) and places decodes with ``dp_balanced``.
* A rank waiting for remote KV must not stall step sync: while one request on
  decode rank 1 waits for KV that never comes, requests on both ranks
  complete, and the waiting one is recomputed after ``kv_load_timeout_s``.

The colocated reference is prefill rank 0 answering requests that name no
peers (float32: DP=2 under step sync equals DP=1, which
tests/v1/distributed/test_step_sync_dp.py checks), before any transfer.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_disagg.testing import openai_client
from vllm_disagg.testing.openai_client import complete
from vllm_disagg.testing.p2p import (
    P2pInstance,
    disaggregated_completion,
    free_kv_port,
    kv_transfer_config,
    peer_naming,
)
from vllm_disagg.testing.server import get_free_port

pytestmark = pytest.mark.e2e

COMMON_ARGS = [
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "16",
    "--seed",
    "0",
    "--dtype",
    "float32",
    "--block-size",
    "32",
    "--enforce-eager",
]
MAX_TOKENS = 10
LOAD_TIMEOUT_S = 30.0  # the others must finish well before the orphan gives up

_rng = random.Random(7)
PROMPTS = [
    [_rng.randrange(3, 500) for _ in range(_rng.randint(3, 120))] for _ in range(12)
]
ORPHAN = [_rng.randrange(3, 500) for _ in range(70)]
CHAT = [{"role": "user", "content": "Tell me about prefill and decode."}]


def _ids(response: dict) -> list[int]:
    return list(response["choices"][0]["token_ids"])


@pytest.fixture(scope="module")
def xpyd_dp(tiny_models, start_server, start_router):
    """(router, [prefill rank 0, 1], [decode rank 0, 1]), every rank registered."""
    model = tiny_models["tiny-mixtral"]
    router = start_router(
        name="router-dp", model=str(model), args=["--policy-decode", "dp_balanced"]
    )
    options = json.dumps({"step_sync_peer_timeout_s": 10})

    def instance(role: str, **extra) -> list[P2pInstance]:
        kv_port, rpc_port = free_kv_port(), get_free_port()
        ranks = []
        for rank in (0, 1):
            http_port = get_free_port()
            # One kv_port for both ranks: each rank's worker listens on kv_port +
            # dp_rank.
            config = kv_transfer_config(
                role,
                kv_port,
                proxy_ip="127.0.0.1",
                proxy_port=str(router.discovery_port),
                http_port=str(http_port),
                **extra,
            )
            server = start_server(
                model,
                [
                    *COMMON_ARGS,
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
                    "--kv-transfer-config",
                    config,
                ],
                name=f"p2p-dp-{role}-rank{rank}",
                wait=False,
                port=http_port,
            )
            ranks.append(P2pInstance(server, kv_port + rank))
        return ranks

    prefills = instance("kv_producer")
    decodes = instance("kv_consumer", kv_load_timeout_s=LOAD_TIMEOUT_S)
    for inst in (*prefills, *decodes):
        inst.server.wait_ready()
    router.wait_for_instances(
        lambda found: len(found) == 4, timeout_s=30, what="4 registered DP ranks"
    )
    yield router, prefills, decodes
    for inst in (*prefills, *decodes):
        inst.server.stop()


@pytest.fixture(scope="module")
def reference(xpyd_dp):
    _, prefills, _ = xpyd_dp
    server = prefills[0].server
    with ThreadPoolExecutor(8) as pool:
        outs = list(
            pool.map(
                lambda p: _ids(
                    server.complete(
                        p, max_tokens=MAX_TOKENS, temperature=0.0, return_token_ids=True
                    )
                ),
                [*PROMPTS, ORPHAN],
            )
        )
    ref = {tuple(p): o for p, o in zip([*PROMPTS, ORPHAN], outs)}
    chat = openai_client.chat(server, CHAT, max_tokens=MAX_TOKENS, temperature=0.0)
    ref["chat"] = chat["choices"][0]["message"]["content"]
    return ref


def _served(inst: P2pInstance) -> float:
    values = inst.server.metrics(prefix="vllm:request_success")
    return sum(v for labels in values.values() for v in labels.values())


def test_the_router_serves_xpyd_on_dp_engines_placing_each_group_as_one(
    xpyd_dp, reference
):
    router, prefills, decodes = xpyd_dp
    groups: dict[str, set[str]] = {}
    for listed in router.instances():
        groups.setdefault(listed["role"], set()).add(listed["dp_group"])
    # One group per instance (both ranks name it), the two instances' differ.
    assert len(groups["prefill"]) == len(groups["decode"]) == 1, groups
    assert "" not in groups["prefill"] | groups["decode"]
    assert groups["prefill"] != groups["decode"]
    ranks = [*prefills, *decodes]
    before = [_served(r) for r in ranks]
    with ThreadPoolExecutor(4) as pool:
        outs = list(
            pool.map(
                lambda p: _ids(
                    openai_client.complete(
                        router,
                        p,
                        max_tokens=MAX_TOKENS,
                        temperature=0.0,
                        return_token_ids=True,
                    )
                ),
                PROMPTS,
            )
        )
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        assert out == reference[tuple(prompt)], f"completion {i}"
    chunks = openai_client.stream_completion(
        router,
        PROMPTS[0],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        return_token_ids=True,
    )
    assert [t for c in chunks for t in openai_client.token_ids(c)] == reference[
        tuple(PROMPTS[0])
    ]
    chat = openai_client.chat(router, CHAT, max_tokens=MAX_TOKENS, temperature=0.0)
    assert chat["choices"][0]["message"]["content"] == reference["chat"]
    streamed = openai_client.stream_chat(
        router, CHAT, max_tokens=MAX_TOKENS, temperature=0.0
    )
    assert openai_client.streamed_text(streamed) == reference["chat"]
    deadline = time.monotonic() + 15
    while (
        any(_served(r) <= b for r, b in zip(ranks, before))
        and time.monotonic() < deadline
    ):
        time.sleep(0.5)
    idle = [r.server.log_path.name for r, b in zip(ranks, before) if _served(r) <= b]
    assert not idle, f"ranks that served nothing: {idle}"


def test_dp2_decode_loads_remote_kv_and_a_waiting_rank_never_stalls_the_group(
    xpyd_dp, reference
):
    _, prefills, decodes = xpyd_dp
    prefill = prefills[0]

    # A request on rank 1 whose prefill never happens: it waits for KV.
    orphan_headers, orphan_params = peer_naming(prefill.kv_addr, decodes[1].kv_addr)
    done_after: dict[str, float] = {}  # what -> seconds from the start when it finished

    def note_done(what: str):
        return lambda _: done_after.__setitem__(what, time.monotonic() - started)

    with ThreadPoolExecutor(16) as pool:
        started = time.monotonic()
        orphan = pool.submit(
            complete,
            decodes[1],
            ORPHAN,
            headers=orphan_headers,
            **orphan_params,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            return_token_ids=True,
        )
        orphan.add_done_callback(note_done("orphan"))
        time.sleep(0.5)
        # Meanwhile requests on both ranks go through the connector and finish.
        futures = [
            pool.submit(
                disaggregated_completion,
                prefill,
                decodes[i % 2],
                prompt,
                max_tokens=MAX_TOKENS,
                return_token_ids=True,
            )
            for i, prompt in enumerate(PROMPTS)
        ]
        for i, future in enumerate(futures):
            future.add_done_callback(note_done(f"request {i}"))
        outs = [_ids(f.result(timeout=120)) for f in futures]
        orphan_out = _ids(orphan.result(timeout=120))

    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        assert out == reference[tuple(prompt)], f"request {i} on rank {i % 2}"
    assert orphan_out == reference[tuple(ORPHAN)]
    # The others did not wait for the orphan's deadline; the orphan was recomputed after
    # it.
    orphan_done = done_after.pop("orphan")
    assert max(done_after.values()) < orphan_done, done_after
    assert LOAD_TIMEOUT_S - 1 <= orphan_done < LOAD_TIMEOUT_S + 60, orphan_done
    for d in decodes:
        received = d.server.metrics(prefix="vllm:p2p_bytes_received")
        assert sum(v for labels in received.values() for v in labels.values()) > 0
