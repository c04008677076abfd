"""The receive side: the engine's receive API and the Hello, Offer and Abort
handlers.

Each key has one explicit state in a :class:`~..recv_state.RecvTable`; the
model thread expects, polls and abandons keys (a received slot is copied into
the KV cache by the layout, ``KVLayout.copy_slot``), the listener accepts
channels (``Hello``) and offers (``Offer``: decide, allocate, apply) into
room from the receive buffer, else the host pool (room.py), and the receive
threads (inbound.py) finish them through the
:class:`~.ports.InboundOwner` calls below.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import limits
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.inbound import (
    InboundChannel,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.local import (
    Local,
    Rejects,
    hello_mismatch,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.ports import (
    ChannelEnd,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.room import Room
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.transfers import (
    GetJob,
    RecvSlot,
    SlotState,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    Abort,
    Hello,
    Offer,
    Refusal,
    Reply,
    Status,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.recv_state import (
    Event,
    OfferAnswer,
    OfferFacts,
    RecvState,
    RecvTable,
    Timeouts,
    decide_offer,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
    P2pStatsRecorder,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    Channel,
    TransportError,
    addresses_of,
)
from vllm_disagg.logger import init_logger
from vllm_disagg.wire.peers import PeerInfoError, canonical_host, split_addr

# One logger for the engine package, named as the module it was split from.
logger = init_logger(__package__)

_EVICTED = (
    "no request claimed this KV before the room was needed for another "
    "transfer (unclaimed KV is freed first)"
)


def _is_host(source: str | None, host: str) -> bool:
    """Whether the address ``source`` a message came from is ``host``'s."""
    if not source or not host:
        return False
    try:
        return source in addresses_of(host)
    except TransportError:
        return False


class Receiver:
    """The engine's receive side: every key it receives, the inbound
    channels and their threads, the room they fill."""

    def __init__(
        self,
        local: Local,
        *,
        lock: threading.Lock,
        stopped: threading.Event,
        stats: P2pStatsRecorder,
        rejects: Rejects,
        submit: Callable[[str, GetJob], None],
        kv_buffer_size: int,
        mem_pool_size_bytes: int,
    ):
        self.local = local
        self.lock = lock  # the engine's: one lock for both sides and the sweep
        self.stopped = stopped
        self.stats = stats
        self.rejects = rejects
        self._submit = submit  # a GetJob to the thread of the prefill's peer
        self.table = RecvTable(
            Timeouts(hold_s=local.hold_timeout_s, closed_s=limits.TOMBSTONE_TTL_S)
        )
        self.room = Room(lock, local.layout, kv_buffer_size, mem_pool_size_bytes, stats)
        self.inbound: dict[str, InboundChannel] = {}
        self.recv_threads = 0  # receive threads alive (at most MAX_INBOUND_CHANNELS)
        self.seen_channels: dict[str, float] = {}  # channel id -> forget after
        # Aborts of keys the decode did not know yet: key -> (sender host,
        # reason, forget after); applied by expect() when the hosts match.
        self.early_aborts: dict[str, tuple[str, str, float]] = {}

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
        with self.lock:
            entry = self.table.apply(
                key, Event.EXPECT, time.monotonic(), deadline=deadline
            )
            entry.skip_blocks, entry.prompt_digest = skip_blocks, prompt_digest
            entry.load_deadline = deadline
            if prefill_addr:
                entry.prefill_host = canonical_host(split_addr(prefill_addr)[0])
            early = self.early_aborts.pop(key, None)
            ask = get_from is not None and entry.state is RecvState.EXPECTED
        if early is not None and _is_host(early[0], entry.prefill_host):
            # The prefill gave up on this key before the decode knew it.
            self.fail_expected(key, f"the prefill gave up sending it: {early[1]}")
            return
        if ask:
            self._submit(
                get_from,
                GetJob(
                    key=key,
                    skip_blocks=skip_blocks,
                    deadline=deadline,
                    on_failure=lambda reason: self.fail_expected(key, reason),
                ),
            )

    def poll(self, key: str) -> RecvSlot | None:
        """The slot of ``key`` once it is complete or failed (then owned by the
        caller)."""
        with self.lock:
            entry = self.table.get(key)
            if entry is None or entry.state is not RecvState.READY:
                return None
            self.table.apply(key, Event.TAKEN, time.monotonic())
            slot, entry.slot = entry.slot, None
            return slot

    def abandon(self, key: str) -> None:
        """The worker stops waiting for ``key``; its room is freed now, or when
        a receive in progress ends; a later offer is refused."""
        with self.lock:
            entry = self.table.get(key)
            before = entry.state if entry is not None else None
            if not self.table.allows(key, Event.ABANDON):  # every state allows it
                logger.error("P2P: abandon of %s in state %s", key, before)
                return
            entry = self.table.apply(key, Event.ABANDON, time.monotonic())
            slot = None
            if before is RecvState.READY:
                slot, entry.slot = entry.slot, None
        if slot is not None:
            self.room.release(slot)

    def still_expected(self, key: str) -> bool:
        """Decode still waits for an offer of ``key`` (GET: keep asking)."""
        with self.lock:
            return self.table.state(key) is RecvState.EXPECTED

    def fail_expected(self, key: str, reason: str) -> None:
        self.fail_key(key, reason, only_expected=True)

    def fail_key(self, key: str, reason: str, *, only_expected: bool = False) -> None:
        """No KV will come for ``key`` (no room, another prompt's, the GET
        failed): the worker's poll() gets the reason at once, or as soon as
        decode expects the key; swept if it never does."""
        with self.lock:
            state = self.table.state(key)
            if state not in (None, RecvState.EXPECTED) or (
                only_expected and state is None
            ):
                return
            entry = self.table.apply(key, Event.FAILED, time.monotonic())
            entry.reason = reason
            entry.slot = RecvSlot.failed(key, reason)

    # --- what the receive threads ask (ports.InboundOwner) ---

    def channel_up(self, inbound: ChannelEnd, channel: Channel) -> bool:
        with self.lock:
            broken, inbound.channel = inbound.broken, channel
            # A sender uses only its newest channel to us: an older one from
            # the same address belongs to a sender that restarted or gave up
            # on it. Replaced only now that this one is set up, so a replayed
            # Hello that cannot complete breaks nothing.
            stale = [
                c
                for c in self.inbound.values()
                if c.peer == inbound.peer and c is not inbound
            ]
        if broken:
            return False
        for old in stale:
            old.break_("the sender opened a new channel")
        return True

    def channel_down(self, inbound: ChannelEnd, reason: str) -> None:
        with self.lock:
            # Under the engine lock: an offer either sees the channel broken,
            # or is queued before its drain and failed by it.
            inbound.broken = True
            if self.inbound.get(inbound.channel_id) is inbound:
                del self.inbound[inbound.channel_id]
        self.rejects.log_limited(
            "channel_closed", f"P2P channel from {inbound.peer} closed: {reason}"
        )

    def thread_ended(self) -> None:
        with self.lock:
            self.recv_threads -= 1

    def finish_slot(
        self, slot: RecvSlot, *, ok: bool, reason: str = "", quiet: bool = False
    ) -> None:
        """The receive of ``slot`` ended (its thread, or its channel's drain);
        ``quiet``: the caller logged why (rate-limited)."""
        with self.lock:
            slot.state = SlotState.COMPLETE if ok else SlotState.FAILED
            slot.reason = reason
            entry = self.table.get(slot.key)
            free = entry is None or entry.slot is not slot
            if not free:
                before = entry.state
                self.table.apply(
                    slot.key, Event.RECEIVED if ok else Event.FAILED, time.monotonic()
                )
                if before is RecvState.ABANDONING:
                    entry.slot, free = None, True
        if not ok and not quiet:
            logger.warning("P2P receive of %s failed: %s", slot.key, reason)
        if free:
            self.room.release(slot)

    def discard_corrupt(self, slot: RecvSlot, peer: str, reason: str) -> None:
        """A received block is not what the sender hashed: the transfer is
        failed now (the worker recomputes), counted and logged, rate-limited.
        The channel stays up: the caller drains the slot's remaining layers."""
        self.stats.record_checksum_mismatch()
        self.rejects.log_limited(
            "checksum",
            f"P2P engine {self.local.addr} discarded the KV of {slot.key} from "
            f"{peer}: {reason}; the request will be recomputed",
        )
        self.finish_slot(slot, ok=False, reason=reason, quiet=True)

    # --- the listener's handlers of Hello, Offer and Abort ---

    def on_abort(self, msg: Abort, source: str | None) -> Reply:
        """The sender of ``msg.keys`` gave up on them: fail the loads now.

        Only the host of the prefill a request named may end its load (the
        grant vouched for that host, and the source address is the socket's,
        not what the message says); from anyone else the abort changes
        nothing. Always answered ok, so a sender stops re-sending."""
        now = time.monotonic()
        fail = []
        with self.lock:
            named = {}
            for key in msg.keys:
                entry = self.table.get(key)
                if entry is not None and entry.state is RecvState.EXPECTED:
                    named[key] = entry.prefill_host
        # Outside the lock: a host name may take a lookup (cached).
        ours = {k for k, host in named.items() if _is_host(source, host)}
        with self.lock:
            for key in msg.keys:
                entry = self.table.get(key)
                if entry is None:
                    if source is not None and (
                        key in self.early_aborts
                        or len(self.early_aborts) < limits.MAX_EARLY_ABORTS
                    ):
                        self.early_aborts[key] = (
                            source,
                            msg.reason,
                            now + self.local.hold_timeout_s,
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
            self.fail_expected(key, f"the prefill gave up sending it: {msg.reason}")
        return Reply(req_no=msg.req_no, status=Status.OK)

    def on_hello(self, msg: Hello, route: bytes = b"") -> Reply:
        refuse = self.rejects.refuse
        mismatch = hello_mismatch(self.local, msg)
        if mismatch is not None:
            return refuse(msg.req_no, *mismatch)
        with self.lock:
            if msg.channel_id in self.inbound or msg.channel_id in self.seen_channels:
                return refuse(
                    msg.req_no, Refusal.DUPLICATE, "channel id in use or replayed"
                )
            # Threads, not channels: a replaced channel's thread may still be
            # waiting for its set-up to time out.
            if self.recv_threads >= limits.MAX_INBOUND_CHANNELS:
                return refuse(
                    msg.req_no,
                    Refusal.BUSY,
                    f"{limits.MAX_INBOUND_CHANNELS} receive threads already running",
                )
        try:
            peer_host = split_addr(msg.sender_addr, "sender_addr")[0]
            reply_setup, finish = self.local.transport.accept(
                msg.setup, peer_host=peer_host
            )
        except (TransportError, PeerInfoError) as e:
            return refuse(msg.req_no, Refusal.MALFORMED, f"bad channel set-up: {e}")
        now = time.monotonic()
        with self.lock:
            self.recv_threads += 1
            self.seen_channels[msg.channel_id] = now + 2 * limits.MAX_HELLO_AGE_S
        inbound = InboundChannel(
            self,
            msg.channel_id,
            msg.sender_addr,
            finish,
            now + min(self.local.hold_timeout_s, limits.CHANNEL_SETUP_TIMEOUT_S),
            route=route,
            peer_host=canonical_host(peer_host),
        )
        with self.lock:
            self.inbound[msg.channel_id] = inbound
        return Reply(req_no=msg.req_no, status=Status.OK, setup=reply_setup)

    def on_offer(self, msg: Offer, route: bytes = b"") -> Reply:
        """Decide from the key's state (recv_state.decide_offer), take room,
        then apply the offer, unless the key or the channel went meanwhile."""
        layout = self.local.layout
        with self.lock:
            inbound = self.inbound.get(msg.channel_id)
            if inbound is not None and inbound.route != route:
                inbound = None  # another connection's channel: not this sender's to use
            decision = decide_offer(
                self.table.get(msg.key),
                OfferFacts(
                    key=msg.key,
                    num_blocks=msg.num_blocks,
                    prompt_digest=msg.prompt_digest,
                    channel=msg.channel_id,
                    channel_ok=inbound is not None and not inbound.broken,
                    offered_by=inbound.peer_host if inbound is not None else "",
                    max_blocks=layout.num_blocks,
                    table_full=len(self.table.keys) >= limits.MAX_RECV_KEYS,
                ),
            )
        if decision.answer is OfferAnswer.NOT_WANTED:
            return Reply(req_no=msg.req_no, status=Status.NOT_WANTED)
        if decision.answer is OfferAnswer.REFUSE:
            if decision.refusal is Refusal.DIGEST:
                self.stats.record_digest_mismatch()
            if decision.fail_load:
                self.fail_key(
                    msg.key, "offered KV belongs to another prompt (digest mismatch)"
                )
            return self.rejects.refuse(msg.req_no, decision.refusal, decision.detail)
        skip = decision.skip_blocks
        deadline = decision.deadline
        if deadline is None:
            deadline = time.monotonic() + self.local.hold_timeout_s
        slot = self._take_room(msg, skip, deadline)
        if slot is None:
            return Reply(req_no=msg.req_no, status=Status.NO_SPACE)
        with self.lock:
            # The worker may have given up on the key while the room was taken,
            # or the channel may have broken: its drain runs under this lock
            # too, so a slot queued here is either received or failed, never stuck.
            gave_up = not self.table.allows(msg.key, Event.OFFER)
            broken = inbound.broken
            if not gave_up and not broken:
                entry = self.table.apply(
                    msg.key, Event.OFFER, time.monotonic(), deadline=deadline
                )
                entry.slot = slot
                inbound.queue.put(slot)
        if gave_up or broken:
            self.room.release(slot)
            if broken:
                return self.rejects.refuse(
                    msg.req_no,
                    Refusal.UNKNOWN_CHANNEL,
                    f"offer on closed channel {msg.channel_id!r}",
                )
            return Reply(req_no=msg.req_no, status=Status.NOT_WANTED)
        return Reply(req_no=msg.req_no, status=Status.OK, skip_blocks=skip)

    def _take_room(self, msg: Offer, skip: int, deadline: float) -> RecvSlot | None:
        """A slot for the accepted offer ``msg``; when neither the receive
        buffer nor the pool has room, KV no request claimed is freed for it,
        oldest first; None (the load failed) when that is not enough either."""
        digests = self.local.checksum is not None
        slot = self.room.take(msg, skip, deadline, digests)
        while slot is None and self._evict_oldest_unclaimed():
            slot = self.room.take(msg, skip, deadline, digests)
        if slot is None:
            # Not a bad message: counted as dropped only. The load fails now
            # (or as soon as decode expects the key), not at its deadline.
            nbytes = self.room.nbytes(msg.num_blocks - skip)
            self.stats.record_dropped()
            self.fail_key(
                msg.key, f"no room for {nbytes} bytes: receive buffer and pool are full"
            )
            self.rejects.log_limited(
                "no_space",
                f"P2P engine {self.local.addr} dropped the KV of {msg.key}: "
                f"no room for {nbytes} bytes in the receive buffer or the pool; "
                "the request will be recomputed",
            )
        return slot

    def _evict_oldest_unclaimed(self) -> bool:
        """Free the oldest received KV that no request claimed (its request
        was refused, cancelled or never sent): a flood of such transfers must
        not cost honest ones their room. The key stays READY with a failed
        slot, so a request that does claim it later recomputes at once
        instead of waiting for KV that will not come. False: none to free."""
        with self.lock:
            victim = self.table.oldest_unclaimed()
            if victim is None:
                return False
            slot, victim.slot = victim.slot, RecvSlot.failed(victim.key, _EVICTED)
            victim.reason = _EVICTED
        self.room.release(slot)
        self.stats.record_unclaimed_evicted()
        self.rejects.log_limited(
            "unclaimed_evicted",
            f"P2P engine {self.local.addr} freed the KV of {slot.key}, which no "
            "request claimed, to make room for a new transfer",
        )
        return True

    # --- the sweep, and closing ---

    def sweep(self, now: float) -> None:
        """Forget old channel ids and early aborts; expire keys past their
        deadline and free the slots nobody claimed."""
        with self.lock:
            for cid, until in list(self.seen_channels.items()):
                if now > until:
                    del self.seen_channels[cid]
            for key, (_, _, until) in list(self.early_aborts.items()):
                if now > until:
                    del self.early_aborts[key]
            orphans = []
            for entry in self.table.expire(now):
                if entry.slot is not None:
                    orphans.append((entry.expected, entry.slot))
                    entry.slot = None
        for expected, slot in orphans:
            if not expected:
                logger.warning(
                    "P2P: freeing KV of %s that no request claimed", slot.key
                )
            self.room.release(slot)

    def close(self) -> None:
        for inbound in list(self.inbound.values()):
            if inbound.channel is not None:
                inbound.channel.close()
