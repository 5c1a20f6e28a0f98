"""The Jet-RL model inside a host trainer (``nemo_rl/hosted_policy.py``), on CPU with a real Megatron-Core model.

* Checkpoint names: with the TE names applied, the chunk's distributed-checkpoint keys and global shapes are exactly
  those of Megatron-Core's local-spec GPT (whose mapping matches the TransformerEngine spec that Megatron-Bridge's HF
  import writes); without them they differ.
* Megatron's ``Float16Module`` (which Megatron-Bridge wraps every chunk in) leaves the forward bit-identical.
* One FP8 refresh per optimizer step under Megatron's distributed optimizer with ``overlap_param_gather`` (NeMo-RL's
  default), DP=2 on gloo: after each successful step every rank's cache holds the 128x128 reference quantization of
  the all-gathered weights, also after the deferred gather. The control — refreshing right after ``step()``
  without forcing the gather — leaves a cache that disagrees with the weights the next forward reads. A step with
  non-finite gradients is skipped and leaves the cache untouched.
"""

from __future__ import annotations

import os

import pytest
import torch
from megatron_helpers import hf_state, tiny_shape

from jetrl_megatron.fp8.quant import quantize_128x128
from jetrl_megatron.megatron.cpu import spawn
from jetrl_megatron.model import layout
from jetrl_megatron.recipe import Fp8Recipe


def _sharded_keys(model) -> set[tuple]:
    """(checkpoint key, global shape, offset) of every sharded tensor (objects: key and type), as saved / loaded."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {(v.key, tuple(v.global_shape), tuple(v.global_offset)) if isinstance(v, ShardedTensor)
            else (v.key, type(v).__name__) for v in model.sharded_state_dict().values()}


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_checkpoint_keys_are_megatron_local_spec_keys(mp, family):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from jetrl_megatron.megatron.model import build_gpt
    from jetrl_megatron.nemo_rl.hosted_policy import build_policy_chunk

    shape = tiny_shape(family)
    ours = build_policy_chunk(shape, Fp8Recipe())
    spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, normalization="RMSNorm")
    ref = GPTModel(config=ours.config, transformer_layer_spec=spec, vocab_size=ours.vocab_size,
                   max_sequence_length=shape.max_position_embeddings, position_embedding_type="rope",
                   share_embeddings_and_output_weights=shape.tie_word_embeddings)
    want = _sharded_keys(ref)
    assert _sharded_keys(ours) == want
    want_keys = {k[0] for k in want}
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in want_keys
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in want_keys
    plain = {k[0] for k in _sharded_keys(build_gpt(shape, Fp8Recipe()))}  # the control: this project's own names
    assert "decoder.layers.input_layernorm.weight" in plain and plain != want_keys


def test_float16_wrapper_keeps_the_forward_bit_identical(mp):
    """Megatron-Bridge wraps each chunk in Megatron's ``Float16Module``, which casts every floating buffer to BF16
    (the rotary tables are FP32 buffers holding BF16-rounded values): the logits must not change."""
    from megatron.core.transformer.module import Float16Module

    from jetrl_megatron.nemo_rl.hosted_policy import build_policy_chunk

    model = build_policy_chunk(tiny_shape("qwen3"), Fp8Recipe())
    toks = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(input_ids=toks, position_ids=None, attention_mask=None)
        wrapped = Float16Module(model.config, model)
        assert all(b.dtype == torch.bfloat16 for b in wrapped.buffers())
        out = wrapped(input_ids=toks, position_ids=None, attention_mask=None)
    assert out.dtype == torch.float32 and torch.equal(out, plain.float())


def test_chunk_builder_refuses_other_arms_and_virtual_pipeline(mp):
    from jetrl_megatron.nemo_rl.hosted_policy import ChunkBuilder

    shape = tiny_shape("qwen3")
    for mode in ("bf16", "bf16_train_fp8_rollout", "fake_quant"):
        with pytest.raises(ValueError, match=f"mode='{mode}'"):
            ChunkBuilder(shape, Fp8Recipe(mode=mode))()
    with pytest.raises(ValueError, match="vp_stage=1"):
        ChunkBuilder(shape, Fp8Recipe())(vp_stage=1)
    import copy

    builder = ChunkBuilder(shape, Fp8Recipe(), sequence_parallel=False)
    assert copy.deepcopy(builder) == builder  # Megatron-Bridge deep-copies its provider for the reference model


def test_hosted_models_follow_the_engine_ops_the_policy_asks_vllm_for(mp):
    """The hosted trainer's norms and SwiGLU are what its GPU engines were asked for, read from the very
    vllm_kwargs.hf_overrides entries vLLM reads: jetrl_vllm_kwargs writes them, policy_plan reads them back, the
    chunk builder hands them to the model's context; a non-boolean entry is refused naming it."""
    from nemo_rl_standin import policy_config

    from jetrl_megatron.nemo_rl.hosted_policy import ChunkBuilder
    from jetrl_megatron.nemo_rl.policy_cfg import PolicyConfigError, jetrl_vllm_kwargs, policy_plan

    shape = tiny_shape("qwen3")
    seen = {}
    for norms, forms in (("batch_invariant", False), ("vllm", True), ("batch_invariant", True)):
        policy = policy_config(num_layers=shape.num_layers)
        policy["generation"]["vllm_kwargs"] = jetrl_vllm_kwargs(Fp8Recipe(), shape.num_layers, cuda_norms=norms,
                                                                swiglu_fp8_forms=forms)
        plan = policy_plan(policy, shape)
        builder = ChunkBuilder.for_plan(plan)
        assert (plan.cuda_norms, plan.swiglu_fp8_forms) == (builder.cuda_norms, builder.swiglu_fp8_forms) == (
            norms, forms)
        seen[(norms, forms)] = builder().fp8_context.cuda_norms
    assert seen == {("batch_invariant", False): "batch_invariant", ("vllm", True): "vllm",
                    ("batch_invariant", True): "batch_invariant"}
    policy = policy_config(num_layers=shape.num_layers)
    policy["generation"]["vllm_kwargs"]["hf_overrides"]["jetrl_swiglu_fp8_forms"] = "yes"
    with pytest.raises(PolicyConfigError, match="hf_overrides.jetrl_swiglu_fp8_forms: 'yes'; must be true or false"):
        policy_plan(policy, shape)


def test_the_hosted_policy_reads_the_trainer_only_keys_of_policy_jet_rl_and_names_the_rest(mp, caplog):
    """`jetrl run` reads policy.jet_rl; NeMo-RL's driver hands the hosted worker the same YAML's policy. The keys
    that change only the trainer's backward (deterministic_backward, fuse_swiglu_grad_quant) reach the hosted model;
    the others (ops the engines run too, taken from hf_overrides there) are named once as unread and change
    nothing; a non-boolean value is refused by its key."""
    import logging

    from nemo_rl_standin import policy_config

    from jetrl_megatron.megatron.model import fp8_context
    from jetrl_megatron.megatron.numerics import RolloutCoreAttention
    from jetrl_megatron.nemo_rl.hosted_policy import ChunkBuilder
    from jetrl_megatron.nemo_rl.policy_cfg import PolicyConfigError, policy_plan

    shape = tiny_shape("qwen3")
    policy = policy_config(num_layers=shape.num_layers)
    with caplog.at_level(logging.WARNING, logger="jetrl_megatron.nemo_rl.policy_cfg"):
        plain = policy_plan(policy, shape)
        assert "policy.jet_rl" not in caplog.text
        block = {"deterministic_backward": True, "fuse_swiglu_grad_quant": True, "cuda_norms": "vllm"}
        with_block = policy_plan({**policy, "jet_rl": block}, shape)
    assert "policy.jet_rl.{cuda_norms}: not read by the NeMo-RL driver" in caplog.text
    assert (plain.deterministic_backward, plain.fuse_swiglu_grad_quant) == (False, False)
    assert (with_block.deterministic_backward, with_block.fuse_swiglu_grad_quant) == (True, True)
    assert with_block.cuda_norms == plain.cuda_norms == "batch_invariant"  # the engines' norms, not the block's
    for plan, on in ((plain, False), (with_block, True)):
        builder = ChunkBuilder.for_plan(plan)
        assert (builder.deterministic_backward, builder.fuse_swiglu_grad_quant) == (on, on)
        model = builder()
        attn = [m for m in model.modules() if isinstance(m, RolloutCoreAttention)]
        assert fp8_context(model).deterministic_backward is on
        assert len(attn) == shape.num_layers and all(m.deterministic_backward is on for m in attn)
    with pytest.raises(PolicyConfigError, match="policy.jet_rl.deterministic_backward: 'yes'; must be true or false"):
        policy_plan({**policy, "jet_rl": {"deterministic_backward": "yes"}}, shape)
    # where the worker's train() runs autograd's backward: the calling thread unless the block says device
    assert plain.backward_thread == with_block.backward_thread == "calling"
    assert policy_plan({**policy, "jet_rl": {"backward_thread": "device"}}, shape).backward_thread == "device"
    with pytest.raises(PolicyConfigError, match="policy.jet_rl.backward_thread: 'gpu'; must be 'calling' or 'device'"):
        policy_plan({**policy, "jet_rl": {"backward_thread": "gpu"}}, shape)
    with pytest.raises(PolicyConfigError, match="policy.jet_rl.fuse_swiglu_grad_quant: 1; must be true or false"):
        policy_plan({**policy, "jet_rl": {"fuse_swiglu_grad_quant": 1}}, shape)


# ------------------------------------------------------------------------------------------------ DP=2, gloo
STEPS = 2


def _check_cache(ddp, fp8_names: list[str]) -> dict[str, bool]:
    """name -> whether the cache holds the reference quantization of the current (local view of the) weight."""
    from jetrl_megatron.megatron.model import rollout_weights, unwrap

    served = rollout_weights(ddp)
    params = dict(unwrap(ddp).named_parameters())
    out = {}
    for n in fp8_names:
        q, s = quantize_128x128(params[n].detach(), Fp8Recipe())
        out[n] = bool(torch.equal(served[n].view(torch.uint8), q.view(torch.uint8)) and
                      torch.equal(served[n + "_scale_inv"], s))
    return out


def _train(rank: int, variant: str, sd) -> dict:
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from jetrl_megatron.megatron.model import fp8_linears, refresh_fp8_cache, rollout_weights, unwrap
    from jetrl_megatron.nemo_rl.hosted_policy import build_policy_chunk, refresh_fp8_after_each_step, refresh_fp8_now

    shape = tiny_shape("qwen3")
    gpt = build_policy_chunk(shape, Fp8Recipe())
    params = dict(gpt.named_parameters())
    with torch.no_grad():
        for pmap in layout.stage_param_maps(shape):
            params[pmap.megatron].copy_(layout.hf_to_megatron_shard(pmap, [sd[n] for n in pmap.hf], shape, 1, 0))
    refresh_fp8_cache(gpt)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=True, overlap_param_gather=True,
                                            check_for_nan_in_grad=False)
    ddp = DistributedDataParallel(config=gpt.config, ddp_config=ddp_cfg, module=gpt)
    refresh_fp8_now(ddp)  # DDP moved the parameters into its buffers
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-2, bf16=True, params_dtype=torch.bfloat16,
                                                 loss_scale=1.0, use_distributed_optimizer=True, clip_grad=1.0),
                                 [ddp])
    refreshes: list[list[int]] = []
    if variant == "hooked":
        refresh_fp8_after_each_step(opt, ddp, on_refresh=refreshes.append)
        with pytest.raises(RuntimeError, match="already installed"):
            refresh_fp8_after_each_step(opt, ddp)
    else:  # the control: re-quantize right after step(), without the deferred all-gather
        inner = opt.step

        def naive_step():
            result = inner()
            if result[0]:
                refreshes.append(refresh_fp8_now(ddp))
            return result

        opt.step = naive_step
    fp8_names = [f"{n}.weight" for n, _ in fp8_linears(ddp)]
    g = torch.Generator().manual_seed(100 + rank)
    records = []
    for step in range(STEPS + 1):
        bad = step == STEPS  # the last step has non-finite gradients
        toks = torch.randint(0, shape.vocab_size, (2, 128), generator=g)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        logits = ddp(input_ids=toks, position_ids=None, attention_mask=None)
        loss = logits.float().square().mean() * (float("nan") if bad else 1.0)
        loss.backward()
        ddp.finish_grad_sync()
        before = {n: t.clone() for n, t in rollout_weights(ddp).items() if n in fp8_names}
        ok, _, _ = opt.step()
        right_after = _check_cache(ddp, fp8_names)
        ddp.start_param_sync(force_sync=True)  # what the next forward's pre-hooks would do (no-op when gathered)
        after_gather = _check_cache(ddp, fp8_names)
        full = {n: p.detach().clone() for n, p in unwrap(ddp).named_parameters() if n in fp8_names}
        peers: list = [None] * dist.get_world_size()
        dist.all_gather_object(peers, {n: t.view(torch.int16) for n, t in full.items()})
        same_weights = all(torch.equal(peers[0][n], p[n]) for p in peers for n in fp8_names)
        unchanged = all(torch.equal(before[n].view(torch.uint8), t.view(torch.uint8))
                        for n, t in rollout_weights(ddp).items() if n in fp8_names)
        records.append({"ok": bool(ok), "right_after": right_after, "after_gather": after_gather,
                        "same_weights": same_weights, "cache_unchanged": unchanged, "refreshes": len(refreshes)})
    return {"records": records}


def _run(rank: int, world_size: int, out_dir: str) -> None:
    sd = hf_state(tiny_shape("qwen3"), seed=31, std=0.02)
    for variant in ("hooked", "naive"):
        res = _train(rank, variant, sd)
        torch.save(res, os.path.join(out_dir, f"{variant}-rank{rank}.pt"))


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("hosted")
    spawn(_run, 2, str(out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_one_refresh_per_step_from_the_gathered_weights(dp2, rank):
    records = torch.load(dp2 / f"hooked-rank{rank}.pt")["records"]
    for i, r in enumerate(records[:STEPS]):
        assert r["ok"], f"step {i} was skipped"
        assert r["refreshes"] == i + 1, "exactly one refresh per successful step"
        assert r["same_weights"], "DP ranks hold different weights after the gather"
        bad = [n for n, good in r["after_gather"].items() if not good]
        assert not bad, f"step {i}: the cache is not the quantization of the gathered weights: {bad[:4]}"
        assert all(r["right_after"].values())  # the hook gathered before quantizing
    skipped = records[STEPS]
    assert not skipped["ok"] and skipped["refreshes"] == STEPS and skipped["cache_unchanged"]


@pytest.mark.slow
def test_control_refresh_without_the_gather_serves_stale_bytes(dp2):
    """Without forcing the deferred all-gather, the cache disagrees with the weights of the next forward."""
    stale = []
    for rank in (0, 1):
        records = torch.load(dp2 / f"naive-rank{rank}.pt")["records"]
        for r in records[:STEPS]:
            assert r["ok"] and all(r["right_after"].values())  # consistent with the half-updated local buffer
            stale += [n for n, good in r["after_gather"].items() if not good]
    assert stale, "the control should have produced a stale FP8 cache"
