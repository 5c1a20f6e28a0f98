#!/bin/bash
# Exactly on-policy on the GPU (docs/precision.md "GPU vLLM's own ops"): the checks and measurements of one H200
# round, each phase one device call. Usage: bash bench/exact_gpu.sh stage0|stage1|check|grpo OUT_DIR [args...]
#   stage0/stage1  copy the vLLM bundle part carried in this call (.vc/p0, .vc/p1) to /tmp/vc (one part per call:
#                  the device takes at most 64 MiB a call)
#   check          install the bundle (+ .vc/p2 and .whl carried here), then: the vllm_cuda GPU tests, the
#                  trainer-vs-engine probe on the tiny model (both arms, per-layer probe where they differ), and the
#                  FP8 GEMM M-invariance per backend at Qwen3 shapes
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
  cp .vc/p2/* /tmp/vc/ && cat /tmp/vc/part0* > /tmp/vllm026.tar && sha256sum -c /tmp/vc/SHA256 && mkdir -p /tmp/w && tar xf /tmp/vllm026.tar -C /tmp/w \
    && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
       /tmp/w/.whl/*.whl .whl/*.whl && touch /tmp/site/.jetrl_ok
}
case $mode in
  stage0) cp .vc/p0/* /tmp/vc/ && ls -l /tmp/vc ;;
  stage1) cp .vc/p1/* /tmp/vc/ && ls -l /tmp/vc ;;
  check)
    install > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
    timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_vllm_cuda_gpu.py -k "not bit_for_bit" \
      > "$out/ops_tests.log" 2>&1; tail -15 "$out/ops_tests.log"
    timeout 240 python3 bench/vllm_cuda_exact.py --preset tiny --arms jetrl bf16 --out "$out/exact_tiny.json" \
      > "$out/exact_tiny.log" 2>&1; tail -60 "$out/exact_tiny.log"
    timeout 120 python3 bench/gemm_m_invariance.py --presets qwen3-8b --backends cublas triton \
      --out "$out/gemm_m_invariance.json" > "$out/gemm_m.log" 2>&1; tail -5 "$out/gemm_m.log" ;;
  *) echo "usage: $0 stage0|stage1|check OUT_DIR" >&2; exit 2 ;;
esac
