# One command for the main job, one for the tests; both set themselves up.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test bench lean clean

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

test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/fastdiag bench

clean:
	rm -rf $(VENV) runs build *.egg-info
