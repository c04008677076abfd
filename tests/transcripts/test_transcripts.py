"""Protocol transcripts: every ``<core>/*.txt`` here replayed against the real
core (vllm_disagg/testing/transcripts.py says the format and the commands).

A mismatch shows the unified diff from the file to what the core does now;
``pytest tests/transcripts --rewrite-transcripts`` writes that back instead,
to be reviewed as a diff like any other change.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from vllm_disagg.testing.transcripts import DRIVERS, TranscriptError, run_transcript

HERE = Path(__file__).parent
FILES = sorted(HERE.glob("*/*.txt"))


def test_every_transcript_directory_has_a_driver_and_files():
    assert {p.parent.name for p in FILES} == set(DRIVERS)


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_transcript(path: Path, request):
    expected = path.read_text()
    actual = run_transcript(expected, DRIVERS[path.parent.name]())
    if actual == expected:
        return
    if request.config.getoption("--rewrite-transcripts"):
        path.write_text(actual)
        return
    diff = difflib.unified_diff(
        expected.splitlines(keepends=True),
        actual.splitlines(keepends=True),
        f"{path.relative_to(HERE)} (expected)",
        f"{path.relative_to(HERE)} (the core now)",
    )
    pytest.fail(
        "transcript differs (run pytest tests/transcripts --rewrite-transcripts "
        "to accept it):\n" + "".join(diff),
        pytrace=False,
    )


class _Echo:
    def run(self, cmd):
        return [f"{cmd.name} {' '.join(cmd.args)}"] if cmd.args else []


def test_the_format_keeps_prose_and_rewrites_only_the_output_blocks():
    text = "# note\n\nsay a b\n----\nstale\n\n# empty output\nsay\n----\n"
    assert run_transcript(text, _Echo()) == (
        "# note\n\nsay a b\n----\nsay a b\n\n# empty output\nsay\n----\n"
    )
    again = run_transcript(run_transcript(text, _Echo()), _Echo())
    assert again == run_transcript(text, _Echo())


def test_a_script_error_names_its_line():
    with pytest.raises(TranscriptError, match="line 2: 'tick 1 typo=2'"):
        run_transcript("\ntick 1 typo=2\n----\n", DRIVERS["p2p_send"]())
