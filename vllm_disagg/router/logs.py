"""Log lines that a misbehaving peer or a failing fleet cannot flood."""

from __future__ import annotations

import logging
import time
from collections import Counter

INTERVAL_S = 10.0


class LogLimiter:
    """At most one warning per kind per interval; the next one says how many
    were held back in between."""

    def __init__(self, logger: logging.Logger, interval_s: float = INTERVAL_S) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._next_at: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next_at.get(kind, now):
            self._held[kind] += 1
            return
        self._next_at[kind] = now + self._interval_s
        held = self._held.pop(kind, 0)
        if held:
            message += f" ({held} more since the last report)"
        self._logger.warning(message, *args)
