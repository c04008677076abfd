"""benchmarks/router_scale.py --quick: the fleet-scale benchmark runs end to
end (fake instances registering through real discovery sockets, selection
through the proxy's code) and writes its result files. No timed assertion:
the figures depend on the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_preset_registers_selects_and_writes_its_results(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")])
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "router_scale.py"), "--quick"]
        + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "router_scale.json").read_text())
    sizes = [f["instances"] for f in result["fleets"]]
    assert sizes == [4, 16]
    for fleet in result["fleets"]:
        # Every instance registered and heartbeated through the socket, and
        # none expired or was refused while prompts were selected.
        assert fleet["heartbeats"]["handled"] >= fleet["instances"]
        assert fleet["heartbeats"]["rejected"] == 0
        assert fleet["selection"]["prompts"] == result["prompts"]
        assert fleet["selection"]["shared_prompts"] > 0
        assert fleet["instances_listing"]["bytes"] > 300 * fleet["instances"]
    index = result["index_memory"][-1]
    assert 0 < index["entries"] <= 65536 and index["bytes"] > 0
    md = (tmp_path / "router_scale.md").read_text()
    assert "load average" in md and "| 16 |" in md
