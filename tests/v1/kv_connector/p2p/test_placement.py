"""Where the P2P engine's threads run (engine/placement.py).

Under vLLM's CPU defaults the model thread is pinned to one core, and the
engine's threads inherited that pin: every worker of a host answered control
messages from one shared, spinning core (issue 27's 10 s stalls).
"""

from __future__ import annotations

import os
import threading

import pytest

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import placement

linux_only = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux-only"
)


def test_parse_cpu_list():
    assert placement.parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert placement.parse_cpu_list("5") == {5}
    assert placement.parse_cpu_list("") == set()


def test_choose_cpus_prefers_cores_the_openmp_team_left_free():
    # vLLM's auto binding on 8 cores with one reserved core: the team has 0-6.
    assert placement.choose_cpus(set(range(8)), set(range(7))) == {7}
    # The team took every core (2 cores, nothing reserved): use them all,
    # never the model thread's one core.
    assert placement.choose_cpus({0, 1}, {0, 1}) == {0, 1}
    # Unpinned workers: nothing changes.
    assert placement.choose_cpus({0, 1}, set()) == {0, 1}


def _task(root, name: str, cpus: str) -> None:
    d = root / name
    d.mkdir()
    (d / "status").write_text(f"Name:\tx\nCpus_allowed_list:\t{cpus}\n")


def test_pinned_cpus_reads_threads_narrower_than_the_process(tmp_path):
    _task(tmp_path, "100", "0")  # the model thread (OpenMP thread 0)
    _task(tmp_path, "101", "1")  # OpenMP thread 1
    _task(tmp_path, "102", "0-3")  # an unpinned thread
    assert placement.pinned_cpus({0, 1, 2, 3}, tmp_path) == {0, 1}
    assert placement.pinned_cpus({0, 1}, tmp_path / "missing") == set()


@linux_only
def test_threads_started_inside_placed_run_on_the_control_plane_cpus(monkeypatch):
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    pinned = {min(allowed)}
    monkeypatch.setattr(
        placement, "control_plane_cpus", lambda: frozenset(allowed - pinned)
    )
    seen: dict[str, set[int]] = {}

    def child() -> None:
        seen["child"] = os.sched_getaffinity(0)

    def model_thread() -> None:
        # Pinned the way vLLM pins its OpenMP thread 0.
        os.sched_setaffinity(0, pinned)
        with placement.placed():
            t = threading.Thread(target=child)
            t.start()
            t.join()
        seen["after"] = os.sched_getaffinity(0)

        def peer() -> None:  # started from the pinned thread, places itself
            placement.place_current_thread()
            seen["peer"] = os.sched_getaffinity(0)

        t = threading.Thread(target=peer)
        t.start()
        t.join()

    t = threading.Thread(target=model_thread)
    t.start()
    t.join()
    assert seen["child"] == allowed - pinned
    assert seen["after"] == pinned  # the model thread keeps its own pin
    assert seen["peer"] == allowed - pinned


@linux_only
def test_control_plane_cpus_never_narrower_than_a_free_core():
    cpus = placement.control_plane_cpus()
    assert cpus and cpus <= placement.process_cpus()


def _proc(root, pid: int, comm: str, threads: dict[int, str]) -> None:
    d = root / str(pid)
    (d / "task").mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "status").write_text("Cpus_allowed_list:\t0-3\n")
    for tid, cpus in threads.items():
        _task(d / "task", str(tid), cpus)


def test_other_vllm_workers_pinned_to_our_cores_are_found(tmp_path):
    _proc(tmp_path, 10, "VLLM::Worker", {10: "0", 11: "1", 12: "0-3"})
    _proc(tmp_path, 20, "VLLM::Worker_DP1", {20: "2", 21: "3"})
    _proc(tmp_path, 30, "python", {30: "0"})  # not a vLLM worker
    _proc(tmp_path, 40, "VLLM::Worker", {40: "0", 41: "1"})  # this process
    (tmp_path / "self").mkdir()  # not a pid
    found = placement.shared_pinned_cores({0, 1}, tmp_path, self_pid=40)
    assert found == {10: {0, 1}}
    assert placement.shared_pinned_cores({2}, tmp_path, self_pid=40) == {20: {2}}
