"""Step sync's options (one row per key, checked with the shared parsers of
``vllm_disagg.options``) and timing constants."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from vllm_disagg.errors import ConfigError
from vllm_disagg.options import parsers, tables
from vllm_disagg.options.rows import Option, by_key, parse_rows

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
MAX_LOOKAHEAD = 1024
MAX_DP_SIZE = 1 << 16
COORDINATOR_HOSTS = ("auto", "thread", "process")
# From this DP size, `auto` runs the coordinator in a process of its own and
# grants a longer lease. The coordinator's messages grow with N and its CPU with
# them: in the scale model (benchmarks/results/step_sync_scale-coordinator.md)
# lookahead 8 and the coordinator's own process were at or above the thread with
# lookahead 2 from DP = 32 on every figure (pass rate, grant wait, rank 0's pace),
# with known-length drains still wasting no pass. The price of the longer lease:
# work that ends by EOS can leave up to 7 dummy passes when a group goes idle.
LARGE_GROUP_FROM_DP = 32
SMALL_GROUP_LOOKAHEAD = 2
LARGE_GROUP_LOOKAHEAD = 8


def parse_lookahead(key: str, value) -> int | str:
    """An integer in 1..MAX_LOOKAHEAD, or ``auto`` (resolved by the DP size)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return parsers.integer(key, value, 1, MAX_LOOKAHEAD)
    except ConfigError:
        raise parsers.refuse(
            key, value, f"an integer in 1..{MAX_LOOKAHEAD} or auto"
        ) from None


# One row per option key (vllm_disagg.options.rows.Option).
OPTIONS: tuple[Option, ...] = (
    Option(
        "step_sync_lookahead",
        "integer or `auto`",
        "auto",
        lambda key, value: parse_lookahead(key, value),
        "steps a rank asks the coordinator to grant ahead of its pass (it renews "
        "when fewer than half remain); every rank of a DP group needs the same; "
        f"`auto`: {SMALL_GROUP_LOOKAHEAD} below DP = {LARGE_GROUP_FROM_DP}, "
        f"{LARGE_GROUP_LOOKAHEAD} from it",
        f"< 1, > {MAX_LOOKAHEAD}, anything but an integer or auto",
        field="lookahead",
    ),
    Option(
        "step_sync_peer_timeout_s",
        "seconds",
        30.0,
        lambda key, value: parsers.seconds(key, value, 0.1, 3600.0),
        "how long the ranks of a DP group wait for a silent rank before they fail "
        "(heartbeats every fifth of it)",
        "< 0.1, > 3600",
        field="peer_timeout_s",
    ),
    Option(
        "step_sync_coordinator",
        "string",
        "auto",
        lambda key, value: parsers.choice(key, value, COORDINATOR_HOSTS),
        "where DP rank 0 runs the coordinator: `thread` (in its engine process), "
        "`process` (a child process with an interpreter of its own), `auto` "
        f"(process from DP = {LARGE_GROUP_FROM_DP})",
        f"anything but {', '.join(COORDINATOR_HOSTS)}",
        field="coordinator",
    ),
)
OPTION = by_key(OPTIONS)
# --additional-config key -> StepSyncConfig field.
OPTION_KEYS = {option.key: option.name for option in OPTIONS}


@dataclass(frozen=True)
class StepSyncConfig:
    dp_size: int
    # An int once constructed: ``auto`` is resolved by ``dp_size``.
    lookahead: int = OPTION["step_sync_lookahead"].default
    peer_timeout_s: float = OPTION["step_sync_peer_timeout_s"].default
    coordinator: str = OPTION["step_sync_coordinator"].default

    def __post_init__(self):
        parsers.integer("dp_size", self.dp_size, 1, MAX_DP_SIZE)
        given = {
            "lookahead": self.lookahead,
            "peer_timeout_s": self.peer_timeout_s,
            "coordinator": self.coordinator,
        }
        for name, value in parse_rows(
            OPTIONS, given, lambda key: key, by_field=True
        ).items():
            object.__setattr__(self, name, value)
        if self.lookahead == "auto":
            large = self.dp_size >= LARGE_GROUP_FROM_DP
            object.__setattr__(
                self,
                "lookahead",
                LARGE_GROUP_LOOKAHEAD if large else SMALL_GROUP_LOOKAHEAD,
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
        given = {key: options[key] for key in OPTION_KEYS if key in options}
        return cls(dp_size, **parse_rows(OPTIONS, given, str, by_field=False))

    @property
    def coordinator_in_process(self) -> bool:
        """Whether rank 0 runs the coordinator in a child process."""
        if self.coordinator == "auto":
            return self.dp_size >= LARGE_GROUP_FROM_DP
        return self.coordinator == "process"

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


# --- docs/step_sync.md's options table, rendered from OPTIONS ---------------------

DOC_BEGIN, DOC_END = tables.markers(
    "step sync options", "OPTIONS in vllm_disagg/v1/engine/step_sync/config.py"
)
DOC_TABLE = tables.DocTable(
    DOC_BEGIN, DOC_END, lambda: tables.markdown_table(OPTIONS, tables.KEY_COLUMNS)
)
