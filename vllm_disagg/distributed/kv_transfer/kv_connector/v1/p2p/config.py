"""The P2pNcclConnector's options: one frozen dataclass parsed from
``--kv-transfer-config``, with one-line errors that name the key.

Every key of ``kv_connector_extra_config`` is one row of :data:`OPTIONS` (type,
default, parser, help); the rules between keys are one function,
``_check_cross_fields``. Direct construction and the JSON go through both, and
docs/p2p_connector.md's key table is rendered from the rows (``python -m`` this module
rewrites it).

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
* ``kv_bind_ip`` splits what the workers bind from what they advertise
  (``kv_ip``), for NAT and containers (Elasticsearch's ``bind_host`` /
  ``publish_host``): unset, they bind ``kv_ip``. With the tcp transport,
  ``kv_data_port`` fixes the data ports a NAT must forward. Security looks at
  both addresses: loopback-only means bound *and* advertised on loopback.
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
* Except on one host: where the environment sets no secret or token and
  the instance (``kv_ip``, its advertised HTTP host, its routers) is on
  loopback, both come from this user's local cookie
  (``vllm_disagg/wire/cookie.py``, :func:`_with_local_cookie`), which the
  same user's router finds too: the seed's recipe starts as typed, and other
  users of the machine, who cannot read the cookie, are refused.
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
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_disagg import envs
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.checksum import (
    NONE as NO_CHECKSUM,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.checksum import (
    OFFERED as CHECKSUMS,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.checksum import (
    ChecksumUnavailable,
    make_checksum,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.roles import (
    KV_BOTH,
    KV_CONSUMER,
    KV_PRODUCER,
    KV_ROLES,
)
from vllm_disagg.errors import ConfigError
from vllm_disagg.logger import init_logger
from vllm_disagg.wire.cookie import P2P_SECRET, ROUTER_TOKEN, CookieError, load_cookie
from vllm_disagg.wire.peers import canonical_host, format_addr, is_loopback

logger = init_logger(__name__)

CONNECTOR_NAME = "P2pNcclConnector"


class SendType(str, enum.Enum):
    """How KV reaches the decode instance (names of the seed documents)."""

    PUT = "PUT"  # prefill sends after the forward pass
    GET = "GET"  # decode asks for it; prefill keeps the blocks until taken
    PUT_ASYNC = "PUT_ASYNC"  # prefill sends layer by layer during the pass


ROLES = KV_ROLES
# The transport names (transport/ imports them from here: reading options
# must not import torch).
TRANSPORTS = ("auto", "tcp", "gloo", "nccl", "fake")

# Keys the seed document puts at the top level of the JSON that 0.32's
# KVTransferConfig lacks. Moved into kv_connector_extra_config:
MOVED_TOP_LEVEL_KEYS = ("kv_buffer_size", "kv_ip")
# Accepted for old recipes, dropped with a one-time warning:
IGNORED_TOP_LEVEL_KEYS = ("kv_rank", "kv_parallel_size")
LEGACY_TOP_LEVEL_KEYS = MOVED_TOP_LEVEL_KEYS + IGNORED_TOP_LEVEL_KEYS

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
    what = (
        f"a size in GiB (>= 0 and <= {MAX_MEM_POOL_SIZE_GB:.0f}; 0 disables the pool)"
    )
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


def parse_checksum(key: str, value: Any) -> str:
    """One of ``checksum.OFFERED``, whose library is installed."""
    name = parse_choice(key, value, CHECKSUMS)
    try:
        make_checksum(name)
    except ChecksumUnavailable as e:
        raise ConfigError(f"{key}: {e}") from None
    return name


def parse_host(key: str, value: Any) -> str:
    """An IPv4 address, an IPv6 address (brackets optional) or a host name.

    The same grammar the request-id codec accepts (``wire/peers.py``): no
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
        raise ConfigError(
            f"{key}: {_show(value)} is a wildcard address; give one that "
            "other machines can connect to"
            + (" (kv_bind_ip binds a wildcard)" if key.endswith("kv_ip") else "")
        )
    return host


def parse_bool(key: str, value: Any) -> bool:
    """A JSON ``true``/``false``; ``"yes"`` or ``1`` is a typo, not a choice."""
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: {_show(value)} is not true or false")
    return value


def parse_send_type(key: str, value: Any) -> SendType:
    return SendType(parse_choice(key, value, tuple(t.value for t in SendType)))


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


def parse_routers(key: str, value: Any) -> tuple[tuple[str, int | None], ...]:
    """``proxy_ip``: one router or several, each ``(host, port or None)``; a
    missing port is ``proxy_port``'s (:func:`_check_cross_fields`)."""
    items = value
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("[") and '"' in text:  # a JSON list given as a string
            try:
                items = json.loads(text)
            except ValueError:
                raise ConfigError(
                    f"{key}: {_show(value)} is not {_ROUTERS_WHAT}"
                ) from None
        else:
            items = text.split(",")
    if not isinstance(items, list | tuple) or not items:
        raise ConfigError(f"{key}: {_show(value)} is not {_ROUTERS_WHAT}")
    if len(items) > MAX_ROUTERS:
        raise ConfigError(f"{key}: {len(items)} routers; at most {MAX_ROUTERS}")
    return tuple(_parse_router(key, item) for item in items)


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
    if isinstance(value, AllowedPeers):
        return value
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
                raise ConfigError(
                    f"{key}: {_show(item)} is not {_ALLOWED_WHAT}"
                ) from None
            continue
        try:
            host, port = _parse_router(key, item)
        except ConfigError:
            raise ConfigError(f"{key}: {_show(item)} is not {_ALLOWED_WHAT}") from None
        hosts.append((canonical_host(host), port))
    return AllowedPeers(tuple(hosts), tuple(networks))


# --- the options: one row per kv_connector_extra_config key ------------------


@dataclass(frozen=True)
class Option:
    """One key of ``kv_connector_extra_config``: how it is read, and its row in the
    docs."""

    key: str
    type: str  # docs: what the key accepts (Markdown)
    default: Any  # the P2pConfig field's default
    parse: Callable[
        [str, Any], Any
    ]  # (key to name in errors, value) -> the field's value
    help: str  # docs: what it does
    refused: str  # docs: what start-up refuses
    field: str = ""  # the P2pConfig field, when not ``key``
    shown_default: str = ""  # docs: the default, when the value says too little
    check: Callable[[str, Any], Any] | None = (
        None  # a field value, when its unit is not the key's
    )
    absent: Callable[[], Any] | None = (
        None  # a JSON without the key, when not ``default``
    )

    @property
    def name(self) -> str:
        return self.field or self.key


OPTIONS: tuple[Option, ...] = (
    Option(
        "send_type",
        "`PUT_ASYNC`, `PUT`, `GET` (any case)",
        SendType.PUT_ASYNC,
        parse_send_type,
        "send mode; must match the peers'",
        "other strings",
    ),
    Option(
        "kv_buffer_size",
        'bytes: int, float or numeric string (`"1e9"`)',
        10**9,
        parse_byte_size,
        "D's receive-buffer budget (unused on P)",
        "negative, non-numeric, > 1 PiB",
        shown_default="1e9",
    ),
    Option(
        "mem_pool_size_gb",
        "number (GiB)",
        GIB,
        parse_gib,
        "host pool for what does not fit the buffer, created on first spill; 0 "
        "disables it",
        f"< 0, > {MAX_MEM_POOL_SIZE_GB:.0f}",
        field="mem_pool_size_bytes",
        shown_default="1.0",
        check=parse_byte_size,
    ),
    Option(
        "kv_ip",
        "IPv4, IPv6 (brackets optional), host name",
        "127.0.0.1",
        parse_advertised_host,
        "address peers are told (messages, registrations, grants); the workers bind it "
        "too unless `kv_bind_ip` is set; must be reachable by peers",
        "wildcard, `_` in names, IPv6 zone ids, bad IPs",
        field="host",
        shown_default=(
            "the address of `vllm serve --host` when it names one (not a wildcard; the "
            "`vllm` command passes it on as `VLLM_DISAGG_SERVE_HOST`), else vLLM's "
            "`get_ip()` (`VLLM_HOST_IP`, else the default route's address; 127.0.0.1 "
            "without a route)"
        ),
        absent=_default_host,
    ),
    Option(
        "kv_bind_ip",
        "as `kv_ip`, or a wildcard (`0.0.0.0`, `::`)",
        None,
        parse_host,
        "address the workers' KV ports (control, and tcp data) bind, when it is not "
        '`kv_ip` (which stays what peers are told): NAT, containers (see "Bind and '
        'advertised addresses")',
        "what `kv_ip` refuses but wildcards; with `transport` `gloo` or `nccl` when "
        "it differs from `kv_ip`",
        field="bind_host",
        shown_default="`kv_ip`",
    ),
    Option(
        "kv_data_port",
        "port",
        None,
        parse_port,
        "tcp transport: the first data port; worker i listens on `kv_data_port` + i, "
        "as on `kv_port` (a NAT can forward them); unset: each picks a free port",
        "with `transport` `gloo` or `nccl`; overlapping the `kv_port` range or "
        "`http_port`",
        shown_default="unset (a free port)",
    ),
    Option(
        "transport",
        ", ".join(f"`{t}`" for t in TRANSPORTS),
        "auto",
        lambda key, value: parse_choice(key, value, TRANSPORTS),
        "data plane; must match the peers'",
        "other strings",
        shown_default="`auto` (nccl on CUDA, tcp otherwise)",
    ),
    Option(
        "kv_load_timeout_s",
        "seconds",
        30.0,
        parse_seconds,
        "D: how long a request waits for its KV before it is recomputed",
        f"≤ 0, > {MAX_TIMEOUT_S:.0f}",
    ),
    Option(
        "kv_hold_timeout_s",
        "seconds",
        60.0,
        parse_seconds,
        "P: how long a send may take / held blocks wait for a pull; D: how long "
        "unclaimed KV is kept; channel set-up on D",
        f"≤ 0, > {MAX_TIMEOUT_S:.0f}",
    ),
    Option(
        "skip_cached_blocks",
        "JSON `true`/`false`",
        True,
        parse_bool,
        "D receives only blocks after its prefix hit (when it knows the request first)",
        "anything but a boolean",
    ),
    Option(
        "proxy_ip",
        "one router or several: a host or `host:port` (`[IPv6]:port`), or a "
        'comma-separated string (`"10.0.0.1,10.0.0.2:30002"`) or JSON list of them; at '
        f"most {MAX_ROUTERS}",
        None,
        parse_routers,
        'routers this instance registers with (see "Registering with a router")',
        "wildcard addresses, a router listed twice, an item without a port when "
        "`proxy_port` is unset",
    ),
    Option(
        "proxy_port",
        "port",
        None,
        parse_port,
        "discovery port of every `proxy_ip` item that has none; needed unless every "
        "item has its port",
        "given without `proxy_ip`",
    ),
    Option(
        "http_port",
        "port",
        None,
        parse_port,
        "this instance's API server port, which the routers forward to; required with "
        "`proxy_ip`; must not be one of the KV ports; a port other than `vllm serve "
        "--port` is reported at start (a warning: a port mapping may be in between)",
        "missing with `proxy_ip`, inside the KV port range",
    ),
    Option(
        "http_ip",
        "host (as `kv_ip`)",
        None,
        parse_advertised_host,
        "the host of this instance's API server as the routers must reach it; one that "
        "is not where `vllm serve --host` listens (or, with a wildcard `--host`, not "
        "an address of this machine, or not resolvable) is reported at start",
        "wildcard (`0.0.0.0`, `::`) and what `kv_ip` refuses",
        shown_default="`kv_ip` (or its default)",
    ),
    Option(
        "allowed_peers",
        "`host`, `host:port`, IP network; comma-separated string or JSON list",
        None,
        parse_allowed_peers,
        'peers a request may name without a router grant (see "Security")',
        "anything else: `kv_connector_extra_config.allowed_peers: 'x' is not peers: "
        "...`",
        shown_default="none",
    ),
    Option(
        "kv_checksum",
        ", ".join(f"`{name}`" for name in CHECKSUMS),
        NO_CHECKSUM,
        parse_checksum,
        "per-block checksum the sender attaches to every KV block and the receiver "
        "checks before the block is used (a mismatch is recomputed); must match the "
        "peers'; CPU transports only (tcp, gloo). Off by default: `crc32c` cost "
        '18-38 % of transfer time here (see "KV checksums")',
        "other strings; any but `none` with `transport` `nccl`",
    ),
    Option(
        "allow_unauthenticated",
        "JSON `true`/`false`",
        False,
        parse_bool,
        "start with a non-loopback `kv_ip` and no P2P secret (warned at start)",
        "anything but a boolean",
    ),
)
OPTION = {option.key: option for option in OPTIONS}
# Every key kv_connector_extra_config may hold; anything else is an error,
# so a typo is never silently ignored.
EXTRA_CONFIG_KEYS = tuple(OPTION)


def _check_bind_fields(fields: dict[str, Any], label: Callable[[str], str]) -> None:
    """``kv_bind_ip`` other than ``kv_ip``, and ``kv_data_port``, are the tcp
    transport's: gloo and nccl listen (and advertise) where they bind."""
    transport = fields["transport"]
    if transport not in ("gloo", "nccl"):
        return
    bind = fields["bind_host"]
    if bind is not None and canonical_host(bind) != canonical_host(fields["host"]):
        raise ConfigError(
            f"{label('kv_bind_ip')}, {label('transport')}: a bind address other than "
            f"kv_ip works with the tcp transport only ({transport} advertises the "
            "address it binds); use transport tcp or drop kv_bind_ip"
        )
    if fields["kv_data_port"] is not None:
        raise ConfigError(
            f"{label('kv_data_port')}, {label('transport')}: kv_data_port is the tcp "
            f"transport's data port; {transport} picks its own: use transport tcp or "
            "drop kv_data_port"
        )


def _check_cross_fields(
    fields: dict[str, Any], label: Callable[[str], str]
) -> dict[str, Any]:
    """The rules between options, for both ways in: ``proxy_ip`` needs its
    ports and ``http_port``; ``kv_checksum`` needs a CPU transport.
    ``fields``: parsed, by field name; ``label`` names a key in errors.
    Returns them with ``proxy_ip`` canonical and ``routers`` resolved."""
    if fields["kv_checksum"] != NO_CHECKSUM and fields["transport"] == "nccl":
        raise ConfigError(
            f"{label('kv_checksum')}, {label('transport')}: kv_checksum hashes KV in "
            "host memory (tcp, gloo); nccl keeps it on the GPU: set kv_checksum to "
            "none"
        )
    _check_bind_fields(fields, label)
    items, port = fields["proxy_ip"], fields["proxy_port"]
    ip_key, port_key = label("proxy_ip"), label("proxy_port")
    if items is None:
        if port is not None:
            raise ConfigError(
                f"{ip_key}, {port_key}: give both (register with a router) or neither"
            )
        return {**fields, "routers": ()}
    routers: list[tuple[str, int]] = []
    for host, own_port in items:
        if own_port is None and port is None:
            raise ConfigError(
                f"{ip_key}, {port_key}: give both (register with a router) or neither; "
                f"without {port_key} every router needs its port (host:port)"
            )
        router = (host, port if own_port is None else own_port)
        if router in routers:
            raise ConfigError(
                f"{ip_key}: router {format_addr(*router)} is listed twice"
            )
        routers.append(router)
    if fields["http_port"] is None:
        raise ConfigError(
            f"{label('http_port')}: required with proxy_ip/proxy_port (the port of "
            "this instance's API server that the router forwards requests to)"
        )
    text = ",".join(host if p is None else format_addr(host, p) for host, p in items)
    return {**fields, "proxy_ip": text, "routers": tuple(routers)}


def _parse_options(
    given: Mapping[str, Any], label: Callable[[str], str], *, fields: bool
) -> dict[str, Any]:
    """Every option, parsed by its row, then :func:`_check_cross_fields`.

    ``given``: values by key (the JSON) or, with ``fields``, by P2pConfig
    field (direct construction, where a field's own unit is checked and
    ``None`` is the unset default). Absent keys take their defaults.
    """
    out: dict[str, Any] = {}
    for option in OPTIONS:
        name = option.name if fields else option.key
        if name not in given:
            out[option.name] = option.absent() if option.absent else option.default
        elif fields and given[name] is None and option.default is None:
            out[option.name] = None
        else:
            parse = (option.check if fields else None) or option.parse
            out[option.name] = parse(label(option.key), given[name])
    return _check_cross_fields(out, label)


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


# --- credentials on one host -------------------------------------------------------

_logged_sources: set[tuple[str, str]] = set()


def _log_source(what: str, source: str, key: str | None = None) -> None:
    """Once per process and ``key`` (default: ``source``): where a credential
    came from (never its value)."""
    if (what, key or source) not in _logged_sources:
        _logged_sources.add((what, key or source))
        logger.info("%s: %s from %s", CONNECTOR_NAME, what, source)


def _with_local_cookie(
    secret: bytes | None,
    grant_token: bytes | None,
    fields: Mapping[str, Any],
    routers: tuple[tuple[str, int], ...],
) -> tuple[bytes | None, bytes | None]:
    """The credentials the environment gave, completed from this user's
    local cookie (``vllm_disagg/wire/cookie.py``) where it gave none and the
    instance is on loopback: the P2P secret when ``kv_ip`` is loopback, the
    router token when ``kv_ip``, the advertised HTTP host and every router
    are. The same user's router and instances on this host find the same
    cookie, so the seed's recipe runs on one machine with nothing exported,
    and another user, who cannot read the file, is refused. Anything beyond
    loopback keeps needing the variables (``check_security``).

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


# --- the dataclass -------------------------------------------------------------


@dataclass(frozen=True)
class P2pConfig:
    """Everything the connector reads from ``--kv-transfer-config``, typed
    and checked. Build it with :meth:`from_vllm_config`. The fields of the
    extra-config keys take their defaults (and their help) from :data:`OPTIONS`."""

    role: str  # kv_role
    base_port: int  # kv_port
    host: str = OPTION["kv_ip"].default
    bind_host: str | None = None  # kv_bind_ip; None: bind host
    kv_data_port: int | None = None
    send_type: SendType = OPTION["send_type"].default
    kv_buffer_size: int = OPTION["kv_buffer_size"].default
    mem_pool_size_bytes: int = OPTION["mem_pool_size_gb"].default
    transport: str = OPTION["transport"].default
    kv_load_timeout_s: float = OPTION["kv_load_timeout_s"].default
    kv_hold_timeout_s: float = OPTION["kv_hold_timeout_s"].default
    skip_cached_blocks: bool = OPTION["skip_cached_blocks"].default
    proxy_ip: str | None = None  # canonical text; a list is accepted too
    proxy_port: int | None = None
    http_port: int | None = None
    http_ip: str | None = None
    # Control-plane HMAC key (VLLM_DISAGG_P2P_SECRET); None: no authentication.
    secret: bytes | None = field(default=None, repr=False)
    # The router's token (VLLM_DISAGG_ROUTER_TOKEN): checks the peer grants.
    grant_token: bytes | None = field(default=None, repr=False)
    allowed_peers: AllowedPeers | None = None
    kv_checksum: str = OPTION["kv_checksum"].default
    allow_unauthenticated: bool = OPTION["allow_unauthenticated"].default
    # Derived from proxy_ip and proxy_port: (host, port) of every router.
    routers: tuple[tuple[str, int], ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        # Direct construction gets the same rows and rules as the JSON; errors name the
        # field.
        set_ = object.__setattr__
        set_(self, "role", parse_choice("role", self.role, ROLES))
        set_(self, "base_port", parse_port("base_port", self.base_port))
        given = {option.name: getattr(self, option.name) for option in OPTIONS}
        for name, value in _parse_options(
            given, lambda key: OPTION[key].name, fields=True
        ).items():
            set_(self, name, value)
        for name in ("secret", "grant_token"):
            if getattr(self, name) is not None and not isinstance(
                getattr(self, name), bytes
            ):
                raise ConfigError(f"{name}: must be bytes or None")
            set_(self, name, getattr(self, name) or None)

    @property
    def listen_host(self) -> str:
        """Where the workers' KV ports bind: ``kv_bind_ip``, else ``kv_ip``."""
        return self.bind_host or self.host

    @property
    def binds_beyond_loopback(self) -> bool:
        """Whether the workers' ports can be reached from other machines: bound
        (``kv_bind_ip``) or advertised (``kv_ip``, a forwarder may lead there)
        beyond loopback."""
        return not (is_loopback(self.host) and is_loopback(self.listen_host))

    def _open_key(self) -> str:
        """The key that makes the KV ports reachable beyond loopback."""
        if is_loopback(self.host):
            return f"{_EXTRA}.kv_bind_ip: {self.listen_host}"
        return f"{_EXTRA}.kv_ip: {self.host}"

    def check_security(self) -> None:
        """Safe by default, checked at start-up (API server and engine core):
        one line naming what to set when the configuration is open."""
        if self.binds_beyond_loopback and self.secret is None:
            if not self.allow_unauthenticated:
                raise ConfigError(
                    f"{self._open_key()} is reachable beyond loopback and the "
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
                    self.listen_host,
                    envs.VLLM_DISAGG_P2P_SECRET,
                )
        if (
            self.routers
            and self.grant_token is None
            and self.binds_beyond_loopback
            and not self.allow_unauthenticated
        ):
            raise ConfigError(
                f"{_EXTRA}.proxy_ip: registrations with the router from {self.host} "
                f"would be unsigned: set {envs.VLLM_DISAGG_ROUTER_TOKEN} to the "
                "router's token"
            )
        if self.grant_token is None and self.allowed_peers is None:
            raise ConfigError(
                f"{CONNECTOR_NAME}: nothing vouches for the peers a request names: set "
                f"{envs.VLLM_DISAGG_ROUTER_TOKEN} to the router's token (the router "
                "signs the peers of every request with it) or list the peers in "
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
    def from_kv_transfer_config(
        cls, kv_transfer_config, *, local_cookie: bool = True
    ) -> P2pConfig:
        """Parse vLLM's ``KVTransferConfig`` (after
        :func:`normalize_kv_transfer_json`); errors name the JSON key.

        The credentials come from the environment; where it sets none and
        everything is on loopback, from this user's local cookie
        (:func:`_with_local_cookie`), unless ``local_cookie`` is False (the
        command line's check, which must not create files)."""
        connector = getattr(kv_transfer_config, "kv_connector", None)
        if connector != CONNECTOR_NAME:
            raise ConfigError(
                f"kv_connector: {_show(connector)} is not {CONNECTOR_NAME}"
            )
        extra = kv_transfer_config.kv_connector_extra_config
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"{_EXTRA}: {_show(extra)} is not a JSON object")
        unknown = sorted(str(k) for k in extra if k not in OPTION)
        if unknown:
            close = difflib.get_close_matches(unknown[0], EXTRA_CONFIG_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{_EXTRA}.{unknown[0]}: unknown key{hint}; allowed keys are "
                f"{', '.join(EXTRA_CONFIG_KEYS)}"
            )
        role = parse_choice("kv_role", kv_transfer_config.kv_role, ROLES)
        base_port = parse_port("kv_port", kv_transfer_config.kv_port)
        secret, grant_token = envs.p2p_secret(), envs.router_token()
        fields = _parse_options(extra, lambda key: f"{_EXTRA}.{key}", fields=False)
        routers = fields.pop("routers")
        if local_cookie:
            secret, grant_token = _with_local_cookie(
                secret, grant_token, fields, routers
            )
        return cls(
            role=role,
            base_port=base_port,
            secret=secret,
            grant_token=grant_token,
            **fields,
        )

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
            raise ValueError(
                f"bad parallel sizes: dp_rank={dp_rank} tp={tp_size} pp={pp_size}"
            )
        if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
            raise ValueError(
                f"bad ranks: tp_rank={tp_rank}/{tp_size} pp_rank={pp_rank}/{pp_size}"
            )
        offset = dp_rank * tp_size * pp_size + pp_rank * tp_size + tp_rank
        port = self.base_port + offset
        if port > MAX_PORT:
            raise ConfigError(
                f"kv_port: {self.base_port} + {offset} (DP rank {dp_rank}, PP rank "
                f"{pp_rank}, TP rank {tp_rank}) is beyond {MAX_PORT}; kv_port must "
                f"be at most {MAX_PORT - offset}"
            )
        return port

    def data_port(self, worker_port: int) -> int:
        """The tcp data port of the worker whose control port is ``worker_port``
        (same offset from ``kv_data_port``); 0 (a free port) when unset."""
        if self.kv_data_port is None:
            return 0
        return self.kv_data_port + (worker_port - self.base_port)

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
        if self.kv_data_port is not None:
            data = range(self.kv_data_port, self.kv_data_port + count)
            if data[-1] > MAX_PORT:
                raise ConfigError(
                    f"{_EXTRA}.kv_data_port: {self.kv_data_port} needs ports "
                    f"{data[0]}..{data[-1]} for {count} workers, beyond {MAX_PORT}"
                )
            clash = set(data) & (set(ports) | {self.http_port})
            if clash:
                raise ConfigError(
                    f"{_EXTRA}.kv_data_port: ports {data[0]}..{data[-1]} overlap the "
                    f"KV ports {ports[0]}..{ports[-1]} or http_port (port "
                    f"{min(clash)}); choose ports apart"
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
        if self.role == KV_CONSUMER and push:
            why = (
                "prefill pushes the KV to the decode rank the request names, but the "
                "API server may hand the request to another rank"
            )
        elif self.role == KV_PRODUCER and not push:
            why = (
                "decode pulls the KV from the prefill rank the request names, but the "
                "API server may have run the prefill on another rank"
            )
        elif self.role == KV_BOTH:
            why = (
                "kv_both picks its side by comparing the request's addresses with its "
                "own rank's, and the API server may hand the request to another rank"
            )
        else:
            return
        raise ConfigError(
            f"{CONNECTOR_NAME}: kv_role {self.role} with send_type "
            f"{self.send_type.value} cannot run {dp} DP ranks behind one API server "
            f"(internal load balancing): {why}; run one `vllm serve` per DP rank "
            "(--data-parallel-rank N, external load balancing) so each rank registers "
            "as its own instance"
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


# --- docs/p2p_connector.md's key table, rendered from OPTIONS ---------------------

DOC_BEGIN = (
    "<!-- BEGIN kv_connector_extra_config table: generated from OPTIONS in "
    "vllm_disagg/distributed/kv_transfer/kv_connector/v1/p2p/config.py by "
    "`python -m vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config`; "
    "do not edit by hand -->"
)
DOC_END = "<!-- END kv_connector_extra_config table -->"


def _shown_default(option: Option) -> str:
    if option.shown_default:
        return option.shown_default
    value = option.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, SendType):
        return f"`{value.value}`"
    return f"{value:g}" if isinstance(value, float) else str(value)


def markdown_table(options: tuple[Option, ...] = OPTIONS) -> str:
    """The docs' table of ``kv_connector_extra_config`` keys, one row per option."""
    rows = [
        "| key | type | default | meaning | refused |",
        "| --- | --- | --- | --- | --- |",
    ]
    for o in options:
        rows.append(
            f"| `{o.key}` | {o.type} | {_shown_default(o)} | {o.help} | {o.refused} |"
        )
    return "\n".join(rows)


def doc_table(text: str) -> str:
    """The generated part of the docs, between the markers."""
    begin, end = text.index(DOC_BEGIN) + len(DOC_BEGIN), text.index(DOC_END)
    return text[begin:end].strip("\n")


def update_doc(path: str | Path) -> bool:
    """Rewrite the table between the markers; returns whether it changed."""
    path = Path(path)
    text = path.read_text()
    begin, end = text.index(DOC_BEGIN) + len(DOC_BEGIN), text.index(DOC_END)
    new = f"{text[:begin]}\n{markdown_table()}\n{text[end:]}"
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":  # rewrite the docs' table (run from the repository's root)
    path = sys.argv[1] if len(sys.argv) > 1 else "docs/p2p_connector.md"
    print(f"{path}: {'updated' if update_doc(path) else 'up to date'}")
