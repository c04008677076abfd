"""The connector's credentials on one host: where the environment sets no
router token or P2P secret and everything is on loopback, this user's local
cookie (vllm_disagg/wire/cookie.py) stands in; beyond loopback it never
does, and today's one-line refusals stay."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from vllm.config.kv_transfer import KVTransferConfig

from vllm_disagg import envs
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import (
    security as p2p_security,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import (
    P2pConfig,
    check_p2p_config,
    normalize_kv_transfer_json,
)
from vllm_disagg.errors import ConfigError
from vllm_disagg.wire.cookie import (
    DIR_NAME,
    FILE_NAME,
    P2P_SECRET,
    ROUTER_TOKEN,
    load_cookie,
)


@pytest.fixture
def cookie_dir(tmp_path, monkeypatch) -> Path:
    """Nothing exported, and a private XDG_RUNTIME_DIR with no cookie yet."""
    for name in (
        envs.VLLM_DISAGG_ROUTER_TOKEN,
        envs.VLLM_DISAGG_P2P_SECRET,
        envs.VLLM_DISAGG_P2P_SECRET_FILE,
        envs.VLLM_DISAGG_SERVE_HOST,
    ):
        monkeypatch.delenv(name, raising=False)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    monkeypatch.setattr(p2p_security, "_logged_sources", set())
    monkeypatch.setattr(p2p_security, "_warned", set())
    return run / DIR_NAME


def _seed(extra: dict, role: str = "kv_producer") -> dict:
    """The seed document's JSON, as a user on one machine types it."""
    return {
        "kv_connector": "P2pNcclConnector",
        "kv_role": role,
        "kv_buffer_size": "1e1",
        "kv_port": "21001",
        "kv_connector_extra_config": extra,
    }


ON_ONE_HOST = {
    "kv_ip": "127.0.0.1",
    "proxy_ip": "127.0.0.1",
    "proxy_port": "30001",
    "http_port": "20001",
}


def _config(obj: dict, **kwargs) -> P2pConfig:
    return P2pConfig.from_kv_transfer_config(
        KVTransferConfig(**normalize_kv_transfer_json(obj)), **kwargs
    )


def _error(fn, *args) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_on_loopback_the_cookie_vouches_and_authenticates(cookie_dir):
    config = _config(_seed(ON_ONE_HOST))
    cookie = load_cookie()
    assert cookie.path == cookie_dir / FILE_NAME and not cookie.created
    assert config.grant_token == cookie.key(ROUTER_TOKEN)
    assert config.secret == cookie.key(P2P_SECRET)
    config.check_security()  # before the cookie: "nothing vouches for the peers"
    assert stat.S_IMODE(os.stat(cookie.path).st_mode) == 0o600
    # A second instance of the user (a decode) finds the same credentials.
    decode = _config(_seed({**ON_ONE_HOST, "http_port": "20002"}, "kv_consumer"))
    assert (decode.grant_token, decode.secret) == (config.grant_token, config.secret)


def test_the_seed_json_without_kv_ip_behind_vllm_serve_host_loopback(
    cookie_dir, monkeypatch
):
    """`vllm serve --host 127.0.0.1` with the seed's JSON (no kv_ip)."""
    monkeypatch.setenv(envs.VLLM_DISAGG_SERVE_HOST, "127.0.0.1")
    extra = {"proxy_ip": "localhost", "proxy_port": "30001", "http_port": "20001"}
    config = _config(_seed(extra))
    assert config.host == "127.0.0.1"
    assert config.grant_token == load_cookie().key(ROUTER_TOKEN)
    config.check_security()


def test_the_1p1d_recipe_without_a_router_uses_it_too(cookie_dir):
    config = _config(_seed({"kv_ip": "127.0.0.1"}, "kv_consumer"))
    assert config.grant_token == load_cookie().key(ROUTER_TOKEN)
    config.check_security()


def test_explicit_variables_win(cookie_dir, monkeypatch):
    monkeypatch.setenv(envs.VLLM_DISAGG_ROUTER_TOKEN, "tok")
    config = _config(_seed(ON_ONE_HOST))
    assert config.grant_token == b"tok"
    assert config.secret == load_cookie().key(P2P_SECRET)  # still unset: the cookie
    monkeypatch.setenv(envs.VLLM_DISAGG_P2P_SECRET, "s3cr3t")
    config = _config(_seed(ON_ONE_HOST))
    assert (config.grant_token, config.secret) == (b"tok", b"s3cr3t")


def test_nothing_is_read_or_made_when_the_variables_are_set(cookie_dir, monkeypatch):
    monkeypatch.setenv(envs.VLLM_DISAGG_ROUTER_TOKEN, "tok")
    monkeypatch.setenv(envs.VLLM_DISAGG_P2P_SECRET, "s3cr3t")
    _config(_seed(ON_ONE_HOST))
    assert not cookie_dir.exists()


def test_beyond_loopback_it_is_never_used_and_todays_refusals_stay(cookie_dir):
    # kv_ip beyond loopback: neither credential; the P2P secret's refusal.
    config = _config(_seed({**ON_ONE_HOST, "kv_ip": "10.1.2.3"}))
    assert (config.secret, config.grant_token) == (None, None)
    assert not cookie_dir.exists()
    assert _error(config.check_security).startswith(
        "kv_connector_extra_config.kv_ip: 10.1.2.3 is reachable beyond loopback"
    )
    # A router beyond loopback: it cannot have this host's cookie, so no
    # token; the P2P plane, on loopback, is still authenticated by it.
    config = _config(_seed({**ON_ONE_HOST, "proxy_ip": "10.0.1.1"}))
    assert config.grant_token is None
    assert config.secret == load_cookie().key(P2P_SECRET)
    assert _error(config.check_security).startswith(
        "P2pNcclConnector: nothing vouches for the peers a request names: set "
        f"{envs.VLLM_DISAGG_ROUTER_TOKEN}"
    )
    # One router of several beyond loopback is enough to need the token.
    extra = {**ON_ONE_HOST, "proxy_ip": "127.0.0.1:30001,10.0.1.1:30001"}
    assert _config(_seed(extra)).grant_token is None
    # An API server advertised beyond loopback: the router that forwards to
    # it may be elsewhere too.
    extra = {**ON_ONE_HOST, "http_ip": "192.0.2.7"}
    assert _config(_seed(extra)).grant_token is None


def test_the_command_line_check_creates_nothing(cookie_dir):
    config = _config(_seed(ON_ONE_HOST), local_cookie=False)
    assert (config.secret, config.grant_token) == (None, None)
    assert not cookie_dir.exists()


def test_a_cookie_open_to_others_is_refused_in_one_line(cookie_dir):
    made = load_cookie()
    os.chmod(made.path, 0o644)
    message = _error(_config, _seed(ON_ONE_HOST))
    assert message == (
        f"local cookie: file {made.path} has mode 0644, open to other users; it "
        f"must be 0600 (chmod 600 {made.path}) (or set "
        f"{envs.VLLM_DISAGG_ROUTER_TOKEN} on the router and every instance)"
    )
    # The API server's start-up check says the same, before engines start.
    vllm_config = type(
        "VllmConfig",
        (),
        {
            "kv_transfer_config": KVTransferConfig(
                **normalize_kv_transfer_json(_seed(ON_ONE_HOST))
            )
        },
    )()
    assert _error(check_p2p_config, vllm_config) == message


def test_with_allowed_peers_a_refused_cookie_is_a_warning(cookie_dir, monkeypatch):
    """An instance that allowed_peers vouch for starts as it did before the
    cookie: P2P on loopback unauthenticated, said once."""
    made = load_cookie()
    os.chmod(made.path.parent, 0o777)
    warnings: list[tuple] = []
    monkeypatch.setattr(p2p_security.logger, "warning", lambda *a: warnings.append(a))
    extra = {"kv_ip": "127.0.0.1", "allowed_peers": "127.0.0.1"}
    for _ in range(2):
        config = _config(_seed(extra))
        assert (config.secret, config.grant_token) == (None, None)
        config.check_security()
    [warning] = warnings
    text = warning[0] % warning[1:]
    assert f"directory {made.path.parent} has mode 0777" in text
    assert "the P2P plane on loopback is not authenticated" in text


def test_where_each_credential_came_from_is_logged_once_never_the_value(
    cookie_dir, monkeypatch
):
    lines: list[str] = []
    monkeypatch.setattr(
        p2p_security.logger, "info", lambda fmt, *a: lines.append(fmt % a)
    )
    for _ in range(3):
        config = _config(_seed(ON_ONE_HOST))
    path = cookie_dir / FILE_NAME
    assert lines == [
        f"P2pNcclConnector: P2P secret from the local cookie {path} (created)",
        f"P2pNcclConnector: router token from the local cookie {path} (created)",
    ]
    assert not any(
        v.decode() in line
        for line in lines
        for v in (config.secret, config.grant_token, load_cookie().value)
    )
    monkeypatch.setenv(envs.VLLM_DISAGG_ROUTER_TOKEN, "tok")
    _config(_seed(ON_ONE_HOST))
    assert lines[-1] == (
        f"P2pNcclConnector: router token from {envs.VLLM_DISAGG_ROUTER_TOKEN}"
    )


def test_a_proxy_of_ones_own_signs_with_what_the_instances_use(cookie_dir, monkeypatch):
    """The README's 1P1D snippet: `router_token_on_this_host()`."""
    from vllm_disagg.testing.p2p import router_token_on_this_host

    config = _config(_seed({"kv_ip": "127.0.0.1"}, "kv_consumer"))
    assert router_token_on_this_host() == config.grant_token
    monkeypatch.setenv(envs.VLLM_DISAGG_ROUTER_TOKEN, "tok")
    assert router_token_on_this_host() == b"tok" == _config(_seed({})).grant_token
