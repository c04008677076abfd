"""One patch registry entry: what it changes upstream, why, until when.

The record type alone, apart from the entries (``enablers.py``,
``features.py``) and from the apply/verify machinery (``__init__.py``), so
the exporter and the README table read the same fields the plugin applies.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class InTree:
    """What a patch becomes in an in-tree fork of vLLM (the export of the
    patch set as upstream changes, :mod:`vllm_disagg.export`): ``edit``, a
    small change of the upstream symbol the exporter derives (anchored edit
    or transplant, :mod:`vllm_disagg.export.edits`); ``hand``, an in-tree
    form written for it (a new field, a redone mechanism: ``hand_cpu.py``,
    ``step_sync.py``); ``dropped``, nothing, because only the plugin or the
    CPU CI needs it. ``detail`` says what, or why not."""

    form: Literal["edit", "hand", "dropped"]
    detail: str


@dataclass(frozen=True)
class Patch:
    name: str
    module: str
    upstream: str
    kind: Literal["enabler", "feature", "probe"]
    why: str
    how: str
    drop_when: str
    in_tree: InTree
    # The upstream pull request or issue this relates to, or why there is none.
    related: str
    # Upstream files (paths in vLLM's source tree) the in-tree form changes
    # beyond the module of ``upstream``: the export pins and edits them too.
    also_changes: tuple[str, ...] = ()
    # Entry points in `module`; several patches of one upstream module share it.
    apply_fn: str = "apply"
    check_fn: str = "is_applied"
    # Whether an engine core with a given configuration uses the patch,
    # ``fn(vllm_config, dp_rank) -> bool`` in `module` (a config of None: True).
    # Empty: every engine core does. load_patch_set verifies only what it uses.
    used_fn: str = ""

    def load(self):
        return importlib.import_module(self.module)

    def apply(self) -> None:
        getattr(self.load(), self.apply_fn)()

    def is_applied(self) -> bool:
        return bool(getattr(self.load(), self.check_fn)())

    def is_used(self, vllm_config, dp_rank: int) -> bool:
        if not self.used_fn or vllm_config is None:
            return True
        return bool(getattr(self.load(), self.used_fn)(vllm_config, dp_rank))
