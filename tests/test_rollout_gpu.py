"""GPU rollout engine (real vLLM on CUDA): colocated sleep / wake and tensor parallelism, on a small random Qwen3.

Run on the H200 machine with vLLM 0.26 installed (docs/vllm_gpu.md); skipped without CUDA or without vLLM.
- sleep(level=1) must release GPU memory (weights offloaded, KV cache freed) and wake_up() must restore the exact
  weights: the same seeded generation afterwards gives the same tokens and logprobs, bit for bit, and a refit after
  wake_up is served. After sleep(level=2) (weights discarded) a refit of the same weights must restore every byte.
  A wake-up the GPU has no room for fails with one line naming the memory and the keys (rl/engine_wake.py).
- A TP=2 engine (two GPUs) serves the same FP8 model: its prompt logprobs agree with the TP=1 engine's within a
  stated bound (not bit for bit: the row-parallel all-reduce changes the summation order), and a refit reaches
  both ranks (the logprobs move to the new weights' TP=1 values).
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.own_process,  # each test's engines in a fresh process (sleep mode's allocator is one per process)
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]

# Stock block-FP8 vs the plugin on the same checkpoint: same bytes, same kernels (measured bit-identical on the H200).
TP_MEAN_ABS_BOUND = 0.02
# TP=2 vs TP=1: the row-parallel layers reduce BF16 partial sums across ranks, and FP8 re-quantization of the next
# layer's input amplifies those roundings (measured mean |dlogp| 4.5e-2 on this model). The check is relative: TP=2
# must sit much closer to TP=1 on the same weights than two different weight sets sit apart from each other.
TP_REL_BOUND = 0.25


def _model(tmp_path, seed: int = 0):
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.rollout.model_dir import write_tiny_model_dir

    return write_tiny_model_dir(tmp_path / f"m{seed}", preset="tiny", seed=seed, recipe=Fp8Recipe(), logit_std=1.0)


def _engine(model_dir, tp: int = 1, sleep: bool = False):
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine

    return RolloutEngine(RolloutConfig(model_dir=str(model_dir), recipe=Fp8Recipe(), tensor_parallel_size=tp,
                                       gpu_memory_utilization=0.25, max_num_seqs=16, enable_sleep_mode=sleep,
                                       max_model_len=256, fp8_gemm_warmup=False))  # JIT on demand keeps tests short


def _prompts(n: int = 6, length: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n, length), generator=g).tolist()


def test_sleep_wake_restores_weights_and_serves_refits(tmp_path):
    from jetrl_megatron.rollout.model_dir import load_state_dict

    engine = _engine(_model(tmp_path), sleep=True)
    try:
        before = engine.generate(_prompts(), n=2, max_tokens=16, seed=11, ignore_eos=True)
        free_awake = torch.cuda.mem_get_info()[0]
        assert engine.sleep(level=1)
        free_asleep = torch.cuda.mem_get_info()[0]
        assert free_asleep > free_awake + (64 << 20), (free_awake, free_asleep)
        assert engine.wake_up()
        after = engine.generate(_prompts(), n=2, max_tokens=16, seed=11, ignore_eos=True)
        assert [s.token_ids for s in after] == [s.token_ids for s in before]
        assert [s.logprobs for s in after] == [s.logprobs for s in before]

        seqs = [s.prompt_token_ids + s.token_ids for s in before]
        old = torch.tensor(engine.score(seqs))
        engine.sleep(level=1)
        engine.wake_up()
        engine.refit(load_state_dict(_model(tmp_path, seed=1)))
        new = torch.tensor(engine.score(seqs))
        assert (new - old).abs().mean() > 0.05, "refit after wake_up not served"
    finally:
        engine.shutdown()


def test_level2_sleep_then_a_refit_serves_the_same_bytes(tmp_path):
    """``policy.jet_rl.engine_sleep_level: 2``: vLLM discards the weights while the trainer runs (no host backup) and
    keeps the model's buffers; the in-place refit after wake_up must rewrite every parameter, so the engine then
    serves exactly what it served before sleeping (a parameter the refit missed would hold garbage). Also: the
    discarded weights give back more GPU memory than the KV cache alone."""
    from jetrl_megatron.rollout.model_dir import load_state_dict

    model_dir = _model(tmp_path)
    engine = _engine(model_dir, sleep=True)
    try:
        before = engine.generate(_prompts(), n=2, max_tokens=16, seed=11, ignore_eos=True)
        seqs = [s.prompt_token_ids + s.token_ids for s in before]
        scores = engine.score(seqs)
        free_awake = torch.cuda.mem_get_info()[0]
        assert engine.sleep(level=2)
        free_asleep = torch.cuda.mem_get_info()[0]
        assert free_asleep > free_awake + (64 << 20), (free_awake, free_asleep)
        assert engine.wake_up()
        engine.refit(load_state_dict(model_dir))
        after = engine.generate(_prompts(), n=2, max_tokens=16, seed=11, ignore_eos=True)
        assert [s.token_ids for s in after] == [s.token_ids for s in before]
        assert [s.logprobs for s in after] == [s.logprobs for s in before]
        assert engine.score(seqs) == scores
    finally:
        engine.shutdown()


def test_an_engine_that_cannot_wake_names_the_memory_and_the_keys(tmp_path):
    """With the GPU filled while the engine sleeps (as the trainer's state filled an 80 GB card at 8B, 2026-12-05),
    vLLM's real out-of-memory failure at wake-up reaches the loop as one line naming the KV budget and the keys."""
    from jetrl_megatron.rl.config import load_config
    from jetrl_megatron.rl.engine_wake import EngineWakeOutOfMemory, wake_engine

    cfg = load_config("qwen3_8b_1gpu", [f"policy.generation.vllm_kwargs.kv_cache_memory_bytes={12 << 30}"])
    engine = _engine(_model(tmp_path), sleep=True)
    try:
        assert engine.sleep(level=1)
        filler = torch.empty(torch.cuda.mem_get_info()[0] - (256 << 20), dtype=torch.uint8, device="cuda")
        expected = r"kv_cache_memory_bytes = 12\.0 GiB.*GPU had 0\.\d+ of "
        with pytest.raises(EngineWakeOutOfMemory, match=expected) as info:
            wake_engine(engine.wake_up, cfg)
        # the filler is a tensor of torch's default pool: the message counts it among the trainer's tensors
        tensors = float(re.search(r"the trainer's tensors (\d+\.\d) GiB", str(info.value)).group(1))
        assert tensors >= filler.numel() / (1 << 30) - 0.1, str(info.value)
        del filler
    finally:
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - a half-woken engine may not shut down cleanly; its process ends here
            pass


def test_a_decode_at_max_num_seqs_off_vllms_grid_replays_a_full_graph(tmp_path):
    """vLLM 0.26 captures decode graphs at 1, 2, 4, 8, 16, 24, ... up to max_num_seqs: at max_num_seqs 21 (a KV budget
    holding 21 4K-token Qwen3-8B sequences) a 17-21-wide decode ran eager. The engine adds max_num_seqs to the capture
    sizes (rollout/compilation.py): vLLM's own dispatcher then picks a full graph for 21 and for 18."""
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine

    engine = RolloutEngine(RolloutConfig(model_dir=str(_model(tmp_path)), recipe=Fp8Recipe(), max_num_seqs=21,
                                         gpu_memory_utilization=0.25, max_model_len=256, enforce_eager=False,
                                         fp8_gemm_warmup=False))
    try:
        sizes = engine.llm.llm_engine.vllm_config.compilation_config.cudagraph_capture_sizes
        assert 21 in sizes and 16 in sizes, sizes
        assert engine.decode_graph == "FULL"
        assert engine.llm.collective_rpc("jetrl_decode_graph_mode", args=(18,))[0] == "FULL"
        out = engine.generate(_prompts(n=21), max_tokens=4, temperature=1.0, seed=3, ignore_eos=True)
        assert len(out) == 21 and all(len(s.token_ids) == 4 for s in out)
    finally:
        engine.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_engine_matches_tp1_and_refits_both_ranks(tmp_path):
    from jetrl_megatron.rollout.model_dir import load_state_dict

    dir0, dir1 = _model(tmp_path, 0), _model(tmp_path, 1)
    seqs = [p + q for p, q in zip(_prompts(seed=1), _prompts(seed=2), strict=True)]
    ref = {}
    for tag, d in (("w0", dir0), ("w1", dir1)):
        e1 = _engine(d, tp=1)
        try:
            ref[tag] = torch.tensor(e1.score(seqs))
        finally:
            e1.shutdown()
    apart = (ref["w0"] - ref["w1"]).abs().mean().item()
    print(f"TP1: weight set 0 vs 1 mean |dlogp| {apart:.2e}")
    assert apart > 0.05  # the two weight sets are distinguishable

    e2 = _engine(dir0, tp=2)
    try:
        got0 = torch.tensor(e2.score(seqs))
        d0 = (got0 - ref["w0"]).abs().mean().item()
        print(f"TP2 vs TP1 mean |dlogp| {d0:.2e}, max {(got0 - ref['w0']).abs().max().item():.2e}")
        assert d0 < TP_REL_BOUND * apart
        e2.refit(load_state_dict(dir1))
        got1 = torch.tensor(e2.score(seqs))
        d1 = (got1 - ref["w1"]).abs().mean().item()
        print(f"TP2 after refit vs TP1 on the new weights mean |dlogp| {d1:.2e}")
        assert d1 < TP_REL_BOUND * apart
    finally:
        e2.shutdown()


# (scale format exported, VLLM_USE_DEEP_GEMM_E8M0 for stock vLLM: None = vLLM's default, which is 1 on Hopper,
#  whether stock vLLM must then serve the plugin's logprobs bit for bit)
EXPORT_CASES = [("fp32", "0", True), ("pow2", None, True), ("fp32", None, False)]


@pytest.mark.parametrize(("scale_fmt", "e8m0", "exact"), EXPORT_CASES,
                         ids=["fp32-e8m0_off", "pow2-vllm_default", "fp32-vllm_default"])
def test_exported_checkpoint_in_stock_vllm_block_fp8(tmp_path, monkeypatch, scale_fmt, e8m0, exact):
    """`jetrl export` output is a standard block-FP8 checkpoint that stock vLLM's `fp8` method loads on GPU.

    Stock vLLM serves the plugin's logprobs bit for bit when it keeps the scales: with FP32 scales only under
    ``VLLM_USE_DEEP_GEMM_E8M0=0``; with vLLM's Hopper default (E8M0 on) it rounds weight and activation scales up
    to powers of two, which changes nothing only for a ``scale_fmt: pow2`` export. The third case measures the
    gap a user gets with FP32 scales and vLLM's defaults (reported, not required to be zero)."""
    from vllm import LLM, SamplingParams

    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.reshard_cli import export_main
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.model_dir import write_tiny_model_dir

    # vLLM's DeepGEMM warm-up JIT-compiles kernels for every M bucket on a cold cache (~4 min per shape set); the
    # logprobs compared below are the same with the kernels compiled on first use, so the test skips it
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "skip")
    if e8m0 is None:
        monkeypatch.delenv("VLLM_USE_DEEP_GEMM_E8M0", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_DEEP_GEMM_E8M0", e8m0)
    bf16_dir = write_tiny_model_dir(tmp_path / "bf16", preset="tiny", seed=3, logit_std=1.0)
    out = tmp_path / "fp8"
    assert export_main(["--from-hf", str(bf16_dir), "--out", str(out), "--scale-fmt", scale_fmt]) == 0
    seqs = [p + q for p, q in zip(_prompts(seed=4), _prompts(seed=5), strict=True)]

    # cuda_norms "vllm": the plugin engine keeps vLLM's own norm kernels, as the stock engine below runs them, so the
    # comparison is of the FP8 linears alone
    engine = RolloutEngine(RolloutConfig(model_dir=str(out), recipe=Fp8Recipe(scale_fmt=scale_fmt),
                                         gpu_memory_utilization=0.25, max_num_seqs=16, max_model_len=256,
                                         fp8_gemm_warmup=False, cuda_norms="vllm"))
    try:
        ours = torch.tensor(engine.score(seqs))
    finally:
        engine.shutdown()
    llm = LLM(model=str(out), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              gpu_memory_utilization=0.25, max_model_len=256, max_num_seqs=16)
    try:
        import vllm.envs as envs

        e8m0_in_effect = bool(envs.VLLM_USE_DEEP_GEMM_E8M0)
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        method = type(model.model.layers[0].self_attn.qkv_proj.quant_method).__name__
        assert "Fp8" in method and "JetRL" not in method, method  # vLLM's own block-FP8 path, not the plugin
        outs = llm.generate([{"prompt_token_ids": s} for s in seqs],
                            SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
        stock = torch.tensor([[step[t].logprob for step, t in zip(o.prompt_logprobs[1:], s[1:], strict=True)]
                              for o, s in zip(outs, seqs, strict=True)])
    finally:
        from vllm.distributed import cleanup_dist_env_and_memory

        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
    d = (stock - ours).abs()
    print(f"\nexport scale_fmt={scale_fmt}, VLLM_USE_DEEP_GEMM_E8M0={e8m0 or 'default'} (in effect: {e8m0_in_effect}):"
          f" stock {method} vs jetrl plugin: mean |dlogp| {d.mean():.2e}, max {d.max():.2e}, "
          f"exact {(d == 0).double().mean():.3f}")
    if exact:
        assert torch.equal(stock, ours), (d.mean().item(), d.max().item())
    else:
        assert d.mean() < 0.5  # sanity only: the same model, scales rounded to powers of two


def _record(name: str, stats: dict) -> None:
    """Append this run's numbers to $JETRL_GPU_REPORT_DIR/<name>.jsonl (with the vLLM version), when set."""
    import json
    import os

    import vllm

    out = os.environ.get("JETRL_GPU_REPORT_DIR")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.jsonl"), "a") as f:
            f.write(json.dumps({"vllm": vllm.__version__, **stats}) + "\n")


def test_plugin_serves_the_trainer_fp8_bytes_and_refits_by_both_loader_paths(tmp_path):
    """The `jetrl_fp8` plugin on this vLLM: a model directory written from the Megatron trainer's FP8 cache is
    served; the bytes it serves are the trainer's (read-back checksum of every parameter); its prompt logprobs track
    the trainer's FP8 forward (GPU vLLM runs its own element-wise kernels, so the bound is relative: much closer to
    the trainer on the same weights than two weight sets are to each other); a refit through vLLM's
    ``reload_weights`` (this project's loop) and through the model's plain ``load_weights`` (NeMo-RL's vLLM worker)
    serves the new trainer bytes, identically."""
    from jetrl_megatron.megatron import cpu
    from jetrl_megatron.megatron.convert import load_hf_checkpoint
    from jetrl_megatron.megatron.model import build_gpt, rollout_weights, token_logprobs
    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.reshard.mover import MegatronShards, iter_canonical
    from jetrl_megatron.rollout.model_dir import hf_config_for, random_hf_state_dict, write_model_dir

    recipe, shape = Fp8Recipe(), get_model_shape("tiny")
    cpu.init_parallel(1, 1)
    gpt = build_gpt(shape, recipe)
    seqs = [p + q for p, q in zip(_prompts(seed=1), _prompts(seed=2), strict=True)]
    tokens = torch.tensor(seqs, device="cuda")

    def trainer_side(seed: int) -> tuple[dict, torch.Tensor]:
        load_hf_checkpoint(gpt, random_hf_state_dict(shape, seed=seed, logit_std=1.0))  # refreshes the FP8 cache
        local = {k: v.cpu().clone() for k, v in rollout_weights(gpt).items()}  # the cache's bytes + BF16 tensors
        canonical = dict(iter_canonical(MegatronShards(shape, 1, 1, None, {(0, 0, 0): local})))
        return canonical, token_logprobs(gpt, tokens).float().cpu()

    w0, lp_train0 = trainer_side(0)
    w1, lp_train1 = trainer_side(1)
    apart = (lp_train0 - lp_train1).abs().mean().item()
    assert apart > 0.05, apart  # the two weight sets are distinguishable
    engine = _engine(write_model_dir(tmp_path / "m0", hf_config_for(shape, recipe), w0))
    try:
        served0 = torch.tensor(engine.score(seqs))
        d0 = (served0 - lp_train0).abs()
        engine.refit(w1, verify=True)  # reload_weights; every live parameter read back against the trainer's bytes
        served1 = torch.tensor(engine.score(seqs))
        d1 = (served1 - lp_train1).abs()
        engine.llm.apply_model(lambda model: model.load_weights(((k, v.cuda()) for k, v in w0.items())))
        engine.llm.reset_prefix_cache()
        plain0 = torch.tensor(engine.score(seqs))
    finally:
        engine.shutdown()
    stats = {"weights_apart_mean": apart, "initial_mean": d0.mean().item(), "initial_max": d0.max().item(),
             "refit_mean": d1.mean().item(), "refit_max": d1.max().item(),
             "load_weights_equals_initial": bool(torch.equal(plain0, served0))}
    print("trainer FP8 forward vs plugin:", stats)
    _record("plugin_vs_trainer", {**stats, "served0": served0.tolist(), "served1": served1.tolist()})
    assert d0.mean().item() < TP_REL_BOUND * apart and d1.mean().item() < TP_REL_BOUND * apart
    assert torch.equal(plain0, served0), "model.load_weights (NeMo-RL's path) served other logprobs than the start"
