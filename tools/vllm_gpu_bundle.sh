#!/usr/bin/env bash
# Build a vLLM bundle for the H200 test machine (torch 2.11.0+cu130, triton 3.6, Python 3.12, offline): an
# xz-compressed tar of the slimmed wheels, split into 44 MiB parts under <repo>/<outdir>/p0, p1, ... (an ignored
# folder): that machine takes at most 64 MiB per transfer, and each part travels with the working tree (15 MiB on
# 2026-12-07); .whl (4 MiB) rides with the smaller last part.
# Usage, from the project's root:  bash tools/vllm_gpu_bundle.sh [VERSION] [OUTDIR]   (then see docs/vllm_gpu.md)
#   VERSION  vLLM release: 0.26.0 (default; what our GPU numbers were measured on) or 0.20.0 (NeMo-RL v0.7.0's)
#   OUTDIR   relative to the repository root; default .vc for 0.26, .vc<minor> otherwise (0.20.0 -> .vc20)
set -euo pipefail
ver=${1:-0.26.0}
minor=$(cut -d. -f2 <<<"$ver")
out=${2:-$([ "$ver" = 0.26.0 ] && echo .vc || echo ".vc$minor")}
tag=$(awk -F. '{printf "%d%02d", $1, $2}' <<<"$ver")   # 0.26.0 -> 026
case "$out" in .|..|/*|*..*) echo "OUTDIR must be a folder inside the repository, not '$out'" >&2; exit 2 ;; esac
# What vLLM needs beyond the GPU image's packages (torch, triton, numpy, transformers, ... are there). flashinfer,
# tilelang and the CUTLASS DSL are left out on purpose: the runs use FA3/DeepGEMM and VLLM_USE_FLASHINFER_SAMPLER=0.
case "$ver" in
  0.26.0)
    extra=(llguidance==1.7.6 openai-harmony==0.0.8 apache-tvm-ffi==0.1.10 openai==3.57.0 pydantic==2.14.4
           pydantic-core==2.50.5 xgrammar==0.2.7 pyzmq==27.3.0 cbor2==6.3.0 blake3==1.0.11 jiter==0.19.0
           msgspec==0.23.0 compressed-tensors==0.17.0 fastapi==0.136.3 starlette==1.10.0 httpx2==2.16.2
           httpcore2==2.16.2 truststore==0.10.5 sniffio==1.3.1 pybase64==1.5.1 loguru==0.7.3 setproctitle==1.3.8
           cachetools==8.0.2 partial-json-parser==0.2.1.1.post7 typing-inspection==0.4.5 annotated-types==0.8.0) ;;
  0.20.0)
    # The 0.26 set where 0.20's pins admit it; 0.20 pins llguidance<1.4, apache-tvm-ffi==0.1.9 and
    # compressed-tensors==0.15.0.1, xgrammar 0.2 needs apache-tvm-ffi>=0.1.10 (0.1.33 is NeMo-RL v0.7.0's), and
    # 0.20 imports gguf at start-up and pins diskcache.
    extra=(llguidance==1.3.0 openai-harmony==0.0.8 apache-tvm-ffi==0.1.9 openai==3.57.0 pydantic==2.14.4
           pydantic-core==2.50.5 xgrammar==0.1.33 pyzmq==27.3.0 cbor2==6.3.0 blake3==1.0.11 jiter==0.19.0
           msgspec==0.23.0 compressed-tensors==0.15.0.1 fastapi==0.136.3 starlette==1.10.0 httpx2==2.16.2
           httpcore2==2.16.2 truststore==0.10.5 sniffio==1.3.1 pybase64==1.5.1 loguru==0.7.3 setproctitle==1.3.8
           cachetools==8.0.2 partial-json-parser==0.2.1.1.post7 typing-inspection==0.4.5 annotated-types==0.8.0
           gguf==0.19.0 diskcache==5.6.3) ;;
  *) echo "no wheel list for vLLM $ver in $0: add one (see docs/vllm_gpu.md)" >&2; exit 2 ;;
esac
repo=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
P=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp
   --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
   --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
   --platform manylinux_2_5_x86_64 -d whl)
python3 -m pip download -q "${P[@]}" "vllm==$ver" "${extra[@]}"
# Drop what an H200 dense-model run never loads: the FA2 library (Hopper uses FA3), the Rust server binary,
# DeepGEMM builds for other Python versions, and (MOE=1 keeps it) the MoE kernel library, which vLLM imports only
# inside contextlib.suppress(ImportError) and calls only from MoE layers (Qwen3 / Llama dense models have none).
# Without it the 0.26 bundle is three parts instead of four: the last rides with the first call that uses vLLM.
moe=()
[ "${MOE:-0}" = 1 ] || moe=('vllm/_moe_C_stable_libtorch.abi3.so' 'vllm/_moe_C.abi3.so')
zip -q -d whl/vllm-"$ver"-*.whl 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs' \
  'vllm/third_party/deep_gemm/_C.cpython-310-*' 'vllm/third_party/deep_gemm/_C.cpython-311-*' \
  'vllm/third_party/deep_gemm/_C.cpython-313-*' 'vllm/third_party/deep_gemm/_C.cpython-314-*' "${moe[@]}" \
  >/dev/null 2>&1 || true
# Store every wheel uncompressed (pip installs such a zip like any other; RECORD hashes the files, not the archive)
# and compress the whole bundle with xz instead: vLLM's FA3 library is 36.6 MiB deflated and 7.5 MiB with xz. The
# file keeps its name: GNU tar detects the xz stream when it extracts (`tar xf`), so the install steps are unchanged.
python3 - whl/*.whl <<'PY'
import os, sys, zipfile
for path in sys.argv[1:]:
    tmp = path + ".stored"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            data = src.read(item)  # before the entry is re-described as stored
            item.compress_type = zipfile.ZIP_STORED
            dst.writestr(item, data)
    os.replace(tmp, path)
PY
mv whl .whl && tar cf - .whl | xz -9 -T"$(nproc)" > "vllm$tag.tar"
sha=$(sha256sum "vllm$tag.tar" | cut -d' ' -f1)
split -b 44M -d -a 2 "vllm$tag.tar" part
grep -qx "/$out/" "$repo/.git/info/exclude" 2>/dev/null || echo "/$out/" >> "$repo/.git/info/exclude"
rm -rf "${repo:?}/$out"
n=0
for f in part*; do mkdir -p "$repo/$out/p$n"; mv "$f" "$repo/$out/p$n/"; last="$repo/$out/p$n"; n=$((n + 1)); done
echo "$sha  /tmp/vllm$tag.tar" > "$last/SHA256"
ls -l "$repo/$out"/p*/
echo "vLLM $ver bundle: $n parts, sha256 $sha — install steps: docs/vllm_gpu.md"
