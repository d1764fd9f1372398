"""Throughput of the ShapeEval reward on one CPU core.

    .venv/bin/python -m pytest benchmarks/test_bench_shapes_reward.py --benchmark-enable -s

Scores a batch of 256 renders of test prompts at 64x64 with torch limited to one thread (the reward
itself is single-threaded numpy/scipy) and reports images per CPU-second: process CPU time, so the
figure is what one core delivers even when other processes share the machine. Prints the median
and 20/80 percentiles with the hardware; the target is >= 1,000 images/s.
"""

import time

import numpy as np
import pytest
import torch

from stepfast.data.shapeeval import load_metadata, render_batch
from stepfast.rewards.shapes import ShapesReward
from machine import cpu_name

BATCH = 256
SIZE = 64
REPEATS = 20
TARGET_IMAGES_PER_SECOND = 1000


@pytest.fixture(scope="module")
def batch():
    test = load_metadata("test")
    metas = [test[i] for i in np.random.default_rng(0).integers(len(test), size=BATCH)]
    return render_batch(metas, SIZE, seed=0), [m["prompt"] for m in metas]


def test_shapes_reward_images_per_second(benchmark, batch):
    torch.set_num_threads(1)
    images, prompts = batch
    reward = ShapesReward()
    reward.score(images, prompts)  # warm-up: prompt parsing is cached per reward

    rates = []
    for _ in range(REPEATS):
        start = time.process_time()
        out = reward.score(images, prompts)
        rates.append(BATCH / (time.process_time() - start))
    p20, median, p80 = np.percentile(rates, [20, 50, 80])
    print(
        f"\nShapesReward.score, {BATCH} images {SIZE}x{SIZE}, 1 thread: median {median:,.0f} images/s "
        f"(p20 {p20:,.0f}, p80 {p80:,.0f}) per CPU-second on {cpu_name()}"
    )
    benchmark.extra_info.update(images_per_second_median=median, p20=p20, p80=p80, cpu=cpu_name())
    benchmark(reward.score, images, prompts)
    assert out["strict"].mean() == 1.0, "the benchmark batch must be scored correctly"
    assert median >= TARGET_IMAGES_PER_SECOND
