"""The config.json of the models NeMo-RL v0.7.0's dense Megatron GRPO YAMLs name, as published on the Hugging Face
hub (the architecture keys; values as in those files), for hub caches built in tests."""

from __future__ import annotations

from typing import Any

_LLAMA_EOS = [128001, 128008, 128009]


def _llama(hidden: int, ffn: int, layers: int, heads: int, rope_factor: float, tied: bool, **extra: Any) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 128000, "eos_token_id": _LLAMA_EOS, "hidden_act": "silu", "hidden_size": hidden,
            "initializer_range": 0.02, "intermediate_size": ffn, "max_position_embeddings": 131072,
            "mlp_bias": False, "model_type": "llama", "num_attention_heads": heads, "num_hidden_layers": layers,
            "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": rope_factor, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": tied, "torch_dtype": "bfloat16", "use_cache": True,
            "vocab_size": 128256, **extra}


def _qwen2(hidden: int, ffn: int, layers: int, heads: int, kv: int, vocab: int, max_pos: int, tied: bool,
           eos: int) -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
            "eos_token_id": eos, "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02,
            "intermediate_size": ffn, "max_position_embeddings": max_pos, "max_window_layers": 28,
            "model_type": "qwen2", "num_attention_heads": heads, "num_hidden_layers": layers,
            "num_key_value_heads": kv, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
            "tie_word_embeddings": tied, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
            "vocab_size": vocab}


PUBLISHED: dict[str, dict] = {
    "meta-llama/Llama-3.1-8B-Instruct": _llama(4096, 14336, 32, 32, 8.0, False),
    "meta-llama/Llama-3.2-1B-Instruct": _llama(2048, 8192, 16, 32, 32.0, True, head_dim=64),
    "meta-llama/Llama-3.3-70B-Instruct": _llama(8192, 28672, 80, 64, 8.0, False),
    "Qwen/Qwen2.5-1.5B": _qwen2(1536, 8960, 28, 12, 2, 151936, 131072, True, 151643),
    "Qwen/Qwen2.5-7B-Instruct": _qwen2(3584, 18944, 28, 28, 4, 152064, 32768, False, 151645),
    # Hybrid architectures (Mamba-2 + attention; gated delta-net + attention): only the keys that name the
    # architecture, which is all a refusal reads.
    "nvidia/NVIDIA-Nemotron-Nano-12B-v2": {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h"},
    "Qwen/Qwen3.5-9B-Base": {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"},
}
