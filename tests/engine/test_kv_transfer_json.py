"""p2p-kv-transfer-json: vLLM's real CLI parser accepts the seed design
document's --kv-transfer-config for P2pNcclConnector, and a bad value is one
argparse error naming the key; the EngineArgs wrappers normalise a dict."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest
from vllm.config.kv_transfer import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_disagg import envs
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import (
    P2pConfig,
    SendType,
    check_p2p_config,
)
from vllm_disagg.errors import ConfigError
from vllm_disagg.patches import PATCHES
from vllm_disagg.patches.engine import arg_utils, arg_utils_p2p

BY_NAME = {p.name: p for p in PATCHES}
PATCH = BY_NAME["p2p-kv-transfer-json"]


def seed_json(role: str, buffer: str, port: str, **extra) -> str:
    """The design document's command-line JSON, verbatim in shape."""
    return json.dumps(
        {
            "kv_connector": "P2pNcclConnector",
            "kv_role": role,
            "kv_buffer_size": buffer,
            "kv_port": port,
            "kv_connector_extra_config": {
                "proxy_ip": "10.0.1.1",
                "proxy_port": "30001",
                "http_port": "20001",
                **extra,
            },
        },
        separators=(",", ":"),
    )


@pytest.fixture(scope="module")
def parser():
    """Upstream vLLM's CLI parser built with the patch applied (the way AsyncEngineArgs
    builds `vllm serve`'s), upstream restored afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("add_cli_args", "__post_init__", "create_engine_config"):
            mp.setattr(EngineArgs, name, EngineArgs.__dict__[name])
        mp.setattr(arg_utils, "_feature_config_checks", [])
        mp.setattr(arg_utils, "_feature_args_fixups", [])
        assert not PATCH.is_applied()
        BY_NAME["startup-validation"].apply()
        PATCH.apply()
        PATCH.apply()  # idempotent
        assert PATCH.is_applied()
        assert arg_utils._feature_config_checks == [check_p2p_config]
        yield EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm serve"))
    assert not PATCH.is_applied()


def test_registry_entry():
    assert PATCH.kind == "feature"
    assert PATCH.module == arg_utils_p2p.__name__
    assert "Unexpected keyword argument" in PATCH.why
    # It hooks into the enabler's wrappers, so it comes after it.
    assert PATCHES.index(BY_NAME["startup-validation"]) < PATCHES.index(PATCH)


@pytest.mark.parametrize(
    "role, buffer, port, size",
    [("kv_producer", "1e1", "21001", 10), ("kv_consumer", "8e9", "22001", 8 * 10**9)],
)
def test_seed_json_is_accepted(parser, role, buffer, port, size):
    args = parser.parse_args(["--kv-transfer-config", seed_json(role, buffer, port)])
    ktc = args.kv_transfer_config
    assert isinstance(ktc, KVTransferConfig)
    assert (ktc.kv_connector, ktc.kv_role, ktc.kv_port) == (
        "P2pNcclConnector",
        role,
        int(port),
    )
    assert ktc.kv_load_failure_policy == "recompute"
    assert ktc.kv_connector_extra_config == {
        "proxy_ip": "10.0.1.1",
        "proxy_port": "30001",
        "http_port": "20001",
        "kv_buffer_size": buffer,
    }
    config = P2pConfig.from_kv_transfer_config(ktc)
    assert (config.role, config.base_port, config.kv_buffer_size) == (
        role,
        int(port),
        size,
    )
    assert EngineArgs.from_cli_args(args).kv_transfer_config is ktc


def test_dotted_form_goes_through_the_same_type(parser):
    args = parser.parse_args(
        [
            "--kv-transfer-config.kv_connector=P2pNcclConnector",
            "--kv-transfer-config.kv_role=kv_consumer",
            "--kv-transfer-config.kv_buffer_size=1e1",
            "--kv-transfer-config.kv_port=22001",
            "--kv-transfer-config.kv_connector_extra_config.send_type=get",
        ]
    )
    config = P2pConfig.from_kv_transfer_config(args.kv_transfer_config)
    assert (config.kv_buffer_size, config.base_port, config.send_type) == (
        10,
        22001,
        SendType.GET,
    )


def test_other_connectors_parse_as_upstream(parser):
    text = '{"kv_connector":"ExampleConnector","kv_role":"kv_both","kv_port":"1"}'
    ktc = parser.parse_args(["--kv-transfer-config", text]).kv_transfer_config
    assert ktc.kv_load_failure_policy == "fail"  # upstream's default, untouched
    assert parser.parse_args([]).kv_transfer_config is None


@pytest.mark.parametrize(
    "text, message",
    [
        (
            seed_json("kv_producer", "1e1", "21001", send_type="PUSH"),
            "kv_connector_extra_config.send_type: 'PUSH' is not one of PUT, GET, "
            "PUT_ASYNC",
        ),
        (
            seed_json("kv_producer", "lots", "21001"),
            "kv_connector_extra_config.kv_buffer_size: 'lots' is not a number of bytes",
        ),
        (seed_json("kv_producer", "1e1", "abc"), "kv_port: 'abc' is not a port number"),
        (
            seed_json("kv_producer", "1e1", "21001", send_typ="PUT"),
            "kv_connector_extra_config.send_typ: unknown key (did you mean "
            "'send_type'?)",
        ),
    ],
)
def test_bad_values_are_one_argparse_line(parser, capsys, text, message):
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--kv-transfer-config", text])
    assert info.value.code == 2
    err = capsys.readouterr().err
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert error_lines == [line for line in error_lines if message in line]
    assert len(error_lines) == 1
    assert error_lines[0].startswith(
        "vllm serve: error: argument --kv-transfer-config: "
    )
    assert "Traceback" not in err and "validation error" not in err


# --- the EngineArgs wrappers, called directly --------------------------------


def test_post_init_normalises_a_dict_before_upstream(monkeypatch):
    seen = []
    monkeypatch.setattr(
        arg_utils,
        "_upstream_post_init",
        lambda self: seen.append(self.kv_transfer_config),
    )
    monkeypatch.setattr(
        arg_utils,
        "_feature_args_fixups",
        [arg_utils_p2p.normalize_engine_args_kv_transfer],
    )
    config = json.loads(seed_json("kv_consumer", "8e9", "22001"))
    arg_utils.__post_init__(
        SimpleNamespace(model="org/model", kv_transfer_config=config)
    )
    assert seen[0]["kv_connector_extra_config"]["kv_buffer_size"] == "8e9"
    assert "kv_buffer_size" not in seen[0]
    KVTransferConfig(**seen[0])  # now acceptable to upstream


def test_create_engine_config_normalises_and_checks(monkeypatch):
    """The first EngineArgs of a process runs upstream's __post_init__ (it
    loads the plugins), so create_engine_config normalises too, then runs
    check_p2p_config (port plan included) on the built config."""
    built = []

    def upstream(self, *args, **kwargs):
        built.append(self.kv_transfer_config)
        parallel = SimpleNamespace(
            data_parallel_size=50000, tensor_parallel_size=1, pipeline_parallel_size=1
        )
        return SimpleNamespace(
            kv_transfer_config=KVTransferConfig(**self.kv_transfer_config),
            parallel_config=parallel,
        )

    monkeypatch.setattr(arg_utils, "_upstream_create_engine_config", upstream)
    monkeypatch.setattr(arg_utils, "check_cpu_head_size", lambda config: None)
    monkeypatch.setattr(arg_utils, "_feature_args_fixups", [])
    monkeypatch.setattr(arg_utils, "_feature_config_checks", [])
    monkeypatch.setattr(EngineArgs, "add_cli_args", EngineArgs.__dict__["add_cli_args"])
    arg_utils_p2p.apply()
    args = SimpleNamespace(
        distributed_executor_backend=None,
        data_parallel_backend="mp",
        kv_transfer_config=json.loads(seed_json("kv_producer", "1e1", "21001")),
    )
    monkeypatch.setenv(envs.VLLM_DISAGG_P2P_SECRET, "s3cr3t")  # kv_ip is not loopback
    monkeypatch.setenv(envs.VLLM_DISAGG_ROUTER_TOKEN, "tok")
    with pytest.raises(
        ConfigError, match=r"^kv_port: 21001 needs ports 21001\.\.71000"
    ):
        arg_utils.create_engine_config(args)
    assert built[0]["kv_load_failure_policy"] == "recompute"


# --- the real console script ---------------------------------------------------


@pytest.mark.e2e
def test_vllm_serve_accepts_the_seed_json(tmp_path):
    """`vllm serve` (the plugin loads in AsyncEngineArgs.add_cli_args): the
    seed JSON parses, so the first error is about the missing model; a bad
    value exits 2 naming the key."""
    from vllm_disagg.testing.server import cpu_test_env, vllm_executable

    def serve(text):
        return subprocess.run(
            [
                vllm_executable(),
                "serve",
                str(tmp_path / "none"),
                "--kv-transfer-config",
                text,
            ],
            capture_output=True,
            text=True,
            timeout=180,
            env=cpu_test_env(),
        )

    good = serve(seed_json("kv_producer", "1e1", "21001"))
    # Arguments are parsed before the model is looked for.
    assert good.returncode == 2, good.stderr[-3000:]
    assert "no such file or directory" in good.stderr, good.stderr[-3000:]
    bad = serve(seed_json("kv_producer", "1e1", "21001", send_type="PUSH"))
    assert bad.returncode == 2
    assert "kv_connector_extra_config.send_type: 'PUSH' is not one of" in bad.stderr
    assert "Traceback" not in bad.stderr
