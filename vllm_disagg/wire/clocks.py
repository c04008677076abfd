"""The fleet's one clock rule: how far apart two parts' wall clocks may be.

Two checks compare a sender's wall clock (``time.time()``) with the
receiver's:

* a router's discovery refuses a ``Register`` or ``Deregister`` whose
  ``sent_at`` is more than :data:`MAX_CLOCK_SKEW_S` off its own clock, ahead
  or behind, with or without a registration token (``wire/discovery.py``);
* a P2P receiver refuses a ``Hello`` whose ``sent_at`` is more than
  :data:`MAX_HELLO_AGE_S` off its own clock (``engine/receiver.py``): a
  captured Hello replays for no longer than that.

A router pairs only instances it accepted, each within ``MAX_CLOCK_SKEW_S``
of the router's clock, so any two of them are within ``2 *
MAX_CLOCK_SKEW_S`` of each other: :data:`MAX_HELLO_AGE_S` is that plus
:data:`CLOCK_SLACK_S` (a Hello's time in flight and in the receiver's queue,
and the drift of a clock between two heartbeats, each re-checked). A pair the
router makes can always open its P2P channel; an instance too far off is
refused at registration, its Ack saying by how much, and never paired.
Without a router (peers an operator names), a Hello refused for its clock
ends the transfer at once on both sides (``Abort``), never at
``kv_load_timeout_s``.

Standard library only: the router and the connector both import it.
"""

from __future__ import annotations

# Largest difference between an instance's clock and a router's that the
# router accepts (NTP keeps clocks within milliseconds; minutes off is a
# broken host, said at registration instead of on every transfer).
MAX_CLOCK_SKEW_S = 120.0
# A Hello's time in flight and queued, and clock drift between heartbeats.
CLOCK_SLACK_S = 60.0
# Largest difference between a Hello's sender clock and its receiver's.
MAX_HELLO_AGE_S = 2 * MAX_CLOCK_SKEW_S + CLOCK_SLACK_S


def clock_offset_problem(offset_s: float, limit_s: float, whose: str) -> str | None:
    """Why a sender clock ``offset_s`` ahead of this side's (negative: behind)
    is refused, or None within ``limit_s``; ``whose``: this side's name."""
    if abs(offset_s) <= limit_s:
        return None
    direction = "ahead of" if offset_s > 0 else "behind"
    return (
        f"the sender's clock is {abs(offset_s):.0f} s {direction} the {whose}'s "
        f"(at most {limit_s:.0f} s; a replayed frame, or clocks to sync with NTP)"
    )
