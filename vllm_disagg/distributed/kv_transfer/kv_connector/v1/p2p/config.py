"""The P2pNcclConnector's options: one frozen dataclass parsed from
``--kv-transfer-config``, with one-line errors that name the key.

Every key of ``kv_connector_extra_config`` is one row of :data:`OPTIONS`
(``extra_config.py``: type, default, parser, help, and the docs' key table
rendered from the rows); the rules between keys are one function here,
``_check_cross_fields``. Direct construction and the JSON go through both.
What the options allow is ``security.py`` (safe by default, the local
cookie); where the workers listen is ``ports.py``; the seed document's legacy
JSON is made acceptable to vLLM 0.32 by ``seed_json.py``.

Users select the connector with the seed design document's JSON::

    --kv-transfer-config '{"kv_connector":"P2pNcclConnector","kv_role":"kv_producer",
      "kv_buffer_size":"1e1","kv_port":"21001",
      "kv_connector_extra_config":{"proxy_ip":"10.0.1.1","proxy_port":"30001",
                                   "http_port":"20001"}}'

Decisions:

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
  file ``VLLM_DISAGG_P2P_SECRET_FILE`` names); see ``security.py``.
* ``proxy_ip`` names one router or several (router replicas behind a load
  balancer must all know the fleet): a host, ``host:port``, or a
  comma-separated string or JSON list of them; items without a port use
  ``proxy_port``. Every DP rank registers with every router (registration.py).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_disagg import envs
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import ports, security
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.checksum import (
    NONE as NO_CHECKSUM,
)

# Re-exported: users and the connector's modules name them with P2pConfig.
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.extra_config import (  # noqa: F401
    EXTRA_CONFIG_KEYS,
    GIB,
    OPTION,
    OPTIONS,
    TRANSPORTS,
    SendType,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.roles import (
    CONNECTOR_NAME,
    KV_ROLES,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.security import (
    AllowedPeers,
)

# Re-exported: the patches, the exporter and users import them from here.
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.seed_json import (  # noqa: F401
    DEFAULT_KV_LOAD_FAILURE_POLICY,
    IGNORED_TOP_LEVEL_KEYS,
    LEGACY_TOP_LEVEL_KEYS,
    MOVED_TOP_LEVEL_KEYS,
    normalize_kv_transfer_json,
)
from vllm_disagg.errors import ConfigError
from vllm_disagg.options import parsers
from vllm_disagg.options.rows import parse_rows
from vllm_disagg.wire.peers import canonical_host, format_addr, is_loopback

ROLES = KV_ROLES
_EXTRA = "kv_connector_extra_config"


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
    """Every option parsed by its row (``options.rows.parse_rows``), then
    :func:`_check_cross_fields`."""
    return _check_cross_fields(
        parse_rows(OPTIONS, given, label, by_field=fields), label
    )


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
        set_(self, "role", parsers.choice("role", self.role, ROLES))
        set_(self, "base_port", parsers.port("base_port", self.base_port))
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

    def check_security(self) -> None:
        """Safe by default, checked at start-up (API server and engine core):
        one line naming what to set when the configuration is open
        (``security.py``)."""
        security.check_security(self)

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
                f"kv_connector: {parsers.show(connector)} is not {CONNECTOR_NAME}"
            )
        extra = kv_transfer_config.kv_connector_extra_config
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"{_EXTRA}: {parsers.show(extra)} is not a JSON object")
        unknown = sorted(str(k) for k in extra if k not in OPTION)
        if unknown:
            close = difflib.get_close_matches(unknown[0], EXTRA_CONFIG_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{_EXTRA}.{unknown[0]}: unknown key{hint}; allowed keys are "
                f"{', '.join(EXTRA_CONFIG_KEYS)}"
            )
        role = parsers.choice("kv_role", kv_transfer_config.kv_role, ROLES)
        base_port = parsers.port("kv_port", kv_transfer_config.kv_port)
        secret, grant_token = envs.p2p_secret(), envs.router_token()
        fields = _parse_options(extra, lambda key: f"{_EXTRA}.{key}", fields=False)
        routers = fields.pop("routers")
        if local_cookie:
            secret, grant_token = security.with_local_cookie(
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

    # --- the port plan: one control-plane port per worker (ports.py) -------

    def worker_port(
        self, *, dp_rank: int, tp_size: int, pp_size: int, tp_rank: int, pp_rank: int
    ) -> int:
        """The port of one worker: ``kv_port`` plus the worker's global index."""
        return ports.worker_port(
            self.base_port,
            dp_rank=dp_rank,
            tp_size=tp_size,
            pp_size=pp_size,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
        )

    def data_port(self, worker_port: int) -> int:
        """The tcp data port of the worker whose control port is ``worker_port``
        (same offset from ``kv_data_port``); 0 (a free port) when unset."""
        if self.kv_data_port is None:
            return 0
        return self.kv_data_port + (worker_port - self.base_port)

    def instance_port(self, dp_rank: int, tp_size: int, pp_size: int) -> int:
        """The port of a DP rank's first worker, which names the instance."""
        return ports.instance_port(self.base_port, dp_rank, tp_size, pp_size)

    def check_port_plan(self, parallel_config) -> range:
        """Every worker's port (and tcp data port) exists and is not
        ``http_port``; returns the control ports."""
        return ports.check_port_plan(
            self.base_port, self.http_port, parallel_config, self.kv_data_port
        )

    def check_dp_load_balancing(self, parallel_config) -> None:
        """Refuse the DP layouts in which a request may not land on the rank it
        names (``ports.check_dp_load_balancing`` says which and why)."""
        ports.check_dp_load_balancing(self.role, self.send_type.value, parallel_config)


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
