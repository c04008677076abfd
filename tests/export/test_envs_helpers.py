"""The secret getters written into vllm/envs.py: one template, run as written."""

from __future__ import annotations

import os

import pytest

from vllm_disagg.export import layout as L
from vllm_disagg.export.envs_helpers import secret_helper


def _load(source: str, name: str):
    namespace: dict = {"os": os}
    exec(compile(source, "<envs.py>", "exec"), namespace)
    return namespace[name]


@pytest.mark.parametrize(
    "var, name",
    [
        ("VLLM_P2P_NCCL_SECRET", "get_p2p_nccl_secret"),
        ("VLLM_DP_SYNC_SECRET", "get_dp_sync_secret"),
    ],
)
def test_generated_getter_reads_variable_then_file(var, name, tmp_path, monkeypatch):
    helper = next(v.helper for v in L.ENV_VARS if v.name == var)
    assert helper.startswith(f"def {name}() -> bytes | None:\n")
    assert "SECRET_VAR" not in helper and "get_secret" not in helper
    get = _load(helper, name)
    monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv(f"{var}_FILE", raising=False)
    assert get() is None
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(b"  from-file\n")
    monkeypatch.setenv(f"{var}_FILE", str(secret_file))
    assert get() == b"from-file"
    monkeypatch.setenv(var, "direct")
    assert get() == b"direct"
    monkeypatch.delenv(var)
    secret_file.write_bytes(b" \n")
    with pytest.raises(ValueError, match=f"{var}_FILE: .* is empty"):
        get()
    monkeypatch.setenv(f"{var}_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=f"{var}_FILE: cannot read"):
        get()


def test_docstring_is_rewrapped_within_ruff_columns():
    source = secret_helper("get_x_secret", "VLLM_X_SECRET", "The X secret")
    assert max(len(line) for line in source.splitlines()) <= 88
    assert '    """The X secret as bytes, or None when unset: VLLM_X_SECRET,' in source
