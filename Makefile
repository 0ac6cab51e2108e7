PY ?= python3
PIP ?= $(PY) -m pip

.PHONY: install demo test lint gpu-check

# torch is pinned to the local CPU build first so that pip never pulls the CUDA wheels on CPU boxes
install:
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"

demo: install
	TUNER_CACHE=$${TUNER_CACHE:-.tuner/demo.db} $(PY) -m tuner.demo

test: install
	$(PY) -m pytest -q

lint:
	ruff check . && ruff format --check .
