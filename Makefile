# The two commands of the README: `make demo` (set up + main job) and `make test` (set up + test suite).
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: setup demo demo-vlm test test-unit lint

setup:
	./scripts/setup.sh

demo: setup
	./scripts/demo.sh

demo-vlm: setup
	./scripts/demo.sh --vlm --config configs/demo_vlm_cpu.yaml

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

test-unit: setup
	$(PY) -m pytest -q tests/unit

lint:
	$(PY) -m ruff check . && $(PY) -m ruff format --check .
