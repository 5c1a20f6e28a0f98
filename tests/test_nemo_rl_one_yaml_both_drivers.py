"""One YAML, both drivers: the jetrl switches in the standalone form (fp8_cfg.enabled: true + precision: fp8) and in
the hosted form (fp8_cfg.enabled: false + precision: bfloat16 + vllm_kwargs.quantization: jetrl_fp8) select the same
arm and the same recipe under `jetrl run` (rl/config/run_config.py) and under NeMo-RL's driver (nemo_rl/policy_cfg.py,
which hands NeMo-RL the hosted form); every other combination is an error naming the keys. One test per cell of the
switch table, per driver; expectations are written out here, not computed from the table in the code.
"""

from __future__ import annotations

import copy

import pytest
from nemo_rl_standin import policy_config

from jetrl_megatron.errors import UserError
from jetrl_megatron.nemo_rl.policy_cfg import PolicyConfigError, check_policy, hosted_form, policy_plan
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.rl.config import ConfigError, load_config

TRAIN, PREC, QUANT = ("policy.megatron_cfg.fp8_cfg.enabled", "policy.generation.vllm_cfg.precision",
                      "policy.generation.vllm_kwargs.quantization")
QC = "policy.generation.vllm_kwargs.hf_overrides.quantization_config"

# (fp8_cfg.enabled, precision, vllm_kwargs.quantization) -> the arm, or the text the error must contain
CELLS = [
    (False, "bfloat16", None, "bf16"),
    (False, "fp8", None, "bf16_train_fp8_rollout"),
    (True, "fp8", None, "jetrl"),                 # standalone form
    (False, "bfloat16", "jetrl_fp8", "jetrl"),    # hosted form
    (True, "fp8", "jetrl_fp8", "jetrl"),          # both at once
    (True, "bfloat16", None, "an FP8 trainer with a BF16 rollout is not an arm"),
    (True, "bfloat16", "jetrl_fp8", "policy.generation.vllm_cfg.precision: 'bfloat16' with "
                                    "policy.megatron_cfg.fp8_cfg.enabled: true and "
                                    "policy.generation.vllm_kwargs.quantization: 'jetrl_fp8' contradict"),
    (False, "fp8", "jetrl_fp8", "policy.generation.vllm_cfg.precision: 'fp8' with "
                                "policy.megatron_cfg.fp8_cfg.enabled: false and "
                                "policy.generation.vllm_kwargs.quantization: 'jetrl_fp8' contradict"),
    (False, "fp8", "fp8", "policy.generation.vllm_kwargs.quantization: 'fp8'"),
    (False, "bfloat16", "awq", "policy.generation.vllm_kwargs.quantization: 'awq'"),
]
ARMS = {"bf16", "bf16_train_fp8_rollout", "jetrl"}


def _standalone(fp8_train: bool, precision: str, quantization: str | None, *extra: str):
    ov = [f"{TRAIN}={str(fp8_train).lower()}", f"{PREC}={precision}"]
    ov += [f"+{QUANT}={quantization}"] if quantization is not None else []
    return load_config("tiny_cpu", [*ov, *extra])


def _hosted(fp8_train: bool, precision: str, quantization: str | None, recipe: Fp8Recipe | None = None) -> dict:
    """A NeMo-RL policy section with these switches; the hosted recipe block only with quantization jetrl_fp8."""
    policy = policy_config(recipe)
    policy["megatron_cfg"]["fp8_cfg"] = {"enabled": fp8_train, "fp8": "e4m3", "fp8_recipe": "blockwise",
                                         "fp8_param": False}
    policy["generation"]["vllm_cfg"]["precision"] = precision
    if quantization is None:
        policy["generation"]["vllm_kwargs"] = {}
    else:
        policy["generation"]["vllm_kwargs"]["quantization"] = quantization
    return policy


@pytest.mark.parametrize("fp8_train, precision, quantization, want", CELLS)
def test_standalone_runner_cell(fp8_train, precision, quantization, want):
    if want in ARMS:
        cfg = _standalone(fp8_train, precision, quantization)
        assert cfg.arm == want and cfg.recipe.mode == want
        # the switches are read, never rewritten
        assert (cfg.policy.megatron_cfg.fp8_cfg.enabled, cfg.policy.generation.vllm_cfg.precision) == (
            fp8_train, precision)
    else:
        with pytest.raises(ConfigError) as e:
            _standalone(fp8_train, precision, quantization)
        assert want in str(e.value), str(e.value)


@pytest.mark.parametrize("fp8_train, precision, quantization, want", CELLS)
def test_hosted_driver_cell(fp8_train, precision, quantization, want):
    policy = _hosted(fp8_train, precision, quantization)
    if want == "jetrl":
        plan = policy_plan(policy, _tiny())
        assert plan.recipe == Fp8Recipe()
        hosted = hosted_form(policy, 4)  # what NeMo-RL is given: its own FP8 paths off, jetrl_fp8 on
        assert hosted["megatron_cfg"]["fp8_cfg"]["enabled"] is False
        assert hosted["generation"]["vllm_cfg"]["precision"] == "bfloat16"
        assert hosted["generation"]["vllm_kwargs"] == policy_config()["generation"]["vllm_kwargs"]
        assert check_policy(hosted, 4) == Fp8Recipe()
    else:
        needle = f"select {want!r}; the Jet-RL worker runs the jetrl arm" if want in ARMS else want
        with pytest.raises(PolicyConfigError) as e:
            policy_plan(policy, _tiny())
        assert needle in str(e.value), str(e.value)


def _tiny():
    from jetrl_megatron.model.shapes import get_model_shape

    return get_model_shape("tiny")


def test_both_drivers_build_the_same_recipe_from_either_form():
    """BF16 last layer + pow2 scales, written with NeMo-RL's keys: the standalone form under the hosted driver and
    the hosted form under the standalone runner give the recipe of the other."""
    recipe = Fp8Recipe(bf16_last_layers=1, scale_fmt="pow2")
    nemo_keys = ["policy.generation.vllm_cfg.num_last_layers_in_bf16=1",
                 "policy.generation.vllm_cfg.pow2_weight_scaling_factors=true",
                 "policy.generation.vllm_cfg.pow2_activation_scaling_factors=true"]
    standalone = _standalone(True, "fp8", None, *nemo_keys).recipe
    block = {f"+{QC}.jet_rl.{k}={v}" for k, v in (("mode", "jetrl"), ("bf16_last_layers", 1),
                                                     ("scale_fmt", "pow2"))}
    hosted_in_standalone = _standalone(False, "bfloat16", "jetrl_fp8", *nemo_keys, *sorted(block)).recipe
    policy = _hosted(True, "fp8", None)
    policy["generation"]["vllm_cfg"].update(num_last_layers_in_bf16=1, pow2_weight_scaling_factors=True,
                                            pow2_activation_scaling_factors=True)
    standalone_in_hosted = policy_plan(policy, _tiny()).recipe
    hosted_in_hosted = policy_plan(_hosted(False, "bfloat16", "jetrl_fp8", recipe), _tiny()).recipe
    assert standalone == hosted_in_standalone == standalone_in_hosted == hosted_in_hosted == recipe.replace(
        mode="jetrl")


@pytest.mark.parametrize("extra, needle", [
    ([f"+{QC}.jet_rl.bf16_last_layers=2"], f"{QC}.jet_rl.bf16_last_layers: 2 contradicts "
                                           "policy.generation.vllm_cfg.num_last_layers_in_bf16"),
    ([f"+{QC}.jet_rl.scale_fmt=pow2"], f"{QC}.jet_rl.scale_fmt: 'pow2' contradicts "
                                       "policy.generation.vllm_cfg.pow2_weight_scaling_factors"),
    ([f"+{QC}.jet_rl.mode=bf16"], f"{QC}.jet_rl.mode: 'bf16' contradicts policy.jet_rl.arm"),
    (["policy.jet_rl.arm=bf16"], "policy.jet_rl.arm: 'bf16' contradicts"),
    (["policy.jet_rl.arm=fake_quant"], "policy.jet_rl.arm: 'fake_quant' contradicts"),
])
def test_standalone_runner_refuses_a_hosted_form_that_disagrees(extra, needle):
    with pytest.raises(ConfigError) as e:
        _standalone(False, "bfloat16", "jetrl_fp8", *extra)
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("path, value, needle", [
    ("fp8_recipe", "tensorwise", "policy.megatron_cfg.fp8_cfg.fp8_recipe: 'tensorwise'"),
    ("fp8", "hybrid", "policy.megatron_cfg.fp8_cfg.fp8: 'hybrid'"),
    ("fp8_param", True, "policy.megatron_cfg.fp8_cfg.fp8_param: True"),
])
def test_hosted_driver_refuses_a_standalone_form_that_is_not_jetrl(path, value, needle):
    policy = _hosted(True, "fp8", None)
    policy["megatron_cfg"]["fp8_cfg"][path] = value
    with pytest.raises(UserError) as e:
        policy_plan(copy.deepcopy(policy), _tiny())
    assert needle in str(e.value), str(e.value)
