"""Model presets and HF config conversion (checked against transformers' own config classes)."""

import json

import pytest
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from jetrl_megatron.model.shapes import PRESETS, ModelShape, get_model_shape

_HF_CLASS = {"qwen3": Qwen3Config, "llama": LlamaConfig, "qwen2": Qwen2Config}

# Published Qwen/Qwen3-8B config.json (subset), written out independently of the preset table.
QWEN3_8B_JSON = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def _core(shape: ModelShape) -> dict:
    d = shape.to_dict()
    d.pop("name")
    return d


@pytest.mark.parametrize("name", list(PRESETS))
def test_round_trip_through_hf_dict(name):
    shape = PRESETS[name]
    back = ModelShape.from_hf_config(json.loads(json.dumps(shape.to_hf_config())), name=name)
    assert back == shape


@pytest.mark.parametrize("name", list(PRESETS))
def test_transformers_config_accepts_and_round_trips(name):
    shape = PRESETS[name]
    hf = shape.to_hf_config()
    cls = _HF_CLASS[shape.family]
    cfg = cls(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    # transformers' own view of the numbers
    assert cfg.hidden_size == shape.hidden_size
    assert cfg.num_key_value_heads == shape.num_kv_heads
    assert getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads) == shape.head_dim
    assert cfg.rope_parameters["rope_theta"] == shape.rope_theta
    if shape.rope_scaling:
        assert cfg.rope_parameters["rope_type"] == "llama3"
        assert cfg.rope_parameters["factor"] == shape.rope_scaling["factor"]
    back = ModelShape.from_hf_config(cfg.to_dict(), name=name)
    assert _core(back) == _core(shape)


def test_published_config_matches_preset(tmp_path):
    p = tmp_path / "Qwen3-8B" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(QWEN3_8B_JSON))
    for arg in (p, p.parent):
        s = get_model_shape(arg)
        assert _core(s) == _core(PRESETS["qwen3-8b"])
        assert s.name == "Qwen3-8B"


def test_presets_sanity():
    expect = {  # name: (h, F, nh, ng, L, V, tied)
        "qwen3-0.6b": (1024, 3072, 16, 8, 28, 151936, True), "qwen3-1.7b": (2048, 6144, 16, 8, 28, 151936, True),
        "qwen3-4b": (2560, 9728, 32, 8, 36, 151936, True), "qwen3-8b": (4096, 12288, 32, 8, 36, 151936, False),
        "qwen3-14b": (5120, 17408, 40, 8, 40, 151936, False), "qwen3-32b": (5120, 25600, 64, 8, 64, 151936, False),
        "llama3.1-8b": (4096, 14336, 32, 8, 32, 128256, False), "qwen2.5-7b": (3584, 18944, 28, 4, 28, 152064, False),
        "tiny": (256, 768, 4, 2, 4, 128, False),
    }
    for name, (h, f, nh, ng, L, v, tied) in expect.items():
        s = get_model_shape(name)
        assert (s.hidden_size, s.ffn_hidden_size, s.num_attention_heads, s.num_kv_heads, s.num_layers,
                s.vocab_size, s.tie_word_embeddings) == (h, f, nh, ng, L, v, tied), name
        assert s.head_dim == 128
        assert s.qk_norm == (s.family == "qwen3") and s.qkv_bias == (s.family == "qwen2")
    assert get_model_shape("llama3.1-8b").rope_scaling["rope_type"] == "llama3"
    assert get_model_shape("Qwen/Qwen3-8B") is PRESETS["qwen3-8b"]
    assert get_model_shape("qwen2.5-7b").q_size == 3584


def test_unknown_model_lists_presets():
    with pytest.raises(ValueError, match="qwen3-8b.*llama3.1-8b"):
        get_model_shape("gpt-5")


def test_bad_config_rejected():
    with pytest.raises(ValueError, match="model_type"):
        ModelShape.from_hf_config({"model_type": "gpt2", "hidden_size": 8})
    bad = dict(QWEN3_8B_JSON, num_key_value_heads=5)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelShape.from_hf_config(bad)

