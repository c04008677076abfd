"""Helpers for the step-sync unit tests: real Coordinator/Participant objects
on loopback ZMQ, simulated engine threads, a lossy TCP relay, and the real
``StepSyncDPEngineCoreProc`` methods on engines built without vLLM's model
machinery."""

from __future__ import annotations

import queue
import random
import socket
import struct
import threading
import time

from vllm_disagg.v1.engine.step_sync import (
    Coordinator,
    Participant,
    StepSyncConfig,
    new_group_secret,
)

DEADLINE_S = 20.0


def wait_until(predicate, timeout_s=DEADLINE_S, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")


class SimEngine:
    """A stand-in engine thread: real work first, then dummy passes while owed."""

    def __init__(self, config, rank, address, secret, work_steps, start_delay_s=0.0):
        self.events: queue.Queue = queue.Queue()
        self.failures: list[str] = []
        self.part = Participant(
            config,
            rank,
            address,
            secret,
            on_grant=lambda step: self.events.put(("grant", step)),
            on_failure=lambda reason: self.events.put(("fail", reason)),
        )
        self.part.watch_progress = True
        self.work_steps = work_steps
        self.start_delay_s = start_delay_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _drain(self, block: bool):
        try:
            kind, value = self.events.get(timeout=0.05) if block else self.events.get_nowait()
        except queue.Empty:
            return
        if kind == "grant":
            self.part.observe_grant(value)
        else:
            self.failures.append(value)

    def _loop(self):
        time.sleep(self.start_delay_s)
        while not self.stop.is_set():
            while not self.events.empty():
                self._drain(block=False)
            if self.work_steps > 0:
                step = self.part.begin_forward(dummy=False)
                self.work_steps -= 1
                self._collective(step)
            elif self.part.steps_owed:
                self.part.begin_forward(dummy=True)
                time.sleep(0.002)
            else:
                self._drain(block=True)

    def _collective(self, step: int):
        """A real pass meets the peers in collectives, which they reach only
        once ``step`` is granted to them: wait for the grant as that would."""
        time.sleep(0.002)
        while self.part._delivered < step and not self.stop.is_set():
            if self.part.failure is not None:
                self.failures.append(self.part.failure)
                self.stop.wait()
                return
            time.sleep(0.001)

    def add_work(self, steps: int):
        self.work_steps += steps
        self.events.put(("grant", 0))  # wake the loop, as an ADD request would

    def start(self):
        self.part.start()
        self.thread.start()
        return self

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.part.close(timeout_s=0.5)


def settled(coord, engines) -> bool:
    return all(e.work_steps == 0 and e.part.local_step == coord.step for e in engines)


class LossyRelay:
    """A TCP relay between one participant and the coordinator that can lose
    data (``drop_upstream``/``drop_downstream``: bytes read are discarded, as
    a network that loses segments would look to ZMQ after its framing
    breaks) and reset every connection (``reset``): what ZMQ papers over by
    reconnecting, losing whatever was in flight."""

    def __init__(self, target: str):
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.drop_upstream = False
        self.drop_downstream = False
        self.chunks_dropped = 0
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._closed = False
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue  # e.g. the client reset before we accepted
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            for src, dst, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, up), daemon=True).start()

    def _pump(self, src, dst, upstream):
        try:
            while data := src.recv(65536):
                if self.drop_upstream if upstream else self.drop_downstream:
                    self.chunks_dropped += 1
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def reset(self):
        """RST every connection (ZMQ reconnects by itself)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for sock in conns:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # shutdown() wakes the pump blocked in recv(); close() alone
                # would leave the connection open until that recv returned.
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self):
        self._closed = True
        self._listener.close()
        self.reset()


def chaos(relay: LossyRelay, seconds: float, seed: int = 0):
    """Randomly lose data both ways and reset connections for ``seconds``."""
    rng = random.Random(seed)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        action = rng.random()
        if action < 0.3:
            relay.reset()
        elif action < 0.6:
            relay.drop_upstream = True
            time.sleep(rng.uniform(0.01, 0.1))
            relay.drop_upstream = False
            relay.reset()  # a stream that lost bytes cannot be resynchronised
        elif action < 0.9:
            relay.drop_downstream = True
            time.sleep(rng.uniform(0.01, 0.1))
            relay.drop_downstream = False
            relay.reset()
        time.sleep(rng.uniform(0.02, 0.15))
