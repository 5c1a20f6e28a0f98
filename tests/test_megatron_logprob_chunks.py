"""``policy.logprob_chunk_size``: the logits -> token logprobs step a chunk of positions at a time
(megatron/logprob_chunks.py) gives the whole computation's logprobs and gradients bit for bit, on every path of
``logprobs_from_logits`` (raw, temperature, top-k / top-p, vocab-parallel, TP 2), in a real training step, and holds
the memory ``jetrl plan`` says (live tensor bytes measured op by op)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from jetrl_megatron.sampling import LogitsSampling

SAMPLINGS = {
    "raw": None,
    "temperature": LogitsSampling(temperature=0.7),
    "top_k_top_p": LogitsSampling(temperature=0.9, top_k=17, top_p=0.9),
}
CHUNKS = (1, 3, 8, 9, 40)  # 9 = s - 1 of the cases below: one chunk, the whole path itself


def _case(b=3, s=10, v=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, s, v, generator=g) * 3).to(torch.bfloat16)
    tokens = torch.randint(0, v, (b, s), generator=g)
    tokens[:, 1::2] = logits[:, :-1:2].float().argmax(-1)  # every other token the most likely: kept by any filter
    grad_out = torch.randn(b, s - 1, generator=g)
    return logits, tokens, grad_out


def _logprobs_and_grad(logits, tokens, grad_out, **kw):
    from jetrl_megatron.megatron.model import logprobs_from_logits

    x = logits.clone().requires_grad_(True)
    lp = logprobs_from_logits(x, tokens, x.shape[-1], **kw)
    lp.backward(torch.where(torch.isinf(lp), torch.zeros_like(grad_out), grad_out))
    return lp.detach(), x.grad


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunks_give_the_whole_logprobs_and_gradients_bit_for_bit(mp, sampling, chunk):
    logits, tokens, grad_out = _case(seed=CHUNKS.index(chunk))
    whole = _logprobs_and_grad(logits, tokens, grad_out, sampling=SAMPLINGS[sampling])
    parts = _logprobs_and_grad(logits, tokens, grad_out, sampling=SAMPLINGS[sampling], chunk=chunk)
    assert torch.equal(parts[0], whole[0]), "logprobs differ"
    assert torch.equal(parts[1], whole[1]), "gradients differ"
    assert torch.isfinite(whole[1]).all() and whole[1].abs().sum() > 0
    with torch.no_grad():  # the logprob pass: no autograd, nothing recomputed
        from jetrl_megatron.megatron.model import logprobs_from_logits

        assert torch.equal(logprobs_from_logits(logits, tokens, 200, sampling=SAMPLINGS[sampling], chunk=chunk),
                           whole[0])


def test_chunked_logprobs_and_gradients_match_an_fp64_reference(mp):
    """Independent of the whole path: log_softmax of the temperature-scaled logits in FP64, and its gradient
    (onehot - softmax) * g / T, against the chunked results (FP32 rounding apart)."""
    logits, tokens, grad_out = _case(b=2, s=13, v=150, seed=7)
    t = 0.8
    lp, grad = _logprobs_and_grad(logits, tokens, grad_out, sampling=LogitsSampling(temperature=t), chunk=5)
    z = logits[:, :-1].double() / t
    want = torch.log_softmax(z, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert torch.allclose(lp.double(), want, rtol=0, atol=2e-5)
    onehot = torch.nn.functional.one_hot(tokens[:, 1:], 150).double()
    want_grad = (onehot - torch.softmax(z, -1)) * grad_out[..., None].double() / t
    assert torch.allclose(grad[:, :-1].double(), want_grad, rtol=0, atol=1e-2 * want_grad.abs().max().item())
    assert torch.equal(grad[:, -1], torch.zeros_like(grad[:, -1]))  # the last position scores no token


def test_vocab_parallel_path_chunks_bit_for_bit(mp):
    logits, tokens, grad_out = _case(b=2, s=12, v=256, seed=3)
    whole = _logprobs_and_grad(logits, tokens, grad_out, vocab_parallel=True)
    parts = _logprobs_and_grad(logits, tokens, grad_out, vocab_parallel=True, chunk=4)
    assert torch.equal(parts[0], whole[0]) and torch.equal(parts[1], whole[1])


def test_a_chunk_below_one_is_refused(mp):
    from jetrl_megatron.megatron.model import logprobs_from_logits

    logits, tokens, _ = _case()
    with pytest.raises(ValueError, match="logprob_chunk_size must be a positive number"):
        logprobs_from_logits(logits, tokens, 200, chunk=0)


def test_the_config_key_is_bounded():
    from jetrl_megatron.rl.config import load_config

    assert load_config("tiny_cpu").policy.logprob_chunk_size is None
    assert load_config("tiny_cpu", ["policy.logprob_chunk_size=64"]).policy.logprob_chunk_size == 64
    with pytest.raises(Exception, match="policy.logprob_chunk_size"):
        load_config("tiny_cpu", ["policy.logprob_chunk_size=0"])


def _tp2_rank(rank: int, world_size: int, out: str) -> None:
    from megatron.core.tensor_parallel.mappings import scatter_to_tensor_model_parallel_region

    from jetrl_megatron.megatron.cpu import init_parallel
    from jetrl_megatron.megatron.model import logprobs_from_logits

    init_parallel(2, 1)
    logits, tokens, grad_out = _case(b=2, s=11, v=256, seed=11)
    results = {}
    for vocab_parallel in (False, True):
        for chunk in (None, 3):
            x = scatter_to_tensor_model_parallel_region(logits).clone().requires_grad_(True)
            lp = logprobs_from_logits(x, tokens, 256, vocab_parallel=vocab_parallel, chunk=chunk)
            lp.backward(grad_out)
            results[(vocab_parallel, chunk)] = (lp.detach(), x.grad)
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_tp2_chunks_bit_for_bit(tmp_path):
    """The TP gather (and the vocab-parallel cross entropy's all-reduces) run inside each chunk on both ranks."""
    from jetrl_megatron.megatron.cpu import spawn

    spawn(_tp2_rank, 2, str(tmp_path))
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        for vp in (False, True):
            (lp_w, g_w), (lp_c, g_c) = res[(vp, None)], res[(vp, 3)]
            assert torch.equal(lp_c, lp_w) and torch.equal(g_c, g_w), (rank, vp)
            assert g_w.shape[-1] == 128 and g_w.abs().sum() > 0


class LiveTensorBytes(TorchDispatchMode):
    """The peak bytes of tensor storages that ops create while the mode is on (a storage is counted from the op that
    creates it until it is freed; storages that existed before, and views of them, are not)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._live: dict[int, int] = {}
        self._before: set[int] = set()

    def _freed(self, key: int) -> None:
        self.now -= self._live.pop(key, 0)

    def _storages(self, tree):
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                yield t.untyped_storage()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for st in self._storages((args, kwargs)):
            if id(st) not in self._live and id(st) not in self._before:
                self._before.add(id(st))
                weakref.finalize(st, self._before.discard, id(st))
        out = func(*args, **(kwargs or {}))
        for st in self._storages(out):
            key = id(st)
            if key not in self._live and key not in self._before and st.nbytes():
                self._live[key] = st.nbytes()
                self.now += st.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(st, self._freed, key)
        return out


PATHS = {  # the trainer's torch logprob paths (no GPU vLLM here), as config overrides and what the step computes
    "raw": ([], None, False),
    "temperature": (["policy.generation.temperature=0.7"], LogitsSampling(temperature=0.7), False),
    "top_k_top_p": (["policy.generation.temperature=0.7", "policy.generation.top_k=50", "policy.generation.top_p=0.9"],
                    LogitsSampling(temperature=0.7, top_k=50, top_p=0.9), False),
    "top_p_with_kl": (["policy.generation.top_p=0.9", "loss_fn.reference_policy_kl_penalty=0.01"],
                      LogitsSampling(top_p=0.9), True),
}


@pytest.mark.parametrize("shape", [(2, 257, 2048), (8, 801, 1024)], ids=["512rows", "6400rows"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("chunk", [None, 64, 16])
def test_the_plan_counts_the_logits_peak_the_code_holds(mp, chunk, path, shape):
    """Update: the output layer's logits (a BF16 GEMM on (s, b, h), transposed as GPTModel hands them out), the
    logprobs (twice under a filter with the KL term: filtered and temperature-only, as the loss takes them) and their
    backward down to the logits' gradient; logprob pass: the same forward under no_grad. Live tensor bytes measured
    op by op against plan_terms.update_logits_bytes / logprob_logits_bytes."""
    from jetrl_megatron.megatron.model import logprobs_from_logits
    from jetrl_megatron.rl.config import load_config
    from jetrl_megatron.rl.tools import plan_terms

    b, s, v = shape
    overrides, sampling, with_kl = PATHS[path]
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(s, b, 32, generator=g).to(torch.bfloat16).requires_grad_(True)  # Megatron's (s, b, h)
    weight = (torch.randn(v, 32, generator=g) / 6).to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, v, (b, s), generator=g)
    grad_out = torch.randn(b, s - 1, generator=g)
    overrides = ["policy.jet_rl.attn_impl=fp32", *overrides]
    cfg = load_config("tiny_cpu", overrides + ([] if chunk is None else [f"policy.logprob_chunk_size={chunk}"]))
    def model_logits():  # GPTModel's output layer on (s, b, h), handed out as a contiguous (b, s, V) copy
        return (hidden @ weight.t()).transpose(0, 1).contiguous()

    with LiveTensorBytes() as update:
        logits = model_logits()
        lp = logprobs_from_logits(logits, tokens, v, sampling=sampling, chunk=chunk)
        loss = (torch.where(torch.isinf(lp), 0.0, lp) * grad_out).sum()
        if with_kl:
            loss = loss + (logprobs_from_logits(logits, tokens, v, sampling=sampling.unfiltered(), chunk=chunk)
                           * grad_out).sum()
        del logits, lp
        loss.backward()
    with torch.no_grad(), LiveTensorBytes() as logprob:
        logprobs_from_logits(model_logits(), tokens, v, sampling=sampling, chunk=chunk)
    planned_update = plan_terms.update_logits_bytes(cfg, b, s, v, 1)
    planned_logprob = plan_terms.logprob_logits_bytes(cfg, b, s, v, 1)
    assert 0.9 * planned_update <= update.peak <= 1.1 * planned_update, (update.peak, planned_update)
    assert 0.9 * planned_logprob <= logprob.peak <= 1.1 * planned_logprob, (logprob.peak, planned_logprob)
    if chunk == 16 and path == "raw":  # the point of the knob: the 12 B per entry of the whole become ~4
        assert update.peak < 0.45 * plan_terms.update_logits_bytes(load_config("tiny_cpu", overrides), b, s, v, 1)


def test_a_training_step_with_chunks_equals_one_without(mp):
    """A real Megatron step on the tiny model: the same loss, the same gradients and the same updated weights with
    the logprobs in chunks of 3 positions as without."""
    from jetrl_megatron.megatron.model import token_logprobs, train_step, unwrap
    from jetrl_megatron.megatron.policy import build_policy
    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.recipe import Fp8Recipe

    shape = get_model_shape("tiny")
    toks = torch.randint(0, shape.vocab_size, (4, 12), generator=torch.Generator().manual_seed(2))
    out = {}
    for chunk in (None, 3):
        policy = build_policy(shape, Fp8Recipe(), seed=0, optimizer={"lr": 1e-2})
        res = train_step([policy.model], policy.optimizer, {"tokens": toks}, lambda lp, mb: (-lp.mean(), {}),
                         micro_batch_size=2, logprob_chunk=chunk)
        assert not res.skipped
        weights = {n: p.detach().clone() for n, p in unwrap(policy.model).named_parameters()}
        out[chunk] = (res.loss, res.grad_norm, weights,
                      token_logprobs(policy.model, toks, micro_batch_size=2, logprob_chunk=chunk))
    (loss_w, norm_w, w_w, lp_w), (loss_c, norm_c, w_c, lp_c) = out[None], out[3]
    assert loss_c == loss_w and norm_c == norm_w
    assert all(torch.equal(w_c[n], w_w[n]) for n in w_w)
    assert torch.equal(lp_c, lp_w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_cuda_logprobs_chunk_bit_for_bit_in_the_memory_the_plan_says(mp, temperature):
    """GPU vLLM's logprob kernels (``_VllmCudaLogprobFn``, the exact path on CUDA) in chunks of 64 positions: the
    same logprobs and gradients as the whole, and the CUDA allocator's peak against plan_terms (16 B per entry whole;
    4 B plus one chunk's 16 chunked) at a Qwen3-sized vocabulary."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM")
    from jetrl_megatron.megatron.model import logprobs_from_logits
    from jetrl_megatron.rl.config import load_config
    from jetrl_megatron.rl.tools import plan_terms

    b, s, v, h = 2, 513, 151936, 256
    g = torch.Generator(device="cuda").manual_seed(9)
    hidden = torch.randn(b, s, h, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda", generator=g) / 8).to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, v, (b, s), device="cuda", generator=g)
    grad_out = torch.randn(b, s - 1, device="cuda", generator=g)
    sampling = LogitsSampling(temperature=temperature)
    results, peaks = {}, {}
    for chunk in (None, 64):
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        lp = logprobs_from_logits(hidden @ weight.t(), tokens, v, sampling=sampling, vllm_cuda=True, chunk=chunk)
        lp.backward(grad_out)
        torch.cuda.synchronize()
        peaks[chunk] = torch.cuda.max_memory_allocated() - base
        results[chunk] = (lp.detach(), hidden.grad.clone(), weight.grad.clone())
    assert all(torch.equal(x, y) for x, y in zip(results[64], results[None], strict=True))
    for chunk, peak in peaks.items():
        cfg = load_config("tiny_cpu", [] if chunk is None else [f"policy.logprob_chunk_size={chunk}"])
        planned = plan_terms.update_logits_bytes(cfg, b, s, v, 1)
        assert 0.9 * planned <= peak <= 1.1 * planned, (chunk, peak, planned)
