"""RouterConfig flags and their one-line errors; the console script."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from vllm_disagg import envs
from vllm_disagg.errors import ConfigError
from vllm_disagg.router.__main__ import make_parser
from vllm_disagg.router.config import RouterConfig, StaticInstance

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = (
    REPO
    / "examples/online_serving/disaggregated_serving_p2p_nccl_xpyd"
    / "disagg_proxy_p2p_nccl_xpyd.py"
)


def parse(*argv: str) -> RouterConfig:
    return RouterConfig.from_cli_args(make_parser().parse_args(list(argv)))


def test_defaults_are_the_design_documents_ports():
    config = parse()
    assert (config.port, config.discovery_port) == (10001, 30001)
    assert (config.policy_prefill, config.policy_decode, config.handoff) == (
        "round_robin",
        "round_robin",
        "sequential",
    )
    assert config.fallback_to_decode_prefill is False and config.max_retries == 2


def test_every_flag_reaches_the_config():
    config = parse(
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--discovery-port",
        "31000",
        "--policy-prefill",
        "prefix-aware",
        "--policy-decode",
        "least_outstanding",
        "--handoff",
        "concurrent",
        "--heartbeat-timeout-s",
        "12",
        "--connect-timeout-s",
        "1",
        "--prefill-timeout-s",
        "2",
        "--first-token-timeout-s",
        "3",
        "--chunk-timeout-s",
        "4",
        "--request-timeout-s",
        "5",
        "--max-retries",
        "0",
        "--breaker-failures",
        "7",
        "--breaker-cooldown-s",
        "8",
        "--fallback-to-decode-prefill",
        "--max-body-bytes",
        "4096",
        "--prefix-index-max-entries",
        "99",
        "--prefix-chunk-chars",
        "32",
        "--prefix-balance-threshold",
        "0",
        "--registration-token",
        "s3cr3t",
        "--static-prefill",
        "10.0.0.1:20001,10.0.0.1:21001",
        "[::1]:20002,[::1]:21002,m",
        "--static-decode",
        "h:1,h:2",
        "--log-level",
        "DEBUG",
    )
    assert config.policy_prefill == "prefix_aware" and config.handoff == "concurrent"
    assert (config.heartbeat_timeout_s, config.chunk_timeout_s) == (12, 4)
    assert config.breaker_failures == 7
    assert config.static_prefill == (
        StaticInstance("10.0.0.1:20001", "10.0.0.1:21001"),
        StaticInstance("[::1]:20002", "[::1]:21002", "m"),
    )
    assert config.static_decode == (StaticInstance("h:1", "h:2"),)
    assert config.token == b"s3cr3t" and "s3cr3t" not in repr(config)
    assert config.log_level == "debug" and config.prefix_balance_threshold == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--policy-decode", "prefix_aware"],
            "--policy-decode: 'prefix_aware' is not one of round_robin, "
            "least_outstanding",
        ),
        (
            ["--handoff", "eager"],
            "--handoff: 'eager' is not one of sequential, concurrent",
        ),
        (["--port", "70000"], "--port: 70000 is not a port"),
        (
            ["--chunk-timeout-s", "0"],
            "--chunk-timeout-s: 0.0 is not a number of seconds",
        ),
        (
            ["--request-timeout-s", "nan"],
            "--request-timeout-s: nan is not a number of seconds",
        ),
        (["--max-retries", "-1"], "--max-retries: -1 is not an integer in 0..10"),
        (["--max-body-bytes", "10"], "--max-body-bytes: 10 is not an integer in"),
        (
            ["--static-prefill", "10.0.0.1:1"],
            "--static-prefill: '10.0.0.1:1' is not HTTP_ADDR,KV_ADDR",
        ),
        (
            ["--static-decode", "nohost,h:2"],
            "--static-decode HTTP_ADDR: 'nohost' is not 'host:port'",
        ),
        (["--registration-token", ""], "--registration-token: must not be empty"),
        (
            ["--http-server", "gunicorn"],
            "--http-server: 'gunicorn' is not one of uvicorn, hypercorn",
        ),
    ],
)
def test_bad_values_name_the_flag(argv, message):
    with pytest.raises(ConfigError) as e:
        parse(*argv)
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_token_falls_back_to_the_environment(monkeypatch):
    monkeypatch.setenv(envs.VLLM_DISAGG_ROUTER_TOKEN, "from-env")
    assert RouterConfig().token == b"from-env"
    assert RouterConfig(registration_token="flag").token == b"flag"
    monkeypatch.setenv(envs.VLLM_DISAGG_ROUTER_TOKEN, "")
    # Nothing given and no local cookie (test_local_cookie.py): no token.
    assert RouterConfig(local_cookie=False).token is None


def test_add_cli_args_composes_with_another_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mine")
    RouterConfig.add_cli_args(parser)
    args = parser.parse_args(["--mine", "x", "--port", "5"])
    assert RouterConfig.from_cli_args(args).port == 5


def test_console_script_bad_flag_is_one_line_exit_2():
    result = subprocess.run(
        [sys.executable, "-m", "vllm_disagg.router", "--handoff", "eager"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr == (
        "vllm-disagg-router: error: --handoff: 'eager' is not one of sequential, "
        "concurrent\n"
    )


@pytest.mark.parametrize("http_server", ["uvicorn", "hypercorn"])
@pytest.mark.parametrize("taken", ["--port", "--discovery-port"])
def test_a_port_in_use_is_one_line_exit_1(http_server, taken):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        ports = {
            "--port": "0",
            "--discovery-port": "0",
            taken: str(holder.getsockname()[1]),
        }
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "vllm_disagg.router",
                "--host",
                "127.0.0.1",
                "--discovery-host",
                "127.0.0.1",
                "--http-server",
                http_server,
                *(item for pair in ports.items() for item in pair),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("vllm-disagg-router: error: cannot listen: "), (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def test_example_script_serves_and_stops_on_sigterm(tmp_path):
    """The example proxy (the router's main) starts, answers /health and
    exits cleanly on SIGTERM."""
    log = tmp_path / "router.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(EXAMPLE),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--discovery-host",
                "127.0.0.1",
                "--discovery-port",
                "0",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        port = None
        deadline = time.monotonic() + 30
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            found = re.search(
                r"router: HTTP on http://127\.0\.0\.1:(\d+) ", log.read_text()
            )
            port = found and int(found[1])
            time.sleep(0.05)
        assert port, log.read_text()
        resp = requests.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert resp.status_code == 503 and resp.json()["status"] == "unavailable"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
