"""The router's configuration: one frozen dataclass checked by the flag rows.

Each field but ``local_cookie`` is a row of :data:`~vllm_disagg.router.flags.OPTIONS`
(``flags.py``: parser, default, help, docs table); argparse is built from the
same rows. The dataclass validates itself with them, so a config built in code
(tests, an embedding program) is checked exactly like one parsed from the
command line, with one-line errors that name the flag and the allowed values.
Here too: where the registration token comes from (:class:`RouterCredentials`).
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field
from typing import NamedTuple

from vllm_disagg import envs
from vllm_disagg.options.rows import add_arguments, from_namespace, parse_rows

# StaticInstance: users who build a config in code name it from here.
from vllm_disagg.router.flags import OPTION, OPTIONS, StaticInstance
from vllm_disagg.wire.cookie import ROUTER_TOKEN, CookieError, load_cookie


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
    """The router's configuration; each field but ``local_cookie`` is a row of
    :data:`OPTIONS`, which gives its default and checks it."""

    host: str = OPTION["host"].default
    port: int = OPTION["port"].default
    discovery_host: str = OPTION["discovery_host"].default
    discovery_port: int = OPTION["discovery_port"].default
    policy_prefill: str = OPTION["policy_prefill"].default
    policy_decode: str = OPTION["policy_decode"].default
    handoff: str = OPTION["handoff"].default
    heartbeat_timeout_s: float = OPTION["heartbeat_timeout_s"].default
    stall_timeout_s: float = OPTION["stall_timeout_s"].default
    connect_timeout_s: float = OPTION["connect_timeout_s"].default
    prefill_timeout_s: float = OPTION["prefill_timeout_s"].default
    first_token_timeout_s: float = OPTION["first_token_timeout_s"].default
    chunk_timeout_s: float = OPTION["chunk_timeout_s"].default
    request_timeout_s: float = OPTION["request_timeout_s"].default
    max_retries: int = OPTION["max_retries"].default
    max_migrations: int = OPTION["max_migrations"].default
    breaker_failures: int = OPTION["breaker_failures"].default
    breaker_cooldown_s: float = OPTION["breaker_cooldown_s"].default
    fallback_to_decode_prefill: bool = OPTION["fallback_to_decode_prefill"].default
    max_body_bytes: int = OPTION["max_body_bytes"].default
    max_header_bytes: int = OPTION["max_header_bytes"].default
    max_connections: int = OPTION["max_connections"].default
    client_header_timeout_s: float = OPTION["client_header_timeout_s"].default
    client_idle_timeout_s: float = OPTION["client_idle_timeout_s"].default
    client_body_timeout_s: float = OPTION["client_body_timeout_s"].default
    prefix_index_max_entries: int = OPTION["prefix_index_max_entries"].default
    prefix_chunk_chars: int = OPTION["prefix_chunk_chars"].default
    prefix_balance_threshold: int = OPTION["prefix_balance_threshold"].default
    # Selective disaggregation: a prompt whose uncached part is shorter than
    # this many tokens goes to the decode alone (0: never; see selective.py).
    decode_alone_below_tokens: int = OPTION["decode_alone_below_tokens"].default
    # The router's token estimate for text.
    prompt_bytes_per_token: float = OPTION["prompt_bytes_per_token"].default
    # Kept out of repr: a token must not end up in a log line.
    registration_token: str | None = field(default=None, repr=False)
    # Without a token, accept registrations from other machines too.
    insecure_discovery: bool = OPTION["insecure_discovery"].default
    # Without a token (and without insecure_discovery): use this user's local
    # cookie (wire/cookie.py) as the token, registrations from loopback only.
    # Not a flag: a token, given or found, is what the fleet needs; code that
    # builds a router without any (tests) turns it off.
    local_cookie: bool = True
    static_prefill: tuple[StaticInstance, ...] = OPTION["static_prefill"].default
    static_decode: tuple[StaticInstance, ...] = OPTION["static_decode"].default
    log_level: str = OPTION["log_level"].default
    http_server: str = OPTION["http_server"].default
    workers: int = OPTION["workers"].default

    def __post_init__(self) -> None:
        given = {option.name: getattr(self, option.name) for option in OPTIONS}
        parsed = parse_rows(OPTIONS, given, lambda key: OPTION[key].flag, by_field=True)
        for name, value in parsed.items():
            object.__setattr__(self, name, value)

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
        """The router's flags, one per row of :data:`OPTIONS`, in argument
        groups; values are checked by the dataclass (one wording)."""
        return add_arguments(parser, OPTIONS)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RouterConfig:
        return cls(**from_namespace(OPTIONS, args))
