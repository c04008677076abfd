"""The router's token on one host: with none given, this user's local cookie
(vllm_disagg/wire/cookie.py). Registrations and grants are then signed as
with any token, so a process that cannot read the cookie (another user's)
cannot register or sign; and registrations from beyond loopback are refused
as they are without a token."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from vllm_disagg import envs
from vllm_disagg.router.config import RouterConfig
from vllm_disagg.wire.cookie import DIR_NAME, FILE_NAME, ROUTER_TOKEN, load_cookie
from vllm_disagg.wire.discovery import (
    DISCOVERY_VERSION,
    Ack,
    Register,
    Role,
    open_frame,
    seal,
)
from vllm_disagg.wire.grants import GRANT_KEY, GrantError, check_grant
from vllm_disagg.wire.peers import parse_peer_info

from .conftest import WAIT_S

COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 3}


@pytest.fixture
def cookie_dir(tmp_path, monkeypatch) -> Path:
    """No token exported, and a private XDG_RUNTIME_DIR with no cookie yet."""
    monkeypatch.delenv(envs.VLLM_DISAGG_ROUTER_TOKEN, raising=False)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    return run / DIR_NAME


def register(instance_id: str = "i-1", **fields) -> Register:
    values = dict(
        version=DISCOVERY_VERSION,
        instance_id=instance_id,
        role=Role.DECODE,
        http_addr="127.0.0.1:20002",
        kv_addr="127.0.0.1:22001",
        model="m",
        sent_at=time.time(),
    )
    return Register(**{**values, **fields})


async def _send(port: int, frames: list[bytes]) -> list[bytes]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        async with asyncio.timeout(WAIT_S):
            await sock.send_multipart(frames)
            return await sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()


# --- where the token comes from ---------------------------------------------


def test_without_a_token_the_router_uses_the_local_cookie(cookie_dir):
    credentials = RouterConfig().credentials
    cookie = load_cookie()
    assert credentials.token == cookie.key(ROUTER_TOKEN) and credentials.local
    assert credentials.source == f"the local cookie {cookie_dir / FILE_NAME} (created)"
    assert credentials.token.decode() not in repr(credentials) + repr(RouterConfig())
    assert RouterConfig().token == credentials.token  # a second router: the same


def test_a_given_token_wins_and_reads_no_cookie(cookie_dir, monkeypatch):
    monkeypatch.setenv(envs.VLLM_DISAGG_ROUTER_TOKEN, "from-env")
    credentials = RouterConfig().credentials
    assert (credentials.token, credentials.source, credentials.local) == (
        b"from-env",
        envs.VLLM_DISAGG_ROUTER_TOKEN,
        False,
    )
    flag = RouterConfig(registration_token="flag").credentials
    assert (flag.token, flag.source) == (b"flag", "--registration-token")
    assert not cookie_dir.exists()


def test_insecure_discovery_or_no_cookie_means_no_token(cookie_dir):
    """--insecure-discovery takes unsigned registrations from anywhere:
    instances elsewhere cannot have this host's cookie."""
    assert RouterConfig(insecure_discovery=True).token is None
    assert RouterConfig(local_cookie=False).token is None
    assert not cookie_dir.exists()


def test_a_cookie_open_to_others_is_refused_and_the_router_runs_without(cookie_dir):
    made = load_cookie()
    os.chmod(made.path, 0o604)
    credentials = RouterConfig().credentials
    assert credentials.token is None and not credentials.local
    assert credentials.cookie_problem == (
        f"local cookie: file {made.path} has mode 0604, open to other users; it "
        f"must be 0600 (chmod 600 {made.path})"
    )


# --- a router that uses it ----------------------------------------------------


async def test_registrations_must_carry_the_cookie(cookie_dir, start_router):
    router = await start_router(local_cookie=True)
    token = load_cookie().key(ROUTER_TOKEN)
    assert router.state.config.token == token
    port = router.state.discovery.port

    # This user's instance (same cookie): accepted.
    ack = open_frame(token, await _send(port, seal(token, register("mine"))))
    assert ack == Ack(DISCOVERY_VERSION, "mine", True)
    # Unsigned from loopback (accepted by a router with no token): refused.
    reply = open_frame(None, await _send(port, seal(None, register("unsigned"))))
    assert not reply.accepted and "registration token" in reply.reason
    # Signed with another cookie (another user's, who cannot read ours).
    other = os.urandom(32).hex().encode()
    reply = open_frame(None, await _send(port, seal(other, register("other"))))
    assert not reply.accepted
    assert [i["instance_id"] for i in router.registry.snapshot()] == ["mine"]
    assert router.state.discovery.rejected["unauthenticated"] == 2


async def test_from_beyond_loopback_it_says_the_cookie_is_for_loopback_only(
    cookie_dir, start_router
):
    router = await start_router(local_cookie=True)
    token = router.state.config.token
    reply = open_frame(
        token, router.state.discovery.handle(seal(token, register()), "192.0.2.7")
    )
    assert not reply.accepted
    assert reply.reason == (
        "unauthenticated: this router's token is its user's local cookie, for "
        f"loopback only (give the router and the instances "
        f"{envs.VLLM_DISAGG_ROUTER_TOKEN})"
    )
    assert router.registry.snapshot() == []


async def test_the_router_signs_grants_with_the_cookie(cookie_dir, pd):
    router, p, d = await pd(local_cookie=True)
    status, _, _ = await router.post("/v1/completions", COMPLETION)
    assert status == 200
    token = load_cookie().key(ROUTER_TOKEN)
    for seen in (p.requests[0], d.requests[0]):
        params = seen.body["kv_transfer_params"]
        peer = parse_peer_info(seen.headers["X-Request-Id"], params)
        check_grant(token, params[GRANT_KEY], peer)
        with pytest.raises(GrantError, match="forged"):
            check_grant(load_cookie().value, params[GRANT_KEY], peer)


# --- another user of the machine ----------------------------------------------

NOBODY = 65534

_OTHER_USER = textwrap.dedent(
    """
    import json, sys, time, zmq
    from pathlib import Path
    from vllm_disagg.wire.cookie import ROUTER_TOKEN, load_cookie
    from vllm_disagg.wire.discovery import (
        DISCOVERY_VERSION, Register, Role, open_frame, seal,
    )

    theirs, port = Path(sys.argv[1]), int(sys.argv[2])
    out = {}
    try:
        theirs.read_bytes()
        out["read_theirs"] = "read"
    except OSError as e:
        out["read_theirs"] = type(e).__name__
    mine = load_cookie()  # this user's own (XDG_RUNTIME_DIR is its own)
    out["own_cookie_created"] = mine.created
    ctx = zmq.Context()
    for name, token in (("own_cookie", mine.key(ROUTER_TOKEN)), ("unsigned", None)):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10000)
        sock.connect(f"tcp://127.0.0.1:{port}")
        msg = Register(DISCOVERY_VERSION, "intruder-" + name, Role.DECODE,
                       "127.0.0.1:20009", "127.0.0.1:22009", "m", sent_at=time.time())
        sock.send_multipart(seal(token, msg))
        ack = open_frame(None, sock.recv_multipart())
        out[name] = [ack.accepted, ack.reason]
        sock.close()
    print(json.dumps(out))
    """
)


def _code_root() -> Path:
    """The directory the cookie's package is imported from (this checkout, or
    an in-tree copy of vLLM), for the other user's PYTHONPATH."""
    top = sys.modules[load_cookie.__module__.split(".")[0]]
    return Path(top.__file__).resolve().parents[1]


def _others_can_read(path: Path) -> bool:
    """Whether a user outside this one's groups can reach ``path``."""
    for part in (path, *path.parents):
        if not part.stat().st_mode & stat.S_IXOTH:
            return False
    return bool(path.stat().st_mode & stat.S_IROTH)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as nobody")
async def test_another_user_cannot_read_the_cookie_nor_register(
    request, cookie_dir, start_router
):
    """The router runs as this user (root) with its cookie; a process of
    another user (nobody) on the same host, with its own cookie or none,
    cannot read this one and every registration it sends is refused."""
    code_root = _code_root()
    if not _others_can_read(code_root):
        pytest.skip(f"{code_root} is not readable by another user (a private tmp)")
    router = await start_router(local_cookie=True)
    theirs = load_cookie().path
    # Its own runtime directory, where it can reach it (not under ours).
    own_run = Path(tempfile.mkdtemp(prefix="cookie-nobody-"))
    request.addfinalizer(lambda: shutil.rmtree(own_run, ignore_errors=True))
    os.chown(own_run, NOBODY, NOBODY)
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(own_run),
        "XDG_RUNTIME_DIR": str(own_run),
        "PYTHONPATH": str(code_root),
    }
    proc = await asyncio.create_subprocess_exec(
        "setpriv",
        f"--reuid={NOBODY}",
        f"--regid={NOBODY}",
        "--clear-groups",
        sys.executable,
        "-c",
        _OTHER_USER,
        str(theirs),
        str(router.state.discovery.port),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=str(own_run),
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-2000:]
    result = json.loads(out)
    assert result["read_theirs"] == "PermissionError"
    assert result["own_cookie_created"] is True
    assert result["own_cookie"][0] is False
    assert result["unsigned"][0] is False
    assert router.registry.snapshot() == []
    assert router.state.discovery.rejected["unauthenticated"] == 2
