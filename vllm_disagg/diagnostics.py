"""Thread stacks for hangs, where the logs are.

A DP group that fails because one engine stopped stepping says which rank
and since when, but not where it was stuck; that is in a thread of the
engine core or of one of its workers. So:

* every process the plugin loads into (API server, engine cores, workers)
  prints all its threads' stacks to stderr (the server log) on ``SIGUSR1``
  (``kill -USR1 <pid>``), unless something else handles ``SIGUSR1`` there;
* ``dump_stacks`` prints this process's stacks now and sends ``SIGUSR1`` to
  its vLLM worker processes, which step sync calls when its own engine is
  found stuck, before the engine exits.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys

# The logger vllm_disagg.logger.init_logger would give, without importing vLLM:
# this module loads in processes that must stay light (and in tests).
logger = logging.getLogger(f"vllm.{__name__}")

# setproctitle names of the processes that load the plugin and so handle it.
WORKER_TITLE_PREFIX = "VLLM::Worker"
_installed = False


def install_stack_dump_signal() -> bool:
    """SIGUSR1 -> every thread's stack on stderr; True if installed now or before."""
    global _installed
    if _installed:
        return True
    if (
        not hasattr(signal, "SIGUSR1")
        or signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL
    ):
        return False  # not ours to take
    try:
        faulthandler.register(
            signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False
        )
    except (ValueError, RuntimeError, OSError, AttributeError):  # no usable stderr fd
        return False
    _installed = True
    return True


def dump_stacks(reason: str, workers: bool = True) -> list[int]:
    """Print this process's thread stacks to stderr, and ask its worker
    processes for theirs; returns the pids signalled."""
    logger.error("thread stacks of pid %d follow (%s)", os.getpid(), reason)
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (ValueError, RuntimeError, OSError, AttributeError):
        logger.error("could not print the thread stacks: stderr is not a file")
    return signal_workers() if workers else []


def signal_workers() -> list[int]:
    """SIGUSR1 to the child processes named like vLLM workers (they load the
    plugin, so they print their stacks); any other child is left alone:
    SIGUSR1 would end a process that does not handle it."""
    import psutil

    signalled = []
    for child in psutil.Process().children(recursive=True):
        try:
            # setproctitle shows in the command line; the name is cut to 15 characters.
            title = (child.cmdline() or [child.name()])[0]
            if title.startswith(WORKER_TITLE_PREFIX):
                child.send_signal(signal.SIGUSR1)
                signalled.append(child.pid)
        except psutil.Error:
            continue
    return signalled
