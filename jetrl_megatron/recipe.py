"""The FP8 precision contract as one frozen dataclass.

Both sides of Jet-RL — the Megatron trainer and the vLLM rollout — read the same `Fp8Recipe`, so the exclusion list,
scale format and block sizes cannot drift apart. It round-trips to the `jet_rl:` section of a recipe YAML and emits the
HF `quantization_config` that vLLM's loader (and our `jetrl_fp8` plugin) reads.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

FP8_MODES = ("bf16", "bf16_train_fp8_rollout", "jetrl", "fake_quant")
# The arms NeMo-RL's two switches select: (trainer FP8 on, rollout precision fp8) -> arm. fake_quant (an ablation)
# has bf16_train_fp8_rollout's switches and is chosen explicitly.
ARM_BY_SWITCHES = {(False, False): "bf16", (False, True): "bf16_train_fp8_rollout", (True, True): "jetrl"}
TRAINER_GEMMS = ("bf16", "fp8", "fake_quant")  # what an FP8-eligible linear of the trainer runs
ROLLOUT_WEIGHTS = ("bf16", "trainer_fp8", "self_quantized")  # what the rollout serves
SCALE_FMTS = ("fp32", "pow2")
# The smallest amax floor: the kernels divide by a scale (>= amax_eps / 448) through its reciprocal
# (fp8/kernels.py `_quotient`), whose E4M3 codes equal IEEE division's for every scale from 1e-20 / 448 up
# (docs/kernels.md); far below it the reciprocal overflows.
AMAX_EPS_MIN = 1e-20
GEMM_BACKENDS = ("auto", "emulated", "cublas", "triton", "deep_gemm")
# Element-wise kernels of the rollout-matched numerics (RMSNorm, RoPE, residual add, SwiGLU): the Triton kernels and
# their torch twins are bit-identical, so this picks speed, not numbers.
ELEMENTWISE_IMPLS = ("auto", "torch", "triton")
# The trainer's attention and non-GEMM numerics (megatron/numerics.py): vLLM's own ops (vllm_cuda on GPU, vllm_cpu on
# CPU: exactly on-policy), or SDPA with the twins / Triton kernels (fp32, bf16, bf16_gqa).
ATTN_IMPLS = ("vllm_cpu", "vllm_cuda", "fp32", "bf16", "bf16_gqa")

# Module-name keywords that are BF16 whatever the recipe says (embeddings, lm_head, norms, attention core).
ALWAYS_BF16_KEYWORDS = ("embed", "lm_head", "output_layer", "norm", "core_attention", "rotary")
# Names of FP8 linear projections on either side (HF/vLLM and Megatron).
FP8_LINEAR_NAMES = (
    "q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj",
    "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
)
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


class RecipeError(ValueError):
    """A recipe key or value is invalid; the message names the key."""


@dataclass(frozen=True)
class Fp8Recipe:
    """Jet-RL's precision flow: E4M3, 128x128 weight blocks, 1x128 activation/gradient groups.

    `mode` selects the experiment arm: `jetrl` (FP8 train + the same FP8 rollout), `bf16` (both BF16),
    `bf16_train_fp8_rollout` (today's industry setup: BF16 trainer, rollout quantizes BF16 weights itself) and
    `fake_quant` (ablation: BF16 GEMMs on quantize-dequantized operands).
    """

    mode: str = "jetrl"
    fmt: str = "e4m3"
    weight_block: tuple[int, int] = (128, 128)
    group_size: int = 128
    scale_fmt: str = "fp32"
    amax_eps: float = 1e-10
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    bf16_module_keywords: tuple[str, ...] = field(default_factory=tuple)
    gemm_backend: str = "auto"
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> RecipeError:
            return RecipeError(f"jet_rl.{key}: {why} (got {getattr(self, key)!r})")

        if self.mode not in FP8_MODES:
            raise bad("mode", f"must be one of {FP8_MODES}")
        if self.fmt != "e4m3":
            raise bad("fmt", "only 'e4m3' is supported (E5M2 gradients are not part of the Jet-RL contract)")
        if tuple(self.weight_block) != (128, 128):
            raise bad("weight_block", "must be [128, 128] (the block shape cuBLAS/DeepGEMM/vLLM consume)")
        if self.group_size != 128:
            raise bad("group_size", "must be 128 (1x128 activation groups)")
        if self.scale_fmt not in SCALE_FMTS:
            raise bad("scale_fmt", f"must be one of {SCALE_FMTS}")
        if not (isinstance(self.amax_eps, float) and AMAX_EPS_MIN <= self.amax_eps < 1e-3):
            raise bad("amax_eps", f"must be a float in [{AMAX_EPS_MIN:g}, 1e-3)")
        for key in ("bf16_first_layers", "bf16_last_layers"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(key, "must be a non-negative integer")
        if not all(isinstance(k, str) and k for k in self.bf16_module_keywords):
            raise bad("bf16_module_keywords", "must be a list of non-empty strings")
        if self.gemm_backend not in GEMM_BACKENDS:
            raise bad("gemm_backend", f"must be one of {GEMM_BACKENDS}")
        if not isinstance(self.batch_invariant, bool):
            raise bad("batch_invariant", "must be true or false")

    # ----------------------------------------------------------------- dict / YAML round trip
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Fp8Recipe:
        """Build from the `jet_rl:` YAML section; unknown keys are an error naming the key."""
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise RecipeError(f"jet_rl: unknown key(s) {unknown}; known keys are {sorted(known)}")
        if "weight_block" in d:
            d["weight_block"] = _as_tuple("weight_block", d["weight_block"])
        if "bf16_module_keywords" in d:
            d["bf16_module_keywords"] = _as_tuple("bf16_module_keywords", d["bf16_module_keywords"] or ())
        if isinstance(d.get("amax_eps"), int) and not isinstance(d.get("amax_eps"), bool):
            d["amax_eps"] = float(d["amax_eps"])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["weight_block"] = list(self.weight_block)
        d["bf16_module_keywords"] = list(self.bf16_module_keywords)
        return d

    def replace(self, **changes: Any) -> Fp8Recipe:
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------- what the arm means (code asks these)
    @property
    def trainer_gemm(self) -> str:
        """The trainer's FP8-eligible linears: ``fp8`` (the FP8 flow, jetrl), ``fake_quant`` (BF16 GEMMs on
        quantize-dequantized operands) or ``bf16``."""
        return {"jetrl": "fp8", "fake_quant": "fake_quant"}.get(self.mode, "bf16")

    @property
    def rollout_weights(self) -> str:
        """What the rollout serves: ``trainer_fp8`` (the trainer's own FP8 bytes and scales), ``self_quantized``
        (the rollout quantizes the BF16 weights it receives) or ``bf16``."""
        return {"jetrl": "trainer_fp8", "bf16": "bf16"}.get(self.mode, "self_quantized")

    @property
    def trains_fp8(self) -> bool:
        """Whether the trainer's linear GEMMs run the FP8 flow (jetrl); fake_quant emulates it in BF16."""
        return self.trainer_gemm == "fp8"

    @property
    def rollout_fp8(self) -> bool:
        return self.rollout_weights != "bf16"

    @property
    def switches(self) -> tuple[bool, bool]:
        """NeMo-RL's (``fp8_cfg.enabled``, ``vllm_cfg.precision == fp8``) for this arm."""
        return self.trains_fp8, self.rollout_fp8

    # ----------------------------------------------------------------- which modules are FP8

    def layer_is_fp8(self, layer_idx: int, num_layers: int) -> bool:
        """0-based global decoder layer index -> whether its linears are FP8 under this recipe."""
        if not 0 <= layer_idx < num_layers:
            raise IndexError(f"layer_idx {layer_idx} outside [0, {num_layers})")
        return self.bf16_first_layers <= layer_idx < num_layers - self.bf16_last_layers

    def module_is_fp8(self, name: str, layer_idx: int | None, num_layers: int) -> bool:
        """Whether a module (HF or Megatron naming) runs FP8 GEMMs; attention, norms, embeddings, lm_head never do."""
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("weight", "bias", "weight_scale_inv"):
            leaf = name.rsplit(".", 2)[-2]
        if leaf not in FP8_LINEAR_NAMES:
            return False
        if any(k in name for k in ALWAYS_BF16_KEYWORDS) or any(k in name for k in self.bf16_module_keywords):
            return False
        if layer_idx is None:
            match = _LAYER_INDEX.search(name)
            if match is None:
                return False
            layer_idx = int(match.group(1))
        return self.layer_is_fp8(layer_idx, num_layers)

    def bf16_layer_indices(self, num_layers: int) -> list[int]:
        return [i for i in range(num_layers) if not self.layer_is_fp8(i, num_layers)]

    # ----------------------------------------------------------------- HF checkpoint metadata
    def hf_quantization_config(self, num_layers: int, quant_method: str = "fp8") -> dict[str, Any]:
        """The `quantization_config` of an exported checkpoint (DeepSeek-V3/vLLM block-FP8 convention).

        `ignored_layers` lists the HF module prefixes that stay BF16 (whole excluded layers' projections and
        lm_head), in the key vLLM's Fp8Config reads; `modules_to_not_convert` carries the same for transformers.
        """
        ignored = ["lm_head"]
        for i in self.bf16_layer_indices(num_layers):
            for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                ignored.append(f"model.layers.{i}.{proj}")
        cfg: dict[str, Any] = {
            "quant_method": quant_method,
            "fmt": self.fmt,
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.weight_block),
            "ignored_layers": ignored,
            "modules_to_not_convert": list(ignored),
        }
        if quant_method == "jetrl_fp8":
            cfg["jet_rl"] = self.to_dict()
        return cfg


def _as_tuple(key: str, value: Any) -> tuple:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise RecipeError(f"jet_rl.{key}: must be a list (got {value!r})")
