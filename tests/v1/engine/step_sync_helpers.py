"""Helpers for the step-sync unit tests: real Coordinator/Participant objects
on loopback ZMQ, simulated engine threads, a lossy TCP relay, and the real
``StepSyncDPEngineCoreProc`` methods on engines built without vLLM's model
machinery."""

from __future__ import annotations

import contextlib
import queue
import random
import socket
import struct
import threading
import time

from vllm_disagg.v1.engine.step_sync import Participant

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
            kind, value = (
                self.events.get(timeout=0.05) if block else self.events.get_nowait()
            )
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
        while self.part.delivered < step and not self.stop.is_set():
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
                threading.Thread(
                    target=self._pump, args=(src, dst, up), daemon=True
                ).start()

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
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def reset(self):
        """RST every connection (ZMQ reconnects by itself)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for sock in conns:
            try:
                sock.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
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


# --- the real StepSyncDPEngineCoreProc methods, without vLLM's model side ---


class FakeScheduler:
    """Decode work as a count of passes, with vLLM's pause-state semantics:
    PAUSED_ALL freezes everything, PAUSED_NEW lets running work drain, and
    work that arrives while paused waits in the queue until unpaused."""

    def __init__(self):
        from vllm.v1.core.sched.interface import PauseState

        self._states = PauseState
        self.pause_state = PauseState.UNPAUSED
        self.work = 0
        self.queued = 0
        self.ready_at = 0.0  # e.g. waiting for remote KV until then

    def set_pause_state(self, state):
        self.pause_state = state
        if state == self._states.UNPAUSED:
            self.work, self.queued = self.work + self.queued, 0

    def add_work(self, passes: int):
        if self.pause_state == self._states.UNPAUSED:
            self.work += passes
        else:
            self.queued += passes

    def has_requests(self) -> bool:
        return self.work > 0 and self.pause_state != self._states.PAUSED_ALL

    def get_num_unfinished_requests(self) -> int:
        return self.work if self.has_requests() else 0

    def has_unfinished_requests(self) -> bool:
        return self.has_requests()

    def schedulable(self) -> bool:
        return self.has_requests() and time.monotonic() >= self.ready_at

    def finish_requests(self, request_ids, status):
        self.work = self.queued = 0
        return []


class FakeExecutor:
    def __init__(self):
        self.sleeping = False

    @property
    def is_sleeping(self) -> bool:
        return self.sleeping

    def sleep(self, level: int = 1):
        self.sleeping = True

    def wake_up(self, tags=None):
        self.sleeping = False

    def collective_rpc(self, *args, **kwargs):
        return None


class _NoMetrics:
    def maybe_write(self, force: bool = False):
        pass

    def close(self):
        pass


def make_engine(config, rank, address, secret, shutdown_timeout=0):
    """A StepSyncDPEngineCoreProc with its step-sync state, input queue and
    pause/shutdown machinery real, and scheduler/executor faked."""
    import types

    from vllm.v1.engine.core import EngineShutdownState

    from vllm_disagg.v1.engine.core import StepSyncDPEngineCoreProc, StepSyncInput

    engine = object.__new__(StepSyncDPEngineCoreProc)
    engine.input_queue = queue.Queue()
    engine.output_queue = queue.Queue()
    engine.aborts_queue = queue.Queue()
    engine.process_input_queue_block = False
    engine.scheduler = FakeScheduler()
    engine.model_executor = FakeExecutor()
    engine.batch_queue = None
    engine._idle_state_callbacks = []
    engine.dp_rank = rank
    engine.shutdown_state = EngineShutdownState.RUNNING
    engine.vllm_config = types.SimpleNamespace(shutdown_timeout=shutdown_timeout)
    engine.step_sync_config = config
    engine.step_sync_coordinator = None
    engine._metrics = _NoMetrics()
    engine._reset_caches = lambda *a, **k: None
    # What __init__ sets before the upstream constructor runs.
    from vllm_disagg.v1.engine.core import PausePhase

    engine.pause_phase = PausePhase.RUNNING
    engine._pause_intent = 0
    engine._pause_reported = False
    engine._resumed = None
    engine._leaving_since = None
    engine._left_alone = False
    engine.step_sync = Participant(
        config,
        rank,
        address,
        secret,
        on_grant=lambda step: engine.input_queue.put_nowait(
            (StepSyncInput.GRANT, step)
        ),
        on_failure=lambda reason: engine.input_queue.put_nowait(
            (StepSyncInput.FAILED, reason)
        ),
        on_group=lambda state: engine.input_queue.put_nowait(
            (StepSyncInput.GROUP, state)
        ),
    ).start()
    return engine


class EngineThread:
    """Runs the busy loop of one engine the way ``run_busy_loop`` does, with
    real and dummy passes that meet the peers in a simulated collective, and
    utility calls (pause, resume, sleep, wake) executed on the engine thread."""

    def __init__(self, engine, passes: dict, collective_timeout_s: float = 5.0):
        self.engine = engine
        self.passes = passes
        self.collective_timeout_s = collective_timeout_s
        self.calls: queue.Queue = queue.Queue()
        self.results: list = []
        self.error: BaseException | None = None
        self.hung_at: int | None = None
        self.ran_while_asleep = 0
        self.exited = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def call(self, name, *args, **kwargs):
        """Queue a utility call (an engine method name, or any callable) to
        run on the engine thread; its result (or exception) lands in results."""
        self.calls.put((name, args, kwargs))

    def _run(self):
        engine = self.engine
        engine.step_sync.watch_progress = True
        try:
            while engine._handle_shutdown():
                while not self.calls.empty():
                    name, args, kwargs = self.calls.get_nowait()
                    method = name if callable(name) else getattr(engine, name)
                    try:
                        self.results.append((name, method(*args, **kwargs)))
                    except RuntimeError as exc:
                        self.results.append((name, exc))
                engine._process_input_queue()
                if engine.scheduler.schedulable():
                    self._pass(dummy=False)
                    engine.scheduler.work -= 1
                elif engine._dummy_due():
                    self._pass(dummy=True)
                else:
                    time.sleep(0.002)
                engine._report_drained()
                if self.hung_at is not None:
                    return
            self.exited = True
        except Exception as exc:  # StepSyncFailure and anything unexpected
            self.error = exc

    def _pass(self, dummy: bool):
        engine = self.engine
        if engine.model_executor.is_sleeping:
            self.ran_while_asleep += 1
        step = engine.step_sync.begin_forward(dummy=dummy)
        self.passes[engine.dp_rank] = step
        deadline = time.monotonic() + self.collective_timeout_s
        while min(self.passes.values()) < step:
            if time.monotonic() > deadline:
                self.hung_at = step
                return
            time.sleep(0.0005)

    def start(self):
        self.thread.start()
        return self
