#!/bin/bash
# Exactly on-policy on the GPU (docs/precision.md "GPU vLLM's own ops"): the checks and measurements of one H200
# round, each phase one device call. Usage: bash bench/exact_gpu.sh stage0|stage1|check|grpo OUT_DIR [args...]
#   stage0/stage1  copy the vLLM bundle part carried in this call (.vc/p0, .vc/p1) to /tmp/vc (one part per call:
#                  the device takes at most 64 MiB a call; the two-part xz bundle needs stage0 only)
#   check          install the bundle (+ its last part and .whl carried here), then: the vllm_cuda GPU tests, the
#                  trainer-vs-engine probe on the tiny model (both arms, per-layer probe where they differ), and the
#                  FP8 GEMM M-invariance per backend at Qwen3 shapes
#   tests          tests/test_vllm_cuda_gpu.py (ops against FP32 references; trainer == engine bit for bit)
#   grpo           `jetrl run --recipe count_150m_gpu` per arm (ARMS), LEN-token responses (ignore_eos), STEPS steps,
#                  CUDA graphs (the recipe's FULL_DECODE_ONLY, mode 0); metrics.jsonl + summaries as one .tgz
#   probe          bench/vllm_cuda_exact.py at PRESET (qwen3-0.6b), LEN new tokens, CUDA graphs, with a refit
#   suite          `pytest -m gpu tests` in one process (what `make test-gpu` runs)
#   layer          bench/megatron_layer_bench.py, Qwen3-8B layer at 8K tokens: bf16 attention vs vllm_cuda numerics
# Logs and JSON go to OUT_DIR (the run tool's $OUT).
set -uo pipefail
mode=${1:?stage0|stage1|check}
out=${2:?OUT_DIR}
shift 2
mkdir -p /tmp/vc "$out"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} DG_JIT_CACHE_DIR=/tmp/dg_cache
install() {
  [ -f /tmp/site/.jetrl_ok ] && return 0
  cp .vc/p*/* /tmp/vc/ && cat /tmp/vc/part0* > /tmp/vllm026.tar && sha256sum -c /tmp/vc/SHA256 && mkdir -p /tmp/w && tar xf /tmp/vllm026.tar -C /tmp/w \
    && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
       /tmp/w/.whl/*.whl .whl/*.whl && touch /tmp/site/.jetrl_ok
}
case $mode in
  stage0) cp .vc/p0/* /tmp/vc/ && ls -l /tmp/vc ;;
  stage1) cp .vc/p1/* /tmp/vc/ && ls -l /tmp/vc ;;
  check)
    install > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
    timeout -s INT -k 30 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_vllm_cuda_gpu.py -k "not bit_for_bit" \
      > "$out/ops_tests.log" 2>&1; tail -15 "$out/ops_tests.log"
    timeout 240 python3 bench/vllm_cuda_exact.py --preset tiny --arms jetrl bf16 --out "$out/exact_tiny.json" \
      > "$out/exact_tiny.log" 2>&1; tail -60 "$out/exact_tiny.log"
    timeout 120 python3 bench/gemm_m_invariance.py --presets qwen3-8b --backends cublas triton \
      --out "$out/gemm_m_invariance.json" > "$out/gemm_m.log" 2>&1; tail -5 "$out/gemm_m.log" ;;
  grpo)  # the GRPO loop on count_150m_gpu, fixed-length responses (ignore_eos), CUDA graphs, per arm: ARMS, LEN, STEPS
    install > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
    len=${LEN:-1024}
    for arm in ${ARMS:-jetrl bf16}; do
      dir=/tmp/exact_grpo/len${len}_$arm
      timeout "${RUN_LIMIT:-240}" python3 -m jetrl_megatron.cli run --recipe count_150m_gpu --arm "$arm" \
        policy.jet_rl.sft_warmstart.steps=0 grpo.max_num_steps="${STEPS:-3}" data.train.num_terms=$((len / 5)) \
        policy.generation.max_new_tokens="$len" policy.max_total_sequence_length=$((len + 64)) \
        policy.generation.vllm_cfg.max_model_len=$((len + 64)) policy.generation.ignore_eos=true \
        policy.generation.vllm_kwargs.kv_cache_memory_bytes=17179869184 grpo.val_period=0 grpo.val_at_start=false \
        grpo.val_at_end=false logger.tensorboard_enabled=false logger.log_dir="$dir" "$@" > "$out/grpo_len${len}_$arm.log" 2>&1
      echo "== $arm: rc $?"; grep -E "^step|mismatch|Error" "$out/grpo_len${len}_$arm.log" | tail -8
    done
    (cd /tmp/exact_grpo && find . -name '*.json*' -o -name 'config.yaml' -o -name '*.log' | tar czf "$out/grpo_len$len.tgz" -T -) ;;
  probe)  # the trainer-vs-engine probe at a Qwen3 shape: PRESET, LEN, CUDA graphs
    install > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
    timeout "${RUN_LIMIT:-300}" python3 bench/vllm_cuda_exact.py --preset "${PRESET:-qwen3-0.6b}" --arms jetrl bf16 \
      --prompts 32 --prompt-min 32 --prompt-max 96 --new-tokens "${LEN:-1024}" --cuda-graphs --refit --micro-batch 4 \
      --out "$out/exact_${PRESET:-qwen3-0.6b}.json" "$@" > "$out/exact_probe.log" 2>&1
    echo "probe rc $?"; grep -v "INFO\|WARNING\|warn" "$out/exact_probe.log" | tail -70 ;;
  tests)
    install > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
    timeout -s INT -k 30 "${RUN_LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_vllm_cuda_gpu.py "$@" \
      > "$out/vllm_cuda_tests.log" 2>&1; echo "tests rc $?"; tail -15 "$out/vllm_cuda_tests.log" ;;
  suite)  # what `make test-gpu` runs, as one pytest process
    install > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
    timeout -s INT -k 30 "${RUN_LIMIT:-400}" python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests > "$out/test_gpu.log" 2>&1
    echo "suite rc $?"; grep -E "passed|failed|FAILED|SKIPPED|Error" "$out/test_gpu.log" | tail -15 ;;
  layer)  # the Qwen3-8B layer fwd+bwd: today's CUDA numerics (bf16 attention, Triton element-wise) vs vLLM's ops
    install > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
    for impl in bf16 vllm_cuda; do
      timeout "${RUN_LIMIT:-150}" python3 bench/megatron_layer_bench.py --seq 8192 --iters 20 --warmup 5 \
        --backends cublas --lean-swiglu --elementwise triton --attn-impl "$impl" --out "$out/layer_$impl" \
        > "$out/layer_$impl.log" 2>&1; echo "layer $impl rc $?"; grep -iE "ms|ratio|x bf16" "$out/layer_$impl.log" | tail -8
    done ;;
  *) echo "usage: $0 stage0|stage1|check|tests|grpo|probe|suite|layer OUT_DIR" >&2; exit 2 ;;
esac
