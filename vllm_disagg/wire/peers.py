"""How a request names its P2P peers: the request-id / ``kv_transfer_params``
codec, and the ``host:port`` grammar every component shares.

Standard library only: the router (which runs without vLLM) and the
connector both import it, and neither imports the other.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import uuid
from dataclasses import dataclass
from typing import Any

# --- request-id / kv_transfer_params codec (standard library only) ----------
#
# A proxy (or router) names the prefill and decode instances of a request in
# one of two ways; both sides of the transfer must find the same peers and the
# same key:
#
# * kv_transfer_params (the request body), keys PREFILL_ADDR_KEY,
#   DECODE_ADDR_KEY, REQUEST_KEY_KEY; these win when present;
# * the seed's request id (X-Request-Id)
#   ___prefill_addr_{host:port}___decode_addr_{host:port}_{key}.
#
# vLLM never shows the connector the proxy's id itself: it wraps it
# (cmpl-{id}-0, chatcmpl-{id}), appends a random -{8 hex} per engine, and
# prefixes {k}_ for the children of n > 1. So the id is *searched* for the
# pattern, each field has a bounded grammar that cannot run into the next one,
# and the transfer key is the proxy's token after the decode address (up to
# the next "-", "_" or the end), which prefill and decode share; never the
# internal id, which differs between them.

# kv_transfer_params keys (request body in, response out).
PREFILL_ADDR_KEY = "p2p_prefill_addr"
DECODE_ADDR_KEY = "p2p_decode_addr"
REQUEST_KEY_KEY = "p2p_request_key"
PEER_INFO_KEYS = (PREFILL_ADDR_KEY, DECODE_ADDR_KEY, REQUEST_KEY_KEY)

PREFILL_MARKER = "___prefill_addr_"
DECODE_MARKER = "___decode_addr_"
MAX_KEY_CHARS = 128
MAX_HOST_CHARS = 253
MAX_ADDR_CHARS = MAX_HOST_CHARS + 8  # "[" host "]:" port

# Bounded pieces: a host name has no "_" and no ":", an IPv6 address is
# bracketed, a port has at most 5 digits; no piece can eat into the next.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = rf"(?:\[[0-9A-Fa-f:.]{{2,45}}\]|{_LABEL}(?:\.{_LABEL}){{0,126}})"
_PORT = r"[0-9]{1,5}"
_KEY = rf"[0-9A-Za-z]{{1,{MAX_KEY_CHARS}}}"

_ADDR_RE = re.compile(rf"(?P<host>{_HOST}):(?P<port>{_PORT})")
_KEY_RE = re.compile(_KEY)
_ID_RE = re.compile(
    rf"{PREFILL_MARKER}(?P<p_host>{_HOST}):(?P<p_port>{_PORT})"
    rf"{DECODE_MARKER}(?P<d_host>{_HOST}):(?P<d_port>{_PORT})"
    rf"_(?P<key>{_KEY})(?=[-_]|\Z)"
)


class PeerInfoError(ValueError):
    """A request names its peers, but not in a form this codec accepts."""


@dataclass(frozen=True)
class PeerInfo:
    """The peers of one request and the key both sides file its KV under.

    Hosts are stored without brackets (``::1``); ``*_addr`` add them back.
    """

    prefill_host: str
    prefill_port: int
    decode_host: str
    decode_port: int
    key: str

    @property
    def prefill_addr(self) -> str:
        return format_addr(self.prefill_host, self.prefill_port)

    @property
    def decode_addr(self) -> str:
        return format_addr(self.decode_host, self.decode_port)

    def to_kv_transfer_params(self) -> dict[str, str]:
        return make_kv_transfer_params(self.prefill_addr, self.decode_addr, self.key)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_host(label: str, host: str) -> str:
    """The host of an address the grammar matched, without brackets and in
    its own spelling; PeerInfoError unless :func:`check_host` accepts it."""
    check_host(host, label)
    return host[1:-1] if host.startswith("[") else host


_HOSTNAME_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")


def check_host(host: Any, label: str = "host") -> str:
    """A host as a user writes it (configuration, flags): an IPv4 address, an
    IPv6 address (brackets optional) or a host name, returned without
    brackets, IPv6 compressed. The grammar of the request-id codec: no
    underscores in names, no IPv6 zone ids. PeerInfoError naming ``label``."""
    what = "is not an IPv4 or IPv6 address or a host name"
    if not isinstance(host, str) or not host.strip() or len(host) > 255:
        raise PeerInfoError(f"{label}: {_show(host)} {what}")
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
        if ":" not in text:
            raise PeerInfoError(f"{label}: {_show(host)} {what}")
    if ":" in text:
        if "%" in text:
            raise PeerInfoError(
                f"{label}: {_show(host)}: IPv6 zone ids are not supported"
            )
        try:
            return str(ipaddress.IPv6Address(text))
        except ValueError:
            raise PeerInfoError(f"{label}: {_show(host)} {what}") from None
    if re.fullmatch(r"[0-9.]+", text):
        try:
            return str(ipaddress.IPv4Address(text))
        except ValueError:
            raise PeerInfoError(f"{label}: {_show(host)} {what}") from None
    if len(text) > MAX_HOST_CHARS or not _HOSTNAME_RE.fullmatch(text):
        raise PeerInfoError(f"{label}: {_show(host)} {what}")
    return text


def _check_port(label: str, port: str) -> int:
    value = int(port)  # the grammar allows 1-5 digits only
    if not 1 <= value <= 65535:
        raise PeerInfoError(f"{label}: port {port} is not in 1..65535")
    return value


def split_addr(addr: Any, label: str = "address") -> tuple[str, int]:
    """``"host:port"`` / ``"[v6]:port"`` -> ``(host, port)``; PeerInfoError
    naming ``label`` otherwise. An unbracketed IPv6 address is ambiguous and
    refused."""
    if not isinstance(addr, str) or len(addr) > MAX_ADDR_CHARS:
        raise PeerInfoError(f"{label}: {_show(addr)} is not 'host:port'")
    return _split_valid_addr(addr, label)


# The router names the same few registered peers on every request; an
# IP address parse costs more than the rest of the naming. Only valid
# addresses are cached (lru_cache keeps no exceptions), and at most 4096.
@functools.lru_cache(maxsize=4096)
def _split_valid_addr(addr: str, label: str) -> tuple[str, int]:
    match = _ADDR_RE.fullmatch(addr)
    if match is None:
        raise PeerInfoError(
            f"{label}: {_show(addr)} is not 'host:port' (IPv6 as '[addr]:port')"
        )
    return _check_host(label, match["host"]), _check_port(label, match["port"])


def format_addr(host: str, port: int) -> str:
    """``(host, port)`` -> ``"host:port"``, IPv6 bracketed (``"[::1]:21001"``)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def canonical_addr(addr: str) -> tuple[str, int]:
    """``(host, port)`` of a valid ``host:port`` in one spelling per address:
    IPs compressed (``[0:0:0:0:0:0:0:1]`` -> ``::1``), names case-folded
    without a trailing dot. Two spellings of one address compare equal."""
    host, port = split_addr(addr)
    return canonical_host(host), port


def canonical_host(host: str) -> str:
    """A host (IPv6 brackets optional) in the spelling of :func:`canonical_addr`."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host.lower().rstrip(".")


def source_host(address: str | None) -> str | None:
    """The canonical host of the IP a connection came from, as a socket
    reports it (a dual-stack socket shows IPv4 peers as ``::ffff:a.b.c.d``)."""
    if not address:
        return None
    try:
        mapped = ipaddress.IPv6Address(address).ipv4_mapped
    except ValueError:
        mapped = None
    return canonical_host(str(mapped) if mapped is not None else address)


def is_loopback(host: str) -> bool:
    """True for loopback addresses and ``localhost``; a host name is not
    resolved (it may name any machine)."""
    host = canonical_host(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_key(key: Any, label: str = "key") -> str:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise PeerInfoError(
            f"{label}: {_show(key)} is not 1..{MAX_KEY_CHARS} letters or digits"
        )
    return key


def make_request_id(prefill_addr: str, decode_addr: str, key: str | None = None) -> str:
    """The seed's request id (``X-Request-Id``) a proxy sends to both sides:
    ``___prefill_addr_{P}___decode_addr_{D}_{key}``, key a fresh uuid hex by
    default."""
    split_addr(prefill_addr, "prefill_addr")
    split_addr(decode_addr, "decode_addr")
    key = check_key(uuid.uuid4().hex if key is None else key)
    return f"{PREFILL_MARKER}{prefill_addr}{DECODE_MARKER}{decode_addr}_{key}"


def make_kv_transfer_params(
    prefill_addr: str, decode_addr: str, key: str
) -> dict[str, str]:
    """The same information as ``kv_transfer_params`` (survives any id rewrite)."""
    split_addr(prefill_addr, PREFILL_ADDR_KEY)
    split_addr(decode_addr, DECODE_ADDR_KEY)
    check_key(key, REQUEST_KEY_KEY)
    return {
        PREFILL_ADDR_KEY: prefill_addr,
        DECODE_ADDR_KEY: decode_addr,
        REQUEST_KEY_KEY: key,
    }


def _from_params(params: dict) -> PeerInfo:
    for name in PEER_INFO_KEYS:
        if name not in params:
            raise PeerInfoError(
                f"kv_transfer_params.{name}: missing; give {', '.join(PEER_INFO_KEYS)} "
                "together"
            )
    label = "kv_transfer_params."
    p_host, p_port = split_addr(params[PREFILL_ADDR_KEY], label + PREFILL_ADDR_KEY)
    d_host, d_port = split_addr(params[DECODE_ADDR_KEY], label + DECODE_ADDR_KEY)
    key = check_key(params[REQUEST_KEY_KEY], label + REQUEST_KEY_KEY)
    return PeerInfo(p_host, p_port, d_host, d_port, key)


def _from_request_id(request_id: str) -> PeerInfo | None:
    start = request_id.find(PREFILL_MARKER)
    if start < 0:
        if DECODE_MARKER in request_id:
            raise PeerInfoError(
                f"request id: {DECODE_MARKER!r} without {PREFILL_MARKER!r} before it"
            )
        return None
    # Anchored at the marker: the cost is bounded by the pattern, not the id.
    match = _ID_RE.match(request_id, start)
    if match is None:
        raise PeerInfoError(
            f"request id: {_show(request_id[start : start + 80])} is not "
            f"'{PREFILL_MARKER}host:port{DECODE_MARKER}host:port_key' "
            f"(key: 1..{MAX_KEY_CHARS} letters or digits, IPv6 hosts in brackets)"
        )
    p_host = _check_host("request id prefill address", match["p_host"])
    d_host = _check_host("request id decode address", match["d_host"])
    return PeerInfo(
        p_host,
        _check_port("request id prefill address", match["p_port"]),
        d_host,
        _check_port("request id decode address", match["d_port"]),
        match["key"],
    )


def parse_peer_info(
    request_id: str, kv_transfer_params: dict | None
) -> PeerInfo | None:
    """The peers of a request: from ``kv_transfer_params`` when it carries any
    of :data:`PEER_INFO_KEYS` (then all of them, valid), else from the request
    id (vLLM's internal one is fine). None: the request names no peers (an
    ordinary request, prefilled locally). PeerInfoError: it tries to, wrongly.
    """
    if isinstance(kv_transfer_params, dict) and any(
        name in kv_transfer_params for name in PEER_INFO_KEYS
    ):
        return _from_params(kv_transfer_params)
    if not isinstance(request_id, str):
        raise PeerInfoError(f"request id: {_show(request_id)} is not a string")
    return _from_request_id(request_id)
