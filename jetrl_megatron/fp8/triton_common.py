"""What every bit-exact Triton kernel of this project shares: the launch options that keep IEEE rounding (no FMA
contraction) and the round-to-nearest-even BF16 cast that also holds under the Triton interpreter.

Why here (the fp8 layer): the stress-format kernels (fp8/stress_kernels.py) and the Megatron element-wise kernels
(megatron/triton_numerics.py) both need them, and a module may import only from its own layer or below.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: the torch twins run
    triton = None


def interpreting() -> bool:
    """True under the Triton interpreter. Asked from Triton itself: ``TRITON_INTERPRET`` is Triton's switch (it
    decides, when a kernel is defined, whether it runs interpreted), not one of this project's."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


_CUDA_OPTS: list = []


def launch_opts() -> dict:
    """No FMA contraction; non-FTZ libdevice (``expf``/``rsqrtf`` as in torch's non-FTZ CUDA build) where the
    installed triton has that option."""
    if interpreting():
        return {}
    if not _CUDA_OPTS:
        opts = {"enable_fp_fusion": False}
        try:
            from triton.backends.nvidia.compiler import CUDAOptions

            if "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__:
                opts["enable_reflect_ftz"] = False
        except ImportError:
            pass
        _CUDA_OPTS.append(opts)
    return _CUDA_OPTS[0]


if triton is not None:

    @triton.jit
    def round_bf16(x, EMU_BF16: tl.constexpr):
        """FP32 -> the nearest-even BF16 value, kept in FP32 (EMU_BF16: in integer arithmetic, for the interpreter,
        whose own cast does not round to nearest even)."""
        if EMU_BF16:
            b = x.to(tl.uint32, bitcast=True)
            b = b + 0x7FFF + ((b >> 16) & 1)
            b = (b >> 16) << 16
            return b.to(tl.float32, bitcast=True)
        else:
            return x.to(tl.bfloat16).to(tl.float32)
