"""The router's Prometheus metrics (``/metrics``), in a CollectorRegistry of
its own so that several routers in one process (tests) never collide.

Events the request path sees are counted here directly; state that lives in
the registry and the discovery listener (instances, removals, breaker opens,
rejected frames) is read from them at scrape time.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from vllm_disagg.router.discovery import DiscoveryServer
from vllm_disagg.router.registry import InstanceRegistry

PREFIX = "vllm_disagg_router"
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Outcome(str, enum.Enum):
    """How a request ended: the ``outcome`` label of requests_total. A str,
    so a member is its label value wherever a string is expected."""

    OK = "ok"  # decode answered 2xx
    UPSTREAM_CLIENT_ERROR = "upstream_client_error"  # an instance's 4xx, relayed
    BAD_REQUEST = "bad_request"  # refused by the router: malformed or oversized
    NO_INSTANCE = "no_instance"  # 503 / 404: nothing to send it to
    UPSTREAM_ERROR = "upstream_error"  # 5xx, connection failure, broken stream
    TIMEOUT = "timeout"  # a leg or the request deadline ran out
    CANCELLED = "cancelled"  # the client went away
    ROUTER_ERROR = "router_error"  # a bug in the router: a 500 (endpoint: the path)

    __str__ = str.__str__
    __format__ = str.__format__


class LegFailure(str, enum.Enum):
    """Why a call to an instance failed: the ``reason`` label of
    prefill_failures_total, and what log lines and errors name."""

    REFUSED = "refused"  # nothing listens there
    LOCAL = "local"  # the router's own shortage (descriptors, buffers)
    CONNECT_TIMEOUT = "connect_timeout"
    TIMEOUT = "timeout"
    CONNECTION = "connection"  # reset or closed mid-request
    ERROR = "error"
    STATUS = "status"  # it answered 5xx
    INSTANCE_REMOVED = "instance_removed"  # its heartbeats stopped mid-leg
    INSTANCE_STALLED = "instance_stalled"  # its engine stopped stepping mid-leg

    __str__ = str.__str__
    __format__ = str.__format__


class RouterMetrics:
    def __init__(
        self,
        registry: InstanceRegistry,
        discovery: DiscoveryServer,
        multiprocess_dir: str | None = None,
    ) -> None:
        """``multiprocess_dir``: a ``--workers`` worker's: ``render`` sums
        the request metrics of every worker (prometheus_client's files)."""
        self._multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.prefill_retries = Counter(
            f"{PREFIX}_prefill_retries",
            "Prefill attempts repeated on another instance.",
            registry=self.registry,
        )
        self.decode_retries = Counter(
            f"{PREFIX}_decode_retries",
            "Requests "
            "sent to another decode instance after one refused the connection.",
            registry=self.registry,
        )
        self.prefill_failures = Counter(
            f"{PREFIX}_prefill_failures",
            "Failed prefill attempts by reason (refused, connect_timeout, timeout, "
            "connection, status, error).",
            ["reason"],
            registry=self.registry,
        )
        self.decode_prefill_fallbacks = Counter(
            f"{PREFIX}_decode_prefill_fallbacks",
            "Requests the decode instance prefilled itself "
            "(--fallback-to-decode-prefill), by reason (no_prefill, prefill_failed, "
            "prompt_logprobs: vLLM computes such a prompt where it answers, invalid: "
            "vLLM refuses it in validation, beam_search: vLLM's beam search reads "
            "no transferred KV, stored_response: it continues a response stored "
            "on a decode, stdlib_json: a body only Python's json reads "
            "(NaN, lone surrogates), no_kv_transfer_params: vLLM's request "
            "model for it has no kv_transfer_params).",
            ["reason"],
            registry=self.registry,
        )
        self.routes = Counter(
            f"{PREFIX}_routes",
            "Generation requests by the way they went: route disaggregated "
            "(reason long_prompt: over --decode-alone-below-tokens, always: "
            "the threshold is off) or decode_alone (reason short_prompt, or "
            "any reason of decode_prefill_fallbacks).",
            ["route", "reason"],
            registry=self.registry,
        )
        self.concurrent_prefill_failures = Counter(
            f"{PREFIX}_concurrent_prefill_failures",
            "Concurrent hand-off: prefill failed after decode started (decode "
            "recomputes).",
            registry=self.registry,
        )
        self.client_connections_closed = Counter(
            f"{PREFIX}_client_connections_closed",
            "Client connections the router closed for a bound, by reason "
            "(too_many_connections, headers_too_large, header_timeout, body_timeout, "
            "write_timeout).",
            ["reason"],
            registry=self.registry,
        )
        self.health_probes = Counter(
            f"{PREFIX}_health_probes",
            "/health probes of instances that timed out a request, by result (failed: "
            "counted toward the instance's circuit breaker).",
            ["result"],
            registry=self.registry,
        )
        self.migrations = Counter(
            f"{PREFIX}_migrations",
            "Requests whose decode failed, by what migration did (outcome: "
            "resumed, restarted, no_pair, limit, not_migratable, not_joined) and why "
            "(reason: how the decode failed, why the request cannot move, or what "
            "its continuation did not repeat).",
            ["outcome", "reason"],
            registry=self.registry,
        )
        self.migration_latency = Histogram(
            f"{PREFIX}_migration_latency_seconds",
            "From a decode's failure to the first bytes of the request's "
            "continuation on another pair.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self.added_latency = Histogram(
            f"{PREFIX}_added_latency_seconds",
            "Time to the client's first byte minus time spent waiting on instances.",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=self.registry,
        )
        self._state = _StateCollector(registry, discovery)
        self.registry.register(self._state)
        self._start_known_series_at_zero()

    def _start_known_series_at_zero(self) -> None:
        """Create the label values that alerts watch at 0: a series that
        appears only with its first event hides that event from rate() and
        increase()."""
        for endpoint in ("/v1/completions", "/v1/chat/completions"):
            for outcome in Outcome:
                self.requests.labels(endpoint, outcome.value)
        for failure in LegFailure:
            self.prefill_failures.labels(failure.value)
        for reason in ("no_prefill", "prefill_failed"):
            self.decode_prefill_fallbacks.labels(reason)
        for result in ("ok", "failed"):
            self.health_probes.labels(result)
        for route, reason in (
            ("disaggregated", "long_prompt"),
            ("disaggregated", "always"),
            ("decode_alone", "short_prompt"),
        ):
            self.routes.labels(route, reason)
        for outcome in ("resumed", "no_pair", "limit"):
            self.migrations.labels(outcome, "broken")

    def count_route(self, route: str, reason: str) -> None:
        """One generation request went ``route`` (disaggregated or
        decode_alone) for ``reason``."""
        self.routes.labels(route, reason).inc()

    def render(self) -> bytes:
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        summed = CollectorRegistry()
        MultiProcessCollector(summed, path=self._multiprocess_dir)
        summed.register(self._state)
        return generate_latest(summed)


class _StateCollector(Collector):
    def __init__(self, registry: InstanceRegistry, discovery: DiscoveryServer) -> None:
        self._registry = registry
        self._discovery = discovery

    def collect(self) -> Iterator:
        instances = GaugeMetricFamily(
            f"{PREFIX}_instances", "Registered instances by role.", labels=["role"]
        )
        for role, count in self._registry.counts().items():
            instances.add_metric([role], count)
        yield instances
        stalled = GaugeMetricFamily(
            f"{PREFIX}_instances_stalled",
            "Registered instances out of rotation because their heartbeats say "
            "their engine holds requests without stepping (--stall-timeout-s).",
            labels=["role"],
        )
        for role, count in sorted(self._registry.stalled_counts().items()):
            stalled.add_metric([role], count)
        yield stalled
        unpaired = GaugeMetricFamily(
            f"{PREFIX}_instances_unpaired",
            "Registered instances whose model fingerprint matches no instance of "
            "the other side (other weights or settings under one model name).",
            labels=["role"],
        )
        for role, count in sorted(self._registry.unpaired_counts().items()):
            unpaired.add_metric([role], count)
        yield unpaired
        yield CounterMetricFamily(
            f"{PREFIX}_instance_stalls",
            "Times an instance was taken out of rotation for not stepping.",
            value=self._registry.stalls,
        )
        removals = CounterMetricFamily(
            f"{PREFIX}_instance_removals",
            "Instances removed (expired, deregistered, unreachable, replaced).",
            labels=["reason"],
        )
        for reason, count in sorted(self._registry.removals.items()):
            removals.add_metric([reason], count)
        yield removals
        yield CounterMetricFamily(
            f"{PREFIX}_breaker_opens",
            "Circuit breakers opened.",
            value=self._registry.breaker_opens,
        )
        accepted = CounterMetricFamily(
            f"{PREFIX}_discovery_accepted",
            "Discovery messages accepted, by type.",
            labels=["type"],
        )
        for kind, count in sorted(self._discovery.accepted.items()):
            accepted.add_metric([kind], count)
        yield accepted
        rejected = CounterMetricFamily(
            f"{PREFIX}_discovery_rejected",
            "Discovery frames rejected, by kind (malformed, oversized, "
            "unauthenticated, stale, version).",
            labels=["kind"],
        )
        for kind, count in sorted(self._discovery.rejected.items()):
            rejected.add_metric([kind], count)
        yield rejected
