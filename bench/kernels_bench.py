"""FP8 kernel benchmark on one GPU: quantization kernels, blockwise FP8 GEMM backends, FP8 linear and a Qwen3 MLP block.

One command (on the H200):  PYTHONPATH=. python bench/kernels_bench.py
Writes $OUT/kernels_bench.json (or ./kernels_bench.json) and prints the summary tables last.

What is measured (median of CUDA-event timings, random data, never zeros):
- device copy bandwidth (bytes read + written) and a BF16 8192^3 matmul, as this run's ceilings;
- quant kernels as GB/s of bytes moved (inputs read once, outputs written once) and fraction of the copy bandwidth;
- per Qwen3 linear shape and GEMM form (fprop/dgrad/wgrad): BF16 cuBLAS and every FP8 backend as TFLOP/s and ratio
  to BF16, at M = 8192 and 16384; decode M in {1, 16, 64} (FProp only) under CUDA graphs with the weights rotated
  through more than L2 so they stream from HBM as in a real decode step;
- a Triton tile-config sweep at M = 8192 whose winner is the Triton column ("triton"), plus batch-invariant mode;
- FP8 linear fwd+bwd (fp8_linear with the cached FP8 weight) vs BF16 F.linear fwd+bwd, and the Qwen3-8B MLP block
  (gate_up, SwiGLU, down) fwd+bwd at 8192 tokens;
- the SwiGLU backward fused with fc1's dY FP8 quantization (megatron/swiglu_fp8.py, a launch sweep) vs the unfused
  triton_numerics.swiglu_bwd + quant_dual, at the Qwen3-8B fc1 width, bytes checked equal (section "swiglu").
BENCH_DRY=1 runs every code path on CPU under TRITON_INTERPRET=1 with tiny shapes (a smoke test, not a measurement).
BENCH_BASELINE_KERNELS=FILE (an earlier fp8/kernels.py, e.g. `git show REV:jetrl_megatron/fp8/kernels.py > FILE`):
the quant section also times that file's kernels on the same inputs, side by side ("before" rows), and checks both
give the same bytes.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

DRY = os.environ.get("BENCH_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from jetrl_megatron.fp8 import gemm as G  # noqa: E402
from jetrl_megatron.fp8 import kernels as K  # noqa: E402
from jetrl_megatron.fp8 import quant as Q  # noqa: E402
from jetrl_megatron.fp8.backends import triton as TB  # noqa: E402
from jetrl_megatron.fp8.backends.triton_gemm import GemmConfig  # noqa: E402
from jetrl_megatron.fp8.linear import fp8_linear, fp8_linear_forward  # noqa: E402
from jetrl_megatron.recipe import Fp8Recipe  # noqa: E402

DEV = "cpu" if DRY else "cuda"
SCALE = 32 if DRY else 1  # shrink every dimension in dry mode (kept multiples of 128)
OUT_DIR = os.environ.get("OUT", ".")
RESULTS: dict = {"errors": []}

SHAPES = {  # name -> (N, K) of the linear; Qwen3-8B and Qwen3-32B per rank at TP2
    "8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (24576, 4096), "8B.down": (4096, 12288),
    "32B.qkv": (5120, 5120), "32B.o": (5120, 4096), "32B.gate_up": (25600, 5120), "32B.down": (5120, 12800),
}
TRAIN_M = (8192, 16384)
DECODE_M = (1, 4, 16, 64)


def dim(x: int) -> int:
    return x if SCALE == 1 else max(128, (x // SCALE) // 128 * 128)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, warmup_ms: float = 10, rep_ms: float = 40) -> float:
    if DRY:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def bench_graph_ms(fns: list, reps: int = 20) -> float:
    """Per-call time of a CUDA graph that replays the calls in `fns` (one per rotated weight copy), median of reps."""
    if DRY:
        return bench_ms(lambda: [f() for f in fns]) / len(fns)
    for f in fns:
        f()
    sync()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    sync()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(fns))
    return statistics.median(times)


def section(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            t = time.time()
            print(f"\n=== {name}", flush=True)
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - record and go on with the next section
                traceback.print_exc()
                RESULTS["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
                return None
            finally:
                print(f"--- {name}: {time.time() - t:.1f}s", flush=True)
                save()
        return run
    return wrap


def save() -> None:
    path = os.path.join(OUT_DIR, "kernels_bench.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(RESULTS, fh, indent=1)
    os.replace(tmp, path)


def randn(*shape, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


# ------------------------------------------------------------------------------------------------------ sections
@section("environment")
def environment() -> None:
    env = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "torch": torch.__version__,
           "triton": triton.__version__, "cuda": torch.version.cuda, "dry": DRY}
    if DEV == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sms=props.multi_processor_count, capability=list(torch.cuda.get_device_capability()))
        try:
            env["cublaslt"] = torch._C._cuda_getCompiledVersion()
        except Exception:  # noqa: BLE001
            pass
    env["backends"] = {name: G.load_backend(name) is not None for name in ("cublas", "triton", "deep_gemm")}
    RESULTS["env"] = env
    print(env)


@section("ceilings")
def ceilings() -> None:
    n = (1 << 29) // SCALE  # 1 GiB of BF16
    src = torch.randn(n, device=DEV).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 2 / ms / 1e6
    a = randn(dim(8192), dim(8192))
    b = randn(dim(8192), dim(8192))
    ms_mm = bench_ms(lambda: a @ b)
    RESULTS["ceilings"] = {"copy_GBps": copy_gbs, "bf16_mm_8192_TFLOPs": 2 * a.shape[0] ** 3 / ms_mm / 1e9}
    print(RESULTS["ceilings"])


def _gbps_row(name, shape, ms, nbytes, copy_gbs):
    return {"kernel": name, "shape": list(shape), "us": ms * 1e3, "GBps": nbytes / ms / 1e6,
            "frac_copy": nbytes / ms / 1e6 / copy_gbs}


@section("quant kernels")
def quant_kernels() -> None:
    copy_gbs = RESULTS.get("ceilings", {}).get("copy_GBps", float("nan"))
    rows = []
    recipe = Fp8Recipe()
    # 1) launch-shape sweep on one shape; the winners become the defaults for everything measured afterwards
    m, k = dim(16384), dim(4096)
    x = randn(m, k)
    xq, xs = K.quant_act(x, recipe)
    best_act, best_dual, best_regroup = None, None, None
    for bm, nw in ((16, 4), (32, 4), (64, 8)):
        ms = bench_ms(lambda bm=bm, nw=nw, x=x: K.quant_act(x, recipe, block_m=bm, num_warps=nw))
        rows.append(_gbps_row(f"quant_act[bm={bm},w={nw}]", (m, k), ms, 3 * m * k + 4 * m * k // 128, copy_gbs))
        best_act = min(best_act or (ms, bm, nw), (ms, bm, nw))
    for tm in (0, 1, 2):
        for nw, ft in ((4, 32), (4, 64), (8, 64), (4, 128), (8, 128)):
            for vec in (0, 2, 4):  # the load vector in features (kernels.REGROUP_VEC; 0 = the compiler's 16 bytes)
                ms = bench_ms(lambda nw=nw, xq=xq, xs=xs, tm=tm, ft=ft, vec=vec: K.regroup_for_wgrad(
                    xq, xs, recipe, num_warps=nw, trans_mode=tm, feats=ft, load_vec=vec))
                rows.append(_gbps_row(f"regroup[t={tm},w={nw},f={ft},v={vec}]", (m, k), ms,
                                      2 * m * k + 8 * m * k // 128, copy_gbs))
                best_regroup = min(best_regroup or (ms, tm, nw, ft, vec), (ms, tm, nw, ft, vec))
    K.REGROUP_TRANS_MODE, K.REGROUP_WARPS, K.REGROUP_FEATS, K.REGROUP_VEC = best_regroup[1:]
    K.ACT_BLOCK_M, K.ACT_WARPS = best_act[1:]
    for tm in (0, 1, 2):
        for nw, split in ((4, False), (8, False), (4, True)):
            if split and tm != K.REGROUP_TRANS_MODE:
                continue
            ms = bench_ms(lambda nw=nw, x=x, tm=tm, split=split: K.quant_dual(
                x, recipe, num_warps=None if split else nw, trans_mode=tm, split=split))
            rows.append(_gbps_row(f"quant_dual[t={tm},w={nw},split={int(split)}]", (m, k), ms,
                                  4 * m * k + 8 * m * k // 128, copy_gbs))
            best_dual = min(best_dual or (ms, tm, nw, split), (ms, tm, nw, split))
    K.TRANS_MODE, K.DUAL_WARPS, K.DUAL_SPLIT = best_dual[1], best_dual[2], best_dual[3]
    chosen = {"ACT_BLOCK_M": K.ACT_BLOCK_M, "ACT_WARPS": K.ACT_WARPS, "TRANS_MODE": K.TRANS_MODE,
              "DUAL_WARPS": K.DUAL_WARPS, "DUAL_SPLIT": K.DUAL_SPLIT, "REGROUP_TRANS_MODE": K.REGROUP_TRANS_MODE,
              "REGROUP_WARPS": K.REGROUP_WARPS, "REGROUP_FEATS": K.REGROUP_FEATS, "REGROUP_VEC": K.REGROUP_VEC}
    RESULTS["quant_defaults"] = chosen
    print("quant launch defaults chosen:", chosen)
    before = _baseline_kernels()
    del x, xq, xs
    # 2) the kernels with those defaults on the Qwen3 activation/gradient shapes
    for m, k in ((16384, 4096), (16384, 12288), (8192, 24576)):
        m, k = dim(m), dim(k)
        x = randn(m, k)
        xq, xs = K.quant_act(x, recipe)
        cases = {
            "quant_act": (lambda x=x: K.quant_act(x, recipe), 2 * m * k + m * k + 4 * m * k // 128),
            "quant_dual": (lambda x=x: K.quant_dual(x, recipe), 2 * m * k + 2 * m * k + 8 * m * k // 128),
            "regroup_for_wgrad": (lambda xq=xq, xs=xs: K.regroup_for_wgrad(xq, xs, recipe),
                                  m * k + 4 * m * k // 128 + m * k + 4 * m * k // 128),
        }
        for name, (fn, nbytes) in cases.items():
            rows.append(_gbps_row(name, (m, k), bench_ms(fn), nbytes, copy_gbs))
            if before is not None:  # the earlier kernels on the same input: the same bytes, and their time
                old = {"quant_act": lambda x=x: before.quant_act(x, recipe),
                       "quant_dual": lambda x=x: before.quant_dual(x, recipe),
                       "regroup_for_wgrad": lambda xq=xq, xs=xs: before.regroup_for_wgrad(xq, xs, recipe)}[name]
                row = _gbps_row(f"before {name}", (m, k), bench_ms(old), nbytes, copy_gbs)
                row["same_bytes"] = _same_outputs(fn(), old())
                rows.append(row)
        if (m, k) == (dim(16384), dim(4096)):
            ms = bench_ms(lambda x=x: Q.quantize_1x128(x, recipe))
            rows.append(_gbps_row("eager torch quantize_1x128 (reference)", (m, k), ms, 3 * m * k, copy_gbs))
        del x, xq, xs
    for n, k in ((24576, 4096), (4096, 12288)):
        n, k = dim(n), dim(k)
        w = randn(n, k, scale=0.02)
        rows.append(_gbps_row("bf16 clone (same tensor)", (n, k), bench_ms(lambda w=w: w.clone()), 4 * n * k,
                              copy_gbs))
        for with_t in (False, True):
            ms = bench_ms(lambda w=w, with_t=with_t: K.quant_weight(w, recipe, with_transpose=with_t))
            nbytes = 2 * n * k + n * k * (2 if with_t else 1)
            rows.append(_gbps_row("quant_weight" + ("+T" if with_t else ""), (n, k), ms, nbytes, copy_gbs))
            if before is not None:
                old = lambda w=w, with_t=with_t: before.quant_weight(w, recipe, with_transpose=with_t)  # noqa: E731
                row = _gbps_row("before quant_weight" + ("+T" if with_t else ""), (n, k), bench_ms(old), nbytes,
                                copy_gbs)
                row["same_bytes"] = _same_outputs(K.quant_weight(w, recipe, with_transpose=with_t), old())
                rows.append(row)
    RESULTS["quant"] = rows
    for r in rows:
        same = "" if "same_bytes" not in r else f"  same bytes: {r['same_bytes']}"
        print(f"{r['kernel']:<40} {str(r['shape']):<16} {r['us']:9.1f} us {r['GBps']:8.0f} GB/s {r['frac_copy']:.2f}"
              + same)


def _baseline_kernels():
    """The earlier kernels module named by BENCH_BASELINE_KERNELS, or None."""
    path = os.environ.get("BENCH_BASELINE_KERNELS")
    if not path:
        return None
    from sass_counts import load_module  # bench/ is this script's directory

    print(f"baseline kernels: {path}")
    return load_module(path, "kernels_before")


def _same_outputs(a, b) -> bool:
    """Bit-identical tuples of tensors (FP8 compared as bytes, FP32 scales by bits, NaN included)."""
    def bits(t):
        return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int32)
    return len(a) == len(b) and all(x.shape == y.shape and x.stride() == y.stride()
                                    and torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


def _fp8_operands(m: int, n: int, k: int):
    x, w, dy = randn(m, k, scale=2.0), randn(n, k, scale=0.02), randn(m, n, scale=1e-3)
    xq, xs = K.quant_act(x)
    wq, ws = K.quant_weight(w)
    gq, gs, gtq, gts = K.quant_dual(dy)
    xtq, xts = K.regroup_for_wgrad(xq, xs)
    return {"x": x, "w": w, "dy": dy, "fprop": (xq, xs, wq, ws), "dgrad": (gq, gs, wq, ws),
            "wgrad": (gtq, gts, xtq, xts)}


def _bf16_fn(form: str, ops: dict):
    x, w, dy = ops["x"], ops["w"], ops["dy"]
    return {"fprop": lambda: x @ w.t(), "dgrad": lambda: dy @ w, "wgrad": lambda: dy.t() @ x}[form]


SWEEP = [
    GemmConfig(128, 128, 8, 8, 4, pipe=True),
    GemmConfig(128, 128, 16, 8, 3),
    GemmConfig(64, 128, 8, 4, 4, pipe=True),
    GemmConfig(64, 128, 8, 4, 5, pipe=True),
    GemmConfig(64, 128, 16, 4, 3, pipe=True),
    GemmConfig(64, 256, 8, 8, 3, pipe=True),
    GemmConfig(64, 128, 8, 4, 4),
]


@section("triton tile sweep (M=8192)")
def triton_sweep() -> dict[str, GemmConfig]:
    best: dict[str, GemmConfig] = {}
    table = []
    m = dim(8192)
    scores: dict[tuple[str, str], list[float]] = {}
    for shape in ("8B.gate_up", "8B.o", "32B.down"):
        n, k = (dim(v) for v in SHAPES[shape])
        ops = _fp8_operands(m, n, k)
        for form in ("fprop", "dgrad", "wgrad"):
            mm, nn, kk = {"fprop": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}[form]
            fn_mod = getattr(TB, form)
            for cfg in SWEEP:
                try:
                    ms = bench_ms(lambda cfg=cfg, fn_mod=fn_mod, form=form, ops=ops: fn_mod(*ops[form], config=cfg),
                                  rep_ms=25)
                    tf = 2 * mm * nn * kk / ms / 1e9
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is just skipped
                    tf = float("nan")
                    print(f"config {cfg.key()} failed for {form}: {type(exc).__name__}: {str(exc)[:200]}")
                scores.setdefault((form, cfg.key()), []).append(tf)
                table.append({"shape": shape, "form": form, "config": cfg.key(), "TFLOPs": tf})
        del ops
    for form in ("fprop", "dgrad", "wgrad"):
        def gmean(vals):
            good = [v for v in vals if v == v and v > 0]
            return math.exp(sum(math.log(v) for v in good) / len(good)) if len(good) == len(vals) else 0.0
        ranked = sorted(SWEEP, key=lambda c, form=form: -gmean(scores[(form, c.key())]))
        best[form] = ranked[0]
        print(f"{form}: " + ", ".join(f"{c.key()}={gmean(scores[(form, c.key())]):.0f}" for c in ranked))
    RESULTS["triton_sweep"] = {"rows": table, "best": {f: c.key() for f, c in best.items()}}
    return best


def _wanted(name: str) -> bool:
    """BENCH_GEMM_BACKENDS=cublas,deep_gemm limits the FP8 backends measured (all available ones by default)."""
    only = os.environ.get("BENCH_GEMM_BACKENDS")
    return not only or name in only.split(",")


def _fp8_backends(best: dict[str, GemmConfig] | None):
    out = {}
    if G.load_backend("cublas") is not None:
        mod = G.load_backend("cublas")
        out["cublas"] = lambda form, ops, mod=mod: getattr(mod, form)(*ops[form])
    if DRY or G.load_backend("triton") is not None:
        out["triton"] = lambda form, ops: getattr(TB, form)(*ops[form], config=(best or {}).get(form))
        out["triton_bi"] = lambda form, ops: getattr(TB, form)(*ops[form], batch_invariant=True)
    if G.load_backend("deep_gemm") is not None:
        mod = G.load_backend("deep_gemm")
        out["deep_gemm"] = lambda form, ops, mod=mod: getattr(mod, form)(*ops[form])
    return {k_: v for k_, v in out.items() if _wanted(k_.removesuffix("_bi"))}


@section("GEMMs, training M")
def gemm_train(best) -> None:
    rows = []
    backends = _fp8_backends(best)
    for shape, (n, k) in SHAPES.items():
        n, k = dim(n), dim(k)
        for m in TRAIN_M:
            m = dim(m)
            ops = _fp8_operands(m, n, k)
            for form in ("fprop", "dgrad", "wgrad"):
                mm, nn, kk = {"fprop": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}[form]
                flops = 2 * mm * nn * kk
                bf = flops / bench_ms(_bf16_fn(form, ops)) / 1e9
                row = {"shape": shape, "M": m, "form": form, "bf16": bf}
                for name, call in backends.items():
                    try:
                        row[name] = flops / bench_ms(lambda call=call, form=form, ops=ops: call(form, ops)) / 1e9
                    except Exception as exc:  # noqa: BLE001
                        row[name] = float("nan")
                        RESULTS["errors"].append(f"gemm {shape} M={m} {form} {name}: {exc}")
                rows.append(row)
                print(" ".join(f"{k_}={v:.0f}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()),
                      flush=True)
            del ops
    RESULTS["gemm_train"] = rows


def _rotations(weight_bytes: int) -> int:
    return max(2, min(16, math.ceil(240e6 / max(weight_bytes, 1))))


@section("decode GEMM / linear (CUDA graphs, weights from HBM)")
def decode() -> None:
    rows = []
    recipe = Fp8Recipe()
    backends = {"cublas": Fp8Recipe(gemm_backend="cublas"), "triton": Fp8Recipe(gemm_backend="triton"),
                "triton_bi": Fp8Recipe(gemm_backend="triton", batch_invariant=True), "auto": recipe,
                "deep_gemm": Fp8Recipe(gemm_backend="deep_gemm")}
    backends = {k_: v for k_, v in backends.items()
                if k_ == "auto" or (G.load_backend(v.gemm_backend) is not None and _wanted(v.gemm_backend))}
    for shape, (n, k) in SHAPES.items():
        n, k = dim(n), dim(k)
        copies = _rotations(n * k)
        ws_bf16 = [randn(n, k, scale=0.02) for _ in range(copies)]
        ws_fp8 = [K.quant_weight(w) for w in ws_bf16]
        for m in DECODE_M:
            x = randn(m, k)
            flops = 2 * m * n * k
            bf_ms = bench_graph_ms([lambda w=w, x=x: F.linear(x, w) for w in ws_bf16])
            row = {"shape": shape, "M": m, "bf16_us": bf_ms * 1e3, "bf16_TFLOPs": flops / bf_ms / 1e9}
            for name, rec in backends.items():
                try:
                    ms = bench_graph_ms([lambda q=q, s=s, rec=rec, x=x: fp8_linear_forward(x, q, s, None, rec)
                                         for q, s in ws_fp8])
                    row[f"{name}_us"] = ms * 1e3
                    row[f"{name}_x"] = bf_ms / ms
                except Exception as exc:  # noqa: BLE001
                    row[f"{name}_us"] = float("nan")
                    RESULTS["errors"].append(f"decode {shape} M={m} {name}: {exc}")
            rows.append(row)
            print(" ".join(f"{k_}={v:.2f}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()),
                  flush=True)
        del ws_bf16, ws_fp8
    RESULTS["decode"] = rows


def _linear_step(fn, x, w, dy):
    def step():
        x.grad = None
        w.grad = None
        y = fn(x, w)
        y.backward(dy)
    return step


@section("linear fwd+bwd, M=8192")
def linear_fwd_bwd() -> None:
    rows = []
    m = dim(8192)
    recipes = {"auto": Fp8Recipe(), "cublas": Fp8Recipe(gemm_backend="cublas"),
               "triton": Fp8Recipe(gemm_backend="triton"), "deep_gemm": Fp8Recipe(gemm_backend="deep_gemm")}
    recipes = {k_: v for k_, v in recipes.items()
               if k_ == "auto" or (G.load_backend(v.gemm_backend) is not None and _wanted(v.gemm_backend))}
    for shape, (n, k) in SHAPES.items():
        n, k = dim(n), dim(k)
        x = randn(m, k).requires_grad_(True)
        w = randn(n, k, scale=0.02).requires_grad_(True)
        dy = randn(m, n, scale=1e-3)
        wf = K.quant_weight(w.detach())
        bf_ms = bench_ms(_linear_step(lambda a, b: F.linear(a, b), x, w, dy))
        row = {"shape": shape, "M": m, "bf16_ms": bf_ms}
        for name, rec in recipes.items():
            step = _linear_step(lambda a, b, rec=rec, wf=wf: fp8_linear(a, b, None, rec, weight_fp8=wf), x, w, dy)
            ms = bench_ms(step)
            row[f"{name}_ms"] = ms
            row[f"{name}_x"] = bf_ms / ms
        rows.append(row)
        print(" ".join(f"{k_}={v:.3f}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()), flush=True)
        del x, w, dy, wf
    RESULTS["linear"] = rows


@section("SwiGLU backward + fc1 dY FP8 quantization, fused vs unfused")
def swiglu_grad_quant() -> None:
    from jetrl_megatron.megatron import swiglu_fp8 as S
    from jetrl_megatron.megatron import triton_numerics as tn

    recipe = Fp8Recipe()
    f = dim(12288)
    rows = []
    for m in (dim(8192), dim(16384)):
        x, dy = randn(m, 2 * f, scale=2.0), randn(m, f, scale=1e-3)
        unfused = K.quant_dual(tn.swiglu_bwd(x, dy), recipe)
        fused = S.swiglu_bwd_quant_dual(x, dy, recipe)
        for a, b in zip(fused[:4], unfused, strict=True):  # the fusion must not change a byte
            if a.dtype == torch.float8_e4m3fn:
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            if not torch.equal(a, b):
                raise AssertionError(f"swiglu_bwd_quant_dual differs from swiglu_bwd + quant_dual at m={m}")
        # minimal traffic: read gate, up, d(out) once; write both FP8 copies and their scales
        nbytes = 6 * m * f + 4 * m * f + 2 * 4 * (2 * m * f) // 128
        base = bench_ms(lambda x=x, dy=dy: K.quant_dual(tn.swiglu_bwd(x, dy), recipe))
        rows.append({"kernel": "unfused swiglu_bwd + quant_dual", "M": m, "F": f, "us": base * 1e3,
                     "GBps_min_traffic": nbytes / base / 1e6})
        launches = [dict(split=False, trans_mode=tm, num_warps=nw) for tm in (0, 1, 2) for nw in (4, 8)]
        launches += [dict(split=True, block_m=bm, feats=ft, trans_mode=tm, num_warps=nw)
                     for bm in (16, 32) for ft in (64, 128) for tm in (1, 2) for nw in (4, 8)]
        for launch in launches:
            for write_dx in (False, True):
                ms = bench_ms(lambda x=x, dy=dy, launch=launch, write_dx=write_dx: S.swiglu_bwd_quant_dual(
                    x, dy, recipe, write_dx=write_dx, **launch))
                rows.append({"kernel": "fused" + ("+dx" if write_dx else ""), "M": m, "F": f, **launch,
                             "us": ms * 1e3, "GBps_min_traffic": nbytes / ms / 1e6, "speedup": base / ms})
        del x, dy, unfused, fused
    best = {}
    for r in rows:
        if r["kernel"] == "fused" and (r["M"] not in best or r["us"] < best[r["M"]]["us"]):
            best[r["M"]] = r
    RESULTS["swiglu_grad_quant"] = {"rows": rows, "best_fused": list(best.values())}
    for r in [r for r in rows if r["kernel"].startswith("unfused")] + list(best.values()):
        print(r)


@section("Qwen3-8B MLP block fwd+bwd, 8192 tokens")
def mlp_block() -> None:
    m, h, f = dim(8192), dim(4096), dim(12288)
    x = randn(m, h).requires_grad_(True)
    w1 = randn(2 * f, h, scale=0.02).requires_grad_(True)
    w2 = randn(h, f, scale=0.02).requires_grad_(True)
    dy = randn(m, h, scale=1e-3)

    def swiglu(t):
        gate, up = t.chunk(2, dim=-1)
        return F.silu(gate) * up

    def make(lin):
        def step():
            for t in (x, w1, w2):
                t.grad = None
            y = lin(swiglu(lin(x, w1, 0)), w2, 1)
            y.backward(dy)
        return step

    caches = [K.quant_weight(w1.detach()), K.quant_weight(w2.detach())]
    res = {"tokens": m, "bf16_ms": bench_ms(make(lambda a, w, i: F.linear(a, w)))}
    for name, rec in {"auto": Fp8Recipe(), "triton": Fp8Recipe(gemm_backend="triton"),
                      "deep_gemm": Fp8Recipe(gemm_backend="deep_gemm")}.items():
        if name != "auto" and (G.load_backend(rec.gemm_backend) is None or not _wanted(rec.gemm_backend)):
            continue
        ms = bench_ms(make(lambda a, w, i, rec=rec: fp8_linear(a, w, None, rec, weight_fp8=caches[i])))
        res[f"{name}_ms"] = ms
        res[f"{name}_x"] = res["bf16_ms"] / ms
    # per-step weight quantization (once per optimizer step), reported separately
    res["weight_quant_ms"] = bench_ms(lambda: [K.quant_weight(w1.detach()), K.quant_weight(w2.detach())])
    RESULTS["mlp"] = res
    print(res)


# ------------------------------------------------------------------------------------------------------ summary
def summary() -> None:
    print("\n" + "=" * 100)
    env = RESULTS.get("env", {})
    print(f"GPU {env.get('gpu')}  torch {env.get('torch')}  triton {env.get('triton')}  CUDA {env.get('cuda')}  "
          f"{env.get('date')}")
    c = RESULTS.get("ceilings", {})
    if c:
        print(f"copy {c['copy_GBps']:.0f} GB/s (read+write); BF16 8192^3 mm {c['bf16_mm_8192_TFLOPs']:.0f} TFLOP/s")
    if RESULTS.get("triton_sweep"):
        print("triton best configs:", RESULTS["triton_sweep"]["best"])
    if RESULTS.get("quant_defaults"):
        print("quant launch defaults:", RESULTS["quant_defaults"])
    if RESULTS.get("quant"):
        print("\nQuant kernels                  shape              us      GB/s  frac-of-copy")
        for r in RESULTS["quant"]:
            print(f"{r['kernel'][:30]:<30} {str(r['shape']):<16} {r['us']:8.1f} {r['GBps']:8.0f}  {r['frac_copy']:.2f}")
    if RESULTS.get("gemm_train"):
        names = [n for n in ("cublas", "triton", "triton_bi", "deep_gemm") if n in RESULTS["gemm_train"][0]]
        print("\nGEMM TFLOP/s (ratio to BF16)")
        print(f"{'shape':<12} {'M':<8} {'form':<6} {'bf16':>6}" + "".join(f"{n:>18}" for n in names))
        for r in RESULTS["gemm_train"]:
            cells = "".join(f"{r[n]:>9.0f} ({r[n] / r['bf16']:.2f}x)" for n in names)
            print(f"{r['shape']:<12} M={r['M']:<6} {r['form']:<6} {r['bf16']:>6.0f}{cells}")
    if RESULTS.get("decode"):
        print("\nDecode FP8 linear fwd (CUDA graph, us; speedup vs BF16)")
        for r in RESULTS["decode"]:
            cells = "  ".join(f"{n} {r[n + '_us']:.1f} ({r.get(n + '_x', float('nan')):.2f}x)"
                              for n in ("auto", "cublas", "triton", "triton_bi", "deep_gemm") if n + "_us" in r)
            print(f"{r['shape']:<12} M={r['M']:<3} bf16 {r['bf16_us']:.1f}  {cells}")
    if RESULTS.get("linear"):
        print("\nLinear fwd+bwd M=8192 (ms; speedup vs BF16)")
        for r in RESULTS["linear"]:
            cells = "  ".join(f"{n} {r[n + '_ms']:.3f} ({r[n + '_x']:.2f}x)"
                              for n in ("auto", "cublas", "triton", "deep_gemm")
                              if n + "_ms" in r)
            print(f"{r['shape']:<12} bf16 {r['bf16_ms']:.3f}  {cells}")
    if RESULTS.get("mlp"):
        print("\nQwen3-8B MLP fwd+bwd:", {k_: round(v, 3) for k_, v in RESULTS["mlp"].items()})
    if RESULTS.get("swiglu_grad_quant"):
        print("\nSwiGLU bwd + fc1 dY quant (us): unfused",
              {r["M"]: round(r["us"], 1) for r in RESULTS["swiglu_grad_quant"]["rows"]
               if r["kernel"].startswith("unfused")}, " best fused", RESULTS["swiglu_grad_quant"]["best_fused"])
    if RESULTS["errors"]:
        print("\nERRORS:", *RESULTS["errors"][:20], sep="\n  ")


def main() -> int:
    torch.manual_seed(0)
    sections = os.environ.get("BENCH_SECTIONS", "env,ceil,quant,sweep,gemm,decode,linear,mlp,swiglu").split(",")
    environment()
    if "ceil" in sections:
        ceilings()
    if "quant" in sections:
        quant_kernels()
    best = triton_sweep() if "sweep" in sections else None
    if "gemm" in sections:
        gemm_train(best)
    if "decode" in sections:
        decode()
    if "linear" in sections:
        linear_fwd_bwd()
    if "mlp" in sections:
        mlp_block()
    if "swiglu" in sections:
        swiglu_grad_quant()
    try:
        from jetrl_megatron.fp8.backends import cublas as cublas_backend
        RESULTS["cublas_pads_small_m"] = cublas_backend._pad_small_m
    except Exception:  # noqa: BLE001
        pass
    save()
    summary()
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
