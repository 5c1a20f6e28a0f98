"""FP8 GEMM backends behind `fp8/gemm.py`'s dispatch, loaded lazily by name.

Each module exposes `available() -> bool` and `fprop`, `dgrad`, `wgrad` with the operand layouts documented in
`fp8/gemm.py`. `auto_table.py` holds the measured per-form / per-M choice used by `gemm_backend="auto"` on CUDA.
"""
