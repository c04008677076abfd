"""Print the patch registry: ``python -m vllm_disagg.patches``.

``--markdown`` prints the README's table instead; ``--update-readme [PATH]``
rewrites that table in place (between the :data:`BEGIN` and :data:`END`
markers), so a registry change is one command away from the README.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

from vllm_disagg.patches import PATCHES, Patch

BEGIN = (
    "<!-- BEGIN patch table: generated from vllm_disagg/patches/ by "
    "`python -m vllm_disagg.patches --update-readme`; do not edit by hand -->"
)
END = "<!-- END patch table -->"
UPDATE_COMMAND = ".venv/bin/python -m vllm_disagg.patches --update-readme"


def print_registry(patches: Iterable[Patch] = PATCHES) -> None:
    for patch in patches:
        print(f"{patch.name}  [{patch.kind}]")
        for label, text in (
            ("upstream", patch.upstream),
            ("module", patch.module),
            ("why", patch.why),
            ("how", patch.how),
            ("drop when", patch.drop_when),
            ("in-tree", f"{patch.in_tree.form}: {patch.in_tree.detail}"),
            ("related", patch.related),
            ("also", ", ".join(patch.also_changes) or "-"),
        ):
            body = textwrap.fill(text, width=88, subsequent_indent=" " * 13)
            print(f"  {label:<10} {body}")
        print()


def _code(text: str) -> str:
    """A Markdown code span that survives a table cell."""
    fence = "``" if "`" in text else "`"
    escaped = text.replace("|", "\\|")  # a pipe ends the cell even in code
    return f"{fence}{escaped}{fence}"


def markdown_table(patches: Iterable[Patch] = PATCHES) -> str:
    """The README's table: one row per registry entry, in registry order."""
    rows = [
        "| patch | upstream symbol | kind | in-tree form |",
        "| --- | --- | --- | --- |",
    ]
    rows += [
        f"| {p.name} | {_code(p.upstream)} | {p.kind} | {p.in_tree.form} |"
        for p in patches
    ]
    return "\n".join(rows) + "\n"


def readme_table(text: str) -> str:
    """The generated block of a README: what lies between the markers."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no patch table markers in the README: {BEGIN!r} ... {END!r}")
    return text[start + len(BEGIN) : end].strip("\n") + "\n"


def update_readme(path: Path, patches: Iterable[Patch] = PATCHES) -> bool:
    """Rewrite the table between the markers; True when the file changed."""
    text = path.read_text()
    readme_table(text)  # markers present, in order
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = text[:start] + "\n" + markdown_table(patches) + text[end:]
    if new == text:
        return False
    path.write_text(new)
    return True


def default_readme() -> Path:
    """README.md of the source tree this package runs from (an editable
    install), else of the current directory."""
    beside = Path(__file__).resolve().parents[2] / "README.md"
    return beside if beside.is_file() else Path("README.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_disagg.patches")
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--markdown", action="store_true", help="print the README's table"
    )
    group.add_argument(
        "--update-readme",
        nargs="?",
        const=default_readme(),
        type=Path,
        metavar="PATH",
        help="rewrite the table in PATH (default: the README.md of this source tree)",
    )
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_table())
    elif args.update_readme is not None:
        changed = update_readme(args.update_readme)
        print(f"{args.update_readme}: {'updated' if changed else 'already up to date'}")
    else:
        print_registry()
    return 0


if __name__ == "__main__":
    sys.exit(main())
