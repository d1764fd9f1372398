"""Sampling speed of the embedded model on the CPU: 16 images at 64x64, 40 steps, CFG 4.5.

    .venv/bin/python -m pytest benchmarks/test_bench_embedded_sampling.py --benchmark-enable -s

Loads the shipped pipeline with diffusers' own `StableDiffusion3Pipeline.from_pretrained` (the path
users take), samples 16 test prompts with ODE sampling and classifier-free guidance (32 transformer
rows per step), and prints wall-clock seconds per call, median and range over REPEATS calls, with the
torch thread count and the CPU. The target is under 30 s on a 2-core CPU.
"""

import os
import time

import numpy as np
import torch

from stepfast.data.shapeeval import load_metadata
from stepfast.models import EMBEDDED_MODEL, text_length
from machine import cpu_name, setting

IMAGES = 16
STEPS = 40
GUIDANCE = 4.5
REPEATS = setting("STEPFAST_BENCH_REPEATS", 3)
TARGET_SECONDS = 30.0


def test_embedded_model_samples_16_images_40_steps(benchmark):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(EMBEDDED_MODEL, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    prompts = [m["prompt"] for m in load_metadata("test")[:IMAGES]]

    def sample():
        generators = [torch.Generator().manual_seed(i) for i in range(IMAGES)]
        return pipe(
            prompt=prompts, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=64, width=64,
            generator=generators, max_sequence_length=text_length(pipe), output_type="np",
        ).images  # fmt: skip

    images = sample()  # warm-up (first-call allocations)
    seconds = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        images = sample()
        seconds.append(time.perf_counter() - start)
    median = float(np.median(seconds))
    print(
        f"\nembedded model, {IMAGES} images 64x64, {STEPS} steps, CFG {GUIDANCE}: median {median:.2f} s "
        f"(min {min(seconds):.2f}, max {max(seconds):.2f}, {REPEATS} calls) with {torch.get_num_threads()} "
        f"torch threads on {os.cpu_count()} CPUs ({cpu_name()}); target < {TARGET_SECONDS:.0f} s"
    )
    benchmark.extra_info.update(seconds_median=median, threads=torch.get_num_threads(), cpu=cpu_name())
    benchmark.pedantic(sample, rounds=1, iterations=1)
    assert images.shape == (IMAGES, 64, 64, 3) and np.isfinite(images).all()
    assert median < TARGET_SECONDS
