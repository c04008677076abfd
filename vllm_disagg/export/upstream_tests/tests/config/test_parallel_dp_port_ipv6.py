"""DP rank 0 binds the DP group's port in the family of the master address."""

import socket
from types import SimpleNamespace

import pytest

from vllm.config.parallel import ParallelConfig
from vllm.distributed.utils import create_tcp_store

pytestmark = pytest.mark.cpu_test


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    ("ip", "family"),
    [
        pytest.param("127.0.0.1", socket.AF_INET, id="ipv4"),
        pytest.param(
            "::1",
            socket.AF_INET6,
            id="ipv6",
            marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback"),
        ),
    ],
)
def test_rank0_binds_in_the_master_address_family(ip, family):
    store = create_tcp_store(ip, 0, is_master=True)
    ranks = [
        SimpleNamespace(
            data_parallel_master_ip=ip,
            _coord_store_port=store.port,
            data_parallel_rank=rank,
        )
        for rank in (0, 1)
    ]
    port, sock = ParallelConfig._pick_stateless_dp_port(ranks[0])
    try:
        assert sock is not None and sock.family == family
        assert sock.getsockname()[1] == port
        # Rank 1 reads the port rank 0 published.
        assert ParallelConfig._pick_stateless_dp_port(ranks[1]) == (port, None)
    finally:
        sock.close()
