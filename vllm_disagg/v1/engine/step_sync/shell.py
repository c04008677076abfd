"""What both shells share: ZMQ sockets, one network thread, a failure reported once."""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq
from vllm.utils.network_utils import is_valid_ipv6_address, split_zmq_path

from vllm_disagg.logger import init_logger
from vllm_disagg.v1.engine.step_sync.messages import MAX_MESSAGE_BYTES

logger = init_logger(__name__)


def new_socket(kind: int, address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    _, host, _ = split_zmq_path(address)
    if is_valid_ipv6_address(host):
        sock.setsockopt(zmq.IPV6, 1)
    return sock


class NetworkThread:
    """One background thread that owns the sockets and moves bytes between them and a
    protocol core, a stop flag, and the core's failure reported at most once."""

    def __init__(self, thread_name: str, on_failure: Callable[[str], None]):
        self.on_failure = on_failure
        self._stop = threading.Event()
        self._failed: str | None = None
        self._sockets: list[zmq.Socket] = []
        # How long close() lets queued frames (a final Abort) go out.
        self._close_linger_ms = 0
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    @property
    def failure(self) -> str | None:
        """The failure reported, if any."""
        return self._failed

    def start(self):
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        for sock in self._sockets:
            sock.close(linger=self._close_linger_ms)

    def _fail_once(self, reason: str, log_prefix: str) -> bool:
        """Log and report ``reason`` unless a failure was already reported."""
        if self._failed is not None:
            return False
        self._failed = reason
        logger.error("%s: %s", log_prefix, reason)
        self.on_failure(reason)
        return True
