"""What the fleet puts on ``/metrics``, and the metric names a PromQL
expression or a page of docs uses.

The exposed names are taken from the code that defines them (the router's
registry, the P2P connector's Prometheus metrics built as vLLM builds them,
the step-sync collector reading a snapshot of every counter), so a renamed
or removed metric leaves the rules, the dashboard or the docs naming
something that no longer exists.
"""

from __future__ import annotations

import functools
import json
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace

import vllm
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's own metrics the rules and the dashboard read (checked against
# vLLM's source below), and Prometheus's own.
VLLM_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds",
    "vllm:kv_cache_usage_perc",
)
PROMETHEUS_SERIES = {"up"}

_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
    "unknown": ("",),
}


def _samples(registry: CollectorRegistry) -> dict[str, str]:
    """The type of every family the registry exposes, by name."""
    return {family.name: family.type for family in registry.collect()}


def router_families() -> dict[str, str]:
    from vllm_disagg.router.app import create_app, router_state
    from vllm_disagg.router.config import RouterConfig

    config = RouterConfig(
        host="127.0.0.1",
        port=0,
        discovery_host="127.0.0.1",
        discovery_port=0,
        local_cookie=False,
    )
    return _samples(router_state(create_app(config)).metrics.registry)


def p2p_families() -> dict[str, str]:
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
        P2pPromMetrics,
    )

    registry = CollectorRegistry()

    def bound(cls):
        return functools.partial(cls, registry=registry)

    metric_types = {cls: bound(cls) for cls in (Counter, Gauge, Histogram)}
    P2pPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        metric_types,
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    return _samples(registry)


def step_sync_families() -> dict[str, str]:
    from vllm_disagg.v1.metrics.step_sync import METRICS, StepSyncCollector

    with tempfile.TemporaryDirectory() as directory:
        snapshot = {"dp_rank": 0, "stats": dict.fromkeys(METRICS, 1)}
        (Path(directory) / "step_sync_dp0.json").write_text(json.dumps(snapshot))
        registry = CollectorRegistry()
        registry.register(StepSyncCollector(Path(directory)))
        return _samples(registry)


def vllm_families() -> dict[str, str]:
    source = "\n".join(
        path.read_text()
        for path in (Path(vllm.__file__).parent / "v1" / "metrics").glob("*.py")
    )
    found = {}
    for name in VLLM_METRICS:
        if f'"{name}"' in source:
            found[name] = "histogram" if name.endswith("_seconds") else "gauge"
    return found


@functools.cache
def exposed_families() -> dict[str, str]:
    """Every metric family the fleet exposes: name -> type."""
    return {
        **router_families(),
        **p2p_families(),
        **step_sync_families(),
        **vllm_families(),
        **dict.fromkeys(PROMETHEUS_SERIES, "gauge"),
    }


@functools.cache
def exposed_series_names() -> frozenset[str]:
    """The sample names a query can select: ``<counter>_total``,
    ``<histogram>_bucket``/``_sum``/``_count``, ``<gauge>``."""
    return frozenset(
        name + suffix
        for name, kind in exposed_families().items()
        for suffix in _SUFFIXES.get(kind, ("",))
    )


def known_loosely(name: str) -> bool:
    """A name as docs write it: the family, or a sample name with a suffix."""
    families = exposed_families()
    if name in families:
        return True
    for suffix in ("_total", "_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name.removesuffix(suffix) in families:
            return True
    return False


# --- PromQL ------------------------------------------------------------------

_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (identifiers that are not
    functions, keywords, label names or values, durations or variables)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    s = re.sub(r"'(?:[^'\\]|\\.)*'", "''", s)
    s = re.sub(r"\$\{[^}]*\}|\$\w+", "1", s)  # Grafana variables
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # ranges, subqueries
    s = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s
    )  # grouping label lists
    s = re.sub(r"\boffset\s+\S+", " ", s)
    names = set()
    for match in _IDENT.finditer(s):
        name = match.group()
        before = s[match.start() - 1] if match.start() else ""
        if before.isdigit() or before == ".":
            continue  # part of a number (1e3) or a duration
        if name.lower() in _KEYWORDS:
            continue
        if re.match(r"\s*\(", s[match.end() :]):
            continue  # a function
        names.add(name)
    return names


# --- docs --------------------------------------------------------------------

FULL_PREFIXES = ("vllm_disagg_router_", "vllm:", "vllm_disagg:")
ROUTER_PREFIX = "vllm_disagg_router_"


def _expand_braces(name: str) -> list[str]:
    """``a_{b,c}_d`` -> ``a_b_d``, ``a_c_d`` (as the docs abbreviate)."""
    match = re.search(r"\{([A-Za-z0-9_,]+)\}", name)
    if not match or "," not in match.group(1):
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    return [
        expanded
        for part in match.group(1).split(",")
        for expanded in _expand_braces(head + part + tail)
    ]


def doc_metric_names(text: str) -> set[str]:
    """Metric names in the code spans of a markdown page: every span naming
    a prefixed metric, and in a table column headed ``metric...`` every span
    outside parentheses that starts with a name (router metrics are
    abbreviated there: without their ``vllm_disagg_router_`` prefix)."""
    names = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        for candidate in _expand_braces(span.strip()):
            match = re.match(
                r"(vllm_disagg_router_|vllm:|vllm_disagg:)[\w:]+", candidate
            )
            if match:
                names.add(match.group())
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        for title, cell in zip(header, cells):
            if not title.lower().startswith("metric"):
                continue
            # label values are listed in parentheses: (`invalid_http`, ...)
            cell = re.sub(r"\([^()]*\)", " ", cell)
            for span in re.findall(r"`([^`\n]+)`", cell):
                for candidate in _expand_braces(span.strip()):
                    match = re.match(r"[A-Za-z_][\w:]*", candidate)
                    if not match:
                        continue  # a label selector alone: {reason="..."}
                    name = match.group()
                    if not name.startswith(FULL_PREFIXES):
                        name = ROUTER_PREFIX + name
                    names.add(name)
    return names
