#!/usr/bin/env bash
# The wheels the H200 test machine's image lacks besides vLLM (cp312, x86_64), into <repo>/.whl (git-ignored):
# megatron-core and the test helpers, and the config loader (omegaconf, hydra-core; antlr4 has no wheel on PyPI, so
# it is built here). Carried with the first bundle part and installed by bench/qwen3_8b_gpu.sh stage0
# (docs/vllm_gpu.md). Usage, from the project's root: bash tools/gpu_wheels.sh
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
cd "$repo"
rm -rf .whl
python3 -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1 hypothesis==6.170.17 attrs==26.1.0 \
  sortedcontainers==2.4.0 hydra-core==1.3.2
python3 -m pip wheel -q --no-deps -w .whl omegaconf==2.3.0 antlr4-python3-runtime==4.9.3
ls -l .whl
