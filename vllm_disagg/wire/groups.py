"""The id of a DP group, the same on every rank of it.

Two places name a group: each rank's registration with the routers (the
router places requests on a group as one: ``router/placement.py``) and the
step-sync metrics' ``dp_group`` label (rules compare a group's ranks across
scrape targets). One function, so that an operator can join the two.
"""

from __future__ import annotations

import hashlib
import socket
from typing import Any


def dp_group_of(parallel_config: Any) -> str:
    """A hash of the group's rendezvous (``--data-parallel-address`` and
    ``--data-parallel-rpc-port``, which all its ranks share and no other
    group can), with this host's name when that address is loopback (two
    single-host groups on two hosts may both use 127.0.0.1); "" at DP=1."""
    size = parallel_config.data_parallel_size
    if size <= 1:
        return ""
    host = str(parallel_config.data_parallel_master_ip)
    if host.startswith("127.") or host in ("localhost", "::1"):
        host = f"{socket.gethostname()}/{host}"
    key = f"{host}:{parallel_config.data_parallel_rpc_port}/{size}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]
