"""The rank processes of the step-sync scale model (benchmarks/step_sync_scale.py).

One process per DP rank, forked from the benchmark, each running a simulated busy
loop: a pass is ``time.sleep(pass_s)`` and then the stand-in for the MoE collective,
a barrier over a hub process (every rank PUSHes "arrived at pass k", the hub PUBlishes
"pass k released" once all have). Three ways to keep the ranks together:

* ``step_sync``: the real :class:`Participant` in every rank and the real
  :class:`Coordinator` as a thread of rank 0's process, as in the engine; each rank's
  step-sync messages go through a relay thread in its process that holds every frame
  ``delay_s`` in each direction (the one-way delay of a relay or transport wrapper);
* ``waves``: upstream's busy loop (vLLM 0.33): a dummy pass while the group runs, the
  "anything unfinished?" all-reduce at the first pass of a wave and every
  ``dp_sync_interval`` passes, and engine-started waves (an idle rank that gets work
  tells the DP coordinator, which broadcasts START_DP_WAVE). The all-reduce and the
  wave messages go through the hub and carry the same one-way delay per hop;
* ``none``: no coordination at all, a fixed number of passes: what the harness itself
  allows (the ideal the others are held to).

The MoE stand-in carries no injected delay in any model: it runs over the MoE fabric,
not over step sync's transport. It is a barrier, not a gloo all-reduce: a real one
across 256 processes on 2 cores would measure the machine, not the protocol.
"""

from __future__ import annotations

import heapq
import json
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass

now = time.monotonic  # CLOCK_MONOTONIC: one clock for every process on the host


@dataclass(frozen=True)
class Scenario:
    model: str  # step_sync | waves | none
    dp: int
    pass_ms: float
    delay_ms: float
    lookahead: int = 2
    coordinator: str = "thread"  # step sync: thread (in rank 0) or process
    adaptive: bool = True  # step sync: the engine tells how many passes its work needs
    load_passes: int = 100  # passes every rank has work for, in the steady phase
    wakes: int = 4  # idle-wake + drain trials
    drain_passes: int = 8  # passes of work one rank gets in a trial
    sync_interval: int = 16  # waves: dp_sync_interval

    @property
    def pass_s(self) -> float:
        return self.pass_ms / 1000

    @property
    def delay_s(self) -> float:
        return self.delay_ms / 1000

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def stat_cpu_s(stat_text: str) -> float:
    """User + system CPU seconds from the text of a /proc .../stat file."""
    fields = stat_text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(native_id: int) -> float:
    """User + system CPU of one thread of this process."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        return stat_cpu_s(f.read())


def process_cpu_s(pid: int) -> float:
    """User + system CPU of a whole process; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return stat_cpu_s(f.read())
    except OSError:
        return 0.0


class Relay(threading.Thread):
    """Holds every frame ``delay_s`` each way between a participant and the
    coordinator (a transport wrapper in the rank's process)."""

    def __init__(self, upstream: str, delay_s: float):
        import zmq

        super().__init__(daemon=True, name="DelayRelay")
        ctx = zmq.Context.instance()
        self.zmq = zmq
        self.front = ctx.socket(zmq.ROUTER)
        self.address = (
            f"tcp://127.0.0.1:{self.front.bind_to_random_port('tcp://127.0.0.1')}"
        )
        self.back = ctx.socket(zmq.DEALER)
        self.back.connect(upstream)
        self.delay_s = delay_s
        self.stop = threading.Event()

    def run(self) -> None:
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        held: list = []  # (due, seq, up, frames)
        seq, route = 0, b""
        while not self.stop.is_set():
            t = now()
            while held and held[0][0] <= t:
                _, _, up, frames = heapq.heappop(held)
                if up:
                    self.back.send_multipart(frames)
                elif route:
                    self.front.send_multipart([route, *frames])
            wait = held[0][0] - t if held else 0.1
            if wait < 0.001:
                time.sleep(wait)  # sub-millisecond: poll() counts whole ms
                continue
            for sock, _ in poller.poll(wait * 1000):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    seq += 1
                    if sock is self.front:
                        route, frames = frames[0], frames[1:]
                    due = now() + self.delay_s
                    heapq.heappush(held, (due, seq, sock is self.front, frames))


def control_socket(address: str):
    """The benchmark's PUSH socket to the hub (control messages)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    return sock


def hub_main(sc: Scenario, pull: str, pub: str) -> None:
    """The collectives and the waves' DP coordinator: counts arrivals, publishes
    releases. Messages: ``B k`` (MoE barrier), ``A id flag sent_at`` (waves'
    all-reduce), ``W rank wave sent_at`` (start_wave), ``C ...`` (control)."""
    import zmq

    ctx = zmq.Context.instance()
    rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    rx.bind(pull)
    tx.bind(pub)
    barrier: dict[int, int] = {}
    reduce: dict[int, list] = {}
    d = sc.delay_s
    while True:
        parts = rx.recv().split()
        kind = parts[0]
        if kind == b"B":
            k = int(parts[1])
            barrier[k] = barrier.get(k, 0) + 1
            if barrier[k] == sc.dp:
                del barrier[k]
                tx.send(b"B %d" % k)
        elif kind == b"A":
            i, flag, sent = int(parts[1]), int(parts[2]), float(parts[3])
            acc = reduce.setdefault(i, [0, 0, 0.0])
            acc[0] += 1
            acc[1] |= flag
            acc[2] = max(acc[2], sent)
            if acc[0] == sc.dp:
                del reduce[i]
                release = max(acc[2] + d, now())  # the last arrival, then back
                tx.send(b"A %d %d %.6f" % (i, acc[1], release + d))
        elif kind == b"W":
            release = max(float(parts[3]) + d, now())
            tx.send(b"C wave %s %s %.6f" % (parts[1], parts[2], release + d))
        elif kind == b"C":
            tx.send(b" ".join(parts))
            if parts[1] == b"exit":
                time.sleep(0.5)
                return


class Rank:
    """One rank's harness: hub sockets, the pass and its records."""

    def __init__(self, sc: Scenario, rank: int, pull: str, pub: str):
        import zmq

        self.zmq = zmq
        self.sc, self.rank = sc, rank
        ctx = zmq.Context.instance()
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(pull)
        self.subs = {}
        for topic in (b"B", b"A", b"C"):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, topic + b" ")
            sub.connect(pub)
            self.subs[topic] = sub
        self.passes: list[list] = []  # step, start, computed, released, real, wait
        self.wakes: list[list] = []  # work arrived: t, step then
        self.snaps: list[dict] = []
        self.released = now()

    def send(self, text: str) -> None:
        self.push.send(text.encode())

    def wait_for(self, topic: bytes, timeout_s: float = 60.0) -> list[bytes]:
        sub = self.subs[topic]
        if not sub.poll(timeout_s * 1000):
            raise TimeoutError(f"rank {self.rank}: nothing on {topic!r}")
        return sub.recv().split()[1:]

    def control(self, timeout_s: float | None) -> list[bytes] | None:
        """The next control message for this rank (or all), if one comes in time."""
        sub = self.subs[b"C"]
        deadline = None if timeout_s is None else now() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - now())
            if not sub.poll(None if left is None else left * 1000):
                return None
            parts = sub.recv().split()[1:]
            if parts[0] in (b"work",) and int(parts[1]) != self.rank:
                continue
            return parts

    def moe_pass(self, step: int, real: bool, wait_s: float = 0.0) -> None:
        start = now()
        time.sleep(self.sc.pass_s)
        computed = now()
        self.send(f"B {step}")
        while int(self.wait_for(b"B")[0]) < step:
            pass
        t = now()
        self.passes.append([step, start, computed, t, int(real), wait_s])
        self.released = t

    def join_hub(self) -> None:
        """Until the hub's PUB reaches this rank (ZMQ's slow joiner)."""
        deadline = now() + 60
        while now() < deadline:
            self.send(f"C hello {self.rank}")
            parts = self.control(0.05)
            if parts and parts[0] == b"hello":
                return
        raise TimeoutError(f"rank {self.rank}: no hub")

    def report(self, conn, extra: dict | None = None) -> None:
        times = os.times()
        conn.send_bytes(
            json.dumps(
                {
                    "rank": self.rank,
                    "passes": self.passes,
                    "wakes": self.wakes,
                    "snaps": self.snaps,
                    "cpu_s": times.user + times.system,
                    **(extra or {}),
                }
            ).encode()
        )


def rank_main(sc: Scenario, rank: int, ports: dict, conn) -> None:
    try:
        {"step_sync": _step_sync, "waves": _waves, "none": _none}[sc.model](
            sc, rank, ports, conn
        )
    except BaseException as e:  # the parent reports it
        conn.send_bytes(json.dumps({"rank": rank, "error": repr(e)}).encode())
    finally:
        os._exit(0)


def _none(sc: Scenario, rank: int, ports: dict, conn) -> None:
    h = Rank(sc, rank, ports["pull"], ports["pub"])
    h.join_hub()
    conn.send_bytes(b"ready")
    while (parts := h.control(None))[0] != b"exit":
        if parts[0] == b"load":
            h.snaps.append({"t": now()})
            for step in range(1, int(parts[1]) + 1):
                h.moe_pass(step, True)
        elif parts[0] == b"report":
            h.report(conn)


def _coordinator_probe(coord) -> dict:
    """Counts the coordinator's frames in and messages out; reads its thread's CPU."""
    counts = {"in": 0, "out": 0}
    handle, deliver = coord._handle, coord._deliver

    def counted_handle(batch):
        counts["in"] += len(batch)
        handle(batch)

    def counted_deliver(sends):
        counts["out"] += len(sends)
        return deliver(sends)

    coord._handle, coord._deliver = counted_handle, counted_deliver

    def snap() -> dict:
        return {
            "t": now(),
            "coord_cpu_s": thread_cpu_s(coord._thread.native_id),
            "msgs_in": counts["in"],
            "msgs_out": counts["out"],
        }

    return snap


def _process_probe(coord) -> dict:
    """The child's CPU from /proc now; its message counters as of its latest status
    (``t_msgs``: when that status arrived, at most STATUS_REFRESH_S old)."""

    def snap() -> dict:
        stats = coord.stats
        return {
            "t": now(),
            "coord_cpu_s": process_cpu_s(coord.pid),
            "t_msgs": coord.status_at,
            "msgs_in": stats.get("frames_received", 0),
            "msgs_out": stats.get("grants_sent", 0),
        }

    return snap


def _step_sync(sc: Scenario, rank: int, ports: dict, conn) -> None:
    from vllm_disagg.v1.engine.step_sync import (
        Coordinator,
        CoordinatorProcess,
        Participant,
        StepSyncConfig,
    )

    h = Rank(sc, rank, ports["pull"], ports["pub"])
    config = StepSyncConfig(
        sc.dp, sc.lookahead, peer_timeout_s=60.0, coordinator=sc.coordinator
    )
    secret = bytes.fromhex(ports["secret"])
    snap = None
    if rank == 0 and config.coordinator_in_process:
        coord = CoordinatorProcess(config, ports["coordinator"], secret).start()
        snap = _process_probe(coord)
    elif rank == 0:
        coord = Coordinator(config, ports["coordinator"], secret).start()
        snap = _coordinator_probe(coord)
    address = ports["coordinator"]
    if sc.delay_s > 0:
        relay = Relay(address, sc.delay_s)
        relay.start()
        address = relay.address
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    part = Participant(
        config,
        rank,
        address,
        secret,
        on_grant=lambda step: inbox.put(("grant", step)),
        on_failure=lambda reason: inbox.put(("failed", reason)),
    ).start()
    part.wait_for_group(120)
    h.join_hub()
    conn.send_bytes(b"ready")

    def control() -> None:  # the engine's input queue gets control and grants alike
        while True:
            parts = h.control(None)
            inbox.put(("ctl", parts))
            if parts[0] == b"exit":
                return

    threading.Thread(target=control, daemon=True).start()
    work, loading, known = 0, 0, False
    while True:
        idle = not work and not loading and part.steps_owed == 0
        try:
            item = (
                inbox.get(timeout=None if idle else 0) if idle else inbox.get_nowait()
            )
        except queue.Empty:
            item = None
        if item is not None:
            kind, value = item
            if kind == "grant":
                part.observe_grant(value)
            elif kind == "failed":
                raise RuntimeError(value)
            elif value[0] == b"exit":
                break
            elif value[0] == b"report":
                h.report(conn, {"coord_cpu": snap and snap()})
            elif value[0] == b"load":
                loading = int(value[1])
                h.snaps.append(snap() if snap else {"t": now()})
            elif value[0] == b"work":
                work, known = int(value[2]), sc.adaptive
                h.wakes.append([now(), part.local_step])
                part.request_ahead(work if known else None)
            continue  # the whole queue first, as the engine does
        if work or loading:
            after = None if loading or not known else work - 1
            t0 = now()
            step = part.begin_forward(dummy=False, passes_after=after)
            h.moe_pass(step, True, now() - t0)
            if loading:
                loading -= 1
                if not loading and snap:
                    h.snaps.append(snap())
            else:
                work -= 1
        elif part.steps_owed:
            h.moe_pass(part.begin_forward(dummy=True), False)
    part.close(1.0)


def _waves(sc: Scenario, rank: int, ports: dict, conn) -> None:
    h = Rank(sc, rank, ports["pull"], ports["pub"])
    h.join_hub()
    conn.send_bytes(b"ready")
    running, counter, wave, step, reduce_id = False, 0, 0, 0, 0
    work, loading = 0, 0
    while True:
        busy = running or work or loading
        parts = h.control(0 if busy else None)
        if parts is not None:
            kind = parts[0]
            if kind == b"exit":
                break
            if kind == b"report":
                h.report(conn)
            elif kind in (b"work", b"load"):
                if kind == b"work":
                    work = int(parts[2])
                    h.wakes.append([now(), step])
                else:
                    loading = int(parts[1])
                    h.snaps.append({"t": now()})
                if not running:  # 0.33: the engine that gets work wakes the others
                    running = True
                    h.send(f"W {rank} {wave} {now():.6f}")
            elif kind == b"wave":
                sender, their_wave, due = int(parts[1]), int(parts[2]), float(parts[3])
                if sender != rank and their_wave >= wave and not running:
                    time.sleep(max(0.0, due - now()))  # the hop's delay
                    running = True
            continue
        if not busy:
            continue
        step += 1
        h.moe_pass(step, bool(work or loading))
        if loading:
            loading -= 1
        elif work:
            work -= 1
        # _has_global_unfinished_reqs: an all-reduce at pass 1 and every interval.
        counter += 1
        if counter != 1 and counter % sc.sync_interval:
            continue
        reduce_id += 1
        t0 = now()
        h.send(f"A {reduce_id} {int(bool(work or loading))} {t0:.6f}")
        while True:
            got = h.wait_for(b"A")
            if int(got[0]) == reduce_id:
                break
        time.sleep(max(0.0, float(got[2]) - now()))  # the release's hop
        h.passes[-1][5] = now() - t0
        if not int(got[1]):
            running, counter, wave = False, 0, wave + 1
