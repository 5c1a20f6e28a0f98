"""The FP8 quantization kernels compiled for sm_90 without a GPU: SASS instructions per element, by launch variant.

Why: the token-grouped kernels are instruction-bound on Hopper (a regroup program of 128 x 64 codes issued ~2,600
instructions per thread for 64 elements), so the static instruction count of one program, divided by the elements a
thread handles, ranks variants before any GPU time is spent. Triton compiles for a named target offline and ships
ptxas / cuobjdump; nothing here launches a kernel. Timings still come from bench/kernels_bench.py on the GPU.

    python bench/sass_counts.py                       # every kernel, this tree's fp8/kernels.py
    python bench/sass_counts.py --baseline OLD.py     # the same launch variants of an earlier kernels file too
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from types import ModuleType

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
OPS = ("FFMA", "FMUL", "MUFU", "CALL", "SHFL", "BAR", "LDS", "STS", "LDG", "STG", "F2FP", "PRMT")
# arguments the runtime specializes as multiples of 16 (pointers from torch's allocator, strides of 128-wide groups)
ALIGNED = ("x_ptr", "w_ptr", "q_ptr", "s_ptr", "qt_ptr", "st_ptr", "K", "N", "stride_xm", "stride_wn", "stride_qm",
           "stride_qn", "stride_sn", "stride_sg", "stride_qtn", "stride_qtk", "stride_stg")


def _signature(fn, consts: dict, pointer_types: dict) -> dict:
    sig = {}
    for arg in fn.arg_names:
        if arg in consts:
            sig[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            sig[arg] = pointer_types.get(arg, "*fp32")
        else:
            sig[arg] = "fp32" if arg == "eps" else "i32"
    return sig


def compile_sm90(fn, consts: dict, pointer_types: dict, num_warps: int):
    """One specialization compiled for sm_90 (Triton's compiled kernel: .asm holds the PTX and the cubin)."""
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ALIGNED
             if a in fn.arg_names and a not in consts}
    src = ASTSource(fn, _signature(fn, consts, pointer_types), constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps})


def sass_of(compiled) -> str:
    """The SASS listing of a compiled kernel's cubin (Triton's bundled cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(compiled.asm["cubin"])
    try:
        return subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", fh.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(fh.name)


def compile_sass(fn, consts: dict, pointer_types: dict, num_warps: int) -> tuple[str, int]:
    """SASS text and shared-memory bytes of one specialization, compiled for sm_90."""
    compiled = compile_sm90(fn, consts, pointer_types, num_warps)
    return sass_of(compiled), compiled.metadata.shared


def op_counts(sass: str) -> dict[str, int]:
    """Instruction count of the SASS listing and the count of each opcode in OPS."""
    lines = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass)]
    counts = {"instr": len(lines)}
    for op in OPS:
        counts[op] = sum(1 for line in lines if line == op)
    return counts


def variants(module: ModuleType) -> list[tuple[str, str, dict, dict, int, int]]:
    """(label, kernel, constexprs, pointer types, warps, elements per thread) for each kernel and launch shape."""
    common = {"POW2": False, "CAST": True, "GROUP": 128}
    fp8_in = {"q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv"}
    bf16_in = {"q_ptr": "*bf16", "qt_ptr": "*fp8e4nv"}
    has_vec = "LOAD_VEC" in module._regroup_kernel.arg_names
    out = []
    for name, ptrs, has_scale in (("regroup", fp8_in, True), ("quant_dual transposed pass", bf16_in, False)):
        for feats, warps in ((64, 4), (128, 4), (128, 8)):
            for vec in ((0, 2, 4) if has_vec else (0,)):
                consts = {**common, "stride_qk": 1, "stride_sm": 1, "stride_stn": 1, "TOKENS": 128, "FEATS": feats,
                          "TRANS_MODE": 1, "HAS_SCALE": has_scale, "LOAD_VEC": vec}
                out.append((f"{name} f={feats} w={warps} vec={vec}", "_regroup_kernel", consts, ptrs, warps,
                            128 * feats // (32 * warps)))
    out.append(("quant_act bm=32 w=4", "_quant_rows_kernel",
                {**common, "stride_xk": 1, "stride_sm": 1, "BLOCK_M": 32}, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv"},
                4, 32 * 128 // 128))
    out.append(("quant_weight w=4", "_quant_weight_kernel",
                {**common, "stride_wk": 1, "WRITE_T": False, "TILE": 128, "TRANS_MODE": 1},
                {"w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv"}, 4, 128 * 128 // 128))
    return out


def table(module: ModuleType, tag: str) -> list[str]:
    rows = []
    for label, kernel, consts, ptrs, warps, per_thread in variants(module):
        sass, smem = compile_sass(getattr(module, kernel), consts, ptrs, warps)
        c = op_counts(sass)
        cells = " | ".join(str(c[op]) for op in OPS)
        rows.append(f"| {tag} | {label} | {c['instr']} | {c['instr'] / per_thread:.1f} | {cells} | {smem} |")
    return rows


def load_module(path: str, name: str = "kernels_under_test") -> ModuleType:
    """A kernels file (e.g. an earlier fp8/kernels.py from `git show`) imported under another name."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=None, help="an earlier fp8/kernels.py, compiled side by side")
    args = ap.parse_args(argv)
    from jetrl_megatron.fp8 import kernels

    print(f"triton {triton.__version__}, target sm_{TARGET.arch}; static counts of one program's SASS")
    print("| kernels | kernel and launch | SASS instr | per element | " + " | ".join(OPS) + " | smem B |")
    print("|---" * (len(OPS) + 5) + "|")
    for line in table(kernels, "this tree"):
        print(line, flush=True)
    if args.baseline:
        for line in table(load_module(args.baseline), "baseline"):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
