"""The participant's shell: a DEALER socket, a network thread and the engine thread's
waits around :class:`ParticipantCore`."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable

import zmq

from vllm_disagg.errors import ConfigError
from vllm_disagg.v1.engine.step_sync.config import (
    FLUSH_TIMEOUT_S,
    MAX_GRANT_WAIT_S,
    StepSyncConfig,
)
from vllm_disagg.v1.engine.step_sync.messages import (
    TO_COORDINATOR,
    Counters,
    GroupState,
    RankState,
    seal,
)
from vllm_disagg.v1.engine.step_sync.participant_core import ParticipantCore
from vllm_disagg.v1.engine.step_sync.shell import NetworkThread, new_socket


class StepSyncGroupError(RuntimeError):
    """The step-sync group did not form or cannot go on."""


class Participant(NetworkThread):
    """One DP rank's side of the protocol.

    Engine thread API: :meth:`begin_forward` before every real or dummy
    forward pass, :meth:`observe_grant` for each step delivered through
    ``on_grant``, :attr:`steps_owed` to decide whether a dummy pass is due,
    :meth:`set_pause_intent` / :meth:`set_pause_ready` / :meth:`set_leaving`
    for the group phases, and :attr:`group` for the latest group state
    (``on_group`` announces each change of it). The accounting lives in
    :attr:`core`; this object adds the sockets, the network thread and the waits.
    """

    def __init__(
        self,
        config: StepSyncConfig,
        dp_rank: int,
        coordinator_address: str,
        secret: bytes,
        on_grant: Callable[[int], None],
        on_failure: Callable[[str], None],
        on_group: Callable[[GroupState], None] | None = None,
    ):
        if not 0 <= dp_rank < config.dp_size:
            raise ConfigError(f"dp_rank {dp_rank} outside [0, {config.dp_size})")
        super().__init__(f"StepSyncParticipant{dp_rank}", on_failure)
        self.config = config
        self.dp_rank = dp_rank
        self.coordinator_address = coordinator_address
        self._secret = secret
        self.on_grant = on_grant
        self.on_group = on_group or (lambda state: None)
        self._incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.core = ParticipantCore(config, dp_rank, self._incarnation, secret)
        # The engine thread may wait on this for the delivered step (or the
        # member count) to grow; the network thread notifies it.
        self._delivered_grew = threading.Condition()
        self._log_prefix = f"step sync rank {dp_rank}"
        self._sock = new_socket(zmq.DEALER, coordinator_address)
        self._sock.connect(coordinator_address)
        # Engine thread -> network thread wake-ups: "the state changed".
        ctx = zmq.Context.instance()
        wake_addr = f"inproc://step-sync-{dp_rank}-{self._incarnation}"
        self._wake_rx = ctx.socket(zmq.PULL)
        self._wake_rx.setsockopt(zmq.LINGER, 0)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = ctx.socket(zmq.PUSH)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake_addr)
        self._sockets += [self._wake_tx, self._wake_rx, self._sock]

    # --- the core's state, for the engine and for metrics ---

    local_step = property(
        lambda self: self.core.local_step, doc="Passes (real or dummy) run."
    )
    coord_step = property(
        lambda self: self.core.coord_step, doc="Latest grant observed."
    )
    requested = property(
        lambda self: self.core.requested, doc="Highest step asked for."
    )
    forward_steps = property(lambda self: self.core.forward_steps)
    dummy_steps = property(lambda self: self.core.dummy_steps)
    intent = property(lambda self: self.core.intent)
    delivered = property(
        lambda self: self.core.delivered, doc="Highest step granted so far."
    )
    group = property(
        lambda self: self.core.group, doc="The latest group state, if any."
    )

    @property
    def counters(self) -> Counters:
        return self.core.counters

    @property
    def watch_progress(self) -> bool:
        return self.core.watch_progress

    @watch_progress.setter
    def watch_progress(self, value: bool) -> None:
        self.core.watch_progress = value

    @property
    def steps_owed(self) -> int:
        """Forward passes this rank still owes the group (dummy if no work).

        Engine thread only: it asks after every pass (or begins the next one),
        so asking also says the last pass ended (the progress watch gives a
        rank inside a pass longer than one that runs none)."""
        self.core.in_pass = False
        return self.core.steps_owed

    # --- engine thread ---

    def observe_grant(self, step: int) -> None:
        self.core.observe_grant(step)

    def begin_forward(self, dummy: bool, passes_after: int | None = None) -> int:
        """Account for the forward pass about to run; return its step number.

        A real pass may run ahead of the grant: the coordinator is asked for
        ``lookahead`` steps past it before the remaining grant drops below the
        renewal margin. A real pass that nobody granted yet waits for its
        grant (see ``_await_grant``); with ``request_ahead`` that is rare.
        ``passes_after``: the most passes the known work can still use (None:
        unknown); the request goes no further.
        """
        before = self.core.state
        step = self.core.begin_forward(dummy, passes_after)
        if not dummy:
            self._wake_if_changed(before)
            self._await_grant(step)
        return step

    def request_ahead(self, passes: int | None = None) -> None:
        """Work arrived while this rank holds no grant beyond its last pass:
        ask for the next ``lookahead`` steps now and wait for the grant, so
        the peers start their dummy pass while this engine is still
        scheduling. If the work turns out unschedulable, the group runs at
        most ``lookahead`` dummy passes for it. ``passes``: the most passes the
        work can use, when known (the request goes no further)."""
        before = self.core.state
        step = self.core.request_ahead(passes)
        if step is not None:
            self._wake_if_changed(before)
            self._await_grant(step)

    def set_pause_intent(self, pause: bool) -> int:
        """A pause (True) or resume (False) call on this rank; returns the
        intent number the coordinator acknowledges in ``intent_ack``."""
        intent = self.core.set_pause_intent(pause)
        self._wake()
        return intent

    def set_pause_ready(self) -> None:
        """Paused and locally drained: no more real passes until resumed."""
        before = self.core.state
        self.core.set_pause_ready()
        self._wake_if_changed(before)

    def set_leaving(self) -> None:
        """Shutting down and locally drained: no more real passes."""
        before = self.core.state
        self.core.set_leaving()
        self._wake_if_changed(before)

    def wait_for_group(self, timeout_s: float) -> None:
        """Block until all ``dp_size`` ranks joined; raise with the reason
        (the coordinator's, when it gave one) if the group does not form."""
        deadline = time.monotonic() + timeout_s
        with self._delivered_grew:
            self._delivered_grew.wait_for(
                lambda: self._failed is not None
                or (
                    self.group is not None and self.group.members >= self.config.dp_size
                ),
                max(0.0, deadline - time.monotonic()),
            )
        if self._failed is not None:
            raise StepSyncGroupError(self._failed)
        if self.group is None or self.group.members < self.config.dp_size:
            joined = 0 if self.group is None else self.group.members
            raise StepSyncGroupError(
                f"DP rank {self.dp_rank}: the step-sync group at "
                f"{self.coordinator_address} did not form within {timeout_s:.0f}s "
                f"({joined}/{self.config.dp_size} ranks joined)"
            )

    def _publish(self) -> None:
        self.core.publish()
        self._wake()

    def _wake_if_changed(self, before: RankState) -> None:
        if self.core.state is not before:
            self._wake()

    def _wake(self) -> None:
        try:  # noqa: SIM105 - every state change: no suppress() object per wake-up
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already queued; the resend timer is the backstop

    def _await_grant(self, step: int) -> None:
        """Wait, up to ``MAX_GRANT_WAIT_S``, until ``step`` was granted.

        Only a rank waking an idle group waits, for one loopback round trip,
        and the wait costs nothing: its first pass would wait for its peers in
        the first collective anyway, and they start on that same grant. It
        matters because otherwise this thread goes on scheduling while holding
        the GIL, and the network thread that carries the request (and, on
        rank 0, the coordinator thread) gets to run only after the
        interpreter's switch interval (5 ms).
        """
        core = self.core
        if core.delivered >= step:
            return
        core.counters.inc("grant_waits")
        with self._delivered_grew:
            self._delivered_grew.wait_for(
                lambda: core.delivered >= step or self._failed is not None,
                MAX_GRANT_WAIT_S,
            )

    @property
    def stats(self) -> dict[str, int]:
        """Counters and step positions for metrics (any thread may read)."""
        core = self.core
        return {
            **core.counters.snapshot(),
            "local_step": core.local_step,
            "coord_step": core.coord_step,
            "forward_steps": core.forward_steps,
            "dummy_steps": core.dummy_steps,
        }

    def close(self, timeout_s: float = 5.0) -> None:
        """Leave: tell the coordinator (waiting briefly for it to hear it,
        so it does not take the silence for a failure), then stop."""
        if self._thread.is_alive() and self._failed is None:
            final = self.core.set_left()
            self._wake()
            deadline = time.monotonic() + min(FLUSH_TIMEOUT_S, timeout_s)
            while time.monotonic() < deadline and self._failed is None:
                if self.core.acknowledged(final):
                    break
                time.sleep(0.01)
        super().close(timeout_s)

    # --- network thread ---

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        self._send(self.core.start(time.monotonic()))
        timeout_ms = int(self.config.resend_interval_s * 1000)
        while not self._stop.is_set():
            events = dict(poller.poll(timeout_ms))
            if self._wake_rx in events:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            if self._sock in events:
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)
                if self._failed is not None:
                    return
            msg = self.core.on_tick(time.monotonic())
            if msg is not None:
                self._send(msg)
            if self.core.failed is not None:
                if self.core.stalled is not None:
                    # Where this rank's engine is stuck is in its threads and its
                    # workers' threads: into the log, before the engine exits.
                    from vllm_disagg.diagnostics import dump_stacks

                    dump_stacks(self.core.stalled)
                self._fail(self.core.failed)
                return

    def _send(self, msg: RankState) -> None:
        try:  # noqa: SIM105 - every step: no suppress() object per message
            self._sock.send_multipart(
                seal(self._secret, TO_COORDINATOR, msg), zmq.NOBLOCK
            )
        except zmq.Again:
            pass  # not connected yet or queue full: the resend timer heals it

    def _handle(self, frames: list[bytes]) -> None:
        received = self.core.on_frames(frames, time.monotonic())
        if received is None:
            return
        if self.core.failed is not None and self._failed is None:
            self._fail(self.core.failed)  # the coordinator's Abort
        else:
            with self._delivered_grew:
                self._delivered_grew.notify_all()
        if received.grant is not None:
            self.on_grant(received.grant)
        if received.group is not None:
            self.on_group(received.group)

    def _fail(self, reason: str) -> None:
        self._fail_once(reason, self._log_prefix)
        with self._delivered_grew:
            self._delivered_grew.notify_all()
