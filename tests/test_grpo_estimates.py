"""grpo.estimate_images: one batch of clean estimates per substep, each distinct state estimated once."""

import pytest
import torch

from stepfast import grpo
from stepfast.config import load_config
from stepfast.models import load_pipeline
from stepfast.models.tiny import tiny_pipeline_dir
from stepfast.policy import encode_prompts, latent_shape
from stepfast.rollout import sample_noise
from stepfast.sde import sd3_time_grid


def test_distinct_rows_keeps_the_first_of_each_set_in_order():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 2, 3, generator=g)
    t = torch.tensor([0.9, 0.5, 0.9, 0.5, 0.9, 0.9])
    prompt = torch.tensor([0, 0, 0, 1, 0, 1])
    rows[2], rows[4] = rows[0], rows[0]  # rows 2 and 4 are row 0: the same state, time and prompt
    rows[5] = rows[0]  # the same state and time, another prompt
    rows[3] = rows[1]  # the same state and time, another prompt
    keep, inverse = grpo.distinct_rows(rows, t, prompt)
    assert keep.tolist() == [0, 1, 3, 5]
    assert inverse.tolist() == [0, 1, 0, 2, 0, 3]
    assert torch.equal(rows[keep][inverse], rows) and torch.equal(t[keep][inverse], t)
    assert torch.equal(prompt[keep][inverse], prompt)
    t[2] = 0.5  # another time: its own set
    assert grpo.distinct_rows(rows, t, prompt)[0].tolist() == [0, 1, 2, 3, 5]


class CountingEstimator:
    """grpo.Estimator, recording how many states each call estimated."""

    def __init__(self, estimator):
        self.estimator, self.rows = estimator, []

    def __call__(self, cond, states, t, substeps, first_velocity=None):
        self.rows.append(states.shape[0])
        return self.estimator(cond, states, t, substeps, first_velocity)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """A default-preset rollout of 2 groups of 4 on a tiny model: ddim, shared initial noise."""
    torch.manual_seed(0)
    model = tiny_pipeline_dir(tmp_path_factory.mktemp("tiny"), seed=0)
    cfg = load_config("default", [f"model.path={model}", "sde.steps=5", "rollout.groups=2", "rollout.group_size=4",
                                  "rollout.micro_batch=8", "rollout.substeps=2", "rollout.cfg=2.0"])  # fmt: skip
    pipe = load_pipeline(model)
    texts = ["a photo of a red circle"] * 4 + ["a photo of two squares"] * 4
    cond = encode_prompts(pipe, texts, cfg.rollout.cfg, torch.device("cpu"))
    shape = latent_shape(pipe, 1, pipe.default_sample_size * pipe.vae_scale_factor)[1:]
    grid = sd3_time_grid(cfg.sde.steps, shift=3.0)

    def run(same_latent: bool):
        groups, members = [0] * 4 + [1] * 4, list(range(4)) * 2
        x_init, noise = sample_noise(cfg.seed, 1, groups, members, shape, cfg.sde.steps, same_latent)
        return grpo.rollout(pipe.transformer, cond, x_init, noise, grid, cfg)

    return cfg, pipe, cond, run


def test_shared_states_are_estimated_once_and_give_every_member_the_same_image(rollout):
    cfg, pipe, cond, run = rollout
    traj = run(same_latent=True)
    # ddim's first step is deterministic: members of a group share states 0 and 1, and no other
    assert all(torch.equal(traj.states[j, g * 4], traj.states[j, g * 4 + n]) for j in (0, 1) for g in (0, 1)
               for n in range(4))  # fmt: skip
    assert not torch.equal(traj.states[2, 0], traj.states[2, 1])
    counting = CountingEstimator(grpo.Estimator(pipe.transformer, cfg.rollout.cfg, use_cuda_graph=False))
    images = grpo.estimate_images(pipe, counting, cond, traj, cfg)
    every = grpo.estimate_images(pipe, counting, cond, traj, cfg, distinct=False)
    assert counting.rows == [5 * 8 - 2 * 2 * 3, 5 * 8]  # 2 shared states x 2 groups, 3 members each spared
    assert images.shape == every.shape == (5, 8, 3, *images.shape[-2:])
    torch.testing.assert_close(images, every, rtol=0, atol=1e-5)
    for j in (0, 1):
        for g in (0, 1):
            assert all(torch.equal(images[j, g * 4], images[j, g * 4 + n]) for n in range(4))


def test_without_shared_noise_every_state_is_estimated(rollout):
    cfg, pipe, cond, run = rollout
    cfg = load_config("default", [f"model.path={cfg.model.path}", "sde.steps=5", "rollout.groups=2",
                                  "rollout.group_size=4", "rollout.micro_batch=8", "rollout.substeps=2",
                                  "rollout.cfg=2.0", "rollout.same_latent=false"])  # fmt: skip
    counting = CountingEstimator(grpo.Estimator(pipe.transformer, cfg.rollout.cfg, use_cuda_graph=False))
    grpo.estimate_images(pipe, counting, cond, run(same_latent=False), cfg)
    assert counting.rows == [5 * 8]
