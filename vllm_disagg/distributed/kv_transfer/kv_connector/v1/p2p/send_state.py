"""The send side of every transfer: one ordered state, one transition table,
and the pure decision of what a ``Get`` gets.

The counterpart of recv_state.py. A transfer (engine/transfers.py) is in
exactly one :class:`SendState` and only moves forward: :func:`step` is the
only place that changes it and refuses what the table does not list (a
second end of one send: the sweep's backstop racing the send itself). GET
transfers are also filed by key in a :class:`SendTable` until a ``Get``
pulls them, their deadline passes, or, once released, they are forgotten.
No sockets, no threads, time passed in: the engine calls it under its lock,
the unit tests drive it directly.

::

               hold                 Get pulls it             every layer written
    (none) ---------> HELD ---------------------> SENDING ---------------------> SENT
      |                 | second hold of the key     ^  |  refused, broken, no reply
      |  start_send     +--> FAILED                  |  +--> FAILED
      +----------------------------------------------+  |
                        | deadline passed               | deadline passed
                        +--> EXPIRED                    +--> EXPIRED

SENT, FAILED and EXPIRED are the *released* states: the worker frees the
blocks, and a ``Get`` of a released key is answered ``gone`` until the key
is forgotten ``tombstone_s`` later.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


class SendState(enum.IntEnum):
    """Where one transfer is; ordered: a transfer only moves forward."""

    HELD = 1  # GET: kept until a Get pulls it or kv_hold_timeout_s passes
    SENDING = 2  # on its peer's thread: the offer, then the layers' messages
    SENT = 3  # released: every layer was written
    FAILED = 4  # released: refused, a broken channel, no reply, replaced
    EXPIRED = 5  # released: not pulled and sent by its deadline

    @property
    def released(self) -> bool:
        return self >= SendState.SENT


class SendEvent(enum.Enum):
    HOLD = "hold"  # GET: the prefill's worker keeps the KV for a Get
    QUEUE = "queue"  # PUT: the worker queued the KV on its peer's thread
    PULL = "pull"  # a Get from the decode host the request named
    SENT = "sent"  # the peer thread wrote every layer
    FAIL = "fail"  # refused, broken, no reply, replaced by a second hold
    EXPIRE = "expire"  # the deadline passed (the sweep)


S, E = SendState, SendEvent
# (state, event) -> next state; None as a state: a transfer not started yet.
TRANSITIONS: dict[tuple[SendState | None, SendEvent], SendState] = {
    (None, E.HOLD): S.HELD,
    (None, E.QUEUE): S.SENDING,
    (S.HELD, E.PULL): S.SENDING,
    (S.HELD, E.FAIL): S.FAILED,  # replaced: nothing could ever pull it
    (S.HELD, E.EXPIRE): S.EXPIRED,  # nobody pulled it
    (S.SENDING, E.SENT): S.SENT,
    (S.SENDING, E.FAIL): S.FAILED,
    (S.SENDING, E.EXPIRE): S.EXPIRED,  # backstop: its send did not end it
}

NOT_SENT_IN_TIME = "not pulled and sent before kv_hold_timeout_s"


def step(state: SendState | None, event: SendEvent) -> SendState | None:
    """The state ``event`` moves a transfer in ``state`` to; None when the
    table does not list it (the transfer has ended already: ignore it)."""
    return TRANSITIONS.get((state, event))


class Transfer(Protocol):
    """What the table needs of a transfer (engine/transfers.py's SendTransfer)."""

    key: str
    state: SendState | None
    deadline: float
    decode_host: str  # GET: only a Get from this host may pull it ("" any)


class GetAnswer(enum.Enum):
    """What a ``Get`` of one key gets (:func:`decide_get`)."""

    PULL = "pull"  # held for this host: send it now (answered ok)
    SENDING = "sending"  # pulled already: its offer is on the way (answered ok)
    GONE = "gone"  # released: sent, failed or expired
    NOT_READY = "not_ready"  # not held (yet): ask again
    NOT_YOURS = "not_yours"  # held for another decode host: refused


def decide_get(held: Transfer | None, host: str) -> GetAnswer:
    """A Get from decode host ``host`` (canonical) for the transfer ``held``
    under its key (None: nothing). KV goes only to the decode host the
    request named (any DP rank there: the rank that runs the request pulls
    with its own address)."""
    if held is None:
        return GetAnswer.NOT_READY
    if held.decode_host not in ("", host):
        return GetAnswer.NOT_YOURS
    if held.state is SendState.HELD:
        return GetAnswer.PULL
    if held.state is SendState.SENDING:
        return GetAnswer.SENDING
    return GetAnswer.GONE


@dataclass(eq=False)
class Filed:
    """A GET transfer filed under its key, and until when."""

    xfer: Transfer
    until: float  # HELD, SENDING: the transfer's deadline; released: forgotten then


class SendTable:
    """The GET transfers of one engine, by key. Not thread-safe: callers hold
    the engine's lock."""

    def __init__(self, tombstone_s: float):
        self.tombstone_s = tombstone_s
        self.keys: dict[str, Filed] = {}

    def get(self, key: str) -> Transfer | None:
        filed = self.keys.get(key)
        return None if filed is None else filed.xfer

    def apply(self, xfer: Transfer, event: SendEvent, now: float) -> bool:
        """Move ``xfer`` by ``event``; False (nothing changes) when the table
        does not list it. A filed transfer that is released is remembered
        ``tombstone_s`` more, so a late Get is answered ``gone``."""
        target = step(xfer.state, event)
        if target is None:
            return False
        xfer.state = target
        filed = self.keys.get(xfer.key)
        if event is SendEvent.HOLD:
            self.keys[xfer.key] = Filed(xfer, xfer.deadline)
        elif filed is not None and filed.xfer is xfer:
            filed.until = now + self.tombstone_s if target.released else xfer.deadline
        return True

    def hold(self, xfer: Transfer, now: float) -> Transfer | None:
        """File ``xfer`` as HELD under its key (a retried id replaces the
        transfer there). Returns the replaced one if it was still HELD: the
        caller fails it, since nothing could ever pull it (one being sent
        ends on its own)."""
        old = self.get(xfer.key)
        self.apply(xfer, SendEvent.HOLD, now)
        return old if old is not None and old.state is SendState.HELD else None

    def expire(self, now: float) -> list[Transfer]:
        """Expire the transfers past their deadline (returned: the caller ends
        them) and forget the released ones past their tombstone."""
        expired = []
        for key, filed in list(self.keys.items()):
            if now <= filed.until:
                continue
            if filed.xfer.state is not None and filed.xfer.state.released:
                del self.keys[key]
            elif self.apply(filed.xfer, SendEvent.EXPIRE, now):
                expired.append(filed.xfer)
        return expired
