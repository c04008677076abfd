"""Selection policies, prefix affinity and its memory bound."""

from __future__ import annotations

import pytest

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.policy import (
    LeastOutstandingPolicy,
    Policies,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    make_policy,
    policy_names,
    register_policy,
    render_prompt,
)
from vllm_disagg.router.registry import Instance
from vllm_disagg.wire.discovery import Role


def instances(n: int) -> list[Instance]:
    return [
        Instance(
            f"i{k}", Role.PREFILL, f"h:{k + 1}", f"k:{k + 1}", "m", 0, 1, 0.0, 0.0, 10.0
        )
        for k in range(n)
    ]


def picks(policy, candidates, bodies) -> list[str]:
    return [policy.select(candidates, body).instance_id for body in bodies]


def test_round_robin_cycles():
    fleet = instances(3)
    chosen = picks(RoundRobinPolicy(), fleet, [{}] * 6)
    assert chosen[:3] == chosen[3:] and sorted(chosen[:3]) == ["i0", "i1", "i2"]


def test_least_outstanding_prefers_the_idle_and_rotates_ties():
    fleet = instances(3)
    fleet[0].outstanding, fleet[1].outstanding, fleet[2].outstanding = 4, 1, 1
    assert set(picks(LeastOutstandingPolicy(), fleet, [{}] * 4)) == {"i1", "i2"}
    fleet[2].outstanding = 0
    assert picks(LeastOutstandingPolicy(), fleet, [{}] * 3) == ["i2"] * 3


def chat(system: str, user: str) -> dict:
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ]
    }


def test_prefix_aware_routes_a_shared_prefix_to_its_holder():
    policy = PrefixAwarePolicy(max_entries=1000, chunk_chars=16, balance_threshold=100)
    fleet = instances(4)
    first = policy.select(fleet, {"prompt": "A" * 64 + "tail one"})
    for k in range(5):
        fleet[k % 4].outstanding += 1  # load elsewhere does not move it
        assert policy.select(fleet, {"prompt": "A" * 64 + f"other tail {k}"}) is first

    system = "You are a careful assistant. " * 4
    holder = policy.select(fleet, chat(system, "question one"))
    assert policy.select(fleet, chat(system, "question two")) is holder


def test_prefix_aware_falls_back_to_least_loaded_without_a_match():
    policy = PrefixAwarePolicy(max_entries=1000, chunk_chars=16, balance_threshold=100)
    fleet = instances(3)
    fleet[0].outstanding, fleet[1].outstanding = 3, 2
    assert policy.select(fleet, {"prompt": "B" * 64}).instance_id == "i2"
    assert policy.select(fleet, {"prompt": "short"}).instance_id == "i2"


def test_prefix_aware_never_routes_to_an_instance_that_is_not_a_candidate():
    policy = PrefixAwarePolicy(max_entries=1000, chunk_chars=16, balance_threshold=100)
    fleet = instances(3)
    body = {"prompt": "C" * 80}
    holder = policy.select(fleet, body)
    healthy = [i for i in fleet if i is not holder]
    for _ in range(5):
        assert policy.select(healthy, body) in healthy


def test_prefix_aware_leaves_an_overloaded_holder():
    policy = PrefixAwarePolicy(max_entries=1000, chunk_chars=16, balance_threshold=2)
    fleet = instances(2)
    body = {"prompt": "D" * 64}
    holder = policy.select(fleet, body)
    holder.outstanding = 3
    other = policy.select(fleet, body)
    assert other is not holder
    # The prefix now lives on the other instance too; the index follows it.
    holder.outstanding = 0
    assert policy.select(fleet, body) is other


def test_prefix_index_stays_bounded():
    policy = PrefixAwarePolicy(max_entries=500, chunk_chars=16, balance_threshold=8)
    fleet = instances(4)
    for k in range(20_000):
        policy.select(fleet, {"prompt": f"{k:08d}" * 12})
        assert len(policy) <= 500
    assert len(policy) == 500


def test_eviction_takes_tails_before_the_head_they_hang_off():
    """Chunks are touched last-first, so a prompt longer than the index
    keeps its head (what other prompts share), not its tail."""
    policy = PrefixAwarePolicy(max_entries=4, chunk_chars=16, balance_threshold=100)
    fleet = instances(3)
    long_prompt = "".join(f"{k:016d}" for k in range(10))
    holder = policy.select(fleet, {"prompt": long_prompt})
    assert policy._index.keys() == set(policy.chunk_hashes(long_prompt)[:4])
    fleet[fleet.index(holder)].outstanding = 1  # least-loaded would pick another
    assert policy.select(fleet, {"prompt": long_prompt[:64] + "x" * 16}) is holder


def test_render_prompt_covers_every_message_and_prompt_form():
    base = chat("sys", "q")
    assert render_prompt(base) != render_prompt(chat("other sys", "q"))
    assert render_prompt(base).startswith(
        render_prompt({"messages": base["messages"][:1]})
    )  # a conversation extends its own prefix
    with_tools = {**base, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert render_prompt(with_tools) != render_prompt(base)
    parts = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    }
    assert "hi" in render_prompt(parts)
    tokens = render_prompt({"prompt": [11, 2, 3]})
    assert tokens.startswith(render_prompt({"prompt": [11, 2]})) and "11" in tokens
    assert render_prompt({"prompt": ["a", "b"]}) == "a\x1eb"
    assert render_prompt({}) == ""


def test_policies_from_config():
    policies = Policies.from_config(
        RouterConfig(policy_prefill="prefix_aware", policy_decode="least_outstanding")
    )
    assert isinstance(policies.prefill, PrefixAwarePolicy)
    assert isinstance(policies.decode, LeastOutstandingPolicy)
    assert policies.prefill.chunk_chars == 256


@pytest.mark.parametrize("n", [1, 2, 5])
def test_every_policy_only_picks_candidates(n):
    fleet = instances(n)
    for policy in (
        RoundRobinPolicy(),
        LeastOutstandingPolicy(),
        PrefixAwarePolicy(100, 16, 4),
    ):
        for k in range(10):
            assert policy.select(fleet, {"prompt": "x" * (k * 10)}) in fleet


def test_prefix_hashing_cost_is_bounded_per_request():
    """A 3M-token-id prompt froze the event loop for 5-16 s (a json.dumps per
    token); only the first MAX_PREFIX_CHUNKS chunks are rendered and hashed."""
    import time as _time

    from vllm_disagg.router.policy import MAX_PREFIX_CHUNKS, PrefixAwarePolicy

    policy = PrefixAwarePolicy(max_entries=1 << 20, chunk_chars=16, balance_threshold=4)
    huge = {"prompt": list(range(3_000_000))}
    start = _time.monotonic()
    text = render_prompt(huge, policy.max_chars)
    assert len(text) <= policy.max_chars
    assert len(policy.chunk_hashes(text)) <= MAX_PREFIX_CHUNKS
    assert _time.monotonic() - start < 1.0
    # The bound keeps prefixes comparable: equal starts render equal.
    other = {"prompt": list(range(3_000_000))[:-1] + [7]}
    assert render_prompt(other, policy.max_chars) == text
    assert render_prompt(
        {"messages": [{"role": "user", "content": "x" * 10**7}]}, policy.max_chars
    ).startswith("user\x1fxxx")


def test_rendering_costs_what_the_limit_allows_whatever_the_body():
    """json.dumps per token id (3M ids froze the loop for seconds), of 10 MB
    of tools, and of JSON nested 980 deep (a RecursionError, a 500)."""
    import time

    deep: list = []
    inner = deep
    for _ in range(100_000):
        inner.append([])
        inner = inner[0]
    bodies = [
        {"prompt": list(range(3_000_000))},
        {
            "tools": [{"function": {"name": "f" * 100}}] * 100_000,
            "messages": [{"role": "user", "content": "q"}],
        },
        {"messages": [{"role": "user", "content": deep}]},
        {"prompt": [deep]},
    ]
    for body in bodies:
        started = time.perf_counter()
        text = render_prompt(body, 131072)
        assert len(text) <= 131072
        assert time.perf_counter() - started < 1.0  # ~0.1 s at most here
    assert render_prompt({"prompt": [deep]}, 1000).count("\u2026") == 1


def test_policies_are_registered_by_name_next_to_their_classes():
    assert policy_names(Role.PREFILL) == (
        "round_robin",
        "least_outstanding",
        "prefix_aware",
        "dp_balanced",  # placement.py: registered where it is defined
    )
    assert policy_names(Role.DECODE) == (
        "round_robin",
        "least_outstanding",
        "dp_balanced",
    )
    assert isinstance(make_policy("prefix_aware", RouterConfig()), PrefixAwarePolicy)
    with pytest.raises(ValueError, match="unknown policy 'nope'; one of round_robin"):
        make_policy("nope", RouterConfig())
    with pytest.raises(ValueError, match="registered twice"):
        register_policy("round_robin")(type("Again", (RoundRobinPolicy,), {}))
