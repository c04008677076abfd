"""One commit of the exported series (its own module so that the modules
holding slices of the series can build commits without an import cycle)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Commit:
    slug: str
    title: str  # upstream's "[Area] Summary" convention
    patches: tuple[str, ...]  # registry entries
    tests: tuple[str, ...]  # upstream paths under export/upstream_tests
    tested: str  # how it was tested, for the description
    unverified: str  # what stays unverified
    summary: str = ""  # a paragraph when one entry's text is not enough
    # The Buildkite job (its key) that runs ``tests``, where no job's paths
    # already cover them (upstream's check-test-tethering hook).
    ci_job: str | None = None
    # The relocation slice (vllm_disagg.export.layout) whose project modules
    # and tests this commit adds at their upstream paths.
    relocate: str | None = None
    # What ci_job runs when it is not ``tests`` (files or directories, e.g.
    # relocated tests besides the written ones).
    ci_tests: tuple[str, ...] = ()
    # Only the edits of these upstream files, where one registry entry's
    # in-tree form is several pull requests (empty: all of its edits).
    edit_paths: tuple[str, ...] = ()

    def carries(self, edit) -> bool:
        """Whether this commit makes ``edit`` (an :class:`Edit`)."""
        return edit.patch in self.patches and (
            not self.edit_paths or edit.path in self.edit_paths
        )

    def ci_command(self) -> str:
        paths = " ".join(
            rel.removeprefix("tests/") for rel in (self.ci_tests or self.tests)
        )
        return f"pytest -v -s -m 'cpu_test' {paths}"
