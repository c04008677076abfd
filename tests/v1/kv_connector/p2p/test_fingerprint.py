"""The model fingerprint (fingerprint.py): what makes two instances' KV
interchangeable, and where it is checked (issue 28: a prefill and a decode
with other weights under one name answered wrong with HTTP 200)."""

from __future__ import annotations

import os
import time

import pytest

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import fingerprint as fp
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import SlotState
from vllm_disagg.testing.scheduler import make_vllm_config
from vllm_disagg.testing.tiny_models import build_model

from .test_engine import DIGEST, wait_done


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """The tiny Llama, and the same architecture and tokenizer with other
    weights (another seed: a fine-tune)."""
    out = tmp_path_factory.mktemp("fingerprint-models")
    base = build_model("tiny-llama", out)
    tuned = build_model("tiny-llama", out, seed=7, name="tiny-llama-tuned")
    return base, tuned


def test_other_weights_same_shapes_give_another_fingerprint(llamas):
    base, tuned = llamas
    a = fp.model_fingerprint(make_vllm_config(base, "kv_producer"))
    b = fp.model_fingerprint(make_vllm_config(tuned, "kv_consumer"))
    again = fp.model_fingerprint(make_vllm_config(base, "kv_consumer"))
    assert a.digest == again.digest  # role and ports are not part of it
    assert a.digest != b.digest
    assert a.differences(b.parts) == ["weights"]
    assert len(a.digest) == fp.FINGERPRINT_BYTES


def test_block_size_and_dtype_are_part_of_it(llamas):
    base, _ = llamas
    a = fp.describe(make_vllm_config(base, "kv_producer", block_size=16))
    b = fp.describe(make_vllm_config(base, "kv_producer", block_size=32))
    assert fp.fingerprint_of(a).differences(b) == ["block_size"]


def test_weight_hashes_are_computed_once_and_cached(tmp_path, monkeypatch):
    (tmp_path / "model-00001.safetensors").write_bytes(b"a" * 1000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"b" * 10)
    (tmp_path / "config.json").write_text("{}")  # not a weight file
    calls = []
    real = fp._file_sha256
    monkeypatch.setattr(fp, "_file_sha256", lambda p: calls.append(p.name) or real(p))
    first = fp.weight_hashes(tmp_path)
    assert sorted(first) == ["model-00001.safetensors", "model-00002.safetensors"]
    assert len(calls) == 2 and (tmp_path / fp.CACHE_NAME).is_file()
    assert fp.weight_hashes(tmp_path) == first and len(calls) == 2  # cached
    # Rewritten in place with another size: hashed again, and it differs.
    time.sleep(0.01)
    (tmp_path / "model-00002.safetensors").write_bytes(b"c" * 11)
    changed = fp.weight_hashes(tmp_path)
    assert calls[2:] == ["model-00002.safetensors"]
    assert changed["model-00002.safetensors"] != first["model-00002.safetensors"]


def test_hub_snapshots_cost_no_hashing(tmp_path, monkeypatch):
    """A hub snapshot's weight files link to blobs named by their SHA-256."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    blob = blobs / ("ab" * 32)
    blob.write_bytes(b"weights")
    snap = tmp_path / "snapshots" / "rev"
    snap.mkdir(parents=True)
    os.symlink(blob, snap / "model.safetensors")
    monkeypatch.setattr(fp, "_file_sha256", lambda p: pytest.fail("hashed a blob"))
    assert fp.weight_hashes(snap) == {"model.safetensors": f"7:{'ab' * 32}"}


def test_a_read_only_folder_caches_under_the_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "w.safetensors").write_bytes(b"x")
    monkeypatch.setattr(fp.os, "access", lambda path, mode: False)
    fp.weight_hashes(folder)
    assert not (folder / fp.CACHE_NAME).exists()
    assert list((tmp_path / "home" / ".cache" / "vllm" / "kv_fingerprint").iterdir())


def test_a_hello_from_another_model_is_refused_and_the_load_fails_at_once(
    make_engine,
):
    prefill = make_engine("tcp", "PUT")
    decode = make_engine("tcp", "PUT")
    prefill.engine.model_fingerprint = b"\x01" * 16
    decode.engine.model_fingerprint = b"\x02" * 16
    decode.expect(
        "k",
        0,
        time.monotonic() + 60,
        get_from=None,
        prompt_digest=DIGEST,
        prefill_addr=prefill.addr,
    )
    xfer = wait_done(
        prefill.start_send(
            "k", "req-k", decode.addr, [1, 2], all_saved=True, prompt_digest=DIGEST
        )
    )
    assert not xfer.ok and "refused the channel (model;" in xfer.reason, xfer.reason
    deadline = time.monotonic() + 5
    while (slot := decode.poll("k")) is None:
        assert time.monotonic() < deadline, "the decode still waits"
        time.sleep(0.01)
    assert slot.state is SlotState.FAILED
    assert decode.totals()["rejected_messages"] == 1
