"""The clean estimates of one iteration: each distinct state once vs every state, side by side.

    .venv/bin/python -m pytest benchmarks/test_bench_estimates.py --benchmark-enable -s

The `default` preset's batch (4 groups of 8 on the embedded model, 10 ddim steps, T' = 3, CFG 4.5)
is rolled out once; then `grpo.estimate_images` runs on it with `distinct=True` (the trainer's way:
a group's members share states 0 and 1, so those are estimated once per group) and `distinct=False`
(every state of every member), alternating A B A B so that load on a shared machine hits both alike.
Prints the median seconds of each and their ratio, and checks that both give the same images.
STEPFAST_BENCH_REPEATS (default 5) sets the number of calls of each.
"""

from __future__ import annotations

import statistics
import time

import torch

from machine import cpu_name, setting
from stepfast import grpo
from stepfast.config import load_config
from stepfast.data.prompts import load_prompts
from stepfast.models import EMBEDDED_MODEL, load_pipeline
from stepfast.policy import encode_prompts, latent_shape
from stepfast.rollout import sample_noise
from stepfast.sde import sd3_time_grid


def test_distinct_states_vs_every_state(benchmark):
    repeats = setting("STEPFAST_BENCH_REPEATS", 5)
    torch.set_num_threads(1)
    cfg = load_config("default")
    groups, size = cfg.rollout.groups, cfg.rollout.group_size
    pipe = load_pipeline(EMBEDDED_MODEL)
    prompts = load_prompts(cfg.rollout.prompts)
    texts = [prompts[g].prompt for g in range(groups) for _ in range(size)]
    cond = encode_prompts(pipe, texts, cfg.rollout.cfg, torch.device("cpu"))
    shape = latent_shape(pipe, 1, cfg.rollout.resolution)[1:]
    members = [(g, n) for g in range(groups) for n in range(size)]
    x_init, noise = sample_noise(cfg.seed, 1, [g for g, _ in members], [n for _, n in members], shape,
                                 cfg.sde.steps, cfg.rollout.same_latent)  # fmt: skip
    grid = sd3_time_grid(cfg.sde.steps, shift=float(pipe.scheduler.config.get("shift", 3.0)))
    traj = grpo.rollout(pipe.transformer, cond, x_init, noise, grid, cfg)
    estimator = grpo.Estimator(pipe.transformer, cfg.rollout.cfg, use_cuda_graph=False)
    seconds = {True: [], False: []}
    images = {}

    def measure():
        for _ in range(repeats):
            for distinct in (True, False):
                start = time.perf_counter()
                images[distinct] = grpo.estimate_images(pipe, estimator, cond, traj, cfg, distinct=distinct)
                seconds[distinct].append(time.perf_counter() - start)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    once, every = statistics.median(seconds[True]), statistics.median(seconds[False])
    print(f"\nclean estimates of {groups} groups x {size}, {cfg.sde.steps} states each, T' = {cfg.rollout.substeps}, "
          f"1 thread on {cpu_name()}, median of {repeats}:\n"
          f"  every state    {every:.3f} s\n  distinct once  {once:.3f} s\n"
          f"  every / distinct: {every / once:.2f}x")  # fmt: skip
    benchmark.extra_info.update(every_s=every, distinct_s=once, ratio=every / once)
    torch.testing.assert_close(images[True], images[False], rtol=0, atol=1e-5)
