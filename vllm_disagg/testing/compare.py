"""Compare greedy completions between two runs the way vLLM's own tests do."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GreedyResult:
    """Token ids of one greedy completion, with the top-k logprobs per position."""

    token_ids: list[int]
    top_logprobs: list[dict[int, float]]

    @classmethod
    def from_completion(cls, choice: dict) -> GreedyResult:
        """Build from an OpenAI completions choice made with
        ``return_token_ids=True`` and ``logprobs=k``."""
        token_ids = list(choice["token_ids"])
        top = []
        logprobs = choice.get("logprobs") or {}
        for entry in logprobs.get("top_logprobs") or []:
            top.append({_token_id(tok): lp for tok, lp in (entry or {}).items()})
        return cls(token_ids, top)


def _token_id(token: str) -> int:
    # With return_tokens_as_token_ids the keys are "token_id:<n>".
    return int(token.rsplit(":", 1)[1])


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def close_by_logprobs(a: GreedyResult, b: GreedyResult) -> tuple[bool, str]:
    """vLLM's ``check_logprobs_close`` rule: identical, or at the first
    differing position each side's token is in the other's top-k."""
    pos = first_difference(a.token_ids, b.token_ids)
    if pos is None:
        return True, "identical"
    if pos >= len(a.token_ids) or pos >= len(b.token_ids):
        return False, f"lengths differ ({len(a.token_ids)} vs {len(b.token_ids)})"
    ta, tb = a.token_ids[pos], b.token_ids[pos]
    ok = ta in b.top_logprobs[pos] and tb in a.top_logprobs[pos]
    return ok, f"first difference at {pos}: {ta} vs {tb}"
