"""GPU: which of vLLM's ops give a token different bytes in a decode step than in a prefill? Op by op, at a model
shape, with the ops GPU vLLM 0.26 runs (jetrl_megatron.vllm_cuda.ops) and the plugin's FP8 linear.

Why: at the Qwen3-8B shape the trainer equals vLLM's prefill bit for bit, but vLLM's own decode differs from its
prefill (bench/RESULTS.md). A token's bytes in decode come from ops run on a batch of one token per running sequence
(M = the batch), its bytes in prefill (and in the trainer) from ops run on whole sequences (M = thousands of tokens),
and attention reads the KV cache one query at a time instead of in query tiles. This finds the op(s) whose output
for the same row depends on that, so the trainer can follow vLLM's decode where it must.

Per op, the fraction of rows bit-identical between the decode-shaped call and the prefill-shaped call, and the max
|difference|:
* RMSNorm and fused add + RMSNorm (hidden size), vLLM's and the batch-invariant kernels GPU engines run by default
  (`policy.jet_rl.cuda_norms`), SiLU-and-mul (FFN size): a row at M = 1..255 vs at M = 4096;
* the FP8 linear (the plugin's `fp8_linear_forward`, each backend and `auto` with the jetrl recipe) at M vs 4096;
* the BF16 linears (the bf16 arm's engine: torch `F.linear`) and the BF16 lm_head GEMM (vocab x hidden) at M vs 4096;
* the project's Triton SwiGLU (``swiglu_fp8_forms``) against vLLM's ``silu_and_mul`` on every BF16 gate value;
* FlashAttention 3 over the paged KV cache: vLLM's decode call (one query per sequence, `max_seqlen_q` 1,
  `seqused_k` = position + 1, the scheduler metadata for that batch, `num_splits` 1 or FA3's heuristic 0) vs the
  prefill call over the whole sequences, at several positions, per head configuration (the model's, and GQA 2).

    python3 bench/decode_invariance.py --preset qwen3-8b --out $OUT/decode_invariance.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jetrl_megatron.fp8 import quant_dispatch as fp8_ops  # noqa: E402
from jetrl_megatron.fp8.gemm import load_backend, resolve_backend  # noqa: E402
from jetrl_megatron.fp8.linear import fp8_linear_forward  # noqa: E402
from jetrl_megatron.model.shapes import get_model_shape  # noqa: E402
from jetrl_megatron.recipe import Fp8Recipe  # noqa: E402
from jetrl_megatron.rollout import invariant_norm  # noqa: E402
from jetrl_megatron.vllm_cuda import ops  # noqa: E402

M_DECODE = (1, 8, 16, 32, 64, 128, 255)
M_PREFILL = 4096


def compare(rows_small: torch.Tensor, rows_full: torch.Tensor) -> dict:
    """Fraction of rows with the same bytes, and the max |difference| (FP32)."""
    same = (rows_small == rows_full).all(dim=-1)
    return {"rows": int(same.numel()), "identical": float(same.float().mean()),
            "max_abs": float((rows_small.float() - rows_full.float()).abs().max())}


def by_m(fn, x_full: torch.Tensor) -> dict:
    """fn(x[:m]) against fn(x)[:m] for each decode M."""
    full = fn(x_full)
    return {m: compare(fn(x_full[:m].clone()), full[:m]) for m in M_DECODE}


def elementwise(shape, g) -> dict:
    h, f, eps = shape.hidden_size, shape.ffn_hidden_size, 1e-6
    x = torch.randn(M_PREFILL, h, generator=g, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(M_PREFILL, h, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(h, generator=g, device="cuda")).to(torch.bfloat16)
    gu = torch.randn(M_PREFILL, 2 * f, generator=g, device="cuda", dtype=torch.bfloat16)

    def fused(t: torch.Tensor) -> torch.Tensor:  # the normalised output; the residual (x + r) is stored alongside
        n = t.shape[0]
        out, res = ops.fused_add_rms_norm(t.clone(), r[:n].clone(), w, eps)
        return torch.cat((out, res), -1)

    def fused_invariant(t: torch.Tensor) -> torch.Tensor:
        return torch.cat(invariant_norm.rms_norm(t, w, eps, r[:t.shape[0]].clone()), -1)

    return {"rms_norm": by_m(lambda t: ops.rms_norm(t, w, eps), x), "fused_add_rms_norm": by_m(fused, x),
            "rms_norm batch_invariant": by_m(lambda t: invariant_norm.rms_norm(t, w, eps), x),
            "fused_add_rms_norm batch_invariant": by_m(fused_invariant, x),
            "silu_and_mul": by_m(ops.silu_and_mul, gu)}


def linears(shape, g, backends: list[str]) -> list[dict]:
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    out = []
    for name, (n, k) in {"qkv": (q + 2 * kv, shape.hidden_size), "o": (shape.hidden_size, q),
                         "gate_up": (2 * shape.ffn_hidden_size, shape.hidden_size),
                         "down": (shape.hidden_size, shape.ffn_hidden_size)}.items():
        w = torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(M_PREFILL, k, generator=g, device="cuda", dtype=torch.bfloat16)
        for backend in backends:
            if backend != "auto" and load_backend(backend) is None:
                out.append({"linear": name, "backend": backend, "note": "unavailable"})
                continue
            recipe = Fp8Recipe(gemm_backend=backend)
            wq, ws = fp8_ops.quant_weight(w, recipe)
            picked = {m: resolve_backend("fprop", x.device, m, None, recipe) for m in (*M_DECODE, M_PREFILL)}
            res = by_m(lambda t, wq=wq, ws=ws, recipe=recipe: fp8_linear_forward(t, wq, ws, recipe=recipe), x)
            out.append({"linear": name, "n": n, "k": k, "backend": backend, "picked": picked, "by_m": res})
        # the BF16 arm's engine: vLLM's unquantized linear is torch's F.linear (cuBLAS picks its kernel by M)
        out.append({"linear": f"{name}_bf16", "n": n, "k": k, "backend": "torch F.linear",
                    "by_m": by_m(lambda t, w=w: F.linear(t, w), x)})
    vocab = shape.vocab_size
    w = torch.randn(vocab, shape.hidden_size, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(M_PREFILL, shape.hidden_size, generator=g, device="cuda", dtype=torch.bfloat16)
    out.append({"linear": "lm_head_bf16", "n": vocab, "k": shape.hidden_size, "backend": "torch F.linear",
                "by_m": by_m(lambda t: F.linear(t, w), x)})
    return out


def attention(heads_q: int, heads_kv: int, head_dim: int, g, seqs: int, length: int,
              positions: list[int], splits: tuple[int, ...]) -> list[dict]:
    """vLLM's decode attention for the query at each position (one per sequence) vs the prefill call's row."""
    fa, version = ops.flash_attention_module()
    lens = [length] * seqs
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    t = seqs * length
    q, k, v = (torch.randn(t, n, head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
               for n in (heads_q, heads_kv, heads_kv))
    layout = ops.PagedLayout.build(cu, length)
    scale = head_dim ** -0.5
    prefill, _ = ops.PrefillAttention()(q, k, v, layout, scale)
    bs = layout.block_size
    k_cache = k.new_zeros(layout.total_blocks * bs, heads_kv, head_dim)
    v_cache = v.new_zeros(layout.total_blocks * bs, heads_kv, head_dim)
    k_cache[layout.slot], v_cache[layout.slot] = k, v
    k_cache = k_cache.view(layout.total_blocks, bs, heads_kv, head_dim)
    v_cache = v_cache.view(layout.total_blocks, bs, heads_kv, head_dim)
    out = []
    for ns in splits:
        for pos in positions:
            rows = cu[:-1].long() + pos
            used = torch.full((seqs,), pos + 1, dtype=torch.int32, device="cuda")
            cu_q = torch.arange(seqs + 1, dtype=torch.int32, device="cuda")
            meta = None
            if version == 3:
                meta = fa.get_scheduler_metadata(
                    batch_size=seqs, max_seqlen_q=1, max_seqlen_k=pos + 1, num_heads_q=heads_q,
                    num_heads_kv=heads_kv, headdim=head_dim, cache_seqlens=used, qkv_dtype=q.dtype,
                    cu_seqlens_q=cu_q, page_size=bs, causal=True, window_size=(-1, -1), num_splits=ns)
            dec = torch.empty(seqs, heads_q, head_dim, device="cuda", dtype=q.dtype)
            fa.flash_attn_varlen_func(
                q=q[rows].contiguous(), k=k_cache, v=v_cache, out=dec, cu_seqlens_q=cu_q, max_seqlen_q=1,
                seqused_k=used, max_seqlen_k=pos + 1, softmax_scale=scale, causal=True, window_size=None,
                block_table=layout.block_table, softcap=0.0, scheduler_metadata=meta, fa_version=version,
                num_splits=ns)
            out.append({"heads": [heads_q, heads_kv], "num_splits": ns, "position": pos,
                        **compare(dec.reshape(seqs, -1), prefill[rows].reshape(seqs, -1))})
    return out


def project_swiglu_vs_vllm(g) -> dict:
    """The project's Triton SwiGLU (``policy.jet_rl.swiglu_fp8_forms``: engine and trainer both run it) against
    vLLM's own ``silu_and_mul``: on every one of the 65,536 BF16 gate values (silu depends on the gate alone), with an
    up of 1 and random ups over six decades. Not an exactness condition (both sides run the same kernel with the
    switch), but whether the switch changes the rollout's numbers at all."""
    from jetrl_megatron.megatron import triton_numerics as tn

    gate = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(512, 128).cuda()
    ups = [torch.ones_like(gate)] + [(torch.randn(gate.shape, generator=g, device="cuda") * 10.0 ** e).to(
        torch.bfloat16) for e in (-3, 0, 3)]
    rows = []
    for i, up in enumerate(ups):
        x = torch.cat([gate, up], dim=1)
        ours, theirs = tn.swiglu_fwd(x), ops.silu_and_mul(x)
        equal = (ours == theirs) | (ours.isnan() & theirs.isnan())
        finite = ours.isfinite() & theirs.isfinite()
        rows.append({"up": "1" if i == 0 else f"randn x 1e{(-3, 0, 3)[i - 1]}",
                     "identical": float(equal.float().mean()),
                     "max_abs": float((ours.float() - theirs.float())[finite].abs().max())})
    return {"rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--backends", nargs="+", default=["auto", "deep_gemm", "cublas"])
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not ops.available():
        raise SystemExit(f"needs GPU vLLM's ops: {ops.unavailable_reason()}")
    shape = get_model_shape(args.preset)
    g = torch.Generator(device="cuda").manual_seed(0)
    positions = sorted({p for p in (0, 15, 16, 63, 64, 100, 127, 128, 175, 176, 255, 256, 511, 512, args.length - 1)
                        if p < args.length})
    report = {"preset": args.preset, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
              "elementwise": elementwise(shape, g), "project_swiglu_vs_vllm": project_swiglu_vs_vllm(g),
              "linears": linears(shape, g, args.backends), "attention": []}
    for hq, hkv in sorted({(shape.num_attention_heads, shape.num_kv_heads), (16, 8)}):
        report["attention"] += attention(hq, hkv, shape.head_dim, g, args.seqs, args.length, positions, (1, 0))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print("| op | M (decode rows) | identical | max abs |\n|---|---|---|---|")
    for name, res in report["elementwise"].items():
        for m, r in res.items():
            print(f"| {name} | {m} | {r['identical']:.3f} | {r['max_abs']:.3g} |")
    for row in report["linears"]:
        for m, r in row.get("by_m", {}).items():
            picked = row.get("picked", {}).get(m, "")
            print(f"| {row['linear']} {row['backend']}{' -> ' + picked if picked else ''} | {m} | "
                  f"{r['identical']:.3f} | {r['max_abs']:.3g} |")
    print("\n| the project's SwiGLU vs vLLM's silu_and_mul, every BF16 gate, up | identical | max abs |\n|---|---|---|")
    for r in report["project_swiglu_vs_vllm"]["rows"]:
        print(f"| {r['up']} | {r['identical']:.6f} | {r['max_abs']:.3g} |")
    print("\n| attention heads q/kv | num_splits | position | identical | max abs |\n|---|---|---|---|---|")
    for r in report["attention"]:
        print(f"| {r['heads'][0]}/{r['heads'][1]} | {r['num_splits']} | {r['position']} | {r['identical']:.3f} | "
              f"{r['max_abs']:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
