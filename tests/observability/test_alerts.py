"""observability/alerts.yml and dashboard.json: valid, documented, and
unit-tested with ``promtool test rules`` (alerts_test.yml: series that must
fire each alert and series that must not).

promtool comes with Prometheus (Debian 12: ``apt-get install prometheus``,
2.42); without it the promtool tests skip, saying so.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from vllm_disagg.testing.prometheus import dashboard_exprs

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "observability" / "alerts.yml"
DASHBOARD = ROOT / "observability" / "dashboard.json"
RULE_TESTS = Path(__file__).with_name("alerts_test.yml")
SEVERITIES = {"critical", "warning", "info"}


def rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "promtool not found: install Prometheus (Debian/Ubuntu: "
            "`apt-get install -y prometheus`, which brings promtool) to test "
            "observability/alerts.yml"
        )
    return path


def run(cmd: list[str], cwd: Path | None = None) -> str:
    result = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_every_rule_is_an_alert_with_severity_summary_and_advice():
    names = [rule.get("alert") for rule in rules()]
    assert all(names), "recording rules belong elsewhere"
    assert len(names) == len(set(names)), "alert names must be unique"
    for rule in rules():
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert len(rule["annotations"]["description"]) > 60, rule["alert"]


def test_every_alert_has_a_case_that_fires():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tests
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert {rule["alert"] for rule in rules()} - fired == set()


def test_rules_are_valid(promtool):
    run([promtool, "check", "rules", str(RULES)])


def test_rules_fire_on_what_they_should_and_only_on_that(promtool, tmp_path):
    """alerts_test.yml against the rules less their annotations (promtool
    compares annotations too; they are checked above and by check rules)."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(doc))
    shutil.copy(RULE_TESTS, tmp_path / "alerts_test.yml")
    run([promtool, "test", "rules", "alerts_test.yml"], cwd=tmp_path)


def test_dashboard_is_importable_as_is():
    doc = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in doc["__inputs"]] == ["DS_PROMETHEUS"]
    assert doc["__inputs"][0]["pluginId"] == "prometheus"
    assert doc["uid"] and doc["title"] and doc["id"] is None
    ids = [panel["id"] for panel in doc["panels"]]
    assert len(ids) == len(set(ids))
    for panel in doc["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
    # no panel overlaps another on the grid
    cells: set[tuple[int, int]] = set()
    for panel in doc["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_dashboard_queries_are_valid_promql(promtool, tmp_path):
    """Every query parses (as a recording rule, with Grafana's variables
    replaced by what Grafana puts there)."""
    records = [
        {
            "record": f"dashboard:query_{i}",
            "expr": re.sub(r"\$__rate_interval|\$__interval", "1m", expr),
        }
        for i, (_, expr) in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": records}]}))
    run([promtool, "check", "rules", str(path)])


def test_the_operations_page_names_real_alerts_and_panels():
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Alerts and dashboard", 1)[1].split("\n## ", 1)[0]
    alerts = {rule["alert"] for rule in rules()}
    named = set(re.findall(r"`(VllmDisagg\w+)`", section))
    assert named - alerts == set()
    assert alerts - named == set(), "every alert belongs to a row of the page"
    titles = {title for title, _ in dashboard_exprs()}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and "VllmDisagg" in cells[1]:
            assert set(cells[2].split("; ")) - titles == set(), line
        if (
            line.startswith("| ")
            and len(cells) == 2
            and cells[0]
            not in (
                "panel",
                "---",
            )
        ):
            assert cells[0] in titles, line
