"""The drift report on a doctored copy of the pinned files (no sdist needed)."""

from __future__ import annotations

from pathlib import Path

from vllm_disagg.export.drift import pinned_files_from_wheel, report
from vllm_disagg.export.source import Pin, Source

MOE = "vllm/model_executor/layers/fused_moe/runner/moe_runner.py"
CLIENT = "vllm/v1/engine/core_client.py"


def _other(files: dict[str, bytes]) -> Source:
    return Source(Path("/other"), "tree", "9.9.9", "PKG-INFO", files=files)


def test_the_pin_itself_drifts_nowhere():
    pin = Pin.current()
    pinned = pinned_files_from_wheel(pin)
    lines = report(_other(dict(pinned)), pinned, pin)
    assert not any(
        line.lstrip().startswith(("refuses", "gone", "changed", "BROKEN"))
        for line in lines
    )
    assert any(line.startswith("edits: ") and "apply" in line for line in lines)


def test_a_moved_anchor_a_changed_symbol_and_a_broken_assumption_are_reported():
    pin = Pin.current()
    pinned = pinned_files_from_wheel(pin)
    other = dict(pinned)
    # The method the MoE edit anchors on is renamed; the clients' FIRST_REQ
    # wake-up is gone (as in 0.33.0).
    other[MOE] = pinned[MOE].replace(b"def _select_forward(", b"def _pick_forward(")
    other[CLIENT] = pinned[CLIENT].replace(b'"FIRST_REQ"', b'"WAKE_UP"')
    lines = report(_other(other), pinned, pin)
    text = "\n".join(lines)
    assert (
        "refuses  cpu-moe-dp-opaque: " in text
        and "_select_forward is defined 0 times" in text
    )
    assert (
        "gone     "
        "vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner._select_forward"
        in text
    )
    assert (
        "BROKEN   the DP clients wake the other engines with a FIRST_REQ message"
        in text
    )
    assert "applies  cpu-ray-dp" in text
