"""What makes one instance's KV interchangeable with another's.

A prefill and a decode serving the same architecture and tokenizer with
other weights (a fine-tune half-way through a rolling upgrade, a wrong
``--model`` behind the same ``--served-model-name``, other ``--hf-overrides``,
quantization or rope settings) produce KV of the same shape: the layout check
passes, the prompt's token ids match, and a decode that continued on the
other model's KV answered wrong with HTTP 200. The fingerprint covers what
decides the KV's bytes:

* the weights' content: per weight file, its size and a content hash. A
  Hugging Face hub snapshot names each file's blob by its hash (LFS: the
  SHA-256), so those cost nothing; other files are hashed once (SHA-256, about
  1 GB/s on one core) and the hash is cached beside them, or under
  ``~/.cache/vllm/kv_fingerprint`` when the folder is read-only, keyed by path,
  size and modification time;
* the model config as vLLM resolved it (``hf_config`` with ``--hf-overrides``),
  the tokenizer's files, dtype, KV-cache dtype, quantization, block size,
  layer count, KV heads and head size, the TP/PP layout;
* the connector's protocol version.

It goes into the P2P ``Hello`` (an incompatible channel is refused at once,
both values logged by the refusing side) and into every prompt digest
(:func:`~.protocol.prompt_digest`), so KV computed under another fingerprint
is refused even from an allowed peer, and the request recomputed.
Not covered: weights changed in place without their size or modification
time changing (the cache would be stale: delete it), and what a model's code
does differently with identical weights and config (another vLLM version).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_disagg.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

FINGERPRINT_BYTES = 16
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)
CACHE_NAME = ".vllm_kv_fingerprint.json"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class ModelFingerprint:
    digest: bytes  # FINGERPRINT_BYTES
    parts: dict[str, str]  # what went into it, for the refusal's log line

    @property
    def short(self) -> str:
        return self.digest.hex()[:12]

    def differences(self, other_parts: dict[str, str]) -> list[str]:
        keys = sorted(set(self.parts) | set(other_parts))
        return [k for k in keys if self.parts.get(k) != other_parts.get(k)]


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _hub_blob_hash(path: Path) -> str | None:
    """A hub snapshot's files link to ``blobs/<hash>``: the name is the
    content's hash (SHA-256 for LFS files, the git SHA-1 of small ones)."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    if target.parent.name == "blobs" and len(target.name) in (40, 64):
        return target.name
    return None


def _cache_path(folder: Path) -> Path:
    if os.access(folder, os.W_OK):
        return folder / CACHE_NAME
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:32]
    return Path.home() / ".cache" / "vllm" / "kv_fingerprint" / f"{key}.json"


def weight_hashes(folder: Path) -> dict[str, str]:
    """``file name -> "size:hash"`` of every weight file in ``folder``."""
    files = sorted(
        p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
    )
    cache_file = _cache_path(folder)
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    out: dict[str, str] = {}
    hashed = 0
    started = time.monotonic()
    for path in files:
        st = path.stat()
        blob = _hub_blob_hash(path)
        if blob is not None:
            out[path.name] = f"{st.st_size}:{blob}"
            continue
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        entry = cache.get(path.name)
        if isinstance(entry, dict) and entry.get("stamp") == stamp:
            digest = entry.get("sha256", "")
        else:
            digest = _file_sha256(path)
            hashed += st.st_size
            cache[path.name] = {"stamp": stamp, "sha256": digest}
        out[path.name] = f"{st.st_size}:{digest}"
    if hashed:
        took = time.monotonic() - started
        logger.info(
            "hashed %.2f GB of weights in %.1f s for the model fingerprint "
            "(cached in %s)",
            hashed / 1e9,
            took,
            cache_file,
        )
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
            os.replace(tmp, cache_file)
        except OSError as e:
            logger.warning("cannot cache weight hashes in %s: %s", cache_file, e)
    return out


def _model_folder(model: str, revision: str | None) -> Path | None:
    path = Path(model)
    if path.is_dir():
        return path
    try:  # a hub id: the snapshot vLLM downloaded (no network here)
        from vllm.transformers_utils.repo_utils import hf_api

        return Path(
            hf_api().snapshot_download(
                repo_id=model,
                revision=revision,
                local_files_only=True,
                ignore_patterns="*",
            )
        )
    except Exception:  # noqa: BLE001 - any failure: the weights stay uncovered
        return None


def _files_digest(folder: Path | None, names: tuple[str, ...]) -> str:
    if folder is None:
        return ""
    h = hashlib.sha256()
    for name in names:
        p = folder / name
        if p.is_file():
            h.update(name.encode() + b"\0")
            h.update(p.read_bytes())
    return h.hexdigest()[:32]


def _digest_of(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def describe(vllm_config: VllmConfig) -> dict[str, str]:
    """The parts of the fingerprint, each a short string."""
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
        PROTOCOL_VERSION,
    )

    mc = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    folder = _model_folder(mc.model, mc.revision)
    weights = weight_hashes(folder) if folder is not None else {}
    tokenizer_folder = _model_folder(mc.tokenizer, mc.tokenizer_revision)
    try:
        hf_config = mc.hf_config.to_dict()
    except Exception:  # noqa: BLE001
        hf_config = repr(mc.hf_config)
    for volatile in ("_name_or_path", "transformers_version"):
        if isinstance(hf_config, dict):
            hf_config.pop(volatile, None)
    return {
        "protocol": str(PROTOCOL_VERSION),
        "weights": _digest_of(weights) if weights else f"unhashed:{mc.model}",
        "config": _digest_of(hf_config),
        "tokenizer": _files_digest(tokenizer_folder, TOKENIZER_FILES),
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cache.cache_dtype),
        "quantization": str(mc.quantization),
        "block_size": str(cache.block_size),
        "layers": str(mc.get_num_layers(parallel)),
        "kv_heads": str(mc.get_num_kv_heads(parallel)),
        "head_size": str(mc.get_head_size()),
        "tp_pp": f"{parallel.tensor_parallel_size}x{parallel.pipeline_parallel_size}",
    }


def fingerprint_of(parts: dict[str, str]) -> ModelFingerprint:
    text = json.dumps(parts, sort_keys=True)
    digest = hashlib.sha256(b"vllm-kv-model-v1" + text.encode()).digest()
    return ModelFingerprint(digest[:FINGERPRINT_BYTES], dict(parts))


def model_fingerprint(vllm_config: VllmConfig) -> ModelFingerprint:
    fp = fingerprint_of(describe(vllm_config))
    logger.info("model fingerprint %s (%s)", fp.short, _summary(fp.parts))
    return fp


def _summary(parts: dict[str, str]) -> str:
    return ", ".join(f"{k}={v[:12]}" for k, v in sorted(parts.items()))
