"""Seconds per training iteration: stepwise (`default`) vs Flow-GRPO (`flow_grpo`), side by side.

Both presets run on the same model, batch and machine, alternating A B A B so that load on a shared
machine hits both alike; the first iteration of each run (warm-up) is left out. Prints seconds per
iteration of each, their ratio (the paper reports 1.8-2.4x for stepwise over Flow-GRPO), and the time
split into rollout, estimates (with the decoding of the final images, which runs beside them),
rewards and update. Each preset keeps its own settings, so the ratio
also carries what they do differently besides the credit (printed under it): the steps trained and
the LoRA's targets, which the update's time follows.

    .venv/bin/python -m pytest benchmarks/test_bench_iteration.py --benchmark-enable -s
    STEPFAST_BENCH_ITERATIONS=4 STEPFAST_BENCH_REPEATS=2 (defaults) set the size.
"""

from __future__ import annotations

import csv
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from machine import run_environment, setting

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("rollout", "estimates", "rewards", "update")


def run(preset: str, out: Path, iterations: int, model: str) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "stepfast" / "train.py"), "--config", preset, f"output_dir={out}",
           f"iterations={iterations}", f"model.path={model}", "eval.before_after=false", "checkpoint_every=0",
           "log.report=false", "log.tensorboard=false"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=run_environment(), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{preset} failed:\n{proc.stderr[-4000:]}")
    with (out / "metrics.csv").open() as f:
        return [{k: float(v) for k, v in r.items() if k.startswith(("time/", "iteration"))} for r in csv.DictReader(f)]


def preset_differences(preset: str) -> str:
    """What a preset trains, in the terms that set the update's time."""
    from stepfast import grpo
    from stepfast.config import load_config

    cfg = load_config(preset)
    return (f"{preset} trains {len(grpo.trained_steps(cfg))} of {cfg.sde.steps} steps ({cfg.sampler}), "
            f"LoRA on {len(cfg.model.lora_targets)} projections per block")  # fmt: skip


def model_path() -> str:
    from stepfast.models import EMBEDDED_MODEL

    return EMBEDDED_MODEL if Path(EMBEDDED_MODEL, "model_index.json").exists() else ""


def test_iteration_time_stepwise_vs_flow_grpo(benchmark, tmp_path):
    iterations = setting("STEPFAST_BENCH_ITERATIONS", 4, minimum=2)  # the first of each run is not timed
    repeats = setting("STEPFAST_BENCH_REPEATS", 2)
    model = model_path()
    if not model:
        from stepfast.models.tiny import tiny_pipeline_dir

        model = str(tiny_pipeline_dir(tmp_path, seed=0))
    rows: dict[str, list[dict]] = {"default": [], "flow_grpo": []}

    def measure():
        for r in range(repeats):
            for preset in rows:
                rows[preset] += run(preset, tmp_path / f"{preset}-{r}", iterations, model)[1:]

    benchmark.pedantic(measure, rounds=1, iterations=1)
    print(f"\nseconds per iteration, {iterations - 1} timed iterations x {repeats} runs each; "
          f"model {model}; {platform.machine()}, {os.cpu_count()} CPUs, torch {__import__('torch').__version__}")
    print(f"{'preset':>10} | {'s/iter':>7} | " + " | ".join(f"{p:>9}" for p in PHASES))
    med = {}
    for preset, rs in rows.items():
        med[preset] = statistics.median(r["time/iteration"] for r in rs)
        split = [statistics.median(r[f"time/{p}"] for r in rs) for p in PHASES]
        print(f"{preset:>10} | {med[preset]:7.2f} | " + " | ".join(f"{s:9.2f}" for s in split))
    ratio = med["default"] / med["flow_grpo"]
    print(f"stepwise (default) / flow_grpo: {ratio:.2f}x per iteration (paper: 1.8-2.4x)")
    print("besides the credit: " + "; ".join(preset_differences(preset) for preset in rows))
    # every phase took a measurable, finite time in every timed iteration (a phase skipped or a clock
    # misread would show as 0, negative or nan), and the medians are over as many timed iterations as
    # the header says, for both presets
    bad = [(preset, r["iteration"], k, r[k]) for preset, rs in rows.items() for r in rs
           for k in ("time/iteration", *(f"time/{p}" for p in PHASES)) if not 0 < r[k] < float("inf")]  # fmt: skip
    assert not bad, f"times that are not positive and finite: {bad}"
    assert all(len(rs) == (iterations - 1) * repeats for rs in rows.values()), {k: len(v) for k, v in rows.items()}
