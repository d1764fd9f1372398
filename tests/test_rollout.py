"""stepfast.rollout's bookkeeping: every sample's noise from its own keys, and the clean estimates of a
whole trajectory state by state."""

import pytest
import torch

from stepfast import sde
from stepfast.rollout import estimate_clean_images, sample_noise, sample_trajectory, trajectory_estimates

SHAPE = (2, 4, 4)


@pytest.mark.parametrize("same_latent", [True, False])
def test_each_samples_noise_depends_on_its_own_keys_only(same_latent):
    """(seed, iteration, group, member) decide a sample's noise, whatever else is in the batch (how
    ranks split the work); shared initial noise within a group when asked, never shared step noise,
    and no step noise equal to an initial one."""
    groups, members = [0, 0, 0, 5, 5, 5], [0, 1, 2, 0, 1, 2]
    x_init, noise = sample_noise(3, 7, groups, members, SHAPE, steps=4, same_latent=same_latent)
    assert x_init.shape == (6, *SHAPE) and noise.shape == (4, 6, *SHAPE)
    part_init, part_noise = sample_noise(3, 7, [5, 0], [1, 2], SHAPE, steps=4, same_latent=same_latent)
    assert torch.equal(part_init, x_init[[4, 2]]) and torch.equal(part_noise, noise[:, [4, 2]])
    assert torch.equal(x_init[0], x_init[1]) == same_latent and torch.equal(x_init[3], x_init[5]) == same_latent
    assert not torch.equal(x_init[0], x_init[3])  # groups never share
    for i in range(6):
        assert not any(torch.equal(noise[j, i], x_init[k]) for j in range(4) for k in range(6))
        for k in range(i + 1, 6):
            assert not torch.equal(noise[:, i], noise[:, k])
    for other in [(4, 7), (3, 8)]:  # another seed, another iteration
        assert not torch.equal(sample_noise(*other, groups, members, SHAPE, 4, same_latent)[1], noise)


def test_trajectory_estimates_are_each_states_own_estimate_then_the_final_sample():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def velocity(x, t):
        return net(torch.cat([x, t[:, None].to(x.dtype)], dim=1))

    grid = sde.sd3_time_grid(5)
    x_init = torch.randn(3, 2)
    traj = sample_trajectory(velocity, x_init, grid, "ddim", generator=torch.Generator().manual_seed(1), eta=1.0)
    images = trajectory_estimates(velocity, traj, substeps=3)
    assert images.shape == (6, 3, 2)
    for j in range(5):
        one = estimate_clean_images(velocity, traj.states[j], grid[j].expand(3), 3)  # no reused velocity
        torch.testing.assert_close(images[j], one, rtol=1e-5, atol=1e-6, msg=f"state {j}")
    assert torch.equal(images[-1], traj.states[-1])
