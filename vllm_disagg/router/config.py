"""The router's options: one frozen dataclass, its command-line flags, and
one-line errors that name the flag and the allowed values.

The dataclass validates itself, so a config built in code (tests, an
embedding program) is checked exactly like one parsed from the command line.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from vllm_disagg import envs
from vllm_disagg.errors import ConfigError
from vllm_disagg.router.policy import policy_names
from vllm_disagg.wire.cookie import ROUTER_TOKEN, CookieError, load_cookie
from vllm_disagg.wire.discovery import (
    DEFAULT_DISCOVERY_PORT,
    DEFAULT_HTTP_PORT,
    MAX_MODEL_CHARS,
    Role,
)
from vllm_disagg.wire.peers import (
    PeerInfoError,
    split_addr,
)

PREFILL_POLICIES = policy_names(Role.PREFILL)
DECODE_POLICIES = policy_names(Role.DECODE)
HANDOFFS = ("sequential", "concurrent")
HTTP_SERVERS = ("uvicorn", "hypercorn")
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_TIMEOUT_S = 86400.0
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
            raise ConfigError(f"{flag}: {spec!r} is not HTTP_ADDR,KV_ADDR[,MODEL]")
        for part, what in zip(parts, ("HTTP_ADDR", "KV_ADDR")):
            try:
                split_addr(part, f"{flag} {what}")
            except PeerInfoError as e:
                raise ConfigError(str(e)) from None
        model = parts[2] if len(parts) == 3 else None
        if model is not None and not 0 < len(model) <= MAX_MODEL_CHARS:
            raise ConfigError(f"{flag}: MODEL must be 1..{MAX_MODEL_CHARS} characters")
        return cls(parts[0], parts[1], model)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class RouterCredentials(NamedTuple):
    token: bytes | None
    source: str  # for the log: the flag, the variable, the cookie's path
    # The local cookie: only this user's processes on this host have it, so
    # discovery takes registrations from loopback only, as without a token.
    local: bool = False
    cookie_problem: str = ""  # why the local cookie was refused, if it was

    def __repr__(self) -> str:  # never the token
        return f"RouterCredentials(source={self.source!r}, local={self.local})"


@dataclass(frozen=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = DEFAULT_HTTP_PORT
    discovery_host: str = "0.0.0.0"
    discovery_port: int = DEFAULT_DISCOVERY_PORT
    policy_prefill: str = "round_robin"
    policy_decode: str = "round_robin"
    handoff: str = "sequential"
    heartbeat_timeout_s: float = 10.0
    stall_timeout_s: float = 20.0
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0
    first_token_timeout_s: float = 300.0
    chunk_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    max_retries: int = 2
    max_migrations: int = 2
    breaker_failures: int = 3
    breaker_cooldown_s: float = 10.0
    fallback_to_decode_prefill: bool = False
    max_body_bytes: int = 32 << 20
    max_header_bytes: int = 64 << 10
    max_connections: int = 4096
    client_header_timeout_s: float = 10.0
    client_idle_timeout_s: float = 30.0
    client_body_timeout_s: float = 60.0
    prefix_index_max_entries: int = 65536
    prefix_chunk_chars: int = 256
    prefix_balance_threshold: int = 16
    # Selective disaggregation: a prompt whose uncached part is shorter than
    # this many tokens goes to the decode alone (0: never; see selective.py).
    decode_alone_below_tokens: int = 0
    prompt_bytes_per_token: float = 4.0  # the router's token estimate for text
    # Kept out of repr: a token must not end up in a log line.
    registration_token: str | None = field(default=None, repr=False)
    # Without a token, accept registrations from other machines too.
    insecure_discovery: bool = False
    # Without a token (and without insecure_discovery): use this user's local
    # cookie (wire/cookie.py) as the token, registrations from loopback only.
    # Not a flag: a token, given or found, is what the fleet needs; code that
    # builds a router without any (tests) turns it off.
    local_cookie: bool = True
    static_prefill: tuple[StaticInstance, ...] = ()
    static_decode: tuple[StaticInstance, ...] = ()
    log_level: str = "info"
    http_server: str = "uvicorn"

    def __post_init__(self) -> None:
        for name in ("port", "discovery_port"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= 65535
            ):
                raise ConfigError(
                    f"{_flag(name)}: {value!r} is not a port (0..65535, 0: any free "
                    "port)"
                )
        for name in ("host", "discovery_host"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"{_flag(name)}: an address to listen on is required")
        self._choice("policy_prefill", PREFILL_POLICIES)
        self._choice("policy_decode", DECODE_POLICIES)
        self._choice("handoff", HANDOFFS)
        self._choice("log_level", LOG_LEVELS)
        self._choice("http_server", HTTP_SERVERS)
        for f in fields(self):
            if f.name.endswith("_s"):
                value = getattr(self, f.name)
                if not (
                    isinstance(value, int | float)
                    and math.isfinite(value)
                    and 0 < value <= MAX_TIMEOUT_S
                ):
                    raise ConfigError(
                        f"{_flag(f.name)}: {value!r} is not a number of seconds "
                        f"(> 0 and <= {MAX_TIMEOUT_S:.0f})"
                    )
        self._int_range("max_retries", 0, MAX_RETRIES)
        self._int_range("max_migrations", 0, MAX_RETRIES)
        self._int_range("breaker_failures", 1, 1000)
        self._int_range("max_body_bytes", 1024, 1 << 34)
        self._int_range("max_header_bytes", 1024, 1 << 24)
        self._int_range("max_connections", 1, 1 << 20)
        self._int_range("prefix_index_max_entries", 1, 1 << 26)
        self._int_range("prefix_chunk_chars", 16, 1 << 20)
        self._int_range("prefix_balance_threshold", 0, 1 << 20)
        self._int_range("decode_alone_below_tokens", 0, 1 << 24)
        ratio = self.prompt_bytes_per_token
        if not (
            isinstance(ratio, int | float)
            and not isinstance(ratio, bool)
            and math.isfinite(ratio)
            and 0.5 <= ratio <= 64
        ):
            raise ConfigError(
                f"--prompt-bytes-per-token: {ratio!r} is not a number in 0.5..64"
            )
        if self.registration_token is not None and not self.registration_token:
            raise ConfigError(
                "--registration-token: must not be empty (leave it unset instead)"
            )

    def _choice(self, name: str, allowed: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in allowed:
            raise ConfigError(
                f"{_flag(name)}: {value!r} is not one of {', '.join(allowed)}"
            )

    def _int_range(self, name: str, low: int, high: int) -> None:
        value = getattr(self, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not low <= value <= high
        ):
            raise ConfigError(
                f"{_flag(name)}: {value!r} is not an integer in {low}..{high}"
            )

    @functools.cached_property
    def credentials(self) -> RouterCredentials:
        """The registration token and where it came from: the flag, else the
        environment's VLLM_DISAGG_ROUTER_TOKEN, else this user's local cookie
        (created if there is none yet; see ``local_cookie``), else none (a
        cookie file that is not this user's alone is refused: no token, and
        the reason in ``cookie_problem``)."""
        if self.registration_token:
            return RouterCredentials(
                self.registration_token.encode(), "--registration-token"
            )
        token = envs.router_token()
        if token is not None:
            return RouterCredentials(token, envs.VLLM_DISAGG_ROUTER_TOKEN)
        if not self.local_cookie or self.insecure_discovery:
            return RouterCredentials(None, "nowhere")
        try:
            cookie = load_cookie()
        except CookieError as e:
            # Refused (one line in the start-up warning); the router runs as
            # it did without a token.
            return RouterCredentials(None, "nowhere", cookie_problem=str(e))
        return RouterCredentials(cookie.key(ROUTER_TOKEN), cookie.describe(), True)

    @property
    def token(self) -> bytes | None:
        """The registration token as bytes (:attr:`credentials`)."""
        return self.credentials.token

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """The router's flags, one argument group each, defaults from the
        dataclass."""
        defaults = RouterConfig()
        for add_group in (
            _add_listening_args,
            _add_selection_args,
            _add_failure_args,
            _add_security_args,
            _add_process_args,
        ):
            add_group(parser, defaults)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RouterConfig:
        values: dict[str, Any] = {
            f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)
        }
        for name in ("static_prefill", "static_decode"):
            values[name] = tuple(
                StaticInstance.parse(_flag(name), s) for s in values[name]
            )
        for name in (
            "policy_prefill",
            "policy_decode",
            "handoff",
            "log_level",
            "http_server",
        ):
            values[name] = values[name].lower().replace("-", "_")
        return cls(**values)


def _add_listening_args(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Where the router listens."""
    net = parser.add_argument_group("listening")
    net.add_argument(
        "--host", default=d.host, help="HTTP address (default %(default)s)"
    )
    net.add_argument(
        "--port",
        type=int,
        default=d.port,
        help="HTTP port for clients; 0 picks a free one (default %(default)s)",
    )
    net.add_argument(
        "--discovery-host",
        default=d.discovery_host,
        help="service-discovery address (default %(default)s)",
    )
    net.add_argument(
        "--discovery-port",
        type=int,
        default=d.discovery_port,
        help="service-discovery (ZMQ) port the instances' proxy_port "
        "names; 0 picks a free one (default %(default)s)",
    )


def _add_selection_args(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Which instances get a request, and the hand-off."""
    sel = parser.add_argument_group("selection")
    sel.add_argument(
        "--policy-prefill",
        default=d.policy_prefill,
        help=f"one of {', '.join(PREFILL_POLICIES)} (default %(default)s)",
    )
    sel.add_argument(
        "--policy-decode",
        default=d.policy_decode,
        help=f"one of {', '.join(DECODE_POLICIES)} (default %(default)s)",
    )
    sel.add_argument(
        "--handoff",
        default=d.handoff,
        help="sequential: decode starts when prefill answered; concurrent: "
        "both at once, decode waits for the KV (default %(default)s)",
    )
    sel.add_argument(
        "--prefix-index-max-entries",
        type=int,
        default=d.prefix_index_max_entries,
        help="prefix_aware: chunk hashes kept, LRU (default %(default)s)",
    )
    sel.add_argument(
        "--prefix-chunk-chars",
        type=int,
        default=d.prefix_chunk_chars,
        help="prefix_aware: characters per hashed chunk (default %(default)s)",
    )
    sel.add_argument(
        "--prefix-balance-threshold",
        type=int,
        default=d.prefix_balance_threshold,
        help="prefix_aware: the prefix holder is skipped when it has more than "
        "this many requests in flight above the least loaded prefill "
        "instance (default %(default)s)",
    )
    sel.add_argument(
        "--decode-alone-below-tokens",
        type=int,
        default=d.decode_alone_below_tokens,
        help="selective disaggregation: a prompt whose part the decode has "
        "not cached is shorter than this many tokens (estimated) goes to the "
        "decode alone, no prefill leg; 0: off (default %(default)s)",
    )
    sel.add_argument(
        "--prompt-bytes-per-token",
        type=float,
        default=d.prompt_bytes_per_token,
        help="the router's token estimate for text prompts: UTF-8 bytes per "
        "token (default %(default)s; token-id prompts are counted exactly)",
    )


def _add_failure_args(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Timeouts, retries and the circuit breaker."""
    fail = parser.add_argument_group("timeouts and failures")
    for name, help_text in (
        (
            "heartbeat_timeout_s",
            "remove an instance silent this long (at least 3 of its heartbeat "
            "intervals)",
        ),
        (
            "stall_timeout_s",
            "no new requests (and its prefill legs ended, retried elsewhere) "
            "for an instance whose heartbeats say its engine has held "
            "requests this long without a step; it is routed to again once "
            "it steps",
        ),
        ("connect_timeout_s", "TCP connect to an instance"),
        ("prefill_timeout_s", "the whole prefill request"),
        (
            "first_token_timeout_s",
            "streaming: from sending decode the request to its first chunk (the KV "
            "wait)",
        ),
        ("chunk_timeout_s", "streaming: between two chunks of decode's answer"),
        ("request_timeout_s", "the whole request, every leg and retry included"),
        (
            "breaker_cooldown_s",
            "how long an open circuit breaker keeps an instance out",
        ),
        (
            "client_header_timeout_s",
            "a client's request line and headers, from its "
            "connection or the request's first byte",
        ),
        (
            "client_idle_timeout_s",
            "a client's request body, or its reading of a streamed "
            "answer, may stall this long before the connection is "
            "dropped",
        ),
        (
            "client_body_timeout_s",
            "a client's request body must be whole this long after its headers",
        ),
    ):
        fail.add_argument(
            _flag(name),
            type=float,
            default=getattr(d, name),
            help=f"{help_text} (default %(default)s)",
        )
    fail.add_argument(
        "--max-retries",
        type=int,
        default=d.max_retries,
        help="prefill retries on other instances, before anything reached "
        "the client (default %(default)s)",
    )
    fail.add_argument(
        "--max-migrations",
        type=int,
        default=d.max_migrations,
        help="times one request may move to another prefill/decode pair "
        "when its decode fails (a stream continues where it stopped); 0: "
        "never (default %(default)s)",
    )
    fail.add_argument(
        "--breaker-failures",
        type=int,
        default=d.breaker_failures,
        help="consecutive failures that open an instance's circuit breaker "
        "(default %(default)s)",
    )
    fail.add_argument(
        "--fallback-to-decode-prefill",
        action="store_true",
        help="when no prefill instance is available or all attempts failed, "
        "let the decode instance prefill itself (counted in "
        "/metrics); off: answer 503/502",
    )


def _add_security_args(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Authentication, bounds, instances named by hand."""
    sec = parser.add_argument_group("security and limits")
    sec.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help=(
            "largest accepted request body, larger ones get 413 (default %(default)s)"
        ),
    )
    sec.add_argument(
        "--max-header-bytes",
        type=int,
        default=d.max_header_bytes,
        help=(
            "largest request line and headers, larger ones get 431 (default "
            "%(default)s)"
        ),
    )
    sec.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open client connections; one more is answered 503 and closed "
        "(default %(default)s; the file-descriptor limit is raised to "
        "fit them and their upstream legs)",
    )
    sec.add_argument(
        "--registration-token",
        default=None,
        help="shared token instances sign registrations with; prefer the "
        f"{envs.VLLM_DISAGG_ROUTER_TOKEN} environment variable "
        "(a flag shows in `ps`)",
    )
    sec.add_argument(
        "--insecure-discovery",
        action="store_true",
        help="without a registration token, accept registrations from "
        "other machines too (default: loopback only)",
    )
    sec.add_argument(
        "--static-prefill",
        nargs="+",
        default=[],
        metavar="HTTP,KV[,MODEL]",
        help="prefill instances that do not register themselves",
    )
    sec.add_argument(
        "--static-decode",
        nargs="+",
        default=[],
        metavar="HTTP,KV[,MODEL]",
        help="decode instances that do not register themselves",
    )


def _add_process_args(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Logging and the HTTP server."""
    parser.add_argument(
        "--log-level",
        default=d.log_level,
        help=f"one of {', '.join(LOG_LEVELS)} (default %(default)s)",
    )
    parser.add_argument(
        "--http-server",
        default=d.http_server,
        help=f"ASGI server for the HTTP front end, one of "
        f"{', '.join(HTTP_SERVERS)} (default %(default)s: it costs "
        "less CPU per request, see benchmarks/results/router.md)",
    )
