"""Host cost of the FP8 linear's pieces at the update's micro-batch size (issue 29 item 3).

At ~2K tokens the Qwen3-8B layer in FP8 is host-bound: eager it ran 1.02x BF16, captured as CUDA graphs 1.24x
(bench/RESULTS.md, 2026-12-07). This says where the host time goes, op by op, for each of the layer's four linears:

- host us: wall time of N calls issued back to back (kernels are asynchronous; nothing syncs inside the loop);
- device us: GPU time of the same N calls, measured with every launch already queued behind a GPU sleep, so no host
  gap enters it;
- an op whose host time exceeds its device time leaves the GPU idle at this M.

Ops: the three FP8 quantizers, each GEMM form through the dispatch (`fp8/gemm.py`) and straight into every backend
the machine has (the dispatch's own cost, and which backend is cheapest to issue at this M: cuBLASLt's blockwise
FP8 call was among the top host items of one layer cProfile at 2K tokens, not at 8K), the whole autograd FP8 linear
forward and forward+backward against BF16's, the same math issued as bare pieces with no autograd around it, the FP8
backward's body timed from inside (on CUDA autograd runs it on its own device thread: the rest of fwd+bwd is the
engine's hand-over), optionally torch.profiler's CPU self time per op (every thread), and two floors: an empty
Triton kernel's launch and one ``torch.empty``. ``--thread-probe`` calls the backward body's own code directly on the
main thread and on a worker thread (is the body slow because of the thread it runs on?), reruns fwd+bwd with a 1 s
GIL switch interval (is a thread fighting for the GIL?), and with ``--torch-profile`` adds cProfile of the body on
autograd's thread and on the main thread (which Python functions take the time).

    python3 bench/host_overhead.py --tokens 2048 --torch-profile --thread-probe --out bench/host_overhead.json
    TRITON_INTERPRET=1 python3 bench/host_overhead.py --tiny --iters 2   (a CPU smoke run: host times only)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import sys
import threading
import time
import types
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bench_report import write_report  # noqa: E402

from jetrl_megatron.fp8 import gemm, quant_dispatch  # noqa: E402
from jetrl_megatron.fp8.linear import _Fp8LinearFunction, fp8_linear  # noqa: E402
from jetrl_megatron.fp8.triton_common import interpreting  # noqa: E402
from jetrl_megatron.megatron.backward_thread import backward_thread_scope  # noqa: E402
from jetrl_megatron.megatron.spec import per_rank_gemm_shapes  # noqa: E402
from jetrl_megatron.model.shapes import get_model_shape  # noqa: E402
from jetrl_megatron.recipe import Fp8Recipe  # noqa: E402


@triton.jit
def _noop_kernel(x_ptr):
    """Stores nothing: the floor of one Triton launch from Python."""
    pid = tl.program_id(0)
    tl.store(x_ptr + pid, 0.0, mask=pid < 0)


def linear_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """The layer's four FP8 linears as (N out, K in), one rank; fc1 as the layer runs it, gate and up in one GEMM."""
    sizes = per_rank_gemm_shapes(get_model_shape(preset), tp=1)
    fc1_n, fc1_k = sizes["mlp.linear_fc1"]
    return {"qkv": sizes["self_attention.linear_qkv"], "proj": sizes["self_attention.linear_proj"],
            "fc1": (2 * fc1_n, fc1_k), "fc2": sizes["mlp.linear_fc2"]}


def time_op(fn: Callable[[], object], iters: int, cuda: bool) -> dict[str, float | None]:
    """(host us, device us) per call of ``fn`` (see the module docstring); device is None without CUDA."""
    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host_us = (time.perf_counter() - t0) / iters * 1e6
    if not cuda:
        return {"host_us": host_us, "device_us": None}
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # hold the GPU long enough for the host to queue all N calls: then the events time the GPU alone
    torch.cuda._sleep(int((host_us * iters * 1.5 + 2000) * 1.98e3))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return {"host_us": host_us, "device_us": start.elapsed_time(end) / iters * 1e3}


def linear_ops(m: int, n: int, k: int, recipe: Fp8Recipe, device: torch.device) -> dict[str, Callable[[], object]]:
    """Every op timed for one (N, K) linear at M tokens, on random inputs."""
    gen = torch.Generator(device=device).manual_seed(n * 31 + k)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * k ** -0.5).requires_grad_(True)
    wq, ws = quant_dispatch.quant_weight(w.detach(), recipe)
    xq, xs = quant_dispatch.quant_act(x, recipe)
    gq, gs, gtq, gts = quant_dispatch.quant_dual(dy, recipe)
    xtq, xts = quant_dispatch.regroup_for_wgrad(xq, xs, recipe)
    operands = {"fprop": (xq, xs, wq, ws), "dgrad": (gq, gs, wq, ws), "wgrad": (gtq, gts, xtq, xts)}
    dispatch = {"fprop": gemm.fp8_gemm_fprop, "dgrad": gemm.fp8_gemm_dgrad, "wgrad": gemm.fp8_gemm_wgrad}
    xg = x.detach().clone().requires_grad_(True)
    w_bf16 = w.detach().clone().requires_grad_(True)

    def fp8_fwd_bwd() -> None:
        fp8_linear(xg, w, recipe=recipe, weight_fp8=(wq, ws)).backward(dy)

    def bf16_fwd_bwd() -> None:
        torch.nn.functional.linear(xg, w_bf16).backward(dy)

    ops: dict[str, Callable[[], object]] = {
        "quant_act x": lambda: quant_dispatch.quant_act(x, recipe),
        "quant_dual dY": lambda: quant_dispatch.quant_dual(dy, recipe),
        "regroup x for WGrad": lambda: quant_dispatch.regroup_for_wgrad(xq, xs, recipe),
    }
    kernels = quant_dispatch._triton_kernels()
    if kernels is not None:  # the one-pass dual quantizer: one launch instead of two (cheaper to issue at small M?)
        ops["quant_dual dY one pass"] = lambda: kernels.quant_dual(dy, recipe, split=False)
    backends = [b for b in gemm.GPU_BACKENDS if gemm.load_backend(b) is not None] if device.type == "cuda" else []
    for form, args in operands.items():
        picked = gemm.resolve_backend(form, device, args[0].shape[0], None, recipe)
        ops[f"{form} via dispatch ({picked})"] = lambda f=dispatch[form], a=args: f(*a, recipe=recipe)
        # every backend this machine has, straight in: the dispatch's own cost, and each backend's host cost at this M
        for name in backends or ["emulated"]:
            direct = gemm._EMULATED[form] if name == "emulated" else getattr(gemm.load_backend(name), form)
            ops[f"{form} {name} direct"] = lambda f=direct, a=args: f(*a)
    ops["fp8_linear fwd (no grad)"] = lambda: fp8_linear(x, w, recipe=recipe, weight_fp8=(wq, ws))
    ops["fp8_linear fwd+bwd"] = fp8_fwd_bwd
    ops["bf16 linear fwd+bwd"] = bf16_fwd_bwd

    def on_calling_thread(fwd_bwd: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:  # autograd's backward on this thread instead of its device thread, as the trainer runs it
            with backward_thread_scope("calling"):
                fwd_bwd()
        return run

    ops["fp8_linear fwd+bwd, backward on the calling thread"] = on_calling_thread(fp8_fwd_bwd)
    ops["bf16 linear fwd+bwd, backward on the calling thread"] = on_calling_thread(bf16_fwd_bwd)

    @torch.no_grad()
    def fp8_pieces() -> None:  # the autograd linear's math, issued from this thread with no autograd around it
        aq, a_s = quant_dispatch.quant_act(x, recipe)
        gemm.fp8_gemm_fprop(aq, a_s, wq, ws, recipe=recipe)
        q, s, qt, st = quant_dispatch.quant_dual(dy, recipe)
        gemm.fp8_gemm_dgrad(q, s, wq, ws, recipe=recipe)
        rq, rs = quant_dispatch.regroup_for_wgrad(aq, a_s, recipe)
        gemm.fp8_gemm_wgrad(qt, st, rq, rs, recipe=recipe)

    @torch.no_grad()
    def bf16_pieces() -> None:
        torch.nn.functional.linear(x, w_bf16)
        dy @ w_bf16
        dy.t() @ x

    ops["fp8 pieces fwd+bwd, no autograd"] = fp8_pieces
    ops["bf16 pieces fwd+bwd, no autograd"] = bf16_pieces
    return ops


def backward_body_us(fwd_bwd: Callable[[], object], iters: int) -> float:
    """Mean wall time of the FP8 linear's backward body per call, timed inside it: on CUDA autograd runs it on its
    device thread, so this against the whole fwd+bwd separates the body from the engine's hand-over around it."""
    spent = []

    def timed(original):
        def backward(ctx, dy):
            t0 = time.perf_counter()
            out = original(ctx, dy)
            spent.append(time.perf_counter() - t0)
            return out
        return backward

    with _backward_wrapped(timed):
        for _ in range(iters):
            fwd_bwd()
    return sum(spent) / len(spent) * 1e6


@contextlib.contextmanager
def _backward_wrapped(wrap: Callable[[Callable], Callable]):
    """The FP8 linear's backward replaced by ``wrap(original)`` inside the block (to time or profile it where
    autograd runs it), the original back after it."""
    fn_cls = _Fp8LinearFunction
    original = fn_cls.backward
    fn_cls.backward = staticmethod(wrap(original))
    try:
        yield
    finally:
        fn_cls.backward = staticmethod(original)


def _body_args(m: int, n: int, k: int, recipe: Fp8Recipe, device: torch.device):
    """A stand-in ctx and dY for calling the FP8 backward body directly, outside autograd: the very code the
    engine runs, with the forward's saved tensors."""
    gen = torch.Generator(device=device).manual_seed(n * 17 + k)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * k ** -0.5
    wq, ws = quant_dispatch.quant_weight(w, recipe)
    xq, xs = quant_dispatch.quant_act(x, recipe)
    ctx = types.SimpleNamespace(saved_tensors=(xq, xs, wq, ws), recipe=recipe, reference_quant=False,
                                x_shape=x.shape, x_dtype=x.dtype, weight_dtype=w.dtype, has_bias=False,
                                needs_input_grad=(True, True, False, False, False, False, False))
    return ctx, dy


def thread_probe(m: int, n: int, k: int, recipe: Fp8Recipe, device: torch.device, iters: int) -> dict[str, float]:
    """The FP8 backward body's own code, called directly (no autograd) on the main thread and on a fresh worker
    thread, timed inside each: against "backward body (timed inside)" this says whether the body is slow because of
    the thread it runs on (autograd's device thread) or because of autograd."""
    ctx, dy = _body_args(m, n, k, recipe, device)

    def body() -> object:
        return _Fp8LinearFunction.backward(ctx, dy)

    def host_us() -> float:  # time_op's host loop alone: the worker thread has no device timing to add
        return time_op(body, iters, cuda=False)["host_us"]

    out = {"fp8 backward body, main thread": host_us()}
    spent: list[float] = []
    worker = threading.Thread(target=lambda: spent.append(host_us()), name="probe-worker")
    worker.start()
    worker.join()
    out["fp8 backward body, worker thread"] = spent[0]
    return out


def cprofile_text(fn: Callable[[], object], iters: int, top: int, *, in_backward: bool = False) -> str:
    """cProfile's top functions by own time over ``iters`` calls of ``fn``. in_backward: profile only the FP8
    backward body, on whichever thread autograd runs it (cProfile hooks the thread that enables it)."""
    prof = cProfile.Profile()
    if not in_backward:
        prof.enable()
        for _ in range(iters):
            fn()
        prof.disable()
    else:
        def profiled(original):
            def backward(ctx, dy):
                prof.enable()
                try:
                    return original(ctx, dy)
                finally:
                    prof.disable()
            return backward

        with _backward_wrapped(profiled):
            for _ in range(iters):
                fn()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    lines = [line for line in buf.getvalue().splitlines() if line.strip()]
    # the body's own line, whatever the top rows were: how many bodies ran under the profiler and their mean time
    body = [(nc, ct) for (path, _, name), (_, nc, _, ct, _) in stats.stats.items()
            if name == "backward" and path.endswith(os.path.join("fp8", "linear.py"))]
    for nc, ct in body:
        lines.append(f"fp8 backward bodies profiled: {nc} calls, {ct / nc * 1e6:.0f} us each (cumulative, profiled)")
    return "\n".join(lines)


def torch_profile(fn: Callable[[], object], iters: int, top: int) -> str:
    """torch.profiler's CPU self time per op over ``iters`` calls (every thread, the autograd device thread too)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(iters):
                fn()
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    except RuntimeError as err:  # an optional table: the rows already timed are worth more than it
        return f"torch.profiler failed: {err}"


def run(args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available()
    if not (cuda or interpreting()):
        raise SystemExit("host_overhead: the FP8 kernels need CUDA (or TRITON_INTERPRET=1 for a CPU smoke run)")
    device = torch.device("cuda" if cuda else "cpu")
    recipe = Fp8Recipe(mode="jetrl")
    rows: list[dict] = []
    profiles: dict[str, str] = {}
    floor = torch.zeros(1, device=device)
    floors = {"triton empty kernel launch": lambda: _noop_kernel[(1,)](floor),
              "torch.empty 1 MiB": lambda: torch.empty(1 << 20, dtype=torch.uint8, device=device)}
    for op, fn in floors.items():
        rows.append({"linear": "-", "op": op, **time_op(fn, args.iters, cuda)})
    for lin, (n, k) in linear_shapes(args.preset).items():
        ops = linear_ops(args.tokens, n, k, recipe, device)
        for op, fn in ops.items():
            with torch.no_grad() if op.endswith("(no grad)") else torch.enable_grad():
                rows.append({"linear": f"{lin} {n}x{k}", "op": op, **time_op(fn, args.iters, cuda)})
            print(f"{lin:5s} {op:28s} host {rows[-1]['host_us']:9.1f} us  device "
                  f"{rows[-1]['device_us'] if rows[-1]['device_us'] is None else round(rows[-1]['device_us'], 1)}",
                  flush=True)
        body = backward_body_us(ops["fp8_linear fwd+bwd"], args.iters)
        rows.append({"linear": f"{lin} {n}x{k}", "op": "fp8_linear backward body (timed inside)", "host_us": body,
                     "device_us": None})
        if args.thread_probe:
            for op, us in thread_probe(args.tokens, n, k, recipe, device, args.iters).items():
                rows.append({"linear": f"{lin} {n}x{k}", "op": op, "host_us": us, "device_us": None})
            interval = sys.getswitchinterval()
            sys.setswitchinterval(1.0)  # a thread waiting for the GIL forces a switch only after this long
            try:
                rows.append({"linear": f"{lin} {n}x{k}", "op": "fp8_linear fwd+bwd, GIL switch interval 1 s",
                             **time_op(ops["fp8_linear fwd+bwd"], args.iters, cuda)})
            finally:
                sys.setswitchinterval(interval)
        if args.torch_profile and not profiles:  # the first linear only: one table per arm is enough to read
            profiles = {arm: torch_profile(ops[arm], args.iters, 20)
                        for arm in ("fp8_linear fwd+bwd", "bf16 linear fwd+bwd")}
            if args.thread_probe:
                ctx, dy = _body_args(args.tokens, n, k, recipe, device)
                profiles["cProfile: fp8 backward body on autograd's thread"] = cprofile_text(
                    ops["fp8_linear fwd+bwd"], args.iters, 25, in_backward=True)
                profiles["cProfile: fp8 backward body on the main thread"] = cprofile_text(
                    lambda c=ctx, g=dy: _Fp8LinearFunction.backward(c, g), args.iters, 25)
    env = {"torch": torch.__version__, "triton": triton.__version__, "tokens": args.tokens, "preset": args.preset,
           "iters": args.iters, "device": torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET=1)",
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "python_threads": sorted(t.name for t in threading.enumerate())}
    return {"env": env, "rows": rows, "layer": layer_totals(rows), "torch_profile": profiles}


LAYER_ARMS = ("fp8_linear fwd+bwd", "bf16 linear fwd+bwd", "fp8_linear fwd+bwd, backward on the calling thread",
              "bf16 linear fwd+bwd, backward on the calling thread", "fp8 pieces fwd+bwd, no autograd",
              "bf16 pieces fwd+bwd, no autograd", "fp8_linear backward body (timed inside)")


def layer_totals(rows: list[dict]) -> dict[str, dict[str, float | None]]:
    """The four linears' fwd+bwd summed, FP8 and BF16, through autograd and as bare pieces: host vs device per
    layer (and the FP8 backward bodies' own time)."""
    out = {}
    for arm in LAYER_ARMS:
        picked = [r for r in rows if r["op"] == arm]
        dev = [r["device_us"] for r in picked]
        out[arm] = {"host_us": sum(r["host_us"] for r in picked),
                    "device_us": None if None in dev else sum(dev)}
    return out


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"Host vs device per call, {env['preset']} linears at {env['tokens']} tokens, {env['device']}, torch "
             f"{env['torch']}, triton {env['triton']}, {env['iters']} calls per op, {env['date']}", "",
             "| linear | op | host us | device us | host / device |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        dev = r["device_us"]
        ratio = "-" if not dev else f"{r['host_us'] / dev:.2f}"
        lines.append(f"| {r['linear']} | {r['op']} | {r['host_us']:.1f} | {'-' if dev is None else f'{dev:.1f}'} "
                     f"| {ratio} |")
    lines += ["", "| the layer's four linears, fwd+bwd | host us | device us |", "|---|---|---|"]
    for arm, t in result["layer"].items():
        dev = t["device_us"]
        lines.append(f"| {arm} | {t['host_us']:.1f} | {'-' if dev is None else f'{dev:.1f}'} |")
    for arm, table in result.get("torch_profile", {}).items():
        what = arm if arm.startswith("cProfile") else f"torch.profiler, CPU self time, {arm}"
        lines += ["", f"{what} (the first linear, {env['iters']} calls):", "", "```", table.rstrip(), "```"]
    if env.get("python_threads"):
        lines += ["", f"Python threads alive: {', '.join(env['python_threads'])}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="M, the micro-batch's tokens (default 2048)")
    ap.add_argument("--preset", default="qwen3-8b", help="model shape preset (default qwen3-8b)")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset at 256 tokens (CPU smoke run)")
    ap.add_argument("--iters", type=int, default=50, help="calls per op (default 50: ~500 launches queue at most)")
    ap.add_argument("--out", help="write the rows as JSON here (and the table beside it as .md)")
    ap.add_argument("--torch-profile", action="store_true",
                    help="also torch.profiler's CPU self time per op of the first linear's fwd+bwd, FP8 and BF16")
    ap.add_argument("--thread-probe", action="store_true",
                    help="also the FP8 backward body called directly on the main and on a worker thread, fwd+bwd "
                         "with a 1 s GIL switch interval, and (with --torch-profile) cProfile of the body on "
                         "autograd's thread and on the main thread")
    args = ap.parse_args(argv)
    if args.tiny:
        args.preset, args.tokens = "tiny", min(args.tokens, 256)
    if args.tokens <= 0 or args.iters <= 0:
        ap.error(f"--tokens and --iters must be positive (got {args.tokens}, {args.iters})")
    result = run(args)
    write_report(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
