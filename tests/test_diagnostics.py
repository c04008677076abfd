"""The stack dump: SIGUSR1 in a process that installed it prints every
thread's stack; dump_stacks signals only processes named like vLLM workers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

CHILD = r"""
import signal, sys, threading, time
from vllm_disagg.diagnostics import install_stack_dump_signal
assert install_stack_dump_signal()
def parked_in_a_thread():
    time.sleep(60)
threading.Thread(target=parked_in_a_thread, daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_sigusr1_prints_every_thread_and_the_process_lives_on():
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        assert proc.poll() is None, "SIGUSR1 ended the process"
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert "parked_in_a_thread" in err and "Thread 0x" in err


def test_a_foreign_sigusr1_handler_is_left_alone():
    code = (
        "import signal\n"
        "from vllm_disagg.diagnostics import install_stack_dump_signal\n"
        "mine = lambda *a: None\n"
        "signal.signal(signal.SIGUSR1, mine)\n"
        "assert install_stack_dump_signal() is False\n"
        "assert signal.getsignal(signal.SIGUSR1) is mine\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_dump_stacks_signals_only_children_named_like_workers(capfd):
    from vllm_disagg.diagnostics import dump_stacks

    titled = (
        "import setproctitle, time; setproctitle.setproctitle('VLLM::Worker_DP0'); "
        "print('ready', flush=True); time.sleep(60)"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", titled], stdout=subprocess.PIPE, text=True
    )
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert worker.stdout.readline().strip() == "ready"
        signalled = dump_stacks("test", workers=True)
        assert signalled == [worker.pid]
        assert (
            worker.wait(timeout=30) == -signal.SIGUSR1
        )  # no handler there: ended by it
        assert bystander.poll() is None
        assert "test_dump_stacks_signals_only_children" in capfd.readouterr().err
    finally:
        for p in (worker, bystander):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
