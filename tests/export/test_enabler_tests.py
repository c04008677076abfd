"""Each enabler is tested the way upstream would test it.

Upstream has no CPU test of what the enablers make work (all_gatherv and
reduce_scatterv on CPU, seeded sampling across prefill chunks, the Ray device
key, the DP port on an IPv6 master, ...): the test each exported commit writes
is that test. Here, without building the fork: every enabler with an in-tree
form has one, upstream's CPU jobs select it (``cpu_test``), and the overlay
check (tests/export/test_fork.py, which asserts each of them ran and passed on
the wheel with the series laid over it) runs it.
"""

from __future__ import annotations

import ast

import pytest

from vllm_disagg.export.series import enabler_tests, overlay_tests
from vllm_disagg.export.tree import UPSTREAM_TESTS
from vllm_disagg.patches import PATCHES

ENABLERS = enabler_tests()


def test_every_enabler_with_an_in_tree_form_is_listed():
    expected = {
        p.name
        for p in PATCHES
        if p.kind == "enabler" and p.in_tree.form in ("edit", "hand")
    }
    assert set(ENABLERS) == expected
    # The ones upstream has no CPU test for, named in the issue that asked.
    assert {
        "cpu-collectives-v",
        "cpu-seeded-requests",
        "cpu-ray-dp",
        "dp-ipv6-master-port",
    } <= expected


@pytest.mark.parametrize("name", sorted(ENABLERS))
def test_enabler_has_an_exported_cpu_test_the_overlay_runs(name):
    files = ENABLERS[name]
    assert files, f"{name}: no commit of the series writes a test for it"
    selected = overlay_tests().run
    for rel in files:
        path = UPSTREAM_TESTS / rel
        assert path.is_file(), f"{name}: {rel} is not under export/upstream_tests"
        tree = ast.parse(path.read_text())
        marks = [
            ast.unparse(mark)
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
            for mark in getattr(node.value, "elts", [node.value])
        ]
        assert "pytest.mark.cpu_test" in marks, (
            f"{rel}: pytestmark {marks}: upstream's CPU jobs and the overlay "
            "check select tests by -m cpu_test"
        )
        tests = [
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
        ]
        assert tests, f"{rel} has no test function"
        assert any(rel == s or rel.startswith(s.rstrip("/") + "/") for s in selected), (
            f"{name}: the overlay check does not run {rel}"
        )
