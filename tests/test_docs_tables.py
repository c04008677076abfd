"""Every docs table of options is the one the option rows render.

After changing an option run ``python -m vllm_disagg.docs_tables``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_disagg.docs_tables import DOC_TABLES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted(DOC_TABLES))
def test_docs_table_is_rendered_from_the_rows(path):
    table = DOC_TABLES[path]
    assert table.current((ROOT / path).read_text()) == table.render(), (
        f"{path} is stale: run python -m vllm_disagg.docs_tables"
    )


def test_a_stale_table_is_rewritten_and_nothing_else(tmp_path):
    table = DOC_TABLES["docs/router.md"]
    path = tmp_path / "doc.md"
    path.write_text(f"intro\n\n{table.begin}\n| old |\n{table.end}\n\nafter\n")
    assert table.update(path) is True
    text = path.read_text()
    assert text.startswith(f"intro\n\n{table.begin}\n| flag |")
    assert text.endswith(f"{table.end}\n\nafter\n")
    assert table.update(path) is False
