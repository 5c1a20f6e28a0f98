#!/bin/bash
# Qwen3-8B GRPO on one H200 through the recipe path (issue 27) and the checks that go with it (issue 26: DeepGEMM
# FProp M-invariance, the exact forward's layer cost). One device call per phase; logs and JSON to OUT_DIR.
# Usage: bash bench/qwen3_8b_gpu.sh stage0|stage1|stage2|suite|vtests|check|grpo|arms|optcost|decode|probe|graphprobe|rollcost|exact150m|waves|fuse|quantk|hostgap|hostops|threads|threadloop|variants|te|long|round OUT_DIR
#   stage0  copy the bundle parts carried in this call (.vc/p*) to /tmp/vc, install .whl (megatron-core, omegaconf,
#           ... for Python 3.12), run the GPU tests that need no vLLM (kernels, backends without DeepGEMM, Triton
#           numerics, the INT stress kernels, phase memory; STAGE0_TESTS="file ..." others instead; TESTS=0 none)
#   stage1, stage2  copy the carried parts only (one 44 MiB part per call: a call takes at most 64 MiB with the tree)
#   a call takes at most 64 MiB: the tree (15 MiB on 2026-12-07) + one 44 MiB part leaves ~5 MiB, so .whl (4 MiB)
#   rides with the smaller last part: call 1 carries .vc/p1 and .whl (stage0), later calls .vc/p0; every mode
#   copies the parts it was carried and installs the bundle once per machine, when all parts and SHA256 are there
#   suite   install the vLLM 0.26 bundle; `make test-gpu ENV=system` (the whole GPU suite, one command, in this
#           machine's Python: it has no internet for the venv); SUITE_FROM / SUITE_TO: a part of it (see the mode)
#   check   install the vLLM 0.26 bundle; FP8 FProp M-invariance per backend at the Qwen3-8B shapes
#           (DeepGEMM included); the backend GPU tests again with DeepGEMM; the Qwen3-8B layer fwd+bwd, bf16
#           attention vs vLLM's own ops (issue 26's cost), cuBLAS GEMMs in both
#   grpo    `jetrl run --recipe qwen3_8b_1gpu --arm $ARM` (random weights made on the spot), LEN new tokens by
#           ignore_eos, STEPS steps; the run directory (metrics.jsonl, summary.json, config.yaml, log) as one .tgz;
#           PACK_DG=1 (any mode) then packs DeepGEMM's JIT cache (for the next round: carry it back as .dgc/dg_cache.tgz);
#           FA_SPLITS=N sets vLLM's FA3 KV-split cap for CUDA-graph decode (attention_config; exact engines' default 1, vLLM's 32);
#           PROFILE=N profiles step N (profile_stepN.md in the run directory); EXTRA="key=value ..." appends overrides; LAYER=1 then runs check's layer cost benchmark;
#           CARD=h100: the overrides that fit 8B on an 80 GB card (optimizer offload 0.8, level-2 sleep, micro-batches
#           2 / 4, KV_GIB (default 12) of KV cache: the rollout in waves), checked by the plan against 79 GiB; above
#           LEN 1024 micro-batches 1 / 2 and policy.logprob_chunk_size 256 (1K with micro-batches of 4 / 8 and chunks
#           planned at 74.3 GiB but its engine could not wake after step 1 on 2026-12-05, as the 4K runs of
#           2026-12-05/06: the optimizer's device FP32 grads and the last packed layout pinned torch's cache, freed
#           since (plan 70.2 GiB); with them the 4K run woke after every update on an H100, 2026-12-06)
#           PREWARM=1 first runs `jetrl prewarm` with the same overrides (DeepGEMM's kernels for every GEMM the run meets,
#           compiled in parallel processes; PREWARM_LIMIT seconds, default 240), its log prewarm_1.log in the run directory;
#           PREWARM=only: prewarm twice (cold, then warm) and no run; PREWARM=once: once, no run. The DeepGEMM cache's file count is logged before
#           and after the run (a run that compiled nothing leaves it unchanged)
#           CALL_LIMIT=seconds: the run's limit is what is left of them since the script began, less CALL_RESERVE
#           (default 25 s, for packing): a call whose install and prewarm take what they take still ends in time
#           TAG=name suffixes the run directory (len<LEN>_<ARM>_<TAG>); RUN_IN_OUT=1 writes the run directory under
#           OUT_DIR itself (a call cut by the device budget still returns its log and the steps it finished)
#   arms    ARMS="jetrl bf16 ..." the grpo mode once per arm (RUN_IN_OUT; RUN_LIMIT shared, or LIMIT_ARM each) in one call, then a
#           side-by-side table of their last steps (bench/step_table.py: phase seconds, k3, the update's cudaFree calls
#           and peak, and with PROFILE the device's busy share of the profiled logprob / update stretches)
#   optcost the optimizer CPU offload's copies (issue 27 item 4), side by side in one call: grpo with CARD=h100 and the
#           same ARM / LEN / STEPS / EXTRA three times, the host FP32 masters pageable (pin_cpu_params=false, the
#           before), page-locked (the default), and page-locked with overlap_cpu_optimizer_d2h_h2d=true; then a table
#           of each run's last step (update, optimizer step, step) from its metrics; LIMIT_OPT=seconds per run;
#           OPT_VARIANTS="pageable pinned" runs those alone (a call holds at most 600 s)
#   decode  bench/decode_invariance.py at the Qwen3-8B shape: which of vLLM's ops give a token other bytes in a decode
#           step than in a prefill (norms, SiLU-and-mul, FP8 linears per backend, BF16 lm_head, FA3 decode vs prefill),
#           and the project's SwiGLU against vLLM's silu_and_mul on every BF16 gate value
#   graphprobe  bench/graph_layout_probe.py (install first): does vLLM's FA3 (and the flash backward) give the real tokens
#           the packed call's bytes when every padded row is attended whole (a layout fixed by (b, sq), no host sync:
#           what CUDA graphs of the update's layers need); bit-identity per case and both paths' ms (~1 min)
#   probe   bench/vllm_cuda_exact.py at the Qwen3-8B shape (ARMS, default jetrl; auto GEMMs, CUDA graphs, a refit), PROMPTS x LEN,
#           with FA_SPLITS as above: trainer vs vLLM's decode and prefill, and vLLM's decode vs its own prefill
#   rollcost  bench/rollout_bench.py compare at PRESET (default qwen3-8b), 128 x 1024 tokens: stock FP8, the plugin and BF16, each with
#           the batch-invariant norms and with vLLM's own (ARMS to choose), every arm in a fresh process
#   exact150m  count_150m_gpu from random init, the three arms side by side at LENS (default 256 1024 4096) new tokens
#           by ignore_eos, 2 GRPO steps each, KV_GIB (default 8) of KV cache per run: issue 26's mismatch-by-position rows at the small shape
#   fuse    the SwiGLU fusions (Fp8ModelContext.fuse_swiglu_grad_quant: backward + fc1 dY FP8 quantization;
#           swiglu_fp8_forms: forward + fc2 input; `decode` compares that kernel with vLLM's silu_and_mul): their tests,
#           bench/kernels_bench.py's swiglu section, the Qwen3-8B layer fwd+bwd with each fusion off and on
#           (GRAPH=1: also each arm with the layer captured as CUDA graphs, issue 29 item 3)
#   hostgap the Qwen3-8B layer fwd+bwd at SEQ (default 2048: the 8B update's micro-batch of 2 x ~1.1K tokens), eager and
#           captured as CUDA graphs, jetrl and bf16, with cProfile of one fwd+bwd's host side (issue 29 item 3)
#   threadloop the variants mode over THREADS (default "calling device calling device"): policy.jet_rl.backward_thread
#           set so in each run, then the step table (the update with the backward on each thread)
#   variants ARM's grpo run once per VARIANTS entry "tag:key=value[,key=value...]" (default: the update's attention
#           packed / whole_rows / packed), then the step table (with STEPS >= 3 each run's median and range)
#   threads hostops at TOKENS (default 2048), then the layer bench at SEQ (default 2048) with autograd's backward on
#           its CUDA device thread and on the calling thread (--backward-on-calling-thread), GRAPH="" skips graphs
#   hostops bench/host_overhead.py at TOKENS (default "2048 4128"): host vs device us per call of each FP8 linear
#           piece (quantizers, GEMMs through the dispatch and direct, the autograd linear vs BF16), issue 29 item 3
#   waves   bench/rollout_waves.py at PRESET (default qwen3-0.6b), 128 x LEN tokens, per KV_GIB budget: the rollout in
#           waves that fit the cache (no preemption) against one submission (vLLM preempts), seconds and samples
#   te      issue 29 item 5, like for like with TransformerEngine's blockwise-FP8 guide: the layer at hidden 4096,
#           FFN 16384, 15,872 tokens, and the Qwen3-8B layer at 16,384 tokens, each with --profile: the GEMM +
#           quantization ratio next to TE's 1.40x (needs the bundle for DeepGEMM)
#   long    issue 31's GPU learning rounds: install, then bench/long_response_gpu.sh LONG_MODE (default learn) OUT_DIR
#   round   ROUND="mode ..." runs those modes one after another in this call (each into OUT_DIR/<mode>);
#           LIMIT_<mode>=seconds gives that mode its own RUN_LIMIT
# pytest runs under `timeout -s INT`: at its limit pytest is interrupted, not killed, and still prints which tests
# failed and why (a killed run's log ended mid-test on 2026-12-05 with one failure and no message)
set -uo pipefail
mode=${1:?stage0|stage1|stage2|suite|vtests|check|grpo|arms|optcost|decode|probe|graphprobe|rollcost|exact150m|waves|fuse|quantk|hostgap|hostops|threads|threadloop|variants|te|long|round}
out=${2:?OUT_DIR}
mkdir -p /tmp/vc "$out"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} DG_JIT_CACHE_DIR=/tmp/dg_cache \
  TRITON_CACHE_DIR=/tmp/triton_cache PYTHONUNBUFFERED=1
# JIT caches carried from an earlier session (PACK_DG=1 below writes them): DeepGEMM's and Triton's
# (an archive that does not unpack whole is dropped: its kernels compile again, none is loaded half-written)
[ -f .dgc/dg_cache.tgz ] && [ ! -d /tmp/dg_cache ] && mkdir -p /tmp/dg_cache \
  && { tar xzf .dgc/dg_cache.tgz -C /tmp || { echo "dg_cache.tgz did not unpack: cold JIT" >&2; rm -rf /tmp/dg_cache; }; }
[ -f .dgc/triton_cache.tar.xz ] && [ ! -d /tmp/triton_cache ] \
  && { tar xf .dgc/triton_cache.tar.xz -C /tmp || { echo "triton_cache.tar.xz did not unpack: cold JIT" >&2;
       rm -rf /tmp/triton_cache; }; }
wheels() {
  [ -f /tmp/site/.whl_ok ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.whl_ok
}
stage_parts() {  # the bundle parts this call carried (any of .vc/p0, p1, ...) into /tmp/vc, kept between calls
  for part in .vc/p*/; do [ -d "$part" ] && cp "$part"* /tmp/vc/; done
  ls -l /tmp/vc
}
vllm_bundle() {
  [ -f /tmp/site/.vllm_ok ] && return 0
  stage_parts >/dev/null && cat /tmp/vc/part0* > /tmp/vllm026.tar && sha256sum -c /tmp/vc/SHA256 && mkdir -p /tmp/w \
    && tar xf /tmp/vllm026.tar -C /tmp/w && rm -f /tmp/vllm026.tar /tmp/vc/part0* \
    && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
       /tmp/w/.whl/*.whl && rm -rf /tmp/w && touch /tmp/site/.vllm_ok
}
layer_cost() {  # the Qwen3-8B layer's fwd+bwd at 8K tokens: bf16 attention vs vLLM's ops with the batch-invariant
  # norms (the default) and with vLLM's own norms (issue 26's cost)
  for variant in bf16 vllm_cuda:batch_invariant vllm_cuda:vllm; do
    impl=${variant%%:*} norms=${variant#*:}; [ "$norms" = "$variant" ] && norms=batch_invariant
    tag=${variant/:/_}
    timeout 120 python3 bench/megatron_layer_bench.py --seq 8192 --iters 20 --warmup 5 --backends cublas \
      --lean-swiglu --elementwise triton --attn-impl "$impl" --cuda-norms "$norms" --out "$out/layer_$tag" \
      > "$out/layer_$tag.log" 2>&1
    echo "layer $tag rc $?"; grep -iE " ms|ratio|x bf16" "$out/layer_$tag.log" | tail -6
  done
}
case $mode in
  stage0)
    stage_parts
    wheels > "$out/wheels.log" 2>&1 || { tail -20 "$out/wheels.log"; exit 1; }
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; free -g; df -h /tmp "$PWD";
      python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } | tee "$out/machine.txt"
    [ "${TESTS:-1}" = 0 ] && exit 0
    # STAGE0_TESTS: other test files instead (a call that also has to carry the bundle runs only what it must)
    tests=(${STAGE0_TESTS:-tests/test_fp8_kernels_gpu.py tests/test_fp8_backends_gpu.py \
      tests/test_megatron_triton_numerics.py tests/test_fp8_stress_kernels.py tests/test_rl_phase_memory.py})
    timeout -s INT -k 30 "${RUN_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu -rs "${tests[@]}" \
      > "$out/tests_novllm.log" 2>&1
    echo "tests rc $?"; grep -E "passed|failed|FAILED|SKIPPED|Error" "$out/tests_novllm.log" | tail -15 ;;
  stage1|stage2) stage_parts ;;
  suite)
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    python3 -c "import vllm, megatron.core; print('vllm', vllm.__version__, 'megatron-core', megatron.core.__version__)"
    start=$(date +%s)
    # one line per test (-vv against the Makefile's -q) with its seconds since the start: a run cut by the limit
    # still says where its time went (with -v alone, 2026-12-05, the log had one line per file)
    # SUITE_FROM / SUITE_TO (file-name prefixes, e.g. tests/test_megatron): only the test files from / before them,
    # alphabetically -- on a cold H100 the whole suite needs more than one call's 600 s (2026-12-07: collection 47 s,
    # tests/test_fp8_backends_gpu.py 261 s with DeepGEMM's JIT cold, 85 tests in 540 s). Three calls:
    # SUITE_TO=tests/test_megatron; SUITE_FROM=tests/test_megatron SUITE_TO=tests/test_rollout; SUITE_FROM=tests/test_rollout
    gpu_tests=tests
    if [ -n "${SUITE_FROM:-}${SUITE_TO:-}" ]; then
      gpu_tests=$(ls tests/test_*.py | awk -v lo="${SUITE_FROM:-}" -v hi="${SUITE_TO:-}" \
        '$0 >= lo && (hi == "" || $0 < hi)' | tr '\n' ' ')
      [ -n "$gpu_tests" ] || { echo "no test file between '${SUITE_FROM:-}' and '${SUITE_TO:-}'" >&2; exit 2; }
    fi
    PYTEST_ADDOPTS=-vv timeout "${RUN_LIMIT:-540}" make test-gpu ENV=system GPU_TESTS="$gpu_tests" 2>&1 \
      | while IFS= read -r line; do printf '%4d %s\n' $(( $(date +%s) - start )) "$line"; done > "$out/test_gpu.log"
    echo "make test-gpu rc ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s"
    grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$out/test_gpu.log" | tail -25 ;;
  check)
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    timeout 200 python3 bench/gemm_m_invariance.py --presets qwen3-8b --backends deep_gemm cublas \
      --out "$out/gemm_m_invariance.json" > "$out/gemm_m.log" 2>&1; echo "m-invariance rc $?"; tail -4 "$out/gemm_m.log"
    timeout -s INT -k 30 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_fp8_backends_gpu.py > "$out/backends.log" 2>&1
    echo "backends rc $?"; grep -E "passed|failed|FAILED|SKIPPED|Error" "$out/backends.log" | tail -8
    layer_cost ;;
  grpo)
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    arm=${ARM:?ARM} len=${LEN:-1024} steps=${STEPS:-3}
    # the run directory (logs, the profile; the engine starts from config.json alone): on disk, not in a tmpfs
    base=/tmp; [ "$(stat -f -c %T /tmp)" = tmpfs ] && base=$PWD/..
    [ "${RUN_IN_OUT:-0}" = 1 ] && base=$out  # a call the budget may cut: what the run wrote so far still comes back
    name=len${len}_$arm${TAG:+_$TAG}; dir=$base/r8b/$name; rm -rf "$dir"; mkdir -p "$dir"
    kv=$(( 20 * 1073741824 ))
    card=()
    if [ "${CARD:-h200}" = h100 ]; then  # 8B on an 80 GB card (jetrl plan: rollout 60.8 GiB, update 70.2 at the
      # optimizer step, host 109.8 (before 2026-12-06: 66.9 / 74.3, the device FP32 grads kept); torch reports 79.2 GiB, ~2.1 GiB of which the CUDA context and vLLM's graph pool hold;
      # measured at step 2 with 64 responses: rollout 72.0, update 78.0, 2026-12-05 bench/qwen3_8b_1gpu/20261205e_h100)
      kv=$(( ${KV_GIB:-12} * 1073741824 ))  # 82 of the 128 sequences at once: the rollout runs in two waves
      card=(policy.jet_rl.plan_gpu_mem_gib=79 policy.jet_rl.engine_sleep_level=2 policy.train_micro_batch_size=2
            policy.logprob_batch_size=4)
      # longer responses: one sequence per micro-batch and its logits turned into logprobs 256 positions at a time
      # (plan: 70.2 GiB at 4K, as at 1K above; 9.3 GiB of logits without the chunks)
      (( len > 1024 )) && card+=(policy.train_micro_batch_size=1 policy.logprob_batch_size=2 policy.logprob_chunk_size=256)
      FRACTION=${FRACTION:-0.8}
    elif (( len > 1024 )); then  # the H200 (the recipe's 128 responses, micro-batches 4 / 8; 20 GiB of KV is one
      # wave at 1K) above 1K: KV_GIB (default 40: 4K-token sequences in two waves of ~64; 72.6 GiB would hold all 128,
      # plan 128.4 of 139.8 GiB, too close for the plan's measured +4-9%), the logits 256 positions at a time (the
      # update's alone are 37.4 GiB without) and optimizer offload 0.6 (0.75 leaves the bf16 arm's host, which keeps
      # its engine's BF16 weights while asleep, 6.8 GiB short of the plan's margin). jetrl plan at 4K: rollout 107.1
      # GiB of 139.8, host 91.2 (bf16 97.6) of 125
      kv=$(( ${KV_GIB:-40} * 1073741824 ))
      card=(policy.logprob_chunk_size=256)
      FRACTION=${FRACTION:-0.6}
    fi
    run_args=(--recipe qwen3_8b_1gpu --arm "$arm" \
      grpo.max_num_steps="$steps" policy.generation.ignore_eos=true policy.generation.max_new_tokens="$len" \
      policy.max_total_sequence_length=$((len + 32)) policy.generation.vllm_cfg.max_model_len=$((len + 32)) \
      policy.generation.vllm_kwargs.kv_cache_memory_bytes=$kv logger.tensorboard_enabled=false \
      policy.megatron_cfg.optimizer.optimizer_offload_fraction="${FRACTION:-0.75}" logger.log_dir="$dir" \
      ${FA_SPLITS:++policy.generation.vllm_kwargs.attention_config.flash_attn_max_num_splits_for_cuda_graph=$FA_SPLITS} \
      ${PROFILE:+policy.jet_rl.profile_step=$PROFILE} "${card[@]}" ${EXTRA:-})
    dg_files() { find /tmp/dg_cache -type f 2>/dev/null | wc -l; }
    if [ "${PREWARM:-0}" != 0 ]; then  # the run's FP8 GEMM kernels compiled first, one process per GEMM (jetrl prewarm)
      # PREWARM=only: prewarm twice (the second pass times a warm cache) and no run; PREWARM=once: once and no run
      # (the run then gets a call of its own, the cache kept in /tmp on the warm machine)
      for pass in $([ "$PREWARM" = only ] && echo 1 2 || echo 1); do
        t0=$SECONDS; before=$(dg_files)
        timeout "${PREWARM_LIMIT:-240}" python3 -m jetrl_megatron.cli prewarm "${run_args[@]}" > "$dir/prewarm_$pass.log" 2>&1
        echo "== prewarm pass $pass rc $? in $((SECONDS - t0)) s; DeepGEMM cache files $before -> $(dg_files)"
        grep -E "^# prewarm|FAILED|^  .* s, " "$dir/prewarm_$pass.log" | tail -12
      done
      case $PREWARM in only|once) exit 0 ;; esac
    fi
    echo "== DeepGEMM cache files before the run: $(dg_files)"
    limit=${RUN_LIMIT:-520}  # CALL_LIMIT: the run gets what is left of that many seconds since this script began
    [ -n "${CALL_LIMIT:-}" ] && limit=$(( CALL_LIMIT - SECONDS - ${CALL_RESERVE:-25} ))
    echo "== run $name: limit $limit s"
    timeout "$limit" python3 -m jetrl_megatron.cli run "${run_args[@]}" > "$dir/run.log" 2>&1 &
    pid=$!
    while kill -0 $pid 2>/dev/null; do  # host and GPU memory every 5 s (the run's own metrics hold the per-phase peaks)
      echo "$(date +%T) $(free -m | awk '/Mem:/ {print "host_used_mib", $3}') $(nvidia-smi --query-gpu=memory.used \
        --format=csv,noheader,nounits | head -1) gpu_used_mib" >> "$dir/memory_trace.txt"; sleep 5
    done
    wait $pid; echo "== run $name: rc $?; DeepGEMM cache files after it: $(dg_files)"
    grep -E "^step|rollout engine|Error|error:|Killed|CUDA out" "$dir/run.log" | tail -12
    # the run directory as one archive (under OUT already with RUN_IN_OUT=1: no second copy)
    [ "${RUN_IN_OUT:-0}" = 1 ] || (cd "$dir/.." && tar czf "$out/grpo8b_$name.tgz" --exclude='model_init_engine*' "$name")
    [ "${LAYER:-0}" = 1 ] && layer_cost ;;
  arms)  # ARMS="jetrl bf16 ..." one grpo run per arm with the same CARD / LEN / STEPS / PROFILE / EXTRA, one after
    # another in this call, then bench/step_table.py's side-by-side table of their last steps; RUN_LIMIT (default 560)
    # is the whole call's, shared evenly unless LIMIT_ARM gives each arm its seconds
    arms=(${ARMS:?ARMS=\"arm arm ...\"})
    per_arm=${LIMIT_ARM:-$(( ${RUN_LIMIT:-560} / ${#arms[@]} ))}
    for a in "${arms[@]}"; do
      ARM=$a RUN_IN_OUT=1 PACK_DG=0 NO_PACK=1 RUN_LIMIT=$per_arm bash "$0" grpo "$out"
    done
    python3 bench/step_table.py "$out"/r8b/* | tee "$out/step_table.md" ;;
  threadloop)  # where autograd runs the update's backward, in the loop: the variants mode over THREADS (default
    # "calling device calling device": alternating, so that drift between runs shows), policy.jet_rl.backward_thread
    # set so in each run. STEPS >= 3: the table's "fwd+bwd steps 2+" column then gives each run's median and range
    # (one step per run did not settle 2026-12-07's pair)
    v=""; for t in ${THREADS:-calling device calling device}; do v+=" $t:policy.jet_rl.backward_thread=$t"; done
    VARIANTS="$v" bash "$0" variants "$out" ;;
  variants)  # an A/B in the loop: ARM's grpo run (default jetrl; LEN / STEPS / CARD / EXTRA as in grpo, RUN_LIMIT
    # each) once per VARIANTS entry "tag:key=value[,key=value...]" (default the update's attention, packed /
    # whole_rows / packed), those overrides appended to EXTRA; then bench/step_table.py over the runs
    i=0
    for v in ${VARIANTS:-packed:policy.jet_rl.update_attention=packed whole:policy.jet_rl.update_attention=whole_rows \
        packed:policy.jet_rl.update_attention=packed}; do
      i=$((i + 1)); overrides=${v#*:}
      ARM=${ARM:-jetrl} TAG=${v%%:*}_$i RUN_IN_OUT=1 PACK_DG=0 NO_PACK=1 RUN_LIMIT=${RUN_LIMIT:-200} \
        EXTRA="${EXTRA:-} ${overrides//,/ }" bash "$0" grpo "$out"
    done
    python3 bench/step_table.py "$out"/r8b/* | tee "$out/step_table.md" ;;
  optcost)  # the host masters pageable / page-locked / page-locked + overlapped copies, one run each, side by side
    opt=policy.megatron_cfg.optimizer
    for v in "pageable:$opt.pin_cpu_params=false" "pinned:" "overlap:$opt.overlap_cpu_optimizer_d2h_h2d=true"; do
      [[ " ${OPT_VARIANTS:-pageable pinned overlap} " == *" ${v%%:*} "* ]] || continue
      CARD=h100 TAG=${v%%:*} RUN_LIMIT=${LIMIT_OPT:-170} EXTRA="${EXTRA:-} ${v#*:}" bash "$0" grpo "$out"
    done
    python3 - "$out" <<'PY'
import io, json, sys, tarfile
from pathlib import Path
print("| run | step | update s | optimizer s | step s | k3 |")
print("|---|---|---|---|---|---|")
for tgz in sorted(Path(sys.argv[1]).glob("grpo8b_*.tgz")):
    with tarfile.open(tgz) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("metrics.jsonl")), None)
        rows = [json.loads(x) for x in io.TextIOWrapper(tar.extractfile(member))] if member else []
    last = rows[-1] if rows else {}
    print(f"| {tgz.stem[len('grpo8b_'):]} | {last.get('step', '-')} | {last.get('time/update', float('nan')):.2f} | "
          f"{last.get('time/optimizer', float('nan')):.2f} | {last.get('time/step', float('nan')):.2f} | "
          f"{last.get('mismatch/k3_kl', float('nan')):.2e} |")
PY
    ;;
  vtests)  # issue 26's GPU tests alone: vLLM's own CUDA ops, trainer == engine decode/prefill, the decode-matched trainer,
    # the batch-invariant norms (one launch, FP8 forms), the engine's sleep / wake / refit, the loop's phase memory
    # (cache release order, cache breakdown), the in-place refit (an engine started without weights); VTESTS=-k-expression
    # narrows; VTEST_FILES="tests/a.py ..." runs those files instead
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    # shellcheck disable=SC2086  # the file list splits on spaces
    timeout -s INT -k 30 "${RUN_LIMIT:-300}" python3 -m pytest -v -s -p no:cacheprovider -m gpu -rs --durations=10 \
      ${VTESTS:+-k "$VTESTS"} ${VTEST_FILES:-tests/test_rollout_invariant_norm.py tests/test_vllm_cuda_gpu.py \
      tests/test_rollout_gpu.py tests/test_rl_phase_memory.py tests/test_rollout_refit_inplace.py \
      tests/test_rollout_kv_waves.py} > "$out/vllm_cuda_tests.log" 2>&1
    echo "vllm_cuda tests rc $?"; grep -E "PASSED|FAILED|SKIPPED|ERROR|bit-identical|decoded in|passed|failed|Error" \
      "$out/vllm_cuda_tests.log" | tail -20 ;;
  decode)
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    timeout "${RUN_LIMIT:-300}" python3 bench/decode_invariance.py --preset "${PRESET:-qwen3-8b}" \
      --out "$out/decode_invariance.json" > "$out/decode_invariance.log" 2>&1
    echo "decode invariance rc $?"; grep -E "^\|" "$out/decode_invariance.log" | head -200 ;;
  graphprobe)  # bench/graph_layout_probe.py: FA3 + the flash backward on whole padded rows vs the packed real tokens
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    timeout "${RUN_LIMIT:-180}" python3 bench/graph_layout_probe.py --out "$out/graph_layout_probe.json" \
      > "$out/graph_layout_probe.log" 2>&1
    echo "graph layout probe rc $?"; tail -15 "$out/graph_layout_probe.log" ;;
  probe)
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    tag=${FA_SPLITS:-default}
    timeout "${RUN_LIMIT:-300}" python3 bench/vllm_cuda_exact.py --preset qwen3-8b --arms ${ARMS:-jetrl} --gemm-backend auto \
      --prompts "${PROMPTS:-32}" --new-tokens "${LEN:-512}" --kv-cache-gib 8 --cuda-graphs --refit --no-probe \
      ${FA_SPLITS:+--fa-max-splits $FA_SPLITS} --out "$out/probe_8b_splits_$tag.json" > "$out/probe_8b_$tag.log" 2>&1
    echo "probe rc $?"; grep -A7 '"trainer_vs_decode"\|"decode_vs_prefill"\|"trainer_vs_prefill"' "$out/probe_8b_$tag.log" \
      | grep -E "vs_|bit_identical|k3" ;;
  rollcost)  # issue 26 item 5: rollout tokens/s at 8B with the batch-invariant norms vs vLLM's own, side by side
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    timeout "${RUN_LIMIT:-540}" python3 bench/rollout_bench.py compare --preset "${PRESET:-qwen3-8b}" --prompts "${PROMPTS:-128}" \
      --prompt-len 64 --new "${LEN:-1024}" --arm-timeout 170 --out "$out/rollcost.json" \
      --arms "${ARMS:-stock_fp8,jetrl,jetrl:auto:vllm,bf16,bf16:auto:vllm}" > "$out/rollcost.log" 2>&1
    echo "rollout cost rc $?"; grep -B2 -A8 "^arm " "$out/rollcost.log" | head -14 ;;
  exact150m)  # issue 26 item 5: count_150m_gpu (random init, no warm start), the three arms side by side at each of
    # LENS new tokens (ignore_eos), 2 GRPO steps: the mismatch by position with the batch-invariant norms
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    for len in ${LENS:-256 1024 4096}; do
      timeout "${RUN_LIMIT:-180}" python3 -m jetrl_megatron.cli compare --recipe count_150m_gpu --seeds 1 --parallel 3 \
        --arms "${ARMS:-jetrl,bf16,bf16_train_fp8_rollout}" --out "/tmp/exact150m/len$len" \
        policy.jet_rl.sft_warmstart.steps=0 grpo.max_num_steps=2 grpo.val_at_start=false grpo.max_val_samples=0 \
        policy.generation.ignore_eos=true policy.generation.max_new_tokens="$len" \
        policy.max_total_sequence_length=$((len + 64)) policy.generation.vllm_cfg.max_model_len=$((len + 64)) \
        policy.generation.vllm_kwargs.kv_cache_memory_bytes=$((${KV_GIB:-8} << 30)) logger.tensorboard_enabled=false ${EXTRA:-} \
        > "$out/exact150m_len$len.log" 2>&1
      echo "== count_150m_gpu len $len: rc $?"; grep -A5 "^| arm | seeds" "$out/exact150m_len$len.log" | head -6
    done
    (cd /tmp/exact150m && find . -path '*/model*' -prune -o -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' \
      -o -name '*.log' -o -name 'config.yaml' \) -print0 | tar czf "$out/exact150m.tgz" --null -T -) ;;
  te)  # issue 29 item 5: TransformerEngine's guide shape and the Qwen3-8B layer, GEMM + quantization vs BF16 GEMM
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    for shape in "te 15872 16384" "qwen3_8b 16384 12288"; do
      read -r tag seq ffn <<<"$shape"
      timeout "${RUN_LIMIT:-240}" python3 bench/megatron_layer_bench.py --seq "$seq" --ffn "$ffn" --iters 20 \
        --warmup 5 --backends auto --lean-swiglu --elementwise triton --profile --out "$out/layer_$tag" \
        > "$out/layer_$tag.log" 2>&1
      echo "layer $tag rc $?"; grep -E "^\| (bf16|jetrl) \||^\| jetrl / |TransformerEngine" "$out/layer_$tag.log" | head -8
    done ;;
  fuse)  # issue 29 item 2: the fused SwiGLU backward + fc1 dY FP8 quantization, its GPU tests, kernel and layer cost
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    timeout -s INT -k 30 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_megatron_swiglu_fp8.py \
      tests/test_megatron_swiglu_fwd_forms.py > "$out/swiglu_tests.log" 2>&1
    echo "swiglu tests rc $?"; grep -E "passed|failed|FAILED|SKIPPED" "$out/swiglu_tests.log" | tail -6
    BENCH_SECTIONS=env,ceil,swiglu timeout 150 python3 bench/kernels_bench.py > "$out/kernels_swiglu.log" 2>&1
    echo "kernels bench rc $?"; tail -25 "$out/kernels_swiglu.log"
    timeout 300 python3 bench/megatron_layer_bench.py --seq 8192 --iters 20 --warmup 5 --backends auto --lean-swiglu \
      --elementwise triton --fuse-swiglu-grad-quant off,on --swiglu-fp8-forms off,on ${GRAPH:+--cuda-graph} \
      --out "$out/layer_fuse" > "$out/layer_fuse.log" 2>&1
    echo "layer bench rc $?"; grep "^|" "$out/layer_fuse.log" | tail -16 ;;
  quantk)  # issue 29 item 2: the FP8 quantization kernels before and after a change, side by side in this call:
    # BEFORE (default .dgc/before) holds the earlier fp8/kernels.py, megatron/swiglu_fp8.py, megatron/triton_numerics.py
    # (`git show REV:path`); the kernels' GPU tests, kernels_bench's quant section timing both (same bytes checked),
    # bench/host_overhead.py at 2,048 tokens (HOSTOPS_LIMIT s, default 60), and the Qwen3-8B layer fwd+bwd at SEQ
    # (default 8192) tokens with each version (cuBLAS GEMMs: no vLLM bundle needed), LAYER_REPEAT (default 1) rounds of
    # before, after
    wheels > "$out/wheels.log" 2>&1 || { tail -20 "$out/wheels.log"; exit 1; }
    before=${BEFORE:-.dgc/before}
    # QUANT_TESTS="file ...": only those test files (e.g. the ones an earlier call did not reach)
    tests=(${QUANT_TESTS:-tests/test_fp8_kernels_gpu.py tests/test_megatron_triton_numerics.py \
      tests/test_megatron_swiglu_fp8.py tests/test_megatron_swiglu_fwd_forms.py})
    timeout -s INT -k 30 "${TEST_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu -rs "${tests[@]}" \
      > "$out/tests_quant.log" 2>&1
    echo "quant kernel GPU tests rc $?"; grep -E "passed|failed|FAILED|Error" "$out/tests_quant.log" | tail -8
    mkdir -p "$out/kb"
    BENCH_SECTIONS=env,ceil,quant BENCH_BASELINE_KERNELS="$before/kernels.py" OUT="$out/kb" \
      timeout "${BENCH_LIMIT:-180}" python3 bench/kernels_bench.py > "$out/kernels_quant.log" 2>&1
    echo "kernels bench rc $?"; grep -E "^(quant|regroup|before|bf16 clone|eager)|defaults chosen|copy_GBps" \
      "$out/kernels_quant.log" | tail -60
    # issue 29 item 3 op by op at the update's micro-batch (cuBLAS and Triton only here: no vLLM bundle, no DeepGEMM)
    timeout "${HOSTOPS_LIMIT:-60}" python3 bench/host_overhead.py --tokens 2048 --out "$out/host_overhead_2048.json" \
      > "$out/host_overhead_2048.log" 2>&1
    echo "host overhead rc $?"; grep -E " host .* device" "$out/host_overhead_2048.log" | head -40
    rm -rf /tmp/before_tree && mkdir -p /tmp/before_tree && cp -r jetrl_megatron bench tests /tmp/before_tree/ \
      && cp "$before/kernels.py" /tmp/before_tree/jetrl_megatron/fp8/ \
      && cp "$before/swiglu_fp8.py" "$before/triton_numerics.py" /tmp/before_tree/jetrl_megatron/megatron/
    # the after-rows run with the launch shapes the sweep just picked (the before-rows with their file's own defaults)
    picks=$(python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['quant_defaults']
print(','.join(f'{k}={int(v)}' for k, v in d.items()))" "$out/kb/kernels_bench.json" 2>/dev/null)
    echo "after-rows launch: ${picks:-the module defaults}"
    for round in $(seq "${LAYER_REPEAT:-1}"); do
      for side in before after; do
        tree=$PWD launch=(--quant-launch "$picks"); [ "$side" = before ] && tree=/tmp/before_tree launch=()
        (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "${LAYER_LIMIT:-150}" python3 bench/megatron_layer_bench.py \
          --seq "${SEQ:-8192}" --iters 20 --warmup 5 --backends cublas --lean-swiglu --elementwise triton --profile \
          "${launch[@]}" --out "$out/layer_${side}_$round") > "$out/layer_${side}_$round.log" 2>&1
        echo "layer $side round $round rc $?"; grep -E "^\| (bf16|jetrl)|FP8 quant|quantization" \
          "$out/layer_${side}_$round.log" | head -12
      done
    done ;;
  hostgap)  # issue 29 item 3 at the size the 8B update runs (micro-batch 2 x ~1.1K tokens): the Qwen3-8B layer fwd+bwd
    # eager vs captured as CUDA graphs, jetrl and bf16 side by side, and cProfile of the host side of one fwd+bwd;
    # BACKENDS: the jetrl rows' gemm_backend values (default auto; e.g. auto,deep_gemm)
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    timeout "${RUN_LIMIT:-200}" python3 bench/megatron_layer_bench.py --seq "${SEQ:-2048}" --iters 30 --warmup 5 \
      --backends "${BACKENDS:-auto}" --lean-swiglu --elementwise triton --cuda-graph --host-profile \
      --out "$out/layer_hostgap_seq${SEQ:-2048}" > "$out/layer_hostgap.log" 2>&1
    echo "layer bench rc $?"; grep "^|" "$out/layer_hostgap.log" | tail -40 ;;
  hostops)  # issue 29 item 3, op by op: host vs device us of the FP8 linear's pieces at TOKENS (default "2048 4128")
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    for m in ${TOKENS:-2048 4128}; do
      timeout "${RUN_LIMIT:-120}" python3 bench/host_overhead.py --tokens "$m" --torch-profile --thread-probe --out "$out/host_overhead_$m.json" \
        > "$out/host_overhead_$m.log" 2>&1
      echo "host overhead $m rc $?"; grep "^|" "$out/host_overhead_$m.log" | tail -100
      sed -n '/^torch.profiler/,$p' "$out/host_overhead_$m.md"
    done ;;
  threads)  # issue 29 item 3: autograd's device thread vs the calling thread, op by op (hostops at TOKENS) and
    # the layer at SEQ tokens with every backward on each (BF16 and jetrl alike, eager and graphed)
    TOKENS=${TOKENS:-2048} bash "$0" hostops "$out"
    for where in device calling; do
      flag=""; [ "$where" = calling ] && flag=--backward-on-calling-thread
      timeout "${RUN_LIMIT:-200}" python3 bench/megatron_layer_bench.py --seq "${SEQ:-2048}" --iters 30 --warmup 5 \
        --backends "${BACKENDS:-auto}" --lean-swiglu --elementwise triton ${GRAPH---cuda-graph} $flag \
        --out "$out/layer_backward_on_${where}_thread" > "$out/layer_backward_on_${where}_thread.log" 2>&1
      echo "layer bench, backward on the $where thread: rc $?"; grep "^|" "$out/layer_backward_on_${where}_thread.log" | tail -8
    done ;;
  waves)  # a KV cache smaller than the batch: waves (no preemption) vs one submission (vLLM preempts), per budget
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    timeout "${RUN_LIMIT:-240}" python3 bench/rollout_waves.py --preset "${PRESET:-qwen3-0.6b}" --prompts 8 --n 16 \
      --prompt-len 32 --new "${LEN:-1024}" --kv-gib "${KV_GIB:-4,20}" --out "$out/rollout_waves.json" \
      > "$out/rollout_waves.log" 2>&1
    echo "rollout waves rc $?"; grep "^|" "$out/rollout_waves.log" ;;
  long)  # issue 31's GPU rounds: install, then bench/long_response_gpu.sh LONG_MODE (default learn) with this
    # script's environment (PYTHONPATH=/tmp/site, vLLM's flags); its own variables pass through (PARALLEL, SEEDS,
    # LEARN_STOP, LEARN_LR, LEARN_STEPS, LEARN_ARMS, LEARN_REUSE_FROM, WARMSTART_ONLY, TIME_LIMIT); EXTRA="key=value
    # ..." are overrides. Its state (/tmp/jetrl_long) lasts as long as the machine: chain the calls of one round
    wheels > "$out/wheels.log" 2>&1 && vllm_bundle > "$out/install.log" 2>&1 || { tail -20 "$out"/*.log; exit 1; }
    # `python` there: a wrapper, not a link (a link to a venv's interpreter loses the venv and its packages)
    mkdir -p /tmp/pybin && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/pybin/python \
      && chmod +x /tmp/pybin/python; PATH=/tmp/pybin:$PATH \
      TIME_LIMIT=${TIME_LIMIT:-${RUN_LIMIT:-540}} bash bench/long_response_gpu.sh "${LONG_MODE:-learn}" "$out" ${EXTRA:-} ;;
  round)  # several modes in one device call, in order, each into its own folder: ROUND="vtests fuse"; a mode's own
    # variables (ARM, LEN, RUN_LIMIT, ...) apply to every mode of the round, so keep their sum of limits under a call's
    for m in ${ROUND:?ROUND=\"mode mode ...\"}; do
      [ "$m" = round ] && { echo "round: a round cannot hold itself" >&2; exit 2; }
      limit_var=LIMIT_$m  # LIMIT_<mode>=seconds: that mode's RUN_LIMIT in this round
      echo "== round: $m ($(date +%T))"; PACK_DG=0 RUN_LIMIT=${!limit_var:-${RUN_LIMIT:-}} bash "$0" "$m" "$out/$m"
    done ;;
  *) echo "usage: $0 stage0|stage1|stage2|suite|vtests|check|grpo|arms|optcost|decode|probe|graphprobe|rollcost|exact150m|waves|fuse|quantk|hostgap|hostops|threads|threadloop|variants|te|long|round OUT_DIR" >&2
     exit 2 ;;
esac
# PACK_DG=1 (any mode): DeepGEMM's JIT cache as one file, to carry back next session as .dgc/dg_cache.tgz, and
# Triton's kernels (binaries, metadata and launchers only: tools/triton_cache_pack.py) as .dgc/triton_cache.tar.xz
# when that packs under 10 MiB (carried beside the last bundle part and the tree, a call stays under 64 MiB)
if [ "${PACK_DG:-0}" = 1 ] && [ -d /tmp/dg_cache ]; then
  # written under another name and renamed when whole: a call cut while packing leaves no truncated archive
  tar czf "$out/dg_cache.tgz.partial" -C /tmp dg_cache && mv "$out/dg_cache.tgz.partial" "$out/dg_cache.tgz" \
    && ls -l "$out/dg_cache.tgz"
fi
if [ "${PACK_DG:-0}" = 1 ] && [ -d /tmp/triton_cache ]; then
  python3 tools/triton_cache_pack.py /tmp/triton_cache "$out/triton_cache.tar.xz" --max-mib 10
fi
# At most 8 files come back from a device call (2026-12-05: a vtests log was left out): where this mode wrote more
# than 6, everything but the archives travels as one logs.tgz
# (NO_PACK=1: a mode run inside another, which packs once at its end: arms)
if [ "${NO_PACK:-0}" != 1 ] && [ "$(find "$out" -type f | wc -l)" -gt 6 ]; then
  # a name no earlier invocation into the same OUT took (two grpo runs in one call: the second archive used to
  # overwrite the first, 2026-12-07)
  pack=logs.tgz; n=1; while [ -e "$out/$pack" ]; do pack=logs_$n.tgz; n=$((n + 1)); done
  (cd "$out" && find . -type f ! -name '*.tgz' ! -name '*.tar.xz' -print0 | tar czf "$pack" --null -T - --remove-files)
fi
