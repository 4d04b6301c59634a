PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,serve]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	# one worker per core (at most 4: each holds its own models)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadgroup tests

demo: $(STAMP)
	$(BIN)/python examples/extract.py

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_vs_hf.py
	$(BIN)/python benchmarks/engine_vs_hf.py --quantization int4

clean:
	rm -rf $(VENV) build *.egg-info
