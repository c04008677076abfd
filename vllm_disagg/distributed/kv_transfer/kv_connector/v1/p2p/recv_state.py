"""The receive side of every transfer key: one explicit state, one transition
function, a deadline in every state.

Before, a key's fate was spread over four dicts and two flags (expected,
slots with their own state, tombstones, "abandoned" on both), and some
combinations had no way out: a slot left RECEIVING by a broken channel, an
expectation nobody would ever fulfil. Here a key is in exactly one
:class:`RecvState`; :meth:`RecvTable.apply` is the only place that changes
it, refuses transitions the table does not list, and sets the deadline of
the new state. :meth:`RecvTable.expire` moves every key whose deadline
passed, so no key waits forever. :func:`decide_offer` is what an offer of
a key gets, from the key's entry alone. No sockets, no threads, time passed
in: the engine calls it under its lock, the unit tests drive it directly.

::

            expect         offer accepted           bytes in / failed
    (none) ------> EXPECTED ------------> RECEIVING ----------------> READY
      |               |  fail (no room,      |  abandon               |  taken by poll()
      |  offer        |  digest, GET error)  v                        |  abandon, expire
      +-----------> RECEIVING  READY  ABANDONING --bytes in/failed--> CLOSED
                      |  abandon, expire     (slot freed)               (late offers
                      +----------------------------------------->       refused until
                                                                        it is forgotten)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import Refusal


class RecvState(enum.Enum):
    EXPECTED = "expected"  # the decode waits for the key; no offer yet
    RECEIVING = "receiving"  # an offer was accepted; bytes arrive into the slot
    ABANDONING = (
        "abandoning"  # the decode gave up while bytes arrive: free them at the end
    )
    READY = "ready"  # the slot is complete or failed: the decode's poll() takes it
    CLOSED = "closed"  # taken or given up: late offers are refused until forgotten


class Event(enum.Enum):
    EXPECT = "expect"  # the decode's worker knows the request (start_load_kv)
    OFFER = "offer"  # the listener accepted an offer and took room for it
    RECEIVED = "received"  # the receive thread has every byte
    FAILED = "failed"  # no room, digest mismatch, GET error, receive error
    TAKEN = "taken"  # poll() handed the slot to the worker
    ABANDON = "abandon"  # the worker stopped waiting (deadline, request aborted)
    EXPIRE = "expire"  # the state's deadline passed


S, E = RecvState, Event
# (state, event) -> next state; None as a state: the key has no entry yet.
TRANSITIONS: dict[tuple[RecvState | None, Event], RecvState] = {
    (None, E.EXPECT): S.EXPECTED,
    (None, E.OFFER): S.RECEIVING,  # PUT_ASYNC: the KV can come before the request
    (None, E.FAILED): S.READY,  # refused before the decode knew the key
    (None, E.ABANDON): S.CLOSED,  # given up before anything arrived: refuse it later
    (S.EXPECTED, E.EXPECT): S.EXPECTED,
    (S.EXPECTED, E.OFFER): S.RECEIVING,
    (S.EXPECTED, E.FAILED): S.READY,
    (S.EXPECTED, E.ABANDON): S.CLOSED,
    (S.EXPECTED, E.EXPIRE): S.CLOSED,
    (S.RECEIVING, E.EXPECT): S.RECEIVING,
    (S.RECEIVING, E.RECEIVED): S.READY,
    (S.RECEIVING, E.FAILED): S.READY,
    (S.RECEIVING, E.ABANDON): S.ABANDONING,
    (S.RECEIVING, E.EXPIRE): S.ABANDONING,  # backstop: the transport's deadline ends it
    (S.ABANDONING, E.EXPECT): S.ABANDONING,
    (S.ABANDONING, E.ABANDON): S.ABANDONING,
    (S.ABANDONING, E.RECEIVED): S.CLOSED,
    (S.ABANDONING, E.FAILED): S.CLOSED,
    (S.READY, E.EXPECT): S.READY,
    (S.READY, E.FAILED): S.READY,
    (S.READY, E.TAKEN): S.CLOSED,
    (S.READY, E.ABANDON): S.CLOSED,
    (S.READY, E.EXPIRE): S.CLOSED,  # nobody claimed it
    (S.CLOSED, E.EXPECT): S.EXPECTED,  # a new request with a key used long ago
    (S.CLOSED, E.ABANDON): S.CLOSED,
    (S.CLOSED, E.FAILED): S.CLOSED,
}


class TransitionError(RuntimeError):
    """An event the key's state does not allow (a bug, or a message to refuse)."""


@dataclass(eq=False)
class RecvKey:
    """Everything this side knows about one key it receives."""

    key: str
    state: RecvState | None = None
    deadline: float = 0.0
    expected: bool = False  # the decode asked for it (its request exists)
    skip_blocks: int = 0  # blocks the decode holds itself
    prompt_digest: bytes = b""  # what the decode's request says the KV must be of
    load_deadline: float = 0.0  # the decode's own deadline for the load
    prefill_host: str = ""  # the host of the prefill the request named (canonical)
    slot: object | None = (
        None  # the RecvSlot, from OFFER (or FAILED) until freed or taken
    )
    reason: str = ""  # why it failed


@dataclass(frozen=True)
class Timeouts:
    hold_s: float  # a READY slot nobody expects, an unexpected receive
    grace_s: float = 5.0  # past the decode's own deadline, before the engine expires it
    closed_s: float = 300.0  # how long a closed key refuses late offers


class RecvTable:
    """The receive-side keys of one engine. Not thread-safe: callers hold the
    engine's lock."""

    def __init__(self, timeouts: Timeouts):
        self.timeouts = timeouts
        self.keys: dict[str, RecvKey] = {}

    def get(self, key: str) -> RecvKey | None:
        return self.keys.get(key)

    def state(self, key: str) -> RecvState | None:
        entry = self.keys.get(key)
        return None if entry is None else entry.state

    def allows(self, key: str, event: Event) -> bool:
        return (self.state(key), event) in TRANSITIONS

    def apply(
        self, key: str, event: Event, now: float, *, deadline: float | None = None
    ) -> RecvKey:
        """Move ``key`` by ``event`` and set the new state's deadline (the
        decode's own ``deadline`` for EXPECT; else derived from the state)."""
        entry = self.keys.get(key)
        current = None if entry is None else entry.state
        target = TRANSITIONS.get((current, event))
        if target is None:
            raise TransitionError(
                f"key {key}: {event.value} in state "
                f"{current.value if current else 'none'}"
            )
        if entry is None:
            entry = self.keys[key] = RecvKey(key)
        if event is Event.EXPECT:
            entry.expected = True
        if current is RecvState.CLOSED and target is RecvState.EXPECTED:
            entry.slot, entry.reason = None, ""
        entry.state = target
        entry.deadline = self._deadline(entry, now, deadline)
        return entry

    def _deadline(self, entry: RecvKey, now: float, given: float | None) -> float:
        t = self.timeouts
        state = entry.state
        if state is RecvState.CLOSED:
            return now + t.closed_s
        if state is RecvState.EXPECTED:
            # The worker abandons at its deadline; this is the backstop.
            return (given if given is not None else now + t.hold_s) + t.grace_s
        if state in (RecvState.RECEIVING, RecvState.ABANDONING):
            # Keep the receive's deadline; only the first entry sets it.
            if given is not None:
                return given + t.grace_s
            return (
                entry.deadline if entry.deadline > now else now + t.hold_s + t.grace_s
            )
        # READY: the decode polls every step when it expects the key;
        # an unclaimed slot waits at most hold_s for its request.
        if given is not None:
            return given + t.grace_s
        return max(entry.deadline, now + t.hold_s) if entry.expected else now + t.hold_s

    def oldest_unclaimed(self) -> RecvKey | None:
        """The READY key no request expects yet, holding bytes, that arrived
        first (READY's deadline is its arrival plus hold_s): KV whose request
        was refused, cancelled or never sent, the first to go under pressure."""
        oldest = None
        for entry in self.keys.values():
            if (
                entry.state is RecvState.READY
                and not entry.expected
                and getattr(entry.slot, "nbytes", 0) > 0
                and (oldest is None or entry.deadline < oldest.deadline)
            ):
                oldest = entry
        return oldest

    def expire(self, now: float) -> list[RecvKey]:
        """Apply EXPIRE to every key past its deadline; forget closed ones.
        Returns the entries that expired out of READY (their slot to free)."""
        freed = []
        for key, entry in list(self.keys.items()):
            if now <= entry.deadline:
                continue
            if entry.state is RecvState.CLOSED:
                del self.keys[key]
                continue
            if entry.state is RecvState.ABANDONING:
                continue  # the receive thread ends it (its transport deadline)
            before = entry.state
            self.apply(key, Event.EXPIRE, now)
            if before is RecvState.READY:
                freed.append(entry)
        return freed


class OfferAnswer(enum.Enum):
    ACCEPT = "accept"  # take room for it and queue its slot (answered ok)
    REFUSE = "refuse"  # a Refusal kind (answered rejected)
    NOT_WANTED = "not_wanted"  # the worker gave up on the key (answered so)


@dataclass(frozen=True)
class OfferDecision:
    answer: OfferAnswer
    refusal: Refusal | None = None
    detail: str = ""  # for this side's log only
    fail_load: bool = False  # DIGEST from the named prefill: no other KV will come
    skip_blocks: int = 0  # ACCEPT: blocks the decode holds itself
    deadline: float | None = None  # ACCEPT: the decode's own (None: not expected)


@dataclass(frozen=True)
class OfferFacts:
    """What an offer of ``key`` says, and what the listener knows of it."""

    key: str
    num_blocks: int
    prompt_digest: bytes
    channel: str  # its channel id
    channel_ok: bool  # a live channel of the connection it came on
    offered_by: str  # the host of the channel's sender (canonical)
    max_blocks: int  # the receiver's KV cache
    table_full: bool  # a new key would pass MAX_RECV_KEYS


def decide_offer(entry: RecvKey | None, offer: OfferFacts) -> OfferDecision:
    """What an offer gets, from the key's entry (None: unknown key): in order,
    a bad channel, too many blocks, a second offer, a full table, a key given
    up on, another prompt's KV; else accepted. A refused key is never filed
    (a flood of offers must not grow the table)."""

    def refuse(kind: Refusal, detail: str, fail: bool = False) -> OfferDecision:
        return OfferDecision(OfferAnswer.REFUSE, kind, detail, fail_load=fail)

    state = None if entry is None else entry.state
    if not offer.channel_ok:
        return refuse(
            Refusal.UNKNOWN_CHANNEL, f"offer on unknown channel {offer.channel!r}"
        )
    if offer.num_blocks > offer.max_blocks:
        return refuse(
            Refusal.OVERSIZED,
            f"offer of {offer.num_blocks} blocks, the KV cache has {offer.max_blocks}",
        )
    if state in (RecvState.RECEIVING, RecvState.ABANDONING, RecvState.READY):
        return refuse(Refusal.DUPLICATE, f"second offer for {offer.key}")
    if entry is None and offer.table_full:
        return refuse(Refusal.BUSY, "too many keys already tracked")
    if state is RecvState.CLOSED:
        return OfferDecision(OfferAnswer.NOT_WANTED)
    expected = entry if entry is not None and entry.expected else None
    if expected is None:
        return OfferDecision(OfferAnswer.ACCEPT)
    if offer.prompt_digest != expected.prompt_digest:
        # KV of another prompt under this key: never filed. From the host of
        # the prefill the request named, no other KV will come: fail the load
        # now; from anyone else, only refuse (the real one may).
        return refuse(
            Refusal.DIGEST,
            f"offer of {offer.key}: prompt digest differs from the request's",
            fail=bool(expected.prefill_host)
            and offer.offered_by == expected.prefill_host,
        )
    return OfferDecision(
        OfferAnswer.ACCEPT,
        skip_blocks=min(expected.skip_blocks, offer.num_blocks - 1),
        deadline=expected.load_deadline,
    )
