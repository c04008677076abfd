"""Build tiny random-weight checkpoints that ``vllm serve`` loads offline.

``python -m vllm_disagg.testing.tiny_models OUTDIR`` writes two models:

* ``OUTDIR/tiny-llama``: dense Llama.
* ``OUTDIR/tiny-mixtral``: Mixtral MoE (4 experts, top-2), the model that
  needs collectives across DP ranks.

Both have hidden size 128, 2 attention heads and 1 KV head, so head_dim is 64
(the CPU attention kernel rejects 16), bf16 weights, and share a byte-level
BPE tokenizer trained on the small corpus below. Building is deterministic:
the same seed gives byte-identical files, so tests and benchmarks on two
machines use the same model.

The weights are drawn with a larger spread than a real initializer so that
logits are peaked: greedy decoding then does not hinge on near-ties, which
keeps "same token ids" comparisons meaningful.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

CORPUS = """\
The quick brown fox jumps over the lazy dog.
Data parallel engines step together so that collectives never wait forever.
Prefill instances compute the key value cache and send it to decode instances.
A proxy chooses one prefill and one decode instance for every request.
Small models make fast tests, and fast tests run on every commit.
The coordinator grants steps; every participant runs exactly as many forward passes.
Tensors move by block, by block id, over the registered cache.
Once upon a time there was a tiny model that answered every prompt with care.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 and 2026 appear in text too.
Questions? Answers! Lists: one, two, three; code: x = y + 1.
"""

SEED = 20261122
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
HIDDEN = 128
HEADS = 2
KV_HEADS = 1
HEAD_DIM = 64
LAYERS = 2
INTERMEDIATE = 256
NUM_EXPERTS = 4
MAX_POSITIONS = 2048
WEIGHT_STD = 0.25

MODEL_NAMES = ("tiny-llama", "tiny-mixtral")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def build_tokenizer(outdir: Path) -> Path:
    """The tiny models' byte-level BPE tokenizer, written to ``outdir``;
    returns its ``tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tokenizer.save(str(outdir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        # A plain "role: content" template, so /v1/chat/completions works
        # (transformers has no default template any more).
        "chat_template": CHAT_TEMPLATE,
    }
    (outdir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return outdir / "tokenizer.json"


def _shape(**overrides: int) -> dict[str, int]:
    """The model's dimensions: the module constants, with ``overrides``."""
    shape = dict(
        layers=LAYERS,
        heads=HEADS,
        kv_heads=KV_HEADS,
        hidden=HIDDEN,
        intermediate=INTERMEDIATE,
    )
    unknown = set(overrides) - set(shape)
    if unknown:
        raise TypeError(f"unknown model dimensions: {sorted(unknown)}")
    shape.update(overrides)
    return shape


def _config(kind: str, vocab_size: int, bos_id: int, eos_id: int, **dims: int):
    from transformers import LlamaConfig, MixtralConfig

    d = _shape(**dims)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=d["hidden"],
        intermediate_size=d["intermediate"],
        num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"],
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    if kind == "tiny-llama":
        return LlamaConfig(**common)
    return MixtralConfig(num_local_experts=NUM_EXPERTS, num_experts_per_tok=2, **common)


ARCHITECTURES = {"tiny-llama": "LlamaForCausalLM", "tiny-mixtral": "MixtralForCausalLM"}


def checkpoint_shapes(
    kind: str, vocab_size: int, head_dim: int, **dims: int
) -> list[tuple[str, tuple]]:
    """Tensor names and shapes in the original Hugging Face checkpoint format.

    Written out by hand rather than taken from a transformers model, whose
    in-memory names change between releases (transformers 5 fuses experts).
    ``dims`` (layers, heads, kv_heads, hidden, intermediate) override the
    module's constants.
    """
    d = _shape(**dims)
    hidden, inter, heads, kv_heads = (
        d["hidden"],
        d["intermediate"],
        d["heads"],
        d["kv_heads"],
    )
    shapes = [("model.embed_tokens.weight", (vocab_size, hidden))]
    for i in range(d["layers"]):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
            (f"{p}.self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, heads * head_dim)),
        ]
        if kind == "tiny-llama":
            shapes += [
                (f"{p}.mlp.gate_proj.weight", (inter, hidden)),
                (f"{p}.mlp.up_proj.weight", (inter, hidden)),
                (f"{p}.mlp.down_proj.weight", (hidden, inter)),
            ]
        else:
            shapes.append((f"{p}.block_sparse_moe.gate.weight", (NUM_EXPERTS, hidden)))
            for e in range(NUM_EXPERTS):
                q = f"{p}.block_sparse_moe.experts.{e}"
                shapes += [
                    (f"{q}.w1.weight", (inter, hidden)),
                    (f"{q}.w2.weight", (hidden, inter)),
                    (f"{q}.w3.weight", (inter, hidden)),
                ]
    shapes += [
        ("model.norm.weight", (hidden,)),
        ("lm_head.weight", (vocab_size, hidden)),
    ]
    return shapes


def build_model(
    kind: str,
    outdir: Path,
    head_dim: int = HEAD_DIM,
    *,
    seed: int = SEED,
    name: str | None = None,
    **dims: int,
) -> Path:
    """Write one tiny model (``kind`` in MODEL_NAMES) into ``outdir/kind``
    (``outdir/name`` with ``name``). Another ``seed`` gives the same
    architecture and tokenizer with other weights (a "fine-tune").

    ``dims`` (``layers``, ``heads``, ``kv_heads``, ``hidden``,
    ``intermediate``) override the module's constants, for larger models
    (benchmarks that need megabytes of KV per request); the defaults are the
    tiny models above."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    target = outdir / (name or kind)
    target.mkdir(parents=True, exist_ok=True)
    build_tokenizer(target)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    config = _config(
        kind,
        tokenizer.get_vocab_size(),
        tokenizer.token_to_id("<s>"),
        tokenizer.token_to_id("</s>"),
        **dims,
    )
    config.head_dim = head_dim

    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in checkpoint_shapes(kind, config.vocab_size, head_dim, **dims):
        if name.endswith("norm.weight"):
            value = torch.ones(shape)
        else:
            value = torch.randn(shape, generator=generator) * WEIGHT_STD
        state[name] = value.to(torch.bfloat16).contiguous()
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})

    config_dict = config.to_dict()
    config_dict.pop("transformers_version", None)
    config_dict["architectures"] = [ARCHITECTURES[kind]]
    (target / "config.json").write_text(
        json.dumps(config_dict, indent=2, sort_keys=True) + "\n"
    )
    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
    }
    (target / "generation_config.json").write_text(
        json.dumps(generation, indent=2) + "\n"
    )
    return target


def build_all(outdir: str | os.PathLike) -> dict[str, Path]:
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    return {kind: build_model(kind, out) for kind in MODEL_NAMES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "outdir", help="directory to write tiny-llama/ and tiny-mixtral/ into"
    )
    args = parser.parse_args(argv)
    for kind, path in build_all(args.outdir).items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
