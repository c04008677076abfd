"""The step-sync scale model's ``--quick`` preset runs end to end (a few seconds, after
one import of vLLM): real Coordinator and Participants in forked rank processes, the
waves model and the harness baseline. Only counts are checked, never timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_preset_runs_every_model_and_counts_wasted_passes(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")])
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "step_sync_scale.py"),
            "--quick",
            "--out",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "step_sync_scale-quick.json").read_text())
    rows = {
        (r["scenario"]["model"], r["scenario"]["delay_ms"]): r
        for r in result["results"]
    }
    assert set(rows) == {
        ("step_sync", 0.0),
        ("step_sync", 1.0),
        ("waves", 1.0),
        ("none", 0.0),
    }
    for row in rows.values():
        assert row["passes_per_s"] > 0
    # Exact pass counts: a drain whose end the rank knows costs step sync no pass;
    # waves run on to their next all-reduce (8 passes after an 8-pass request).
    assert rows[("step_sync", 0.0)]["wasted_per_drain"] == 0
    assert rows[("step_sync", 1.0)]["wasted_per_drain"] == 0
    assert rows[("waves", 1.0)]["wasted_per_drain"] == 8
    assert rows[("step_sync", 1.0)]["coordinator"]["msgs_per_pass"] > 0
    assert (tmp_path / "step_sync_scale-quick.md").exists()
