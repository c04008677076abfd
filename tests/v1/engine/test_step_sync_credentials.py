"""Step sync's credentials: only the DP group's members hold the secret.

* Where the secret comes from (``credentials.py``): the launching process's fresh
  one for engine cores it starts itself, the operator's ``VLLM_DISAGG_DP_SECRET``
  for ranks started separately (refused at start beyond loopback without it), the
  user's local cookie on loopback.
* What the DP group's TCP store serves (``rendezvous.py``): a real store and the real
  join of two ranks in this process; a stranger reads every key the store holds and
  tries every value, and its forged new incarnation of rank 1 (which failed the whole
  group when the store handed out the secret) changes nothing. The same frame under
  the members' key still does: the test would see a leak.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
import zmq
from step_sync_helpers import wait_until
from torch.distributed import TCPStore

from vllm_disagg import envs
from vllm_disagg.errors import ConfigError
from vllm_disagg.testing.step_sync import keys_from, read_store
from vllm_disagg.v1.engine.step_sync import (
    PROTOCOL_VERSION,
    TO_COORDINATOR,
    RankState,
    StepSyncConfig,
    StepSyncGroupError,
    rendezvous,
    seal,
)
from vllm_disagg.v1.engine.step_sync import credentials as cred
from vllm_disagg.wire import cookie

LOOPBACK, REMOTE = "127.0.0.1", "10.1.2.3"


def _parallel(
    dp_size=2,
    local=None,
    host=LOOPBACK,
    backend="mp",
    local_only=False,
):
    return SimpleNamespace(
        data_parallel_size=dp_size,
        data_parallel_size_local=dp_size if local is None else local,
        data_parallel_master_ip=host,
        data_parallel_backend=backend,
        local_engines_only=local_only,
    )


# One `vllm serve --data-parallel-size 2` (internal LB), one server per rank
# (external LB), hybrid LB on two nodes, a headless node with all ranks, the Ray
# backend, and an API-only node (no engine core here).
INTERNAL = _parallel()
EXTERNAL = _parallel(local=1, local_only=True)
HYBRID = _parallel(dp_size=4, local=2, local_only=True)
HEADLESS_ALL = _parallel(dp_size=2, local=2)
RAY = _parallel(local=1, backend="ray")
API_ONLY = _parallel(local=0)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No secret from the test runner's environment; the local cookie in a
    private directory of this test."""
    for name in (
        envs.VLLM_DISAGG_DP_SECRET,
        envs.VLLM_DISAGG_DP_SECRET_FILE,
        envs.VLLM_DISAGG_DP_LAUNCH_SECRET,
    ):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    runtime.chmod(0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return runtime


@pytest.mark.parametrize(
    "config, together",
    [
        (INTERNAL, True),
        (HEADLESS_ALL, True),
        (RAY, True),
        (EXTERNAL, False),
        (HYBRID, False),
        (API_ONLY, False),
    ],
    ids=["internal", "headless-all", "ray", "external", "hybrid", "api-only"],
)
def test_which_launches_start_every_rank(config, together):
    assert cred.launched_together(config) is together


def test_a_launcher_of_every_rank_hands_each_launch_a_fresh_secret():
    cred.prepare_launch(INTERNAL)
    first = os.environ[envs.VLLM_DISAGG_DP_LAUNCH_SECRET]
    cred.prepare_launch(INTERNAL)
    second = os.environ[envs.VLLM_DISAGG_DP_LAUNCH_SECRET]
    assert first != second and len(bytes.fromhex(second)) == 32
    # Beyond loopback too: nobody outside this process tree has it.
    cred.prepare_launch(_parallel(host=REMOTE))
    handed = os.environ[envs.VLLM_DISAGG_DP_LAUNCH_SECRET]
    # Its engine core takes it and removes it, so its workers never inherit it.
    secret = cred.group_secret(_parallel(host=REMOTE))
    assert secret.value == bytes.fromhex(handed)
    assert secret.source == cred.FROM_LAUNCHER
    assert envs.VLLM_DISAGG_DP_LAUNCH_SECRET not in os.environ
    assert handed not in repr(secret)


@pytest.mark.parametrize("config", [EXTERNAL, HYBRID], ids=["external", "hybrid"])
def test_separate_ranks_beyond_loopback_without_a_secret_are_refused_in_one_line(
    config,
):
    config.data_parallel_master_ip = REMOTE
    try:
        with pytest.raises(ConfigError) as refused:
            cred.prepare_launch(config)
        message = str(refused.value)
        assert "\n" not in message
        assert envs.VLLM_DISAGG_DP_SECRET in message and REMOTE in message
        with pytest.raises(ConfigError, match=envs.VLLM_DISAGG_DP_SECRET):
            cred.group_secret(config)
    finally:
        config.data_parallel_master_ip = LOOPBACK


def test_separate_ranks_use_the_operators_secret_or_file(monkeypatch, tmp_path):
    remote = _parallel(local=1, local_only=True, host=REMOTE)
    monkeypatch.setenv(envs.VLLM_DISAGG_DP_SECRET, "s3cret")
    cred.prepare_launch(remote)
    assert cred.group_secret(remote) == cred.GroupSecret(
        b"s3cret", envs.VLLM_DISAGG_DP_SECRET
    )
    monkeypatch.delenv(envs.VLLM_DISAGG_DP_SECRET)
    path = tmp_path / "dp-secret"
    path.write_text("from a file\n")
    monkeypatch.setenv(envs.VLLM_DISAGG_DP_SECRET_FILE, str(path))
    assert cred.group_secret(remote) == cred.GroupSecret(
        b"from a file", envs.VLLM_DISAGG_DP_SECRET_FILE
    )
    path.write_text("  \n")
    with pytest.raises(ConfigError, match=f"{envs.VLLM_DISAGG_DP_SECRET_FILE}.*empty"):
        cred.prepare_launch(remote)


def test_a_stale_launch_secret_does_not_reach_separately_started_ranks(monkeypatch):
    """One inherited from an ancestor launcher is dropped by the launcher of a
    separate rank, and ignored by such an engine core."""
    monkeypatch.setenv(envs.VLLM_DISAGG_DP_SECRET, "operator")
    monkeypatch.setenv(envs.VLLM_DISAGG_DP_LAUNCH_SECRET, "ab" * 32)
    cred.prepare_launch(EXTERNAL)
    assert envs.VLLM_DISAGG_DP_LAUNCH_SECRET not in os.environ
    monkeypatch.setenv(envs.VLLM_DISAGG_DP_LAUNCH_SECRET, "ab" * 32)
    assert cred.group_secret(EXTERNAL).value == b"operator"


def test_separate_ranks_on_loopback_share_the_users_local_cookie(clean_env):
    cred.prepare_launch(EXTERNAL)  # creates it, or fails at start
    first, second = cred.group_secret(EXTERNAL), cred.group_secret(EXTERNAL)
    assert first.value == second.value and len(first.value) == 64
    assert str(clean_env / cookie.DIR_NAME / cookie.FILE_NAME) in first.source
    # Its own key: not the router token's or the P2P secret's.
    found = cookie.load_cookie()
    assert first.value not in (
        found.key(cookie.ROUTER_TOKEN),
        found.key(cookie.P2P_SECRET),
    )


def test_a_local_cookie_open_to_other_users_is_refused_naming_the_variable(
    clean_env,
):
    cookie.load_cookie()
    (clean_env / cookie.DIR_NAME / cookie.FILE_NAME).chmod(0o644)
    with pytest.raises(ConfigError) as refused:
        cred.group_secret(EXTERNAL)
    assert "0644" in str(refused.value)
    assert envs.VLLM_DISAGG_DP_SECRET in str(refused.value)


def test_the_group_key_depends_on_the_secret_and_the_group():
    key = cred.group_key(b"secret", "g1")
    assert len(key) == 32
    assert key != cred.group_key(b"secret", "g2")
    assert key != cred.group_key(b"other", "g1")
    assert key == cred.group_key(b"secret", "g1")
    assert cred.new_group_id() != cred.new_group_id()


# --- what the DP group's TCP store serves ----------------------------------------

TIMEOUT = datetime.timedelta(seconds=10)


class _Group:
    """Two ranks joined through a real TCPStore with the real rendezvous; rank 1
    joins from a store client, as another process would."""

    def __init__(self, secret: cred.GroupSecret):
        self.config = StepSyncConfig(dp_size=2, lookahead=2, peer_timeout_s=10.0)
        self.store = TCPStore(
            LOOPBACK, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT
        )
        # Upstream keeps its own keys in the same store (the DP master port,
        # the gloo rendezvous): some of them, so the stranger reads those too.
        self.store.set("dp_master_port", b"29512")
        self.store.set("tcp://127.0.0.1:29512/0", b"gloo rendezvous address")
        self.failures: list[str] = []
        self.grants: list[tuple[int, int]] = []
        client = TCPStore(LOOPBACK, self.store.port, is_master=False, timeout=TIMEOUT)
        joined: dict[int, object] = {}

        def join(rank, store):
            joined[rank] = rendezvous.join(
                self.config,
                rank,
                store,
                secret,
                LOOPBACK,
                on_grant=lambda step, rank=rank: self.grants.append((rank, step)),
                on_failure=self.failures.append,
            )

        late = threading.Thread(target=join, args=(1, client))
        late.start()  # waits in the store for rank 0's address
        join(0, self.store)
        late.join(10)
        self.coordinator, self.part0 = joined[0]
        _, self.part1 = joined[1]
        for part in (self.part0, self.part1):
            part.wait_for_group(10)

    def close(self):
        for part in (self.part0, self.part1):
            part.close(timeout_s=0.5)
        self.coordinator.close(timeout_s=1)


def _new_incarnation_of_rank_1(seq: int) -> RankState:
    return RankState(
        PROTOCOL_VERSION, 1, 2, 2, "forged", seq, 0, 0, 0, False, False, False, False
    )


def test_everything_the_dp_store_serves_lets_no_one_speak_for_a_rank():
    secret = cred.GroupSecret(os.urandom(32), cred.FROM_LAUNCHER)
    group = _Group(secret)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        served = read_store(LOOPBACK, group.store.port)
        assert rendezvous.STORE_KEY in served
        published = json.loads(served[rendezvous.STORE_KEY])
        assert set(published) == {"version", "address", "group_id"}
        assert all(secret.value not in value for value in served.values())
        assert all(secret.value.hex().encode() not in v for v in served.values())
        candidates = keys_from(served)
        assert len(candidates) > 50
        sock.connect(published["address"])
        before = group.coordinator.counters.snapshot()["unauthenticated_messages"]
        for seq, key in enumerate(sorted(candidates), start=10**6):
            msg = _new_incarnation_of_rank_1(seq)
            sock.send_multipart(seal(key, TO_COORDINATOR, msg))
        wait_until(
            lambda: group.coordinator.counters.snapshot()["unauthenticated_messages"]
            >= before + len(candidates),
            what="the coordinator to drop every forged frame",
        )
        assert group.coordinator.core.failed is None and group.failures == []
        # The group is whole: rank 1 asks for steps and both ranks get them.
        group.part1.request_ahead()
        wait_until(
            lambda: {rank for rank, step in group.grants if step >= 2} == {0, 1},
            what="a grant to both ranks",
        )
        # The frame itself is what failed the group while the store served the
        # secret: under the members' key it still does.
        gid = published["group_id"]
        sock.send_multipart(
            seal(cred.group_key(secret.value, gid), TO_COORDINATOR, msg)
        )
        # (The shell reports the core's failure after it sent the Aborts.)
        wait_until(lambda: group.coordinator.failure is not None, what="abort")
        assert "DP rank 1 re-registered as a new process" in group.coordinator.failure
    finally:
        sock.close()
        group.close()


def test_a_rank_with_another_secret_cannot_join_and_says_what_to_check():
    config = StepSyncConfig(dp_size=2, lookahead=2, peer_timeout_s=0.5)
    store = TCPStore(
        LOOPBACK, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT
    )
    failures: list[str] = []
    joined = []
    try:
        for rank, value in ((0, b"a" * 32), (1, b"b" * 32)):
            secret = cred.GroupSecret(value, f"secret {rank}")
            coord, part = rendezvous.join(
                config, rank, store, secret, LOOPBACK, lambda s: None, failures.append
            )
            joined.append((coord, part, secret))
        coord0, part0, _ = joined[0]
        _, part1, secret1 = joined[1]
        started = time.monotonic()
        with pytest.raises(StepSyncGroupError, match=r"DP rank\(s\) 1 did not join"):
            part0.wait_for_group(10)
        wait_until(lambda: coord0.failure is not None, what="the coordinator's report")
        assert "frames failed authentication" in coord0.failure
        with pytest.raises(StepSyncGroupError) as not_formed:
            part1.wait_for_group(1)
        hint = rendezvous.not_formed_hint(part1, secret1)
        assert "share one step-sync secret? (this rank's: secret 1)" in hint
        assert time.monotonic() - started < 10, not_formed.value
    finally:
        for coord, part, _ in joined:
            part.close(timeout_s=0.2)
            if coord is not None:
                coord.close(timeout_s=1)


def test_a_store_entry_of_another_protocol_version_is_refused():
    store = TCPStore(
        LOOPBACK, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT
    )
    store.set(
        rendezvous.STORE_KEY,
        json.dumps({"version": 2, "address": "tcp://x:1", "group_id": "g"}).encode(),
    )
    with pytest.raises(
        StepSyncGroupError, match=f"protocol 2, this rank {PROTOCOL_VERSION}"
    ):
        rendezvous.lookup(store)
