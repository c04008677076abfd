"""Where this instance's API server is: what routers are told against where it listens.

A registration tells the routers ``http_addr`` (``http_ip``, ``http_port``);
``vllm serve`` listens where its ``--host`` and ``--port`` say. When the two
disagree, routers send requests where nothing answers, so the difference is
said at start (warnings: a port mapping or NAT in between can make it right),
and the registration thread probes the address this host itself reaches.
Apart from ``registration.py``, which sends the heartbeats, because this is
address reasoning with no sockets kept and no thread.
"""

from __future__ import annotations

import socket

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    TransportError,
    addresses_of,
)
from vllm_disagg.wire.peers import format_addr, split_addr


def _addresses(host: str) -> frozenset[str]:
    """What ``host`` stands for (the transports' resolution); empty when it
    does not resolve."""
    try:
        return addresses_of(host)
    except TransportError:
        return frozenset()


def _is_local(ip: str) -> bool:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((ip, 0))
        except OSError:
            return False
    return True


def advertised_http_problems(
    http_addr: str, serve_host: str | None, serve_port: int | None
) -> list[str]:
    """Why routers would send this instance's requests where its API server
    does not listen: the advertised ``http_addr`` against what ``vllm serve``
    was given (``--host``, ``--port``; None: unknown or a wildcard). Said at
    start instead of found by clients; a port mapping or NAT in between can
    make a difference right, hence warnings, not errors."""
    host, port = split_addr(http_addr, "http_addr")
    problems = []
    if serve_port is not None and port != serve_port:
        problems.append(
            f"http_port {port} is not the port vllm serve listens on (--port "
            f"{serve_port})"
        )
    ips = _addresses(host)
    if not ips:
        problems.append(f"http_ip {host} does not resolve here")
    elif serve_host is not None:
        if not ips & _addresses(serve_host):
            problems.append(
                f"http_ip {host} is not the address vllm serve listens on (--host "
                f"{serve_host})"
            )
    elif not any(_is_local(ip) for ip in ips):
        problems.append(f"http_ip {host} is not an address of this machine")
    return problems


def api_listen_addr(
    http_addr: str, serve_host: str | None, serve_port: int | None
) -> str:
    """Where this host reaches its own API server: ``vllm serve --host``
    and ``--port`` when the ``vllm`` command saw them (a wildcard or no
    ``--host`` listens on loopback too), else the advertised ``http_addr``."""
    if serve_port is None:  # not started by `vllm serve`: nothing else known
        return http_addr
    return format_addr(serve_host or "127.0.0.1", serve_port)
