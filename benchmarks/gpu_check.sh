#!/usr/bin/env bash
# Every CUDA test and benchmark: the fused kernels, the CUDA-graph estimate engine and the trainer, on
# one GPU. About 5 minutes on one H200 (most of it: compiling the Triton kernels once, the trainer runs,
# building an SD3.5-Medium-shaped transformer with random weights). Nothing is downloaded.
#
#   bash benchmarks/gpu_check.sh                    # from any directory
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#   STEPFAST_HBM_PEAK_BYTES_PER_S=3.35e12 bash benchmarks/gpu_check.sh   # H100 SXM peak
#
# Prints, in order:
#   1. the CUDA tests: compiled Triton kernels against float64 (outputs and gradients, every sampler,
#      reduction and dtype), on-policy bitwise equality, the CUDA-graph estimate engine against eager;
#   2. the trainer on the GPU (`python stepfast/train.py`, tiny model; fp32 and the SD3.5 presets' bf16
#      with gradient checkpointing under ZeRO-2, fp32 under ZeRO-3): Triton kernels and the graph in
#      use (eager under ZeRO-3), every first micro-step on-policy to the bit, and the fp32 run's first
#      rewards against the same run on the CPU;
#   3. the fused-vs-eager-vs-copy table on CUDA, and pytest-benchmark's records;
#   4. the Triton ops' achieved HBM bandwidth as a fraction of STEPFAST_HBM_PEAK_BYTES_PER_S
#      (default 4.8e12 B/s, an H200);
#   5. the CUDA-graph estimate engine's speedup over the eager loop on an SD3.5-Medium-shaped
#      SD3Transformer2DModel (24 layers, 24 heads x 64, joint_attention_dim 4096; bf16, random weights);
#   6. seconds per training iteration, `default` (stepwise) against `flow_grpo`, on this GPU
#      (benchmarks/test_bench_iteration.py; STEPFAST_BENCH_ITERATIONS, default 4 here, and
#      STEPFAST_BENCH_REPEATS, default 1 here, set its size).
# Exit status: non-zero when a test fails.
set -euo pipefail
if (( $# )); then  # it runs every check, always: an argument (a -k filter, say) would be ignored
  echo "gpu_check: takes no arguments (got: $*); it runs every CUDA check. For a subset, run pytest on" \
       "tests/ or benchmarks/ yourself" >&2
  exit 2
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -z "${PYTHON:-}" ]]; then  # the first interpreter whose torch sees a GPU, else the first with torch
  for candidate in .venv/bin/python python3 python; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
      PYTHON=$candidate
      break
    fi
    if [[ -z "${PYTHON:-}" ]] && "$candidate" -c "import torch" >/dev/null 2>&1; then
      PYTHON=$candidate  # kept unless a later one sees a GPU; the driver then says there is none
    fi
  done
  if [[ -z "${PYTHON:-}" ]]; then
    echo "gpu_check: no python with torch found (tried .venv/bin/python, python3, python); set PYTHON=" >&2
    exit 2
  fi
fi
# the trainer's tests and the iteration benchmark start `python stepfast/train.py` as subprocesses,
# which find stepfast.kernels (kernels/, mapped by pyproject) only in an installed stepfast
if ! why=$("$PYTHON" -c "import stepfast.kernels" 2>&1); then
  why=$(tail -n 1 <<<"$why")
  hint=""
  if [[ "$why" == *"No module named 'stepfast"* ]]; then
    hint=": install stepfast into it first ($PYTHON -m pip install --no-build-isolation -e .; make test does it for .venv)"
  fi
  echo "gpu_check: $PYTHON cannot import stepfast.kernels ($why)$hint" >&2
  exit 2
fi
export STEPFAST_HBM_PEAK_BYTES_PER_S="${STEPFAST_HBM_PEAK_BYTES_PER_S:-4.8e12}"
export STEPFAST_BENCH_ITERATIONS="${STEPFAST_BENCH_ITERATIONS:-4}" STEPFAST_BENCH_REPEATS="${STEPFAST_BENCH_REPEATS:-1}"
# the defaults under test: Triton on CUDA, compiled (not interpreted)
unset STEPFAST_KERNELS TRITON_INTERPRET

command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true

exec "$PYTHON" - <<'PY'
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path.cwd()))

import pytest
import torch
import triton

if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch")
print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
      f"python {sys.version.split()[0]}", flush=True)

try:
    import pytest_benchmark  # noqa: F401

    no_plugin = []
    bench_opts = ["--benchmark-enable", "--benchmark-columns=min,median,iqr,max,rounds", "--benchmark-sort=name"]
    bench_filter = "cuda"
except ImportError:  # pyproject's addopts name the plugin: override them; skip its per-case records
    print("gpu_check: pytest-benchmark is not installed: skipping its per-case records", flush=True)
    no_plugin = ["-o", "addopts=-ra"]
    bench_opts = no_plugin
    bench_filter = "cuda and not test_bench["

common = ["-p", "no:cacheprovider", "-rfEs"]
phases = [
    ("CUDA tests (compiled Triton kernels vs float64, CUDA-graph engine)",
     ["-q", *common, *no_plugin, "-k", "cuda", "tests/test_kernels.py", "tests/test_estimates.py"]),
    ("The trainer on the GPU (Triton kernels, CUDA graph, on-policy ratios, fp32 against the CPU)",
     ["-q", "-s", *common, *no_plugin, "-k", "cuda", "tests/test_train.py"]),
    ("CUDA benchmarks (fused vs eager vs copy, HBM bandwidth, CUDA-graph engine on SD3.5-Medium shapes)",
     ["-q", "-s", *common, *bench_opts, "-k", bench_filter, "benchmarks/test_bench_kernels.py"]),
]
if not no_plugin:  # the iteration benchmark is a pytest-benchmark test
    phases.append(("Seconds per iteration on this GPU: default (stepwise) vs flow_grpo",
                   ["-q", "-s", *common, *bench_opts, "benchmarks/test_bench_iteration.py"]))
status = 0
start = time.time()
for title, args in phases:
    print(f"\n=== {title} ===", flush=True)
    t0 = time.time()
    rc = int(pytest.main(args))
    print(f"=== exit {rc} after {time.time() - t0:.0f} s ===", flush=True)
    status = status or rc
print(f"\ngpu_check: {'OK' if status == 0 else 'FAILED'} in {time.time() - start:.0f} s", flush=True)
sys.exit(status)
PY
