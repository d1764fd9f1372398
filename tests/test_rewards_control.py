"""The `random` control reward: a score that depends on (seed, prompt, pixels) and nothing else."""

import numpy as np
import pytest
import torch
from PIL import Image

from stepfast import rewards
from stepfast.rewards.control import RandomReward


def _images(n, seed=0, size=8):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_an_image_scores_the_same_in_any_batch_order_and_company():
    reward = rewards.load("random")
    images, prompts = _images(6), [f"prompt {i % 2}" for i in range(6)]
    whole = reward.score(images, prompts)["score"]
    order = [5, 2, 0, 4, 1, 3]
    shuffled = reward.score(images[order], [prompts[i] for i in order])["score"]
    torch.testing.assert_close(shuffled, whole[order], rtol=0, atol=0)
    # one image at a time, as a rank holding part of the batch scores it
    alone = torch.cat([reward.score(images[i : i + 1], prompts[i : i + 1])["score"] for i in range(6)])
    torch.testing.assert_close(alone, whole, rtol=0, atol=0)
    # a fresh instance (a resumed run) gives the same scores
    torch.testing.assert_close(RandomReward().score(images, prompts)["score"], whole, rtol=0, atol=0)


def test_the_score_reads_the_pixels_whatever_form_they_come_in():
    reward = RandomReward(seed=3)
    floats = _images(3)
    pixels = (floats.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    expected = reward.score(pixels, ["a"] * 3)["score"]
    torch.testing.assert_close(reward.score(floats, ["a"] * 3)["score"], expected, rtol=0, atol=0)
    torch.testing.assert_close(reward.score(floats * 2 - 1, ["a"] * 3)["score"], expected, rtol=0, atol=0)
    pil = [Image.fromarray(p) for p in pixels]
    torch.testing.assert_close(reward.score(pil, ["a"] * 3)["score"], expected, rtol=0, atol=0)


def test_one_pixel_level_the_prompt_or_the_seed_changes_the_score():
    pixels = np.zeros((1, 8, 8, 3), dtype=np.uint8)
    nudged = pixels.copy()
    nudged[0, 7, 2, 1] = 1
    reward = RandomReward()
    base = reward.score(pixels, ["a circle"])["score"].item()
    assert reward.score(nudged, ["a circle"])["score"].item() != base
    assert reward.score(pixels, ["a square"])["score"].item() != base
    assert RandomReward(seed=1).score(pixels, ["a circle"])["score"].item() != base
    # the same bytes in another shape are another image
    assert reward.score(np.zeros((1, 4, 16, 3), dtype=np.uint8), ["a circle"])["score"].item() != base


def test_scores_are_uniform_on_the_unit_interval():
    # 4,000 one-pixel images, every one distinct: a uniform sample has mean 0.5 (sd of the mean 0.0046)
    # and a quarter of its values in each quarter of [0, 1) (sd 0.0068 each)
    levels = np.arange(4000)
    pixels = np.stack([levels % 256, (levels // 256) % 256, np.zeros_like(levels)], axis=1).astype(np.uint8)
    scores = RandomReward().score(pixels.reshape(4000, 1, 1, 3), ["x"] * 4000)["score"]
    assert scores.dtype == torch.float32
    assert scores.min() >= 0 and scores.max() < 1
    assert abs(scores.mean().item() - 0.5) < 0.02
    quarters = torch.histc(scores, bins=4, min=0, max=1) / 4000
    assert torch.all((quarters - 0.25).abs() < 0.03), quarters
    assert len(set(scores.tolist())) > 3990  # 24 bits: a handful of ties at most


def test_bad_options_and_mismatched_batches_are_named():
    with pytest.raises(ValueError, match="reward 'random': option seed must be a whole number, got 1.5"):
        rewards.load("random", seed=1.5)
    with pytest.raises(ValueError, match="random: seed must be a whole number, got True"):
        RandomReward(seed=True)
    assert rewards.load("random", seed=2.0).seed == 2  # a whole number written as a float, as config keys take it
    with pytest.raises(ValueError, match="random: got 2 images but 3 prompts"):
        RandomReward().score(_images(2), ["a", "b", "c"])


def test_it_combines_with_others_as_the_trainer_builds_it():
    weighted = rewards.load_weighted({"random": 1.0, "shapes": 0.0}, {"random": {"seed": 4}})
    pixels = np.zeros((2, 16, 16, 3), dtype=np.uint8)
    out = weighted.score(pixels, ["a photo of a circle"] * 2)
    torch.testing.assert_close(out["score"], RandomReward(seed=4).score(pixels, ["a photo of a circle"] * 2)["score"])
