#!/bin/bash
# The long-response learning experiment on one GPU (docs/rl.md): every arm x 2 seeds from one BF16 warm start per
# response length. Usage: bash bench/long_response_gpu.sh warmstart|short|long|learn OUT_DIR [overrides...]
#   warmstart  both shared warm starts, nothing else: the short one (255-token answers, the recipe's 800 steps: per-token
#              loss 5.1 -> 0.0025, held-out greedy 0.86), then the long one (1025-token answers) continuing from it
#              until the mean per-token loss of 10 steps is 0.001 (at most 200 steps; 124 were needed on 2026-12-02).
#   short      the three arms x 2 seeds at 255 tokens, six runs at once, 30 GRPO steps (reuses the warm start; ~10-12
#              s per step with six sharing the GPU)
#   long       the same at 1025 tokens, six runs at once (106 GiB of the H200 in use at the peak sample), 10 GRPO steps
#              (~17 s per step shared; 300 s in all). At 2K tokens one run peaks near 49 GiB: PARALLEL=2 there.
#   learn      issue 31 item 2, the round in which BF16 should learn: from its own ~1K warm start stopped earlier
#              (per-token loss LEARN_STOP, default 0.01, continuing from the short warm start), GRPO at lr LEARN_LR
#              (default 3e-5: on the CPU count task 1e-4 and above made BF16 itself worse) for LEARN_STEPS steps
#              (default 20), the three arms and the INT4 stressor's off-policy and unified arms (one GPU, opted in
#              with policy.jet_rl.stress.gpu; LEARN_ARMS to choose) x 2 seeds, PARALLEL (default 5; 80 GB cards: 3)
#              at once; then the dose-response table and plot. WARMSTART_ONLY=1 stops after the warm start (a call
#              of its own). LEARN_REUSE_FROM=dir (e.g. bench/long_response/learn_1k_h100): that round's finished
#              runs are adopted, not run again, when this machine's warm start is the same to the last bit (`jetrl
#              compare --reuse-from`). On the GPU it was not (2026-12-06: the short warm start's loss differed from
#              its second logged point on; the attention backward's atomic adds), so a round finishing arms on
#              another machine ran BF16 again beside them, e.g. LEARN_ARMS=bf16,offpolicy_int4_tensor,
#              unified_int4_tensor; every mode now runs the fixed-order backward (below: whether that makes two
#              machines' warm starts alike is not yet measured). Each run checkpoints every 5
#              steps (the newest kept): the same command again on the same machine (a call cut at its limit) keeps
#              the finished runs and continues the cut ones from their last checkpoint (`jetrl compare --reuse`)
# Everything the runs write stays in /tmp/jetrl_long/<length>; OUT_DIR gets the metrics, summaries, logs and plots
# (not the model directories). TIME_LIMIT (seconds) stops the harness so what was written is still copied out.
set -euo pipefail
mode=${1:?warmstart|short|long|learn}
out=${2:?OUT_DIR}
shift 2
# the long task: 205 terms x 5 characters = 1025 response tokens; 1056 new tokens leave room to run on; prompt <= 32
long_ov=(data.train.num_terms=205 policy.generation.max_new_tokens=1056 policy.max_total_sequence_length=1088
         policy.generation.vllm_cfg.max_model_len=1088 grpo.max_num_steps=10 grpo.max_val_samples=32
         policy.model_name=/tmp/jetrl_long/short/warmstart/model policy.jet_rl.sft_warmstart.steps=200
         policy.jet_rl.sft_warmstart.stop_at_loss=0.001)
short_ov=(grpo.max_num_steps=30)
learn_ov=("${long_ov[@]/policy.jet_rl.sft_warmstart.stop_at_loss=0.001/policy.jet_rl.sft_warmstart.stop_at_loss=${LEARN_STOP:-0.01}}"
          "grpo.max_num_steps=${LEARN_STEPS:-20}" "policy.megatron_cfg.optimizer.lr=${LEARN_LR:-3e-5}"
          "policy.megatron_cfg.optimizer.min_lr=${LEARN_LR:-3e-5}" policy.jet_rl.stress.gpu=true grpo.val_period=5
          checkpointing.enabled=true checkpointing.save_period=5 checkpointing.keep_top_k=1)
learn_arms=${LEARN_ARMS:-bf16,bf16_train_fp8_rollout,jetrl,offpolicy_int4_tensor,unified_int4_tensor}
# the attention backward in its fixed-order kernel (docs/config.md `deterministic_backward`): without it two runs of
# one step differ in the last bits, so no two warm starts were alike and every round ran BF16 again
common=(logger.tensorboard_enabled=false policy.jet_rl.deterministic_backward=true)
compare() {  # length parallel [flags...]
  local length=$1 parallel=$2
  shift 2
  local -n ov="${length}_ov"
  timeout "${TIME_LIMIT:-0}" python -m jetrl_megatron.cli compare --recipe count_150m_gpu --seeds "${SEEDS:-2}" \
    --parallel "${PARALLEL:-$parallel}" --out "/tmp/jetrl_long/$length" "$@" "${common[@]}" "${ov[@]}" \
    "${extra[@]}" 2>&1 | tail -n 60
}
extra=("$@")
status=0
case $mode in
  warmstart) compare short 1 --warmstart-only || status=$?
             [ "$status" = 0 ] && { compare long 1 --warmstart-only || status=$?; } ;;
  short) compare short 6 --reuse || status=$? ;;
  long) PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} compare long 6 --reuse \
          || status=$? ;;
  learn) [ -d /tmp/jetrl_long/short/warmstart/model ] || compare short 1 --warmstart-only || status=$?
         if [ "$status" != 0 ]; then :
         elif [ "${WARMSTART_ONLY:-0}" = 1 ]; then compare learn 1 --warmstart-only --arms "$learn_arms" || status=$?
         else PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
                compare learn 5 --reuse --arms "$learn_arms" ${LEARN_REUSE_FROM:+--reuse-from "$LEARN_REUSE_FROM"} \
                || status=$?
              if [ -f /tmp/jetrl_long/learn/compare.json ]; then
                python -m jetrl_megatron.rl.tools.dose_response /tmp/jetrl_long/learn 2>&1 | tail -n 30 || true
              else echo "no dose-response table: the comparison did not finish (no compare.json)"; fi
         fi ;;
  *) echo "usage: $0 warmstart|short|long|learn OUT_DIR [overrides...]" >&2; exit 2 ;;
esac
mkdir -p "$out"
for length in short long learn; do
  [ -d "/tmp/jetrl_long/$length" ] || continue
  (cd "/tmp/jetrl_long/$length" && find . -path '*/model*' -prune -o -path '*/checkpoints' -prune -o -type f \
    \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.png' -o -name '*.log' -o -name 'config.yaml' \) \
    -print0 | tar czf "$out/${mode}_$length.tgz" --null -T -)
done
exit "$status"
