"""vllm_disagg.envs is the one table of environment variables: every
``VLLM_DISAGG_*`` name the repository uses is declared there, and Python code
outside it names them only through its constants."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from vllm_disagg import envs

ROOT = Path(__file__).resolve().parents[1]
SEARCHED = ("vllm_disagg", "benchmarks", "tests", "scripts", "docs", "examples")
NAME = re.compile(r"\bVLLM_DISAGG_[A-Z0-9_]*[A-Z0-9]\b")


def _files(*suffixes: str) -> list[Path]:
    files = [ROOT / "README.md"] if ".md" in suffixes else []
    for top in SEARCHED:
        for path in sorted((ROOT / top).rglob("*")):
            if (
                path.suffix in suffixes
                and path.is_file()
                and "results" not in path.parts
            ):
                files.append(path)
    return files


ENVS_PY = ROOT / "vllm_disagg" / "envs.py"


def _uses() -> dict[str, set[str]]:
    """{name: files} for every name outside envs.py itself."""
    found: dict[str, set[str]] = {}
    for path in _files(".py", ".sh", ".md"):
        if path == ENVS_PY:
            continue
        for name in NAME.findall(path.read_text(errors="replace")):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_name_used_is_declared():
    undeclared = {
        name: files for name, files in _uses().items() if name not in envs.VARIABLES
    }
    assert not undeclared, (
        f"declare these in vllm_disagg/envs.py (VARIABLES): {undeclared}"
    )


def test_every_declared_name_is_used_and_explained():
    used = _uses()
    for name, var in envs.VARIABLES.items():
        assert var.name == name and getattr(envs, name) == name
        assert var.default and len(var.meaning) > 20, name
        assert name in used, f"{name} is declared in envs.py but used nowhere else"


def _bare_names(path: Path) -> list[str]:
    """Spots where Python code spells a variable itself: a string literal
    that is exactly the name, or a bare identifier (a keyword argument such
    as ``env(VLLM_DISAGG_PROBE="1")``). Text that mentions a name is fine."""
    found, previous = [], None
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):  # f-strings
                value = None
            if isinstance(value, str) and NAME.fullmatch(value):
                found.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {tok.string}")
        elif tok.type == tokenize.NAME and NAME.fullmatch(tok.string):
            if previous is None or previous.string != ".":
                found.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {tok.string}")
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            previous = tok
    return found


def test_python_code_names_variables_only_through_envs():
    spelled = [
        hit for path in _files(".py") if path != ENVS_PY for hit in _bare_names(path)
    ]
    assert not spelled, (
        "use the constants and accessors of vllm_disagg.envs instead:\n"
        + "\n".join(spelled)
    )


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, False),
        ("", False),
        ("0", False),
        ("no", False),
        ("1", True),
        (" TRUE ", True),
        ("yes", True),
        ("on", True),
    ],
)
def test_switches(monkeypatch, value, expected):
    for name, accessor in (
        (envs.VLLM_DISAGG_DISABLE, envs.features_disabled),
        (envs.VLLM_DISAGG_PROBE, envs.probes_enabled),
    ):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        assert accessor() is expected, (name, value)


def test_metrics_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(envs.VLLM_DISAGG_METRICS_DIR, raising=False)
    assert envs.metrics_dir() is None
    monkeypatch.setenv(envs.VLLM_DISAGG_METRICS_DIR, "")
    assert envs.metrics_dir() is None
    envs.set_metrics_dir(tmp_path)
    assert envs.metrics_dir() == str(tmp_path)
