"""Code the step-sync edits insert into upstream files, kept as real Python.

The edits (:mod:`.step_sync_edits`) take statements from here by name
(:func:`fragment`): a top-level definition as it stands, or the body of a
carrier class or method named like the upstream scope it goes into (the
carrier's own docstring left out). ruff checks this file and it imports, so
the inserted code is linted where it is written, not only after the export.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import libcst as cst
from pydantic import Field

from vllm_disagg.export import cst as anchors
from vllm_disagg.export.source import ExportError

# --- vllm/config/parallel.py ---------------------------------------------------

DataParallelSync = Literal["wave", "step"]

DataParallelSyncCoordinator = Literal["auto", "thread", "process"]


class ParallelConfig:
    """Carrier: its fields go after ``ParallelConfig.dp_sync_interval``, the
    body of its method before ``return self`` of upstream's."""

    data_parallel_sync: DataParallelSync = "wave"
    """How MoE data parallel ranks stay in lockstep (they must run the same
    number of forward passes). "wave": waves started by the DP coordinator and
    an all-reduce every `dp_sync_interval` steps. "step": the ranks agree on a
    common step count among themselves (a coordinator thread in DP rank 0's
    engine core) and a rank without work runs dummy steps up to it: no waves,
    no all-reduce in the busy loop, and clients carry no DP state."""
    data_parallel_sync_lookahead: int | None = Field(default=None, ge=1, le=1024)
    """With `data_parallel_sync="step"`: how many steps beyond its own a rank
    with work asks for (renewed when half of them are left). None: 2 below
    `data_parallel_size` 32 and 8 from it, where the coordinator's messages
    grow with the group."""
    data_parallel_sync_peer_timeout_seconds: float = Field(
        default=30.0, ge=0.1, le=3600
    )
    """With `data_parallel_sync="step"`: seconds after which a silent or
    stalled DP rank ends the group with an error instead of leaving its peers
    waiting."""
    data_parallel_sync_coordinator: DataParallelSyncCoordinator = "auto"
    """With `data_parallel_sync="step"`: where DP rank 0 runs the step-sync
    coordinator. "thread": in its engine core process; "process": in a child
    process with an interpreter of its own, so rank 0's forward passes and
    the coordinator do not share one interpreter lock; "auto": "process"
    from `data_parallel_size` 32."""

    def _validate_parallel_config(self):
        """Carrier."""
        if self.data_parallel_sync == "step":
            for option in ("enable_elastic_ep", "enable_fault_tolerance"):
                if getattr(self, option):
                    raise ValueError(
                        f"data_parallel_sync='step' does not support {option} (it "
                        "re-forms the DP group, not the step-sync group); use "
                        "data_parallel_sync='wave'"
                    )


# --- vllm/v1/metrics/stats.py -------------------------------------------------


@dataclass
class StepSyncStats:
    """Counters of a DP engine core with `--data-parallel-sync step`.

    The counts are increments since the engine core's previous report; the two
    steps are positions (every rank ends at the same coordinator step)."""

    forward_steps: int = 0
    """Real forward passes run."""
    dummy_steps: int = 0
    """Dummy forward passes run to keep up with the other DP ranks."""
    grant_waits: int = 0
    """Waits (one round trip at most) for a step this rank asked for: the
    wake-ups of an idle group."""
    rejected_frames: int = 0
    """Step-sync frames dropped as malformed, unauthenticated or replayed, by
    this rank and (DP rank 0) by the coordinator."""
    wave_messages: int = 0
    """DP wave traffic that crossed the engine core's boundary (START_DP_WAVE,
    requests stamped with a wave, outputs carrying one); expected 0."""
    local_step: int = 0
    """Forward passes (real and dummy) run so far."""
    coordinator_step: int = 0
    """The step count granted to every DP rank so far."""


# --- reading the fragments ---------------------------------------------------------


@cache
def _module() -> cst.Module:
    return cst.parse_module(Path(__file__).read_text(encoding="utf-8"))


def _is_docstring(stmt: cst.CSTNode) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, cst.SimpleString)
    )


def fragment(name: str, *, body: bool = False) -> list[cst.BaseStatement]:
    """The top-level statement defining ``name``; with ``body``, the body of
    the carrier class or method ``name`` (dotted: ``"Class.method"``) without
    its docstring or its methods."""
    where = "step_sync_fragments.py"
    module = _module()
    if not body:
        found = [s for s in module.body if name in anchors._defined_names(s)]
        if len(found) != 1:
            raise ExportError(f"{where}: {name} is defined {len(found)} times")
        return [found[0].with_changes(leading_lines=[])]
    scope = anchors.find_scope(module, name, where)
    assert isinstance(scope, cst.ClassDef | cst.FunctionDef)
    statements = list(scope.body.body)
    if statements and _is_docstring(statements[0]):
        statements = statements[1:]
    statements = [s for s in statements if not isinstance(s, cst.FunctionDef)]
    if not statements:
        raise ExportError(f"{where}: {name} carries nothing")
    return [statements[0].with_changes(leading_lines=[]), *statements[1:]]
