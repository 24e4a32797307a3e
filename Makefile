# One command for the main job, one for the tests; both set themselves up.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test bench bench-test lean clean docs

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned to the CPU build these machines carry; a GPU machine keeps its own torch.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

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
