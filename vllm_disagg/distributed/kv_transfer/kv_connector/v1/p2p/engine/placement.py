"""Where the engine's threads run: off the cores vLLM pinned its OpenMP team to.

By default vLLM's CPU worker pins one OpenMP thread per core
(``VLLM_CPU_OMP_THREADS_BIND=auto``), its model thread included, and a thread
inherits the affinity of the thread that starts it. So every thread the P2P
engine starts from the model thread (the listener, ZMQ's I/O thread, peer and
receive threads) would share one core with the model thread, and with every
other vLLM worker on the host that pinned its team there too. Their spinning
model threads delayed control replies by 10 s and more (the slow moment of
issue 27); moved off that core, the same fleet answered in milliseconds.

The engine's threads run on the CPUs the process may use minus the cores its
OpenMP team is pinned to (vLLM's reserved cores, as its NIXL connector does
with ``rsv_cores_for_kv``), or on all the process may use when the team takes
them all. Unpinned workers (``nobind``) are left as they are.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

from vllm_disagg.logger import init_logger

logger = init_logger(__name__)

_ONLINE = Path("/sys/devices/system/cpu/online")


def parse_cpu_list(text: str) -> set[int]:
    """``0-3,8,10-11`` (the kernel's CPU list format) as a set of ids."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _thread_affinity(task_status: Path) -> set[int] | None:
    try:
        for line in task_status.read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return parse_cpu_list(line.split(":", 1)[1])
    except (OSError, ValueError):
        return None
    return None


def process_cpus() -> set[int]:
    """The CPUs this process may use, as its launcher gave them, before any
    thread of it was pinned: the parent's affinity (the engine core or the
    executor that spawned this worker, never pinned by vLLM), within the
    CPUs online; this thread's own affinity where neither can be read."""
    own = os.sched_getaffinity(0)
    try:
        allowed = os.sched_getaffinity(os.getppid())
    except OSError:
        allowed = set()
    try:
        online = parse_cpu_list(_ONLINE.read_text())
    except (OSError, ValueError):
        online = set()
    if online:
        allowed &= online
    return (allowed | own) if allowed else own


def pinned_cpus(
    allowed: set[int], task_dir: Path = Path("/proc/self/task")
) -> set[int]:
    """The cores threads of this process are pinned to: each thread whose
    affinity is narrower than ``allowed`` (vLLM's OpenMP team, one core each)."""
    pinned: set[int] = set()
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return pinned
    for task in tasks:
        cpus = _thread_affinity(task / "status")
        if cpus and cpus < allowed:
            pinned |= cpus
    return pinned


def choose_cpus(allowed: set[int], pinned: set[int]) -> set[int]:
    """Cores for the control plane: those the OpenMP team left free, else all."""
    free = allowed - pinned
    return free or set(allowed)


@functools.cache
def control_plane_cpus() -> frozenset[int]:
    """The CPUs the engine's threads run on (computed once per process)."""
    allowed = process_cpus()
    cpus = choose_cpus(allowed, pinned_cpus(allowed))
    if cpus != os.sched_getaffinity(0):
        logger.info(
            "P2P engine threads run on CPUs %s (the model thread is pinned to %s)",
            _format(cpus),
            _format(os.sched_getaffinity(0)),
        )
    return frozenset(cpus)


def place_current_thread() -> None:
    """Move the calling thread (only it: Linux affinity is per thread) to the
    control-plane CPUs; the threads it starts inherit them."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, control_plane_cpus())


@contextlib.contextmanager
def placed() -> Iterator[None]:
    """Run the block on the control-plane CPUs, then restore the caller's
    affinity: threads the block starts (ZMQ's own included) stay placed."""
    try:
        before = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        yield
        return
    place_current_thread()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, before)


def shared_pinned_cores(
    own: set[int], proc: Path = Path("/proc"), self_pid: int | None = None
) -> dict[int, set[int]]:
    """Other vLLM workers on this host (``VLLM::Worker`` processes) whose
    threads are pinned to some of the cores in ``own``: pid -> those cores."""
    self_pid = os.getpid() if self_pid is None else self_pid
    found: dict[int, set[int]] = {}
    try:
        entries = list(proc.iterdir())
    except OSError:
        return found
    for entry in entries:
        if not entry.name.isdigit() or int(entry.name) == self_pid:
            continue
        try:
            if not (entry / "comm").read_text().startswith("VLLM::Worker"):
                continue
        except OSError:
            continue
        for task in _tasks(entry):
            cpus = _thread_affinity(task / "status")
            # OpenMP team members are pinned one core each.
            if cpus and len(cpus) == 1 and cpus & own:
                found.setdefault(int(entry.name), set()).update(cpus)
    return found


def _tasks(entry: Path) -> list[Path]:
    try:
        return list((entry / "task").iterdir())
    except OSError:
        return []


def warn_if_cores_are_shared() -> None:
    """Once per process: say so when this worker's OpenMP team is pinned to
    cores another vLLM worker on the host pinned its team to as well. Both
    teams spin on those cores and every forward pass of both waits."""
    allowed = process_cpus()
    own = pinned_cpus(allowed)
    if not own:
        return  # unpinned (nobind): nothing to collide
    others = shared_pinned_cores(own)
    if others:
        cores = set().union(*others.values())
        logger.warning(
            "this worker's OpenMP threads are pinned to CPUs %s, and %d other vLLM "
            "worker(s) on this host (pids %s) pin theirs to %s too: their threads "
            "spin against each other and every forward pass slows down. Give each "
            "server its own cores (VLLM_CPU_OMP_THREADS_BIND=0-3 for one, 4-7 for "
            "the next) or unpinned single threads (VLLM_CPU_OMP_THREADS_BIND=nobind "
            "OMP_NUM_THREADS=1); see docs/operations.md",
            _format(own),
            len(others),
            ",".join(str(p) for p in sorted(others)),
            _format(cores),
        )


def _format(cpus) -> str:
    return ",".join(str(c) for c in sorted(cpus))
