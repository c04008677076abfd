"""dp-ipv6-master-port: DP rank 0 picks the DP group's port with a socket of
the master address's family, so --data-parallel-address ::1 works.

The patched ParallelConfig._pick_stateless_dp_port is called directly, with a
real coordination store (a TCPStore on the same address) as launch_core_engines
creates it for DP > 1.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
from vllm.config.parallel import ParallelConfig
from vllm.distributed.utils import create_tcp_store

from vllm_disagg.patches import PATCHES
from vllm_disagg.patches.config import parallel

BY_NAME = {p.name: p for p in PATCHES}


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


ADDRESSES = [
    pytest.param("127.0.0.1", socket.AF_INET, id="ipv4"),
    pytest.param(
        "::1",
        socket.AF_INET6,
        id="ipv6",
        marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here"),
    ),
]


def _configs(ip: str, store_port: int) -> list[SimpleNamespace]:
    """What the method reads of a ParallelConfig, for DP ranks 0 and 1."""
    return [
        SimpleNamespace(
            data_parallel_master_ip=ip,
            _coord_store_port=store_port,
            data_parallel_rank=rank,
        )
        for rank in (0, 1)
    ]


def test_registered_as_an_enabler_next_to_the_probe():
    enabler, probe = BY_NAME["dp-ipv6-master-port"], BY_NAME["dp-collective-probe"]
    assert (enabler.kind, probe.kind) == ("enabler", "probe")
    assert enabler.module == probe.module == parallel.__name__
    assert (enabler.apply_fn, enabler.check_fn) == (
        "apply_ipv6_dp_port",
        "is_ipv6_dp_port_applied",
    )


def test_apply_replaces_the_method(monkeypatch):
    monkeypatch.setattr(
        ParallelConfig,
        "_pick_stateless_dp_port",
        parallel._upstream_pick_stateless_dp_port,
    )
    assert not parallel.is_ipv6_dp_port_applied()
    parallel.apply_ipv6_dp_port()
    assert parallel.is_ipv6_dp_port_applied()
    assert ParallelConfig._pick_stateless_dp_port is parallel._pick_stateless_dp_port


@pytest.mark.parametrize("ip, family", ADDRESSES)
def test_rank0_listens_in_the_address_family_and_publishes_the_port(ip, family):
    store = create_tcp_store(
        ip, 0, is_master=True, world_size=-1, wait_for_workers=False
    )
    rank0, rank1 = _configs(ip, store.port)
    port, listen_socket = parallel._pick_stateless_dp_port(rank0)
    try:
        assert listen_socket is not None and listen_socket.family == family
        assert listen_socket.getsockname()[:2] == (ip, port)
        # A peer reads the same port from the store and can connect to it.
        assert parallel._pick_stateless_dp_port(rank1) == (port, None)
        with socket.create_connection((ip, port), timeout=5):
            pass
    finally:
        listen_socket.close()


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_upstream_fails_on_ipv6():
    """Why the patch exists; when this fails, upstream binds IPv6 itself and
    the patch can go (drop_when)."""
    store = create_tcp_store(
        "::1", 0, is_master=True, world_size=-1, wait_for_workers=False
    )
    rank0, _ = _configs("::1", store.port)
    with pytest.raises(OSError, match="Address family"):
        parallel._upstream_pick_stateless_dp_port(rank0)


def test_without_a_coordination_store_upstream_pops_a_preallocated_port():
    config = SimpleNamespace(
        data_parallel_master_ip="::1",
        _coord_store_port=0,
        get_next_dp_init_port=lambda: 29123,
    )
    assert parallel._pick_stateless_dp_port(config) == (29123, None)
