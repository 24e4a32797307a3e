# One command for the main job, one for the tests; both set themselves up.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test bench bench-test lean clean docs

# The set-up says what it is doing, step by step, and pip lists what it collects and installs (a first
# set-up downloads torch and the dev tools: minutes, not a silent wait).
$(STAMP): pyproject.toml
	@echo "== setup 1/4: the virtual environment $(VENV) (once; later commands reuse it)"
	$(PYTHON) -m venv $(VENV)
	@echo "== setup 2/4: pip itself"
	$(PY) -m pip install --upgrade pip
	@echo "== setup 3/4: torch 2.13.0 (the CPU build, the largest download), unless this Python has a torch"
	# torch is pinned to the CPU build these machines carry; a GPU machine keeps its own torch.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	@echo "== setup 4/4: fastdiag (editable) and its dependencies, with the dev extra (pytest, xdist, ...)"
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)
	@echo "== setup done: $(VENV)"

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fastdiag run --out runs/demo

# -n auto: one pytest-xdist worker per core (most tests are one-thread Python: the interpreted kernels,
# subprocesses), test by test; --dist loadgroup keeps the tests that share an expensive fixture on one
# worker (tests/conftest.py). --durations: where the suite's time goes, printed by every run (CI's log included).
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n auto --dist loadgroup --durations=15

# The benchmarks' own tests, timing off: each checks its timed path against the float64 reference
# first, so a benchmark that drifted from the library fails here (CI runs it after `make test`).
bench-test: $(STAMP)
	FASTDIAG_BENCH_SHAPES=grokking $(PY) -m pytest -q -p no:cacheprovider benchmarks/ --benchmark-disable

# What README.md shows, regenerated from data committed in the repository (docs/generate.py says which
# block comes from where; tests/test_readme_snippets.py checks the fast ones).
docs: $(STAMP)
	$(PY) docs/generate.py

bench: $(STAMP)
	$(VENV)/bin/fastdiag bench

clean:
	rm -rf $(VENV) runs build *.egg-info
