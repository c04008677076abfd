"""Every rank registers or the group does not start; only members can speak."""

from __future__ import annotations

import random
import threading
import time

import msgspec
import pytest
import zmq
from step_sync_helpers import settled, wait_until

from vllm_disagg.v1.engine.step_sync import (
    PROTOCOL_VERSION,
    TO_COORDINATOR,
    TO_PARTICIPANT,
    Abort,
    Coordinator,
    Participant,
    RankState,
    StepSyncConfig,
    StepSyncGroupError,
    new_group_secret,
    seal,
)
from vllm_disagg.wire.frames import MAC_BYTES


def _participant(config, rank, address, secret, failures):
    return Participant(
        config,
        rank,
        address,
        secret,
        lambda step: None,
        lambda r: failures.append((rank, r)),
    ).start()


def test_a_rank_that_never_registers_fails_every_rank_at_start_up():
    config = StepSyncConfig(dp_size=3, lookahead=2, peer_timeout_s=0.5)
    secret = new_group_secret()
    failures: list = []
    coord = Coordinator(
        config, "tcp://127.0.0.1:0", secret, on_failure=failures.append
    ).start()
    parts = [_participant(config, r, coord.address, secret, failures) for r in (0, 2)]
    try:
        started = time.monotonic()
        for part in parts:
            with pytest.raises(
                StepSyncGroupError, match=r"DP rank\(s\) 1 did not join"
            ):
                part.wait_for_group(30)
        assert (
            time.monotonic() - started < 15
        )  # the coordinator's reason, not a 30 s wait
        # Participants append (rank, reason) and may hear the Abort before the
        # coordinator's own report lands: it reports after sending the Aborts
        # (CI saw the participants raise first), so wait for it.
        wait_until(
            lambda: any(isinstance(f, str) for f in failures),
            timeout_s=5,
            what="the coordinator's report",
        )
        coordinator_reports = [f for f in failures if isinstance(f, str)]
        assert (
            coordinator_reports
            and "DP rank(s) 1 did not join" in coordinator_reports[0]
        )
    finally:
        coord.close(timeout_s=1)
        for part in parts:
            part.close(timeout_s=0.2)


def test_a_rank_that_registers_after_the_group_failed_is_told_why():
    """CI saw a loaded machine start a rank after the join deadline: it got
    running-group states and waited for its own timeout, not the reason."""
    config = StepSyncConfig(dp_size=2, lookahead=2, peer_timeout_s=0.3)
    secret = new_group_secret()
    failures: list = []
    coord = Coordinator(
        config, "tcp://127.0.0.1:0", secret, on_failure=failures.append
    ).start()
    late = None
    try:
        wait_until(lambda: failures, timeout_s=5, what="the join deadline")
        late = _participant(config, 0, coord.address, secret, failures)
        started = time.monotonic()
        with pytest.raises(StepSyncGroupError, match=r"DP rank\(s\) 0, 1 did not join"):
            late.wait_for_group(10)
        assert time.monotonic() - started < 8, (
            "learned by its own deadline, not from rank 0"
        )
    finally:
        coord.close(timeout_s=1)
        if late is not None:
            late.close(timeout_s=0.2)


def test_a_rejected_rank_is_told_why_and_the_group_does_not_start():
    """One external-LB server started with a different --additional-config."""
    config = StepSyncConfig(dp_size=2, lookahead=2, peer_timeout_s=30)
    other = StepSyncConfig(dp_size=2, lookahead=4, peer_timeout_s=30)
    secret = new_group_secret()
    failures: list = []
    coord = Coordinator(
        config, "tcp://127.0.0.1:0", secret, on_failure=failures.append
    ).start()
    parts = [
        _participant(config, 0, coord.address, secret, failures),
        _participant(other, 1, coord.address, secret, failures),
    ]
    try:
        started = time.monotonic()
        for part in parts:
            with pytest.raises(
                StepSyncGroupError, match="DP rank 1 was rejected"
            ) as error:
                part.wait_for_group(10)
            assert "step_sync_lookahead=4" in str(error.value)
        assert time.monotonic() - started < 8, "failed by the deadline, not at once"
        # Rank 0 is a member only if it spoke before rank 1 was rejected: a
        # failed group admits no one.
        assert 1 not in coord.registered
    finally:
        coord.close(timeout_s=1)
        for part in parts:
            part.close(timeout_s=0.2)


def test_a_participant_without_the_secret_cannot_join():
    config = StepSyncConfig(dp_size=2, lookahead=2, peer_timeout_s=0.5)
    secret = new_group_secret()
    failures: list = []
    coord = Coordinator(
        config, "tcp://127.0.0.1:0", secret, on_failure=failures.append
    ).start()
    good = _participant(config, 0, coord.address, secret, failures)
    bad = _participant(config, 1, coord.address, new_group_secret(), failures)
    try:
        with pytest.raises(StepSyncGroupError, match=r"DP rank\(s\) 1 did not join"):
            good.wait_for_group(5)
        assert coord.counters.snapshot()["unauthenticated_messages"] >= 1
    finally:
        coord.close(timeout_s=1)
        good.close(timeout_s=0.2)
        bad.close(timeout_s=0.2)


def _state(rank, seq, **overrides):
    fields = dict(
        version=PROTOCOL_VERSION,
        dp_rank=rank,
        dp_size=2,
        lookahead=2,
        incarnation="intruder",
        seq=seq,
        requested=0,
        local_step=0,
        intent=0,
        want_pause=False,
        pause_ready=False,
        leaving=False,
        left=False,
    )
    fields.update(overrides)
    return RankState(**fields)


def _forged_frames(
    rng: random.Random, secret: bytes, real_incarnations: dict[int, str]
):
    """Frames a stranger (or a replayer) could send to the coordinator port."""
    enc = msgspec.msgpack.encode
    kind = rng.randrange(9)
    if kind == 0:
        return [rng.randbytes(rng.randint(0, 200))]
    if kind == 1:  # truncated valid-looking message with a random MAC
        payload = enc(_state(rng.randrange(2), rng.randint(1, 99), requested=5))
        return [payload[: rng.randint(0, len(payload))], rng.randbytes(MAC_BYTES)]
    if kind == 2:  # oversized: ZMQ drops it (MAXMSGSIZE) and the connection
        return None
    if kind == 3:  # a new "incarnation" of a real rank, unauthenticated
        return [
            enc(_state(1, 10**6, incarnation="restarted")),
            rng.randbytes(MAC_BYTES),
        ]
    if kind == 4:  # a step request for a real rank with its real incarnation
        rank = rng.randrange(2)
        state = _state(rank, 10**6, requested=3, incarnation=real_incarnations[rank])
        return [enc(state), rng.randbytes(MAC_BYTES)]
    if kind == 5:  # an Abort (coordinators never take one)
        return [enc(Abort(PROTOCOL_VERSION, 1, "forged")), rng.randbytes(MAC_BYTES)]
    if kind == 6:  # signed with the right key but replayed (stale sequence number)
        rank = rng.randrange(2)
        state = _state(rank, 1, requested=1, incarnation=real_incarnations[rank])
        return seal(secret, TO_COORDINATOR, state)
    if kind == 7:  # signed for the other direction (reflection)
        state = _state(0, 10**6, incarnation=real_incarnations[0])
        return seal(secret, TO_PARTICIPANT, state)
    return [rng.randbytes(8), rng.randbytes(8), rng.randbytes(8)]  # wrong frame count


def test_a_flood_of_foreign_forged_and_malformed_frames_changes_nothing(group, caplog):
    coord, engines = group(2, [0, 0], timeout_s=5.0)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    incarnations = {e.part.dp_rank: e.part._incarnation for e in engines}
    secret = engines[0].part._secret
    stop = threading.Event()
    sent = [0]
    counted = [0]  # frames the coordinator should see (ZMQ drops oversized ones)

    def flood():
        rng = random.Random(42)
        ctx = zmq.Context.instance()
        socks = []
        for i in range(4):  # several strangers, one with a real rank's id-like name
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.connect(coord.address)
            socks.append(sock)
        deadline = time.monotonic() + 20
        while not stop.is_set() and sent[0] < 5000 and time.monotonic() < deadline:
            frames = _forged_frames(rng, secret, incarnations)
            try:
                if frames is None:  # on its own connection, which ZMQ will drop
                    socks[3].send_multipart([b"x" * 5000, rng.randbytes(MAC_BYTES)])
                else:
                    socks[sent[0] % 3].send_multipart(frames)
                    counted[0] += 1
            except zmq.ZMQError:
                pass
            sent[0] += 1
            if sent[0] % 200 == 0:
                time.sleep(0.005)
        for sock in socks:
            sock.close(linger=5000)  # let the queued frames go out

    def dropped():
        counts = coord.counters.snapshot()
        return sum(
            counts[k]
            for k in (
                "unauthenticated_messages",
                "malformed_messages",
                "stale_messages",
            )
        )

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    wait_until(lambda: dropped() > 100, what="the flood to arrive")
    engines[0].add_work(60)  # requests flow while the flood goes on
    engines[1].add_work(40)
    wait_until(
        lambda: settled(coord, engines), timeout_s=30, what="the group to finish work"
    )
    flooder.join(30)
    stop.set()
    assert sent[0] >= 5000
    # Everything was dropped and counted (all but the oversized frames, which
    # ZMQ drops itself); nothing moved the group or aborted it.
    wait_until(
        lambda: dropped() >= counted[0] > 4000,
        what=lambda: f"rejections of {counted[0]} frames: {coord.counters.snapshot()}",
    )
    counts = coord.counters.snapshot()
    assert counts["unauthenticated_messages"] > 0 and counts["stale_messages"] > 0, (
        counts
    )
    assert not coord.failures and not engines[0].failures and not engines[1].failures
    assert coord.registered == [0, 1]
    assert engines[0].part.forward_steps == 60 and engines[1].part.forward_steps == 40
    assert {e.part.local_step for e in engines} == {coord.step}
    assert 60 <= coord.step <= 62
    # Log lines are rate-limited: a handful per kind of frame, not thousands.
    drop_lines = [r for r in caplog.records if "dropped frame" in r.getMessage()]
    assert len(drop_lines) <= 20, len(drop_lines)
