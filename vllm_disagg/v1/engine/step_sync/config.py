"""Step sync's options and timing constants."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from vllm_disagg.errors import ConfigError

SECRET_BYTES = 32
# Heartbeats per peer_timeout_s; a peer must miss several before it is dead.
HEARTBEATS_PER_TIMEOUT = 5
# How often unacknowledged state (or a request still ungranted) is re-sent.
RESEND_INTERVAL_S = 0.1
# Longest the engine thread waits for a grant it asked for (see
# Participant._await_grant). Normally one loopback round trip, well under 1 ms.
MAX_GRANT_WAIT_S = 0.02
# At most one log line per kind of rejected frame per this many seconds.
REJECT_LOG_INTERVAL_S = 10.0
# How long close() waits for the coordinator to acknowledge a final state.
FLUSH_TIMEOUT_S = 2.0


# --additional-config key -> StepSyncConfig field.
OPTION_KEYS = {
    "step_sync_lookahead": "lookahead",
    "step_sync_peer_timeout_s": "peer_timeout_s",
}


@dataclass(frozen=True)
class StepSyncConfig:
    dp_size: int
    lookahead: int = 2
    peer_timeout_s: float = 30.0

    def __post_init__(self):
        if not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ConfigError(
                f"step sync: dp_size must be an integer >= 1, got {self.dp_size!r}"
            )
        if not isinstance(self.lookahead, int) or not 1 <= self.lookahead <= 1024:
            raise ConfigError(
                "step_sync_lookahead must be an integer in [1, 1024], got "
                f"{self.lookahead!r}"
            )
        timeout = self.peer_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not (0.1 <= timeout <= 3600)
        ):
            raise ConfigError(
                "step_sync_peer_timeout_s must be a number of seconds in [0.1, 3600], "
                f"got {self.peer_timeout_s!r}"
            )

    @classmethod
    def from_additional_config(
        cls, additional_config: object, dp_size: int
    ) -> StepSyncConfig:
        """Read the engine options from ``--additional-config`` (JSON)."""
        options = additional_config if isinstance(additional_config, dict) else {}
        unknown = sorted(
            k for k in options if k.startswith("step_sync") and k not in OPTION_KEYS
        )
        if unknown:
            raise ConfigError(
                f"unknown --additional-config key {unknown[0]!r}; "
                f"step sync options are {', '.join(OPTION_KEYS)}"
            )
        kwargs = {
            field: options[key] for key, field in OPTION_KEYS.items() if key in options
        }
        return cls(dp_size, **kwargs)

    @property
    def heartbeat_interval_s(self) -> float:
        return self.peer_timeout_s / HEARTBEATS_PER_TIMEOUT

    @property
    def resend_interval_s(self) -> float:
        return min(RESEND_INTERVAL_S, self.heartbeat_interval_s)

    @property
    def renew_margin(self) -> int:
        """Renew the lease when fewer than this many granted steps remain."""
        return (self.lookahead + 1) // 2


def new_group_secret() -> bytes:
    """A fresh random secret for one DP group (credentials.py says who holds it)."""
    return secrets.token_bytes(SECRET_BYTES)
