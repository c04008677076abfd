"""A real Prometheus for the tests: started on a loopback port, scraping
given targets every second with the project's alert rules (every ``for:``
cut to 1 s), and queried through its HTTP API.

Needs the ``prometheus`` binary (Debian/Ubuntu: ``apt-get install -y
prometheus``); :func:`binary` is None without it, and tests skip, saying so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests
import yaml

from vllm_disagg.testing.server import get_free_port

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "observability" / "alerts.yml"
DASHBOARD = ROOT / "observability" / "dashboard.json"
SKIP_REASON = (
    "prometheus not found: install it (Debian/Ubuntu: `apt-get install -y "
    "prometheus`; do not start its service) to run the Prometheus end-to-end tests"
)


def binary() -> str | None:
    return shutil.which("prometheus")


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of the dashboard."""
    doc = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in doc["panels"]
        for target in panel.get("targets", [])
    ]


@contextmanager
def running(targets: dict[str, str], workdir: Path) -> Iterator[str]:
    """A Prometheus scraping ``targets`` (job -> host:port) every second with
    the rules, ``for:`` cut to 1 s; yields its base URL, stops it after."""
    path = binary()
    if path is None:
        raise RuntimeError(SKIP_REASON)
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "1s"
    (workdir / "rules.yml").write_text(yaml.safe_dump(rules))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yml"],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [addr]}]}
            for job, addr in targets.items()
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = get_free_port()
    with open(workdir / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [
                path,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(url: str, expr: str) -> list:
    answer = requests.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = answer.json()
    if body.get("status") != "success":
        raise AssertionError(f"{expr}: {body}")
    return body["data"]["result"]


def scraped_twice(url: str, jobs: int) -> bool:
    """Whether each of the ``jobs`` targets has two successful scrapes in
    the last minute: ``rate()`` needs two samples, and the targets' scrape
    offsets differ, so one target's second scrape says nothing of another's."""
    twice = query(url, "sum_over_time(up[1m]) >= 2")  # up: 1 per good scrape
    return len(twice) == jobs


def panels_without_data(url: str) -> list[str]:
    """The titles of the dashboard's panels none of whose queries has data."""
    panels = dashboard_exprs()
    shown = {
        title
        for title, expr in panels
        if query(url, expr.replace("$__rate_interval", "1m"))
    }
    return sorted({title for title, _ in panels} - shown)


def targets_health(url: str) -> list[tuple[str, str, str]]:
    """(job, health, last error) of every target, for a failure's message."""
    body = requests.get(f"{url}/api/v1/targets", timeout=10).json()
    return [
        (t["labels"]["job"], t["health"], t["lastError"])
        for t in body["data"]["activeTargets"]
    ]


def active_alerts(url: str) -> dict[str, list[dict]]:
    """The active alerts (pending or firing), by name."""
    body = requests.get(f"{url}/api/v1/alerts", timeout=10).json()
    found: dict[str, list[dict]] = {}
    for alert in body["data"]["alerts"]:
        found.setdefault(alert["labels"]["alertname"], []).append(alert)
    return found


def until(check: Callable[[], Any], what: str, timeout_s: float) -> Any:
    """``check()`` once it is truthy (asked every second); AssertionError
    naming ``what`` and the last answer after ``timeout_s``."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            last = check()
        except requests.RequestException as e:
            last = e
        else:
            if last:
                return last
        time.sleep(1.0)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s (last: {last!r})")
