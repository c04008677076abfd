"""The README's xPyD recipe on one machine, typed as written, with nothing
exported: `vllm-disagg-router` with its defaults (HTTP and discovery on
every address) and one prefill and one decode `vllm serve` of the tiny
model with the JSON's kv_ip/proxy_ip on loopback, no `--host`, and neither
VLLM_DISAGG_ROUTER_TOKEN nor VLLM_DISAGG_P2P_SECRET in their environment.

Before issue 28 each instance exited at start ("nothing vouches for the
peers a request names"). Now the first of the three processes creates this
user's local cookie and all of them derive the router token and the P2P
secret from it: completions through the router equal the colocated answer
with the KV over the connector, and a registration from beyond loopback
(this machine's own non-loopback address) is refused, signed or not.
(That another user is refused: tests/router/test_local_cookie.py.)

The harness's environment is used for memory and threads only; its default
router token is removed. XDG_RUNTIME_DIR points at a fresh private
directory, so the three processes start with no cookie and race to make it.
"""

from __future__ import annotations

import os
import stat
import sys
import time

import pytest
import zmq

from vllm_disagg import envs
from vllm_disagg.testing import openai_client
from vllm_disagg.testing.p2p import P2pInstance, free_kv_port
from vllm_disagg.testing.router import RouterProcess
from vllm_disagg.testing.server import VllmServer, cpu_test_env, get_free_port
from vllm_disagg.wire.cookie import DIR_NAME, FILE_NAME, ROUTER_TOKEN, load_cookie
from vllm_disagg.wire.discovery import (
    DISCOVERY_VERSION,
    Register,
    Role,
    open_frame,
    seal,
)

from .e2e_common import LENGTH_PROMPTS, ids, key, metric

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
# Only what three servers on a 2-core CI machine need (as the other e2e tests).
ARGS = [
    "--max-model-len",
    "1024",
    "--seed",
    "0",
    "--dtype",
    "float32",
    "--enforce-eager",
]


class TypedServer(VllmServer):
    """`vllm serve MODEL --port N ...` with no --host, as the README types it."""

    @property
    def command(self) -> list[str]:
        command = super().command
        at = command.index("--host")
        return command[:at] + command[at + 2 :]


def _readme_json(role: str, kv_port: int, discovery_port: int, http_port: int) -> str:
    """The README's xPyD JSON (its ports replaced by free ones)."""
    buffer = "1e1" if role == "kv_producer" else "1e9"
    return (
        f'{{"kv_connector":"P2pNcclConnector","kv_role":"{role}",'
        f'"kv_buffer_size":"{buffer}","kv_port":"{kv_port}",'
        f'"kv_connector_extra_config":{{"kv_ip":"127.0.0.1","proxy_ip":"127.0.0.1",'
        f'"proxy_port":"{discovery_port}","http_port":"{http_port}"}}}}'
    )


@pytest.fixture(scope="module")
def fleet(tiny_models, tmp_path_factory):
    model = str(tiny_models["tiny-llama"])
    logs = tmp_path_factory.mktemp("local-cookie-logs")
    run = tmp_path_factory.mktemp("xdg-run")
    os.chmod(run, 0o700)
    env = cpu_test_env(XDG_RUNTIME_DIR=str(run))
    for name in (
        envs.VLLM_DISAGG_ROUTER_TOKEN,
        envs.VLLM_DISAGG_P2P_SECRET,
        envs.VLLM_DISAGG_P2P_SECRET_FILE,
    ):
        env.pop(name, None)

    router = RouterProcess(log_path=logs / "router.log", model=model, env=env)
    # `vllm-disagg-router` with its default addresses (every address).
    router.command = [
        os.path.join(os.path.dirname(sys.executable), "vllm-disagg-router"),
        "--port",
        str(router.port),
        "--discovery-port",
        str(router.discovery_port),
    ]
    started: list = []
    try:
        members = {}
        servers = []
        for name, role in (("p", "kv_producer"), ("d", "kv_consumer")):
            kv_port, http_port = free_kv_port(), get_free_port()
            server = TypedServer(
                model,
                [
                    *ARGS,
                    "--kv-transfer-config",
                    _readme_json(role, kv_port, router.discovery_port, http_port),
                ],
                log_path=logs / f"{name}.log",
                env=env,
                port=http_port,
            )
            servers.append(server)
            members[name] = P2pInstance(server, kv_port)
        # All three at once: they race to create the cookie.
        for server in servers:
            server.launch()
            started.append(server)
        router.start()
        started.append(router)
        for server in servers:
            server.wait_ready()
        router.wait_for_instances(
            lambda found: len(found) >= 2, timeout_s=60, what="2 registered instances"
        )
        yield router, members, run, logs
    finally:
        for proc in reversed(started):
            proc.stop()


def _tail(logs) -> str:
    return "\n".join(
        f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-40:])
        for p in sorted(logs.iterdir())
    )


def test_the_recipe_serves_with_the_kv_over_the_connector(fleet):
    router, members, run, logs = fleet
    prefill, decode = members["p"], members["d"]
    reference = {
        key(p): ids(
            prefill.server.complete(
                p, max_tokens=MAX_TOKENS, temperature=0.0, return_token_ids=True
            )
        )
        for p in LENGTH_PROMPTS
    }
    failed = metric(decode, "vllm:p2p_failed_loads")
    received = metric(decode, "vllm:p2p_blocks_received")
    refused = metric(decode, "vllm:p2p_refused_peers")
    for i, prompt in enumerate(LENGTH_PROMPTS):
        body = openai_client.complete(
            router,
            prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            return_token_ids=True,
        )
        assert ids(body) == reference[key(prompt)], f"prompt {i}\n{_tail(logs)}"
    time.sleep(2)  # stats reach the API server with the engine's outputs
    assert metric(decode, "vllm:p2p_blocks_received") > received, _tail(logs)
    assert metric(decode, "vllm:p2p_failed_loads") == failed
    assert metric(prefill, "vllm:p2p_refused_peers") == 0
    assert metric(decode, "vllm:p2p_refused_peers") == refused == 0


def test_one_private_cookie_and_its_source_logged_never_its_value(fleet):
    router, members, run, logs = fleet
    path = run / DIR_NAME / FILE_NAME
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    text = {p.name: p.read_text(errors="replace") for p in logs.iterdir()}
    assert f"using the local cookie {path}" in text["router.log"]
    for name in ("p.log", "d.log"):
        assert f"router token from the local cookie {path}" in text[name]
        assert f"P2P secret from the local cookie {path}" in text[name]
        assert "nothing vouches" not in text[name]
    cookie = load_cookie(path.parent)
    assert not cookie.created
    for secret in (cookie.value, cookie.key(ROUTER_TOKEN)):
        assert not any(secret.decode() in t for t in text.values())


def _outside_address() -> str | None:
    from vllm.utils.network_utils import get_ip

    host = get_ip()
    return None if host.startswith("127.") or ":" in host else host


def test_a_registration_from_beyond_loopback_is_refused(fleet):
    """The router listens on every address (its defaults); through this
    machine's own outside address a frame comes from beyond loopback, and
    the cookie, signed or not, is for loopback only."""
    router, members, run, logs = fleet
    host = _outside_address()
    if host is None:
        pytest.skip("no address beyond loopback on this machine")
    token = load_cookie(run / DIR_NAME).key(ROUTER_TOKEN)
    ctx = zmq.Context()
    try:
        for signed in (token, None):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
            sock.connect(f"tcp://{host}:{router.discovery_port}")
            msg = Register(
                DISCOVERY_VERSION,
                "from-outside",
                Role.DECODE,
                f"{host}:20009",
                f"{host}:22009",
                router.model,
                sent_at=time.time(),
            )
            sock.send_multipart(seal(signed, msg))
            ack = open_frame(None, sock.recv_multipart())
            sock.close()
            assert not ack.accepted and "loopback only" in ack.reason, ack
    finally:
        ctx.term()
    assert {i["kv_addr"] for i in router.instances()} == {
        members["p"].kv_addr,
        members["d"].kv_addr,
    }
