PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo lint check test test-long bench gpu-check clean

setup: $(STAMP)

# PYTHONWARNINGS: setuptools warns on every editable install that same-named folders in the cwd take
# precedence (true, and intended here); the silence is only for that notice
$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel -c constraints.txt 2>/dev/null || true
	$(BIN)/pip install -q torch==2.13.0 -c constraints.txt
	PYTHONWARNINGS=ignore::UserWarning $(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(BIN)/pipetwin demo --out out

# the house rules: ruff (pyflakes, pycodestyle, bugbear), the import contracts of
# setup.cfg [importlinter] (the layers, lazy imports included), and no docstring reference
# (:func:`...`, :class:`...`, ...) that names nothing (experiments/check_refs.py)
lint: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m experiments.check_refs

# the suite in tiers (pytest.ini's markers): `make check` the logic (IR, costs, simulator, planner,
# CLI errors, one world-2 run per family) for everyday work; `make test` (CI) all of it, lint first
check: setup
	$(BIN)/python -m pytest -q -m "not slow and not long" tests

test: lint
	$(BIN)/python -m pytest -q -m "not long" tests

# exit status 5 is pytest's "no test collected": nothing marked long is not a failure
test-long: setup
	$(BIN)/python -m pytest -q -m long tests; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

bench: setup
	$(BIN)/python -m experiments.bench_sim

# on a machine with a GPU: layers vs the kernel model, the preset's constants fitted, runs vs the
# reference (experiments/gpu_check.py; --device cpu runs the same code without a GPU)
gpu-check: setup
	$(BIN)/python -m experiments.gpu_check --device cuda --out out/gpu-check

clean:
	rm -rf $(VENV) out build *.egg-info
