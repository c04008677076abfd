"""What the registry remembers of instances that left, so no old frame brings them back.

The registry holds the instances that are registered; this holds the ones
that are not any more, for as long as a captured frame of theirs could still
pass discovery's clock window (``wire/clocks.py``):

* retired incarnations: an ``instance_id`` that a newer incarnation at its
  address replaced is refused for ``RETIRED_TTL_S`` (a replayed frame of it
  must not evict its successor);
* removed instances (deregistered, expired, unreachable), each with its last
  ``seq``: only a newer heartbeat of it brings it back, for ``REMOVED_TTL_S``.

Both memories are bounded. Removed instances forgotten early (more than
``MAX_REMOVED`` within ``REMOVED_TTL_S``) leave a watermark: until their time
would have ended, a new instance id whose frame is no newer than the newest
of theirs may be one of them, and is refused.
"""

from __future__ import annotations

from vllm_disagg.wire.clocks import CLOCK_SLACK_S, MAX_CLOCK_SKEW_S
from vllm_disagg.wire.discovery import Register

# An incarnation replaced by a newer one at its address is refused this long
# (a captured frame of it replayed must not evict its successor).
RETIRED_TTL_S = 600.0
MAX_RETIRED = 4096
# A removed instance's last seq is remembered this long: longer than a frame
# stays within discovery's clock window (sent by a clock MAX_CLOCK_SKEW_S
# ahead, opened until MAX_CLOCK_SKEW_S after that), so an old frame of it is
# refused by one rule or the other.
REMOVED_TTL_S = max(RETIRED_TTL_S, 2 * MAX_CLOCK_SKEW_S + CLOCK_SLACK_S)
MAX_REMOVED = 4096


class Departures:
    """Instances that left the registry, and the frames of theirs to refuse."""

    def __init__(self) -> None:
        # instance id -> until: incarnations a newer one replaced
        self.retired: dict[str, float] = {}
        # instance id -> (until, its last seq, its last sent_at): removed ones
        self.removed: dict[str, tuple[float, int, float]] = {}
        # The newest sent_at of removed instances forgotten early, and until
        # when any of them would still have been remembered.
        self._forgotten_sent_at = -1.0
        self._forgotten_until = -1.0

    def refusal(self, msg: Register, now: float) -> tuple[str, str] | None:
        """Why a frame of an instance not registered now is refused, as
        (counter label, detail), or None when it may register."""
        gone = self.removed.get(msg.instance_id)
        if gone is not None:
            until, seq, _ = gone
            if now < until and msg.seq <= seq:
                return (
                    "replayed",
                    f"{msg.instance_id} was removed after heartbeat {seq}: "
                    f"heartbeat {msg.seq} is an old frame",
                )
        elif now < self._forgotten_until and msg.sent_at <= self._forgotten_sent_at:
            return (
                "replayed",
                f"{msg.instance_id}: a frame no newer than those of removed "
                "instances this router could not remember (more than "
                f"{MAX_REMOVED} removals within {REMOVED_TTL_S:.0f} s); "
                "a live instance is accepted once its clock passes them",
            )
        until = self.retired.get(msg.instance_id)
        if until is not None and now < until:
            return (
                "stale",
                f"{msg.instance_id} was replaced by a newer incarnation at its address",
            )
        return None

    def retire(self, instance_id: str, now: float) -> None:
        """A newer incarnation replaced ``instance_id`` at its address."""
        self.retired[instance_id] = now + RETIRED_TTL_S
        while len(self.retired) > MAX_RETIRED:
            del self.retired[next(iter(self.retired))]

    def remember_removed(
        self, instance_id: str, seq: int, sent_at: float, now: float
    ) -> None:
        until = now + REMOVED_TTL_S
        self.removed[instance_id] = (until, seq, sent_at)
        while len(self.removed) > MAX_REMOVED:
            oldest = next(iter(self.removed))
            old_until, _, old_sent_at = self.removed.pop(oldest)
            if old_until > now:  # forgotten early: refuse what it could replay
                self._forgotten_until = max(self._forgotten_until, old_until)
                self._forgotten_sent_at = max(self._forgotten_sent_at, old_sent_at)

    def returned(self, instance_id: str) -> None:
        """A newer heartbeat of a removed instance: it lives."""
        self.removed.pop(instance_id, None)
