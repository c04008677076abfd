"""Fake instances that only register: many per process, each with its own
DEALER socket to the router's discovery port, sending signed ``Register``
heartbeats as the connector's registration thread does (the project's wire
code seals them). No HTTP server behind them: for measuring discovery and
selection at fleet scale (benchmarks/router_scale.py), not for routing.

A process of them (``python -m vllm_disagg.testing.fake_registrants``)
takes commands on stdin, one per line, and answers each on stdout:

* ``go``: register every instance once; ``acked N``.
* ``flood SECONDS``: heartbeat each instance again as soon as its last one
  was answered; ``acked N``.
* ``steady``: heartbeat each instance every ``--interval`` seconds, spread
  evenly, until a ``stop`` line; ``acked N`` (heartbeats sent).
* ``bye``: deregister every instance and exit.

:class:`Registrants` starts and drives a few such processes from asyncio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
import uuid

import msgspec
import zmq

from vllm_disagg.wire.discovery import (
    DISCOVERY_VERSION,
    HEARTBEAT_INTERVAL_S,
    Deregister,
    Register,
    Role,
    seal,
)

ACK_DEADLINE_S = 30.0  # every wait on the router has one
MODEL = "fleet-model"
FINGERPRINT = "ab" * 32


def fake_register(index: int, interval_s: float = HEARTBEAT_INTERVAL_S) -> Register:
    """The ``index``-th fake instance's first ``Register``: even indexes
    prefill, odd ones decode, each at addresses of its own."""
    kv_addr = f"127.0.0.1:{40000 + index}"
    return Register(
        version=DISCOVERY_VERSION,
        instance_id=f"{kv_addr}@{uuid.uuid4().hex[:12]}",
        role=Role.PREFILL if index % 2 == 0 else Role.DECODE,
        http_addr=f"127.0.0.1:{20000 + index}",
        kv_addr=kv_addr,
        model=MODEL,
        seq=1,
        interval_s=interval_s,
        sent_at=time.time(),
        fingerprint=FINGERPRINT,
        max_model_len=4096,
    )


class _Fleet:
    """The instances of one process and their sockets."""

    def __init__(self, args: argparse.Namespace, token: bytes | None) -> None:
        self.token = token
        self.interval_s = args.interval
        self.ctx = zmq.Context()
        self.socks, self.templates = [], []
        self.poller = zmq.Poller()
        for i in range(args.first, args.first + args.count):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(args.endpoint)
            self.socks.append(sock)
            self.templates.append(fake_register(i, args.interval))
            self.poller.register(sock, zmq.POLLIN)
        self.poller.register(sys.stdin.fileno(), zmq.POLLIN)
        self.seqs = [0] * len(self.socks)

    def send(self, k: int) -> None:
        self.seqs[k] += 1
        msg = msgspec.structs.replace(
            self.templates[k], seq=self.seqs[k], sent_at=time.time()
        )
        self.socks[k].send_multipart(seal(self.token, msg))

    def drain(self, timeout_ms: int) -> tuple[list[int], bool]:
        """Instances answered within ``timeout_ms``; whether stdin has a line."""
        ready = dict(self.poller.poll(timeout_ms))
        answered = []
        for k, sock in enumerate(self.socks):
            if sock in ready:
                while sock.poll(0):
                    sock.recv_multipart()
                    answered.append(k)
        return answered, sys.stdin.fileno() in ready

    def round_trip(self) -> int:
        """Every instance heartbeats once; how many were answered in time."""
        for k in range(len(self.socks)):
            self.send(k)
        waiting = set(range(len(self.socks)))
        deadline = time.monotonic() + ACK_DEADLINE_S
        while waiting and time.monotonic() < deadline:
            waiting -= set(self.drain(100)[0])
        return len(self.socks) - len(waiting)

    def steady(self) -> int:
        """Each instance every interval, spread evenly, until stdin has a line."""
        gap = self.interval_s / len(self.socks)
        next_at, k, sent, stop = time.monotonic(), 0, 0, False
        while not stop:
            while time.monotonic() >= next_at:
                self.send(k)
                sent, k, next_at = sent + 1, (k + 1) % len(self.socks), next_at + gap
            stop = self.drain(max(1, int((next_at - time.monotonic()) * 1000)))[1]
        return sent

    def bye(self) -> None:
        for template, sock in zip(self.templates, self.socks, strict=True):
            bye = Deregister(DISCOVERY_VERSION, template.instance_id, time.time())
            sock.send_multipart(seal(self.token, bye))
        self.drain(200)
        for sock in self.socks:
            sock.close()
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    """Serve commands on stdin for ``--count`` fake instances (see the module)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--endpoint", required=True, help="tcp://host:port")
    parser.add_argument("--first", type=int, default=0, help="first instance index")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--interval", type=float, default=HEARTBEAT_INTERVAL_S)
    parser.add_argument("--token-hex", default="", help="the registration token")
    args = parser.parse_args(argv)
    fleet = _Fleet(args, bytes.fromhex(args.token_hex) or None)
    print("ready", flush=True)
    while line := sys.stdin.readline():
        cmd, *rest = line.split()
        if cmd == "go":
            print("acked", fleet.round_trip(), flush=True)
        elif cmd == "flood":
            end, sent = time.monotonic() + float(rest[0]), 0
            while time.monotonic() < end:
                sent += fleet.round_trip()
            print("acked", sent, flush=True)
        elif cmd == "steady":
            sent = fleet.steady()
            sys.stdin.readline()  # the "stop"
            print("acked", sent, flush=True)
        elif cmd == "bye":
            break
    fleet.bye()
    return 0


class Registrants:
    """A few processes of fake instances, driven line by line from asyncio."""

    def __init__(self, procs: list[asyncio.subprocess.Process]) -> None:
        self.procs = procs

    @classmethod
    async def start(
        cls,
        endpoint: str,
        size: int,
        processes: int,
        *,
        token: bytes | None,
        interval_s: float = HEARTBEAT_INTERVAL_S,
    ) -> Registrants:
        """``size`` instances over ``processes`` processes, connected, not
        registered yet (``command("go")`` does that)."""
        share = -(-size // processes)
        started = cls([])
        try:
            for first in range(0, size, share):
                started.procs.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable,
                        "-m",
                        "vllm_disagg.testing.fake_registrants",
                        f"--endpoint={endpoint}",
                        f"--first={first}",
                        f"--count={min(share, size - first)}",
                        f"--interval={interval_s}",
                        f"--token-hex={(token or b'').hex()}",
                        stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE,
                    )
                )
            await started._replies("ready")
        except BaseException:
            await started.close()
            raise
        return started

    async def _replies(self, want: str) -> int:
        total = 0
        for proc in self.procs:
            line = await asyncio.wait_for(proc.stdout.readline(), ACK_DEADLINE_S + 60)
            word, *rest = line.decode().split() or ["(exited)"]
            if word != want:
                raise RuntimeError(f"a registrant answered {line!r}, not {want!r}")
            total += int(rest[0]) if rest else 0
        return total

    async def command(self, cmd: str, reply: bool = True) -> int:
        """Send ``cmd`` to every process; the sum of their ``acked`` counts."""
        for proc in self.procs:
            proc.stdin.write(f"{cmd}\n".encode())
            await proc.stdin.drain()
        return await self._replies("acked") if reply else 0

    async def close(self) -> None:
        """Deregister and end every process (killed after 10 s)."""
        for proc in self.procs:
            if proc.returncode is None and proc.stdin is not None:
                proc.stdin.write(b"bye\n")
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    await proc.stdin.drain()
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())
