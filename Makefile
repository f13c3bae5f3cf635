PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-long bench clean

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel -c constraints.txt 2>/dev/null || true
	$(BIN)/pip install -q torch==2.13.0 -c constraints.txt
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(BIN)/pipetwin demo --out out

test: setup
	$(BIN)/python -m pytest -q -m "not long" tests

test-long: setup
	$(BIN)/python -m pytest -q -m long tests

bench: setup
	$(BIN)/python -m experiments.bench_sim

clean:
	rm -rf $(VENV) out build *.egg-info
