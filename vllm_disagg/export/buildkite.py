"""Tethering a new test to one of upstream's Buildkite jobs.

Upstream's pre-commit refuses a test file no Buildkite job runs
(``tools/pre_commit/check_test_tethering.py``). Each commit of the series
names the job that should run its tests; the job is found by its ``key``
(which must be there exactly once) and the command is appended to its
``commands`` list, in the list's own indentation. The file is then parsed
as YAML to check it still is.
"""

from __future__ import annotations

import re

import yaml

from vllm_disagg.export.source import ExportError

_JOB_START = re.compile(r"^- ")


def add_job_command(text: str, key: str, command: str, where: str) -> str:
    lines = text.splitlines(keepends=True)
    key_line = re.compile(rf"^\s+key:\s*['\"]?{re.escape(key)}['\"]?\s*$")
    hits = [i for i, line in enumerate(lines) if key_line.match(line)]
    if len(hits) != 1:
        raise ExportError(
            f"{where}: job key {key} appears {len(hits)} times, expected once"
        )
    start = hits[0]
    end = next(
        (i for i in range(start + 1, len(lines)) if _JOB_START.match(lines[i])),
        len(lines),
    )
    commands = [i for i in range(start, end) if re.match(r"^  commands:\s*$", lines[i])]
    if len(commands) != 1:
        raise ExportError(
            f"{where}: job {key} has {len(commands)} commands lists, expected one"
        )
    first = commands[0] + 1
    while first < end and (
        not lines[first].strip() or lines[first].lstrip().startswith("#")
    ):
        first += 1
    item = re.match(r"^(\s+)- ", lines[first]) if first < end else None
    if item is None:
        raise ExportError(f"{where}: job {key}'s commands list has no items to follow")
    indent = item.group(1)
    last = first
    for i in range(first, end):
        line = lines[i]
        if line.startswith(indent + "- ") or (
            line.startswith(indent + "  ") and line.strip()
        ):
            last = i
        elif line.strip():
            break
    lines.insert(last + 1, f"{indent}- {command}\n")
    result = "".join(lines)
    try:
        jobs = yaml.safe_load(result)
    except yaml.YAMLError as exc:
        raise ExportError(
            f"{where}: not YAML after adding to job {key} ({exc})"
        ) from None
    job = _find_job(jobs, key)
    if job is None or command not in job.get("commands", []):
        raise ExportError(f"{where}: job {key} does not run {command!r} after the edit")
    return result


def _find_job(node, key: str):
    if isinstance(node, dict):
        if node.get("key") == key:
            return node
        children = node.values()
    elif isinstance(node, list):
        children = node
    else:
        return None
    for child in children:
        if (found := _find_job(child, key)) is not None:
            return found
    return None
