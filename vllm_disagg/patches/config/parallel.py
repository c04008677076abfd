"""Patches of ``vllm.config.parallel.ParallelConfig``; two registry entries.

``dp-ipv6-master-port`` (enabler, :func:`apply_ipv6_dp_port`). Upstream:
``ParallelConfig._pick_stateless_dp_port``. When the DP group is formed
through the coordination store, DP rank 0 binds a listening socket to the
DP master IP to pick the group's port, and always as IPv4
(``socket.AF_INET``): with ``--data-parallel-address ::1`` (any IPv6
address) it fails with "Address family for hostname not supported" and no
DP engine starts. The patched method binds an ``AF_INET6`` socket when the
address is IPv6 (``vllm.utils.network_utils.is_valid_ipv6_address``, as
vLLM's other socket helpers decide) and is upstream's method otherwise.

``dp-collective-probe`` (probe, :func:`apply`). Upstream:
``ParallelConfig.sync_dp_state`` and ``has_unfinished_dp``, the gloo
all-reduces upstream's ``DPEngineCoreProc`` makes every ``dp_sync_interval``
steps (and on resume). Wrapped to count calls for the benchmark; only
applied with ``VLLM_DISAGG_PROBE=1``.
"""

from __future__ import annotations

import functools
import socket

from vllm.config.parallel import ParallelConfig
from vllm.utils.network_utils import is_valid_ipv6_address

from vllm_disagg.v1.metrics.probe import PROBE

# --- dp-ipv6-master-port (enabler) -------------------------------------------

_upstream_pick_stateless_dp_port = ParallelConfig._pick_stateless_dp_port

DP_MASTER_PORT_KEY = "dp_master_port"  # upstream's store key


@functools.wraps(_upstream_pick_stateless_dp_port)
def _pick_stateless_dp_port(self) -> tuple[int, socket.socket | None]:
    """Upstream's method, with the listening socket in the address's family."""
    if not self._coord_store_port or not is_valid_ipv6_address(
        self.data_parallel_master_ip
    ):
        return _upstream_pick_stateless_dp_port(self)

    from vllm.distributed.utils import get_cached_tcp_store_client

    store = get_cached_tcp_store_client(
        self.data_parallel_master_ip, self._coord_store_port
    )
    if self.data_parallel_rank == 0:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.bind((self.data_parallel_master_ip, 0))
        s.listen()
        port = s.getsockname()[1]
        store.set(DP_MASTER_PORT_KEY, str(port).encode())
        return port, s
    return int(store.get(DP_MASTER_PORT_KEY).decode()), None


def apply_ipv6_dp_port() -> None:
    ParallelConfig._pick_stateless_dp_port = _pick_stateless_dp_port


def is_ipv6_dp_port_applied() -> bool:
    return ParallelConfig.__dict__["_pick_stateless_dp_port"] is _pick_stateless_dp_port


# --- dp-collective-probe (probe) ---------------------------------------------

_NAMES = ("sync_dp_state", "has_unfinished_dp")
_upstream = {name: ParallelConfig.__dict__[name].__func__ for name in _NAMES}


def _counting(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        PROBE.count("blocking_collectives")
        return fn(*args, **kwargs)

    wrapper.__vllm_disagg_probe__ = True
    return wrapper


def apply() -> None:
    for name, fn in _upstream.items():
        setattr(ParallelConfig, name, staticmethod(_counting(fn)))


def is_applied() -> bool:
    return all(
        getattr(ParallelConfig.__dict__[name].__func__, "__vllm_disagg_probe__", False)
        for name in _NAMES
    )
