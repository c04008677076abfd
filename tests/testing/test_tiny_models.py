import filecmp
import json

from vllm_disagg.testing.tiny_models import HEAD_DIM, MODEL_NAMES, build_all


def _all_files(root):
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def test_builder_is_deterministic(tmp_path):
    first = build_all(tmp_path / "a")
    second = build_all(tmp_path / "b")
    assert set(first) == set(MODEL_NAMES)
    for name in MODEL_NAMES:
        files = _all_files(first[name])
        assert files == _all_files(second[name])
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
            f.name for f in files
        }
        for rel in files:
            assert filecmp.cmp(first[name] / rel, second[name] / rel, shallow=False), (
                rel
            )


def test_models_match_cpu_kernel_constraints(tmp_path):
    paths = build_all(tmp_path)
    llama = json.loads((paths["tiny-llama"] / "config.json").read_text())
    mixtral = json.loads((paths["tiny-mixtral"] / "config.json").read_text())
    for config in (llama, mixtral):
        assert config["head_dim"] == HEAD_DIM == 64
        assert config["dtype"] == "bfloat16"
    assert llama["architectures"] == ["LlamaForCausalLM"]
    assert mixtral["architectures"] == ["MixtralForCausalLM"]
    assert mixtral["num_local_experts"] > mixtral["num_experts_per_tok"] >= 1
