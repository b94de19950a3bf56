# The two commands of the README: `make demo` (set up + main job: the image demo) and `make test` (set up + test
# suite); `make demo-text` runs the text stand-in.
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: setup lock demo demo-text test test-unit lint bench-vllm-gpu

setup:
	./scripts/setup.sh

# Re-pin requirements/cpu.lock (the exact versions setup installs) after changing pyproject.toml's dependencies.
lock:
	./scripts/lock.sh

demo: setup
	./scripts/demo.sh --vlm --config configs/demo_vlm_cpu.yaml

demo-text: setup
	./scripts/demo.sh

# Prints pytest's own time and its 10 slowest tests at the end (the suite is kept under 20 minutes).
test: setup
	@start=$$(date +%s); $(PY) -m pytest -q -p no:cacheprovider --durations=10; rc=$$?; \
	  took=$$(( $$(date +%s) - start )); echo "[make test] pytest took $$((took / 60)) min $$((took % 60)) s"; exit $$rc

test-unit: setup
	$(PY) -m pytest -q tests/unit

lint:
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

# GPU host with vLLM 0.26-0.32 and 2 GPUs: the vLLM server on GPU 1, the learner on GPU 0 (bench/RESULTS.md "the vLLM backend on GPUs").
bench-vllm-gpu:
	python bench/bench_vllm_gpu.py --out runs/vllm_gpu.jsonl
