"""Stand-ins for the NeMo-RL v0.7.0 pieces the Jet-RL worker sits on, so that ``jetrl_megatron/nemo_rl/worker.py``
itself runs on CPU with a real Megatron-Core model (no Ray, Megatron-Bridge or TransformerEngine here).

They behave as ``contract.TOUCHES`` says NeMo-RL does, and nothing more: the base worker's ``__init__`` calls
``setup_model_and_optimizer`` and ``setup_reference_model_state`` through its module's globals and keeps ``.model``
/ ``.optimizer`` of the first; both build chunks with ``megatron_cfg.model.provide(pre_process=, post_process=)``
(Megatron-Bridge's ``get_model``), wrap them in ``Float16Module`` and Megatron's DDP with NeMo-RL's defaults
(distributed optimizer, ``overlap_param_gather``), then load checkpoint weights into them; ``use_reference_model``
copies the reference weights into the parameters and back (``param.copy_``); the refit methods call
``_calculate_refit_param_info`` and ``_iter_params_with_optional_kv_scales``. No NeMo-RL code.
Use :func:`install` only in a process of its own (it puts modules named ``ray`` and ``nemo_rl`` in ``sys.modules``).
"""

from __future__ import annotations

import sys
import types
from collections import namedtuple
from contextlib import contextmanager

import torch

from jetrl_megatron.model import layout

ModelAndOptimizerState = namedtuple("ModelAndOptimizerState", "state model optimizer")
CHECKPOINTS: dict[str, dict[str, torch.Tensor]] = {}  # "policy" / "reference" -> HF-named weights to load


class Provider:
    """Megatron-Bridge's model provider: its own ``provide`` would build a TransformerEngine GPT."""

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        raise AssertionError("the stock provider ran: the Jet-RL build was not installed")


def _load(chunk, sd: dict[str, torch.Tensor], shape) -> None:
    from jetrl_megatron.megatron.model import unwrap

    params = dict(unwrap(chunk).named_parameters())
    with torch.no_grad():
        for pmap in layout.stage_param_maps(shape):
            params[pmap.megatron].copy_(layout.hf_to_megatron_shard(pmap, [sd[n] for n in pmap.hf], shape, 1, 0))


def setup_model_and_optimizer(policy_cfg, megatron_cfg, load_optimizer=True, get_embedding_ranks=None,
                              get_position_embedding_ranks=None, pre_load_checkpoint_hook=None,
                              additional_pre_wrap_hooks=None, *, checkpoint: str = "policy"):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    chunk = megatron_cfg.model.provide(pre_process=True, post_process=True)
    model = Float16Module(chunk.config, chunk)
    ddp = DistributedDataParallel(
        config=chunk.config, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=True, overlap_param_gather=True,
                                                 check_for_nan_in_grad=False))
    _load(ddp, CHECKPOINTS[checkpoint], megatron_cfg.shape)  # the checkpoint load, after the build
    optimizer = None
    if load_optimizer:
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=3e-2, bf16=True, params_dtype=torch.bfloat16, loss_scale=1.0,
                            use_distributed_optimizer=True, clip_grad=1.0), [ddp])
    return ModelAndOptimizerState(None, ddp, optimizer)


def setup_reference_model_state(config, megatron_cfg, pretrained_path, pre_load_checkpoint_hook=None):
    ref = setup_model_and_optimizer(config, megatron_cfg, False, checkpoint="reference").model
    return {k: v.detach().clone() for k, v in ref.state_dict().items() if isinstance(v, torch.Tensor)}


class MegatronPolicyWorkerImpl:
    def __init__(self, config, tokenizer=None, weights_path=None, optimizer_path=None, init_optimizer=True,
                 init_reference_model=True, *, worker_sharding_annotations=None, **kwargs):
        module = sys.modules[__name__ + "_mpw"]
        self.cfg = config
        megatron_cfg = self.megatron_cfg = types.SimpleNamespace(model=Provider(), shape=kwargs["shape"])
        state = module.setup_model_and_optimizer(config, megatron_cfg, init_optimizer)
        self.model, self.optimizer = state.model, state.optimizer
        if init_reference_model:
            self.reference_state_dict = module.setup_reference_model_state(config, megatron_cfg, None)

    def _calculate_refit_param_info(self):
        raise AssertionError("NeMo-RL's Megatron-Bridge conversion tasks ran")

    def _iter_params_with_optional_kv_scales(self, kv_scales=None):
        raise AssertionError("NeMo-RL's Megatron-Bridge export ran")

    def prepare_refit_info(self):
        self.refit_param_info_mcore = self._calculate_refit_param_info()
        return {name: (t.shape, t.dtype) for name, t in self._iter_params_with_optional_kv_scales()}

    def _apply_state_dict_to_model(self, source):
        for key, t in self.model.state_dict().items():
            if isinstance(t, torch.Tensor):
                t.copy_(source[key])

    @contextmanager
    def use_reference_model(self):
        with torch.no_grad():
            saved = {k: v.detach().clone() for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}
            self._apply_state_dict_to_model(self.reference_state_dict)
            yield
            self._apply_state_dict_to_model(saved)

    def train(self, data, loss_fn, eval_mode=False, gbs=None, mbs=None, check_dim_skip_keys=None):
        """NeMo-RL's signature; runs one backward over ``data`` (tokens) and reports what the backward saw: whether
        autograd would run it on its device threads (the thread-local switch, as the engine hands it to the hook)."""
        seen = []
        logits = self.model(input_ids=data, position_ids=None, attention_mask=None)
        logits.register_hook(lambda g: seen.append(torch._C._is_multithreading_enabled()))
        logits.float().square().mean().backward()
        self.model.zero_grad_buffer()
        return {"backward_multithreading": seen}

    def train_step(self, tokens: torch.Tensor) -> bool:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        logits = self.model(input_ids=tokens, position_ids=None, attention_mask=None)
        logits.float().square().mean().backward()
        self.model.finish_grad_sync()
        ok, _, _ = self.optimizer.step()
        return bool(ok)


def install() -> None:
    """Put stand-in ``ray`` and ``nemo_rl`` modules (with the names worker.py imports) into ``sys.modules``."""
    ray = types.ModuleType("ray")
    ray.remote = lambda **options: (lambda cls: cls)
    mpw = types.ModuleType("nemo_rl.models.policy.workers.megatron_policy_worker")
    mpw.MegatronPolicyWorkerImpl = MegatronPolicyWorkerImpl
    mpw.setup_model_and_optimizer = setup_model_and_optimizer
    mpw.setup_reference_model_state = setup_reference_model_state
    utils = types.ModuleType("nemo_rl.models.policy.utils")
    utils.get_runtime_env_for_policy_worker = lambda name: {}
    mods = {"ray": ray, "nemo_rl.models.policy.workers.megatron_policy_worker": mpw,
            "nemo_rl.models.policy.utils": utils, __name__ + "_mpw": mpw}
    for name in ("nemo_rl", "nemo_rl.models", "nemo_rl.models.policy", "nemo_rl.models.policy.workers"):
        mods[name] = types.ModuleType(name)
    mods["nemo_rl.models.policy.workers"].megatron_policy_worker = mpw
    mods["nemo_rl.models.policy"].utils = utils
    mods["nemo_rl.models.policy"].workers = mods["nemo_rl.models.policy.workers"]
    mods["nemo_rl.models"].policy = mods["nemo_rl.models.policy"]
    mods["nemo_rl"].models = mods["nemo_rl.models"]
    sys.modules.update(mods)


def policy_config(recipe=None, num_layers: int = 4, model_name: str = "tiny") -> dict:
    """A NeMo-RL ``policy`` section (the keys the Jet-RL worker reads) that the worker accepts."""
    from jetrl_megatron.nemo_rl.policy_cfg import jetrl_vllm_kwargs
    from jetrl_megatron.recipe import Fp8Recipe

    recipe = recipe or Fp8Recipe()
    return {
        "model_name": model_name,
        "megatron_cfg": {"enabled": True, "fp8_cfg": {"enabled": False}, "context_parallel_size": 1,
                         "num_layers_in_first_pipeline_stage": None, "num_layers_in_last_pipeline_stage": None,
                         "sequence_parallel": False, "peft": {"enabled": False}, "mtp_num_layers": 0},
        "sequence_packing": {"enabled": False},
        "draft": {"enabled": False},
        "generation": {"backend": "vllm",
                       "vllm_cfg": {"precision": "bfloat16", "kv_cache_dtype": "auto",
                                    "num_first_layers_in_bf16": recipe.bf16_first_layers,
                                    "num_last_layers_in_bf16": recipe.bf16_last_layers},
                       "vllm_kwargs": jetrl_vllm_kwargs(recipe, num_layers)},
    }
