#!/bin/bash
# The long-response learning experiment on one GPU (docs/rl.md): every arm x 2 seeds from one BF16 warm start,
# six runs sharing the GPU. Usage: bash bench/long_response_gpu.sh short|long OUT_DIR
# short: ~256-token responses (51 terms), 30 GRPO steps; long: ~2K-token responses (409 terms), 15 GRPO steps,
# warm-started from the short experiment's warm start plus 100 supervised steps at that length.
# Everything the runs write stays in /tmp/jetrl_long/<length>; OUT_DIR gets the metrics, summaries, logs and plots
# (not the model directories).
set -euo pipefail
length=${1:?short|long}
out=${2:?OUT_DIR}
shift 2
case $length in
  short) ov=(); parallel=6 ;;
  # long: the warm start continues from the short experiment's (run it first, same machine) for 100 steps at 2K
  long) ov=(data.train.num_terms=409 policy.generation.max_new_tokens=2068 policy.max_total_sequence_length=2112
            policy.generation.vllm_cfg.max_model_len=2112 policy.generation.vllm_kwargs.kv_cache_memory_bytes=12884901888
            grpo.max_num_steps=15 grpo.max_val_samples=32
            policy.model_name=/tmp/jetrl_long/short/warmstart/model policy.jet_rl.sft_warmstart.steps=100)
        parallel=2 ;;  # one run peaks near 49 GiB at 2K tokens: four at once ran out of the H200's 140 GiB
  *) echo "usage: $0 short|long OUT_DIR" >&2; exit 2 ;;
esac
work=/tmp/jetrl_long/$length
# TIME_LIMIT (seconds) stops the harness so the outputs written so far are still copied out
timeout "${TIME_LIMIT:-0}" python -m jetrl_megatron.cli compare --recipe count_150m_gpu --seeds "${SEEDS:-2}" --parallel "${PARALLEL:-$parallel}" \
  --out "$work" "${ov[@]}" "$@" 2>&1 | tail -n 60 || status=$?
mkdir -p "$out"
(cd "$work" && find . -path '*/model*' -prune -o -path '*/checkpoints' -prune -o -type f \
  \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.png' -o -name '*.log' -o -name 'config.yaml' \) \
  -print0 | tar czf "$out/$length.tgz" --null -T -)
exit "${status:-0}"
