"""The P2P connector's security policy: safe by default, checked at start-up.

An instance whose KV ports are reachable beyond loopback (``kv_ip`` or
``kv_bind_ip`` not loopback) needs the control plane's secret
(``VLLM_DISAGG_P2P_SECRET``) unless ``allow_unauthenticated`` says otherwise,
and something must vouch for the peers a request names: the router's grant
token or the operator's ``allowed_peers`` (:class:`AllowedPeers`). On one host
both come from this user's local cookie (:func:`with_local_cookie`).
``config.py`` reads the options; this module decides what they allow.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_disagg import envs
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.roles import CONNECTOR_NAME
from vllm_disagg.errors import ConfigError
from vllm_disagg.logger import init_logger
from vllm_disagg.options.parsers import host_port, refuse
from vllm_disagg.wire.cookie import P2P_SECRET, ROUTER_TOKEN, CookieError, load_cookie
from vllm_disagg.wire.peers import canonical_host, is_loopback

logger = init_logger(__name__)

_EXTRA = "kv_connector_extra_config"
_warned: set[str] = set()


_ALLOWED_WHAT = (
    "peers: host, host:port ([IPv6]:port) or an IP network (10.0.0.0/8), as a "
    "comma-separated string or a JSON list"
)


@dataclass(frozen=True)
class AllowedPeers:
    """The operator's list of peers a request may name without a router grant."""

    hosts: tuple[tuple[str, int | None], ...] = ()  # canonical host, port or None (any)
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    def allows(self, canonical: tuple[str, int]) -> bool:
        """``canonical``: ``(host, port)`` from ``wire.peers.canonical_addr``."""
        host, port = canonical
        for h, p in self.hosts:
            if h == host and p in (None, port):
                return True
        if self.networks:
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                return False
            return any(ip in net for net in self.networks)
        return False


def parse_allowed_peers(key: str, value: Any) -> AllowedPeers:
    if isinstance(value, AllowedPeers):
        return value
    items = value
    if isinstance(value, str):
        items = [i for i in value.split(",") if i.strip()]
    if not isinstance(items, list | tuple) or not items or len(items) > 4096:
        raise refuse(key, value, f"a list of {_ALLOWED_WHAT}")
    hosts: list[tuple[str, int | None]] = []
    networks = []
    for item in items:
        if isinstance(item, str) and "/" in item:
            try:
                networks.append(ipaddress.ip_network(item.strip(), strict=False))
            except ValueError:
                raise refuse(key, item, _ALLOWED_WHAT) from None
            continue
        host, port = host_port(key, item, _ALLOWED_WHAT)
        hosts.append((canonical_host(host), port))
    return AllowedPeers(tuple(hosts), tuple(networks))


class SecuredConfig(Protocol):
    """What the policy reads of a ``P2pConfig``."""

    host: str
    listen_host: str
    binds_beyond_loopback: bool
    secret: bytes | None
    grant_token: bytes | None
    allowed_peers: AllowedPeers | None
    allow_unauthenticated: bool
    routers: tuple[tuple[str, int], ...]


def _open_key(config: SecuredConfig) -> str:
    """The key that makes the KV ports reachable beyond loopback."""
    if is_loopback(config.host):
        return f"{_EXTRA}.kv_bind_ip: {config.listen_host}"
    return f"{_EXTRA}.kv_ip: {config.host}"


def check_security(config: SecuredConfig) -> None:
    """Safe by default, checked at start-up (API server and engine core):
    one line naming what to set when the configuration is open."""
    if config.binds_beyond_loopback and config.secret is None:
        if not config.allow_unauthenticated:
            raise ConfigError(
                f"{_open_key(config)} is reachable beyond loopback and the "
                "P2P control plane has no secret: set "
                f"{envs.VLLM_DISAGG_P2P_SECRET} (or "
                f"{envs.VLLM_DISAGG_P2P_SECRET_FILE}) to the same value on every "
                f"instance, or set {_EXTRA}.allow_unauthenticated to true to "
                "accept KV from anyone who can reach the port"
            )
        if "allow_unauthenticated" not in _warned:
            _warned.add("allow_unauthenticated")
            logger.warning(
                "%s: allow_unauthenticated is set: the P2P ports on %s accept KV "
                "and control messages from anyone who can reach them (no %s)",
                CONNECTOR_NAME,
                config.listen_host,
                envs.VLLM_DISAGG_P2P_SECRET,
            )
    if (
        config.routers
        and config.grant_token is None
        and config.binds_beyond_loopback
        and not config.allow_unauthenticated
    ):
        raise ConfigError(
            f"{_EXTRA}.proxy_ip: registrations with the router from {config.host} "
            f"would be unsigned: set {envs.VLLM_DISAGG_ROUTER_TOKEN} to the "
            "router's token"
        )
    if config.grant_token is None and config.allowed_peers is None:
        raise ConfigError(
            f"{CONNECTOR_NAME}: nothing vouches for the peers a request names: set "
            f"{envs.VLLM_DISAGG_ROUTER_TOKEN} to the router's token (the router "
            "signs the peers of every request with it) or list the peers in "
            f"{_EXTRA}.allowed_peers"
        )


# --- credentials on one host -------------------------------------------------------

_logged_sources: set[tuple[str, str]] = set()


def _log_source(what: str, source: str, key: str | None = None) -> None:
    """Once per process and ``key`` (default: ``source``): where a credential
    came from (never its value)."""
    if (what, key or source) not in _logged_sources:
        _logged_sources.add((what, key or source))
        logger.info("%s: %s from %s", CONNECTOR_NAME, what, source)


def with_local_cookie(
    secret: bytes | None,
    grant_token: bytes | None,
    fields: Mapping[str, Any],
    routers: tuple[tuple[str, int], ...],
) -> tuple[bytes | None, bytes | None]:
    """The credentials the environment gave, completed from this user's
    local cookie (``vllm_disagg/wire/cookie.py``) where it gave none and the
    instance is on loopback: the P2P secret when ``kv_ip`` (and
    ``kv_bind_ip``, if set) is loopback, the router token when those, the
    advertised HTTP host and every router are. The same user's router and
    instances on this host find the same cookie, so the seed's recipe runs on
    one machine with nothing exported, and another user, who cannot read the
    file, is refused. Anything beyond loopback keeps needing the variables
    (``check_security``).

    A cookie that cannot be used (a file open to other users, no home to
    keep it in) is refused in one line: fatal when the instance has nothing
    else to vouch for peers with, else a warning and today's behaviour (an
    unauthenticated P2P plane on loopback)."""
    host, http_ip = fields["host"], fields["http_ip"]
    # Loopback-only: bound there too (binding 0.0.0.0 while advertising
    # 127.0.0.1 is reachable from anywhere).
    on_loopback = is_loopback(host) and is_loopback(fields["bind_host"] or host)
    p2p_local = secret is None and on_loopback
    token_local = (
        grant_token is None
        and on_loopback
        and (http_ip is None or is_loopback(http_ip))
        and all(is_loopback(router_host) for router_host, _ in routers)
    )
    if grant_token is not None:
        _log_source("router token", envs.VLLM_DISAGG_ROUTER_TOKEN)
    if secret is not None:
        _log_source("P2P secret", "the environment")
    if not (p2p_local or token_local):
        return secret, grant_token
    try:
        cookie = load_cookie()
    except CookieError as e:
        if token_local and fields["allowed_peers"] is None:
            raise ConfigError(
                f"{e} (or set {envs.VLLM_DISAGG_ROUTER_TOKEN} on the router and "
                "every instance)"
            ) from None
        if "local cookie" not in _warned:
            _warned.add("local cookie")
            logger.warning(
                "%s: %s; without it the P2P plane on loopback is not authenticated"
                "%s (set %s and %s to the same values on every instance)",
                CONNECTOR_NAME,
                e,
                " and only allowed_peers vouch for peers" if token_local else "",
                envs.VLLM_DISAGG_P2P_SECRET,
                envs.VLLM_DISAGG_ROUTER_TOKEN,
            )
        return secret, grant_token
    if p2p_local:
        secret = cookie.key(P2P_SECRET)
        _log_source("P2P secret", cookie.describe(), str(cookie.path))
    if token_local:
        grant_token = cookie.key(ROUTER_TOKEN)
        _log_source("router token", cookie.describe(), str(cookie.path))
    return secret, grant_token
