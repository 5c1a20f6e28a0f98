"""Model shapes for the supported families (Qwen3, Llama-3.1, Qwen2.5) as one frozen dataclass.

Why a separate, pure-python module: the Megatron model builder, the HF<->Megatron converter, the resharder and the
rollout engine all need the same numbers (heads, KV groups, head_dim, FFN size, vocab, rope) and must never disagree.
Presets carry the published HF config.json values so nothing has to be downloaded; any HF config.json (or a model
directory holding one) is accepted as well.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

FAMILIES = ("qwen3", "llama", "qwen2")

_ARCHITECTURE = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_MODEL_TYPE_TO_FAMILY = {"qwen3": "qwen3", "llama": "llama", "qwen2": "qwen2"}


@dataclass(frozen=True)
class ModelShape:
    """Architecture numbers of a dense decoder-only model (HF config.json semantics).

    rope_scaling uses the HF legacy dict form (e.g. Llama-3.1's {"rope_type": "llama3", "factor": 8.0, ...});
    it is None for plain RoPE. qkv_bias is True for Qwen2 (q/k/v projections carry a bias, o_proj does not).
    """

    name: str
    family: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Extra HF keys kept verbatim so a config.json round trip does not lose them (not used by our code).
    extra_hf: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model {self.name!r}: family {self.family!r} not in {FAMILIES}")
        for key in ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
                    "ffn_hidden_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model {self.name!r}: {key} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name!r}: num_attention_heads {self.num_attention_heads} is not a multiple "
                             f"of num_kv_heads {self.num_kv_heads}")

    def __hash__(self) -> int:  # rope_scaling is a dict; hash on the identifying numbers only
        return hash((self.name, self.family, self.hidden_size, self.num_layers, self.num_attention_heads,
                     self.num_kv_heads, self.head_dim, self.ffn_hidden_size, self.vocab_size))

    # ---- derived sizes (HF layout) ----
    @property
    def heads_per_group(self) -> int:
        """Query heads per KV group (p = nh / ng)."""
        return self.num_attention_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    def with_name(self, name: str) -> ModelShape:
        return replace(self, name=name)

    # ---- HF config.json conversion ----
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str | None = None) -> ModelShape:
        """Build from an HF config dict (config.json contents or a transformers config's to_dict()).

        Accepts both the legacy rope keys (rope_theta + rope_scaling) and transformers-5 `rope_parameters`.
        """
        model_type = cfg.get("model_type")
        family = _MODEL_TYPE_TO_FAMILY.get(model_type)
        if family is None:
            archs = cfg.get("architectures") or []
            for fam, arch in _ARCHITECTURE.items():
                if arch in archs:
                    family = fam
        if family is None:
            raise ValueError(f"unsupported HF config: model_type={model_type!r} "
                             f"architectures={cfg.get('architectures')!r}; "
                             f"supported model_type values: {sorted(_MODEL_TYPE_TO_FAMILY)}")
        try:
            hidden = int(cfg["hidden_size"])
            nh = int(cfg["num_attention_heads"])
            num_layers = int(cfg["num_hidden_layers"])
            ffn = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as err:
            raise ValueError(f"HF config is missing required key {err.args[0]!r}") from None
        ng = int(cfg.get("num_key_value_heads") or nh)
        head_dim = cfg.get("head_dim")
        head_dim = int(head_dim) if head_dim else hidden // nh
        rope_theta, rope_scaling = _rope_from_hf(cfg)
        if family == "qwen2":
            qkv_bias = True  # Qwen2 attention always has q/k/v bias
        else:
            qkv_bias = bool(cfg.get("attention_bias", False))
        known = {"model_type", "architectures", "hidden_size", "num_attention_heads", "num_hidden_layers",
                 "intermediate_size", "vocab_size", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
                 "rope_parameters", "attention_bias", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
                 "bos_token_id", "eos_token_id", "torch_dtype", "dtype", "quantization_config", "hidden_act",
                 "transformers_version", "_name_or_path"}
        extra = {k: v for k, v in cfg.items() if k not in known and _is_plain_json(v)}
        return cls(
            name=name or str(cfg.get("_name_or_path") or model_type),
            family=family,
            hidden_size=hidden,
            num_layers=num_layers,
            num_attention_heads=nh,
            num_kv_heads=ng,
            head_dim=head_dim,
            ffn_hidden_size=ffn,
            vocab_size=vocab,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=(family == "qwen3"),
            qkv_bias=qkv_bias,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            extra_hf=extra,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict for transformers (Qwen3Config/LlamaConfig/Qwen2Config) and vLLM.

        Written in the published (legacy) rope form: rope_theta + rope_scaling, which both transformers 5
        (converted to rope_parameters on load) and vLLM read.
        """
        if self.family == "qwen2" and self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(f"model {self.name!r}: Qwen2 has no head_dim key; needs head_dim*heads == hidden "
                             f"({self.head_dim}*{self.num_attention_heads} != {self.hidden_size})")
        if self.family == "qwen3" and not self.qk_norm:
            raise ValueError(f"model {self.name!r}: the qwen3 family always has q/k norm")
        if self.family == "llama" and self.qk_norm:
            raise ValueError(f"model {self.name!r}: the llama family has no q/k norm")
        if self.family == "qwen2" and not self.qkv_bias:
            raise ValueError(f"model {self.name!r}: the qwen2 family always has q/k/v bias")
        cfg: dict[str, Any] = dict(self.extra_hf)
        cfg.update({
            "architectures": [_ARCHITECTURE[self.family]],
            "model_type": self.family,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
            "use_cache": True,
        })
        if self.family != "qwen2":
            cfg["head_dim"] = self.head_dim
            cfg["attention_bias"] = self.qkv_bias
        if self.family == "llama":
            cfg.setdefault("mlp_bias", False)
        else:
            cfg.setdefault("use_sliding_window", False)
            cfg.setdefault("sliding_window", None)
            cfg.setdefault("max_window_layers", self.num_layers)
        if self.bos_token_id is not None:
            cfg["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            cfg["eos_token_id"] = self.eos_token_id
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra_hf")
        return d


def _is_plain_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling-or-None) from legacy keys or transformers-5 rope_parameters."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type"}:
            return theta, None
        return theta, scaling
    theta = float(cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type", "rope_theta"}:
            return theta, None
        scaling.pop("rope_theta", None)
        return theta, scaling
    return theta, None


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _qwen3(name: str, hidden: int, layers: int, heads: int, ffn: int, tied: bool) -> ModelShape:
    # Published Qwen/Qwen3-* config.json: 8 KV heads, head_dim 128, rope_theta 1e6, 40960 positions.
    return ModelShape(name=name, family="qwen3", hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                      num_kv_heads=8, head_dim=128, ffn_hidden_size=ffn, vocab_size=151936, rms_norm_eps=1e-6,
                      rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=tied, qk_norm=True,
                      qkv_bias=False, max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645)


PRESETS: dict[str, ModelShape] = {
    "qwen3-0.6b": _qwen3("qwen3-0.6b", 1024, 28, 16, 3072, True),
    "qwen3-1.7b": _qwen3("qwen3-1.7b", 2048, 28, 16, 6144, True),
    "qwen3-4b": _qwen3("qwen3-4b", 2560, 36, 32, 9728, True),
    "qwen3-8b": _qwen3("qwen3-8b", 4096, 36, 32, 12288, False),
    "qwen3-14b": _qwen3("qwen3-14b", 5120, 40, 40, 17408, False),
    "qwen3-32b": _qwen3("qwen3-32b", 5120, 64, 64, 25600, False),
    "llama3.1-8b": ModelShape(
        name="llama3.1-8b", family="llama", hidden_size=4096, num_layers=32, num_attention_heads=32, num_kv_heads=8,
        head_dim=128, ffn_hidden_size=14336, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE), tie_word_embeddings=False, qk_norm=False, qkv_bias=False,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001),
    "qwen2.5-7b": ModelShape(
        name="qwen2.5-7b", family="qwen2", hidden_size=3584, num_layers=28, num_attention_heads=28, num_kv_heads=4,
        head_dim=128, ffn_hidden_size=18944, vocab_size=152064, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=None, tie_word_embeddings=False, qk_norm=False, qkv_bias=True, max_position_embeddings=131072,
        bos_token_id=151643, eos_token_id=151643),
    # The long-response learning experiment's model (recipes/count_150m_gpu.yaml, docs/rl.md): the Qwen3 layout
    # (QK-norm, GQA, head_dim 128, untied embeddings), 151M parameters, the character tokenizer's 128-token vocabulary.
    "qwen3-150m-char": ModelShape(
        name="qwen3-150m-char", family="qwen3", hidden_size=1024, num_layers=12, num_attention_heads=8,
        num_kv_heads=4, head_dim=128, ffn_hidden_size=3072, vocab_size=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=None, tie_word_embeddings=False, qk_norm=True, qkv_bias=False, max_position_embeddings=8192),
    # The embedded CPU default / CI model (Qwen3-style).
    "tiny": ModelShape(
        name="tiny", family="qwen3", hidden_size=256, num_layers=4, num_attention_heads=4, num_kv_heads=2,
        head_dim=128, ffn_hidden_size=768, vocab_size=128, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        tie_word_embeddings=False, qk_norm=True, qkv_bias=False, max_position_embeddings=512),
}

# Accepted spellings of preset names (HF repo ids map onto presets).
_ALIASES = {
    "qwen/qwen3-0.6b": "qwen3-0.6b", "qwen/qwen3-1.7b": "qwen3-1.7b", "qwen/qwen3-4b": "qwen3-4b",
    "qwen/qwen3-8b": "qwen3-8b", "qwen/qwen3-14b": "qwen3-14b", "qwen/qwen3-32b": "qwen3-32b",
    "meta-llama/llama-3.1-8b": "llama3.1-8b", "meta-llama/meta-llama-3.1-8b": "llama3.1-8b",
    "llama-3.1-8b": "llama3.1-8b", "qwen/qwen2.5-7b": "qwen2.5-7b",
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_model_shape(name_or_path: str | os.PathLike) -> ModelShape:
    """Resolve a preset name, a path to an HF config.json, or a model directory containing config.json."""
    text = os.fspath(name_or_path)
    key = text.strip().lower()
    key = _ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
    path = text
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        base = os.path.basename(os.path.dirname(os.path.abspath(path))) or "model"
        return ModelShape.from_hf_config(cfg, name=base)
    raise ValueError(f"unknown model {text!r}: not a preset and not a config.json / model directory. "
                     f"Presets: {', '.join(PRESETS)}")
