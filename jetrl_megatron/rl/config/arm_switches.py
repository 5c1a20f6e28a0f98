"""Which NeMo-RL switches select which arm, in either form: the one table both drivers read the arm from.

Why here, under the config: `jetrl run`'s loader (``run_config.derive_arm``) and the NeMo-RL worker's config checks
(``jetrl_megatron.nemo_rl.policy_cfg``) must agree on it, and the config layer may not import the NeMo-RL glue.
"""

from __future__ import annotations

from typing import Any

from jetrl_megatron.errors import UserError
from jetrl_megatron.fp8.format import QUANT_METHOD
from jetrl_megatron.recipe import ARM_BY_SWITCHES

QUANT_CONFIG_KEY = "policy.generation.vllm_kwargs.hf_overrides.quantization_config"


class PolicyConfigError(UserError):
    """A NeMo-RL policy key is missing or has a value the Jet-RL worker cannot run with; the message names it."""


# ---------------------------------------------------------------------------------------------- the switch table
# Both drivers read the arm from the same three keys, in either of two forms (docs/config.md, "One YAML, both
# drivers"): the standalone form (fp8_cfg.enabled: true + precision: fp8, NeMo-RL's blockwise FP8 recipe) and the
# hosted form (fp8_cfg.enabled: false + precision: bfloat16 + vllm_kwargs.quantization: jetrl_fp8, which keeps
# NeMo-RL's own TransformerEngine FP8 and vLLM re-quantization off under its driver).
FP8_TRAIN_KEY = "policy.megatron_cfg.fp8_cfg.enabled"
PRECISION_KEY = "policy.generation.vllm_cfg.precision"
QUANT_KEY = "policy.generation.vllm_kwargs.quantization"
STANDALONE, HOSTED, BOTH = "standalone", "hosted", "both"


def arm_of_switches(fp8_train: bool, precision: str, quantization: Any = None) -> tuple[str, str]:
    """(arm, form) selected by NeMo-RL's switches; a combination that is no arm raises `PolicyConfigError` naming
    the keys (callers re-raise it as their own error type).

    | fp8_cfg.enabled | precision | quantization | arm |
    | false | bfloat16 | - | bf16 |
    | false | fp8 | - | bf16_train_fp8_rollout |
    | true | fp8 | - | jetrl (standalone form) |
    | false | bfloat16 | jetrl_fp8 | jetrl (hosted form) |
    | true | fp8 | jetrl_fp8 | jetrl (both forms at once) |
    anything else is an error.
    """

    on = str(bool(fp8_train)).lower()
    if precision not in ("bfloat16", "fp8"):
        raise PolicyConfigError(f"{PRECISION_KEY}: {precision!r}; 'bfloat16' or 'fp8'")
    if quantization is None:
        if fp8_train and precision != "fp8":
            raise PolicyConfigError(
                f"{FP8_TRAIN_KEY}: true with {PRECISION_KEY}: {precision!r}: an FP8 trainer with a BF16 rollout is "
                f"not an arm here; set precision: fp8 (jetrl, standalone form), or fp8_cfg.enabled: false with "
                f"{QUANT_KEY}: {QUANT_METHOD} (jetrl, hosted form) or without it (bf16)")
        return ARM_BY_SWITCHES[(bool(fp8_train), precision == "fp8")], STANDALONE
    if quantization != QUANT_METHOD:
        raise PolicyConfigError(f"{QUANT_KEY}: {quantization!r}; only {QUANT_METHOD!r} (the hosted form of jetrl) may "
                                f"be set: vLLM's own FP8 comes with {PRECISION_KEY}: fp8 and {FP8_TRAIN_KEY}: false")
    if (bool(fp8_train), precision) == (False, "bfloat16"):
        return "jetrl", HOSTED
    if (bool(fp8_train), precision) == (True, "fp8"):
        return "jetrl", BOTH
    raise PolicyConfigError(
        f"{PRECISION_KEY}: {precision!r} with {FP8_TRAIN_KEY}: {on} and {QUANT_KEY}: {QUANT_METHOD!r} contradict: "
        f"{QUANT_METHOD!r} selects jetrl, in the hosted form with fp8_cfg.enabled: false + precision: bfloat16 or "
        "in the standalone form with fp8_cfg.enabled: true + precision: fp8")

