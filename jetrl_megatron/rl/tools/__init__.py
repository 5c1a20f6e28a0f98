"""The commands around a run, not the run itself: `jetrl plan` (``run_plan``, ``recommend_layout``), `jetrl run`'s
preflight (``run_preflight``), `jetrl compare` (``compare``, ``compare_runner``), the per-arm mismatch probe
(``mismatch_probe``) and the served-FP8 byte check (``served_fp8_check``)."""
