"""The critical path of one P2P transfer, phase by phase (``p2p_transfer.py
--timeline``).

Each process of the benchmark's first pair stamps the engine's calls that
lie on a transfer's path (wrapped from here; the engine is unchanged) with
``time.monotonic()``, which both processes share. After every engine sample
the parent takes both sides' stamps and cuts the sample's span, from its
start to the decode's ``poll()`` seeing the slot, into phases at milestones:

* PUT: the prefill's peer thread takes the job; it sends the Offer; the
  answer arrives; the first data byte goes out; the decode's last data
  message is in; ``poll()`` sees it;
* PUT-after-pass: the Offer was answered during the pass, so from every layer
  saved straight to the first byte out;
* GET: the decode's peer thread takes the job and sends the ``Get``; the
  prefill's listener handles it; its peer thread takes the send; then as PUT.

A phase is the time from one milestone to the next, so the phases of a
sample add up to its time.
"""

from __future__ import annotations

import functools
import statistics
import time

STAMPS: list[tuple[str, float, float]] = []

# From the prefill's peer thread taking a send to the decode's last byte:
# the milestones PUT and GET share, each (side and stamp name, "start" or
# "end", which: "first" at or after the previous milestone, or "last" of the
# sample), and the phases they end.
_SEND = [
    ("prefill peer job", "start", "first"),
    ("prefill control request", "start", "first"),
    ("prefill control request", "end", "first"),
    ("prefill channel.send", "start", "first"),
    ("decode channel.recv", "end", "last"),
]
_SEND_PHASES = [
    "the peer thread to the Offer",
    "Offer round trip",
    "reading the first layers",
    "data on the wire",
]
# mode -> its milestones after the start.
MILESTONES = {
    "PUT": _SEND,
    "PUT-after-pass": _SEND[-2:],
    "GET": [
        ("decode get job", "start", "first"),
        ("prefill on_get", "start", "first"),
        *_SEND,
    ],
}
# The phase that ends at each milestone (the last: at the sample's end).
_TO_POLL = "last byte to poll()"
PHASES = {
    "PUT": ["start_send to the peer thread", *_SEND_PHASES, _TO_POLL],
    "PUT-after-pass": ["saved to the first byte out", _SEND_PHASES[-1], _TO_POLL],
    "GET": [
        "expect to the decode's peer thread",
        "Get, one way",
        "Get handled to the prefill's peer thread",
        *_SEND_PHASES,
        _TO_POLL,
    ],
}


def _stamped(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            STAMPS.append((name, start, time.monotonic()))

    return wrapper


def install() -> None:
    """Stamp the engine's calls on a transfer's path, in this process."""
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import (
        peer,
        sender,
    )
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport import tcp

    peer.Peer._send = _stamped("peer job", peer.Peer._send)
    peer.Peer._get = _stamped("get job", peer.Peer._get)
    peer.Peer.request = _stamped("control request", peer.Peer.request)
    sender.Sender.on_get = _stamped("on_get", sender.Sender.on_get)
    tcp.TcpChannel.send = _stamped("channel.send", tcp.TcpChannel.send)
    tcp.TcpChannel.recv = _stamped("channel.recv", tcp.TcpChannel.recv)


def take() -> list[tuple[str, float, float]]:
    out = list(STAMPS)
    STAMPS.clear()
    return out


def phases(mode: str, stamps, start: float, end: float) -> list[float] | None:
    """Seconds of each phase of one sample (``PHASES[mode]``), from both
    sides' stamps; None when a milestone is missing."""
    marks = [start]
    for name, edge, which in MILESTONES[mode]:
        times = sorted(
            (s if edge == "start" else e)
            for n, s, e in stamps
            if n == name and (s if edge == "start" else e) >= marks[-1]
        )
        if not times:
            return None
        marks.append(times[0] if which == "first" else times[-1])
    marks.append(max(end, marks[-1]))
    return [b - a for a, b in zip(marks, marks[1:])]


def rows(samples: dict, sizes) -> list[list[str]]:
    """Markdown rows: mode, phase, then the median ms per size (of the
    samples where every milestone was seen)."""
    out = []
    for mode, phase_names in PHASES.items():
        for i, phase in enumerate(phase_names):
            cells = []
            for size in sizes:
                got = samples.get(mode, {}).get(size, [])
                cells.append(
                    f"{statistics.median(p[i] for p in got) * 1e3:.3f}" if got else "-"
                )
            out.append([mode, phase, *cells])
        counts = [len(samples.get(mode, {}).get(size, [])) for size in sizes]
        out.append([mode, "(samples)", *map(str, counts)])
    return out
