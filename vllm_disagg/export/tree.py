"""Writing the fork: the pinned tree, one signed-off commit per pull request,
``git format-patch`` files and a pull-request description per commit.

The output directory is a git repository on branch :data:`BRANCH` whose first
commit is the pinned source as released (so every later commit's diff is
exactly what the patch series changes) and whose later commits follow
:data:`~vllm_disagg.export.series.SERIES`. Files each commit touches are
formatted and linted with ruff under the tree's own configuration (88
columns), as upstream's pre-commit does; a lint finding that ``--fix`` cannot
mend stops the export.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_disagg.export import cst as anchors
from vllm_disagg.export.buildkite import add_job_command
from vllm_disagg.export.checks import run_hooks
from vllm_disagg.export.edits import EDITS, Edit
from vllm_disagg.export.series import SERIES, Commit
from vllm_disagg.export.source import ExportError, Source

BRANCH = "vllm-disagg"
UPSTREAM_TESTS = Path(__file__).parent / "upstream_tests"
SPDX = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
)
_IDENTITY = re.compile(r"^(?P<name>[^<>]+?)\s*<(?P<email>[^<>@\s]+@[^<>\s]+)>$")


@dataclass(frozen=True)
class Identity:
    """Who signs off: the Developer Certificate of Origin is the person's."""

    name: str
    email: str

    @classmethod
    def parse(cls, text: str) -> Identity:
        match = _IDENTITY.match(text.strip())
        if not match:
            raise ExportError(f"--author {text!r}: expected 'Name <email>'")
        return cls(match["name"], match["email"])

    @classmethod
    def from_git(cls) -> Identity | None:
        def get(key: str) -> str:
            done = subprocess.run(
                ["git", "config", key], capture_output=True, text=True
            )
            return done.stdout.strip()

        name, email = get("user.name"), get("user.email")
        return cls(name, email) if name and email else None

    def __str__(self) -> str:
        return f"{self.name} <{self.email}>"


@dataclass
class Result:
    out: Path
    patches_dir: Path
    commits: list[tuple[Commit, str, list[str]]] = field(default_factory=list)


def unpack(source: Source, out: Path) -> None:
    """The whole pinned source under ``out`` (an sdist's top directory
    stripped; a tree copied without its .git)."""
    if source.kind == "tree":
        shutil.copytree(
            source.path,
            out,
            ignore=shutil.ignore_patterns(".git", "__pycache__"),
            symlinks=True,
        )
        return
    out.mkdir(parents=True)
    with tarfile.open(source.path) as tar:
        members = []
        for member in tar.getmembers():
            top, _, rel = member.name.removeprefix("./").partition("/")
            if not rel:
                continue
            member.name = rel
            members.append(member)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(out, members=members, **safe)


def git(out: Path, *args: str, identity: Identity | None = None) -> str:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    if identity is not None:
        env |= {
            "GIT_AUTHOR_NAME": identity.name,
            "GIT_AUTHOR_EMAIL": identity.email,
            "GIT_COMMITTER_NAME": identity.name,
            "GIT_COMMITTER_EMAIL": identity.email,
        }
    done = subprocess.run(
        ["git", *args], cwd=out, capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise ExportError(
            f"git {args[0]} in {out} failed: {done.stderr.strip().splitlines()[-1:]}"
        )
    return done.stdout


def ruff_command() -> list[str]:
    """The ruff of this environment (the ``export`` extra pins upstream's version)."""
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    exe = shutil.which("ruff")
    if exe is None:
        raise ExportError("ruff is not installed: pip install 'vllm-disagg[export]'")
    return [exe]


def ruff(out: Path, paths: Iterable[str]) -> list[str]:
    """Run ruff check --fix, ruff format, then ruff check again on ``paths`` with
    the tree's configuration; the findings left (none when clean)."""
    paths = sorted(paths)
    if not paths:
        return []
    exe = ruff_command()
    config = ["--config", str(out / "pyproject.toml")]
    subprocess.run(
        [*exe, "check", "--fix", "--quiet", *config, *paths],
        cwd=out,
        capture_output=True,
    )
    subprocess.run(
        [*exe, "format", "--quiet", *config, *paths], cwd=out, capture_output=True
    )
    done = subprocess.run(
        [*exe, "check", "--quiet", "--output-format", "concise", *config, *paths],
        cwd=out,
        capture_output=True,
        text=True,
    )
    return [line for line in done.stdout.splitlines() if line.strip()]


def apply_edits(out: Path, edits: Iterable[Edit]) -> list[str]:
    """Run edits on the tree; the changed paths."""
    changed: list[str] = []
    for edit in edits:
        path = out / edit.path
        where = f"{edit.path} ({edit.patch})"
        module = anchors.parse(path.read_text(encoding="utf-8"), where)
        path.write_text(edit.apply(module, where).code, encoding="utf-8")
        changed.append(edit.path)
    return changed


def add_files(
    out: Path, files: dict[str, str], replaces: Iterable[str] = ()
) -> list[str]:
    """Write new files; refuses to overwrite one the tree has, but for
    ``replaces`` (files an earlier commit of the series wrote), which must
    exist."""
    replaces = set(replaces)
    for rel, text in files.items():
        path = out / rel
        if path.exists() != (rel in replaces):
            raise ExportError(
                f"{rel}: the export would overwrite an upstream file"
                if path.exists()
                else f"{rel}: no earlier commit wrote it, nothing to replace"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return list(files)


def tether(out: Path, commit: Commit) -> list[str]:
    """Add the commit's tests to its Buildkite job; the changed yaml file."""
    if commit.ci_job is None:
        return []
    key_line = f"key: {commit.ci_job}"
    files = [
        path
        for path in sorted((out / ".buildkite").rglob("*.yaml"))
        if any(line.strip() == key_line for line in path.read_text().splitlines())
    ]
    if len(files) != 1:
        raise ExportError(
            f"Buildkite job {commit.ci_job}: defined in {len(files)} files, "
            "expected one"
        )
    rel = files[0].relative_to(out).as_posix()
    text = add_job_command(
        files[0].read_text(), commit.ci_job, commit.ci_command(), rel
    )
    files[0].write_text(text)
    return [rel]


def project_root() -> Path:
    """The project checkout the export relocates modules and tests from."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "tests").is_dir() or not (root / "pyproject.toml").is_file():
        raise ExportError(
            f"{root} is not a vllm-disagg source checkout (no tests/): the export "
            "relocates the project's tests too; run it from a checkout"
        )
    return root


def relocate_slice(out: Path, name: str) -> list[str]:
    """Add a relocation slice's files; declare its env vars in vllm/envs.py."""
    from vllm_disagg.export.relocate import add_env_vars, relocate

    moved = relocate(project_root(), name, ruff_config=out / "pyproject.toml")
    changed = add_files(out, moved.files, moved.replaces)
    if moved.env_vars:
        envs = out / "vllm" / "envs.py"
        envs.write_text(add_env_vars(envs.read_text(encoding="utf-8"), moved.env_vars))
        changed.append("vllm/envs.py")
    return changed


def upstream_tests(commit: Commit) -> dict[str, str]:
    files = {}
    for rel in commit.tests:
        text = (UPSTREAM_TESTS / rel).read_text(encoding="utf-8")
        files[rel] = text if text.startswith(SPDX) else SPDX + text
    return files


def build(
    source: Source, out: Path, identity: Identity, commits: Iterable[Commit] = SERIES
):
    """Unpack, commit the pinned tree, then one commit per series entry."""
    patches_dir = out.with_name(out.name + "-patches")
    if patches_dir.exists():
        raise ExportError(f"{patches_dir} exists; move it away or choose another --out")
    # Built beside the target and renamed at the end: a failed export leaves
    # nothing a second run would have to be told to remove.
    final_out, final_patches = out, patches_dir
    out = out.with_name(f".{out.name}.partial-{os.getpid()}")
    patches_dir = out.with_name(out.name + "-patches")
    try:
        result = _build(source, out, patches_dir, identity, commits)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(patches_dir, ignore_errors=True)
        raise
    os.replace(out, final_out)
    os.replace(patches_dir, final_patches)
    result.out, result.patches_dir = final_out, final_patches
    return result


def _build(source, out, patches_dir, identity, commits) -> Result:
    from vllm_disagg.export.describe import commit_message, description

    unpack(source, out)
    git(out, "init", "--quiet", "--initial-branch", BRANCH)
    git(out, "add", "--all", "--force")
    git(
        out,
        "commit",
        "--quiet",
        "--no-verify",
        "-m",
        f"vLLM {source.version} as released ({source.describe()})",
        identity=identity,
    )
    base = git(out, "rev-parse", "HEAD").strip()
    result = Result(out, patches_dir)
    by_patch: dict[str, list[Edit]] = {}
    for edit in EDITS:
        by_patch.setdefault(edit.patch, []).append(edit)
    for commit in commits:
        edits = [
            edit
            for name in commit.patches
            for edit in by_patch.get(name, [])
            if commit.carries(edit)
        ]
        changed = apply_edits(out, edits) + add_files(out, upstream_tests(commit))
        if commit.relocate is not None:
            changed += relocate_slice(out, commit.relocate)
        changed += tether(out, commit)
        findings = ruff(out, [p for p in changed if p.endswith(".py")])
        if findings:
            raise ExportError(
                f"commit {commit.slug!r}: ruff finds {len(findings)} problem(s) it "
                f"cannot fix, first: {findings[0]}"
            )
        if failures := run_hooks(out, changed):
            raise ExportError(f"commit {commit.slug!r}: upstream hook {failures[0]}")
        git(out, "add", "--all", "--", *changed)
        message = commit_message(commit, edits)
        git(
            out,
            "commit",
            "--quiet",
            "--no-verify",
            "--signoff",
            "-m",
            message,
            identity=identity,
        )
        result.commits.append((commit, git(out, "rev-parse", "HEAD").strip(), changed))
    patches_dir.mkdir(parents=True)
    git(out, "format-patch", "--quiet", "-o", str(patches_dir), f"{base}..HEAD")
    for number, (commit, _sha, changed) in enumerate(result.commits, start=1):
        text = description(commit, [e for e in EDITS if commit.carries(e)], changed)
        (patches_dir / f"{number:04d}-{commit.slug}.pr.md").write_text(
            text, encoding="utf-8"
        )
    return result
