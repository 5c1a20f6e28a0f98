"""Does vLLM's FA3 give the real tokens the same bytes when every padded row is attended whole? (issue 29 item 3)

Why: the trainer's GPU attention (``attn_impl="vllm_cuda"``) packs each micro-batch's real tokens before FA3, as
vLLM's prefill sees them. Packing needs the real lengths on the host (``int(lengths.max())``, ``nonzero``: host
syncs and shapes that change per micro-batch), so the update's layers cannot be captured as CUDA graphs (at 2K
tokens the Qwen3-8B layer runs 1.06x BF16 eager, 1.25x when both arms are CUDA graphs; bench/RESULTS.md). The rows
are right-padded and attention is causal, so a real query never reads a pad: attending every row whole
(``cu_seqlens`` every ``sq`` tokens, ``seqused_k = sq``, a block table fixed by ``(b, sq)``) needs no lengths at all,
and the layout is the same for every micro-batch of an update. Whether FA3 (and PyTorch's flash backward) then
give the real tokens the bytes of the packed call is the question this probe answers on a GPU; on a CPU it only
checks the fixed layout.

Per case (random BF16 q/k/v at Qwen3-8B's heads, random lengths): forward output and log-sum-exp at the real tokens,
bit for bit; backward dq/dk/dv at the real tokens with the deterministic flash backward, bit for bit, and exact zeros
at the pads (dout zero there, as the loss masks them); then both paths' fwd+bwd timed, and the packed layout's
build (once per micro-batch, host syncs included).

    python3 bench/graph_layout_probe.py --out $OUT/graph_layout_probe.json      (GPU, vLLM 0.26 installed)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_report import write_report  # noqa: E402

from jetrl_megatron.vllm_cuda import ops as vllm_cuda_ops  # noqa: E402

# (rows b, padded length sq, lengths: None = random in [1, sq], one row always full)
CASES = (
    (1, 2048, (2048,)),
    (1, 4096, (3001,)),
    (2, 2048, (2048, 1500)),
    (4, 1100, None),
    (8, 1024, None),
    (2, 4200, (4200, 17)),
    (16, 300, None),
)
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128  # Qwen3-8B


def full_row_layout(b: int, sq: int, device: torch.device, block_size: int = vllm_cuda_ops.KV_BLOCK
                    ) -> vllm_cuda_ops.PagedLayout:
    """Every one of ``b`` rows of ``sq`` tokens as one whole sequence: the paged layout vLLM's block manager would
    give b fresh sequences of sq tokens, built without reading any length (fixed by ``(b, sq)``)."""
    nb = -(-sq // block_size)
    cu = torch.arange(b + 1, device=device, dtype=torch.int32) * sq
    lens = torch.full((b,), sq, device=device, dtype=torch.int32)
    block_table = torch.arange(b * nb, device=device, dtype=torch.int32).view(b, nb)
    pos = torch.arange(sq, device=device, dtype=torch.int64)
    slot = (torch.arange(b, device=device, dtype=torch.int64)[:, None] * (nb * block_size) + pos[None, :]).reshape(-1)
    return vllm_cuda_ops.PagedLayout(cu, lens, sq, block_table, slot, b * nb, block_size)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (-0 and +0 differ, NaN equals itself when its bits do)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(view), b.contiguous().view(view)))


def _lengths(case: tuple, gen: torch.Generator) -> list[int]:
    b, sq, given = case
    if given is not None:
        return list(given)
    out = torch.randint(1, sq + 1, (b,), generator=gen).tolist()
    out[int(torch.randint(0, b, (1,), generator=gen))] = sq
    return out


def _timed_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def probe_case(case: tuple, gen: torch.Generator, iters: int) -> dict:
    from jetrl_megatron.megatron.numerics import PackedRows, flash_attention_backward

    b, sq, _ = case
    dev = torch.device("cuda")
    lengths = _lengths(case, gen)
    lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    scale = HEAD_DIM ** -0.5

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(b * sq, heads, HEAD_DIM, generator=gen).to(device=dev, dtype=torch.bfloat16)

    q, k, v = rand(HEADS_Q), rand(HEADS_KV), rand(HEADS_KV)  # the sequence-major (b * sq) grid, rows padded
    built = PackedRows.build(lens, sq)  # once per micro-batch, shared by the model's layers
    rows = built.idx  # the grid rows of the real tokens, in the packed order
    pad = torch.ones(b * sq, dtype=torch.bool, device=dev)
    pad[rows] = False
    dout = rand(HEADS_Q).masked_fill(pad[:, None, None], 0.0)
    attention = vllm_cuda_ops.PrefillAttention()

    def packed() -> tuple:  # the trainer's path today: the real tokens gathered, the layout from their lengths
        qp, kp, vp = q.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows)
        out, lse = attention(qp, kp, vp, built.paged, scale)
        grads = flash_attention_backward(dout.index_select(0, rows), qp, kp, vp, out, lse, built.paged.cu_seqlens,
                                         built.paged.max_seqlen, scale, deterministic=True)
        return out, lse, grads

    whole_layout = full_row_layout(b, sq, dev)

    def whole() -> tuple:
        out, lse = attention(q, k, v, whole_layout, scale)
        grads = flash_attention_backward(dout, q, k, v, out, lse, whole_layout.cu_seqlens, sq, scale,
                                         deterministic=True)
        return out, lse, grads

    p_out, p_lse, p_grads = packed()
    w_out, w_lse, w_grads = whole()
    result = {
        "b": b, "sq": sq, "lengths": lengths, "real_tokens": int(rows.numel()),
        "fwd_out_equal": _bits_equal(w_out.index_select(0, rows), p_out),
        "fwd_lse_equal": _bits_equal(w_lse.index_select(1, rows), p_lse),
    }
    for name, w, p in zip(("dq", "dk", "dv"), w_grads, p_grads, strict=True):
        result[f"bwd_{name}_equal"] = _bits_equal(w.index_select(0, rows), p)
        pads = w[pad]
        result[f"bwd_{name}_pads_zero"] = bool(pads.numel() == 0 or torch.count_nonzero(pads) == 0)
    result["packed_ms"] = round(_timed_ms(packed, iters), 3)
    result["packed_layout_build_ms"] = round(_timed_ms(lambda: PackedRows.build(lens, sq), iters), 3)
    result["whole_rows_ms"] = round(_timed_ms(whole, iters), 3)
    return result


def run(args: argparse.Namespace) -> dict:
    if not vllm_cuda_ops.available():
        raise SystemExit(f"graph_layout_probe: needs GPU vLLM's ops ({vllm_cuda_ops.unavailable_reason()})")
    gen = torch.Generator().manual_seed(args.seed)
    cases = []
    for case in CASES:
        t0 = time.perf_counter()
        cases.append(probe_case(case, gen, args.iters))
        print(json.dumps(cases[-1]), f"({time.perf_counter() - t0:.1f} s)", flush=True)
    checks = [k for k in cases[0] if k.endswith(("_equal", "_zero"))]
    verdict = all(c[k] for c in cases for k in checks)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seed": args.seed,
            "heads": [HEADS_Q, HEADS_KV, HEAD_DIM], "cases": cases, "all_bit_identical": verdict}


def markdown(result: dict) -> str:
    lines = ["| b | sq | real tokens | fwd out / lse | dq / dk / dv | pads zero | packed ms (+ layout build) | "
             "whole rows ms |", "|---|---|---|---|---|---|---|---|"]
    yes = {True: "=", False: "DIFF"}
    for c in result["cases"]:
        grads = " / ".join(yes[c[f"bwd_{n}_equal"]] for n in ("dq", "dk", "dv"))
        zeros = all(c[f"bwd_{n}_pads_zero"] for n in ("dq", "dk", "dv"))
        lines.append(f"| {c['b']} | {c['sq']} | {c['real_tokens']} | {yes[c['fwd_out_equal']]} / "
                     f"{yes[c['fwd_lse_equal']]} | {grads} | {zeros} | {c['packed_ms']} "
                     f"(+{c['packed_layout_build_ms']}) | {c['whole_rows_ms']} |")
    lines.append(f"\n{result['device']}, torch {result['torch']}: every real token bit-identical: "
                 f"{result['all_bit_identical']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=10, help="timed fwd+bwd calls per path and case")
    ap.add_argument("--out", default=None, help="write the JSON here (and the table beside it as .md)")
    args = ap.parse_args(argv)
    result = run(args)
    write_report(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
