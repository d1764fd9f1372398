# `make test` and `make train` (and `make bench`, `make clean`). All but `clean` create .venv when it is missing.
# On a machine without a GPU, install the CPU build of torch:
#   make test TORCH=torch==2.13.0 TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (CI leaves out TORCH_INDEX: its pip finds the CPU wheel locally; PyPI's torch is a CUDA build.)
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch
# Where pip finds torch, when not the default index (e.g. https://download.pytorch.org/whl/cpu).
TORCH_INDEX ?=
# The releases of stepfast's dependencies the suite last passed with (empty: the newest allowed).
CONSTRAINTS ?= .ci/constraints.txt
ARGS ?=
# `make train` ranks: one per GPU; without CUDA, two CPU ranks (the launcher told so: DS_ACCELERATOR=cpu,
# which spares its "unable to detect" warnings), the launcher quiet but for errors where its version
# has --quiet. On the 2-core machine the default run
# is sized for, an iteration of 32 samples took 9.3 s as two ranks and 16.7 s as one rank on both
# cores, on one (slower) host: the tiny model's operations are too small to spread over threads.
# Threads per rank: the cores shared out, at least one. Override with `make train RANKS=1 THREADS=2`.
# Both are shell expressions, evaluated once in the recipe (after .venv exists).
RANKS ?= $$($(PY) -c "import torch; print(torch.cuda.device_count() or 2)")
THREADS ?= $$(n=$$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc); echo $$(( n / ranks > 0 ? n / ranks : 1 )))
# `make test` workers (pytest-xdist): one per core, at most 4. Most of the suite's time is trainers
# started as subprocesses, one thread per rank, and their imports and file I/O: on 2 cores two
# workers took 373 s where one took 653 s. `make test WORKERS=0` runs in one process. (nproc would
# report OMP_NUM_THREADS instead of the cores when it is set.)
WORKERS ?= $$(n=$$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc); echo $$(( n < 4 ? n : 4 )))
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stepfast-installed

.PHONY: test train bench clean

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h) $(CONSTRAINTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade setuptools wheel
	$(PY) -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(PY) -m pip install --quiet --no-build-isolation -e ".[dev]" $(if $(CONSTRAINTS),--constraint "$(CONSTRAINTS)")
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests -n $(WORKERS)

train: $(STAMP)
	ranks=$(RANKS); threads=$(THREADS); \
	accelerator=$$($(PY) -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')"); \
	quiet=$$($(VENV)/bin/deepspeed --help 2>/dev/null | grep -q -e '--quiet' && echo --quiet); \
	DS_ACCELERATOR=$${DS_ACCELERATOR:-$$accelerator} OMP_NUM_THREADS=$$threads \
	$(VENV)/bin/deepspeed $$quiet --num_gpus $$ranks stepfast/train.py $(ARGS)

bench: $(STAMP)
	$(PY) -m pytest benchmarks --benchmark-enable -s

clean:
	rm -rf $(VENV) build *.egg-info stepfast/_C*.so
