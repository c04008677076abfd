"""A transfer key is used once per side for as long as its grant is valid
(issue 28): a grant lives 600 s, a used key was remembered 180 s, so a grant
captured from a log could move KV again after three minutes.

Against a real vLLM Scheduler (``vllm_disagg.testing.scheduler``); time is
moved by giving the connector's scheduler module and the grant checker a
clock that runs ahead.
"""

from __future__ import annotations

import time

import pytest

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import (
    scheduler as scheduler_module,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.metadata import (
    P2pConnectorMetadata,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.scheduler import (
    UsedKeys,
)
from vllm_disagg.testing.scheduler import SchedulerHarness, tokens, write_model_config
from vllm_disagg.testing.server import fleet_router_token
from vllm_disagg.wire import grants as grants_module
from vllm_disagg.wire.grants import (
    DEFAULT_GRANT_TTL_S,
    GRANT_KEY,
    MAX_GRANT_TTL_S,
    make_grant,
)
from vllm_disagg.wire.peers import make_request_id

BLOCK = 16
OWN = "127.0.0.1:21001"  # this instance
PREFILL = "10.0.0.1:21001"
DECODE = "10.0.0.2:22001"


class Ahead:
    """``time`` as the patched modules see it: ``offset`` seconds later."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def time(self) -> float:
        return time.time() + self.offset


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_config(tmp_path_factory.mktemp("used-keys-model"))


@pytest.fixture
def clock(monkeypatch) -> Ahead:
    ahead = Ahead()
    monkeypatch.setattr(scheduler_module, "time", ahead)
    monkeypatch.setattr(grants_module, "time", ahead)
    return ahead


def meta(step) -> P2pConnectorMetadata:
    assert isinstance(step.meta, P2pConnectorMetadata)
    return step.meta


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
def test_a_captured_grant_moves_no_kv_again_while_it_is_valid(
    model_dir, clock, role, monkeypatch
):
    h = SchedulerHarness(model_dir, role, block_size=BLOCK, max_num_batched_tokens=64)
    refused: list[int] = []
    monkeypatch.setattr(
        h.connector.stats, "record_refused_peers", lambda: refused.append(1)
    )
    prefill, decode = (PREFILL, OWN) if role == "kv_consumer" else (OWN, DECODE)
    proxy_id = make_request_id(prefill, decode, "captured")
    grant = make_grant(fleet_router_token(), prefill, decode, "captured")
    prompt = tokens(2 * BLOCK, seed=60)

    def send(suffix: str):
        rid = f"cmpl-{proxy_id}-0-{suffix}"
        h.add(
            h.request(
                rid,
                prompt,
                max_tokens=1,
                grant=False,
                kv_transfer_params={GRANT_KEY: grant},
            )
        )
        return rid, h.step()

    rid, step = send("first")
    moved = meta(step).loads if role == "kv_consumer" else meta(step).saves
    assert [spec.request_id for spec in moved] == [rid]
    if role == "kv_consumer":
        h.step(finished_recving={rid})
    else:
        h.step(finished_sending={rid})
    h.run_until_finished(rid)

    # The old memory (2 * max(load, hold) + 60 = 180 s) forgot the key here.
    for offset in (181.0, DEFAULT_GRANT_TTL_S - 2):
        clock.offset = offset
        replay, step = send(f"replay{int(offset)}")
        assert meta(step).loads == [] and meta(step).saves == []
        assert replay in step.scheduled  # computed locally at once, no wait
        h.run_until_finished(replay)
    assert refused == []  # vouched for (a valid grant), refused as a used key
    # Once it expired, the grant itself is refused.
    clock.offset = DEFAULT_GRANT_TTL_S + 2
    late, step = send("late")
    assert meta(step).loads == [] and meta(step).saves == []
    assert late in step.scheduled and refused == [1]
    h.run_until_finished(late)


def test_a_full_memory_refuses_what_a_forgotten_grant_could_replay(clock):
    keys = UsedKeys(ttl_s=180.0, max_keys=2)
    now = int(time.time())
    keys.add("a", now + 600)
    keys.add("b", now + 601)
    keys.add("c", now + 602)  # "a" is forgotten, its grant still valid
    assert "a" not in keys._keys
    assert keys.used("a", now + 600) and keys.refused_forgotten == 1
    assert keys.used("b", now + 601) and keys.used("c", now + 602)
    # A grant made later (one router: expires later) is not held up.
    assert not keys.used("d", now + 603)
    # A key without a grant has only its duplicate window: a forgotten one
    # is not refused (there is no grant to replay).
    keys.add("plain")
    keys.add("e", now + 604)
    keys.add("f", now + 605)
    assert not keys.used("plain")
    # Expired grants forgotten raise nothing; the remembered ones expire.
    clock.offset = 700.0
    assert not keys.used("e", None) and not keys.used("f")
    assert not keys.used("g", now + 1300)


def test_a_key_is_remembered_until_its_grant_expires_and_no_longer_than_the_cap(
    clock,
):
    keys = UsedKeys(ttl_s=180.0)
    now = time.time()
    keys.add("granted", now + DEFAULT_GRANT_TTL_S)
    keys.add("plain")
    keys.add("bogus", now + 10 * MAX_GRANT_TTL_S)  # check_grant refuses these
    clock.offset = 181.0
    assert "granted" in keys and "plain" not in keys
    clock.offset = DEFAULT_GRANT_TTL_S - 1
    assert "granted" in keys
    clock.offset = DEFAULT_GRANT_TTL_S + 1
    assert "granted" not in keys
    clock.offset = MAX_GRANT_TTL_S + 1
    assert "bogus" not in keys
