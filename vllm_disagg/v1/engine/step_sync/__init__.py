"""Step-synchronized data parallelism: the Coordinator/Participant protocol.

MoE DP ranks must run the same number of forward passes, because every pass
meets the other ranks in collectives. Instead of upstream's "waves" (a DP
coordinator process, START_DP_WAVE broadcasts, an all-reduce every N steps),
the ranks agree on a *coordinator step* ``G``: every rank runs forward passes
1..G, with dummy batches where it has no work of its own.

* One :class:`Coordinator` (a thread in DP rank 0's engine process, or from
  DP = 32 in a child process of it: :class:`CoordinatorProcess`) keeps ``G``,
  the group's phase (running, paused, exiting) and the members.
* One :class:`Participant` per DP rank. Its engine thread counts
  ``local_step`` (real or dummy forward passes done) and knows the latest
  ``coord_step`` granted. A rank with work that is about to run pass ``s``
  makes sure ``G >= s`` by asking for ``s + lookahead`` *before* it needs it
  (pipelined lease renewal). Ranks with ``local_step < G`` run dummy passes.

State, not events. Every message carries the sender's whole state, so a
message lost anywhere (a TCP reset that ZMQ papers over, a full queue, a
dropped send) is healed by the next one:

* a participant sends :class:`RankState` (the step it asked for, its pass
  count, its pause intent, whether it is leaving) whenever it changes, again
  every ``RESEND_INTERVAL_S`` while the coordinator has not acknowledged
  it or while it waits for a grant, and as its heartbeat;
* the coordinator answers with :class:`GroupState` (``G``, the phase, the
  step the phase was agreed at, how many ranks joined, and which of the
  rank's messages it has seen), and repeats it to every rank as its heartbeat.

Failure is reported, never waited out: a peer silent for ``peer_timeout_s``,
a rank that owes passes and runs none, or one that ran an ungranted pass that
stays ungranted for that long, ends the group with a message naming it.

Membership is authenticated: every frame (the shared format of
``vllm_disagg/wire/frames.py``) carries an HMAC-SHA256 of its payload under a
key for this one group, derived from a secret only the members hold (the
launching process's, the operator's ``VLLM_DISAGG_DP_SECRET``, or on loopback
the user's local cookie: ``credentials.py``) and the group's id, and a
per-sender sequence number against replay. The DP group's TCP store carries
only the coordinator's address and the group id (``rendezvous.py``).
Unauthenticated, malformed, stale or oversized frames are dropped and counted;
their log lines are rate-limited. No frame from outside the group can change
its state or fail it.

Layout: the rules are plain state machines with no socket, thread or clock
(``coordinator_core.py``, ``participant_core.py``: frames and the time in,
messages out); ``coordinator.py`` and ``participant.py`` are the shells that
own the ZMQ sockets and the network threads (``shell.py``);
``credentials.py`` says where the secret comes from and ``rendezvous.py`` how
the ranks meet. The engine-side state of a participant is only touched by the
engine thread; grants and group-state changes reach it through callbacks that
the engine turns into items on its input queue.
"""

from vllm_disagg.v1.engine.step_sync.config import (
    OPTION_KEYS,
    StepSyncConfig,
    new_group_secret,
)
from vllm_disagg.v1.engine.step_sync.coordinator import Coordinator
from vllm_disagg.v1.engine.step_sync.coordinator_core import CoordinatorCore
from vllm_disagg.v1.engine.step_sync.coordinator_process import CoordinatorProcess
from vllm_disagg.v1.engine.step_sync.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    TO_COORDINATOR,
    TO_PARTICIPANT,
    Abort,
    GroupPhase,
    GroupState,
    RankState,
    seal,
)
from vllm_disagg.v1.engine.step_sync.participant import Participant, StepSyncGroupError
from vllm_disagg.v1.engine.step_sync.participant_core import ParticipantCore

__all__ = [
    "Abort",
    "Coordinator",
    "CoordinatorCore",
    "CoordinatorProcess",
    "GroupPhase",
    "GroupState",
    "MAX_MESSAGE_BYTES",
    "OPTION_KEYS",
    "Participant",
    "ParticipantCore",
    "PROTOCOL_VERSION",
    "RankState",
    "StepSyncConfig",
    "StepSyncGroupError",
    "TO_COORDINATOR",
    "TO_PARTICIPANT",
    "new_group_secret",
    "seal",
]
