"""The record of one edit of an upstream file (its own module, so that the
slices kept in modules of their own, :mod:`.step_sync`, can build edits that
:mod:`.edits` collects without an import cycle)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst

EditFn = Callable[[cst.Module, str], cst.Module]


@dataclass(frozen=True)
class Edit:
    patch: str  # the registry entry
    path: str  # upstream file, relative to the source root
    what: str  # one line, for the report and the commit body
    apply: EditFn  # (module, where) -> module
