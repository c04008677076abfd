"""Every metric docs/operations.md, observability/alerts.yml and
observability/dashboard.json name exists: the names are collected from the
code that defines them (tests/observability/names.py), so renaming or
removing a metric fails here until the rules, the dashboard and the docs
follow."""

from __future__ import annotations

import pytest

from tests.observability import names
from tests.observability.test_alerts import ROOT, dashboard_exprs, rules


def test_names_are_collected_from_the_code():
    series = names.exposed_series_names()
    # one of each kind, as Prometheus sees them
    assert "vllm_disagg_router_requests_total" in series
    assert "vllm_disagg_router_added_latency_seconds_bucket" in series
    assert "vllm:p2p_failed_loads_total" in series
    assert "vllm:p2p_buffer_bytes" in series
    assert "vllm:p2p_recv_seconds_bucket" in series
    assert "vllm_disagg:step_sync_local_step" in series
    assert "vllm_disagg:step_sync_dummy_steps_total" in series
    assert "vllm:time_to_first_token_seconds_bucket" in series
    assert "vllm:p2p_failed_loads" not in series  # a counter needs _total


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        (
            'sum by (job, le) (rate(a_total{x="y", z=~"b|c"}[5m])) / on (job)'
            " group_left max(b) > 1e3",
            {"a_total", "b"},
        ),
        (
            "histogram_quantile(0.99, sum by (le) (rate(h_bucket[$__rate_interval])))",
            {"h_bucket"},
        ),
        (
            "max by (i) (vllm_disagg:g) - min without (r) (vllm:g offset 5m) and up",
            {"vllm_disagg:g", "vllm:g", "up"},
        ),
    ],
)
def test_promql_names(expr, expected):
    assert names.promql_metric_names(expr) == expected


def test_doc_names():
    text = (
        "| failure | metric that shows it |\n| --- | --- |\n"
        '| x | `vllm_disagg_router_a_total{r="c"}`, `b_total` (`not_a_metric`),'
        ' `{reason="x"}`, `vllm:p2p_c_total` |\n\n'
        "text `vllm_disagg:step_sync_{d,e}_messages` and `--flag`\n"
    )
    assert names.doc_metric_names(text) == {
        "vllm_disagg_router_a_total",
        "vllm_disagg_router_b_total",
        "vllm:p2p_c_total",
        "vllm_disagg:step_sync_d_messages",
        "vllm_disagg:step_sync_e_messages",
    }


def test_every_metric_the_rules_use_exists():
    missing = {
        rule["alert"]: sorted(
            names.promql_metric_names(rule["expr"]) - names.exposed_series_names()
        )
        for rule in rules()
    }
    assert {k: v for k, v in missing.items() if v} == {}


def test_every_metric_the_dashboard_uses_exists():
    missing = {
        f"{title}: {expr}": sorted(
            names.promql_metric_names(expr) - names.exposed_series_names()
        )
        for title, expr in dashboard_exprs()
    }
    assert {k: v for k, v in missing.items() if v} == {}


def test_every_metric_the_operations_page_names_exists():
    used = names.doc_metric_names((ROOT / "docs" / "operations.md").read_text())
    assert len(used) > 10
    assert sorted(n for n in used if not names.known_loosely(n)) == []
