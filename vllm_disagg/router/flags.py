"""The router's flags: one row per flag (:data:`OPTIONS`) and docs/router.md's table.

Each row (``vllm_disagg.options.rows.Option``) gives one flag its parser, its
default, its help, its argument group and its line in the flags table; argparse
is built from the rows. What a flag may hold lives here, with the value types
its parsers make (:class:`StaticInstance`); the frozen
:class:`~vllm_disagg.router.config.RouterConfig` built from the rows, and the
credentials it resolves, are ``config.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm_disagg import envs
from vllm_disagg.errors import ConfigError
from vllm_disagg.options import parsers, tables
from vllm_disagg.options.rows import Option, Parser, by_key
from vllm_disagg.router.policy import policy_names
from vllm_disagg.wire.discovery import (
    DEFAULT_DISCOVERY_PORT,
    DEFAULT_HTTP_PORT,
    MAX_MODEL_CHARS,
    Role,
)
from vllm_disagg.wire.peers import PeerInfoError, split_addr

PREFILL_POLICIES = policy_names(Role.PREFILL)
DECODE_POLICIES = policy_names(Role.DECODE)
HANDOFFS = ("sequential", "concurrent")
HTTP_SERVERS = ("uvicorn", "hypercorn")
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_RETRIES = 10


@dataclass(frozen=True)
class StaticInstance:
    """An instance named on the command line instead of registering itself."""

    http_addr: str
    kv_addr: str
    model: str | None = None

    @classmethod
    def parse(cls, flag: str, spec: str) -> StaticInstance:
        """``HTTP_ADDR,KV_ADDR[,MODEL]``, e.g. ``10.0.1.2:20001,10.0.1.2:21001``."""
        parts = spec.split(",")
        if len(parts) not in (2, 3):
            raise parsers.refuse(flag, spec, "HTTP_ADDR,KV_ADDR[,MODEL]")
        for part, what in zip(parts, ("HTTP_ADDR", "KV_ADDR")):
            try:
                split_addr(part, f"{flag} {what}")
            except PeerInfoError as e:
                raise ConfigError(str(e)) from None
        model = parts[2] if len(parts) == 3 else None
        if model is not None and not 0 < len(model) <= MAX_MODEL_CHARS:
            raise parsers.refuse(
                flag, model, f"a MODEL of 1..{MAX_MODEL_CHARS} characters"
            )
        return cls(parts[0], parts[1], model)


def _static(flag: str, value: Any) -> tuple[StaticInstance, ...]:
    """``--static-prefill`` / ``--static-decode``: specs, or instances."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise parsers.refuse(flag, value, "a list of HTTP_ADDR,KV_ADDR[,MODEL]")
    return tuple(
        item if isinstance(item, StaticInstance) else StaticInstance.parse(flag, item)
        for item in value
    )


def _token(flag: str, value: Any) -> str:
    if not isinstance(value, str):
        raise parsers.refuse(flag, value, "a string")
    if not value:
        raise ConfigError(f"{flag}: must not be empty (leave it unset instead)")
    return value


def _choice(choices: tuple[str, ...]) -> Parser:
    """One of ``choices``, any case, ``-`` for ``_`` (``prefix-aware``)."""

    def parse(flag: str, value: Any) -> str:
        text = value.replace("-", "_") if isinstance(value, str) else value
        try:
            return parsers.choice(flag, text, choices)
        except ConfigError:
            raise parsers.refuse(flag, value, f"one of {', '.join(choices)}") from None

    return parse


def _int_in(low: int, high: int) -> Parser:
    return lambda flag, value: parsers.integer(flag, value, low, high)


def _number_in(low: float, high: float) -> Parser:
    """A finite int or float (not a bool, not a string) in ``low..high``."""

    def parse(flag: str, value: Any) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or not low <= value <= high
        ):
            raise parsers.refuse(flag, value, f"a number in {low:g}..{high:g}")
        return value

    return parse


def _listen_port(flag: str, value: Any) -> int:
    return parsers.port(flag, value, any_free=True)


def _seconds(name: str, default: float, help_text: str) -> Option:
    return Option(name, "seconds", default, parsers.seconds, help_text, group=_FAILURES)


MAX_WORKERS = 64
_LISTENING = "listening"
_SELECTION = "selection"
_FAILURES = "timeouts and failures"
_SECURITY = "security and limits"

OPTIONS: tuple[Option, ...] = (
    Option(
        "host",
        "host",
        "0.0.0.0",
        parsers.host,
        "HTTP address for clients",
        group=_LISTENING,
    ),
    Option(
        "port",
        "port",
        DEFAULT_HTTP_PORT,
        _listen_port,
        "HTTP port for clients; `0` picks a free one (logged)",
        group=_LISTENING,
    ),
    Option(
        "discovery_host",
        "host",
        "0.0.0.0",
        parsers.host,
        "service-discovery address",
        group=_LISTENING,
    ),
    Option(
        "discovery_port",
        "port",
        DEFAULT_DISCOVERY_PORT,
        _listen_port,
        "service-discovery (ZMQ) port, the instances' `proxy_port`; `0` picks a "
        "free one (logged)",
        group=_LISTENING,
    ),
    Option(
        "policy_prefill",
        "choice",
        "round_robin",
        _choice(PREFILL_POLICIES),
        f'one of {", ".join(PREFILL_POLICIES)} (see "Selection policies")',
        group=_SELECTION,
    ),
    Option(
        "policy_decode",
        "choice",
        "round_robin",
        _choice(DECODE_POLICIES),
        f'one of {", ".join(DECODE_POLICIES)} (see "Selection policies")',
        group=_SELECTION,
    ),
    Option(
        "handoff",
        "choice",
        "sequential",
        _choice(HANDOFFS),
        "`sequential`: D is sent the request when P has answered; `concurrent`: "
        "P and D at once, D waits for the KV",
        group=_SELECTION,
    ),
    Option(
        "prefix_index_max_entries",
        "integer",
        65536,
        _int_in(1, 1 << 26),
        "`prefix_aware`: chunk hashes kept (LRU)",
        group=_SELECTION,
    ),
    Option(
        "prefix_chunk_chars",
        "integer",
        256,
        _int_in(16, 1 << 20),
        "`prefix_aware`: characters per hashed chunk",
        group=_SELECTION,
    ),
    Option(
        "prefix_balance_threshold",
        "integer",
        16,
        _int_in(0, 1 << 20),
        "`prefix_aware`: skip the prefix holder when it has more than this many "
        "requests in flight above the least loaded P",
        group=_SELECTION,
    ),
    Option(
        "decode_alone_below_tokens",
        "integer",
        0,
        _int_in(0, 1 << 24),
        "selective disaggregation: a prompt whose part the chosen D has not cached "
        "is shorter than this many tokens (estimated) goes to the D alone, no "
        'prefill leg (see "Selective disaggregation"); `0`: off',
        group=_SELECTION,
    ),
    Option(
        "prompt_bytes_per_token",
        "number",
        4.0,
        _number_in(0.5, 64),
        "the router's token estimate for text prompts: UTF-8 bytes per token "
        "(token-id prompts are counted exactly); 0.5 to 64",
        group=_SELECTION,
    ),
    _seconds(
        "heartbeat_timeout_s",
        10.0,
        "remove an instance silent this long (and at least 3 of its announced "
        "heartbeat intervals)",
    ),
    _seconds(
        "stall_timeout_s",
        20.0,
        "take an instance out of rotation (and end its prefill legs, retried "
        "elsewhere) while its heartbeats say its engine has held requests this "
        "long without a step; it is routed to again once it steps; set it above "
        "your longest single forward pass",
    ),
    _seconds("connect_timeout_s", 5.0, "TCP connect to an instance"),
    _seconds("prefill_timeout_s", 300.0, "one prefill request, whole"),
    _seconds(
        "first_token_timeout_s",
        300.0,
        "streaming: from sending D the request to its first chunk (KV wait + "
        "first token)",
    ),
    _seconds("chunk_timeout_s", 60.0, "streaming: between two chunks of D's answer"),
    _seconds(
        "request_timeout_s",
        600.0,
        "the whole request: every leg, every retry; nothing outlives it",
    ),
    Option(
        "max_retries",
        "integer",
        2,
        _int_in(0, MAX_RETRIES),
        "prefill attempts repeated on other P instances, before anything reached "
        "the client",
        group=_FAILURES,
    ),
    Option(
        "max_migrations",
        "integer",
        2,
        _int_in(0, MAX_RETRIES),
        "times one request may move to another (P, D) pair when its D fails (a "
        'stream continues where it stopped; see "Migration"); `0`: never, a failed '
        "D ends the request",
        group=_FAILURES,
    ),
    Option(
        "breaker_failures",
        "integer",
        3,
        _int_in(1, 1000),
        "consecutive failures that open an instance's circuit breaker",
        group=_FAILURES,
    ),
    _seconds(
        "breaker_cooldown_s",
        10.0,
        "how long an open breaker keeps the instance out before one trial request",
    ),
    _seconds(
        "client_header_timeout_s",
        10.0,
        "a client's request line and headers, from its connection or the "
        "request's first byte",
    ),
    _seconds(
        "client_idle_timeout_s",
        30.0,
        "a client's request body, or its reading of a streamed answer, may "
        "stall this long before the connection is dropped",
    ),
    _seconds(
        "client_body_timeout_s",
        60.0,
        "a client's request body must be whole this long after its headers",
    ),
    Option(
        "fallback_to_decode_prefill",
        "switch",
        False,
        parsers.boolean,
        "with no P available or all P attempts failed, D prefills the request "
        "itself (counted in /metrics); off: 503/502",
        group=_FAILURES,
    ),
    Option(
        "max_body_bytes",
        "integer",
        32 << 20,
        _int_in(1024, 1 << 34),
        "largest accepted request body; larger ones get 413",
        group=_SECURITY,
    ),
    Option(
        "max_header_bytes",
        "integer",
        64 << 10,
        _int_in(1024, 1 << 24),
        "largest request line and headers; larger ones get 431",
        group=_SECURITY,
    ),
    Option(
        "max_connections",
        "integer",
        4096,
        _int_in(1, 1 << 20),
        "open client connections; one more is answered 503 and closed (the "
        "file-descriptor limit is raised to fit them and their upstream legs)",
        group=_SECURITY,
    ),
    Option(
        "registration_token",
        "string",
        None,
        _token,
        "shared discovery token instances sign registrations with; prefer "
        f"`{envs.VLLM_DISAGG_ROUTER_TOKEN}` (a flag shows in `ps`)",
        group=_SECURITY,
    ),
    Option(
        "insecure_discovery",
        "switch",
        False,
        parsers.boolean,
        "without a registration token, accept registrations from other machines "
        "too (default: loopback only)",
        group=_SECURITY,
    ),
    Option(
        "static_prefill",
        "list",
        (),
        _static,
        "`HTTP_ADDR,KV_ADDR[,MODEL]`, one or more: prefill instances that do not "
        "register",
        group=_SECURITY,
        metavar="HTTP,KV[,MODEL]",
        nargs="+",
    ),
    Option(
        "static_decode",
        "list",
        (),
        _static,
        "the same for decode instances",
        group=_SECURITY,
        metavar="HTTP,KV[,MODEL]",
        nargs="+",
    ),
    Option(
        "log_level",
        "choice",
        "info",
        _choice(LOG_LEVELS),
        f"one of {', '.join(LOG_LEVELS)}",
    ),
    Option(
        "http_server",
        "choice",
        "uvicorn",
        _choice(HTTP_SERVERS),
        f"the ASGI server of the HTTP front end, one of {', '.join(HTTP_SERVERS)} "
        "(uvicorn costs less CPU per request, see benchmarks/results/router.md)",
    ),
    Option(
        "workers",
        "integer",
        1,
        _int_in(1, MAX_WORKERS),
        "router processes sharing the HTTP port, each on its own core; the "
        "process started keeps discovery and hands every worker the whole fleet, "
        'but each balances on its own requests only (see "Workers")',
    ),
)
OPTION = by_key(OPTIONS)


# --- docs/router.md's flags table, rendered from OPTIONS ---------------------------


def _shown_default(option: Option) -> str:
    value = option.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "unset"
    if value == ():
        return "none"
    return f"`{tables.shown_default(option)}`"


FLAG_COLUMNS: tuple[tables.Column, ...] = (
    ("flag", lambda o: f"`{o.flag}`"),
    ("default", _shown_default),
    ("meaning", lambda o: o.help),
)
DOC_BEGIN, DOC_END = tables.markers(
    "router flags", "OPTIONS in vllm_disagg/router/flags.py"
)
DOC_TABLE = tables.DocTable(
    DOC_BEGIN, DOC_END, lambda: tables.markdown_table(OPTIONS, FLAG_COLUMNS)
)
