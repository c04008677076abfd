"""The hand-written in-tree forms of cpu-seeded-requests and startup-validation
(vllm_disagg/export/hand_cpu.py) on the pinned files of the installed wheel."""

from __future__ import annotations

import re

import pytest

from vllm_disagg.export import cst as anchors
from vllm_disagg.export import pin as pin_module
from vllm_disagg.export.hand_cpu import COMMIT_EDITS, COMMITS, EDITS
from vllm_disagg.export.overlay import installed_vllm
from vllm_disagg.export.pin import sha256_file
from vllm_disagg.export.source import ExportError
from vllm_disagg.export.tree import UPSTREAM_TESTS
from vllm_disagg.patches import PATCHES

BY_NAME = {patch.name: patch for patch in PATCHES}


def _pinned(rel: str) -> str:
    path = installed_vllm() / rel.removeprefix("vllm/")
    assert sha256_file(path) == pin_module.PINNED_FILES[rel], (
        f"{rel}: the wheel is not the pin"
    )
    return path.read_text(encoding="utf-8")


def _edited(path: str) -> str:
    (edit,) = [e for e in EDITS if e.path == path]
    return edit.apply(anchors.parse(_pinned(path), path), path).code


@pytest.mark.parametrize("edit", EDITS, ids=lambda e: e.path.rsplit("/", 1)[-1])
def test_edit_applies_once_to_the_pinned_file(edit):
    assert BY_NAME[edit.patch].in_tree.form == "hand"
    assert edit.path in pin_module.PINNED_FILES
    where = f"{edit.path} ({edit.patch})"
    before = _pinned(edit.path)
    module = edit.apply(anchors.parse(before, where), where)
    assert module.code != before
    compile(module.code, edit.path, "exec")
    assert "vllm_disagg" not in module.code
    with pytest.raises(ExportError, match=re.escape(edit.path)):
        edit.apply(module, where)


def test_runner_keeps_cpu_generator_states_and_restores_them():
    code = _edited("vllm/v1/worker/gpu_model_runner.py")
    module = anchors.parse(code, "x")
    init, sample, bookkeeping = (
        anchors.dotted(anchors.find_scope(module, f"GPUModelRunner.{name}", "x"))
        for name in ("__init__", "_sample", "_bookkeeping_sync")
    )
    assert "self._discarded_cpu_generator_states: dict[int, torch.Tensor] = {}" in init
    assert "gen.get_state()" in sample
    assert sample.index("_discarded_cpu_generator_states") < sample.index(
        "self.sampler("
    )
    assert 'if gen is not None and gen.device.type == "cpu":' in bookkeeping
    assert "gen.set_state(self._discarded_cpu_generator_states[int(i)])" in bookkeeping
    # Other devices keep upstream's offset rewind, now the elif.
    assert re.search(r"elif gen is not None:\s+gen\.set_offset\(", bookkeeping)


def test_cpu_platform_turns_ray_dp_executor_into_mp_after_the_uni_rule():
    code = _edited("vllm/platforms/cpu.py")
    method = anchors.dotted(
        anchors.find_scope(
            anchors.parse(code, "x"), "CpuPlatform.check_and_update_config", "x"
        )
    )
    uni = method.index('distributed_executor_backend == "uni"')
    ray = method.index('parallel_config.data_parallel_backend == "ray"')
    assert uni < ray < method.index('parallel_config.worker_cls == "auto"')
    assert 'parallel_config.distributed_executor_backend = "mp"' in method[ray:]


def test_cpu_attention_checks_head_size_and_declares_48():
    code = _edited("vllm/v1/attention/backends/cpu_attn.py")
    assert "if not CPUAttentionBackend.supports_head_size(head_size):" in code
    namespace: dict = {}
    fn = anchors.find_scope(
        anchors.parse(code, "x"), "CPUAttentionBackend.get_supported_head_sizes", "x"
    )
    sizes = re.search(r"return (\[[\d, ]+\])", anchors.dotted(fn))
    exec(f"s = {sizes[1]}", namespace)
    assert namespace["s"] == [32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]


def test_commits_name_their_edits_and_tests():
    paths = {edit.path for edit in EDITS}
    carried = [path for commit in COMMITS for path in COMMIT_EDITS[commit.slug]]
    assert sorted(carried) == sorted(paths)  # every edit in exactly one commit
    for commit in COMMITS:
        assert re.fullmatch(r"(\[[A-Za-z0-9 ]+\])+ [A-Z].*", commit.title), commit.title
        assert len(commit.title) <= 72, commit.title
        for path in COMMIT_EDITS[commit.slug]:
            assert {e.patch for e in EDITS if e.path == path} <= set(commit.patches)
        for rel in commit.tests:
            text = (UPSTREAM_TESTS / rel).read_text()
            assert "vllm_disagg" not in text, rel
            assert "pytest.mark.cpu_test" in text, rel
            assert max(map(len, text.splitlines())) <= 88, rel
