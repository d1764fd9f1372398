# Two commands: `make test` and `make train`. Both create .venv when it is missing.
# On a machine without a GPU, install the CPU build of torch: make test TORCH=torch==2.13.0
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch
ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stepfast-installed

.PHONY: test train bench clean

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade setuptools wheel
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet --no-build-isolation -e ".[dev]"
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests

train: $(STAMP)
	$(VENV)/bin/deepspeed stepfast/train.py $(ARGS)

bench: $(STAMP)
	$(PY) -m pytest benchmarks --benchmark-enable -s

clean:
	rm -rf $(VENV) build *.egg-info stepfast/_C*.so
