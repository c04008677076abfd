"""The coordinator's shell: a ROUTER socket and a thread around
:class:`CoordinatorCore`."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq
from vllm.utils.network_utils import (
    is_valid_ipv6_address,
    make_zmq_path,
    split_zmq_path,
)

from vllm_disagg.v1.engine.step_sync.config import StepSyncConfig
from vllm_disagg.v1.engine.step_sync.coordinator_core import CoordinatorCore, Send
from vllm_disagg.v1.engine.step_sync.messages import (
    MAX_MESSAGE_BYTES,
    TO_PARTICIPANT,
    Counters,
    GroupPhase,
    seal,
)
from vllm_disagg.v1.engine.step_sync.shell import NetworkThread, new_socket
from vllm_disagg.wire.frames import harden_listener

# Frames answered together at most (the heartbeat and timeouts run between batches).
MAX_FRAME_BATCH = 1024


class Coordinator(NetworkThread):
    """Keeps the coordinator step and the group phase; tells every member.

    Runs a background thread bound to ``address`` (a ZMQ TCP endpoint; port
    0 picks a free port, see :attr:`address`). Every ``dp_size`` rank must
    register within ``peer_timeout_s`` of :meth:`start`, or the group fails.
    The rules live in :attr:`core`; this thread only moves bytes and time.
    """

    def __init__(
        self,
        config: StepSyncConfig,
        address: str,
        secret: bytes,
        on_failure: Callable[[str], None] | None = None,
    ):
        super().__init__("StepSyncCoordinator", on_failure or (lambda reason: None))
        self.config = config
        self._secret = secret
        self.core = CoordinatorCore(config, secret)
        self._abort_on_close: str | None = None
        self._sock = new_socket(zmq.ROUTER, address)
        harden_listener(self._sock, MAX_MESSAGE_BYTES)
        self._sockets.append(self._sock)
        scheme, host, port = split_zmq_path(address)
        if port == "0":
            bracketed = f"[{host}]" if is_valid_ipv6_address(host) else host
            port = self._sock.bind_to_random_port(f"{scheme}://{bracketed}")
            address = make_zmq_path(scheme, host, port)
        else:
            self._sock.bind(address)
        self.address = address

    @property
    def step(self) -> int:
        return self.core.step

    @property
    def phase(self) -> GroupPhase:
        return self.core.phase

    @property
    def phase_step(self) -> int:
        return self.core.phase_step

    @property
    def counters(self) -> Counters:
        return self.core.counters

    @property
    def registered(self) -> list[int]:
        return list(self.core.registered)

    @property
    def all_left(self) -> bool:
        """Every member left the busy loop (the coordinator may go)."""
        return self.core.all_left

    @property
    def stats(self) -> dict[str, int]:
        return {**self.core.counters.snapshot(), "coordinator_step": self.core.step}

    def close(self, timeout_s: float = 5.0, abort_reason: str | None = None) -> None:
        """Stop; unless every member already left, tell them the group is
        over first (so they fail now, not after ``peer_timeout_s``)."""
        self._abort_on_close = abort_reason or "the coordinator (DP rank 0) shut down"
        super().close(timeout_s)

    # The thread owns the socket from here on.
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        self.core.start(time.monotonic())
        while not self._stop.is_set():
            timeout_ms = max(
                0, int((self.core.next_heartbeat - time.monotonic()) * 1000)
            )
            if poller.poll(min(timeout_ms, 100)):
                batch = []
                while len(batch) < MAX_FRAME_BATCH:
                    try:
                        batch.append(self._sock.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                self._handle(batch)
            self._deliver(self.core.on_tick(time.monotonic()))
        if self._deliver(
            self.core.on_close(self._abort_on_close or "the coordinator stopped")
        ):
            # Give the Abort frames a moment to leave before the socket closes.
            self._close_linger_ms = 500

    def _handle(self, batch: list[list[bytes]]) -> None:
        """What arrived together is answered together (one state per member)."""
        self._deliver(self.core.on_frame_batch(batch, time.monotonic()))

    def _deliver(self, sends: list[Send]) -> bool:
        """Send what the core said, then report its failure if it just failed."""
        for route, msg in sends:
            try:  # noqa: SIM105 - every grant to every rank: no suppress() per send
                self._sock.send_multipart(
                    [route, *seal(self._secret, TO_PARTICIPANT, msg)], zmq.NOBLOCK
                )
            except zmq.ZMQError:
                pass  # peer gone or its queue full; the next state heals it
        if self.core.failed is not None:
            self._fail_once(self.core.failed, "step sync coordinator")
        return bool(sends)
