"""End to end, without diffusers: GRPO on a small MLP velocity model of a 2-D Gaussian mixture.

The model is pretrained in seconds by rectified flow on two modes at x = -2 and x = +2; the reward
prefers the right mode. GRPO with the DDIM sampler, shared initial noise per group, T = 10 steps and
T' = 3 ODE substeps for the clean estimates must raise the mean reward of ODE samples drawn from
held-out noise, with `stepwise` credit and with `flow_grpo` credit alike.
"""

import time

import pytest
import torch
from torch import nn

from stepfast import credit, sde
from stepfast.kernels import sde_logprob
from stepfast.loss import grpo_step_loss
from stepfast.rollout import sample_trajectory, trajectory_estimates

MODES = torch.tensor([[-2.0, 0.0], [2.0, 0.0]])


class VelocityMLP(nn.Module):
    def __init__(self, width=128):
        super().__init__()
        self.freqs = torch.arange(1, 5, dtype=torch.float32) * torch.pi
        self.net = nn.Sequential(
            nn.Linear(2 + 8, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, 2)
        )

    def forward(self, x, t):
        t = t.reshape(-1, 1)
        emb = torch.cat([torch.sin(t * self.freqs), torch.cos(t * self.freqs)], dim=1)
        return self.net(torch.cat([x, emb], dim=1))


def sample_data(n, g):
    idx = torch.randint(0, 2, (n,), generator=g)
    return MODES[idx] + 0.35 * torch.randn(n, 2, generator=g)


def reward(x):
    """Smooth preference for the right mode."""
    return torch.sigmoid(2.0 * x[..., 0])


def pretrain(seed=0, steps=800):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = VelocityMLP()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    for _ in range(steps):
        x0 = sample_data(256, g)
        x1 = torch.randn(256, 2, generator=g)
        t = torch.rand(256, generator=g)
        xt = (1 - t[:, None]) * x0 + t[:, None] * x1
        loss = ((model(xt, t) - (x1 - x0)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@torch.no_grad()
def ode_reward(model, noise, grid):
    x = noise
    for j in range(len(grid) - 1):
        t = grid[j].expand(x.shape[0])
        x = sde.step("ode", x, model(x, t), grid[j], grid[j + 1]).sample
    return reward(x).mean().item()


def grpo(model, estimator, iterations=120, groups=8, members=8, substeps=3, seed=1):
    """A compact GRPO loop on the library's pieces: rollout, estimates, credit, PPO-clip loss."""
    grid = sde.sd3_time_grid(10)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(iterations):
        x_init = torch.randn(groups, 1, 2, generator=g).expand(groups, members, 2).reshape(-1, 2)
        traj = sample_trajectory(model, x_init, grid, "ddim", generator=g, eta=1.0)
        images = trajectory_estimates(model, traj, substeps)  # [T + 1, B, 2]
        rewards = reward(images).T.reshape(groups, members, -1)  # [G, N, T + 1]
        adv = credit.compute_advantages(estimator, rewards).reshape(groups * members, -1)
        opt.zero_grad()
        trained = traj.trained.nonzero().flatten().tolist()
        for j in trained:
            t = traj.grid[j].expand(x_init.shape[0])
            s = traj.grid[j + 1].expand(x_init.shape[0])
            v = model(traj.states[j], t)
            logp = sde_logprob("ddim", traj.states[j], v, t, s, traj.states[j + 1], eta=1.0).log_prob
            step_loss = grpo_step_loss(logp, traj.log_probs[j], adv[:, j], clip_range=0.2)
            assert step_loss.ratio_mean.item() == 1.0  # on-policy: the rollout's op, recomputed exactly
            (step_loss.loss / len(trained)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model


@pytest.fixture
def one_thread():
    """The tensors are tiny: intra-op threads only add overhead (and thrash on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("estimator", ["stepwise", "flow_grpo"])
def test_grpo_raises_reward_on_held_out_noise(estimator, one_thread):
    start = time.perf_counter()
    model = pretrain()
    grid = sde.sd3_time_grid(10)
    held_out = torch.randn(2048, 2, generator=torch.Generator().manual_seed(12345))
    before = ode_reward(model, held_out, grid)
    assert 0.35 < before < 0.65  # the pretrained model covers both modes
    grpo(model, estimator)
    after = ode_reward(model, held_out, grid)
    elapsed = time.perf_counter() - start
    print(f"\n{estimator}: mean reward {before:.3f} -> {after:.3f} in {elapsed:.1f} s")
    assert after > before + 0.1
