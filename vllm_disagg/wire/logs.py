"""Log lines that a misbehaving peer or a failing fleet cannot flood.

One helper for every component that logs what strangers can trigger (the
router, discovery, the P2P engine, step sync, registration): at most one
warning per kind per interval, and the next one says how many were held back
in between. Thread-safe; dependency-free like the rest of ``wire/``.
"""

from __future__ import annotations

import logging
import threading
import time

DEFAULT_INTERVAL_S = 10.0


class RateLimitedLog:
    def __init__(
        self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._next_at: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: object, **kwargs: object) -> bool:
        """Log ``message % args`` unless ``kind`` was logged within the
        interval; True when it was logged. ``kwargs`` go to the logger
        (``exc_info``)."""
        now = time.monotonic()
        with self._lock:
            if now < self._next_at.get(kind, now):
                self._held[kind] = self._held.get(kind, 0) + 1
                return False
            self._next_at[kind] = now + self._interval_s
            held = self._held.pop(kind, 0)
        if held:
            message += f" ({held} more since the last report)"
        self._logger.warning(message, *args, **kwargs)
        return True
