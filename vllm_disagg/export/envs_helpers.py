"""Functions the export writes into vllm/envs.py, kept as real code.

Both control-plane secrets (the P2P connector's and step-sync DP's) are read
the same way, so one template, :func:`get_secret`, is the source of both: ruff
checks it and the tests run it. :func:`secret_helper` renames it, its variables
and its subject, and wraps its docstring again.
"""

from __future__ import annotations

import inspect
import os
import re
import textwrap

# The template's placeholders: its name, its variable (and ``<var>_FILE``)
# and the subject its docstring starts with.
_NAME = "get_secret"
_VAR = "SECRET_VAR"
_WHAT = "The secret"
_DOCSTRING = re.compile(r'^    """(.*?)"""\n', re.S | re.M)
# The docstring's width in the exported envs.py (fits ruff's 88 columns).
_DOC_WIDTH = 84


def get_secret() -> bytes | None:
    """The secret as bytes, or None when unset: SECRET_VAR, else the contents
    of the file SECRET_VAR_FILE names (surrounding whitespace ignored)."""
    value = os.getenv("SECRET_VAR")
    if value:
        return value.encode()
    path = os.getenv("SECRET_VAR_FILE")
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            secret = f.read(1 << 16).strip()
    except OSError as e:
        raise ValueError(
            f"SECRET_VAR_FILE: cannot read {path!r} ({e.strerror})"
        ) from None
    if not secret:
        raise ValueError(f"SECRET_VAR_FILE: {path!r} is empty")
    return secret


def secret_helper(name: str, var: str, what: str) -> str:
    """Source of :func:`get_secret` as ``name`` reading ``var`` (else the file
    ``<var>_FILE`` names); its docstring starts with ``what``."""
    source = inspect.getsource(get_secret)
    source = source.replace(f"def {_NAME}(", f"def {name}(", 1)
    source = source.replace(_VAR, var)

    def rewrap(match: re.Match[str]) -> str:
        words = " ".join(match.group(1).split())
        if not words.startswith(_WHAT):
            raise ValueError(f"the template's docstring must start {_WHAT!r}")
        text = f'"""{what}{words[len(_WHAT) :]}"""'
        return (
            textwrap.fill(
                text, _DOC_WIDTH, initial_indent="    ", subsequent_indent="    "
            )
            + "\n"
        )

    return _DOCSTRING.sub(rewrap, source, count=1)
