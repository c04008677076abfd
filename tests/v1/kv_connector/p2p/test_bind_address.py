"""Bind and advertised addresses (``kv_bind_ip`` / ``kv_ip``, ``kv_data_port``;
``http_ip`` against ``vllm serve --host``): what an instance behind a NAT or
in a container needs.

The engine-level proof (in-process, two real engines over tcp): the decode
binds 127.0.0.2 and advertises 127.0.0.3, where nothing of it listens; a TCP
forwarder from 127.0.0.3 to 127.0.0.2 (the NAT) is the only way in. The
prefill is told only the advertised address: without the forwarder the
transfer fails, with it every KV byte crosses the forwarder and lands
byte-equal.
"""

from __future__ import annotations

import socket

import pytest
import torch

from vllm_disagg import envs
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import config as p2p_config
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.api_address import (
    api_listen_addr,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import P2pConfig
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import (
    KVLayout,
    P2pEngine,
    SlotState,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport import (
    create_transport,
)
from vllm_disagg.errors import ConfigError
from vllm_disagg.testing.forwarder import Forwarder
from vllm_disagg.testing.server import get_free_port

from .test_config import _config, _error
from .test_engine import (
    BLOCK_SHAPE,
    BLOCK_SIZE,
    BLOCKS,
    DIGEST,
    LAYERS,
    PAGE,
    Node,
    assert_blocks_equal,
    deadline,
    wait_done,
    wait_slot,
)
from .test_local_cookie import cookie_dir  # noqa: F401 - a fixture

BOUND, ADVERTISED = "127.0.0.2", "127.0.0.3"
CPU = torch.device("cpu")


# --- the options -----------------------------------------------------------------


def test_kv_bind_ip_defaults_to_kv_ip_and_may_be_a_wildcard():
    config = _config()
    assert config.bind_host is None and config.listen_host == "127.0.0.1"
    config = _config({"kv_bind_ip": "0.0.0.0", "kv_ip": "10.1.2.3"})
    assert (config.listen_host, config.host) == ("0.0.0.0", "10.1.2.3")
    assert _config({"kv_bind_ip": "[::]"}).listen_host == "::"
    # kv_ip is what peers are told: still never a wildcard.
    assert _error(_config, {"kv_ip": "0.0.0.0"}).startswith(
        "kv_connector_extra_config.kv_ip: '0.0.0.0'"
    )
    assert _error(_config, {"kv_bind_ip": "a_b"}).startswith(
        "kv_connector_extra_config.kv_bind_ip: 'a_b' is not"
    )


def test_bind_options_are_the_tcp_transports():
    message = _error(_config, {"kv_bind_ip": "0.0.0.0", "transport": "gloo"})
    assert message.startswith(
        "kv_connector_extra_config.kv_bind_ip, kv_connector_extra_config.transport:"
    )
    _config({"kv_bind_ip": "127.0.0.1", "transport": "gloo"})  # the same: fine
    assert "kv_data_port" in _error(
        _config, {"kv_data_port": 23001, "transport": "nccl"}
    )
    # transport auto is resolved by the worker: a GPU's nccl refuses them there.
    with pytest.raises(ConfigError, match="need the tcp transport"):
        create_transport("fake", CPU, BOUND, advertise_host=ADVERTISED)


def test_data_ports_follow_the_worker_plan_and_stay_apart():
    config = _config({"kv_data_port": 23001})
    assert config.data_port(22001) == 23001 and config.data_port(22003) == 23003
    assert _config().data_port(22001) == 0  # a free port
    parallel = type("P", (), {})()
    parallel.data_parallel_size, parallel.tensor_parallel_size = 2, 2
    parallel.pipeline_parallel_size = 1
    assert _config({"kv_data_port": 23001}).check_port_plan(parallel)
    message = _error(_config({"kv_data_port": 22003}).check_port_plan, parallel)
    assert message.startswith("kv_connector_extra_config.kv_data_port: ports 22003..")
    message = _error(_config({"kv_data_port": 65534}).check_port_plan, parallel)
    assert "beyond 65535" in message


# --- safe by default: the bind address counts -------------------------------------


@pytest.mark.parametrize(
    ("kv_ip", "kv_bind_ip", "open_key"),
    [
        ("127.0.0.1", "0.0.0.0", "kv_bind_ip: 0.0.0.0"),  # advertises loopback only
        ("10.1.2.3", "127.0.0.1", "kv_ip: 10.1.2.3"),  # a forwarder leads in
        ("127.0.0.1", "10.1.2.3", "kv_bind_ip: 10.1.2.3"),
    ],
)
def test_loopback_only_means_bound_and_advertised_there(
    monkeypatch, kv_ip, kv_bind_ip, open_key
):
    monkeypatch.delenv(envs.VLLM_DISAGG_P2P_SECRET, raising=False)
    config = _config({"kv_ip": kv_ip, "kv_bind_ip": kv_bind_ip}, local_cookie=False)
    assert config.binds_beyond_loopback
    message = _error(config.check_security)
    assert message.startswith(f"kv_connector_extra_config.{open_key} is reachable")
    _config({"kv_ip": "127.0.0.1", "kv_bind_ip": BOUND}).check_security()


def test_the_local_cookie_is_not_used_when_bound_beyond_loopback(cookie_dir):  # noqa: F811
    wide = _config({"kv_bind_ip": "0.0.0.0"})
    assert wide.secret is None and wide.grant_token is None  # nothing from it
    assert "kv_bind_ip: 0.0.0.0 is reachable" in _error(wide.check_security)
    narrow = _config({"kv_bind_ip": BOUND})
    assert narrow.secret is not None and narrow.grant_token is not None
    assert not p2p_config.P2pConfig(
        role="kv_consumer", base_port=22001, bind_host=BOUND
    ).binds_beyond_loopback


# --- the HTTP side: advertised http_ip, probed where vllm serve listens ------------


def test_the_api_server_is_probed_where_vllm_serve_listens():
    # Behind a NAT the advertised address may not be reachable from here.
    assert api_listen_addr("203.0.113.7:8000", None, 20001) == "127.0.0.1:20001"
    assert api_listen_addr("203.0.113.7:8000", "10.0.0.5", 20001) == "10.0.0.5:20001"
    # Not started by `vllm serve`: only the advertised address is known.
    assert api_listen_addr("10.0.0.5:8000", None, None) == "10.0.0.5:8000"
    config = P2pConfig(
        role="kv_consumer",
        base_port=22001,
        http_ip="203.0.113.7",
        http_port=8000,
        proxy_ip="127.0.0.1",
        proxy_port=30001,
    )
    assert config.http_addr == "203.0.113.7:8000"  # what the routers are told


# --- the engine behind a forwarder ----------------------------------------------


def _engine(host: str, port: int, *, seed: int, bind_host=None, data_port=0) -> Node:
    gen = torch.Generator().manual_seed(seed)
    kv = {
        f"model.layers.{i}.self_attn.attn": torch.randn(
            BLOCKS, *BLOCK_SHAPE, generator=gen
        )
        for i in range(LAYERS)
    }
    transport = create_transport(
        "tcp", CPU, bind_host or host, advertise_host=host, data_port=data_port
    )
    engine = P2pEngine(
        layout=KVLayout(kv, BLOCK_SIZE),
        host=host,
        bind_host=bind_host,
        port=port,
        transport=transport,
        send_type="PUT",
        kv_buffer_size=1 << 26,
        mem_pool_size_bytes=0,
        hold_timeout_s=3.0,
    )
    return Node(engine, kv)


@pytest.fixture
def nat():
    """(prefill on 127.0.0.1, decode bound on BOUND and advertised as ADVERTISED,
    start_forwarding()): the forwarders are the NAT, started by the test."""
    ctrl, data = get_free_port(), get_free_port()
    prefill = _engine("127.0.0.1", get_free_port(), seed=1)
    decode = _engine(ADVERTISED, ctrl, seed=2, bind_host=BOUND, data_port=data)
    forwarders: list[Forwarder] = []

    def start_forwarding() -> list[Forwarder]:
        forwarders.extend(
            Forwarder((ADVERTISED, port), (BOUND, port)) for port in (ctrl, data)
        )
        return forwarders

    yield prefill, decode, start_forwarding
    for node in (prefill, decode):
        node.engine.close()
    for f in forwarders:
        f.close()


def _send(prefill: Node, decode: Node, key: str, src: list[int]):
    decode.expect(key, 0, deadline(), get_from=None, prompt_digest=DIGEST)
    return prefill.start_send(
        key, f"req-{key}", decode.addr, src, all_saved=True, prompt_digest=DIGEST
    )


def test_without_the_nat_the_advertised_address_leads_nowhere(nat):
    prefill, decode, _ = nat
    assert decode.addr.startswith(f"{ADVERTISED}:")  # what peers are told
    port = int(decode.addr.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):  # nothing listens there ...
        socket.create_connection((ADVERTISED, port), timeout=1).close()
    socket.create_connection((BOUND, port), timeout=1).close()  # ... but here
    failed = wait_done(_send(prefill, decode, "k", [1, 2]), timeout=15)
    assert not failed.ok and "no reply to Hello" in failed.reason, failed.reason


def test_the_engine_binds_one_address_and_is_reached_through_the_advertised_one(nat):
    prefill, decode, start_forwarding = nat
    ctrl, data = start_forwarding()
    src, dst = [5, 7, 9, 11], [40, 41, 42, 43]
    xfer = wait_done(_send(prefill, decode, "k", src), timeout=15)
    assert xfer.ok, xfer.reason
    slot = wait_slot(decode, "k")
    assert slot.state is SlotState.COMPLETE, slot.reason
    decode.copy_into_cache(slot, dst, 0)
    decode.release(slot)
    assert_blocks_equal(decode, dst, prefill, src)
    # Control and data both came in through the advertised address.
    nbytes = LAYERS * len(src) * PAGE
    assert ctrl.connections >= 1 and ctrl.bytes_in > 0
    assert data.connections == 1 and data.bytes_in >= nbytes, (data.bytes_in, nbytes)
    assert decode.totals()["bytes_received"] == nbytes
