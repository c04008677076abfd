"""One transfer on each side: what the threads hand each other.

A :class:`SendTransfer` is the KV of one finished prefill on its way to one
peer, in one :class:`~..send_state.SendState`; a :class:`RecvSlot` the room
one accepted offer is received into; a :class:`GetJob` a GET's request to
the prefill. Plain data: the engine's sides move them, the threads fill them.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.checksum import (
    DIGEST_BYTES,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import limits
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.send_state import (
    SendState,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.tensor_pool import (
    PoolAllocation,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    TransportError,
)


@dataclass(eq=False)
class SendTransfer:
    """The KV of one finished prefill, on its way to one peer worker."""

    key: str
    request_id: str
    peer: str
    block_ids: list[int]
    num_layers: int
    deadline: float
    prompt_digest: bytes = b""
    decode_host: str = ""  # GET: only a Get from this host may pull it (canonical)
    # send_state.py's one ordered state; only the engine's Sender moves it.
    state: SendState | None = None
    reason: str = ""  # why it failed (a released state other than SENT)
    # Set once the state is released: the worker waits on it.
    done: threading.Event = field(default_factory=threading.Event)
    layers_ready: int = 0
    events: dict[int, torch.cuda.Event] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)
    # The engine's: set when it closes, so a send waiting for layers that
    # will never be saved ends then, not at its deadline.
    closing: threading.Event | None = None
    # Set by the worker when the forward pass computing this KV raised: the
    # layers it never saved must not go, so the send fails (and says so).
    abandoned: str = ""

    @property
    def ok(self) -> bool:
        return self.state is SendState.SENT

    def abandon(self, reason: str) -> None:
        with self.cond:
            self.abandoned = reason
            self.cond.notify_all()

    def layer_saved(self, layer: int, event: torch.cuda.Event | None) -> None:
        with self.cond:
            if event is not None:
                self.events[layer] = event
            self.layers_ready = max(self.layers_ready, layer + 1)
            self.cond.notify_all()

    def all_saved(self) -> None:
        self.layer_saved(self.num_layers - 1, None)

    def wait_layer(self, layer: int) -> None:
        with self.cond:
            while self.abandoned or self.layers_ready <= layer:
                if self.abandoned:
                    raise TransportError(self.abandoned)
                if self.closing is not None and self.closing.is_set():
                    raise TransportError(
                        f"the engine is closing; layer {layer} was not saved"
                    )
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"layer {layer} was never saved")
                self.cond.wait(min(left, limits.POLL_INTERVAL_S))
            event = self.events.get(layer)
        if event is not None:
            while not event.query():
                if time.monotonic() > self.deadline:
                    raise TransportError(f"layer {layer} compute did not finish")
                time.sleep(0.0002)


@dataclass
class GetJob:
    """GET, decode side: ask the prefill worker to offer ``key`` now."""

    key: str
    skip_blocks: int
    deadline: float
    on_failure: Callable[[str], None]


class SlotState(enum.Enum):
    RECEIVING = "receiving"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(eq=False)
class RecvSlot:
    """Room for one transfer: ``num_layers x (num_blocks - skip)`` pages."""

    key: str
    num_blocks: int  # blocks of the whole prompt on the sender
    skip_blocks: int
    page_bytes: int
    num_layers: int
    tensor: torch.Tensor  # uint8, the whole transfer, layer-major
    pool_alloc: PoolAllocation | None
    deadline: float
    prompt_digest: bytes = b""  # the sender's: the worker copies only on a match
    # kv_checksum: the sender's block digests, layer-major (checksum.py); None: off
    digests: torch.Tensor | None = None
    state: SlotState = SlotState.RECEIVING
    reason: str = ""

    @classmethod
    def failed(cls, key: str, reason: str) -> RecvSlot:
        """What poll() hands the worker for a key no KV will come for."""
        return cls(
            key=key,
            num_blocks=0,
            skip_blocks=0,
            page_bytes=0,
            num_layers=0,
            tensor=torch.empty(0, dtype=torch.uint8),
            pool_alloc=None,
            deadline=0.0,
            state=SlotState.FAILED,
            reason=reason,
        )

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @property
    def blocks_held(self) -> int:
        return self.num_blocks - self.skip_blocks

    def layer(self, i: int) -> torch.Tensor:
        n = self.blocks_held * self.page_bytes
        return self.tensor[i * n : (i + 1) * n]

    def layer_digests(self, i: int) -> torch.Tensor:
        n = self.blocks_held * DIGEST_BYTES
        return self.digests[i * n : (i + 1) * n]
