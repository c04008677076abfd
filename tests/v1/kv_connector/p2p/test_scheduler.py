"""The P2P connector's scheduler side, in-process against a real vLLM Scheduler.

No server, no worker, no model: ``vllm_disagg.testing.scheduler`` builds a
``Scheduler`` with the ``P2pNcclConnector`` and the tests play the model
runner and the worker-side connector by hand (``finished_recving``,
``finished_sending``, ``invalid_block_ids``), asserting on the scheduler's
own state: request status, ``num_computed_tokens``, blocks held and freed,
and the ``P2pConnectorMetadata`` each step hands the workers.

This instance is ``127.0.0.1:21001`` (kv_ip, kv_port, DP rank 0, TP 1).
Block size 16, 64 tokens per step (chunked prefill), prefix caching on.
"""

from __future__ import annotations

from unittest.mock import ANY

import pytest
from vllm.utils.math_utils import cdiv
from vllm.v1.request import RequestStatus

from vllm_disagg import envs
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import P2pConfig
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.metadata import (
    LoadSpec,
    P2pConnectorMetadata,
    SaveSpec,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    prompt_digest,
)
from vllm_disagg.errors import ConfigError
from vllm_disagg.testing.scheduler import SchedulerHarness, tokens, write_model_config
from vllm_disagg.testing.server import fleet_router_token
from vllm_disagg.wire.grants import GRANT_KEY, make_grant
from vllm_disagg.wire.peers import (
    make_kv_transfer_params,
    make_request_id,
)

BLOCK = 16
BUDGET = 64  # max_num_batched_tokens
OWN = "127.0.0.1:21001"  # this instance
PREFILL = "10.0.0.1:21001"  # some other (prefill) instance
DECODE = "10.0.0.2:22001"  # some other (decode) instance
ANOTHER = "10.0.0.3:23001"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_config(tmp_path_factory.mktemp("scheduler-model"))


@pytest.fixture
def harness(model_dir):
    def make(role: str | None, **config) -> SchedulerHarness:
        config.setdefault("block_size", BLOCK)
        config.setdefault("max_num_batched_tokens", BUDGET)
        return SchedulerHarness(model_dir, role, **config)

    return make


def wrapped_id(prefill: str, decode: str, key: str) -> str:
    """The id as the connector sees it: vLLM wraps the proxy's X-Request-Id
    (``cmpl-{id}-0``) and appends a random suffix per engine."""
    return f"cmpl-{make_request_id(prefill, decode, key)}-0-1a2b3c4d"


def metas(step) -> P2pConnectorMetadata:
    meta = step.meta
    assert isinstance(meta, P2pConnectorMetadata)
    return meta


def assert_no_transfer(step) -> None:
    meta = metas(step)
    assert meta.loads == [] and meta.saves == []


def assert_connector_idle(h: SchedulerHarness) -> None:
    """Nothing left behind once every request finished and was freed."""
    c = h.connector
    assert not c._peers and not c._pending_loads and not c._loaded
    assert not c._prefills and not c._sending
    assert not h.scheduler.requests
    assert h.free_blocks == h.initial_free_blocks


def new_req_data(step, req_id):
    for new in step.output.scheduled_new_reqs:
        if new.req_id == req_id:
            return new
    return None


def computed_before_step(step, req_id) -> int:
    """num_computed_tokens of ``req_id`` when ``step`` scheduled it."""
    new = new_req_data(step, req_id)
    if new is not None:
        return new.num_computed_tokens
    cached = step.output.scheduled_cached_reqs
    return cached.num_computed_tokens[cached.req_ids.index(req_id)]


def test_own_address_is_kv_ip_and_instance_port(harness):
    h = harness("kv_both")
    config = P2pConfig.from_vllm_config(h.vllm_config)
    assert h.connector.addr == f"127.0.0.1:{config.instance_port(0, 1, 1)}" == OWN
    assert harness("kv_both", data_parallel_rank=1).connector.addr == "127.0.0.1:21002"


# --- decode (kv_consumer) ---------------------------------------------------


@pytest.mark.parametrize("num_prompt", [1, BLOCK, 3 * BLOCK + 5])
def test_decode_waits_for_remote_kv_then_runs(harness, num_prompt):
    h = harness("kv_consumer")
    rid = wrapped_id(PREFILL, OWN, "key1")
    h.add(h.request("plain", tokens(20, seed=1), max_tokens=8))
    h.add(h.request(rid, tokens(num_prompt, seed=2), max_tokens=3))

    step = h.step()
    # The remote request waits; the local one runs.
    assert step.scheduled == {"plain": 20}
    assert h.req(rid).status == RequestStatus.WAITING_FOR_REMOTE_KVS
    num_blocks = cdiv(num_prompt, BLOCK)
    held = h.block_ids(rid)
    assert len(held) == num_blocks
    assert metas(step).loads == [
        LoadSpec(
            request_id=rid,
            key="key1",
            prefill_addr=PREFILL,
            first_block=0,
            block_ids=held,
            num_blocks=num_blocks,
            prompt_digest=ANY,
        )
    ]
    assert metas(step).saves == []
    assert h.free_blocks == h.initial_free_blocks - num_blocks - 2  # plain: 2 blocks

    # The load is in flight: asked for once, the rest of the batch keeps running.
    for _ in range(2):
        step = h.step()
        assert step.scheduled == {"plain": 1}
        assert_no_transfer(step)
        assert h.req(rid).status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert h.block_ids(rid) == held

    # The worker reports the load finished at the end of a step ...
    step = h.step(finished_recving={rid})
    assert rid not in step.scheduled
    # ... and the next step runs the request, recomputing only the last token.
    step = h.step()
    assert step.scheduled[rid] == 1
    assert new_req_data(step, rid).num_computed_tokens == num_prompt - 1
    assert new_req_data(step, rid).block_ids[0] == held
    assert h.req(rid).status == RequestStatus.RUNNING
    assert_no_transfer(step)

    request = h.req(rid)
    h.run_until_finished({rid, "plain"})
    assert request.num_output_tokens == 3
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_connector_idle(h)


@pytest.mark.parametrize(
    ("num_prompt", "first_block"),
    [
        (3 * BLOCK + 5, 2),  # the 2-block prefix is local, the rest is loaded
        (3 * BLOCK, 2),
        # The whole prompt is the cached prefix: vLLM's local hit stops one
        # token short of the prompt (block-aligned), so the last block is loaded.
        (2 * BLOCK, 1),
    ],
)
def test_decode_loads_only_blocks_after_local_prefix_hit(
    harness, num_prompt, first_block
):
    h = harness("kv_consumer")
    prefix = tokens(2 * BLOCK, seed=3)
    h.add(h.request("first", prefix + tokens(BLOCK + 5, seed=4), max_tokens=2))
    h.run_until_finished("first")
    assert h.free_blocks == h.initial_free_blocks  # cached, but free

    rid = wrapped_id(PREFILL, OWN, "key2")
    prompt = (prefix + tokens(BLOCK + 5, seed=5))[:num_prompt]
    h.add(h.request(rid, prompt, max_tokens=2))
    step = h.step()
    assert h.req(rid).status == RequestStatus.WAITING_FOR_REMOTE_KVS
    num_blocks = cdiv(num_prompt, BLOCK)
    held = h.block_ids(rid)
    assert len(held) == num_blocks
    (load,) = metas(step).loads
    assert load == LoadSpec(
        request_id=rid,
        key="key2",
        prefill_addr=PREFILL,
        first_block=first_block,
        block_ids=held[first_block:],
        num_blocks=num_blocks,
        prompt_digest=ANY,
    )

    step = h.step(finished_recving={rid})
    step = h.step()
    assert new_req_data(step, rid).num_computed_tokens == num_prompt - 1
    assert step.scheduled[rid] == 1
    h.run_until_finished(rid)
    assert_connector_idle(h)


@pytest.mark.parametrize("local_prefix_blocks", [0, 2])
def test_failed_load_is_recomputed_from_local_prefix(harness, local_prefix_blocks):
    h = harness("kv_consumer")
    prefix = tokens(2 * BLOCK, seed=6)
    if local_prefix_blocks:
        h.add(h.request("first", prefix + tokens(5, seed=7), max_tokens=1))
        h.run_until_finished("first")
    num_prompt = 3 * BLOCK + 5
    rid = wrapped_id(PREFILL, OWN, "key3")
    h.add(
        h.request(rid, (prefix + tokens(BLOCK + 5, seed=8))[:num_prompt], max_tokens=3)
    )
    h.add(h.request("plain", tokens(10, seed=9), max_tokens=6))

    step = h.step()
    (load,) = metas(step).loads
    assert load.first_block == local_prefix_blocks
    assert h.req(rid).status == RequestStatus.WAITING_FOR_REMOTE_KVS

    # Every block of the load failed, reported with the request's completion.
    step = h.step(invalid_block_ids=set(load.block_ids), finished_recving={rid})
    assert h.req(rid).num_computed_tokens == local_prefix_blocks * BLOCK

    step = h.step()
    local = local_prefix_blocks * BLOCK
    assert computed_before_step(step, rid) == local
    assert step.scheduled[rid] == num_prompt - local  # recomputed locally ...
    assert metas(step).loads == []  # ... never asked for again
    assert h.req(rid).status == RequestStatus.RUNNING

    request = h.req(rid)
    h.run_until_finished({rid, "plain"})
    assert request.num_output_tokens == 3
    assert_connector_idle(h)


def test_partly_failed_load_is_recomputed_from_first_bad_block(harness):
    h = harness("kv_consumer")
    num_prompt = 3 * BLOCK + 5
    rid = wrapped_id(PREFILL, OWN, "key4")
    h.add(h.request(rid, tokens(num_prompt, seed=10), max_tokens=2))
    (load,) = metas(h.step()).loads
    assert len(load.block_ids) == 4

    h.step(invalid_block_ids={load.block_ids[2]}, finished_recving={rid})
    step = h.step()
    assert computed_before_step(step, rid) == 2 * BLOCK
    assert step.scheduled[rid] == num_prompt - 2 * BLOCK
    assert metas(step).loads == []
    h.run_until_finished(rid)
    assert_connector_idle(h)


def test_abort_while_waiting_for_remote_kv_frees_after_recv(harness):
    h = harness("kv_consumer")
    rid = wrapped_id(PREFILL, OWN, "key5")
    h.add(h.request(rid, tokens(3 * BLOCK + 5, seed=11), max_tokens=3))
    h.add(h.request("plain", tokens(10, seed=12), max_tokens=20))
    h.step()
    held = h.block_ids(rid)
    free = h.free_blocks

    aborted = h.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in aborted] == [rid]
    # The worker may still be writing into the blocks: they stay held.
    for _ in range(3):
        step = h.step()
        assert rid not in step.scheduled
        assert h.block_ids(rid) == held
        assert h.free_blocks == free
        assert h.req(rid).status == RequestStatus.FINISHED_ABORTED
        assert_no_transfer(step)

    h.step(finished_recving={rid})  # the worker reports the load done (or given up)
    assert rid not in h.scheduler.requests
    assert h.free_blocks == free + len(held)
    h.run_until_finished("plain")
    assert_connector_idle(h)


def test_abort_after_recv_reported_frees_at_once(harness):
    h = harness("kv_consumer")
    rid = wrapped_id(PREFILL, OWN, "key6")
    h.add(h.request(rid, tokens(2 * BLOCK, seed=13), max_tokens=3))
    h.step()
    h.step(finished_recving={rid})
    assert h.req(rid).status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    assert rid not in h.scheduler.requests
    assert_connector_idle(h)


def test_load_reported_in_the_step_that_issued_it(harness):
    h = harness("kv_consumer")
    rid = wrapped_id(PREFILL, OWN, "key19")
    h.add(h.request(rid, tokens(BLOCK + 5, seed=35), max_tokens=2))
    step = h.step(finished_recving={rid})
    assert len(metas(step).loads) == 1
    step = h.step()
    assert step.scheduled == {rid: 1}
    assert new_req_data(step, rid).num_computed_tokens == BLOCK + 4
    h.run_until_finished(rid)
    assert_connector_idle(h)


def test_decode_request_admitted_later_is_loaded_once(harness):
    """While blocks are short the scheduler asks the connector again every
    step (no side effects); the load is issued once, when it is admitted."""
    h = harness("kv_consumer", num_blocks=8)  # 7 usable blocks
    h.add(h.request("plain", tokens(4 * BLOCK, seed=14), max_tokens=3))
    h.step()
    rid = wrapped_id(PREFILL, OWN, "key7")
    h.add(h.request(rid, tokens(3 * BLOCK + 5, seed=15), max_tokens=2))
    loads = []
    for _ in range(6):
        step = h.step()
        loads += metas(step).loads
        if h.req(rid).status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
        assert h.req(rid).status == RequestStatus.WAITING
    assert h.req(rid).status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(loads) == 1 and loads[0].block_ids == h.block_ids(rid)
    h.step(finished_recving={rid})
    h.run_until_finished(rid)
    assert_connector_idle(h)


def test_preempted_loaded_request_is_recomputed_not_reloaded(harness):
    h = harness("kv_consumer")
    num_prompt = 3 * BLOCK + 5
    rid = wrapped_id(PREFILL, OWN, "key8")
    h.add(h.request(rid, tokens(num_prompt, seed=16), max_tokens=6))
    assert len(metas(h.step()).loads) == 1
    h.step(finished_recving={rid})
    step = h.step()
    assert step.scheduled[rid] == 1

    # Preempt every running request and drop the prefix cache (vLLM's
    # reset_prefix_cache with reset_running_requests): no local hit is left.
    h.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert h.req(rid).status == RequestStatus.PREEMPTED
    assert h.req(rid).num_computed_tokens == 0

    step = h.step()
    assert metas(step).loads == []
    assert h.req(rid).status == RequestStatus.RUNNING
    assert computed_before_step(step, rid) == 0
    assert (
        step.scheduled[rid] == num_prompt + 1
    )  # recomputed locally: prompt + 1 output
    h.run_until_finished(rid)
    assert_connector_idle(h)


# --- requests without (usable) peer information ------------------------------

UNUSABLE = [
    pytest.param("cmpl-plain-0-1a2b3c4d", None, id="no-peer-info"),
    pytest.param("cmpl-x-0", {"do_remote_prefill": True}, id="foreign-params"),
    pytest.param(
        "___prefill_addr_10.0.0.1___decode_addr_127.0.0.1:21001_k", None, id="no-port"
    ),
    pytest.param("x___decode_addr_127.0.0.1:21001_k", None, id="decode-only-id"),
    pytest.param(
        "___prefill_addr_10.0.0.1:99999___decode_addr_127.0.0.1:21001_k",
        None,
        id="bad-port",
    ),
    pytest.param(
        "___prefill_addr_10.0.0.1:21001___decode_addr_127.0.0.1:21001_",
        None,
        id="no-key",
    ),
    pytest.param("cmpl-1", {"p2p_prefill_addr": PREFILL}, id="params-missing-keys"),
    pytest.param(
        "cmpl-2",
        {"p2p_prefill_addr": "nohost", "p2p_decode_addr": OWN, "p2p_request_key": "k"},
        id="params-bad-addr",
    ),
    pytest.param(
        "cmpl-3",
        {
            "p2p_prefill_addr": PREFILL,
            "p2p_decode_addr": OWN,
            "p2p_request_key": "bad key!",
        },
        id="params-bad-key",
    ),
    pytest.param(
        make_request_id(PREFILL, OWN, "good"),
        {"p2p_prefill_addr": PREFILL, "p2p_decode_addr": OWN, "p2p_request_key": 5},
        id="bad-params-beat-good-id",
    ),
]


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer", "kv_both"])
@pytest.mark.parametrize(("req_id", "params"), UNUSABLE)
def test_request_without_usable_peer_info_is_computed_locally(
    harness, role, req_id, params
):
    h = harness(role)
    h.add(
        h.request(
            req_id,
            tokens(3 * BLOCK + 5, seed=17),
            max_tokens=2,
            kv_transfer_params=params,
        )
    )
    step = h.step()
    assert step.scheduled == {req_id: 3 * BLOCK + 5}
    assert_no_transfer(step)
    steps = h.run_until_finished(req_id)
    assert all(not metas(s).loads and not metas(s).saves for s in steps)
    # Not delay-freed: gone as soon as it finished.
    assert_connector_idle(h)


# --- prefill (kv_producer) ----------------------------------------------------


@pytest.mark.parametrize("send_type", ["PUT", "GET", "PUT_ASYNC"])
@pytest.mark.parametrize("num_prompt", [1, BLOCK, 3 * BLOCK + 5, 2 * BUDGET + 22])
def test_prefill_saves_in_the_step_completing_the_prompt(
    harness, send_type, num_prompt
):
    h = harness("kv_producer", send_type=send_type)
    rid = wrapped_id(OWN, DECODE, "key9")
    h.add(h.request(rid, tokens(num_prompt, seed=18), max_tokens=1))
    h.add(h.request("plain", tokens(10, seed=19), max_tokens=10))

    num_chunks = cdiv(num_prompt + 10, BUDGET)  # "plain" takes 10 of the first step
    for _ in range(num_chunks - 1):
        step = h.step()
        assert 0 < step.scheduled[rid] < num_prompt
        assert_no_transfer(step)  # never before the last chunk
        assert h.req(rid).status == RequestStatus.RUNNING

    step = h.step()
    assert h.req(rid).num_computed_tokens == num_prompt
    num_blocks = cdiv(num_prompt, BLOCK)
    held = h.block_ids(rid)
    assert metas(step).saves == [
        SaveSpec(
            request_id=rid,
            key="key9",
            decode_addr=DECODE,
            block_ids=held[:num_blocks],
            prompt_digest=ANY,
        )
    ]
    assert metas(step).loads == []
    # max_tokens=1: finished in this step, its blocks kept for the send.
    assert rid in step.finished()
    assert h.req(rid).status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert h.holds_blocks(rid)

    for _ in range(2):
        step = h.step()
        assert_no_transfer(step)
        assert h.block_ids(rid) == held

    h.step(finished_sending={rid})
    assert rid not in h.scheduler.requests
    assert not h.holds_blocks(rid)
    h.run_until_finished("plain")
    assert_connector_idle(h)


def test_prefill_send_reported_in_the_step_of_its_save_frees(harness):
    """PUT: the workers may send during the forward pass and report it at
    the end of the same step; the request finishes (max_tokens=1) before
    the scheduler reads the report, so the delayed free completes at once."""
    h = harness("kv_producer")
    rid = wrapped_id(OWN, DECODE, "key10")
    h.add(h.request(rid, tokens(BLOCK + 3, seed=20), max_tokens=1))
    step = h.step(finished_sending={rid})
    assert [save.key for save in metas(step).saves] == ["key10"]
    assert rid in step.finished()
    assert_connector_idle(h)


def test_prefill_aborted_in_the_step_of_its_save_frees_after_sending(harness):
    """An abort that arrives while the step that sends the KV runs: the
    workers got the SaveSpec, so the free waits for their report."""
    h = harness("kv_producer")
    rid = wrapped_id(OWN, DECODE, "key20")
    h.add(h.request(rid, tokens(BLOCK + 5, seed=36), max_tokens=5))

    def abort(_output):
        h.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    step = h.step(between=abort)
    assert len(metas(step).saves) == 1
    assert h.req(rid).status == RequestStatus.FINISHED_ABORTED
    assert h.holds_blocks(rid)
    h.step()
    assert h.holds_blocks(rid)
    h.step(finished_sending={rid})
    assert_connector_idle(h)


def test_prefill_with_local_prefix_hit_saves_every_prompt_block(harness):
    h = harness("kv_producer")
    prefix = tokens(2 * BLOCK, seed=21)
    h.add(h.request("first", prefix + tokens(3, seed=22), max_tokens=1))
    h.run_until_finished("first")

    rid = wrapped_id(OWN, DECODE, "key11")
    h.add(h.request(rid, prefix + tokens(BLOCK + 5, seed=23), max_tokens=1))
    step = h.step()
    assert new_req_data(step, rid).num_computed_tokens == 2 * BLOCK
    (save,) = metas(step).saves
    assert save.block_ids == h.block_ids(rid)[:4] and len(save.block_ids) == 4
    h.step(finished_sending={rid})
    assert_connector_idle(h)


def test_prefill_aborted_before_last_chunk_is_not_saved_and_freed_at_once(harness):
    h = harness("kv_producer")
    rid = wrapped_id(OWN, DECODE, "key12")
    h.add(h.request(rid, tokens(2 * BUDGET + 22, seed=24), max_tokens=1))
    step = h.step()
    assert step.scheduled == {rid: BUDGET}
    assert_no_transfer(step)

    h.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    assert rid not in h.scheduler.requests
    assert h.free_blocks == h.initial_free_blocks
    for _ in range(3):
        assert_no_transfer(h.step())
    assert_connector_idle(h)


def test_prefill_preempted_mid_prompt_saves_its_new_blocks(harness):
    h = harness("kv_producer")
    num_prompt = 2 * BUDGET + 22
    rid = wrapped_id(OWN, DECODE, "key13")
    h.add(h.request(rid, tokens(num_prompt, seed=25), max_tokens=1))
    h.step()
    first_chunk_blocks = h.block_ids(rid)[:4]
    # Preempted mid-prompt; it resumes (scheduled_cached_reqs.resumed_req_ids)
    # with a new block table, not the one its first chunk had.
    h.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert h.req(rid).status == RequestStatus.PREEMPTED
    h.add(h.request("plain", tokens(3 * BLOCK, seed=26), max_tokens=30))

    saves = []
    for _ in range(10):
        step = h.step()
        saves += metas(step).saves
        if h.is_finished(rid):
            break
    (save,) = saves
    assert save.block_ids == h.block_ids(rid)[: cdiv(num_prompt, BLOCK)]
    # (Only meaningful if it was given other blocks when it resumed.)
    assert save.block_ids[:4] != first_chunk_blocks
    h.step(finished_sending={rid})
    h.run_until_finished("plain")
    assert_connector_idle(h)


# --- kv_both: the addresses decide --------------------------------------------


def test_kv_both_acts_as_decode_when_named_decode(harness):
    h = harness("kv_both")
    rid = wrapped_id(PREFILL, OWN, "key14")
    h.add(h.request(rid, tokens(BLOCK + 5, seed=27), max_tokens=2))
    step = h.step()
    (load,) = metas(step).loads
    assert (load.key, load.prefill_addr, load.first_block) == ("key14", PREFILL, 0)
    assert metas(step).saves == []
    assert h.req(rid).status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.step(finished_recving={rid})
    steps = h.run_until_finished(rid)
    assert all(not metas(s).saves for s in steps)  # a decode never sends
    assert_connector_idle(h)


def test_kv_both_acts_as_prefill_when_named_prefill(harness):
    h = harness("kv_both")
    rid = wrapped_id(OWN, DECODE, "key15")
    h.add(h.request(rid, tokens(BLOCK + 5, seed=28), max_tokens=1))
    step = h.step()
    assert step.scheduled == {rid: BLOCK + 5}
    assert metas(step).loads == []
    (save,) = metas(step).saves
    assert (save.key, save.decode_addr, save.block_ids) == (
        "key15",
        DECODE,
        h.block_ids(rid),
    )
    assert h.holds_blocks(rid)
    h.step(finished_sending={rid})
    assert_connector_idle(h)


def test_kv_both_computes_locally_when_named_neither(harness):
    h = harness("kv_both")
    rid = wrapped_id(PREFILL, DECODE, "key16")
    h.add(h.request(rid, tokens(BLOCK + 5, seed=29), max_tokens=1))
    step = h.step()
    assert step.scheduled == {rid: BLOCK + 5}
    assert_no_transfer(step)
    assert_connector_idle(h)  # finished and freed, not delayed


def test_kv_both_on_dp_rank_1_answers_to_its_own_port(harness):
    h = harness("kv_both", data_parallel_rank=1)  # 127.0.0.1:21002
    to_rank0 = wrapped_id(PREFILL, OWN, "key17")
    to_rank1 = wrapped_id(PREFILL, "127.0.0.1:21002", "key18")
    h.add(h.request(to_rank0, tokens(BLOCK, seed=30), max_tokens=1))
    h.add(h.request(to_rank1, tokens(BLOCK, seed=31), max_tokens=1))
    step = h.step()
    assert [load.key for load in metas(step).loads] == ["key18"]
    assert step.scheduled == {to_rank0: BLOCK}


# --- kv_transfer_params win over the request id ---------------------------------


def test_params_win_over_id_on_decode(harness):
    h = harness("kv_consumer")
    rid = wrapped_id(ANOTHER, DECODE, "idkey")
    params = make_kv_transfer_params(PREFILL, OWN, "paramkey")
    h.add(
        h.request(
            rid, tokens(BLOCK + 5, seed=32), max_tokens=1, kv_transfer_params=params
        )
    )
    (load,) = metas(h.step()).loads
    assert (load.key, load.prefill_addr) == ("paramkey", PREFILL)


def test_params_win_over_id_on_prefill(harness):
    h = harness("kv_producer")
    rid = wrapped_id(ANOTHER, ANOTHER, "idkey")
    params = make_kv_transfer_params(OWN, DECODE, "paramkey")
    h.add(
        h.request(
            rid, tokens(BLOCK + 5, seed=33), max_tokens=1, kv_transfer_params=params
        )
    )
    (save,) = metas(h.step()).saves
    assert (save.key, save.decode_addr) == ("paramkey", DECODE)
    h.step(finished_sending={rid})
    assert_connector_idle(h)


@pytest.mark.parametrize("params_say", ["decode", "prefill", "neither"])
def test_params_win_over_id_on_kv_both(harness, params_say):
    h = harness("kv_both")
    # The id names this instance as the decode for one case, the prefill for another.
    id_says = {
        "decode": (OWN, DECODE),
        "prefill": (PREFILL, OWN),
        "neither": (PREFILL, OWN),
    }
    params = {
        "decode": make_kv_transfer_params(PREFILL, OWN, "pk"),
        "prefill": make_kv_transfer_params(OWN, DECODE, "pk"),
        "neither": make_kv_transfer_params(PREFILL, DECODE, "pk"),
    }[params_say]
    rid = wrapped_id(*id_says[params_say], "idkey")
    h.add(
        h.request(
            rid, tokens(BLOCK + 5, seed=34), max_tokens=1, kv_transfer_params=params
        )
    )
    meta = metas(h.step())
    assert [load.key for load in meta.loads] == (
        ["pk"] if params_say == "decode" else []
    )
    assert [save.key for save in meta.saves] == (
        ["pk"] if params_say == "prefill" else []
    )


# --- prompt-embeds requests, and its own address in any spelling ---


def prompt_embeds(num_tokens: int):
    import torch

    return torch.randn(
        num_tokens, 128, generator=torch.Generator().manual_seed(num_tokens)
    )


def test_decode_prompt_embeds_request_is_loaded(harness):
    h = harness("kv_consumer")
    rid = wrapped_id(PREFILL, OWN, "key21")
    h.add(h.request(rid, None, prompt_embeds=prompt_embeds(BLOCK + 5), max_tokens=1))
    (load,) = metas(h.step()).loads
    assert load.num_blocks == 2 and load.block_ids == h.block_ids(rid)


def test_prefill_prompt_embeds_request_is_saved(harness):
    h = harness("kv_producer")
    rid = wrapped_id(OWN, DECODE, "key22")
    h.add(h.request(rid, None, prompt_embeds=prompt_embeds(BLOCK + 5), max_tokens=1))
    step = h.step()
    assert [save.key for save in metas(step).saves] == ["key22"]
    assert h.holds_blocks(rid)


@pytest.mark.parametrize(
    ("kv_ip", "decode_addr"),
    [
        ("::1", "[0:0:0:0:0:0:0:1]:21001"),
        ("Decode-1.example", "decode-1.example:21001"),
    ],
)
def test_kv_both_recognizes_its_address_in_any_spelling(
    harness, kv_ip, decode_addr, monkeypatch
):
    # A host name may be reachable beyond loopback: the plane needs its secret.
    monkeypatch.setenv(envs.VLLM_DISAGG_P2P_SECRET, "s3cr3t")
    h = harness("kv_both", kv_ip=kv_ip)
    rid = wrapped_id(PREFILL, decode_addr, "key23")
    h.add(h.request(rid, tokens(BLOCK + 5, seed=37), max_tokens=1))
    assert [load.key for load in metas(h.step()).loads] == ["key23"]


# --- who vouches for the named peers (issue 17) ------------------------------

NOT_VOUCHED = [
    pytest.param(None, id="no-grant"),
    pytest.param("v1.9999999999." + "0" * 32, id="forged-grant"),
    pytest.param("not a grant", id="malformed-grant"),
]


def count_refusals(h, monkeypatch) -> list:
    """Calls of the refused_peers counter (vLLM's scheduler drains the stats)."""
    calls: list = []
    monkeypatch.setattr(
        h.connector.stats, "record_refused_peers", lambda: calls.append(1)
    )
    return calls


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
@pytest.mark.parametrize("grant", NOT_VOUCHED)
def test_peers_nobody_vouches_for_are_computed_locally_and_counted(
    harness, role, grant, monkeypatch
):
    """A client naming peers itself (HTTP-only poisoning, outbound connections
    to any address) gets a plain local computation; nothing waits or sends."""
    h = harness(role)
    refused = count_refusals(h, monkeypatch)
    prefill, decode = (PREFILL, OWN) if role == "kv_consumer" else (OWN, DECODE)
    rid = wrapped_id(prefill, decode, "forged")
    params = None if grant is None else {GRANT_KEY: grant}
    h.add(
        h.request(
            rid,
            tokens(2 * BLOCK, seed=41),
            max_tokens=2,
            grant=False,
            kv_transfer_params=params,
        )
    )
    step = h.step()
    assert step.scheduled == {rid: 2 * BLOCK}
    assert_no_transfer(step)
    h.run_until_finished(rid)
    assert_connector_idle(h)
    assert refused == [1]


def test_a_grant_is_bound_to_its_peers_and_key(harness, monkeypatch):
    """A grant the router made for one request cannot name another decode."""
    h = harness("kv_producer")
    refused = count_refusals(h, monkeypatch)
    good = make_grant(fleet_router_token(), OWN, DECODE, "k1")
    rid = wrapped_id(OWN, ANOTHER, "k1")
    h.add(
        h.request(
            rid,
            tokens(BLOCK, seed=42),
            max_tokens=1,
            grant=False,
            kv_transfer_params={GRANT_KEY: good},
        )
    )
    assert_no_transfer(h.step())
    assert refused == [1]


def test_allowed_peers_vouch_without_a_grant(model_dir, monkeypatch):
    monkeypatch.delenv(envs.VLLM_DISAGG_ROUTER_TOKEN, raising=False)
    vllm_config_kw = dict(block_size=BLOCK, max_num_batched_tokens=BUDGET)
    from vllm_disagg.testing.scheduler import make_scheduler, make_vllm_config

    vllm_config = make_vllm_config(model_dir, "kv_producer", **vllm_config_kw)
    vllm_config.kv_transfer_config.kv_connector_extra_config["allowed_peers"] = (
        "10.0.0.2"
    )
    scheduler = make_scheduler(vllm_config, num_blocks=64)
    connector = scheduler.connector._scheduler
    vouching = connector._vouching
    from vllm_disagg.wire.peers import parse_peer_info

    assert (
        vouching.refusal(parse_peer_info(wrapped_id(OWN, DECODE, "a"), None), None)
        is None
    )
    assert vouching.refusal(parse_peer_info(wrapped_id(OWN, ANOTHER, "b"), None), None)


def test_no_token_and_no_allowed_peers_refuses_to_start(model_dir, monkeypatch):
    """Beyond loopback (here: the router); on loopback the local cookie
    vouches instead (test_local_cookie.py)."""
    from vllm_disagg.testing.scheduler import make_scheduler, make_vllm_config

    monkeypatch.delenv(envs.VLLM_DISAGG_ROUTER_TOKEN, raising=False)
    vllm_config = make_vllm_config(model_dir, "kv_consumer")
    vllm_config.kv_transfer_config.kv_connector_extra_config.update(
        proxy_ip="10.0.1.1", proxy_port=30001, http_port=20002
    )
    with pytest.raises(
        ConfigError, match=r"nothing vouches for the peers.*allowed_peers"
    ):
        make_scheduler(vllm_config, num_blocks=64)


# --- one transfer per key: n > 1, beam search, retries ------------------------


def test_decode_siblings_sharing_a_key_do_not_wait(harness):
    """With n > 1: the children share the proxy's key; only the first loads, the
    others compute at once (they used to wait kv_load_timeout_s)."""
    h = harness("kv_consumer")
    proxy_id = make_request_id(PREFILL, OWN, "shared")
    first, second = f"0_cmpl-{proxy_id}-0-aa", f"1_cmpl-{proxy_id}-0-aa"
    prompt = tokens(2 * BLOCK, seed=43)
    h.add(
        h.request(first, prompt, max_tokens=2), h.request(second, prompt, max_tokens=2)
    )
    step = h.step()
    assert [load.request_id for load in metas(step).loads] == [first]
    assert step.scheduled == {second: 2 * BLOCK}
    assert h.is_waiting_for_remote(first)


def test_beam_search_steps_reusing_a_key_do_not_wait(harness):
    """Beam search sends {id}-{uuid}-beam-{i} per step, all with the key."""
    h = harness("kv_consumer")
    proxy_id = make_request_id(PREFILL, OWN, "beam")
    prompt = tokens(BLOCK + 3, seed=44)
    first = f"cmpl-{proxy_id}-1111-beam-0"
    h.add(h.request(first, prompt, max_tokens=1))
    assert metas(h.step()).loads
    h.step(finished_recving={first})
    h.run_until_finished(first)
    later = f"cmpl-{proxy_id}-2222-beam-0"
    h.add(h.request(later, prompt + [5], max_tokens=1))
    step = h.step()
    assert not metas(step).loads and later in step.scheduled


def test_prefill_sends_one_transfer_per_key(harness):
    """A retried id or n > 1 on the prefill: a second hold of one key used to
    orphan the first and keep the engine busy."""
    h = harness("kv_producer", send_type="GET")
    proxy_id = make_request_id(OWN, DECODE, "once")
    prompt = tokens(BLOCK, seed=45)
    h.add(h.request(f"cmpl-{proxy_id}-0-aa", prompt, max_tokens=1))
    h.add(h.request(f"cmpl-{proxy_id}-0-bb", prompt, max_tokens=1))
    saves = [save.request_id for save in metas(h.step()).saves]
    assert saves == [f"cmpl-{proxy_id}-0-aa"]


def test_load_and_save_carry_the_prompt_digest(harness):
    prompt = tokens(BLOCK + 7, seed=46)
    h = harness("kv_consumer")
    h.add(h.request(wrapped_id(PREFILL, OWN, "d1"), prompt, max_tokens=1))
    (load,) = metas(h.step()).loads
    model = h.connector.fingerprint.digest
    assert len(model) == 16
    assert load.prompt_digest == prompt_digest(prompt, model)
    p = harness("kv_producer")
    p.add(p.request(wrapped_id(OWN, DECODE, "d2"), prompt, max_tokens=1))
    (save,) = metas(p.step()).saves
    assert save.prompt_digest == prompt_digest(prompt, model)
    assert prompt_digest(prompt, model) != prompt_digest(
        prompt[:-1] + [prompt[-1] + 1], model
    )
    # Another model's KV of the same prompt has another digest: refused.
    assert prompt_digest(prompt, model) != prompt_digest(prompt, bytes(16))


def test_decode_with_prompt_logprobs_does_not_wait_and_refuses_the_kv(harness):
    """Upstream vLLM computes a prompt_logprobs request's whole prompt itself; the
    decode must not wait for KV, and tells its workers to refuse the offer
    (the prefill then frees its blocks at once instead of holding them)."""
    h = harness("kv_consumer")
    rid = wrapped_id(PREFILL, OWN, "plp")
    h.add(h.request(rid, tokens(2 * BLOCK, seed=47), max_tokens=2, prompt_logprobs=1))
    step = h.step()
    assert step.scheduled == {rid: 2 * BLOCK}
    assert metas(step).loads == [] and metas(step).unwanted == ["plp"]
    assert metas(h.step()).unwanted == []


def test_a_request_naming_this_instance_twice_is_computed_locally(harness):
    """It would wait for KV from itself, pinning its blocks (with
    allowed_peers, nothing else would have refused it)."""
    h = harness("kv_consumer")
    rid = wrapped_id(OWN, OWN, "self")
    h.add(h.request(rid, tokens(BLOCK, seed=48), max_tokens=1))
    step = h.step()
    assert step.scheduled == {rid: BLOCK} and not metas(step).loads
