"""One Qwen3-8B-shaped transformer layer through Megatron-Core: jetrl (FP8) vs BF16, fwd+bwd time and saved memory.

The layer is built from our GPT layer spec (Megatron-Core TransformerLayer + SelfAttention + MLP with
Fp8Column/RowParallelLinear and the rollout-matched norms/RoPE/attention), TP=1, micro-batch 1. Both modes get the
same weights and inputs. Reported per mode: median fwd+bwd time of the whole layer and of its MLP block, the
layer's forward alone under no_grad (what the trainer's logprob and reference passes run every step), the
per-step FP8 weight-cache refresh (once per optimizer step, not per micro-batch), the bytes saved for backward
(unique storages seen by saved_tensors_hooks during one forward) and the allocation still held after the forward.

``--elementwise torch,triton`` repeats every mode with the rollout-matched element-wise ops (RMSNorm, qk-norm,
RoPE, FP32 residual add, SwiGLU) as the torch twins and as the Triton kernels (the layer context's elementwise), same
weights and inputs. The Triton SwiGLU lives in numerics.SwiGLU, so ``triton`` arms always use that module (Megatron
otherwise applies its own autograd ``silu(g) * u``); ``torch`` arms use it only with ``--lean-swiglu``.
Besides the synced median, each arm reports the host time to issue one fwd+bwd and the time per fwd+bwd when 20 run
back to back (no sync between them, as the layers of a model run): when the host is slower than the GPU, the synced
median shows the host. ``--host-profile`` adds a cProfile of one step's host side per arm.
``--fuse-swiglu-grad-quant off,on`` runs every jetrl arm without and with the SwiGLU backward fused with the FP8
quantization of fc1's dY (Fp8ModelContext.fuse_swiglu_grad_quant, megatron/swiglu_fp8.py; implies the SwiGLU
module); ``--swiglu-fp8-forms off,on`` likewise with the SwiGLU forward writing fc2's FP8 input
(Fp8ModelContext.swiglu_fp8_forms); every combination asked for runs. A fused arm also reports whether its MLP
block's gradients (input, fc1, fc2) are bit-identical to its unfused twin's (they must be).
``--cuda-graph`` also times every arm with the layer's forward and backward each captured as one CUDA graph
(``torch.cuda.make_graphed_callables`` on the same layer and weights): what launch gaps and host issue cost, the wall
time beyond the kernel sum (issue 29 item 3); and the forward alone under no_grad captured as one graph (the
logprob passes, item 4). It reports whether the graphed forward outputs equal the eager one bit for bit (they must:
same kernels, same inputs); an arm that cannot be captured reports why and keeps its eager numbers.
``--profile`` prints, per arm, the top CUDA kernels of one fwd+bwd by total time (torch.profiler) and the time per
kernel group (GEMM, attention, FP8 quantization, our Triton element-wise kernels, other = torch element-wise/copies).

    python bench/megatron_layer_bench.py [--seq 8192] [--iters 20] [--backends auto,triton] [--out DIR]
        [--attn-impl bf16|bf16_gqa] [--lean-swiglu] [--e2e] [--elementwise torch,triton] [--profile [--top 25]]
        [--fuse-swiglu-grad-quant off,on] [--swiglu-fp8-forms off,on] [--cuda-norms batch_invariant|vllm] [--cuda-graph]
    python bench/megatron_layer_bench.py --tiny --seq 64 --iters 2 --warmup 1   # CPU smoke run (TRITON_INTERPRET=1
                                                                                # makes the triton arms use Triton)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jetrl_megatron.megatron import numerics  # noqa: E402
from jetrl_megatron.megatron.context import Fp8ModelContext  # noqa: E402
from jetrl_megatron.megatron.cpu import init_parallel, teardown_parallel  # noqa: E402
from jetrl_megatron.megatron.layers import Fp8ColumnParallelLinear, Fp8RowParallelLinear  # noqa: E402
from jetrl_megatron.megatron.model import megatron_config, seed_everything  # noqa: E402
from jetrl_megatron.megatron.spec import gpt_layer_spec  # noqa: E402
from jetrl_megatron.model.shapes import get_model_shape  # noqa: E402
from jetrl_megatron.recipe import Fp8Recipe  # noqa: E402
from jetrl_megatron.rl.outputs.profile_windows import classify  # noqa: E402

try:
    from jetrl_megatron.fp8 import kernels as fp8_kernels  # noqa: E402
except ImportError:  # no Triton: the reference quantizers run, there is no launch mode to pick
    fp8_kernels = None


def build_layer(shape, recipe, device, attn_impl=None, lean_swiglu=False, elementwise="auto", fuse=(False, False),
                cuda_norms="batch_invariant"):
    """``fuse``: (the SwiGLU backward fused with fc1's dY quantization, the SwiGLU forward writing fc2's input)."""
    from megatron.core.transformer.spec_utils import build_module

    config = megatron_config(shape, recipe, use_te_activation_func=lean_swiglu)
    ctx = Fp8ModelContext.create(shape, recipe, range(1), attn_impl, elementwise=elementwise,
                                 fuse_swiglu_grad_quant=fuse[0], swiglu_fp8_forms=fuse[1], cuda_norms=cuda_norms)
    layer = build_module(gpt_layer_spec(ctx, 0, lean_swiglu=lean_swiglu), config=config, layer_number=1)
    layer = layer.to(device)
    cache = ctx.cache
    fp8 = [(n, m) for n, m in layer.named_modules()
           if isinstance(m, (Fp8ColumnParallelLinear, Fp8RowParallelLinear)) and m.gemm_mode == "fp8"]

    def refresh():
        cache.refresh((f"{n}.weight", m.weight) for n, m in fp8)

    refresh()

    def persistent() -> set[int]:
        ptrs = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        for q, sc in cache.named_fp8().values():
            ptrs |= {q.untyped_storage().data_ptr(), sc.untyped_storage().data_ptr()}
        return ptrs

    layer.persistent_storages = persistent
    return layer, refresh


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device, warmup: int, iters: int) -> float:
    """Median milliseconds of fn() (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def host_and_pipelined(fn, device, iters: int) -> tuple[float, float]:
    """(median host ms to issue one fn(), ms per fn() when `iters` run back to back without a sync in between).

    Why both: `timeit` syncs every iteration, so a step whose Python takes longer to issue than its kernels take to
    run shows the host time, not the GPU's. Back to back, as the layers of a model run, the GPU works while the host
    issues the next step: that time is max(host, GPU) per step. On CPU both are the plain wall time."""
    _sync(device)
    host = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e3)
        _sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return statistics.median(host), (time.perf_counter() - t) * 1e3 / iters


class _LayerOutput(torch.nn.Module):
    """The layer as a one-tensor-in, one-tensor-out module (what make_graphed_callables captures); owns the layer's
    parameters, so their gradients flow through the graphed backward."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, attention_mask=None)[0]


def graphed_layer_step(layer, x: torch.Tensor, gout: torch.Tensor, warmup: int):
    """(step, forward) of ``layer`` with its forward and backward each replayed as one CUDA graph.

    Captured once here (after ``warmup`` eager iterations on a side stream, which also JIT-compiles any GEMM and
    fills the FP8 weight's derived layouts); a replay reads the weights and the FP8 cache where they live, so a cache
    refreshed in place is seen, while its derived layouts (the DGrad transpose) are the ones built at capture."""
    graphed = torch.cuda.make_graphed_callables(_LayerOutput(layer), (x,), num_warmup_iters=max(warmup, 3))

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = graphed(x)
        out.backward(gout.to(out.dtype))

    return step, graphed


def host_profile(fn, top: int) -> str:
    """cProfile of one fn() on the host: where the Python time to issue a step goes (top functions by own time)."""
    import cProfile
    import io
    import pstats
    import warnings

    prof = cProfile.Profile()
    syncs: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")  # every host<->device synchronizing call warns
        try:
            prof.enable()
            fn()
        finally:
            prof.disable()
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            where = f"{w.filename}:{w.lineno}"
            syncs[where] = syncs.get(where, 0) + 1
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = [f"synchronizing calls in one step: {sum(syncs.values())}"]
    lines += [f"  {n} x {where}" for where, n in sorted(syncs.items(), key=lambda kv: -kv[1])[:20]]
    return "\n".join(lines) + "\n" + buf.getvalue()


def saved_bytes(fn, persistent: set[int]) -> int:
    """Bytes of the unique storages autograd saves for backward during fn(), excluding ``persistent`` storages
    (parameters and FP8 weight-cache entries, which live across steps anyway)."""
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            if st.data_ptr() not in persistent:
                seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


KERNEL_GROUPS = (  # (group, lower-case name fragments), first match wins
    ("fused swiglu bwd + fp8 quant", ("_swiglu_bwd_rows", "_swiglu_bwd_trans", "_swiglu_bwd_dual")),
    ("jetrl triton element-wise", ("_rms_fwd", "_rms_bwd", "_swiglu_", "_rope_kernel", "_residual_add")),
    ("fp8 quant", ("quant", "regroup")),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "_sum_splits", "matmul", "aten::mm",
              "aten::addmm", "aten::bmm")),
)


def kernel_group(name: str) -> str:
    return classify(name, KERNEL_GROUPS, "other (torch element-wise, copies, reductions)")


def profile_step(step, device, top: int) -> dict:
    """One fwd+bwd under torch.profiler: the top kernels (CUDA; CPU ops on CPU) by total time, and group totals."""
    from torch.profiler import ProfilerActivity, profile

    step()
    _sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        _sync(device)
    rows = []
    for e in prof.key_averages():
        if device.type == "cuda":
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None)
            us = e.self_cuda_time_total if us is None else us
        else:
            us = e.self_cpu_time_total
        if us > 0:
            rows.append((e.key, e.count, us / 1e3))
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows) or 1.0
    groups: dict[str, float] = {}
    for name, _, ms in rows:
        groups[kernel_group(name)] = groups.get(kernel_group(name), 0.0) + ms
    return {"total_ms": total, "top": [{"kernel": n, "calls": c, "ms": ms, "pct": 100 * ms / total}
                                       for n, c, ms in rows[:top]],
            "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1]))}


def gemm_quant_ratios(profiles: list[dict]) -> list[dict]:
    """Per FP8 arm of a ``--profile`` run: the BF16 arm's GEMM kernel time over this arm's GEMM + FP8 quantization
    time (fused SwiGLU quantizers included), the ratio TransformerEngine's blockwise-FP8 GEMM guide reports for a
    layer's GEMMs (quantization included). Arms are matched to the BF16 arm of the same element-wise kernels."""
    def elementwise(arm: str) -> str:  # "jetrl / auto / elementwise triton / ..." -> "triton"
        return arm.split(" / elementwise ")[-1].split(" / ")[0]

    bf16 = {elementwise(p["arm"]): p for p in profiles if p["arm"].startswith("bf16 ")}
    out = []
    for p in profiles:
        if p["arm"].startswith("bf16 "):
            continue
        ref = bf16.get(elementwise(p["arm"]))
        if ref is None:
            continue
        g = p["groups"]
        fp8 = g.get("gemm", 0.0) + g.get("fp8 quant", 0.0) + g.get("fused swiglu bwd + fp8 quant", 0.0)
        base = ref["groups"].get("gemm", 0.0)
        if fp8 > 0 and base > 0:
            out.append({"arm": p["arm"], "bf16_gemm_ms": base, "fp8_gemm_quant_ms": fp8, "speedup": base / fp8})
    return out


def format_profile(label: str, prof: dict) -> str:
    unit = "kernel time" if prof.get("device") == "cuda" else "self CPU time"
    lines = [f"### profile: {label} (one fwd+bwd, {unit} {prof['total_ms']:.2f} ms)", "",
             "| group | ms | % |", "|---|---|---|"]
    lines += [f"| {g} | {ms:.2f} | {100 * ms / prof['total_ms']:.1f} |" for g, ms in prof["groups"].items()]
    lines += ["", "| kernel | calls | ms | % |", "|---|---|---|---|"]
    for r in prof["top"]:
        name = r["kernel"].replace("|", "/")
        name = name if len(name) <= 100 else name[:97] + "..."
        lines.append(f"| {name} | {r['calls']} | {r['ms']:.3f} | {r['pct']:.1f} |")
    return "\n".join(lines)


def e2e_smoke() -> dict:
    """Whole tiny GPTModel on this device: build, jetrl logprobs, 3 train steps (DDP + Megatron optimizer)."""
    from jetrl_megatron.megatron.model import token_logprobs, train_step
    from jetrl_megatron.megatron.policy import build_policy

    shape = get_model_shape("tiny")
    policy = build_policy(shape, Fp8Recipe(mode="jetrl"), optimizer={"lr": 3e-3})
    model, opt = policy.model, policy.optimizer
    toks = torch.randint(0, shape.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    lp0 = token_logprobs(model, toks)
    losses = [train_step([model], opt, {"tokens": toks}, lambda lp, mb: (-lp.mean(), {}), micro_batch_size=2).loss
              for _ in range(3)]
    return {"e2e_lp_shape": list(lp0.shape), "e2e_losses": losses, "e2e_refreshes": opt.stats.refreshes}


def graphed_forward(layer, x: torch.Tensor, warmup: int):
    """``layer``'s forward under no_grad (the logprob / reference passes) captured as one CUDA graph: (replay, static
    output). Warm-up iterations run on a side stream first (JIT compiles, FP8 derived layouts), as torch's
    make_graphed_callables does."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(max(warmup, 3)):
            layer(x, attention_mask=None)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = layer(x, attention_mask=None)[0]
    return graph.replay, out


def graph_timings(layer, x, gout, eager_out: torch.Tensor, args) -> dict:
    """The ``graph_*`` columns of one arm (see ``graphed_layer_step`` and ``graphed_forward``); a capture that fails
    is reported, not raised: the arm's eager numbers stand and the table says why its graphed ones are missing."""
    try:
        step, graphed = graphed_layer_step(layer, x, gout, args.warmup)
        with torch.no_grad():
            same = torch.equal(graphed(x).float(), eager_out)
        t = timeit(step, torch.device("cuda"), args.warmup, args.iters)
        _, pipe = host_and_pipelined(step, torch.device("cuda"), args.iters)
        replay, out = graphed_forward(layer, x, args.warmup)
        t_fwd = timeit(replay, torch.device("cuda"), args.warmup, args.iters)
        same_fwd = torch.equal(out.float(), eager_out)
    except Exception as e:  # noqa: BLE001 -- any capture error is a result of this column
        torch.cuda.synchronize()
        return {"graph_error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    return {"graph_layer_ms": t, "graph_pipelined_ms": pipe, "graph_fwd_only_ms": t_fwd,
            "graph_fwd_bit_identical": same and same_fwd}


def fusion_label(fuse: tuple[bool, bool]) -> str:
    return "+".join(name for name, on in zip(("bwd", "fwd"), fuse, strict=True) if on) or "-"


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--backends", default="auto", help="comma list of gemm_backend values for the jetrl rows")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset (CPU smoke run)")
    ap.add_argument("--ffn", type=int, default=None,
                    help="FFN size instead of the preset's (TransformerEngine's blockwise-FP8 GEMM guide: --ffn 16384 "
                         "--seq 15872 at hidden 4096)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--e2e", action="store_true", help="also run a tiny whole-model train smoke test")
    ap.add_argument("--attn-impl", default=None, help="numerics.RolloutCoreAttention attn_impl (default per device)")
    ap.add_argument("--cuda-norms", default="batch_invariant", choices=numerics.CUDA_NORMS,
                    help="the vllm_cuda norms: the batch-invariant kernel GPU engines run (default) or vLLM's own")
    ap.add_argument("--lean-swiglu", action="store_true", help="SwiGLU saving only the fc1 output for backward")
    ap.add_argument("--elementwise", default="auto",
                    help="comma list of element-wise impls to run every mode with: auto, torch, triton")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one fwd+bwd per arm")
    ap.add_argument("--top", type=int, default=25, help="kernels listed per arm with --profile")
    ap.add_argument("--host-profile", action="store_true", help="cProfile the host side of one fwd+bwd per arm")
    ap.add_argument("--fuse-swiglu-grad-quant", default="off",
                    help="comma list of off/on: jetrl arms without / with the SwiGLU backward fused with fc1's dY "
                         "FP8 quantization (on implies the SwiGLU module)")
    ap.add_argument("--backward-on-calling-thread", action="store_true",
                    help="autograd runs every backward on the thread that calls it instead of its CUDA device thread "
                         "(torch.autograd.set_multithreading_enabled(False)), every arm alike")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also time each arm with the layer's fwd and bwd captured as CUDA graphs (needs CUDA)")
    ap.add_argument("--swiglu-fp8-forms", default="off",
                    help="comma list of off/on: jetrl arms without / with the SwiGLU forward writing fc2's FP8 input "
                         "(on implies the SwiGLU module)")
    ap.add_argument("--regroup-modes", default=None,
                    help="comma list of fp8.kernels transposed-store modes (REGROUP_TRANS_MODE) for the jetrl rows; "
                         "default: the module's")
    ap.add_argument("--quant-launch", default="",
                    help="NAME=int,... launch constants of fp8/kernels.py for every row (e.g. REGROUP_FEATS=128,"
                         "REGROUP_VEC=4, kernels_bench's picks; results never depend on them)")
    args = ap.parse_args()
    for item in filter(None, args.quant_launch.split(",")):
        name, _, value = item.partition("=")
        if fp8_kernels is None or not name.isupper() or not isinstance(getattr(fp8_kernels, name, None), int) \
                or not value.lstrip("-").isdigit():
            ap.error(f"--quant-launch: {item!r} is not NAME=int for an integer launch constant of fp8/kernels.py")
        setattr(fp8_kernels, name, int(value))
    impls = [e.strip() for e in args.elementwise.split(",") if e.strip()]
    def on_off(flag: str, value: str) -> list[bool]:
        vals = [v.strip() for v in value.split(",") if v.strip()]
        if not vals or any(v not in ("off", "on") for v in vals):
            ap.error(f"{flag}: a comma list of off/on, got {value!r}")
        return [v == "on" for v in vals]

    fuses = [(b, f) for b in on_off("--fuse-swiglu-grad-quant", args.fuse_swiglu_grad_quant)
             for f in on_off("--swiglu-fp8-forms", args.swiglu_fp8_forms)]
    for e in impls:
        if e not in numerics.ELEMENTWISE_IMPLS:
            ap.error(f"--elementwise: {e!r} is not one of {numerics.ELEMENTWISE_IMPLS}")

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if args.cuda_graph and device.type != "cuda":
        ap.error("--cuda-graph needs CUDA (this machine has no GPU)")
    if args.backward_on_calling_thread:
        torch.autograd.set_multithreading_enabled(False)  # thread-local: this (the only) thread, for the whole run
    init_parallel(1, 1)
    base = get_model_shape("tiny" if args.tiny else "qwen3-8b")
    shape = dataclasses.replace(base, num_layers=1, max_position_embeddings=max(args.seq, 128),
                                ffn_hidden_size=args.ffn or base.ffn_hidden_size)
    s, h = args.seq, shape.hidden_size
    seed_everything(0)
    x = torch.randn(s, 1, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    gout = torch.randn(s, 1, h, device=device, dtype=torch.float32)
    xn = torch.randn(s, 1, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    gmlp = torch.randn(s, 1, h, device=device, dtype=torch.bfloat16)

    rows, outputs, ref_state, profiles, host_texts = [], {}, None, [], []
    default_rmode = fp8_kernels.REGROUP_TRANS_MODE if fp8_kernels else None
    rmodes = [int(v) for v in args.regroup_modes.split(",")] if args.regroup_modes else [default_rmode]
    arms = [(e, "bf16", "auto", None, (False, False)) for e in impls]
    arms += [(e, "jetrl", b, rm, fu) for e in impls for b in args.backends.split(",") for rm in rmodes
             for fu in fuses]
    arms.sort(key=lambda a: impls.index(a[0]))
    gqa_used = True
    grads = {}  # arm -> the gradients of one layer fwd+bwd (fused arms are checked against their unfused twin)
    for ew, mode, backend, rmode, fuse in arms:
        if fp8_kernels is not None:
            fp8_kernels.REGROUP_TRANS_MODE = default_rmode if rmode is None else rmode
        recipe = Fp8Recipe(mode=mode, gemm_backend=backend)
        seed_everything(0)
        lean = args.lean_swiglu or ew == "triton" or any(fuse)
        layer, refresh = build_layer(shape, recipe, device, args.attn_impl, lean, ew, fuse, args.cuda_norms)
        if ref_state is None:
            ref_state = {k: v.detach().clone() for k, v in layer.named_parameters()}
        else:
            with torch.no_grad():
                for k, v in layer.named_parameters():
                    v.copy_(ref_state[k])  # bumps versions: the refresh below is required
            refresh()

        def layer_step(layer=layer):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            out, _ = layer(x, attention_mask=None)
            out.backward(gout.to(out.dtype))  # FP32 residual stream; BF16 with vllm_cuda

        def fwd_step(layer=layer):  # the trainer's logprob / reference passes: forward under no_grad
            with torch.no_grad():
                layer(x, attention_mask=None)

        def mlp_step(layer=layer):
            layer.zero_grad(set_to_none=True)
            out, _ = layer.mlp(xn)
            out.backward(gmlp)

        with torch.no_grad():
            outputs[(ew, mode, backend, rmode, fuse)] = layer(x, attention_mask=None)[0].float()
        if mode == "jetrl" and (False, False) in fuses and len(fuses) > 1:  # the MLP block: deterministic kernels
            xn.grad = None
            mlp_step()
            grads[(ew, mode, backend, rmode, fuse)] = [g.clone() for g in (xn.grad, *(p.grad for p in
                                                                                   layer.mlp.parameters()))]
        t_layer = timeit(layer_step, device, args.warmup, args.iters)
        t_mlp = timeit(mlp_step, device, args.warmup, args.iters)
        t_fwd = timeit(fwd_step, device, args.warmup, args.iters)
        t_host, t_pipe = host_and_pipelined(layer_step, device, args.iters)
        t_refresh = timeit(refresh, device, 2, 5) if mode == "jetrl" else 0.0
        graph = graph_timings(layer, x, gout, outputs[(ew, mode, backend, rmode, fuse)], args) if args.cuda_graph \
            else {}
        saved = saved_bytes(lambda layer=layer: layer(x, attention_mask=None)[0], layer.persistent_storages())
        if device.type == "cuda":
            torch.cuda.synchronize()
            base_mem = torch.cuda.memory_allocated()
            out = layer(x, attention_mask=None)[0]
            held = torch.cuda.memory_allocated() - base_mem
            del out
        else:
            held = 0
        rows.append(dict(elementwise=ew, swiglu_module=lean, mode=mode, backend=backend, regroup_mode=rmode,
                         swiglu_fusion=fuse,
                         layer_ms=t_layer, host_issue_ms=t_host, pipelined_ms=t_pipe,
                         mlp_ms=t_mlp, fwd_ms=t_fwd, refresh_ms=t_refresh, saved_MiB=saved / 2**20,
                         held_after_fwd_MiB=held / 2**20, **graph))
        if args.host_profile:
            _sync(device)
            host_texts.append(f"### host profile: {mode} / {backend} / elementwise {ew}\n\n```\n"
                              f"{host_profile(layer_step, args.top)}```")
            _sync(device)
        if args.profile:
            prof = profile_step(layer_step, device, args.top) | {"device": device.type}
            label = (f"{mode} / {backend} / elementwise {ew}" + ("" if rmode is None else f" / regroup mode {rmode}")
                     + ("" if not any(fuse) else f" / fused SwiGLU {fusion_label(fuse)}"))
            profiles.append({"arm": label, **prof})
        gqa_used &= all(m._gqa_kernels_ok for m in layer.modules() if isinstance(m, numerics.RolloutCoreAttention))
        del layer

    ref = outputs[(impls[0], "bf16", "auto", None, (False, False))]
    for r in rows:
        key = (r["elementwise"], r["mode"], r["backend"], r["regroup_mode"], r["swiglu_fusion"])
        o = outputs[key]
        r["out_rel_err_vs_bf16"] = ((o - ref).norm() / ref.norm()).item()
        unfused = grads.get((*key[:4], (False, False)))
        r["mlp_grads_bit_identical_vs_unfused"] = (None if not any(key[4]) or unfused is None else
                                               all(torch.equal(a, b) for a, b in zip(grads[key], unfused,
                                                                                     strict=True)))
        twin_key = ("torch", r["mode"], r["backend"], r["regroup_mode"], r["swiglu_fusion"])
        twin = None if r["elementwise"] == "torch" else outputs.get(twin_key)
        r["out_rel_diff_vs_torch_ew"] = None if twin is None else ((o - twin).norm() / twin.norm()).item()
    b = rows[0]
    for r in rows:
        r["layer_speedup"] = b["layer_ms"] / r["layer_ms"]
        r["pipelined_speedup"] = b["pipelined_ms"] / r["pipelined_ms"]
        r["mlp_speedup"] = b["mlp_ms"] / r["mlp_ms"]
        r["fwd_speedup"] = b["fwd_ms"] / r["fwd_ms"]
        r["saved_ratio"] = r["saved_MiB"] / b["saved_MiB"]
        if r.get("graph_layer_ms") and b.get("graph_layer_ms"):
            r["graph_speedup"] = b["graph_layer_ms"] / r["graph_layer_ms"]
            r["graph_fwd_speedup"] = b["graph_fwd_only_ms"] / r["graph_fwd_only_ms"]

    info = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                seq=s, shape=dataclasses.asdict(shape) | {"extra_hf": None})
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    import megatron.core

    info["megatron_core"] = megatron.core.__version__
    info["attn_impl"] = args.attn_impl or numerics.default_attn_impl()
    info["lean_swiglu"] = args.lean_swiglu
    info["fuse_swiglu_grad_quant"] = args.fuse_swiglu_grad_quant
    info["swiglu_fp8_forms"] = args.swiglu_fp8_forms
    info["cuda_norms"] = args.cuda_norms
    info["backward_on_calling_thread"] = args.backward_on_calling_thread
    info["elementwise"] = impls
    if "triton" in impls and device.type != "cuda":
        from jetrl_megatron.megatron import triton_numerics

        info["triton_arms_run_triton"] = triton_numerics.available() and triton_numerics.interpreting()
    if info["attn_impl"] == "bf16_gqa":
        info["attn_native_gqa_used"] = gqa_used
    if args.e2e:
        info.update(e2e_smoke())
    head = ("| mode | gemm_backend | elementwise | regroup mode | layer fwd+bwd ms | speedup | host issue ms "
            "| back-to-back ms | speedup | MLP fwd+bwd ms | speedup | fwd only ms | speedup | FP8 refresh ms/step "
            "| saved for bwd MiB "
            "| ratio | held after fwd MiB | out rel err vs bf16 | out rel diff vs torch elementwise "
            "| fused SwiGLU: bwd = fc1 dY quant, fwd = fc2 input (MLP grads = unfused) |")
    lines = [head, "|" + "---|" * 20]
    for r in rows:
        ew = r["elementwise"] + (" (SwiGLU module)" if r["swiglu_module"] else "")
        dtw = "-" if r["out_rel_diff_vs_torch_ew"] is None else f"{r['out_rel_diff_vs_torch_ew']:.2e}"
        rm = "-" if r["regroup_mode"] is None else r["regroup_mode"]
        same = r["mlp_grads_bit_identical_vs_unfused"]
        fu = (fusion_label(r["swiglu_fusion"]) + ("" if same is None else f" ({'yes' if same else 'NO'})")
              if any(r["swiglu_fusion"]) else "-")
        lines.append(f"| {r['mode']} | {r['backend']} | {ew} | {rm} | {r['layer_ms']:.2f} | {r['layer_speedup']:.3f}x "
                     f"| {r['host_issue_ms']:.2f} | {r['pipelined_ms']:.2f} | {r['pipelined_speedup']:.3f}x "
                     f"| {r['mlp_ms']:.2f} | {r['mlp_speedup']:.3f}x | {r['fwd_ms']:.2f} | {r['fwd_speedup']:.3f}x "
                     f"| {r['refresh_ms']:.2f} | {r['saved_MiB']:.1f} "
                     f"| {r['saved_ratio']:.3f} | {r['held_after_fwd_MiB']:.1f} | {r['out_rel_err_vs_bf16']:.4f} "
                     f"| {dtw} | {fu} |")
    if args.cuda_graph:
        lines += ["", "| mode | gemm_backend | elementwise | eager fwd+bwd ms | graphed fwd+bwd ms | graphed / eager "
                  "| speedup vs bf16 graphed | graphed back-to-back ms | eager fwd only ms | graphed fwd only ms "
                  "| fwd-only speedup vs bf16 graphed | graphed fwd == eager fwd |",
                  "|" + "---|" * 12]
        for r in rows:
            if r.get("graph_error"):
                lines.append(f"| {r['mode']} | {r['backend']} | {r['elementwise']} | {r['layer_ms']:.2f} "
                             f"| capture failed: {r['graph_error']} | - | - | - | {r['fwd_ms']:.2f} | - | - | - |")
                continue
            sp = f"{r['graph_speedup']:.3f}x" if r.get("graph_speedup") else "-"
            sp_fwd = f"{r['graph_fwd_speedup']:.3f}x" if r.get("graph_fwd_speedup") else "-"
            lines.append(f"| {r['mode']} | {r['backend']} | {r['elementwise']} | {r['layer_ms']:.2f} "
                         f"| {r['graph_layer_ms']:.2f} | {r['graph_layer_ms'] / r['layer_ms']:.3f} | {sp} "
                         f"| {r['graph_pipelined_ms']:.2f} | {r['fwd_ms']:.2f} | {r['graph_fwd_only_ms']:.2f} "
                         f"| {sp_fwd} | {'yes' if r['graph_fwd_bit_identical'] else 'NO'} |")
    gemm_rows = gemm_quant_ratios(profiles)
    if gemm_rows:
        info["gemm_plus_quant_speedup"] = gemm_rows
        lines += ["", "| arm | BF16 GEMM ms | FP8 GEMM + FP8 quantization ms | speedup (TransformerEngine's blockwise "
                  "FP8 on an H200: 1.40x) |", "|---|---|---|---|"]
        lines += [f"| {g['arm']} | {g['bf16_gemm_ms']:.2f} | {g['fp8_gemm_quant_ms']:.2f} | {g['speedup']:.3f}x |"
                  for g in gemm_rows]
    table = "\n".join(lines)
    prof_text = "\n\n".join([format_profile(p["arm"], p) for p in profiles] + host_texts)
    print(json.dumps(info))
    print(table)
    if prof_text:
        print()
        print(prof_text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        _write_atomic(os.path.join(args.out, "megatron_layer_bench.json"),
                      json.dumps({"info": info, "rows": rows, "profiles": profiles}, indent=2))
        _write_atomic(os.path.join(args.out, "megatron_layer_bench.md"),
                      table + "\n" + ("\n" + prof_text + "\n" if prof_text else ""))
    teardown_parallel()


if __name__ == "__main__":
    main()
