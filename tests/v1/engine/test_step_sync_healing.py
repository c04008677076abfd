"""Lost messages heal, or the group fails fast with a message; it never hangs.

Rank 0's participant talks to the coordinator through a TCP relay that loses
data and resets connections (ZMQ reconnects by itself and drops whatever was
in flight), while simulated engines run real work."""

from __future__ import annotations

import re
import threading
import time

from step_sync_helpers import chaos, settled, wait_until


def test_a_request_lost_in_a_connection_reset_is_re_sent(group):
    coord, engines, relay = group(2, [0, 0], timeout_s=5.0, relay=True)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    relay.drop_upstream = True  # rank 0's next message is lost on the way
    engines[0].add_work(1)
    wait_until(lambda: engines[0].part.local_step == 1, what="rank 0's pass")
    time.sleep(0.2)
    assert coord.step == 0, "the request was not lost"
    relay.drop_upstream = False
    relay.reset()  # ZMQ reconnects; nothing re-sends the lost bytes
    wait_until(lambda: settled(coord, engines), timeout_s=10, what="the group to heal")
    assert coord.step >= 1
    assert not engines[0].failures and not engines[1].failures and not coord.failures
    assert engines[0].part.stats["resends"] >= 1


def test_a_lost_grant_is_healed(group):
    coord, engines, relay = group(2, [0, 0], timeout_s=5.0, relay=True)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    relay.drop_downstream = True  # grants to rank 0 are lost
    engines[1].add_work(5)
    wait_until(lambda: coord.step >= 5, what="rank 1's requests")
    time.sleep(0.2)
    assert engines[0].part.local_step == 0, "rank 0 got its grant anyway"
    relay.drop_downstream = False
    relay.reset()
    wait_until(lambda: settled(coord, engines), timeout_s=10, what="the group to heal")
    assert not engines[0].failures and not coord.failures


def test_steady_work_through_a_lossy_link_keeps_every_rank_in_step(group):
    coord, engines, relay = group(2, [0, 0], lookahead=2, timeout_s=5.0, relay=True)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    engines[0].add_work(150)
    engines[1].add_work(100)
    chaos_thread = threading.Thread(target=chaos, args=(relay, 3.0, 7), daemon=True)
    chaos_thread.start()
    chaos_thread.join()
    wait_until(
        lambda: settled(coord, engines),
        timeout_s=10,
        what=lambda: (
            f"all ranks at one step: coordinator {coord.step}, ranks "
            + str(
                [
                    (e.part.local_step, e.part.delivered, e.work_steps, e.failures)
                    for e in engines
                ]
            )
        ),
    )
    time.sleep(0.3)
    assert relay.chunks_dropped > 0, "the relay lost nothing; the test proves nothing"
    assert {e.part.local_step for e in engines} == {coord.step}
    assert engines[0].part.forward_steps == 150 and engines[1].part.forward_steps == 100
    assert 150 <= coord.step <= 150 + 2
    assert not engines[0].failures and not engines[1].failures and not coord.failures


def test_a_link_that_stays_down_fails_fast_with_a_message(group):
    coord, engines, relay = group(2, [0, 0], timeout_s=1.0, relay=True)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    started = time.monotonic()
    relay.drop_upstream = relay.drop_downstream = True
    engines[1].add_work(3)
    wait_until(
        lambda: coord.failures and engines[0].failures and engines[1].failures,
        timeout_s=15,
        what="every side to report the failure",
    )
    assert time.monotonic() - started < 8
    assert "DP rank 0 silent" in coord.failures[0]
    assert "coordinator silent" in engines[0].failures[0]
    assert "aborted the DP group" in engines[1].failures[0]


def test_a_rank_that_owes_passes_and_runs_none_is_reported(group):
    """An engine stuck outside its loop (or asleep) while its peers wait for
    it in a collective: no silence anywhere, yet no progress."""
    coord, engines, _relay = group(2, [0, 0], timeout_s=1.0, relay=True)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    engines[0].stop.set()  # the engine thread stops stepping; the network stays up
    engines[0].thread.join(2)
    engines[1].add_work(2)
    wait_until(lambda: engines[0].part.failure, timeout_s=5, what="the progress watch")
    assert re.search(
        r"DP rank 0 owes passes 1\.\.\d+ but ran none", engines[0].part.failure
    )


def test_a_pass_that_is_never_granted_is_reported(group):
    coord, engines, relay = group(2, [0, 0], timeout_s=1.0, relay=True)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    # The coordinator hangs (its process is stuck): it reads nothing, answers
    # nothing, and sends no Abort on its way out.
    coord._deliver = lambda sends: False
    coord._stop.set()
    engines[1].add_work(1)
    wait_until(lambda: engines[1].failures, timeout_s=5, what="a failure report")
    reason = engines[1].failures[0]
    assert "coordinator silent" in reason or "granted only up to 0" in reason
