"""Step sync's wire messages and their sealed, direction-labelled frames.

State, not events: every message carries the sender's whole state, so the latest one
wins and a lost one is healed by the next (see the package docstring).
"""

from __future__ import annotations

import enum
import threading
from typing import Annotated

import msgspec

from vllm_disagg.wire.frames import FrameCodec, FrameError

# Version 1: event messages (Register, RequestSteps, Pause, ...), no auth.
# Version 2: whole-state messages, HMAC-authenticated frames, shutdown phase.
# Version 3: frames authenticated under a per-group key (credentials.group_key);
# the secret never travels through the DP group's store.
PROTOCOL_VERSION = 3
# No legitimate frame is anywhere near this; ZMQ drops larger ones.
MAX_MESSAGE_BYTES = 1024

Step = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
Seq = Annotated[int, msgspec.Meta(ge=1, le=2**62)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=2**16)]
Incarnation = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class GroupPhase(enum.IntEnum):
    RUNNING = 0
    # Every rank paused and drained; all stop at ``phase_step``.
    PAUSED = 1
    # Every rank is shutting down and drained; all leave at ``phase_step``.
    EXITING = 2


class RankState(
    msgspec.Struct, tag="rank", array_like=True, forbid_unknown_fields=True
):
    """Participant -> coordinator: everything the coordinator needs to know
    about one rank. Idempotent: the latest one wins."""

    version: int
    dp_rank: Rank
    dp_size: Annotated[int, msgspec.Meta(ge=1, le=2**16)]
    lookahead: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    incarnation: Incarnation
    seq: Seq
    # Highest step this rank asked the group to run through.
    requested: Step
    # Forward passes (real or dummy) this rank has started.
    local_step: Step
    # Counts pause/resume calls; acknowledged back in GroupState.intent_ack.
    intent: Step
    # The latest intent: pause (True) or run (False).
    want_pause: bool
    # want_pause and locally drained: no more real passes from this rank.
    pause_ready: bool
    # Shutting down and locally drained: no more real passes from this rank.
    leaving: bool
    # Left the busy loop (after the agreed exit step, or alone).
    left: bool


class GroupState(
    msgspec.Struct, tag="group", array_like=True, forbid_unknown_fields=True
):
    """Coordinator -> participant: the group as the coordinator sees it."""

    version: int
    seq: Seq
    step: Step
    phase: GroupPhase
    # Step at which the current phase was agreed (G when it was).
    phase_step: Step
    # Ranks registered so far; the group runs once all dp_size joined.
    members: Step
    # Highest RankState.seq and .intent of this rank the coordinator processed.
    ack_seq: Step
    intent_ack: Step


class Abort(msgspec.Struct, tag="abort", array_like=True, forbid_unknown_fields=True):
    """Either direction: the group cannot continue (or this rank may not join)."""

    version: int
    seq: Seq
    reason: Annotated[str, msgspec.Meta(max_length=512)]


ToCoordinator = RankState | Abort
ToParticipant = GroupState | Abort

# Direction labels inside the MAC, so a frame cannot be reflected back.
TO_COORDINATOR = FrameCodec(
    b"P2C", msgspec.msgpack.Decoder(ToCoordinator), MAX_MESSAGE_BYTES
)
TO_PARTICIPANT = FrameCodec(
    b"C2P", msgspec.msgpack.Decoder(ToParticipant), MAX_MESSAGE_BYTES
)

# FrameError kinds in the words of step sync's log lines.
_REASONS = {
    "unauthenticated": "unauthenticated frame",
    "malformed": "undecodable message",
    "oversized": "oversized frame",
}
UNAUTHENTICATED = _REASONS["unauthenticated"]


def seal(secret: bytes, codec: FrameCodec, msg: msgspec.Struct) -> list[bytes]:
    """``[payload, mac]`` for ``msg`` in the direction ``codec`` names."""
    return codec.seal(secret, msg)


def open_frames(secret: bytes, codec: FrameCodec, frames: list[bytes]):
    """Authenticate and decode ``[payload, mac]``: (message, None), or
    (None, the reason why not)."""
    try:
        msg = codec.open(secret, frames)
    except FrameError as e:
        return None, _REASONS.get(e.kind, e.kind)
    if msg.version != PROTOCOL_VERSION:
        return None, f"protocol version {msg.version}, expected {PROTOCOL_VERSION}"
    return msg, None


class Counters:
    """Thread-safe counters exported as metrics (a core counts, any thread reads)."""

    def __init__(self, *names: str):
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def inc(self, name: str, by: int = 1) -> None:
        with self._lock:
            self._values[name] += by

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
