"""The overrides that make `jetrl run` on tiny_cpu a small run, shared by the end-to-end tests (one place to change
the batch shape every such test relies on)."""

from __future__ import annotations

# 4 prompts x 4 samples = 16 per step: one optimizer update (global batch 16) in 2 micro-batches of 8
BATCH = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16",
         "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8"]
# no validation at all: no periodic one (val_period 0), none before GRPO or at the last step
NO_VAL = ["grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false"]


def small_run(warmstart_steps: int, *, val_period: int | None = None, max_num_steps: int | None = None,
              final_arm_probe: bool | None = False, plot: bool = True, tensorboard: bool = True) -> list[str]:
    """BATCH plus a `warmstart_steps`-step supervised warm start (batch 16), no progress bars, and:

    val_period None: NO_VAL; else validation every `val_period` steps on 8 held-out prompts (plus the recipe's
    val_at_start / val_at_end). final_arm_probe None keeps the recipe's; plot / tensorboard False turn them off."""
    out = [*BATCH]
    if max_num_steps is not None:
        out.append(f"grpo.max_num_steps={max_num_steps}")
    out.append(f"policy.jet_rl.sft_warmstart.steps={warmstart_steps}")
    if warmstart_steps:
        out.append("policy.jet_rl.sft_warmstart.batch_size=16")
    if final_arm_probe is not None:
        out.append(f"policy.jet_rl.final_arm_probe={str(final_arm_probe).lower()}")
    out.append("policy.jet_rl.progress_bars=false")
    out += NO_VAL if val_period is None else [f"grpo.val_period={val_period}", "grpo.max_val_samples=8"]
    if not tensorboard:
        out.append("logger.tensorboard_enabled=false")
    if not plot:
        out.append("policy.jet_rl.plot_enabled=false")
    return out
