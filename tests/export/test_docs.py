"""docs/export.md names the series as it is."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_disagg.export.series import SERIES

DOC = Path(__file__).resolve().parents[2] / "docs" / "export.md"


def test_the_series_table_names_every_commit_in_order():
    rows = re.findall(r"^\| (\d+) \| (.+?) \| \d+ \|", DOC.read_text(), re.MULTILINE)
    assert [(int(n), title) for n, title in rows] == [
        (number, commit.title) for number, commit in enumerate(SERIES, start=1)
    ]
