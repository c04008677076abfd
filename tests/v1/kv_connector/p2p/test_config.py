"""P2pNcclConnector options: the seed document's JSON normalised for vLLM
0.32's KVTransferConfig, every value typed and checked, one-line errors that
name the key, and the per-worker port plan."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm.config.kv_transfer import KVTransferConfig

from vllm_disagg import envs
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import (
    extra_config,
    seed_json,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import (
    CONNECTOR_NAME,
    EXTRA_CONFIG_KEYS,
    GIB,
    LEGACY_TOP_LEVEL_KEYS,
    P2pConfig,
    SendType,
    check_p2p_config,
    normalize_kv_transfer_json,
)
from vllm_disagg.errors import ConfigError

SEED_PRODUCER = {
    "kv_connector": "P2pNcclConnector",
    "kv_role": "kv_producer",
    "kv_buffer_size": "1e1",
    "kv_port": "21001",
    "kv_connector_extra_config": {
        "proxy_ip": "10.0.1.1",
        "proxy_port": "30001",
        "http_port": "20001",
    },
}


def _config(
    extra=None, *, role="kv_consumer", port=22001, local_cookie=True, **top
) -> P2pConfig:
    """P2pConfig from the real KVTransferConfig, the way vLLM builds it
    (``local_cookie=False``: the credentials from the environment only, see
    test_local_cookie.py)."""
    obj = {"kv_connector": CONNECTOR_NAME, "kv_role": role, "kv_port": port, **top}
    obj["kv_connector_extra_config"] = {"kv_ip": "127.0.0.1", **(extra or {})}
    return P2pConfig.from_kv_transfer_config(
        KVTransferConfig(**normalize_kv_transfer_json(obj)), local_cookie=local_cookie
    )


@pytest.fixture(autouse=True)
def _fleet_credentials(monkeypatch):
    """A fleet that set what check_security asks for: the checks under test
    here come after it. Tests of the security rules remove these."""
    monkeypatch.setenv(envs.VLLM_DISAGG_P2P_SECRET, "s3cr3t")
    monkeypatch.setenv(envs.VLLM_DISAGG_ROUTER_TOKEN, "tok")


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- normalize_kv_transfer_json ---------------------------------------------


def test_seed_json_is_normalised_for_kv_transfer_config():
    out = normalize_kv_transfer_json(SEED_PRODUCER)
    assert out == {
        "kv_connector": "P2pNcclConnector",
        "kv_role": "kv_producer",
        "kv_port": 21001,
        "kv_connector_extra_config": {
            "proxy_ip": "10.0.1.1",
            "proxy_port": "30001",
            "http_port": "20001",
            "kv_buffer_size": "1e1",
        },
        "kv_load_failure_policy": "recompute",
    }
    assert SEED_PRODUCER["kv_buffer_size"] == "1e1"  # a copy; the input is untouched
    assert "kv_buffer_size" not in SEED_PRODUCER["kv_connector_extra_config"]
    config = P2pConfig.from_kv_transfer_config(KVTransferConfig(**out))
    assert (config.role, config.base_port, config.kv_buffer_size) == (
        "kv_producer",
        21001,
        10,
    )
    assert (config.proxy_ip, config.proxy_port, config.http_port) == (
        "10.0.1.1",
        30001,
        20001,
    )


def test_stock_kv_transfer_config_rejects_the_seed_json():
    """Why the normalisation exists (measured on 0.32)."""
    with pytest.raises(Exception, match="kv_buffer_size"):
        KVTransferConfig(**SEED_PRODUCER)


def test_other_connectors_are_untouched():
    obj = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_size": "1e1",
    }
    assert normalize_kv_transfer_json(obj) is obj


def test_explicit_failure_policy_is_kept():
    out = normalize_kv_transfer_json(
        {**SEED_PRODUCER, "kv_load_failure_policy": "fail"}
    )
    assert out["kv_load_failure_policy"] == "fail"


def test_kv_ip_moves_and_rank_keys_are_dropped_with_one_warning(monkeypatch):
    warnings = []
    monkeypatch.setattr(seed_json, "_warned", set())
    monkeypatch.setattr(seed_json.logger, "warning", lambda *a: warnings.append(a))
    obj = {**SEED_PRODUCER, "kv_ip": "10.0.0.5", "kv_rank": 0, "kv_parallel_size": 2}
    out = normalize_kv_transfer_json(obj)
    normalize_kv_transfer_json(obj)
    assert set(LEGACY_TOP_LEVEL_KEYS).isdisjoint(out)
    assert out["kv_connector_extra_config"]["kv_ip"] == "10.0.0.5"
    assert sorted(w[1] for w in warnings) == ["kv_parallel_size", "kv_rank"]
    assert _config({"kv_ip": "10.0.0.5"}).host == "10.0.0.5"


def test_key_in_both_places():
    same = {**SEED_PRODUCER, "kv_connector_extra_config": {"kv_buffer_size": "1e1"}}
    assert normalize_kv_transfer_json(same)["kv_connector_extra_config"] == {
        "kv_buffer_size": "1e1"
    }
    differ = {**SEED_PRODUCER, "kv_connector_extra_config": {"kv_buffer_size": "2e1"}}
    message = _error(normalize_kv_transfer_json, differ)
    assert message.startswith("kv_buffer_size: given at the top level ('1e1')")


@pytest.mark.parametrize(
    "port", ["abc", "", "21001.5", "21_001", "65536", 0, 65536, -1, True, 21001.0, None]
)
def test_bad_kv_port(port):
    message = _error(normalize_kv_transfer_json, {**SEED_PRODUCER, "kv_port": port})
    assert message.startswith("kv_port: ") and "1..65535" in message


def test_extra_config_must_be_an_object():
    obj = {**SEED_PRODUCER, "kv_connector_extra_config": "proxy"}
    assert _error(normalize_kv_transfer_json, obj).startswith(
        "kv_connector_extra_config: "
    )


# --- P2pConfig --------------------------------------------------------------


def test_defaults(monkeypatch):
    monkeypatch.delenv(envs.VLLM_DISAGG_P2P_SECRET, raising=False)
    monkeypatch.delenv(envs.VLLM_DISAGG_ROUTER_TOKEN, raising=False)
    config = _config(local_cookie=False)
    assert config == P2pConfig(role="kv_consumer", base_port=22001, host="127.0.0.1")
    assert config.send_type is SendType.PUT_ASYNC
    assert config.kv_buffer_size == 10**9
    assert config.mem_pool_size_bytes == GIB and config.mem_pool_size_gb == 1.0
    assert config.transport == "auto"
    assert (config.kv_load_timeout_s, config.kv_hold_timeout_s) == (30.0, 60.0)
    assert (config.proxy_ip, config.proxy_port, config.http_port, config.secret) == (
        None,
    ) * 4


def test_default_host_is_vllms_ip(monkeypatch):
    monkeypatch.delenv(envs.VLLM_DISAGG_SERVE_HOST, raising=False)
    monkeypatch.delenv(envs.VLLM_DISAGG_SERVE_PORT, raising=False)
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    obj = {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_both"}
    assert P2pConfig.from_kv_transfer_config(KVTransferConfig(**obj)).host == "10.1.2.3"


def test_default_host_is_the_address_vllm_serve_listens_on(monkeypatch):
    """`vllm serve --host 127.0.0.1` and the seed's JSON (no kv_ip): instances
    advertised the host's other address, then registered where nothing
    listened (every request 503); now they also would need a secret."""
    from vllm_disagg.entrypoints.cli.main import export_serve_host, serve_host

    assert serve_host(["serve", "m", "--host", "127.0.0.1"]) == "127.0.0.1"
    assert serve_host(["serve", "m", "--host=[::1]", "--port", "1"]) == "::1"
    assert serve_host(["serve", "m", "--host", "0.0.0.0"]) is None
    assert serve_host(["bench", "serve", "--host", "127.0.0.1"]) is None
    for name in (envs.VLLM_DISAGG_SERVE_HOST, envs.VLLM_DISAGG_SERVE_PORT):
        # setenv first, so that monkeypatch unsets what export_serve_host sets
        # (a delenv of an unset variable records nothing to restore).
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    export_serve_host(["serve", "m", "--host", "127.0.0.1"])
    obj = {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": "kv_both",
        "kv_port": 21001,
        "kv_connector_extra_config": {
            "proxy_ip": "127.0.0.1",
            "proxy_port": 30001,
            "http_port": 20001,
        },
    }
    config = P2pConfig.from_kv_transfer_config(KVTransferConfig(**obj))
    assert config.host == "127.0.0.1" and config.http_addr == "127.0.0.1:20001"
    assert not config.binds_beyond_loopback
    assert (
        envs.serve_port() == 8000
    )  # vllm serve's default, exported for the start-up check


def test_serve_port_is_the_one_vllm_serve_listens_on():
    from vllm_disagg.entrypoints.cli.main import serve_port

    assert serve_port(["serve", "m"]) == 8000
    assert serve_port(["serve", "m", "--port", "20001"]) == 20001
    assert serve_port(["serve", "m", "--port=20002", "--host", "x"]) == 20002
    assert serve_port(["bench", "serve", "--port", "1"]) is None


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1e1", 10),
        ("8e9", 8 * 10**9),
        (" 1e9 ", 10**9),
        (1e9, 10**9),
        (5, 5),
        ("0", 0),
        (2.5, 2),
    ],
)
def test_kv_buffer_size(value, expected):
    assert _config({"kv_buffer_size": value}).kv_buffer_size == expected


@pytest.mark.parametrize(
    "value", ["lots", "-1", -1, "nan", "inf", True, None, [1], "1e20"]
)
def test_bad_kv_buffer_size(value):
    message = _error(_config, {"kv_buffer_size": value})
    assert message.startswith("kv_connector_extra_config.kv_buffer_size: ")


@pytest.mark.parametrize(
    "value, expected",
    [
        ("PUT", SendType.PUT),
        ("get", SendType.GET),
        ("Put_Async", SendType.PUT_ASYNC),
        (SendType.GET, SendType.GET),
    ],
)
def test_send_type_is_case_insensitive(value, expected):
    assert _config({"send_type": value}).send_type is expected


def test_bad_send_type_names_key_and_choices():
    assert _error(_config, {"send_type": "PUSH"}) == (
        "kv_connector_extra_config.send_type: 'PUSH' is not one of PUT, GET, PUT_ASYNC"
    )


@pytest.mark.parametrize("gb, expected", [(0, 0), ("0.5", GIB // 2), (2, 2 * GIB)])
def test_mem_pool_size(gb, expected):
    assert _config({"mem_pool_size_gb": gb}).mem_pool_size_bytes == expected


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"mem_pool_size_gb": -1}, "mem_pool_size_gb"),
        ({"transport": "rdma"}, "transport"),
        ({"kv_load_timeout_s": 0}, "kv_load_timeout_s"),
        ({"kv_hold_timeout_s": "soon"}, "kv_hold_timeout_s"),
        ({"kv_ip": "a_b"}, "kv_ip"),
        ({"kv_ip": "999.1.1.1"}, "kv_ip"),
        ({"kv_ip": "fe80::1%eth0"}, "kv_ip"),
        ({"kv_ip": ""}, "kv_ip"),
        ({"proxy_ip": "10.0.0.1", "proxy_port": "abc", "http_port": 1}, "proxy_port"),
        ({"proxy_ip": "10.0.0.1", "proxy_port": 1, "http_port": 0}, "http_port"),
        ({"proxy_ip": "10.0.0.1"}, "proxy_ip"),
        ({"proxy_port": 30001}, "proxy_ip"),
        ({"proxy_ip": "10.0.0.1", "proxy_port": 30001}, "http_port"),
    ],
)
def test_bad_values_name_the_key(extra, key):
    assert _error(_config, extra).startswith(f"kv_connector_extra_config.{key}")


@pytest.mark.parametrize(
    "value, expected",
    [
        ("TCP", "tcp"),
        ("gloo", "gloo"),
        ("nccl", "nccl"),
        ("fake", "fake"),
        ("auto", "auto"),
    ],
)
def test_transport(value, expected):
    assert _config({"transport": value}).transport == expected


@pytest.mark.parametrize(
    "host, expected",
    [
        ("::1", "::1"),
        ("[::1]", "::1"),
        ("host-1.example.com", "host-1.example.com"),
        ("10.0.0.1", "10.0.0.1"),
    ],
)
def test_hosts(host, expected):
    assert _config({"kv_ip": host}).host == expected


def test_unknown_extra_key_lists_the_allowed_keys():
    message = _error(_config, {"send_typ": "PUT"})
    assert message.startswith("kv_connector_extra_config.send_typ: unknown key")
    assert "did you mean 'send_type'?" in message
    assert ", ".join(EXTRA_CONFIG_KEYS) in message
    assert _error(_config, {"kv_rank": 0}).startswith(
        "kv_connector_extra_config.kv_rank"
    )


def test_role_and_connector_are_checked():
    ktc = SimpleNamespace(
        kv_connector=CONNECTOR_NAME,
        kv_role="kv_sender",
        kv_port=1,
        kv_connector_extra_config={},
    )
    assert _error(P2pConfig.from_kv_transfer_config, ktc).startswith(
        "kv_role: 'kv_sender'"
    )
    ktc.kv_connector = "NixlConnector"
    assert _error(P2pConfig.from_kv_transfer_config, ktc).startswith("kv_connector: ")


def test_secret_comes_from_the_environment_and_is_not_printed(monkeypatch):
    monkeypatch.setenv(envs.VLLM_DISAGG_P2P_SECRET, "s3cr3t")
    config = _config()
    assert config.secret == b"s3cr3t"
    assert "s3cr3t" not in repr(config)
    monkeypatch.setenv(envs.VLLM_DISAGG_P2P_SECRET, "")
    assert _config(local_cookie=False).secret is None
    assert "secret" not in EXTRA_CONFIG_KEYS


def test_direct_construction_is_checked_and_frozen():
    config = P2pConfig(
        role="kv_both", base_port="21001", send_type="get", transport="TCP"
    )
    assert (config.base_port, config.send_type, config.transport) == (
        21001,
        SendType.GET,
        "tcp",
    )
    with pytest.raises(AttributeError):
        config.base_port = 1  # type: ignore[misc]
    assert _error(P2pConfig, role="kv_both", base_port=0).startswith("base_port: ")
    assert _error(P2pConfig, role="x", base_port=1).startswith("role: ")
    assert _error(P2pConfig, role="kv_both", base_port=1, kv_buffer_size=-1).startswith(
        "kv_buffer_size: "
    )


# --- the port plan ----------------------------------------------------------


def test_every_worker_of_every_dp_rank_gets_its_own_port():
    config = P2pConfig(role="kv_both", base_port=21001)
    dp, tp, pp = 3, 2, 2
    ports = [
        config.worker_port(dp_rank=d, tp_size=tp, pp_size=pp, tp_rank=t, pp_rank=p)
        for d, p, t in itertools.product(range(dp), range(pp), range(tp))
    ]
    assert ports == list(range(21001, 21001 + dp * tp * pp))
    assert config.instance_port(1, tp, pp) == 21001 + 4
    assert config.worker_port(
        dp_rank=2, tp_size=2, pp_size=2, tp_rank=1, pp_rank=1
    ) == (21001 + 2 * 4 + 1 * 2 + 1)
    with pytest.raises(ValueError):
        config.worker_port(dp_rank=0, tp_size=2, pp_size=1, tp_rank=2, pp_rank=0)


def test_ports_beyond_65535_are_a_config_error():
    config = P2pConfig(role="kv_both", base_port=65535)
    assert config.instance_port(0, 1, 1) == 65535
    message = _error(
        config.worker_port, dp_rank=0, tp_size=2, pp_size=1, tp_rank=1, pp_rank=0
    )
    assert message.startswith("kv_port: ") and "at most 65534" in message
    parallel = SimpleNamespace(
        data_parallel_size=2, tensor_parallel_size=4, pipeline_parallel_size=1
    )
    message = _error(
        P2pConfig(role="kv_both", base_port=65530).check_port_plan, parallel
    )
    assert message.startswith("kv_port: 65530 needs ports 65530..65537")
    assert "at most 65528" in message
    assert P2pConfig(role="kv_both", base_port=65528).check_port_plan(
        parallel
    ) == range(65528, 65536)


def test_http_port_inside_the_kv_ports_is_refused():
    config = P2pConfig(
        role="kv_both",
        base_port=20000,
        proxy_ip="10.0.0.1",
        proxy_port=30001,
        http_port=20001,
    )
    parallel = SimpleNamespace(
        data_parallel_size=1, tensor_parallel_size=2, pipeline_parallel_size=1
    )
    assert _error(config.check_port_plan, parallel).startswith(
        "kv_connector_extra_config.http_port: 20001 is one of the workers' KV ports"
    )


def _vllm_config(kv_transfer_config, dp=1, tp=1, pp=1, external_lb=False):
    parallel = SimpleNamespace(
        data_parallel_size=dp,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        data_parallel_external_lb=external_lb,
    )
    return SimpleNamespace(
        kv_transfer_config=kv_transfer_config, parallel_config=parallel
    )


def test_check_p2p_config():
    assert check_p2p_config(_vllm_config(None)) is None
    other = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    assert check_p2p_config(_vllm_config(other)) is None
    good = KVTransferConfig(**normalize_kv_transfer_json(SEED_PRODUCER))
    assert check_p2p_config(_vllm_config(good, dp=2, tp=2)) is None
    assert _error(check_p2p_config, _vllm_config(good, dp=50000)).startswith(
        "kv_port: 21001"
    )
    bad = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_role="kv_both",
        kv_connector_extra_config={"send_type": "PUSH"},
    )
    assert _error(check_p2p_config, _vllm_config(bad)).startswith(
        "kv_connector_extra_config.send_type"
    )


# --- DP behind one API server (internal load balancing) -----------------------


def _ktc(role, send_type):
    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_role=role,
        kv_port=21001,
        kv_connector_extra_config={"kv_ip": "127.0.0.1", "send_type": send_type},
    )


@pytest.mark.parametrize(
    "role, send_type",
    [
        ("kv_consumer", "PUT"),
        ("kv_consumer", "PUT_ASYNC"),
        ("kv_producer", "GET"),
        ("kv_both", "PUT_ASYNC"),
        ("kv_both", "GET"),
    ],
)
def test_internal_lb_refuses_what_needs_the_named_rank(role, send_type):
    message = _error(check_p2p_config, _vllm_config(_ktc(role, send_type), dp=2))
    assert message.startswith(
        f"P2pNcclConnector: kv_role {role} with send_type {send_type} cannot run 2 DP "
        "ranks behind one API server (internal load balancing): "
    )
    assert message.endswith(
        "run one `vllm serve` per DP rank (--data-parallel-rank N, external load "
        "balancing) so each rank registers as its own instance"
    )
    # The same deployment with one `vllm serve` per rank starts.
    assert (
        check_p2p_config(_vllm_config(_ktc(role, send_type), dp=2, external_lb=True))
        is None
    )


@pytest.mark.parametrize(
    "role, send_type",
    [("kv_consumer", "GET"), ("kv_producer", "PUT"), ("kv_producer", "PUT_ASYNC")],
)
def test_internal_lb_allows_what_works_on_any_rank(role, send_type):
    assert check_p2p_config(_vllm_config(_ktc(role, send_type), dp=2)) is None


def test_internal_lb_check_needs_more_than_one_rank():
    assert check_p2p_config(_vllm_config(_ktc("kv_consumer", "PUT"), dp=1)) is None


# --- service discovery: routers, http address ----------------------------------


@pytest.mark.parametrize(
    "extra, proxy_ip, routers",
    [
        (
            {"proxy_ip": "10.0.0.1", "proxy_port": 30001},
            "10.0.0.1",
            [("10.0.0.1", 30001)],
        ),
        (
            {"proxy_ip": "10.0.0.1,10.0.0.2", "proxy_port": "30001"},
            "10.0.0.1,10.0.0.2",
            [("10.0.0.1", 30001), ("10.0.0.2", 30001)],
        ),
        (
            {"proxy_ip": " r1.example.com , 10.0.0.2:30002 ", "proxy_port": 30001},
            "r1.example.com,10.0.0.2:30002",
            [("r1.example.com", 30001), ("10.0.0.2", 30002)],
        ),
        (
            {"proxy_ip": ["10.0.0.1", "[::1]:30002", "::2"], "proxy_port": 30001},
            "10.0.0.1,[::1]:30002,::2",
            [("10.0.0.1", 30001), ("::1", 30002), ("::2", 30001)],
        ),
        (
            {"proxy_ip": '["10.0.0.1:1", "10.0.0.1:2"]'},
            "10.0.0.1:1,10.0.0.1:2",
            [("10.0.0.1", 1), ("10.0.0.1", 2)],
        ),
        ({"proxy_ip": "[::1]", "proxy_port": 30001}, "::1", [("::1", 30001)]),
    ],
)
def test_proxy_ip_lists_one_or_several_routers(extra, proxy_ip, routers):
    config = _config({**extra, "http_port": 20001})
    assert config.proxy_ip == proxy_ip
    assert config.routers == tuple(routers)
    # The canonical text parses to the same routers (direct construction).
    again = P2pConfig(
        role="kv_consumer",
        base_port=22001,
        proxy_ip=config.proxy_ip,
        proxy_port=config.proxy_port,
        http_port=20001,
    )
    assert again.routers == config.routers


@pytest.mark.parametrize(
    "proxy_ip",
    [
        "",
        ",",
        "10.0.0.1,",
        "a_b",
        "10.0.0.1:0",
        "10.0.0.1:x",
        "[::1]:70000",
        "[::1:1",
        '["10.0.0.1", 5]',
        '["10.0.0.1"',
        "[]",
        [],
        5,
        {"host": "10.0.0.1"},
    ],
)
def test_bad_proxy_ip_names_the_key_and_the_allowed_values(proxy_ip):
    message = _error(
        _config, {"proxy_ip": proxy_ip, "proxy_port": 30001, "http_port": 1}
    )
    assert message.startswith("kv_connector_extra_config.proxy_ip: ")
    assert message.endswith(
        "is not a router address: host or host:port ([IPv6]:port), or a "
        "comma-separated string or JSON list of them"
    )


def test_proxy_ip_refusals_with_their_own_reason():
    def error(**extra):
        return _error(_config, {"proxy_port": 30001, "http_port": 1, **extra})

    assert error(proxy_ip="0.0.0.0") == (
        "kv_connector_extra_config.proxy_ip: '0.0.0.0' is a wildcard address; give one "
        "that other machines can connect to"
    )
    assert error(proxy_ip="10.0.0.1,10.0.0.1:30001") == (
        "kv_connector_extra_config.proxy_ip: router 10.0.0.1:30001 is listed twice"
    )
    many = ",".join(f"10.0.0.{i}" for i in range(extra_config.MAX_ROUTERS + 1))
    assert error(proxy_ip=many).startswith(
        "kv_connector_extra_config.proxy_ip: 17 routers"
    )


def test_proxy_port_may_be_left_out_only_when_every_router_has_its_port():
    assert _config({"proxy_ip": "10.0.0.1:30001", "http_port": 1}).routers == (
        ("10.0.0.1", 30001),
    )
    message = _error(_config, {"proxy_ip": "10.0.0.1:30001,10.0.0.2", "http_port": 1})
    assert message.startswith(
        "kv_connector_extra_config.proxy_ip, kv_connector_extra_config.proxy_port: "
        "give both"
    )
    assert "every router needs its port (host:port)" in message


def test_http_addr_defaults_to_the_kv_host():
    config = _config(
        {"kv_ip": "10.0.0.5", "proxy_ip": "r", "proxy_port": 1, "http_port": 8000}
    )
    assert (config.http_ip, config.http_addr) == (None, "10.0.0.5:8000")
    config = _config(
        {"http_ip": "[fd00::7]", "proxy_ip": "r", "proxy_port": 1, "http_port": 80}
    )
    assert (config.http_ip, config.http_addr) == ("fd00::7", "[fd00::7]:80")
    assert _config().http_addr is None


@pytest.mark.parametrize("http_ip", ["a_b", "", "::", "0.0.0.0", 5])
def test_bad_http_ip(http_ip):
    message = _error(_config, {"http_ip": http_ip})
    assert message.startswith("kv_connector_extra_config.http_ip: ")
    assert _error(P2pConfig, role="kv_both", base_port=1, http_ip=http_ip).startswith(
        "http_ip: "
    )


def test_dense_dp_ranks_keep_their_own_ports_after_vllm_resets_the_rank():
    """Upstream vLLM runs each DP rank of a dense model as an independent rank 0; the
    port plan must still use the rank the user launched."""
    from vllm.config import ParallelConfig

    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import (
        dp_rank_of,
    )

    parallel = ParallelConfig(data_parallel_size=4, data_parallel_rank=3)
    assert dp_rank_of(parallel) == 3
    parallel.reconfigure_for_independent_dp_rank()
    assert parallel.data_parallel_rank == 0
    assert dp_rank_of(parallel) == 3


# --- safe by default (check_security) ------------------------------------------


def test_beyond_loopback_without_a_secret_refuses_to_start(monkeypatch):
    monkeypatch.delenv(envs.VLLM_DISAGG_P2P_SECRET, raising=False)
    config = P2pConfig(
        role="kv_producer", base_port=21001, host="10.1.2.3", grant_token=b"t"
    )
    message = _error(config.check_security)
    assert message.startswith("kv_connector_extra_config.kv_ip: 10.1.2.3 is reachable")
    assert envs.VLLM_DISAGG_P2P_SECRET in message and "allow_unauthenticated" in message
    assert "\n" not in message
    # Loopback-only needs no secret; a secret or the explicit opt-in does.
    P2pConfig(role="kv_producer", base_port=21001, grant_token=b"t").check_security()
    P2pConfig(
        role="kv_producer",
        base_port=21001,
        host="10.1.2.3",
        grant_token=b"t",
        secret=b"s",
    ).check_security()
    P2pConfig(
        role="kv_producer",
        base_port=21001,
        host="10.1.2.3",
        grant_token=b"t",
        allow_unauthenticated=True,
    ).check_security()


def test_allow_unauthenticated_is_read_and_checked():
    assert _config({"allow_unauthenticated": True}).allow_unauthenticated is True
    assert _error(_config, {"allow_unauthenticated": "yes"}).startswith(
        "kv_connector_extra_config.allow_unauthenticated: 'yes' is not true or false"
    )


def test_nothing_to_vouch_for_peers_refuses_to_start(monkeypatch):
    config = P2pConfig(role="kv_consumer", base_port=21001)
    assert "nothing vouches for the peers" in _error(config.check_security)
    P2pConfig(
        role="kv_consumer", base_port=21001, allowed_peers="10.0.0.0/8"
    ).check_security()


def test_allowed_peers_grammar():
    allowed = _config(
        {"allowed_peers": ["10.0.0.5:22001", "10.1.0.0/16"]}
    ).allowed_peers
    assert allowed.allows(("10.0.0.5", 22001)) and not allowed.allows(
        ("10.0.0.5", 22002)
    )
    assert allowed.allows(("10.1.200.3", 1)) and not allowed.allows(("10.2.0.1", 1))
    for bad in ("10.0.0.0/99", "a_b:1", [], 5):
        assert _error(_config, {"allowed_peers": bad}).startswith(
            "kv_connector_extra_config.allowed_peers: "
        )


def test_secret_file(monkeypatch, tmp_path):
    monkeypatch.delenv(envs.VLLM_DISAGG_P2P_SECRET, raising=False)
    path = tmp_path / "secret"
    path.write_text("  from-a-file\n")
    monkeypatch.setenv(envs.VLLM_DISAGG_P2P_SECRET_FILE, str(path))
    assert _config().secret == b"from-a-file"
    path.write_text("\n")
    assert _error(_config).startswith(f"{envs.VLLM_DISAGG_P2P_SECRET_FILE}: ")
    monkeypatch.setenv(envs.VLLM_DISAGG_P2P_SECRET_FILE, str(tmp_path / "missing"))
    assert "cannot read" in _error(_config)


def test_registering_beyond_loopback_needs_the_router_token(monkeypatch):
    monkeypatch.delenv(envs.VLLM_DISAGG_ROUTER_TOKEN, raising=False)
    config = P2pConfig(
        role="kv_producer",
        base_port=21001,
        host="10.1.2.3",
        secret=b"s",
        allowed_peers="10.0.0.0/8",
        proxy_ip="10.0.0.1",
        proxy_port=30001,
        http_port=20001,
    )
    message = _error(config.check_security)
    assert message.startswith("kv_connector_extra_config.proxy_ip: registrations")
    assert envs.VLLM_DISAGG_ROUTER_TOKEN in message


# --- the option table: one source for parsing, defaults and the docs ------------


def test_both_ways_in_share_the_cross_field_rules():
    """The JSON and direct construction run one check; only the key labels differ."""
    assert _error(_config, {"proxy_port": 30001}).startswith(
        "kv_connector_extra_config.proxy_ip, kv_connector_extra_config.proxy_port: "
        "give both"
    )
    assert _error(P2pConfig, role="kv_both", base_port=1, proxy_port=30001).startswith(
        "proxy_ip, proxy_port: give both"
    )
    assert _error(
        P2pConfig, role="kv_both", base_port=1, proxy_ip="r", proxy_port=1
    ) == (
        "http_port: required with proxy_ip/proxy_port (the port of this instance's API "
        "server that the router forwards requests to)"
    )


def test_every_option_is_a_field_with_the_tables_default():
    fields = {f.name: f for f in dataclasses.fields(P2pConfig)}
    assert tuple(o.key for o in extra_config.OPTIONS) == EXTRA_CONFIG_KEYS
    for option in extra_config.OPTIONS:
        assert fields[option.name].default == option.default, option.key
        assert option.help and option.refused and option.type, option.key


DOC = Path(__file__).resolve().parents[4] / "docs" / "p2p_connector.md"


def test_docs_key_table_is_the_option_table():
    """docs/p2p_connector.md's table of kv_connector_extra_config keys is
    rendered from OPTIONS; after a change run
    `.venv/bin/python -m
    vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config`."""
    assert extra_config.doc_table(DOC.read_text()) == extra_config.markdown_table()


def test_update_doc_rewrites_only_the_table(tmp_path):
    path = tmp_path / "doc.md"
    stale = (
        f"intro\n\n{extra_config.DOC_BEGIN}\n| old |\n{extra_config.DOC_END}\n\nafter\n"
    )
    path.write_text(stale)
    assert extra_config.update_doc(path) is True
    text = path.read_text()
    assert text.startswith("intro\n\n") and text.endswith(
        f"{extra_config.DOC_END}\n\nafter\n"
    )
    assert extra_config.doc_table(text) == extra_config.markdown_table()
    assert extra_config.update_doc(path) is False
