"""Selective disaggregation and DP groups placed as one: the size estimates,
the ``dp_balanced`` policy against the registry's real leases, and a router
(fake instances) sending short prompts to the decode alone."""

from __future__ import annotations

import pytest

from vllm_disagg.errors import ConfigError
from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.placement import DpBalancedPolicy
from vllm_disagg.router.policy import LeastOutstandingPolicy, make_policy
from vllm_disagg.router.prompt_size import (
    DEFAULT_OUTPUT_TOKENS,
    output_tokens,
    prompt_tokens,
    request_tokens,
)
from vllm_disagg.router.registry import InstanceRegistry
from vllm_disagg.router.selective import SHORT_PROMPT, SelectiveDisaggregation
from vllm_disagg.wire.discovery import DISCOVERY_VERSION, Register, Role

from .conftest import FakeClock

GROUP_A, GROUP_B = "a" * 16, "b" * 16


def rank(registry, name: str, port: int, group: str = "", rank: int = 0):
    registry.register(
        Register(
            DISCOVERY_VERSION,
            name,
            Role.DECODE,
            f"10.0.0.1:{port}",
            f"10.0.0.1:{port + 1000}",
            "m",
            dp_rank=rank,
            dp_size=2 if group else 1,
            dp_group=group,
        )
    )
    return registry.get(name)


def body(chars: int, max_tokens: int = 16, head: str = "") -> dict:
    return {"model": "m", "prompt": head + "x" * chars, "max_tokens": max_tokens}


# --- estimates --------------------------------------------------------------


def test_prompt_tokens_count_ids_exactly_and_text_by_utf8_bytes():
    assert prompt_tokens({"prompt": [5, 6, 7]}, 4.0)[0] == 3
    assert prompt_tokens({"prompt": [[1, 2], [3]]}, 4.0)[0] == 3
    assert prompt_tokens({"prompt": "abcdefgh"}, 4.0)[0] == 2
    # Three bytes a CJK character: about a token each, as BPE gives them.
    assert prompt_tokens({"prompt": "\u4e00" * 8}, 4.0)[0] == 6
    chat = {"messages": [{"role": "user", "content": "y" * 400}]}
    assert 100 <= prompt_tokens(chat, 4.0)[0] <= 104
    # Bounded: a huge prompt is read no further than asked.
    tokens, text = prompt_tokens({"prompt": "z" * 10_000_000}, 4.0, 1000)
    assert len(text) == 1000 and tokens == 250


def test_output_tokens_read_every_limit_name_and_n():
    assert output_tokens({"max_tokens": 7}) == 7
    assert output_tokens({"max_completion_tokens": "9", "max_tokens": 3}) == 9
    assert output_tokens({"max_output_tokens": 5}, "/v1/responses") == 5
    assert output_tokens({}) == DEFAULT_OUTPUT_TOKENS
    assert output_tokens({"max_tokens": "bad"}) == DEFAULT_OUTPUT_TOKENS
    assert output_tokens({"max_tokens": 4, "n": 3}) == 12
    assert (
        output_tokens({"sampling_params": {"max_tokens": 6}}, "/inference/v1/generate")
        == 6
    )
    assert request_tokens({"prompt": [1] * 10, "max_tokens": 5}, 4.0) == (10, 15)


# --- leases carry tokens ----------------------------------------------------------


def test_tokens_in_flight_are_held_by_leases_and_released_once():
    registry = InstanceRegistry(clock=FakeClock())
    d = rank(registry, "d", 1)
    first = registry.reserve(d, 100)
    second = registry.reserve(d, 30)
    assert (d.tokens_in_flight, d.outstanding) == (130, 2)
    moved = first.transfer()  # the stream relay holds it now
    first.release(True)
    assert d.tokens_in_flight == 130
    moved.release(True)
    moved.release(True)
    assert d.tokens_in_flight == 30
    second.release(None)
    assert (d.tokens_in_flight, d.outstanding) == (0, 0)


def test_registry_groups_ranks_and_forgets_a_removed_one():
    registry = InstanceRegistry(clock=FakeClock())
    r0 = rank(registry, "r0", 1, GROUP_A, 0)
    r1 = rank(registry, "r1", 2, GROUP_A, 1)
    solo = rank(registry, "solo", 3)
    assert r0.group is r1.group and len(r0.group.members) == 2
    assert solo.group is None
    assert registry.dp_groups() == {f"decode/{GROUP_A}": ["r0", "r1"]}
    registry.deregister("r1")
    assert r0.group.members == [r0]
    registry.deregister("r0")
    assert registry.dp_groups() == {}


# --- dp_balanced --------------------------------------------------------------------


def policy() -> DpBalancedPolicy:
    made = make_policy("dp_balanced", RouterConfig(prefix_chunk_chars=16))
    assert isinstance(made, DpBalancedPolicy)
    return made


def test_tokens_not_counts_decide_within_a_group():
    """A long prompt on r0 and short ones after it: least_outstanding sends
    every other short one to r0 (equal counts), raising the step every rank
    of the group waits for; dp_balanced keeps them on r1 until r1's load
    reaches r0's."""
    short = body(40, max_tokens=16)  # 10 + 16 tokens
    by_count = InstanceRegistry(clock=FakeClock())
    ranks = [rank(by_count, f"r{i}", i + 1, GROUP_A, i) for i in range(2)]
    leases = [by_count.reserve(ranks[0], 4000)]  # a long prompt in flight on r0
    lo = LeastOutstandingPolicy()
    counted = []
    for _ in range(20):
        chosen = lo.select(ranks, short)
        counted.append(chosen.instance_id)
        leases.append(by_count.reserve(chosen, 26))
    assert counted.count("r0") >= 9  # counts even out; r0 carries 4000 more

    registry = InstanceRegistry(clock=FakeClock())
    ranks = [rank(registry, f"r{i}", i + 1, GROUP_A, i) for i in range(2)]
    leases.append(registry.reserve(ranks[0], 4000))
    dp = policy()
    placed = []
    for _ in range(20):
        chosen = dp.select(ranks, short)
        placed.append(chosen.instance_id)
        leases.append(registry.reserve(chosen, 26))
    assert placed == ["r1"] * 20
    assert ranks[1].tokens_in_flight == 520 < ranks[0].tokens_in_flight
    for lease in leases:
        lease.release(True)


def test_the_group_with_the_lowest_resulting_maximum_wins():
    """A's idle rank looks least loaded alone, but A steps at its busy
    rank's pace; B's maximum stays lower with the request on it."""
    registry = InstanceRegistry(clock=FakeClock())
    a0, a1 = rank(registry, "a0", 1, GROUP_A, 0), rank(registry, "a1", 2, GROUP_A, 1)
    b0, b1 = rank(registry, "b0", 3, GROUP_B, 0), rank(registry, "b1", 4, GROUP_B, 1)
    held = [
        registry.reserve(a0, 1000),
        registry.reserve(b0, 500),
        registry.reserve(b1, 400),
    ]
    chosen = policy().select([a0, a1, b0, b1], body(40, max_tokens=60))  # 70 tokens
    assert chosen is b1  # B's max becomes 500; A's would stay 1000
    # A group of one (no dp_group) is its own group.
    solo = rank(registry, "solo", 5)
    assert policy().select([a1, solo], body(4)) in (a1, solo)
    assert policy().select([a0, solo], body(4)) is solo
    for lease in held:
        lease.release(True)


def test_prefix_locality_is_kept_only_where_it_does_not_raise_the_maximum():
    registry = InstanceRegistry(clock=FakeClock())
    r0, r1 = rank(registry, "r0", 1, GROUP_A, 0), rank(registry, "r1", 2, GROUP_A, 1)
    dp = policy()
    shared = "s" * 64  # four 16-character chunks
    first = dp.select([r0, r1], body(10, head=shared))
    other = r1 if first is r0 else r0
    # Equal loads: the holder of the prefix costs nothing more: it stays.
    assert dp.select([r0, r1], body(20, head=shared)) is first
    # The holder carries more than the request adds to the other rank:
    # placing it there would raise the group's maximum, so it moves.
    held = registry.reserve(first, 500)
    assert dp.select([r0, r1], body(30, head=shared)) is other
    held.release(True)
    # The holder is now the other rank (it took the prefix last).
    assert dp.select([r0, r1], body(40, head=shared)) is other


# --- selective disaggregation ------------------------------------------------------


def test_short_uncached_prompts_go_alone_and_the_decodes_cache_counts():
    registry = InstanceRegistry(clock=FakeClock())
    d1, d2 = rank(registry, "d1", 1), rank(registry, "d2", 2)
    sel = SelectiveDisaggregation(64, 4.0, 1024, 16)
    assert sel.reason(body(200, head="p"), d1) == SHORT_PROMPT  # 50 tokens
    assert sel.reason(body(400, head="q"), d1) is None  # 100 tokens
    assert sel.reason({"prompt": list(range(63))}, d1) == SHORT_PROMPT
    assert sel.reason({"prompt": list(range(100, 164))}, d1) is None
    # 400 characters d1 served before, then 100 new: 25 tokens to compute
    # on d1, all 125 on d2, which never saw the prefix.
    head = "h" * 400
    assert sel.reason(body(0, head=head), d1) is None
    assert sel.reason(body(100, head=head), d1) == SHORT_PROMPT
    assert sel.reason(body(100, head=head), d2) is None
    # A prompt beyond what the index may know and the threshold: never read
    # to its end, disaggregated.
    assert sel.uncached_tokens(body(10_000_000), d1) == float("inf")
    off = SelectiveDisaggregation(0, 4.0, 1024, 16)
    assert not off.enabled and off.reason(body(4), d1) is None


def test_bad_settings_fail_at_start_naming_the_flag():
    with pytest.raises(ConfigError, match="--decode-alone-below-tokens"):
        RouterConfig(decode_alone_below_tokens=-1)
    with pytest.raises(ConfigError, match="--prompt-bytes-per-token"):
        RouterConfig(prompt_bytes_per_token=0.0)
    with pytest.raises(ConfigError, match="--prompt-bytes-per-token"):
        RouterConfig(prompt_bytes_per_token=float("nan"))


async def test_the_router_sends_a_short_prompt_to_the_decode_alone(pd):
    router, p, d = await pd(decode_alone_below_tokens=32)
    short = {"model": "m", "prompt": "a" * 40, "max_tokens": 4}  # 10 tokens
    status, _, _ = await router.post("/v1/completions", short)
    assert status == 200 and p.requests == [] and len(d.requests) == 1
    # Alone: no peers named, nothing for a prefill to send.
    assert (
        "kv_transfer_params" not in d.requests[0].body
        or not (d.requests[0].body["kv_transfer_params"])
    )
    long = {"model": "m", "prompt": "b" * 400, "max_tokens": 4}  # 100 tokens
    status, _, _ = await router.post("/v1/completions", long)
    assert status == 200 and len(p.requests) == 1 and len(d.requests) == 2
    routes = "vllm_disagg_router_routes_total"
    assert router.metric(routes, route="decode_alone", reason="short_prompt") == 1
    assert router.metric(routes, route="disaggregated", reason="long_prompt") == 1
    # Every lease ended: no tokens left in flight.
    assert [i["tokens_in_flight"] for i in router.registry.snapshot()] == [0, 0]


async def test_with_the_threshold_off_every_prompt_is_disaggregated(pd):
    router, p, d = await pd()
    status, _, _ = await router.post(
        "/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 2}
    )
    assert status == 200 and len(p.requests) == 1
    routes = "vllm_disagg_router_routes_total"
    assert router.metric(routes, route="disaggregated", reason="always") == 1
    assert router.metric(routes, route="decode_alone", reason="short_prompt") == 0
