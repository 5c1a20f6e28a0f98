#!/usr/bin/env bash
# Build the vLLM 0.26.0 bundle for the H200 test machine (torch 2.11.0+cu130, Python 3.12, offline) and split it
# into three parts under <repo>/.vc/p0 .. p2 (an ignored folder), each under 64 MiB.
# Usage, from the project's root:  bash tools/vllm_gpu_bundle.sh   (then see docs/vllm_gpu.md)
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
P=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp
   --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_27_x86_64
   --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
   --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d whl)
python3 -m pip download -q "${P[@]}" vllm==0.26.0 llguidance==1.7.6 openai-harmony==0.0.8 apache-tvm-ffi==0.1.10 \
  openai==3.57.0 pydantic==2.14.4 pydantic-core==2.50.5 xgrammar==0.2.7 pyzmq==27.3.0 cbor2==6.3.0 blake3==1.0.11 \
  jiter==0.19.0 msgspec==0.23.0 compressed-tensors==0.17.0 fastapi==0.136.3 starlette==1.10.0 httpx2==2.16.2 \
  httpcore2==2.16.2 truststore==0.10.5 sniffio==1.3.1 pybase64==1.5.1 loguru==0.7.3 setproctitle==1.3.8 \
  cachetools==8.0.2 partial-json-parser==0.2.1.1.post7 typing-inspection==0.4.5 annotated-types==0.8.0
# Drop what an H200 dense-model run never loads: the FA2 library (Hopper uses FA3), the Rust server binary,
# and DeepGEMM builds for other Python versions. Halves the vLLM wheel.
zip -q -d whl/vllm-0.26.0-*.whl 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs' \
  'vllm/third_party/deep_gemm/_C.cpython-310-*' 'vllm/third_party/deep_gemm/_C.cpython-311-*' \
  'vllm/third_party/deep_gemm/_C.cpython-313-*' 'vllm/third_party/deep_gemm/_C.cpython-314-*' >/dev/null || true
mv whl .whl && tar cf vllm026.tar .whl
sha=$(sha256sum vllm026.tar | cut -d' ' -f1)
split -b 56M -d -a 2 vllm026.tar part
grep -qx '/.vc/' "$repo/.git/info/exclude" 2>/dev/null || echo '/.vc/' >> "$repo/.git/info/exclude"
rm -rf "$repo/.vc"
for i in 0 1 2; do mkdir -p "$repo/.vc/p$i"; mv "part0$i" "$repo/.vc/p$i/"; done
echo "$sha  /tmp/vllm026.tar" > "$repo/.vc/p2/SHA256"
ls -l "$repo"/.vc/p*/
echo "bundle sha256 $sha — install steps: docs/vllm_gpu.md"
