"""The P2pNcclConnector's options: one frozen dataclass parsed from
``--kv-transfer-config``, with one-line errors that name the key.

Users select the connector with the seed design document's JSON::

    --kv-transfer-config '{"kv_connector":"P2pNcclConnector","kv_role":"kv_producer",
      "kv_buffer_size":"1e1","kv_port":"21001",
      "kv_connector_extra_config":{"proxy_ip":"10.0.1.1","proxy_port":"30001",
                                   "http_port":"20001"}}'

vLLM 0.32's ``KVTransferConfig`` forbids unknown fields and has no
``kv_buffer_size`` (nor ``kv_ip``, ``kv_rank``, ``kv_parallel_size``), so
:func:`normalize_kv_transfer_json` first moves these legacy top-level keys
into ``kv_connector_extra_config`` (the ``p2p-kv-transfer-json`` patch calls
it on the command line's JSON); :class:`P2pConfig` then reads the result.

Decisions:

* ``kv_rank`` / ``kv_parallel_size`` (the removed V0 ``PyNcclConnector``'s
  static pairing) mean nothing here, peers are named per request: they are
  accepted at the top level, dropped, and warned about once, so old launch
  recipes still start.
* ``kv_ip`` (top level or extra config) is the host this instance's workers
  listen on and advertise to peers. Unset, it is the address of
  ``vllm serve --host`` when that names one (``VLLM_DISAGG_SERVE_HOST``, set
  by the ``vllm`` command), else vLLM's ``vllm.utils.network_utils.get_ip()``
  (``VLLM_HOST_IP``, else the address of the default route), what a
  multi-host deployment needs and what the old connector used; 127.0.0.1
  when the machine has no route.
* The shared secret of the control plane is never read from the JSON (command
  lines are visible in ``ps``) but from ``VLLM_DISAGG_P2P_SECRET`` (or the
  file ``VLLM_DISAGG_P2P_SECRET_FILE`` names). Safe by default
  (:meth:`P2pConfig.check_security`): an instance whose ``kv_ip`` is not a
  loopback address refuses to start without one, unless
  ``allow_unauthenticated`` is set (logged as a warning); and the peers a
  request names are acted on only when the router's grant
  (``VLLM_DISAGG_ROUTER_TOKEN``, see ``vllm_disagg/wire/grants.py``) or the
  operator's ``allowed_peers`` vouches for them, so an instance with
  neither refuses to start.
* ``kv_load_failure_policy`` defaults to ``"recompute"`` for this connector:
  a lost transfer costs time, never a failed request.
* ``proxy_ip`` names one router or several (router replicas behind a load
  balancer must all know the fleet): a host, ``host:port``, or a
  comma-separated string or JSON list of them; items without a port use
  ``proxy_port``. Every DP rank registers with every router (registration.py).
"""

from __future__ import annotations

import difflib
import enum
import ipaddress
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_disagg import envs
from vllm_disagg.wire.peers import canonical_host, format_addr, is_loopback
from vllm_disagg.errors import ConfigError
from vllm_disagg.logger import init_logger

logger = init_logger(__name__)

CONNECTOR_NAME = "P2pNcclConnector"


class SendType(str, enum.Enum):
    """How KV reaches the decode instance (names of the seed documents)."""

    PUT = "PUT"  # prefill sends after the forward pass
    GET = "GET"  # decode asks for it; prefill keeps the blocks until taken
    PUT_ASYNC = "PUT_ASYNC"  # prefill sends layer by layer during the pass


ROLES = ("kv_producer", "kv_consumer", "kv_both")
TRANSPORTS = ("auto", "tcp", "gloo", "nccl", "fake")

# Keys the seed document puts at the top level of the JSON that 0.32's
# KVTransferConfig lacks. Moved into kv_connector_extra_config:
MOVED_TOP_LEVEL_KEYS = ("kv_buffer_size", "kv_ip")
# Accepted for old recipes, dropped with a one-time warning:
IGNORED_TOP_LEVEL_KEYS = ("kv_rank", "kv_parallel_size")
LEGACY_TOP_LEVEL_KEYS = MOVED_TOP_LEVEL_KEYS + IGNORED_TOP_LEVEL_KEYS

# Every key kv_connector_extra_config may hold; anything else is an error,
# so a typo is never silently ignored.
EXTRA_CONFIG_KEYS = (
    "send_type",
    "kv_buffer_size",
    "mem_pool_size_gb",
    "kv_ip",
    "transport",
    "kv_load_timeout_s",
    "kv_hold_timeout_s",
    "skip_cached_blocks",
    "proxy_ip",
    "proxy_port",
    "http_port",
    "http_ip",
    "allowed_peers",
    "allow_unauthenticated",
)

DEFAULT_KV_BUFFER_SIZE = 10**9
DEFAULT_MEM_POOL_SIZE_GB = 1.0
DEFAULT_KV_LOAD_TIMEOUT_S = 30.0
DEFAULT_KV_HOLD_TIMEOUT_S = 60.0
DEFAULT_KV_LOAD_FAILURE_POLICY = "recompute"

MAX_PORT = 65535
MAX_KV_BUFFER_SIZE = 1 << 50  # 1 PiB: anything larger is a typo
MAX_MEM_POOL_SIZE_GB = 16384.0
MAX_TIMEOUT_S = 86400.0
MAX_ROUTERS = 16
GIB = 1 << 30

_EXTRA = "kv_connector_extra_config"
_warned: set[str] = set()


# --- value parsers: each takes the key to name in its error -----------------


def _show(value: Any) -> str:
    """A value for an error message: one line, bounded."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(key: str, value: Any, what: str) -> float:
    """An int, float or numeric string ("1e9", "21001") as a finite float."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{key}: {_show(value)} is not {what}")
    try:
        number = float(value.strip()) if isinstance(value, str) else float(value)
    except (ValueError, OverflowError):
        raise ConfigError(f"{key}: {_show(value)} is not {what}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{key}: {_show(value)} is not {what}")
    return number


def parse_port(key: str, value: Any) -> int:
    """A TCP port: an integer or an integer string, 1..65535."""
    what = f"a port number (an integer 1..{MAX_PORT})"
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{key}: {_show(value)} is not {what}")
    port = value
    if isinstance(value, str):
        if not re.fullmatch(r"[0-9]{1,5}", value.strip()):  # int() takes "1_0", "٢"
            raise ConfigError(f"{key}: {_show(value)} is not {what}")
        port = int(value)
    if not 1 <= port <= MAX_PORT:
        raise ConfigError(f"{key}: {_show(value)} is not {what}")
    return port


def parse_byte_size(key: str, value: Any) -> int:
    """Bytes as an int, float or numeric string ("1e1", "8e9")."""
    what = 'a number of bytes >= 0 (e.g. 1e9 or "8e9")'
    number = _number(key, value, what)
    if number < 0:
        raise ConfigError(f"{key}: {_show(value)} is not {what}")
    if number > MAX_KV_BUFFER_SIZE:
        raise ConfigError(f"{key}: {_show(value)} bytes is more than 1 PiB")
    return int(number)


def parse_gib(key: str, value: Any) -> int:
    """A size in GiB (float) as bytes."""
    what = f"a size in GiB (>= 0 and <= {MAX_MEM_POOL_SIZE_GB:.0f}; 0 disables the pool)"
    gib = _number(key, value, what)
    if not 0 <= gib <= MAX_MEM_POOL_SIZE_GB:
        raise ConfigError(f"{key}: {_show(value)} is not {what}")
    return int(gib * GIB)


def parse_seconds(key: str, value: Any) -> float:
    what = f"a number of seconds (> 0 and <= {MAX_TIMEOUT_S:.0f})"
    number = _number(key, value, what)
    if not 0 < number <= MAX_TIMEOUT_S:
        raise ConfigError(f"{key}: {_show(value)} is not {what}")
    return number


def parse_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of ``choices``, case-insensitively; returns the canonical spelling."""
    if isinstance(value, str):
        for choice in choices:
            if value.strip().lower() == choice.lower():
                return choice
    raise ConfigError(f"{key}: {_show(value)} is not one of {', '.join(choices)}")


_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")


def parse_host(key: str, value: Any) -> str:
    """An IPv4 address, an IPv6 address (brackets optional) or a host name.

    The same grammar the request-id codec accepts (``vllm_disagg/wire/peers.py``): no
    underscores, no IPv6 zone ids.
    """
    what = "an IPv4 or IPv6 address or a host name"
    if not isinstance(value, str) or not value.strip() or len(value) > 255:
        raise ConfigError(f"{key}: {_show(value)} is not {what}")
    host = value.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise ConfigError(f"{key}: {_show(value)} is not {what}")
    if ":" in host:
        if "%" in host:
            raise ConfigError(f"{key}: {_show(value)}: IPv6 zone ids are not supported")
        try:
            return str(ipaddress.IPv6Address(host))
        except ValueError:
            raise ConfigError(f"{key}: {_show(value)} is not {what}") from None
    if re.fullmatch(r"[0-9.]+", host):
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            raise ConfigError(f"{key}: {_show(value)} is not {what}") from None
    if len(host) > 253 or not _HOSTNAME.fullmatch(host):
        raise ConfigError(f"{key}: {_show(value)} is not {what}")
    return host


def parse_advertised_host(key: str, value: Any) -> str:
    """A host another machine connects to: :func:`parse_host`, but not a
    wildcard address (``0.0.0.0``, ``::``), which names no machine."""
    host = parse_host(key, value)
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name
        wildcard = False
    if wildcard:
        raise ConfigError(f"{key}: {_show(value)} is a wildcard address; give one that "
                          "other machines can connect to")  # fmt: skip
    return host


_ROUTERS_WHAT = (
    "a router address: host or host:port ([IPv6]:port), or a comma-separated "
    "string or JSON list of them"
)


def _parse_router(key: str, item: Any) -> tuple[str, int | None]:
    """One ``proxy_ip`` item: ``host`` or ``host:port`` (IPv6 bracketed with
    a port, brackets optional without)."""
    if not isinstance(item, str):
        raise ConfigError(f"{key}: {_show(item)} is not {_ROUTERS_WHAT}")
    host, port = item.strip(), None
    if host.startswith("[") and "]:" in host:
        inner, port = host[1:].split("]:", 1)
        host = f"[{inner}]"
    elif host.count(":") == 1:  # IPv6 addresses have at least two
        host, port = host.split(":")
    try:
        host = parse_host(key, host)
        port = None if port is None else parse_port(key, port)
    except ConfigError:
        raise ConfigError(f"{key}: {_show(item)} is not {_ROUTERS_WHAT}") from None
    return parse_advertised_host(key, host), port


def parse_routers(
    key: str, value: Any, default_port: int | None, port_key: str = "proxy_port"
) -> tuple[str, tuple[tuple[str, int], ...]]:
    """``proxy_ip``: one router or several. Returns its canonical text (a
    single host stays that host) and the ``(host, port)`` of every router;
    items without a port use ``default_port``."""
    items = value
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("[") and '"' in text:  # a JSON list given as a string
            try:
                items = json.loads(text)
            except ValueError:
                raise ConfigError(f"{key}: {_show(value)} is not {_ROUTERS_WHAT}") from None
        else:
            items = text.split(",")
    if not isinstance(items, list | tuple) or not items:
        raise ConfigError(f"{key}: {_show(value)} is not {_ROUTERS_WHAT}")
    if len(items) > MAX_ROUTERS:
        raise ConfigError(f"{key}: {len(items)} routers; at most {MAX_ROUTERS}")
    canonical: list[str] = []
    routers: list[tuple[str, int]] = []
    for item in items:
        host, port = _parse_router(key, item)
        if port is None and default_port is None:
            raise ConfigError(
                f"{key}, {port_key}: give both (register with a router) or neither; "
                f"without {port_key} every router needs its port (host:port)"
            )
        router = (host, default_port if port is None else port)
        if router in routers:
            raise ConfigError(f"{key}: router {format_addr(*router)} is listed twice")
        routers.append(router)
        canonical.append(host if port is None else format_addr(host, port))
    return ",".join(canonical), tuple(routers)


def _default_host() -> str:
    """kv_ip when the JSON has none: the address ``vllm serve --host`` listens
    on, else vLLM's ``get_ip()``."""
    served = envs.serve_host()
    if served is not None:
        try:
            return parse_advertised_host("kv_ip (from vllm serve --host)", served)
        except ConfigError:
            pass
    from vllm.utils.network_utils import get_ip

    host = get_ip()
    if host in ("0.0.0.0", "::"):
        # get_ip() found no route; an unspecified address is no use to peers.
        return "127.0.0.1"
    return host


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
    items = value
    if isinstance(value, str):
        items = [i for i in value.split(",") if i.strip()]
    if not isinstance(items, list | tuple) or not items or len(items) > 4096:
        raise ConfigError(f"{key}: {_show(value)} is not a list of {_ALLOWED_WHAT}")
    hosts: list[tuple[str, int | None]] = []
    networks = []
    for item in items:
        if isinstance(item, str) and "/" in item:
            try:
                networks.append(ipaddress.ip_network(item.strip(), strict=False))
            except ValueError:
                raise ConfigError(f"{key}: {_show(item)} is not {_ALLOWED_WHAT}") from None
            continue
        try:
            host, port = _parse_router(key, item)
        except ConfigError:
            raise ConfigError(f"{key}: {_show(item)} is not {_ALLOWED_WHAT}") from None
        hosts.append((canonical_host(host), port))
    return AllowedPeers(tuple(hosts), tuple(networks))


# --- normalising the JSON ---------------------------------------------------


def _warn_once(key: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(
            "--kv-transfer-config: %s is ignored by %s (peers are named per "
            "request by the proxy); remove it",
            key,
            CONNECTOR_NAME,
        )


def normalize_kv_transfer_json(obj: dict) -> dict:
    """Make the seed document's JSON acceptable to vLLM 0.32's KVTransferConfig.

    Only for ``kv_connector == "P2pNcclConnector"`` (anything else is returned
    unchanged): returns a copy with :data:`MOVED_TOP_LEVEL_KEYS` moved into
    ``kv_connector_extra_config``, :data:`IGNORED_TOP_LEVEL_KEYS` dropped,
    ``kv_port`` checked and made an int, and ``kv_load_failure_policy``
    defaulted to ``"recompute"``. Raises :class:`ConfigError`.
    """
    if not isinstance(obj, dict) or obj.get("kv_connector") != CONNECTOR_NAME:
        return obj
    out = dict(obj)
    extra = out.get(_EXTRA)
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ConfigError(f"{_EXTRA}: {_show(extra)} is not a JSON object")
    extra = dict(extra)
    for key in MOVED_TOP_LEVEL_KEYS:
        if key not in out:
            continue
        value = out.pop(key)
        if key in extra and extra[key] != value:
            raise ConfigError(
                f"{key}: given at the top level ({_show(value)}) and in {_EXTRA} "
                f"({_show(extra[key])}) with different values; give it once"
            )
        extra[key] = value
    for key in IGNORED_TOP_LEVEL_KEYS:
        if key in out:
            out.pop(key)
            _warn_once(key)
    out[_EXTRA] = extra
    if "kv_port" in out:
        out["kv_port"] = parse_port("kv_port", out["kv_port"])
    out.setdefault("kv_load_failure_policy", DEFAULT_KV_LOAD_FAILURE_POLICY)
    return out


# --- the options ------------------------------------------------------------


@dataclass(frozen=True)
class P2pConfig:
    """Everything the connector reads from ``--kv-transfer-config``, typed
    and checked. Build it with :meth:`from_vllm_config`."""

    role: str
    base_port: int
    host: str = "127.0.0.1"
    send_type: SendType = SendType.PUT_ASYNC
    # Receive buffer (bytes) for pushed KV before it spills to the host pool.
    kv_buffer_size: int = DEFAULT_KV_BUFFER_SIZE
    # Host tensor memory pool; 0 disables it.
    mem_pool_size_bytes: int = int(DEFAULT_MEM_POOL_SIZE_GB * GIB)
    transport: str = "auto"
    # Decode: how long a request waits for its KV before it is recomputed.
    kv_load_timeout_s: float = DEFAULT_KV_LOAD_TIMEOUT_S
    # Prefill: how long a finished request's blocks wait for a peer to take them.
    kv_hold_timeout_s: float = DEFAULT_KV_HOLD_TIMEOUT_S
    # Decode: receive only the blocks its own prefix cache lacks (false: the
    # whole prompt, as the old connector did; kept for measurement).
    skip_cached_blocks: bool = True
    # Service discovery (the routers): where to register (proxy_ip: one host
    # or several, see parse_routers), and this instance's API server address
    # the routers forward to (http_ip defaults to host).
    proxy_ip: str | list[str] | tuple[str, ...] | None = None
    proxy_port: int | None = None
    http_port: int | None = None
    http_ip: str | None = None
    # Control-plane HMAC key (VLLM_DISAGG_P2P_SECRET); None: no authentication.
    secret: bytes | None = field(default=None, repr=False)
    # The router's token (VLLM_DISAGG_ROUTER_TOKEN): checks the peer grants.
    grant_token: bytes | None = field(default=None, repr=False)
    # Peers an operator vouches for without a grant (see parse_allowed_peers).
    allowed_peers: AllowedPeers | None = None
    # Run beyond loopback without a secret (logged as a warning at start).
    allow_unauthenticated: bool = False
    # Derived from proxy_ip and proxy_port: (host, port) of every router.
    routers: tuple[tuple[str, int], ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        # Direct construction gets the same checks as the JSON (field names).
        set_ = object.__setattr__
        set_(self, "role", parse_choice("role", self.role, ROLES))
        set_(self, "base_port", parse_port("base_port", self.base_port))
        set_(self, "host", parse_host("host", self.host))
        send_type = self.send_type.value if isinstance(self.send_type, SendType) else self.send_type
        send_type = parse_choice("send_type", send_type, tuple(t.value for t in SendType))
        set_(self, "send_type", SendType(send_type))
        for name in ("kv_buffer_size", "mem_pool_size_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}: {_show(value)} is not an integer >= 0")
        set_(self, "transport", parse_choice("transport", self.transport, TRANSPORTS))
        for name in ("kv_load_timeout_s", "kv_hold_timeout_s"):
            set_(self, name, parse_seconds(name, getattr(self, name)))
        for name in ("proxy_port", "http_port"):
            if getattr(self, name) is not None:
                set_(self, name, parse_port(name, getattr(self, name)))
        if self.proxy_ip is not None:
            proxy_ip, routers = parse_routers("proxy_ip", self.proxy_ip, self.proxy_port)
            set_(self, "proxy_ip", proxy_ip)
            set_(self, "routers", routers)
        elif self.proxy_port is not None:
            raise ConfigError(
                "proxy_ip, proxy_port: give both (register with a router) or neither"
            )
        if self.http_ip is not None:
            set_(self, "http_ip", parse_advertised_host("http_ip", self.http_ip))
        if self.proxy_ip is not None and self.http_port is None:
            raise ConfigError(
                "http_port: required with proxy_ip/proxy_port (the port of this "
                "instance's API server that the router forwards requests to)"
            )
        for name in ("secret", "grant_token"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bytes):
                raise ConfigError(f"{name}: must be bytes or None")
            set_(self, name, getattr(self, name) or None)
        if self.allowed_peers is not None and not isinstance(self.allowed_peers, AllowedPeers):
            set_(self, "allowed_peers", parse_allowed_peers("allowed_peers", self.allowed_peers))
        if not isinstance(self.allow_unauthenticated, bool):
            raise ConfigError(
                f"allow_unauthenticated: {_show(self.allow_unauthenticated)} is not true or false"
            )

    @property
    def binds_beyond_loopback(self) -> bool:
        """Whether the workers' ports (kv_ip) can be reached from other machines."""
        return not is_loopback(self.host)

    def check_security(self) -> None:
        """Safe by default, checked at start-up (API server and engine core):
        one line naming what to set when the configuration is open."""
        if self.binds_beyond_loopback and self.secret is None:
            if not self.allow_unauthenticated:
                raise ConfigError(
                    f"{_EXTRA}.kv_ip: {self.host} is reachable beyond loopback and the "
                    f"P2P control plane has no secret: set {envs.VLLM_DISAGG_P2P_SECRET} "
                    f"(or {envs.VLLM_DISAGG_P2P_SECRET_FILE}) to the same value on every "
                    f"instance, or set {_EXTRA}.allow_unauthenticated to true to accept "
                    "KV from anyone who can reach the port"
                )
            if "allow_unauthenticated" not in _warned:
                _warned.add("allow_unauthenticated")
                logger.warning(
                    "%s: allow_unauthenticated is set: the P2P ports on %s accept KV and "
                    "control messages from anyone who can reach them (no %s)",
                    CONNECTOR_NAME, self.host, envs.VLLM_DISAGG_P2P_SECRET,
                )
        if self.routers and self.grant_token is None and self.binds_beyond_loopback \
                and not self.allow_unauthenticated:
            raise ConfigError(
                f"{_EXTRA}.proxy_ip: registrations with the router from {self.host} would be "
                f"unsigned: set {envs.VLLM_DISAGG_ROUTER_TOKEN} to the router's token"
            )
        if self.grant_token is None and self.allowed_peers is None:
            raise ConfigError(
                f"{CONNECTOR_NAME}: nothing vouches for the peers a request names: set "
                f"{envs.VLLM_DISAGG_ROUTER_TOKEN} to the router's token (the router signs "
                f"the peers of every request with it) or list the peers in "
                f"{_EXTRA}.allowed_peers"
            )

    @property
    def mem_pool_size_gb(self) -> float:
        return self.mem_pool_size_bytes / GIB

    @property
    def http_addr(self) -> str | None:
        """``host:port`` of this instance's API server, for the routers."""
        if self.http_port is None:
            return None
        return format_addr(self.http_ip or self.host, self.http_port)

    @classmethod
    def from_kv_transfer_config(cls, kv_transfer_config) -> P2pConfig:
        """Parse vLLM's ``KVTransferConfig`` (after
        :func:`normalize_kv_transfer_json`); errors name the JSON key."""
        connector = getattr(kv_transfer_config, "kv_connector", None)
        if connector != CONNECTOR_NAME:
            raise ConfigError(f"kv_connector: {_show(connector)} is not {CONNECTOR_NAME}")
        extra = kv_transfer_config.kv_connector_extra_config
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"{_EXTRA}: {_show(extra)} is not a JSON object")
        unknown = sorted(str(k) for k in extra if k not in EXTRA_CONFIG_KEYS)
        if unknown:
            close = difflib.get_close_matches(unknown[0], EXTRA_CONFIG_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{_EXTRA}.{unknown[0]}: unknown key{hint}; allowed keys are "
                f"{', '.join(EXTRA_CONFIG_KEYS)}"
            )

        def key(name: str) -> str:
            return f"{_EXTRA}.{name}"

        kwargs: dict[str, Any] = {
            "role": parse_choice("kv_role", kv_transfer_config.kv_role, ROLES),
            "base_port": parse_port("kv_port", kv_transfer_config.kv_port),
            "secret": envs.p2p_secret(),
            "grant_token": envs.router_token(),
        }
        if "allowed_peers" in extra:
            kwargs["allowed_peers"] = parse_allowed_peers(
                key("allowed_peers"), extra["allowed_peers"]
            )
        if "allow_unauthenticated" in extra:
            value = extra["allow_unauthenticated"]
            if not isinstance(value, bool):
                raise ConfigError(
                    f"{key('allow_unauthenticated')}: {_show(value)} is not true or false"
                )
            kwargs["allow_unauthenticated"] = value
        if "send_type" in extra:
            choices = tuple(t.value for t in SendType)
            kwargs["send_type"] = parse_choice(key("send_type"), extra["send_type"], choices)
        if "kv_buffer_size" in extra:
            kwargs["kv_buffer_size"] = parse_byte_size(
                key("kv_buffer_size"), extra["kv_buffer_size"]
            )
        if "mem_pool_size_gb" in extra:
            kwargs["mem_pool_size_bytes"] = parse_gib(
                key("mem_pool_size_gb"), extra["mem_pool_size_gb"]
            )
        kwargs["host"] = (
            parse_host(key("kv_ip"), extra["kv_ip"]) if "kv_ip" in extra else _default_host()
        )
        if "transport" in extra:
            kwargs["transport"] = parse_choice(key("transport"), extra["transport"], TRANSPORTS)
        for name in ("kv_load_timeout_s", "kv_hold_timeout_s"):
            if name in extra:
                kwargs[name] = parse_seconds(key(name), extra[name])
        if "skip_cached_blocks" in extra:
            value = extra["skip_cached_blocks"]
            if not isinstance(value, bool):
                raise ConfigError(f"{key('skip_cached_blocks')}: {_show(value)} is not true or false")
            kwargs["skip_cached_blocks"] = value
        for name in ("proxy_port", "http_port"):
            if name in extra:
                kwargs[name] = parse_port(key(name), extra[name])
        if "proxy_ip" in extra:
            kwargs["proxy_ip"], _ = parse_routers(
                key("proxy_ip"), extra["proxy_ip"], kwargs.get("proxy_port"), key("proxy_port")
            )
        elif "proxy_port" in kwargs:
            raise ConfigError(
                f"{key('proxy_ip')}, {key('proxy_port')}: give both (register with "
                "a router) or neither"
            )
        if "http_ip" in extra:
            kwargs["http_ip"] = parse_advertised_host(key("http_ip"), extra["http_ip"])
        if "proxy_ip" in kwargs and "http_port" not in kwargs:
            raise ConfigError(
                f"{key('http_port')}: required with proxy_ip/proxy_port (the port of "
                "this instance's API server that the router forwards requests to)"
            )
        return cls(**kwargs)

    @classmethod
    def from_vllm_config(cls, vllm_config) -> P2pConfig:
        return cls.from_kv_transfer_config(vllm_config.kv_transfer_config)

    # --- the port plan: one control-plane port per worker -------------------

    def worker_port(
        self, *, dp_rank: int, tp_size: int, pp_size: int, tp_rank: int, pp_rank: int
    ) -> int:
        """The port of one worker: ``kv_port`` plus the worker's global index,
        so every worker of every DP rank on a host gets its own."""
        if not (tp_size >= 1 and pp_size >= 1 and dp_rank >= 0):
            raise ValueError(f"bad parallel sizes: dp_rank={dp_rank} tp={tp_size} pp={pp_size}")
        if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
            raise ValueError(f"bad ranks: tp_rank={tp_rank}/{tp_size} pp_rank={pp_rank}/{pp_size}")
        offset = dp_rank * tp_size * pp_size + pp_rank * tp_size + tp_rank
        port = self.base_port + offset
        if port > MAX_PORT:
            raise ConfigError(
                f"kv_port: {self.base_port} + {offset} (DP rank {dp_rank}, PP rank "
                f"{pp_rank}, TP rank {tp_rank}) is beyond {MAX_PORT}; kv_port must "
                f"be at most {MAX_PORT - offset}"
            )
        return port

    def instance_port(self, dp_rank: int, tp_size: int, pp_size: int) -> int:
        """The port of a DP rank's first worker (TP and PP rank 0): the one a
        proxy puts in the request id to name this instance."""
        return self.worker_port(
            dp_rank=dp_rank, tp_size=tp_size, pp_size=pp_size, tp_rank=0, pp_rank=0
        )

    def check_port_plan(self, parallel_config) -> range:
        """Check at start-up that every worker's port exists and does not
        collide with ``http_port``; returns the ports."""
        dp = parallel_config.data_parallel_size
        tp = parallel_config.tensor_parallel_size
        pp = parallel_config.pipeline_parallel_size
        count = dp * tp * pp
        ports = range(self.base_port, self.base_port + count)
        if ports[-1] > MAX_PORT:
            raise ConfigError(
                f"kv_port: {self.base_port} needs ports {ports[0]}..{ports[-1]} for "
                f"{dp} DP x {pp} PP x {tp} TP workers, beyond {MAX_PORT}; kv_port "
                f"must be at most {MAX_PORT + 1 - count}"
            )
        if self.http_port is not None and self.http_port in ports:
            raise ConfigError(
                f"{_EXTRA}.http_port: {self.http_port} is one of the workers' KV "
                f"ports ({ports[0]}..{ports[-1]}, from kv_port); choose ports apart"
            )
        return ports


    def check_dp_load_balancing(self, parallel_config) -> None:
        """Refuse the combinations that cannot work when one API server
        fronts several DP ranks (internal load balancing, hybrid included:
        vLLM makes a hybrid deployment with one local rank external).

        The router names one DP rank of each side per request (its KV
        address), but the API server hands the request to whichever rank it
        picks. What depends on the request landing on the named rank fails:

        * kv_consumer, PUT/PUT_ASYNC: prefill pushes the KV to the named
          decode rank, so a request on another rank never gets it;
        * kv_producer, GET: decode pulls from the named prefill rank, which
          does not hold the KV when the prefill ran on another rank;
        * kv_both: picks its side by comparing the named addresses with its
          own rank's address, so on another rank it transfers nothing.

        The others work: a consumer in GET mode pulls with its own worker's
        address in the ``Get`` and the prefill sends there (engine._on_get);
        a producer in PUT modes pushes from whichever rank ran the prefill,
        and decode files received KV by the request's key, not by sender.
        """
        dp = parallel_config.data_parallel_size
        if dp <= 1 or parallel_config.data_parallel_external_lb:
            return
        push = self.send_type is not SendType.GET
        if self.role == "kv_consumer" and push:
            why = ("prefill pushes the KV to the decode rank the request names, but the "
                   "API server may hand the request to another rank")  # fmt: skip
        elif self.role == "kv_producer" and not push:
            why = ("decode pulls the KV from the prefill rank the request names, but the "
                   "API server may have run the prefill on another rank")  # fmt: skip
        elif self.role == "kv_both":
            why = ("kv_both picks its side by comparing the request's addresses with its "
                   "own rank's, and the API server may hand the request to another rank")
        else:
            return
        raise ConfigError(
            f"{CONNECTOR_NAME}: kv_role {self.role} with send_type {self.send_type.value} "
            f"cannot run {dp} DP ranks behind one API server (internal load balancing): "
            f"{why}; run one `vllm serve` per DP rank (--data-parallel-rank N, external "
            "load balancing) so each rank registers as its own instance"
        )


def check_p2p_config(vllm_config) -> None:
    """Start-up check (run in the API server before engines start): a bad
    P2pNcclConnector configuration fails here, in one line."""
    kv_transfer_config = vllm_config.kv_transfer_config
    if kv_transfer_config is None or kv_transfer_config.kv_connector != CONNECTOR_NAME:
        return
    config = P2pConfig.from_vllm_config(vllm_config)
    config.check_security()
    config.check_port_plan(vllm_config.parallel_config)
    config.check_dp_load_balancing(vllm_config.parallel_config)


def dp_rank_of(parallel_config) -> int:
    """This engine's DP rank for the port plan and registration.

    vLLM resets ``data_parallel_rank`` to 0 in every engine core of a dense
    (non-MoE) model run with DP (``reconfigure_for_independent_dp_rank``);
    ``data_parallel_index`` keeps the rank the user launched.
    """
    index = getattr(parallel_config, "data_parallel_index", None)
    return parallel_config.data_parallel_rank if index is None else index

