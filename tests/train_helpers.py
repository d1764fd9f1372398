"""Rewards for trainer tests, importable by path ("train_helpers:brightness") from subprocesses."""

import torch

from stepfast.rewards.images import to_uint8


def brightness(images, prompts, metadata=None):
    """A smooth reward any random model gets signal from: mean brightness of the image. Float
    images are read as they are (no rounding to 8 bits, which would turn last-bit differences
    between runs into whole quantisation steps)."""
    if isinstance(images, torch.Tensor) and images.is_floating_point():
        return {"score": images.float().mean(dim=(1, 2, 3))}
    return {"score": torch.as_tensor(to_uint8(images), dtype=torch.float32).mean(dim=(1, 2, 3)) / 255}


def nan_reward(images, prompts, metadata=None):
    score = brightness(images, prompts)["score"]
    score[len(score) // 2] = float("nan")
    return {"score": score}


def brightness_eval(images, prompts, metadata=None):
    """`brightness` with a pass/fail, for the held-out evaluation (which reports both)."""
    score = brightness(images, prompts)["score"]
    return {"score": score, "strict": (score > 0.5).float()}


class ScaledBrightness:
    """A reward that needs an option, and reports no "strict" (as PickScore)."""

    def __init__(self, scale: float):
        self.scale = scale

    def score(self, images, prompts, metadata=None):
        return {"score": self.scale * brightness(images, prompts)["score"]}



def fails_on_rank_1_once_there(images, prompts, metadata=None):
    """A reward that breaks on one rank only (a bug in a user's reward), once the file that
    $STEPFAST_TEST_FAIL_ONCE names exists (a checkpoint's COMPLETE marker, say): the other rank finds
    it gone at its next collective."""
    import os
    from pathlib import Path

    if os.environ.get("RANK") == "1" and Path(os.environ["STEPFAST_TEST_FAIL_ONCE"]).exists():
        raise RuntimeError("the reward broke on rank 1")
    return brightness(images, prompts)
