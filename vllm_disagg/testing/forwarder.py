"""A TCP port forwarder for tests: the NAT or port mapping in front of an
instance that binds one address and advertises another (``kv_bind_ip`` /
``kv_ip``, ``vllm serve --host`` / ``http_ip``). It counts what crosses it,
so a test can show that traffic came in through the advertised address."""

from __future__ import annotations

import contextlib
import socket
import threading

ACCEPT_POLL_S = 0.2  # how soon close() is noticed


class Forwarder:
    """A TCP port forwarder, ``listen`` -> ``target`` (a NAT's port mapping),
    counting connections and the bytes sent towards the target."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]):
        """Forward connections to ``listen`` to ``target``, from now until
        :meth:`close`; every upstream connect waits at most 5 s."""
        self.target = target
        self.connections = 0
        self.bytes_in = 0  # towards the target
        self._lock = threading.Lock()
        self._sock = socket.create_server(listen)
        self._sock.settimeout(ACCEPT_POLL_S)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                conn.close()
                continue
            with self._lock:
                self.connections += 1
            for src, dst, inbound in ((conn, upstream, True), (upstream, conn, False)):
                t = threading.Thread(
                    target=self._pump, args=(src, dst, inbound), daemon=True
                )
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, inbound: bool) -> None:
        src.settimeout(ACCEPT_POLL_S)
        try:
            while not self._stop.is_set():
                try:
                    data = src.recv(1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    break
                dst.sendall(data)
                if inbound:
                    with self._lock:
                        self.bytes_in += len(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        for t in self._threads:
            t.join(timeout=2)
