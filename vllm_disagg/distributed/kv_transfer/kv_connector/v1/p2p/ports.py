"""Where the P2P connector's workers listen, checked at start-up.

Every worker of every DP rank on a host gets its own control-plane port:
``kv_port`` plus the worker's global index (:func:`worker_port`); with the tcp
transport's ``kv_data_port``, a data port at the same offset. The checks here
refuse a plan that runs past port 65535 or onto ``http_port``, and the DP
layouts in which a request cannot reach the rank whose address it names.
"""

from __future__ import annotations

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.roles import (
    CONNECTOR_NAME,
    KV_BOTH,
    KV_CONSUMER,
    KV_PRODUCER,
)
from vllm_disagg.errors import ConfigError
from vllm_disagg.options.parsers import MAX_PORT

_EXTRA = "kv_connector_extra_config"


def worker_port(
    base_port: int,
    *,
    dp_rank: int,
    tp_size: int,
    pp_size: int,
    tp_rank: int,
    pp_rank: int,
) -> int:
    """The port of one worker: ``kv_port`` plus the worker's global index,
    so every worker of every DP rank on a host gets its own."""
    if not (tp_size >= 1 and pp_size >= 1 and dp_rank >= 0):
        raise ValueError(
            f"bad parallel sizes: dp_rank={dp_rank} tp={tp_size} pp={pp_size}"
        )
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
        raise ValueError(
            f"bad ranks: tp_rank={tp_rank}/{tp_size} pp_rank={pp_rank}/{pp_size}"
        )
    offset = dp_rank * tp_size * pp_size + pp_rank * tp_size + tp_rank
    port = base_port + offset
    if port > MAX_PORT:
        raise ConfigError(
            f"kv_port: {base_port} + {offset} (DP rank {dp_rank}, PP rank "
            f"{pp_rank}, TP rank {tp_rank}) is beyond {MAX_PORT}; kv_port must "
            f"be at most {MAX_PORT - offset}"
        )
    return port


def instance_port(base_port: int, dp_rank: int, tp_size: int, pp_size: int) -> int:
    """The port of a DP rank's first worker (TP and PP rank 0): the one a
    proxy puts in the request id to name this instance."""
    return worker_port(
        base_port,
        dp_rank=dp_rank,
        tp_size=tp_size,
        pp_size=pp_size,
        tp_rank=0,
        pp_rank=0,
    )


def check_port_plan(
    base_port: int,
    http_port: int | None,
    parallel_config,
    data_port: int | None = None,
) -> range:
    """Check at start-up that every worker's port exists and does not
    collide with ``http_port``, nor the tcp data ports (``kv_data_port``,
    one per worker) with either; returns the control ports."""
    dp = parallel_config.data_parallel_size
    tp = parallel_config.tensor_parallel_size
    pp = parallel_config.pipeline_parallel_size
    count = dp * tp * pp
    ports = range(base_port, base_port + count)
    if ports[-1] > MAX_PORT:
        raise ConfigError(
            f"kv_port: {base_port} needs ports {ports[0]}..{ports[-1]} for "
            f"{dp} DP x {pp} PP x {tp} TP workers, beyond {MAX_PORT}; kv_port "
            f"must be at most {MAX_PORT + 1 - count}"
        )
    if http_port is not None and http_port in ports:
        raise ConfigError(
            f"{_EXTRA}.http_port: {http_port} is one of the workers' KV "
            f"ports ({ports[0]}..{ports[-1]}, from kv_port); choose ports apart"
        )
    if data_port is not None:
        data = range(data_port, data_port + count)
        if data[-1] > MAX_PORT:
            raise ConfigError(
                f"{_EXTRA}.kv_data_port: {data_port} needs ports "
                f"{data[0]}..{data[-1]} for {count} workers, beyond {MAX_PORT}"
            )
        clash = set(data) & (set(ports) | {http_port})
        if clash:
            raise ConfigError(
                f"{_EXTRA}.kv_data_port: ports {data[0]}..{data[-1]} overlap the "
                f"KV ports {ports[0]}..{ports[-1]} or http_port (port "
                f"{min(clash)}); choose ports apart"
            )
    return ports


def check_dp_load_balancing(role: str, send_type: str, parallel_config) -> None:
    """Refuse the combinations that cannot work when one API server
    fronts several DP ranks (internal load balancing, hybrid included:
    vLLM makes a hybrid deployment with one local rank external).

    The router names one DP rank of each side per request (its KV
    address), but the API server hands the request to whichever rank it
    picks. What depends on the request landing on the named rank fails:

    * kv_consumer, PUT/PUT_ASYNC: prefill pushes the KV to the named
      decode rank, so a request on another rank never gets it;
    * kv_producer, GET: decode pulls from the named prefill rank, which
      does not hold the KV when the prefill ran on another rank;
    * kv_both: picks its side by comparing the named addresses with its
      own rank's address, so on another rank it transfers nothing.

    The others work: a consumer in GET mode pulls with its own worker's
    address in the ``Get`` and the prefill sends there (engine._on_get);
    a producer in PUT modes pushes from whichever rank ran the prefill,
    and decode files received KV by the request's key, not by sender.
    """
    dp = parallel_config.data_parallel_size
    if dp <= 1 or parallel_config.data_parallel_external_lb:
        return
    push = send_type != "GET"
    if role == KV_CONSUMER and push:
        why = (
            "prefill pushes the KV to the decode rank the request names, but the "
            "API server may hand the request to another rank"
        )
    elif role == KV_PRODUCER and not push:
        why = (
            "decode pulls the KV from the prefill rank the request names, but the "
            "API server may have run the prefill on another rank"
        )
    elif role == KV_BOTH:
        why = (
            "kv_both picks its side by comparing the request's addresses with its "
            "own rank's, and the API server may hand the request to another rank"
        )
    else:
        return
    raise ConfigError(
        f"{CONNECTOR_NAME}: kv_role {role} with send_type "
        f"{send_type} cannot run {dp} DP ranks behind one API server "
        f"(internal load balancing): {why}; run one `vllm serve` per DP rank "
        "(--data-parallel-rank N, external load balancing) so each rank registers "
        "as its own instance"
    )
