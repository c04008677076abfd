"""How big a request is, seen from a router that loads no tokenizer, and
which prefixes an instance last served.

Sizes are estimates, used only to choose a path or an instance (a wrong one
costs speed, never correctness: every path computes the same tokens). A
prompt of token ids is counted exactly; text is counted as its UTF-8 bytes
divided by ``bytes_per_token`` (byte-level BPE tokenizers of current models
give about 4 bytes a token for English, code and CJK alike, where a
character count varies threefold between scripts). The cost is bounded:
at most ``limit`` characters of a prompt are rendered (``render_prompt``).

:class:`PrefixIndex` is the prefix-aware policy's hash chain, kept for any
side: chunk *i*'s hash covers chunks 0..i, each maps to the instance that
last took a prompt with that prefix, least recently used evicted first.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from vllm_disagg.router.validation import lax_int

DEFAULT_BYTES_PER_TOKEN = 4.0
# Output tokens assumed for a request that sets no limit: its real length is
# unknown until it ends (vLLM's own limit is the context left).
DEFAULT_OUTPUT_TOKENS = 256
MAX_PREFIX_CHUNKS = 512  # per prompt: bounds the hashing a request costs


def _token_id_prompt(body: Mapping[str, Any]) -> int | None:
    """Tokens of a prompt given as token ids (one list, or a batch of
    lists), or None for text."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(i, int) for i in prompt[:64]):
        return len(prompt)
    if all(isinstance(p, list) for p in prompt[:64]):
        return sum(len(p) for p in prompt)
    return None


def prompt_tokens(
    body: Mapping[str, Any], bytes_per_token: float, limit_chars: int | None = None
) -> tuple[int, str]:
    """(estimated prompt tokens, the rendered prompt cut to ``limit_chars``).

    Text beyond ``limit_chars`` is not looked at: a prompt that long counts
    as ``limit_chars`` characters, so compare only against smaller sizes."""
    # Here, not at the top: policy.py loads placement.py, which loads us.
    from vllm_disagg.router.policy import render_prompt

    text = render_prompt(body, limit_chars)
    exact = _token_id_prompt(body)
    if exact is not None:
        return exact, text
    size = len(text.encode("utf-8", "surrogatepass"))
    return math.ceil(size / bytes_per_token), text


def output_tokens(body: Mapping[str, Any], path: str = "/v1/completions") -> int:
    """The request's output limit (``max_tokens`` and its other names), or
    DEFAULT_OUTPUT_TOKENS when it sets none or one that is not a number;
    times ``n`` (each choice is a sequence of its own)."""
    if path == "/inference/v1/generate" and isinstance(
        body.get("sampling_params"), Mapping
    ):
        body = body["sampling_params"]
    limit = DEFAULT_OUTPUT_TOKENS
    for name in ("max_completion_tokens", "max_output_tokens", "max_tokens"):
        value = body.get(name)
        if value is not None:
            parsed = lax_int(value)
            if isinstance(parsed, int) and parsed > 0:
                limit = min(parsed, 1 << 24)
            break
    n = lax_int(body.get("n", 1))
    n = n if isinstance(n, int) and 1 <= n <= 128 else 1
    return limit * n


def request_tokens(
    body: Mapping[str, Any],
    bytes_per_token: float,
    path: str = "/v1/completions",
    limit_chars: int = 1 << 20,
) -> tuple[int, int]:
    """(prompt tokens, prompt + output limit): what a request puts in flight
    on its prefill and on its decode (which holds both until it ends)."""
    prompt = _token_id_prompt(body)  # counted without rendering the ids
    if prompt is None:
        prompt, _ = prompt_tokens(body, bytes_per_token, limit_chars)
    return prompt, prompt + output_tokens(body, path)


class PrefixIndex:
    """Chunk-hash chain -> the instance that last took that prefix (LRU)."""

    def __init__(self, max_entries: int, chunk_chars: int) -> None:
        self.max_entries = max_entries
        self.chunk_chars = chunk_chars
        self.max_chars = chunk_chars * MAX_PREFIX_CHUNKS
        self._index: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._index)

    def chunk_hashes(self, text: str) -> list[int]:
        """Hash chain over the full chunks of ``text`` (a partial tail is
        never reused by another prompt, as in a block-based prefix cache)."""
        hashes, previous = [], 0
        for start in range(0, len(text) - self.chunk_chars + 1, self.chunk_chars):
            previous = hash((previous, text[start : start + self.chunk_chars]))
            hashes.append(previous)
        return hashes

    def holders(self, hashes: list[int]) -> list[str]:
        """The instance that last took each leading chunk, as long as the
        chain is known (its length is the longest known prefix)."""
        out = []
        for chunk_hash in hashes:
            owner = self._index.get(chunk_hash)
            if owner is None:
                break
            out.append(owner)
        return out

    def cached_chunks(self, hashes: list[int], instance_id: str) -> int:
        """Leading chunks of ``hashes`` that ``instance_id`` took last (what
        its prefix cache most likely holds; another instance taking the
        same prefix later hides it, which only underestimates)."""
        count = 0
        for owner in self.holders(hashes):
            if owner != instance_id:
                break
            count += 1
        return count

    def remember(self, hashes: list[int], instance_id: str) -> None:
        index = self._index
        for chunk_hash in reversed(hashes):  # shared heads outlive the tails
            index[chunk_hash] = instance_id
            index.move_to_end(chunk_hash)
        while len(index) > self.max_entries:
            index.popitem(last=False)
