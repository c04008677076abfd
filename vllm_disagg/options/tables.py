"""The docs' tables of options, rendered from the rows between two markers,
so a page's table cannot drift from the options it describes."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_disagg.options.rows import Option

Column = tuple[str, Callable[[Option], str]]  # header, cell of one row


def shown_default(option: Option) -> str:
    """The default as the docs show it."""
    if option.shown_default:
        return option.shown_default
    value = option.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    return f"{value:g}" if isinstance(value, float) else str(value)


KEY_COLUMNS: tuple[Column, ...] = (
    ("key", lambda o: f"`{o.key}`"),
    ("type", lambda o: o.type),
    ("default", shown_default),
    ("meaning", lambda o: o.help),
    ("refused", lambda o: o.refused),
)


def markdown_table(options: Iterable[Option], columns: Sequence[Column]) -> str:
    """One Markdown row per option."""
    rows = [
        "| " + " | ".join(header for header, _ in columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
    ]
    for option in options:
        rows.append("| " + " | ".join(cell(option) for _, cell in columns) + " |")
    return "\n".join(rows)


@dataclass(frozen=True)
class DocTable:
    """A generated table in a docs page, between ``begin`` and ``end``."""

    begin: str
    end: str
    render: Callable[[], str]

    def current(self, text: str) -> str:
        """The table the text holds now."""
        start, stop = text.index(self.begin) + len(self.begin), text.index(self.end)
        return text[start:stop].strip("\n")

    def update(self, path: str | Path) -> bool:
        """Rewrite the table between the markers; returns whether it changed."""
        path = Path(path)
        text = path.read_text()
        start, stop = text.index(self.begin) + len(self.begin), text.index(self.end)
        new = f"{text[:start]}\n{self.render()}\n{text[stop:]}"
        if new != text:
            path.write_text(new)
        return new != text


def markers(name: str, source: str) -> tuple[str, str]:
    """The begin and end comments of a generated table."""
    return (
        f"<!-- BEGIN {name} table: generated from {source}; do not edit by hand -->",
        f"<!-- END {name} table -->",
    )
