"""Run health: optimizer updates that were skipped, and a policy that collapsed to uniform sampling.

Why: Megatron's optimizer skips an update whose loss or gradients are not finite and leaves the policy unchanged;
such steps used to print like any other step (with ``train/loss`` null in metrics.jsonl) and a run in which no update
happened still exited 0. A collapsed policy (e.g. a learning rate orders of magnitude too large) samples uniformly
over the vocabulary: the sampled tokens' mean negative log-probability reaches ln V, rewards and gradients vanish.
Both are now counted, printed, written to summary.json, and a run without a single update fails.
"""

from __future__ import annotations

import math
from typing import Any

COLLAPSED_FRAC = 0.98  # sampling entropy within 2% of ln V: (nearly) uniform over the vocabulary
INFORMED_FRAC = 0.9  # an earlier step below 90% of ln V: the policy had been more than noise


def skipped_updates(row: dict[str, Any]) -> int:
    """Optimizer updates skipped during one GRPO step (``train/skipped_steps``)."""
    return int(row.get("train/skipped_steps") or 0)


def step_note(metrics: dict[str, Any], updates_per_step: int) -> str:
    """Suffix for a step's progress line: empty, or what was skipped."""
    k = skipped_updates(metrics)
    if not k:
        return ""
    return (f" | UPDATE SKIPPED ({k} of {updates_per_step}: non-finite loss or gradients, "
            f"{'policy unchanged' if k == updates_per_step else 'partly applied'})")


def find_collapse(rows: list[dict[str, Any]], vocab_size: int) -> dict[str, Any] | None:
    """The first step whose sampling entropy is ~ln V after an earlier step was clearly below it, else None."""
    ln_v = math.log(vocab_size)
    informed: tuple[int, float] | None = None
    for r in rows:
        e = r.get("policy/approx_entropy")
        if e is None or r.get("step", 0) <= 0:
            continue
        if informed is not None and e >= COLLAPSED_FRAC * ln_v:
            return {"step": r["step"], "entropy": e, "ln_vocab": ln_v, "vocab_size": vocab_size,
                    "entropy_before": informed[1], "step_before": informed[0], "reward": r.get("reward/mean"),
                    "grad_norm": r.get("train/grad_norm")}
        if e <= INFORMED_FRAC * ln_v:
            informed = (r["step"], e)
    return None


def collapse_warning(c: dict[str, Any], lr: float) -> str:
    gn, reward = c.get("grad_norm"), c.get("reward")
    gn_text = "n/a (update skipped)" if gn is None or not math.isfinite(gn) else f"{gn:.3g}"
    return (f"warning: the policy collapsed at step {c['step']}: sampling entropy {c['entropy']:.3f} ~ ln V = "
            f"{c['ln_vocab']:.3f} (uniform over the {c['vocab_size']} tokens; {c['entropy_before']:.3f} at step "
            f"{c['step_before']}), reward {'n/a' if reward is None else f'{reward:.3f}'}, grad norm {gn_text}; "
            f"the updates are most likely far too large: lower policy.megatron_cfg.optimizer.lr (now {lr:g})")


def update_summary(rows: list[dict[str, Any]], updates_per_step: int) -> dict[str, Any]:
    """Counts for summary.json: optimizer updates applied and skipped, and the GRPO steps that skipped any."""
    steps = [r for r in rows if r.get("step", 0) > 0]
    skipped = sum(skipped_updates(r) for r in steps)
    return {"optimizer_updates": len(steps) * updates_per_step - skipped, "skipped_updates": skipped,
            "skipped_steps": [r["step"] for r in steps if skipped_updates(r)]}


def no_update_error(counts: dict[str, Any], steps: int, kl_penalty: float, lr: float) -> str:
    return (f"no optimizer update was applied: all {counts['skipped_updates']} updates of the {steps} GRPO step(s) "
            f"were skipped for a non-finite loss or gradients (train/loss is null in metrics.jsonl), so the policy "
            f"never changed; check loss_fn.reference_policy_kl_penalty (now {kl_penalty:g}) and "
            f"policy.megatron_cfg.optimizer.lr (now {lr:g})")
