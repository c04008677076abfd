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
* Different DP sizes: the same DP=2 prefill also feeds a DP=1 decode
  instance through a second router (2P1D: both prefill ranks feed its one
  rank); its answers equal the colocated run and every one of its loads came
  over the connector. The reverse (DP=1 prefills feeding each rank of a DP=2
  decode) is the chaos fleet's steady state (tests/chaos/test_chaos.py).
* Bind and advertised addresses: that DP=1 decode binds its KV ports on
  127.0.0.2 (``kv_bind_ip``) and advertises 127.0.0.3 (``kv_ip``, registered
  with the router), where only a TCP forwarder (the NAT) listens, and its
  API server is advertised there too: all of its KV and requests came in
  through the forwarders.

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
from vllm_disagg.testing.forwarder import Forwarder
from vllm_disagg.testing.openai_client import complete
from vllm_disagg.testing.p2p import (
    P2pInstance,
    disaggregated_completion,
    free_kv_port,
    kv_transfer_config,
    peer_naming,
)
from vllm_disagg.testing.server import get_free_port

from .e2e_common import metric, wait_metric

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
def dp_servers(tiny_models, start_server, start_router):
    """Every server of the module, started at once: a DP=2 prefill, a DP=2
    decode and a DP=1 decode instance (one `vllm serve` per rank), and two
    routers: ``router`` knows both DP=2 instances, ``router_dp1`` the prefill's
    ranks and the DP=1 decode."""
    model = tiny_models["tiny-mixtral"]
    router = start_router(
        name="router-dp", model=str(model), args=["--policy-decode", "dp_balanced"]
    )
    router_dp1 = start_router(name="router-dp2-to-dp1", model=str(model))
    options = json.dumps({"step_sync_peer_timeout_s": 10})

    def instance(role: str, routers, **extra) -> list[P2pInstance]:
        kv_port, rpc_port = free_kv_port(), get_free_port()
        ranks = []
        for rank in (0, 1):
            http_port = get_free_port()
            # One kv_port for both ranks: each rank's worker listens on kv_port +
            # dp_rank.
            config = kv_transfer_config(
                role,
                kv_port,
                proxy_ip=",".join(f"127.0.0.1:{r.discovery_port}" for r in routers),
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

    prefills = instance("kv_producer", (router, router_dp1))
    decodes = instance("kv_consumer", (router,), kv_load_timeout_s=LOAD_TIMEOUT_S)
    single, nat = _dp1_instance(start_server, model, router_dp1)
    for inst in (*prefills, *decodes, single):
        inst.server.wait_ready()
    router.wait_for_instances(
        lambda found: len(found) == 4, timeout_s=30, what="4 registered DP ranks"
    )
    router_dp1.wait_for_instances(
        lambda found: len(found) == 3, timeout_s=30, what="2 prefill ranks, 1 decode"
    )
    yield {
        "router": router,
        "prefills": prefills,
        "decodes": decodes,
        "router_dp1": router_dp1,
        "dp1_decode": single,
        "nat": nat,
    }
    for inst in (*prefills, *decodes, single):
        inst.server.stop()
    for forwarder in nat.values():
        forwarder.close()


BOUND, ADVERTISED = "127.0.0.2", "127.0.0.3"  # the DP=1 decode's KV addresses


def _dp1_instance(start_server, model, router) -> tuple[P2pInstance, dict]:
    """A DP=1 decode instance (no DP flags) registered with ``router`` only,
    its KV ports bound on BOUND and advertised on ADVERTISED, and the NAT
    between them: {"control", "data", "http": Forwarder}; its API server is
    advertised on ADVERTISED too."""
    kv_port, data_port, http_port = free_kv_port(), get_free_port(), get_free_port()
    nat = {
        name: Forwarder((ADVERTISED, port), (BOUND, port))
        for name, port in (("control", kv_port), ("data", data_port))
    }
    # vllm serve listens on 127.0.0.1; the routers are told ADVERTISED.
    nat["http"] = Forwarder((ADVERTISED, http_port), ("127.0.0.1", http_port))
    config = kv_transfer_config(
        "kv_consumer",
        kv_port,
        proxy_ip=f"127.0.0.1:{router.discovery_port}",
        http_port=str(http_port),
        kv_load_timeout_s=LOAD_TIMEOUT_S,
        kv_ip=ADVERTISED,  # and http_ip, by default
        kv_bind_ip=BOUND,
        kv_data_port=str(data_port),
    )
    server = start_server(
        model,
        [*COMMON_ARGS, "--kv-transfer-config", config],
        name="p2p-dp1-kv_consumer",
        wait=False,
        port=http_port,
    )
    return P2pInstance(server, kv_port), nat


@pytest.fixture(scope="module")
def xpyd_dp(dp_servers):
    """(router, [prefill rank 0, 1], [decode rank 0, 1]), every rank registered."""
    return dp_servers["router"], dp_servers["prefills"], dp_servers["decodes"]


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


def test_a_dp2_prefill_feeds_a_dp1_decode_both_ranks_into_one(dp_servers, reference):
    """DP sizes differ (P=2, D=1) and two prefills feed one decode rank: the
    router pairs any prefill rank with the decode; answers equal the colocated
    run and the decode loaded every prompt's KV (none recomputed)."""
    router, decode = dp_servers["router_dp1"], dp_servers["dp1_decode"]
    prefills = dp_servers["prefills"]
    sent_before = [metric(p, "vllm:p2p_bytes_sent") for p in prefills]
    received_before = metric(decode, "vllm:p2p_bytes_received")
    through_nat = dp_servers["nat"]["data"].bytes_in
    requests_before = dp_servers["nat"]["http"].connections
    failed_before = metric(decode, "vllm:p2p_failed_loads")
    hits_before = metric(decode, "vllm:external_prefix_cache_hits")
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
    # Both prefill ranks sent KV to the one decode rank (round robin over P).
    for rank, (p, before) in enumerate(zip(prefills, sent_before)):
        assert wait_metric(p, "vllm:p2p_bytes_sent", before + 1) > before, rank
    received = wait_metric(decode, "vllm:p2p_bytes_received", received_before + 1)
    assert received > received_before
    # The decode is reached only at its advertised address, through the NAT.
    crossed = dp_servers["nat"]["data"].bytes_in - through_nat
    assert crossed >= received - received_before, (crossed, received)
    assert dp_servers["nat"]["http"].connections > requests_before
    # Every prompt's KV arrived: the decode recomputed nothing, and its prefix
    # cache counted the remote tokens as external hits.
    assert metric(decode, "vllm:p2p_failed_loads") == failed_before
    # Every prompt token but the last is loaded (decode computes the last one).
    remote = sum(len(p) - 1 for p in PROMPTS)
    hits = wait_metric(decode, "vllm:external_prefix_cache_hits", hits_before + remote)
    assert hits - hits_before >= remote, (hits, hits_before, remote)


def test_prometheus_scrapes_every_rank_and_a_dead_prefill_rank_raises_alerts(
    xpyd_dp, reference, tmp_path
):
    """Last in this module: it kills a rank. A real Prometheus scrapes the
    router and the four ranks (one ``vllm serve`` each) with the fleet's rules
    (``for:`` cut to 1 s); every dashboard panel has data, the step gap is
    computed per DP group across the ranks' targets, and SIGKILL of prefill
    rank 1 raises TargetDown and InstanceRemoved. Not exported (the project's
    rules and dashboard): its imports are here."""
    from vllm_disagg.testing import prometheus

    if prometheus.binary() is None:
        pytest.skip(prometheus.SKIP_REASON)
    router, prefills, decodes = xpyd_dp
    jobs = {"router": router.url}
    for role, ranks in (("prefill", prefills), ("decode", decodes)):
        for rank, inst in enumerate(ranks):
            jobs[f"{role}-{rank}"] = inst.server.url
    targets = {f"vllm-disagg-{j}": url.split("//", 1)[1] for j, url in jobs.items()}
    with prometheus.running(targets, tmp_path) as prom:
        for prompt in PROMPTS[:4]:
            out = openai_client.complete(
                router,
                prompt,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                return_token_ids=True,
            )
            assert _ids(out) == reference[tuple(prompt)]
        prometheus.until(
            lambda: prometheus.query(prom, "count(up == 1) == 5"),
            "all five targets up",
            60,
        )
        # Every panel's series exist from start-up (at 0), so once every
        # target has two scrapes after the traffic, every panel has data.
        prometheus.until(
            lambda: prometheus.scraped_twice(prom, len(targets)),
            "two scrapes of every target",
            60,
        )
        empty = prometheus.panels_without_data(prom)
        assert not empty, (
            f"dashboard panels without data: {empty}; targets: "
            f"{prometheus.targets_health(prom)}"
        )
        # One series per DP group: the two ranks of each instance, found
        # across their own targets by dp_group.
        ranks = prometheus.query(
            prom, "count by (dp_group) (vllm_disagg:step_sync_local_step)"
        )
        assert sorted(float(r["value"][1]) for r in ranks) == [2.0, 2.0], ranks

        prefills[1].server.kill()

        def raised():
            state = prometheus.active_alerts(prom)
            down = [
                a
                for a in state.get("VllmDisaggTargetDown", [])
                if a["labels"].get("job", "").endswith("prefill-1")
            ]
            return state if down and "VllmDisaggInstanceRemoved" in state else None

        state = prometheus.until(raised, "the dead rank's alerts", 90)
    for name in ("VllmDisaggTargetDown", "VllmDisaggInstanceRemoved"):
        assert {a["state"] for a in state[name]} <= {"pending", "firing"}
