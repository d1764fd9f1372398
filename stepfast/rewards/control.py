"""`random`: a control reward that ignores what an image shows.

Each image's score is uniform in [0, 1), drawn from a hash of (seed, prompt, the image's pixels as
uint8): the same image and prompt always score the same, whatever the batch, its order, the rank
that scores it or whether the run was resumed, while two images that differ by one pixel level get
unrelated scores. Trained on it, GRPO's policy gradient has mean zero, so the update is a random walk
of the weights: run it beside a real run (same settings and seed, `reward.weights={random: 1.0}`,
the held-out evaluation still on the real reward, `eval.reward`) to see how far a held-out metric
moves with no signal at all before crediting a gain to the reward.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from stepfast.rewards.images import to_uint8

_BITS = 24  # bits of the hash kept: every such value a float32 holds exactly, all below 1


class RandomReward:
    """score: uniform in [0, 1), a function of (seed, prompt, pixels) only."""

    def __init__(self, seed: int = 0):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"random: seed must be a whole number, got {seed!r}")
        self.seed = seed

    def score(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        pixels = to_uint8(images)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if len(prompts) != len(pixels):
            raise ValueError(f"random: got {len(pixels)} images but {len(prompts)} prompts")
        scores = np.empty(len(pixels), dtype=np.float32)
        for i, (image, prompt) in enumerate(zip(pixels, prompts)):
            digest = hashlib.blake2b(digest_size=8)
            for part in (str(self.seed).encode(), str(prompt).encode(), repr(image.shape).encode()):
                digest.update(part)
                digest.update(b"\0")
            digest.update(np.ascontiguousarray(image).tobytes())
            scores[i] = (int.from_bytes(digest.digest(), "little") >> (64 - _BITS)) / 2**_BITS
        return {"score": torch.from_numpy(scores)}
