"""What a NeMo-RL ``policy`` config must say for the Jet-RL Megatron worker, and the one recipe both sides read.

In a NeMo-RL run the FP8 recipe is written once, in ``policy.generation.vllm_kwargs.hf_overrides.quantization_config``
(the HF ``quantization_config`` vLLM builds the ``jetrl_fp8`` method from, with the recipe under ``jet_rl``); the
training worker reads the same dict, so trainer and rollout cannot disagree. NeMo-RL's own FP8 switches stay off:
``vllm_cfg.precision: fp8`` would make its vLLM worker re-quantize the BF16 weights it receives, and
``fp8_cfg.enabled`` would turn on TransformerEngine FP8 training; here the FP8 linears are this project's and vLLM
serves the trainer's bytes.

Plain dicts in, :class:`~jetrl_megatron.recipe.Fp8Recipe` out; no NeMo-RL import. Every refusal names the key.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jetrl_megatron.fp8.format import BLOCK, QUANT_METHOD
from jetrl_megatron.megatron.backward_thread import BACKWARD_THREADS
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.recipe import Fp8Recipe, RecipeError
from jetrl_megatron.rl.config.arm_switches import (
    FP8_TRAIN_KEY,
    HOSTED,
    PRECISION_KEY,
    QUANT_CONFIG_KEY,
    QUANT_KEY,
    STANDALONE,
    PolicyConfigError,
    arm_of_switches,
)
from jetrl_megatron.rl.config.schema import JetRlCfg
from jetrl_megatron.rl.config.switches import RunSwitches, resolve_switches
from jetrl_megatron.rollout import invariant_norm, swiglu_forms

__all__ = ["PolicyConfigError", "QUANT_CONFIG_KEY", "RULES", "READS", "jetrl_vllm_kwargs", "engine_numerics",
           "recipe_from_policy", "check_policy", "model_shape", "PolicyPlan", "policy_plan", "uses_jetrl",
           "arm_of_switches", "hosted_form", "FP8_TRAIN_KEY", "PRECISION_KEY", "QUANT_KEY"]

_MISSING = object()

# Where a key lives: in NeMo-RL v0.7.0's base GRPO YAMLs ("yaml"), only read by NeMo-RL's code with a default
# ("code"), or this integration's own entries inside NeMo-RL's ``vllm_kwargs`` pass-through ("ours").
YAML, CODE, OURS = "yaml", "code", "ours"


@dataclass(frozen=True)
class Rule:
    """``policy.<path>`` must be one of ``allowed`` (``default`` when absent; ``_MISSING``: the key is required)."""

    path: str
    allowed: tuple
    why: str
    where: str = YAML
    default: Any = _MISSING


RULES: tuple[Rule, ...] = (
    Rule("megatron_cfg.enabled", (True,), "it is a Megatron policy worker"),
    Rule("generation.backend", ("vllm",), "the FP8 bytes are served by vLLM's jetrl_fp8 method"),
    Rule("generation.vllm_cfg.precision", ("bfloat16",), "with 'fp8' NeMo-RL's vLLM worker re-quantizes the weights "
         f"it receives; the FP8 recipe goes in {QUANT_CONFIG_KEY}"),
    Rule("megatron_cfg.fp8_cfg.enabled", (False,), "that is TransformerEngine FP8 training; the Jet-RL model runs its "
         "own FP8 linears", default=False),
    Rule("generation.vllm_kwargs.quantization", (QUANT_METHOD,), "vLLM must load the trainer's FP8 bytes with this "
         "project's quantization method", where=OURS),
    Rule("sequence_packing.enabled", (False,), "the Jet-RL attention takes right-padded rows (no packed sequences)",
         default=False),
    Rule("megatron_cfg.context_parallel_size", (1,), "context parallelism is not supported", default=1),
    Rule("megatron_cfg.num_layers_in_first_pipeline_stage", (None,), "the Jet-RL model splits layers evenly over "
         "pipeline stages", default=None),
    Rule("megatron_cfg.num_layers_in_last_pipeline_stage", (None,), "the Jet-RL model splits layers evenly over "
         "pipeline stages", default=None),
    Rule("megatron_cfg.peft.enabled", (False,), "LoRA adapters are not FP8 linears", default=False),
    Rule("megatron_cfg.mtp_num_layers", (0, None), "multi-token prediction is not supported", default=0),
    Rule("megatron_cfg.use_linear_ce_fusion_loss", (False,), "it replaces GPTModel's forward, bypassing the "
         "rollout-matched output layer", where=CODE, default=False),
    Rule("draft.enabled", (False,), "draft-model training is not supported", default=False),
)

# Every policy key this module reads: the rules' and these (the contract test checks them against NeMo-RL).
READS: dict[str, str] = {
    **{r.path: r.where for r in RULES},
    "model_name": YAML,
    "hf_config_overrides": YAML,
    "megatron_cfg.sequence_parallel": YAML,
    "generation.vllm_cfg.kv_cache_dtype": YAML,
    "generation.vllm_cfg.num_first_layers_in_bf16": YAML,
    "generation.vllm_cfg.num_last_layers_in_bf16": YAML,
    "generation.vllm_cfg.pow2_weight_scaling_factors": CODE,
    "generation.vllm_cfg.pow2_activation_scaling_factors": CODE,
    "generation.vllm_kwargs": YAML,
    "generation.vllm_kwargs.hf_overrides.quantization_config": OURS,
    f"generation.vllm_kwargs.hf_overrides.{invariant_norm.HF_KEY}": OURS,
    f"generation.vllm_kwargs.hf_overrides.{swiglu_forms.HF_KEY}": OURS,
    "megatron_cfg.fp8_cfg.fp8": YAML,
    "megatron_cfg.fp8_cfg.fp8_recipe": YAML,
    "megatron_cfg.fp8_cfg.fp8_param": YAML,
    "generation.vllm_cfg.use_deep_gemm": YAML,
    "logprob_chunk_size": YAML,
    "megatron_cfg.defer_fp32_logits": YAML,
    "megatron_cfg.optimizer.optimizer_cpu_offload": YAML,
    "megatron_cfg.optimizer.optimizer_offload_fraction": YAML,
}


def _get(policy: Mapping[str, Any], path: str, default: Any = _MISSING) -> Any:
    """``policy`` value at ``path`` (relative to ``policy.``); a missing key raises unless a default is given."""
    if path not in READS:
        raise KeyError(f"policy.{path} is read but not listed in READS (the NeMo-RL contract table)")
    node: Any = policy
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is _MISSING:
                raise PolicyConfigError(f"policy.{path}: missing (the Jet-RL worker needs it; see docs/nemo_rl.md)")
            return default
        node = node[part]
    return node


def jetrl_vllm_kwargs(recipe: Fp8Recipe, num_layers: int, *, cuda_norms: str = "batch_invariant",
                      swiglu_fp8_forms: bool = False) -> dict[str, Any]:
    """The ``policy.generation.vllm_kwargs`` entries that serve the trainer's FP8 bytes with this recipe, and the
    GPU engines' element-wise choices the hosted trainer's forward follows (:func:`engine_numerics`): the
    batch-invariant RMSNorm (``cuda_norms``, rollout/invariant_norm.py) and the project's SwiGLU writing the next
    FP8 linear's input (``swiglu_fp8_forms``, rollout/swiglu_forms.py). CPU engines ignore both."""
    return {"quantization": QUANT_METHOD,
            "hf_overrides": {"quantization_config": recipe.hf_quantization_config(num_layers,
                                                                                 quant_method=QUANT_METHOD),
                             **invariant_norm.engine_overrides(cuda_norms, on_cuda=True),
                             **swiglu_forms.engine_overrides(swiglu_fp8_forms, on_cuda=True)}}


def engine_numerics(policy: Mapping[str, Any]) -> tuple[str, bool]:
    """(cuda_norms, swiglu_fp8_forms) of the hosted trainer's models: what its GPU engines were asked to run, read
    from the same ``vllm_kwargs.hf_overrides`` entries vLLM reads (a trainer following other ops than its engines
    would not be exactly on-policy). Absent entries: vLLM's own norms and SwiGLU."""
    flags = {}
    for key in (invariant_norm.HF_KEY, swiglu_forms.HF_KEY):
        path = f"generation.vllm_kwargs.hf_overrides.{key}"
        value = _get(policy, path, False)
        if not isinstance(value, bool):
            raise PolicyConfigError(f"policy.{path}: {value!r}; must be true or false")
        flags[key] = value
    return ("batch_invariant" if flags[invariant_norm.HF_KEY] else "vllm"), flags[swiglu_forms.HF_KEY]


def recipe_from_policy(policy: Mapping[str, Any]) -> Fp8Recipe:
    """The run's recipe: ``<QUANT_CONFIG_KEY>.jet_rl`` (must be the jetrl arm)."""
    qc = _get(policy, "generation.vllm_kwargs.hf_overrides.quantization_config")
    if not isinstance(qc, Mapping) or not isinstance(qc.get("jet_rl"), Mapping):
        raise PolicyConfigError(f"{QUANT_CONFIG_KEY}.jet_rl: missing; it holds the FP8 recipe both the trainer and "
                                "vLLM read (jetrl_megatron.nemo_rl.policy_cfg.jetrl_vllm_kwargs writes it)")
    try:
        recipe = Fp8Recipe.from_dict(dict(qc["jet_rl"]))
    except RecipeError as e:
        raise PolicyConfigError(f"{QUANT_CONFIG_KEY}.{e}") from None
    if not (recipe.trains_fp8 and recipe.rollout_weights == "trainer_fp8"):
        raise PolicyConfigError(
            f"{QUANT_CONFIG_KEY}.jet_rl.mode: {recipe.mode!r} (trainer_gemm={recipe.trainer_gemm}, rollout_weights="
            f"{recipe.rollout_weights}); the Jet-RL worker trains in FP8 and serves the trainer's bytes (mode 'jetrl'; "
            "for BF16 or NeMo-RL's own FP8 rollout use NeMo-RL's MegatronPolicyWorker)")
    return recipe


def _require(policy: Mapping[str, Any], path: str, allowed: tuple, why: str, default: Any = _MISSING) -> None:
    value = _get(policy, path, default)
    if value not in allowed:
        want = " or ".join(repr(a) for a in allowed)
        raise PolicyConfigError(f"policy.{path}: {value!r}; the Jet-RL worker needs {want}: {why}")


def check_policy(policy: Mapping[str, Any], num_layers: int) -> Fp8Recipe:
    """Refuse a policy config the Jet-RL worker cannot run; return its recipe. ``num_layers``: the model's."""
    for rule in RULES:
        _require(policy, rule.path, rule.allowed, rule.why, rule.default)
    kv = _get(policy, "generation.vllm_cfg.kv_cache_dtype", "auto")
    if isinstance(kv, str) and kv.startswith("fp8"):
        raise PolicyConfigError(f"policy.generation.vllm_cfg.kv_cache_dtype: {kv!r}; an FP8 KV cache is not part of "
                                "the Jet-RL precision flow (use 'auto')")

    # NeMo-RL's own worker asserts these deep inside each Ray actor; refused here, before anything starts, by key
    chunk = _get(policy, "logprob_chunk_size", None)
    if chunk is not None and chunk > 0 and not _get(policy, "megatron_cfg.defer_fp32_logits", False):
        raise PolicyConfigError(f"policy.logprob_chunk_size: {chunk}; under NeMo-RL's driver NeMo-RL's own logprob "
                                "code reads it and needs policy.megatron_cfg.defer_fp32_logits: true (its workers "
                                "stop on an assertion otherwise); set that key, or unset logprob_chunk_size")
    if _get(policy, "megatron_cfg.optimizer.optimizer_cpu_offload", False):
        fraction = _get(policy, "megatron_cfg.optimizer.optimizer_offload_fraction", 1.0)
        if fraction != 1.0:
            raise PolicyConfigError(f"policy.megatron_cfg.optimizer.optimizer_offload_fraction: {fraction}; NeMo-RL's "
                                    "driver supports only 1.0 with optimizer_cpu_offload (a split is `jetrl run`'s)")

    recipe = recipe_from_policy(policy)
    qc = _get(policy, "generation.vllm_kwargs.hf_overrides.quantization_config")
    if qc.get("quant_method") != QUANT_METHOD:
        raise PolicyConfigError(f"{QUANT_CONFIG_KEY}.quant_method: {qc.get('quant_method')!r}; must be "
                                f"{QUANT_METHOD!r}")
    if list(qc.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise PolicyConfigError(f"{QUANT_CONFIG_KEY}.weight_block_size: {qc.get('weight_block_size')!r}; must be "
                                f"[{BLOCK}, {BLOCK}]")
    want = set(recipe.hf_quantization_config(num_layers)["ignored_layers"])
    have = set(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [])
    if have != want:
        raise PolicyConfigError(
            f"{QUANT_CONFIG_KEY}.ignored_layers: vLLM would keep other modules BF16 than the trainer "
            f"(bf16_first_layers={recipe.bf16_first_layers}, bf16_last_layers={recipe.bf16_last_layers}): only in "
            f"the config {sorted(have - want)[:4]}, missing {sorted(want - have)[:4]}; write the dict with "
            "jetrl_megatron.nemo_rl.policy_cfg.jetrl_vllm_kwargs")
    # NeMo-RL's own names for the same knobs: when set they must agree with the recipe, never silently differ.
    for key, value in (("generation.vllm_cfg.num_first_layers_in_bf16", recipe.bf16_first_layers),
                       ("generation.vllm_cfg.num_last_layers_in_bf16", recipe.bf16_last_layers)):
        got = _get(policy, key, value)
        if got != value:
            raise PolicyConfigError(f"policy.{key}: {got!r} disagrees with the recipe in {QUANT_CONFIG_KEY}.jet_rl "
                                    f"({value}); set both to the same value")
    for key in ("generation.vllm_cfg.pow2_weight_scaling_factors",
                "generation.vllm_cfg.pow2_activation_scaling_factors"):
        got = _get(policy, key, None)
        if got is not None and bool(got) != (recipe.scale_fmt == "pow2"):
            raise PolicyConfigError(f"policy.{key}: {got!r} disagrees with {QUANT_CONFIG_KEY}.jet_rl.scale_fmt "
                                    f"({recipe.scale_fmt!r})")
    return recipe


def model_shape(policy: Mapping[str, Any]) -> ModelShape:
    """The architecture of ``policy.model_name`` (HF config, with ``policy.hf_config_overrides`` applied, as NeMo-RL
    applies them)."""
    from transformers import AutoConfig

    name = _get(policy, "model_name")
    overrides = _get(policy, "hf_config_overrides", None) or {}
    try:
        cfg = AutoConfig.from_pretrained(name, trust_remote_code=True, **overrides).to_dict()
    except OSError as e:
        raise PolicyConfigError(f"policy.model_name: cannot read the HF config of {name!r} ({e})") from None
    try:
        return ModelShape.from_hf_config(cfg, name=str(name))
    except ValueError as e:
        raise PolicyConfigError(f"policy.model_name: {name!r}: {e}") from None


@dataclass(frozen=True)
class PolicyPlan:
    """What the hosted Jet-RL model is, from a checked NeMo-RL policy config."""

    shape: ModelShape
    recipe: Fp8Recipe
    sequence_parallel: bool
    # the model's run switches: the policy.jet_rl defaults with the JETRL_* environment overrides, read once here
    # (rl/config/switches.py)
    switches: RunSwitches = field(default_factory=RunSwitches)
    # the GPU engines' element-wise ops the models follow (engine_numerics)
    cuda_norms: str = "batch_invariant"
    swiglu_fp8_forms: bool = False
    # the trainer-only numerics switches of policy.jet_rl (TRAINER_ONLY_KEYS): no engine runs them, so the hosted
    # worker reads them from the policy's own block, as `jetrl run` does
    deterministic_backward: bool = False
    fuse_swiglu_grad_quant: bool = False
    # where autograd runs the backward of the worker's train() (policy.jet_rl.backward_thread)
    backward_thread: str = "calling"


# policy.jet_rl keys the hosted worker reads, each with its allowed values: they change the trainer's backward only
# (the engines never run it), so one YAML can set them for both drivers; the block's other keys describe ops the
# engines must run too, which the hosted worker takes from vllm_kwargs.hf_overrides (what vLLM reads) instead
TRAINER_ONLY_KEYS: dict[str, tuple[Any, ...]] = {"deterministic_backward": (True, False),
                                                 "fuse_swiglu_grad_quant": (True, False),
                                                 "backward_thread": BACKWARD_THREADS}


def _trainer_only_switches(block: Any) -> dict[str, Any]:
    """The TRAINER_ONLY_KEYS set in a ``policy.jet_rl`` block, each checked against its values (a refusal names the
    key)."""
    if not isinstance(block, Mapping):
        return {}
    out = {}
    for key, allowed in TRAINER_ONLY_KEYS.items():
        if key in block:
            value = block[key]
            if not any(type(value) is type(a) and value == a for a in allowed):
                wanted = "true or false" if allowed == (True, False) else " or ".join(map(repr, allowed))
                raise PolicyConfigError(f"policy.jet_rl.{key}: {value!r}; must be {wanted}")
            out[key] = value
    return out


def policy_plan(policy: Mapping[str, Any], shape: ModelShape | None = None) -> PolicyPlan:
    """Check ``policy`` in its hosted form (:func:`hosted_form`, :func:`check_policy`) and return the model's shape,
    the recipe, sequence parallelism and the numerics switches; ``shape`` None reads ``policy.model_name``'s HF
    config."""
    shape = shape or model_shape(policy)
    policy = hosted_form(policy, shape.num_layers)
    recipe = check_policy(policy, shape.num_layers)
    cuda_norms, swiglu_fp8_forms = engine_numerics(policy)
    block = policy.get("jet_rl")
    trainer_only = _trainer_only_switches(block)
    unread = sorted(k for k in block if k not in TRAINER_ONLY_KEYS) if isinstance(block, Mapping) else []
    if unread:  # one YAML may serve both drivers (jetrl run reads the block); say that this one does not
        logging.getLogger(__name__).warning(
            "policy.jet_rl.{%s}: not read by the NeMo-RL driver's hosted policy (`jetrl run` reads it); here the "
            "models' numerics come from vllm_kwargs.hf_overrides' jetrl_* entries and the JETRL_* variables, and "
            "of policy.jet_rl only %s (docs/nemo_rl.md)", ", ".join(map(str, unread)), ", ".join(TRAINER_ONLY_KEYS))
    return PolicyPlan(shape, recipe, bool(_get(policy, "megatron_cfg.sequence_parallel", False)),
                      resolve_switches(JetRlCfg(), os.environ), cuda_norms, swiglu_fp8_forms, **trainer_only)


def _switch_values(policy: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    return (_get(policy, "megatron_cfg.fp8_cfg.enabled", False), _get(policy, "generation.vllm_cfg.precision"),
            _get(policy, "generation.vllm_kwargs.quantization", None))


def hosted_form(policy: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """``policy`` with the jetrl arm written in the hosted form, which NeMo-RL's driver and workers run.

    The hosted form is returned as it is. The standalone form (fp8_cfg.enabled: true, fp8: e4m3, fp8_recipe:
    blockwise, precision: fp8) is rewritten: NeMo-RL's switches off, ``vllm_kwargs`` gets ``quantization:
    jetrl_fp8`` and the recipe built from NeMo-RL's keys (BF16 first/last layers, pow2 scales, DeepGEMM) unless it
    carries one already, which :func:`check_policy` then holds to those keys. Another arm is refused naming the
    keys: this worker runs jetrl only (NeMo-RL's own worker runs the others)."""
    fp8_train, precision, quantization = _switch_values(policy)
    arm, form = arm_of_switches(fp8_train, precision, quantization)
    if arm != "jetrl":
        raise PolicyConfigError(f"{FP8_TRAIN_KEY}: {str(bool(fp8_train)).lower()}, {PRECISION_KEY}: {precision!r}"
                                f"{'' if quantization is None else f', {QUANT_KEY}: {quantization!r}'} select "
                                f"{arm!r}; the Jet-RL worker runs the jetrl arm (NeMo-RL's own Megatron worker runs "
                                f"{arm!r})")
    if form == HOSTED:
        return dict(policy)
    for path, want in (("megatron_cfg.fp8_cfg.fp8", "e4m3"), ("megatron_cfg.fp8_cfg.fp8_recipe", "blockwise"),
                       ("megatron_cfg.fp8_cfg.fp8_param", False)):
        got = _get(policy, path, want)
        if got != want:
            raise PolicyConfigError(f"policy.{path}: {got!r}; Jet-RL's FP8 flow (the standalone form of jetrl) is "
                                    f"{want!r}")
    out = copy.deepcopy(dict(policy))
    out["megatron_cfg"]["fp8_cfg"]["enabled"] = False
    out["generation"]["vllm_cfg"]["precision"] = "bfloat16"
    kwargs = out["generation"].setdefault("vllm_kwargs", {}) or {}
    out["generation"]["vllm_kwargs"] = kwargs
    if form == STANDALONE:
        pow2 = bool(_get(policy, "generation.vllm_cfg.pow2_weight_scaling_factors", False))
        recipe = Fp8Recipe(mode="jetrl", scale_fmt="pow2" if pow2 else "fp32",
                           bf16_first_layers=int(_get(policy, "generation.vllm_cfg.num_first_layers_in_bf16", 0)),
                           bf16_last_layers=int(_get(policy, "generation.vllm_cfg.num_last_layers_in_bf16", 0)),
                           # use_deep_gemm (NeMo-RL: vLLM's FP8 GEMMs on DeepGEMM): `auto` puts FProp and DGrad
                           # there (rl/config/run_config.py, build_fp8_recipe, says why not WGrad)
                           gemm_backend="auto")
        made = jetrl_vllm_kwargs(recipe, num_layers)
        kwargs["quantization"] = made["quantization"]
        kwargs.setdefault("hf_overrides", {})
        kwargs["hf_overrides"] = dict(kwargs["hf_overrides"] or {}, **made["hf_overrides"])
    return out


def uses_jetrl(policy: Mapping[str, Any]) -> bool:
    """Whether a policy config asks for the Jet-RL flow (vLLM's quantization method is ``jetrl_fp8``)."""
    return _get(policy, "generation.vllm_kwargs.quantization", None) == QUANT_METHOD
