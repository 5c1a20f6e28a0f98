"""GPU: does a row's FP8 FProp output depend on how many rows are in the GEMM? Per backend, at the real Qwen3
linear shapes: Y = fp8_linear_forward(X[:m], W) against the first m rows of the same call at training M, bit for bit.

Why it matters: the rollout engine runs the plugin's FP8 linear at decode M (the running sequences) and the trainer
runs it at training M; exactly on-policy needs the same bytes for the same row (and the same backend at every M).

    python3 bench/gemm_m_invariance.py --out $OUT/gemm_m_invariance.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jetrl_megatron.fp8 import quant_dispatch as ops  # noqa: E402
from jetrl_megatron.fp8.gemm import load_backend  # noqa: E402
from jetrl_megatron.fp8.linear import fp8_linear_forward  # noqa: E402
from jetrl_megatron.model.shapes import get_model_shape  # noqa: E402
from jetrl_megatron.recipe import Fp8Recipe  # noqa: E402

M_SMALL = (1, 2, 3, 8, 16, 31, 64, 128, 255, 256, 512, 1000, 2048)


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    s = get_model_shape(preset)
    q = s.num_attention_heads * s.head_dim
    kv = s.num_kv_heads * s.head_dim
    return {"qkv": (q + 2 * kv, s.hidden_size), "o": (s.hidden_size, q), "gate_up": (2 * s.ffn_hidden_size,
            s.hidden_size), "down": (s.hidden_size, s.ffn_hidden_size)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["qwen3-8b", "qwen3-1.7b"])
    p.add_argument("--backends", nargs="+", default=["cublas", "deep_gemm", "triton"])
    p.add_argument("--train-m", type=int, default=8192)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for preset in args.presets:
        for name, (n, k) in shapes(preset).items():
            w = torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(args.train_m, k, generator=g, device="cuda", dtype=torch.bfloat16)
            for backend in args.backends:
                if load_backend(backend) is None:
                    rows.append({"preset": preset, "linear": name, "backend": backend, "note": "unavailable"})
                    continue
                recipe = Fp8Recipe(gemm_backend=backend)
                wq, ws = ops.quant_weight(w, recipe)
                full = fp8_linear_forward(x, wq, ws, recipe=recipe)
                bad = [m for m in M_SMALL if not torch.equal(fp8_linear_forward(x[:m], wq, ws, recipe=recipe),
                                                             full[:m])]
                rows.append({"preset": preset, "linear": name, "n": n, "k": k, "backend": backend,
                             "m_invariant": not bad, "differs_at_m": bad})
                print(rows[-1], flush=True)
    summary = {b: all(r.get("m_invariant", False) for r in rows if r["backend"] == b) for b in args.backends}
    print("M-invariant at every shape:", summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "train_m": args.train_m,
                       "m": M_SMALL, "rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
