"""Commit messages and pull-request descriptions of the exported series.

The text comes from the patch registry (why, the in-tree form, related
upstream work) and the series (how it was tested, what stays unverified), so
the description of a commit cannot drift from what the registry says the
change is for.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable

from vllm_disagg.export.checks import HOOKS, NOT_RUN
from vllm_disagg.export.edits import Edit
from vllm_disagg.export.series import Commit


def _entries(commit: Commit):
    from vllm_disagg.patches import PATCHES

    by_name = {patch.name: patch for patch in PATCHES}
    return [by_name[name] for name in commit.patches]


def _wrap(text: str, width: int = 72) -> str:
    """Wrapped for a commit body; a bullet's lines continue under its text."""
    indent = "  " if text.startswith("- ") else ""
    lines = textwrap.wrap(
        " ".join(text.split()),
        width,
        subsequent_indent=indent,
        break_on_hyphens=False,
        break_long_words=False,
    )
    return "\n".join(lines)


def _purpose(commit: Commit) -> list[str]:
    """Why the change: an enabler's registry ``why`` (what fails upstream),
    then the commit's summary. A feature's ``why`` speaks of the plugin (what
    it patches), so a feature commit says why in its summary instead."""
    paragraphs = [e.why for e in _entries(commit) if e.kind == "enabler"]
    if commit.summary:
        paragraphs.append(commit.summary)
    return paragraphs


def commit_message(commit: Commit, edits: Iterable[Edit]) -> str:
    """Subject, a body on why and what (wrapped at 72); ``--signoff`` adds
    the trailer."""
    parts = [commit.title, ""]
    for paragraph in _purpose(commit):
        parts += [_wrap(paragraph), ""]
    for edit in edits:
        parts.append(_wrap(f"- {edit.path}: {edit.what}"))
    for test in commit.tests:
        parts.append(_wrap(f"- {test}: new test"))
    return "\n".join(parts).rstrip() + "\n"


def description(commit: Commit, edits: Iterable[Edit], changed: Iterable[str]) -> str:
    """The pull-request description: what, why, how tested, unverified."""
    entries = _entries(commit)
    lines = [f"# {commit.title}", "", "## Purpose", ""]
    for paragraph in _purpose(commit):
        lines += [" ".join(paragraph.split()), ""]
    lines += ["## What changes", ""]
    for entry in entries:
        lines.append(f"- {' '.join(entry.in_tree.detail.split())}")
    for edit in edits:
        lines.append(f"- `{edit.path}`: {edit.what}")
    lines += ["", "Files: " + ", ".join(f"`{path}`" for path in changed), ""]
    lines += ["## Related", ""]
    for entry in entries:
        lines.append(f"- {' '.join(entry.related.split())}")
    if not entries:
        lines.append("- None: no patch of an upstream module; new files only.")
    lines += ["", "## Test plan", "", " ".join(commit.tested.split()), ""]
    lines += ["## Not verified", "", " ".join(commit.unverified.split()), ""]
    lines += [
        "## Checks",
        "",
        "`ruff check` and `ruff format` with the tree's configuration, and the "
        "offline pre-commit hooks "
        + ", ".join(f"`{script}`" for script, _ in HOOKS)
        + ", pass on every changed file (the export refuses otherwise). Not run: "
        + NOT_RUN
        + ".",
        "",
    ]
    return "\n".join(lines)
