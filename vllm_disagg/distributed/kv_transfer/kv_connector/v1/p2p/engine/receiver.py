"""The receive side: the engine's receive API, its room, and the Hello and Offer
handlers.

Each key has one explicit state in a :class:`~..recv_state.RecvTable`; the
model thread expects, polls, copies and abandons keys, the listener accepts
channels (``Hello``) and offers (``Offer``) into room from the receive
buffer, else the host pool, and the receive threads (inbound.py) finish them.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import protocol as proto
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.checksum import (
    DIGEST_BYTES,
    Checksum,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import limits
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.inbound import (
    InboundChannel,
    RecvSlot,
    SlotState,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.layout import (
    check_compatible,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.sender import GetJob
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    Abort,
    Hello,
    Offer,
    Reply,
    Status,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.recv_state import (
    Event,
    RecvState,
    RecvTable,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.tensor_pool import (
    PoolAllocation,
    TensorMemoryPool,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    Channel,
    Transport,
    TransportError,
    addresses_of,
)
from vllm_disagg.logger import init_logger
from vllm_disagg.wire.peers import PeerInfoError, canonical_host, split_addr

if TYPE_CHECKING:
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.layout import (
        KVLayout,
    )
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
        P2pStatsRecorder,
    )

# One logger for the engine package, named as the module it was split from.
logger = init_logger(__package__)


def _is_host(source: str | None, host: str) -> bool:
    """Whether the address ``source`` a message came from is ``host``'s."""
    if not source or not host:
        return False
    try:
        return source in addresses_of(host)
    except TransportError:
        return False


class ReceiverMixin:
    """P2pEngine's receive side (core.py sets up the state it uses)."""

    addr: str
    layout: KVLayout
    transport: Transport
    send_type: str
    kv_buffer_size: int
    mem_pool_size_bytes: int
    hold_timeout_s: float
    model_fingerprint: bytes
    checksum: Checksum | None  # kv_checksum; None: "none"
    checksum_name: str
    stats: P2pStatsRecorder
    _lock: threading.Lock
    _recv: RecvTable  # one explicit state per key (recv_state.py)
    _inbound: dict[str, InboundChannel]
    _recv_threads: int  # receive threads alive (at most MAX_INBOUND_CHANNELS)
    _seen_channels: dict[str, float]  # channel id -> forget after (replays)
    _buffer_used: int
    _pool: TensorMemoryPool | None
    # Aborts of keys the decode did not know yet: key -> (sender host,
    # reason, forget after); applied by expect() when the hosts match.
    _early_aborts: dict[str, tuple[str, str, float]]

    # --- model-thread API ---

    def expect(
        self,
        key: str,
        skip_blocks: int,
        deadline: float,
        get_from: str | None,
        prompt_digest: bytes,
        prefill_addr: str | None = None,
    ) -> None:
        """Decode knows request ``key``: it holds ``skip_blocks`` leading blocks itself,
        and accepts KV only for the prompt whose digest is ``prompt_digest``.

        With ``get_from`` (GET mode) the prefill worker at that address is asked
        to offer the KV now."""
        with self._lock:
            entry = self._recv.apply(
                key, Event.EXPECT, time.monotonic(), deadline=deadline
            )
            entry.skip_blocks, entry.prompt_digest = skip_blocks, prompt_digest
            entry.load_deadline = deadline
            if prefill_addr:
                entry.prefill_host = canonical_host(split_addr(prefill_addr)[0])
            early = self._early_aborts.pop(key, None)
            ask = get_from is not None and entry.state is RecvState.EXPECTED
        if early is not None and _is_host(early[0], entry.prefill_host):
            # The prefill gave up on this key before the decode knew it.
            self._fail_expected(key, f"the prefill gave up sending it: {early[1]}")
            return
        if ask:
            self._submit(
                get_from,
                GetJob(
                    key=key,
                    skip_blocks=skip_blocks,
                    deadline=deadline,
                    on_failure=lambda reason: self._fail_expected(key, reason),
                ),
            )

    def poll(self, key: str) -> RecvSlot | None:
        """The slot of ``key`` once it is complete or failed (then owned by the
        caller)."""
        with self._lock:
            entry = self._recv.get(key)
            if entry is None or entry.state is not RecvState.READY:
                return None
            self._recv.apply(key, Event.TAKEN, time.monotonic())
            slot, entry.slot = entry.slot, None
            return slot

    def copy_into_cache(
        self, slot: RecvSlot, block_ids: list[int], first_block: int
    ) -> None:
        """Write blocks ``first_block..`` of the prompt from ``slot`` into
        ``block_ids``."""
        offset = first_block - slot.skip_blocks
        if offset < 0 or offset + len(block_ids) != slot.blocks_held:
            raise ValueError(
                f"received blocks {slot.skip_blocks}..{slot.num_blocks} do not cover "
                f"the {len(block_ids)} blocks from {first_block} this request needs"
            )
        pages = self.layout.page_bytes
        pending = False
        for i in range(slot.num_layers):
            data = slot.layer(i)[offset * pages :]
            pending |= self.layout.write_blocks(i, block_ids, data)
        if pending:
            # The source is a pinned pool block, freed (and free for the next
            # receive to overwrite) once the caller releases the slot: wait
            # until the copies queued on the current stream have read it.
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.layout.device))
            done.synchronize()

    def abandon(self, key: str) -> None:
        """The worker stops waiting for ``key``; its room is freed now, or when
        a receive in progress ends; a later offer is refused."""
        with self._lock:
            entry = self._recv.get(key)
            before = entry.state if entry is not None else None
            if not self._recv.allows(key, Event.ABANDON):  # every state allows it
                logger.error("P2P: abandon of %s in state %s", key, before)
                return
            entry = self._recv.apply(key, Event.ABANDON, time.monotonic())
            slot = None
            if before is RecvState.READY:
                slot, entry.slot = entry.slot, None
        if slot is not None:
            self.release(slot)

    def release(self, slot: RecvSlot) -> None:
        """Return a slot's bytes to the buffer budget or the pool."""
        with self._lock:
            if slot.pool_alloc is not None:
                self._pool.free(slot.pool_alloc)
                slot.pool_alloc = None
            else:
                self._buffer_used -= slot.nbytes
            slot.tensor = torch.empty(0, dtype=torch.uint8)
            self.stats.set_occupancy(self._buffer_used, self._pool_used())

    def occupancy(self) -> tuple[int, int]:
        """(receive buffer bytes, pool bytes) in use: for tests and metrics."""
        with self._lock:
            return self._buffer_used, self._pool_used()

    # --- internals ---

    def _pool_used(self) -> int:
        return self._pool.used_bytes if self._pool is not None else 0

    def _still_expected(self, key: str) -> bool:
        """Decode still waits for an offer of ``key`` (GET: keep asking)."""
        with self._lock:
            return self._recv.state(key) is RecvState.EXPECTED

    def _fail_expected(self, key: str, reason: str) -> None:
        self._fail_key(key, reason, only_expected=True)

    def _fail_key(self, key: str, reason: str, *, only_expected: bool = False) -> None:
        """No KV will come for ``key`` (no room, another prompt's, the GET
        failed): the worker's poll() gets the reason at once, or as soon as
        decode expects the key; swept if it never does."""
        with self._lock:
            state = self._recv.state(key)
            if state not in (None, RecvState.EXPECTED) or (
                only_expected and state is None
            ):
                return
            entry = self._recv.apply(key, Event.FAILED, time.monotonic())
            entry.reason = reason
            entry.slot = RecvSlot(
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

    def _finish_slot(
        self, slot: RecvSlot, *, ok: bool, reason: str = "", quiet: bool = False
    ) -> None:
        """The receive of ``slot`` ended (its thread, or its channel's drain);
        ``quiet``: the caller logged why (rate-limited)."""
        with self._lock:
            slot.state = SlotState.COMPLETE if ok else SlotState.FAILED
            slot.reason = reason
            entry = self._recv.get(slot.key)
            free = entry is None or entry.slot is not slot
            if not free:
                before = entry.state
                self._recv.apply(
                    slot.key, Event.RECEIVED if ok else Event.FAILED, time.monotonic()
                )
                if before is RecvState.ABANDONING:
                    entry.slot, free = None, True
        if not ok and not quiet:
            logger.warning("P2P receive of %s failed: %s", slot.key, reason)
        if free:
            self.release(slot)

    def _recv_layer(self, channel: Channel, slot: RecvSlot, layer: int) -> None:
        dst = slot.layer(layer)
        # With kv_checksum, the layer's block digests come in the same message.
        tail = [] if slot.digests is None else [slot.layer_digests(layer)]
        if slot.pool_alloc is not None and not self.transport.receives_into_host:
            staging = torch.empty(
                dst.numel(), dtype=torch.uint8, device=self.layout.device
            )
            channel.recv([staging, *tail], slot.deadline)
            dst.copy_(staging)
        else:
            channel.recv([dst, *tail], slot.deadline)

    def _corrupt_blocks(self, slot: RecvSlot, layer: int) -> str | None:
        """Why layer ``layer`` of ``slot`` (just received) must not be used:
        blocks whose checksum is not the sender's; None when all match or
        there is no checksum."""
        if self.checksum is None or slot.digests is None:
            return None
        bad = self.checksum.mismatches(
            slot.layer(layer), slot.page_bytes, slot.layer_digests(layer)
        )
        if not bad:
            return None
        shown = ", ".join(str(slot.skip_blocks + i) for i in bad[:8])
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        return (
            f"checksum mismatch ({self.checksum.name}): layer {layer}, block "
            f"{shown}{more} of the prompt"
        )

    def _discard_corrupt(self, slot: RecvSlot, peer: str, reason: str) -> None:
        """A received block is not what the sender hashed: the transfer is
        failed now (the worker recomputes), counted and logged, rate-limited.
        The channel stays up: the caller drains the slot's remaining layers."""
        self.stats.record_checksum_mismatch()
        self._log_limited(
            "checksum",
            f"P2P engine {self.addr} discarded the KV of {slot.key} from {peer}: "
            f"{reason}; the request will be recomputed",
        )
        self._finish_slot(slot, ok=False, reason=reason, quiet=True)

    def _drain_layer(self, channel: Channel, slot: RecvSlot) -> None:
        """Receive one more layer message of a discarded transfer and drop it,
        so the channel's next message belongs to the next offer (the slot's
        own memory is no longer this thread's)."""
        held = slot.blocks_held
        scratch = torch.empty(
            held * (slot.page_bytes + DIGEST_BYTES), dtype=torch.uint8
        )
        channel.recv([scratch], slot.deadline)

    def _allocate(
        self, nbytes: int
    ) -> tuple[torch.Tensor, PoolAllocation | None] | None:
        """Room for ``nbytes``: receive buffer first, then the pool; None if neither."""
        with self._lock:
            if self._buffer_used + nbytes <= self.kv_buffer_size:
                self._buffer_used += nbytes
                tensor = torch.empty(
                    nbytes, dtype=torch.uint8, device=self.layout.device
                )
                self.stats.set_occupancy(self._buffer_used, self._pool_used())
                return tensor, None
            if self.mem_pool_size_bytes > 0:
                if self._pool is None:
                    self._pool = TensorMemoryPool(self.mem_pool_size_bytes)
                alloc = self._pool.allocate(nbytes)
                if alloc is not None:
                    self.stats.record_spill()
                    self.stats.set_occupancy(self._buffer_used, self._pool_used())
                    return alloc.tensor, alloc
        return None

    # --- the listener's handlers of Hello, Offer and Abort ---

    def _on_abort(self, msg: Abort, source: str | None) -> Reply:
        """The sender of ``msg.keys`` gave up on them: fail the loads now.

        Only the host of the prefill a request named may end its load (the
        grant vouched for that host, and the source address is the socket's,
        not what the message says); from anyone else the abort changes
        nothing. Always answered ok, so a sender stops re-sending."""
        now = time.monotonic()
        fail = []
        with self._lock:
            named = {}
            for key in msg.keys:
                entry = self._recv.get(key)
                if entry is not None and entry.state is RecvState.EXPECTED:
                    named[key] = entry.prefill_host
        # Outside the lock: a host name may take a lookup (cached).
        ours = {k for k, host in named.items() if _is_host(source, host)}
        with self._lock:
            for key in msg.keys:
                entry = self._recv.get(key)
                if entry is None:
                    if source is not None and (
                        key in self._early_aborts
                        or len(self._early_aborts) < limits.MAX_EARLY_ABORTS
                    ):
                        self._early_aborts[key] = (
                            source,
                            msg.reason,
                            now + self.hold_timeout_s,
                        )
                elif entry.state is RecvState.EXPECTED and key in ours:
                    fail.append(key)
        for key in fail:
            logger.info(
                "P2P: the prefill at %s gave up sending the KV of %s (%s); "
                "recomputing it now",
                source,
                key,
                msg.reason,
            )
            self._fail_expected(key, f"the prefill gave up sending it: {msg.reason}")
        return Reply(req_no=msg.req_no, status=Status.OK)

    def _on_hello(self, msg: Hello, route: bytes = b"") -> Reply:
        if msg.version != proto.PROTOCOL_VERSION:
            return self._refuse(
                msg.req_no,
                "version",
                f"protocol version {msg.version}, expected {proto.PROTOCOL_VERSION}",
            )
        if msg.transport != self.transport.name:
            return self._refuse(
                msg.req_no,
                "transport",
                f"peer uses transport {msg.transport}, this worker "
                f"{self.transport.name}",
            )
        mismatch = check_compatible(self.layout.spec, msg.layout)
        if mismatch:
            return self._refuse(msg.req_no, "layout", mismatch)
        if msg.model != self.model_fingerprint:
            # Same shapes, other weights or settings: its KV would give wrong
            # answers here. Both values in one line (each instance logs what
            # its fingerprint covers at start).
            return self._refuse(
                msg.req_no,
                "model",
                f"peer {msg.sender_addr} serves model fingerprint "
                f"{msg.model.hex()[:12] or 'none'}, this worker "
                f"{self.model_fingerprint.hex()[:12] or 'none'}: other weights, "
                "config, tokenizer, dtype or parallel layout",
            )
        if msg.send_type != self.send_type:
            return self._refuse(
                msg.req_no,
                "send_type",
                f"peer uses send_type {msg.send_type}, this worker {self.send_type}",
            )
        if msg.checksum != self.checksum_name:
            # Both ends must agree on what a layer message holds.
            return self._refuse(
                msg.req_no,
                "checksum",
                f"peer attaches kv_checksum {msg.checksum}, this worker checks "
                f"{self.checksum_name}",
            )
        skew = time.time() - msg.sent_at
        if abs(skew) > limits.MAX_HELLO_AGE_S:
            return self._refuse(
                msg.req_no,
                "stale",
                f"Hello sent {skew:.0f} s ago (clock skew "
                f"or a replay; at most {limits.MAX_HELLO_AGE_S:.0f} s)",
            )
        with self._lock:
            if msg.channel_id in self._inbound or msg.channel_id in self._seen_channels:
                return self._refuse(
                    msg.req_no, "duplicate", "channel id in use or replayed"
                )
            # Threads, not channels: a replaced channel's thread may still be
            # waiting for its set-up to time out.
            if self._recv_threads >= limits.MAX_INBOUND_CHANNELS:
                return self._refuse(
                    msg.req_no,
                    "busy",
                    f"{limits.MAX_INBOUND_CHANNELS} receive threads already running",
                )
        try:
            reply_setup, finish = self.transport.accept(
                msg.setup, peer_host=split_addr(msg.sender_addr, "sender_addr")[0]
            )
        except (TransportError, PeerInfoError) as e:
            return self._refuse(msg.req_no, "malformed", f"bad channel set-up: {e}")
        now = time.monotonic()
        with self._lock:
            self._recv_threads += 1
            self._seen_channels[msg.channel_id] = now + 2 * limits.MAX_HELLO_AGE_S
        inbound = InboundChannel(
            self,
            msg.channel_id,
            msg.sender_addr,
            finish,
            now + min(self.hold_timeout_s, limits.CHANNEL_SETUP_TIMEOUT_S),
            route=route,
        )
        with self._lock:
            self._inbound[msg.channel_id] = inbound
        return Reply(req_no=msg.req_no, status=Status.OK, setup=reply_setup)

    def _on_offer(self, msg: Offer, route: bytes = b"") -> Reply:
        with self._lock:
            inbound = self._inbound.get(msg.channel_id)
            if inbound is not None and inbound.route != route:
                inbound = None  # another connection's channel: not this sender's to use
            # Keys nobody asked for are remembered (a refusal, a slot) only up
            # to a bound: a flood of offers must not grow the table.
            busy = (
                msg.key not in self._recv.keys
                and len(self._recv.keys) >= limits.MAX_RECV_KEYS
            )
            entry = self._recv.get(msg.key)
            state = entry.state if entry is not None else None
            exp = entry if entry is not None and entry.expected else None
            duplicate = state in (
                RecvState.RECEIVING,
                RecvState.ABANDONING,
                RecvState.READY,
            )
            gave_up = state is RecvState.CLOSED
        if inbound is None or inbound.broken:
            return self._refuse(
                msg.req_no,
                "unknown_channel",
                f"offer on unknown channel {msg.channel_id!r}",
            )
        if msg.num_blocks > self.layout.num_blocks:
            return self._refuse(
                msg.req_no,
                "oversized",
                f"offer of {msg.num_blocks} blocks, the KV cache has "
                f"{self.layout.num_blocks}",
            )
        if duplicate:
            return self._refuse(msg.req_no, "duplicate", f"second offer for {msg.key}")
        if busy:
            return self._refuse(
                msg.req_no, "busy", f"{limits.MAX_RECV_KEYS} keys already tracked"
            )
        if gave_up:
            return Reply(req_no=msg.req_no, status=Status.NOT_WANTED)
        if exp is not None and msg.prompt_digest != exp.prompt_digest:
            # KV of another prompt under this key: never filed. From the host
            # of the prefill the request named, no other KV will come: fail
            # the load now; from anyone else, only refuse (the real one may).
            self.stats.record_digest_mismatch()
            if (
                exp.prefill_host
                and canonical_host(split_addr(inbound.peer)[0]) == exp.prefill_host
            ):
                self._fail_key(
                    msg.key, "offered KV belongs to another prompt (digest mismatch)"
                )
            return self._refuse(
                msg.req_no,
                "digest",
                f"offer of {msg.key}: prompt digest differs from the request's",
            )
        skip = min(exp.skip_blocks, msg.num_blocks - 1) if exp is not None else 0
        deadline = (
            exp.load_deadline
            if exp is not None
            else time.monotonic() + self.hold_timeout_s
        )
        nbytes = (
            self.layout.num_layers * (msg.num_blocks - skip) * self.layout.page_bytes
        )
        room = self._allocate(nbytes)
        if room is None:
            # Not a bad message: counted as dropped only. The load fails now
            # (or as soon as decode expects the key), not at its deadline.
            self.stats.record_dropped()
            self._fail_key(
                msg.key, f"no room for {nbytes} bytes: receive buffer and pool are full"
            )
            self._log_limited(
                "no_space",
                f"P2P engine {self.addr} dropped the KV of {msg.key}: "
                f"no room for {nbytes} bytes in the receive buffer or the pool; "
                "the request will be recomputed",
            )
            return Reply(req_no=msg.req_no, status=Status.NO_SPACE)
        tensor, alloc = room
        slot = RecvSlot(
            key=msg.key,
            num_blocks=msg.num_blocks,
            skip_blocks=skip,
            page_bytes=self.layout.page_bytes,
            num_layers=self.layout.num_layers,
            tensor=tensor,
            pool_alloc=alloc,
            deadline=deadline,
            prompt_digest=msg.prompt_digest,
            digests=None
            if self.checksum is None
            else torch.empty(
                self.layout.num_layers * (msg.num_blocks - skip) * DIGEST_BYTES,
                dtype=torch.uint8,
            ),
        )
        with self._lock:
            # The worker may have given up on the key while the room was taken,
            # or the channel may have broken: its drain runs under this lock
            # too, so a slot queued here is either received or failed, never stuck.
            gave_up = not self._recv.allows(msg.key, Event.OFFER)
            broken = inbound.broken
            if not gave_up and not broken:
                entry = self._recv.apply(
                    msg.key, Event.OFFER, time.monotonic(), deadline=deadline
                )
                entry.slot = slot
                inbound.queue.put(slot)
        if gave_up or broken:
            self.release(slot)
            if broken:
                return self._refuse(
                    msg.req_no,
                    "unknown_channel",
                    f"offer on closed channel {msg.channel_id!r}",
                )
            return Reply(req_no=msg.req_no, status=Status.NOT_WANTED)
        return Reply(req_no=msg.req_no, status=Status.OK, skip_blocks=skip)
