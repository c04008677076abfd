"""The rows of ``kv_connector_extra_config``: one option per key, and its docs table.

Each key the P2pNcclConnector reads from the extra config is one
:class:`~vllm_disagg.options.rows.Option` of :data:`OPTIONS` (type, default,
parser, help, what is refused), with the value parsers of this connector's
own kinds of value. What a key may hold lives here; the rules between keys
and the typed :class:`P2pConfig` built from them are ``config.py``.
docs/p2p_connector.md's key table is rendered from these rows.

Imports no torch and no vLLM at module level: the transports take
:data:`TRANSPORTS` from here, and the command line's check reads the rows.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any

from vllm_disagg import envs
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import security
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
from vllm_disagg.errors import ConfigError
from vllm_disagg.options import parsers, tables
from vllm_disagg.options.parsers import MAX_TIMEOUT_S
from vllm_disagg.options.rows import Option, by_key
from vllm_disagg.options.tables import DocTable, markers


class SendType(str, enum.Enum):
    """How KV reaches the decode instance (names of the seed documents)."""

    PUT = "PUT"  # prefill sends after the forward pass
    GET = "GET"  # decode asks for it; prefill keeps the blocks until taken
    PUT_ASYNC = "PUT_ASYNC"  # prefill sends layer by layer during the pass


# The transport names (transport/ imports them from here: reading options
# must not import torch).
TRANSPORTS = ("auto", "tcp", "gloo", "nccl", "fake")

MAX_MEM_POOL_SIZE_GB = 16384.0
MAX_ROUTERS = 16
GIB = 1 << 30


# --- value parsers of this connector's own keys ------------------------------


def parse_gib(key: str, value: Any) -> int:
    """A size in GiB (float) as bytes."""
    allowed = (
        f"a size in GiB (>= 0 and <= {MAX_MEM_POOL_SIZE_GB:.0f}; 0 disables the pool)"
    )
    gib = parsers.number(key, value, allowed)
    if not 0 <= gib <= MAX_MEM_POOL_SIZE_GB:
        raise parsers.refuse(key, value, allowed)
    return int(gib * GIB)


def parse_checksum(key: str, value: Any) -> str:
    """One of ``checksum.OFFERED``, whose library is installed."""
    name = parsers.choice(key, value, CHECKSUMS)
    try:
        make_checksum(name)
    except ChecksumUnavailable as e:
        raise ConfigError(f"{key}: {e}") from None
    return name


def parse_kv_ip(key: str, value: Any) -> str:
    """``kv_ip``: an advertised host; a wildcard is refused with a pointer to
    ``kv_bind_ip``, which may bind one."""
    hint = " (kv_bind_ip binds a wildcard)" if key.endswith("kv_ip") else ""
    return parsers.advertised_host(key, value, wildcard_hint=hint)


def parse_send_type(key: str, value: Any) -> SendType:
    return SendType(parsers.choice(key, value, tuple(t.value for t in SendType)))


_ROUTERS_WHAT = (
    "a router address: host or host:port ([IPv6]:port), or a comma-separated "
    "string or JSON list of them"
)


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
                raise parsers.refuse(key, value, _ROUTERS_WHAT) from None
        else:
            items = text.split(",")
    if not isinstance(items, list | tuple) or not items:
        raise parsers.refuse(key, value, _ROUTERS_WHAT)
    if len(items) > MAX_ROUTERS:
        raise ConfigError(f"{key}: {len(items)} routers; at most {MAX_ROUTERS}")
    return tuple(parsers.host_port(key, item, _ROUTERS_WHAT) for item in items)


def _default_host() -> str:
    """kv_ip when the JSON has none: the address ``vllm serve --host`` listens
    on, else vLLM's ``get_ip()``."""
    served = envs.serve_host()
    if served is not None:
        try:
            return parsers.advertised_host("kv_ip (from vllm serve --host)", served)
        except ConfigError:
            pass
    from vllm.utils.network_utils import get_ip

    host = get_ip()
    if host in ("0.0.0.0", "::"):
        # get_ip() found no route; an unspecified address is no use to peers.
        return "127.0.0.1"
    return host


# --- the options: one row per kv_connector_extra_config key ------------------


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
        parsers.byte_size,
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
        check=parsers.byte_size,
    ),
    Option(
        "kv_ip",
        "IPv4, IPv6 (brackets optional), host name",
        "127.0.0.1",
        parse_kv_ip,
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
        parsers.host,
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
        parsers.port,
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
        lambda key, value: parsers.choice(key, value, TRANSPORTS),
        "data plane; must match the peers'",
        "other strings",
        shown_default="`auto` (nccl on CUDA, tcp otherwise)",
    ),
    Option(
        "kv_load_timeout_s",
        "seconds",
        30.0,
        parsers.seconds,
        "D: how long a request waits for its KV before it is recomputed",
        f"≤ 0, > {MAX_TIMEOUT_S:.0f}",
    ),
    Option(
        "kv_hold_timeout_s",
        "seconds",
        60.0,
        parsers.seconds,
        "P: how long a send may take / held blocks wait for a pull; D: how long "
        "unclaimed KV is kept; channel set-up on D",
        f"≤ 0, > {MAX_TIMEOUT_S:.0f}",
    ),
    Option(
        "skip_cached_blocks",
        "JSON `true`/`false`",
        True,
        parsers.boolean,
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
        parsers.port,
        "discovery port of every `proxy_ip` item that has none; needed unless every "
        "item has its port",
        "given without `proxy_ip`",
    ),
    Option(
        "http_port",
        "port",
        None,
        parsers.port,
        "this instance's API server port, which the routers forward to; required with "
        "`proxy_ip`; must not be one of the KV ports; a port other than `vllm serve "
        "--port` is reported at start (a warning: a port mapping may be in between)",
        "missing with `proxy_ip`, inside the KV port range",
    ),
    Option(
        "http_ip",
        "host (as `kv_ip`)",
        None,
        parsers.advertised_host,
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
        security.parse_allowed_peers,
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
        parsers.boolean,
        "start with a non-loopback `kv_ip` and no P2P secret (warned at start)",
        "anything but a boolean",
    ),
)
OPTION = by_key(OPTIONS)
# Every key kv_connector_extra_config may hold; anything else is an error,
# so a typo is never silently ignored.
EXTRA_CONFIG_KEYS = tuple(OPTION)


# --- docs/p2p_connector.md's key table, rendered from OPTIONS ---------------------

DOC_BEGIN, DOC_END = markers(
    "kv_connector_extra_config",
    "OPTIONS in "
    "vllm_disagg/distributed/kv_transfer/kv_connector/v1/p2p/extra_config.py",
)
DOC_TABLE = DocTable(DOC_BEGIN, DOC_END, lambda: markdown_table())


def markdown_table(options: tuple[Option, ...] = OPTIONS) -> str:
    """The docs' table of ``kv_connector_extra_config`` keys, one row per option."""
    return tables.markdown_table(options, tables.KEY_COLUMNS)


def doc_table(text: str) -> str:
    """The generated part of the docs, between the markers."""
    return DOC_TABLE.current(text)


def update_doc(path: str | Path) -> bool:
    """Rewrite the table between the markers; returns whether it changed."""
    return DOC_TABLE.update(path)
