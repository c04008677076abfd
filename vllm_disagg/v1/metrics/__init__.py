"""Small JSON files engine cores leave for another process to read: written
atomically (rename), read tolerating half-written or foreign files."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path


def write_json_atomically(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def read_json_files(directory: str | os.PathLike, pattern: str) -> Iterator[dict]:
    for path in sorted(Path(directory).glob(pattern)):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            yield doc


__all__ = ["read_json_files", "write_json_atomically"]
