"""Selective disaggregation: short prompts skip the prefill leg.

A prefill leg costs a round trip to P, P's scheduling, the KV transfer and
D's wait for it; for a short prompt that is more than D computing the prompt
itself. So a request whose *uncached* prompt, on the decode chosen for it,
is shorter than ``--decode-alone-below-tokens`` goes to that decode alone.

* Tokens are estimated without a tokenizer (``prompt_size.py``: token ids
  exactly, text as UTF-8 bytes / ``--prompt-bytes-per-token``). Loading the
  model's tokenizer in the router would tie the router to each model's files
  and put tokenization of every prompt on its one event loop; asking the
  decode's ``/tokenize`` adds a round trip to exactly the requests this is
  meant to speed up.
* What the decode has cached is what this router last sent it: every prompt
  a decode served (alone or with KV from a prefill) is in its prefix cache
  until evicted. A :class:`PrefixIndex` over decodes remembers it.

A wrong estimate costs speed only: both paths give the same tokens (a decode
computing the prompt is the colocated run; a disaggregated request's KV is
vouched for by the transfer), so a long prompt sent alone only makes D
prefill it, and a short one disaggregated only pays the leg.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from vllm_disagg.router.instance import Instance
from vllm_disagg.router.prompt_size import PrefixIndex, prompt_tokens

SHORT_PROMPT = "short_prompt"  # the decode_alone reason


class SelectiveDisaggregation:
    def __init__(
        self,
        below_tokens: int,
        bytes_per_token: float,
        max_entries: int,
        chunk_chars: int,
    ) -> None:
        self.below_tokens = below_tokens
        self.bytes_per_token = bytes_per_token
        self.decode_prefixes = PrefixIndex(max_entries, chunk_chars)

    @property
    def enabled(self) -> bool:
        return self.below_tokens > 0

    def uncached_tokens(self, body: Mapping[str, Any], decode: Instance) -> float:
        """Estimated prompt tokens ``decode`` would compute itself (inf: more
        than the threshold could ever allow; the prompt was not read to its
        end). Remembers that ``decode`` now holds the prompt."""
        index = self.decode_prefixes
        # Enough text to cover the longest prefix the index may know plus
        # the threshold in characters (a character is at least one byte).
        limit = index.max_chars + math.ceil(self.below_tokens * self.bytes_per_token)
        tokens, text = prompt_tokens(body, self.bytes_per_token, limit + 1)
        hashes = index.chunk_hashes(text)
        cached = index.cached_chunks(hashes, decode.instance_id)
        index.remember(hashes, decode.instance_id)
        if len(text) > limit:
            return math.inf
        if not text:
            return float(tokens)
        cached_chars = min(len(text), cached * index.chunk_chars)
        return tokens * (len(text) - cached_chars) / len(text)

    def reason(self, body: Mapping[str, Any], decode: Instance) -> str | None:
        """SHORT_PROMPT when ``body`` goes to ``decode`` alone, else None."""
        if not self.enabled:
            return None
        if self.uncached_tokens(body, decode) < self.below_tokens:
            return SHORT_PROMPT
        return None
