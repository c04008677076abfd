"""Connector metadata: what the scheduler-side connector tells the workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class LoadSpec:
    """Decode: receive the prompt's blocks ``first_block..`` into ``block_ids``."""

    request_id: str
    key: str
    prefill_addr: str  # the prefill instance's address (its TP rank 0 worker)
    first_block: int  # leading blocks decode already holds (its own prefix cache)
    block_ids: list[int]  # local blocks for prompt blocks first_block..num_blocks-1
    num_blocks: int  # blocks of the whole prompt
    prompt_digest: bytes  # protocol.prompt_digest of the prompt: received KV must match


@dataclass(frozen=True)
class SaveSpec:
    """Prefill: the prompt's KV is (being) computed in this step; send or hold it."""

    request_id: str
    key: str
    decode_addr: str  # the decode instance's address (its TP rank 0 worker)
    block_ids: list[int]  # all blocks of the prompt, in order
    prompt_digest: bytes  # protocol.prompt_digest of the prompt, sent with the offer


@dataclass
class P2pConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Decode: keys of requests that will not load (prompt_logprobs): the
    # workers refuse their offers, so the prefill frees its blocks at once.
    unwanted: list[str] = field(default_factory=list)
