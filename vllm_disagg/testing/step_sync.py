"""Step-sync metrics of a running server, per DP rank, for tests and benchmarks."""

from __future__ import annotations

import re

from vllm_disagg.testing.server import VllmServer
from vllm_disagg.v1.metrics.step_sync import PREFIX

_DP_RANK = re.compile(r'dp_rank="(\d+)"')


def step_sync_metric(server: VllmServer, name: str) -> dict[int, float]:
    """One step-sync metric of ``server``'s ``/metrics``, {dp_rank: value}.

    ``name`` is the sample name after the prefix, e.g. ``forward_steps_total``
    (counters) or ``local_step`` (gauges). Empty until the metric is served.
    """
    values = server.metrics(PREFIX).get(f"{PREFIX}{name}", {})
    return {int(_DP_RANK.search(labels).group(1)): v for labels, v in values.items()}


def read_store(host: str, port: int, timeout_s: float = 10.0) -> dict[str, bytes]:
    """Everything a torch TCPStore at ``host:port`` serves to anyone who connects:
    every key and its value (what a stranger on the same host, or anywhere the port
    is reachable from, can read)."""
    import datetime

    from torch.distributed import TCPStore

    store = TCPStore(
        host,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return {key: store.get(key) for key in store.list_keys()}


def keys_from(served: dict[str, bytes]) -> set[bytes]:
    """Every secret or frame key a stranger could make of what a store served:
    each key and value, hex-decoded where it is hex, each field of a JSON value,
    and step sync's group key derived from each of those under each string seen."""
    import contextlib
    import json

    from vllm_disagg.v1.engine.step_sync.credentials import group_key

    pieces: set[bytes] = set()

    def add(value: bytes) -> None:
        pieces.add(value)
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            pieces.add(bytes.fromhex(value.decode()))

    for key, value in served.items():
        add(key.encode())
        add(value)
        try:
            fields = json.loads(value)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(fields, dict):
            for field in fields.values():
                add(str(field).encode())
    strings = {p.decode(errors="replace") for p in pieces}
    return pieces | {group_key(p, s) for p in pieces for s in strings}
