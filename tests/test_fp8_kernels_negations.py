"""CPU: every unary minus inside the project's Triton kernels is one whose sign of zero cannot matter.

Why: Triton 3.6 (the GPU machine's) lowers ``-v`` as ``0 - v``, so -(+0) comes out +0; in the quant kernels' quotient
that lost every -0 code's sign on the GPU (fixed with ``kernels._negate``, a multiply by -1; the sm_90 PTX check in
test_fp8_kernels_sass.py). The interpreter and Triton 3.9 negate correctly, so no CPU run of a kernel can show such a
bug: this test reads the kernels' source instead. A new ``-v`` on a value fails here until it goes through
``_negate`` or is listed below with the reason its sign of zero is harmless.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jetrl_megatron"

# (module path, kernel, negated expression) -> why -(+0) = +0 changes no output byte
HARMLESS = {
    ("megatron/swiglu_fp8.py", "_swiglu_grad_tile", "-g"): "exp(-g): exp(+0) = exp(-0) = 1",
    ("megatron/triton_numerics.py", "_swiglu_fwd_kernel", "-g"): "exp(-g): exp(+0) = exp(-0) = 1",
    ("megatron/triton_numerics.py", "_swiglu_bwd_kernel", "-g"): "exp(-g): exp(+0) = exp(-0) = 1",
    ("fp8/stress_kernels.py", "_round_half_even", "-r"): "the rounded value is stored as an integer code",
    ("fp8/stress_kernels.py", "_int_codes_kernel", "-qmax"): "a clamp bound, qmax > 0",
}


def _is_triton_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def value_negations() -> dict[tuple[str, str, str], int]:
    """(module, kernel, expression) -> line of each unary minus on a non-constant inside a @triton.jit function."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        for fn in ast.walk(ast.parse(source)):
            if not (isinstance(fn, ast.FunctionDef) and any(_is_triton_jit(d) for d in fn.decorator_list)):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
                        and not isinstance(node.operand, ast.Constant)):
                    key = (path.relative_to(PACKAGE).as_posix(), fn.name, ast.get_source_segment(source, node))
                    found[key] = node.lineno
    return found


def test_every_negation_in_a_triton_kernel_is_harmless_or_a_true_sign_flip():
    found = value_negations()
    assert found, "no Triton kernel found: the scan reads the wrong tree"
    unlisted = {k: line for k, line in found.items() if k not in HARMLESS}
    assert not unlisted, (
        "unary minus on a value in a Triton kernel (Triton 3.6 lowers it as 0 - v: -(+0) = +0); use "
        f"fp8.kernels._negate, or list it in HARMLESS with the reason: {unlisted}")
    stale = set(HARMLESS) - set(found)
    assert not stale, f"HARMLESS lists negations the kernels no longer have: {stale}"


def test_the_scan_sees_a_negation_it_was_not_told_about(tmp_path, monkeypatch):
    """The scan itself can fail: a kernel with a bare ``-x`` is reported."""
    pkg = tmp_path / "jetrl_megatron"
    pkg.mkdir()
    (pkg / "k.py").write_text("import triton\n\n@triton.jit\ndef k(x):\n    return -x + -1.0\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    assert value_negations() == {("k.py", "k", "-x"): 5}
