"""Placing requests on DP groups as one: the ``dp_balanced`` policy.

With step sync the ranks of a DP group step together, so every step of the
group lasts as long as its busiest rank's: a long prompt on one rank slows
the short ones on the others. A rank's load is the tokens its requests put
in flight (prompt + output limit, estimated by ``prompt_size.py``, released
when the request ends), not their count: ten short requests cost a step
less than one 8k-token prompt. For each candidate the policy computes the
maximum load its group would have with the request on it, and picks the
candidate where that maximum is lowest; an instance outside any group (or
alone in its group) is its own group. Prefix locality is kept where it costs
nothing: the instance that last took the request's longest known prefix is
chosen when its maximum is no higher than the best. Ties go to the least
loaded rank, then rotate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm_disagg.router.instance import Instance, group_of
from vllm_disagg.router.policy import Policy, register_policy
from vllm_disagg.router.prompt_size import PrefixIndex, output_tokens, prompt_tokens

if TYPE_CHECKING:
    from vllm_disagg.router.config import RouterConfig


def max_load_with(candidate: Instance, cost: int) -> int:
    """The maximum tokens in flight over ``candidate``'s DP group (itself
    alone without one) once a request of ``cost`` tokens is placed on it."""
    own = candidate.tokens_in_flight + cost
    group = group_of(candidate)
    if group is None:
        return own
    return max(own, group.max_tokens_in_flight(without=candidate))


@register_policy("dp_balanced")
class DpBalancedPolicy(Policy):
    """Lowest resulting group maximum of tokens in flight; see the module."""

    def __init__(
        self, bytes_per_token: float, max_entries: int, chunk_chars: int
    ) -> None:
        self.bytes_per_token = bytes_per_token
        self.prefixes = PrefixIndex(max_entries, chunk_chars)
        self._turn = 0

    @classmethod
    def from_config(cls, config: RouterConfig) -> Policy:
        return cls(
            config.prompt_bytes_per_token,
            config.prefix_index_max_entries,
            config.prefix_chunk_chars,
        )

    def select(
        self, candidates: Sequence[Instance], body: Mapping[str, Any]
    ) -> Instance:
        tokens, text = prompt_tokens(
            body, self.bytes_per_token, self.prefixes.max_chars
        )
        cost = tokens + output_tokens(body)
        hashes = self.prefixes.chunk_hashes(text)
        self._turn += 1
        start = self._turn % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        maxima = {id(c): max_load_with(c, cost) for c in rotated}
        best = min(maxima.values())
        chosen = min(
            (c for c in rotated if maxima[id(c)] == best),
            key=lambda c: c.tokens_in_flight,
        )
        by_id = {c.instance_id: c for c in candidates}
        for owner in reversed(self.prefixes.holders(hashes)):
            holder = by_id.get(owner)
            if holder is not None:
                if maxima[id(holder)] <= best:
                    chosen = holder
                break
        self.prefixes.remember(hashes, chosen.instance_id)
        return chosen
