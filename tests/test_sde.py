"""Samplers against diffusers and against their own formulas; log-probabilities against torch."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from stepfast import sde


def linear_velocity(seed=0, channels=4):
    """A fixed, time-dependent velocity field standing in for a network."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(channels, channels, generator=g) / channels**0.5

    def velocity(x, t):
        t = torch.as_tensor(t, dtype=x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
        return torch.einsum("ij,bj...->bi...", w.to(x.dtype), x) * (1 + t) - 0.3 * t
    return velocity


def test_time_grid_matches_diffusers():
    for steps in (1, 10, 28, 40):
        sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
        sched.set_timesteps(steps)
        assert torch.equal(sde.sd3_time_grid(steps, shift=3.0), sched.sigmas)
    rounded = [round(x, 2) for x in sde.sd3_time_grid(10).tolist()]
    assert rounded == [1.0, 0.96, 0.91, 0.86, 0.79, 0.71, 0.6, 0.46, 0.28, 0.01, 0.0]


def test_ode_reproduces_diffusers_euler_over_a_shifted_trajectory():
    velocity = linear_velocity()
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(10)
    grid = sde.sd3_time_grid(10)
    x0 = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    ours, theirs = x0.clone(), x0.clone()
    for j, timestep in enumerate(sched.timesteps):
        ours = sde.step("ode", ours, velocity(ours, grid[j]), grid[j].item(), grid[j + 1].item()).sample
        theirs = sched.step(velocity(theirs, sched.sigmas[j]), timestep, theirs).prev_sample
        assert (ours - theirs).abs().max() < 1e-6, f"step {j}"
    assert ours.abs().max() > 0.1  # the trajectory went somewhere


@pytest.mark.parametrize("kind, params", [("cps", {"noise_level": 0.0}), ("ddim", {"eta": 0.0})])
def test_zero_noise_equals_ode(kind, params):
    velocity = linear_velocity()
    grid = sde.sd3_time_grid(10)
    x = x_ode = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(2))
    for j in range(10):
        t, s = grid[j].item(), grid[j + 1].item()
        out = sde.step(kind, x, velocity(x, t), t, s, generator=torch.Generator().manual_seed(j), **params)
        assert torch.all(out.std == 0)
        x = out.sample
        x_ode = sde.step("ode", x_ode, velocity(x_ode, t), t, s).sample
        assert (x - x_ode).abs().max() < 1e-6


def test_step_formulas_by_hand():
    x = torch.tensor([[0.5, -1.0]])
    v = torch.tensor([[2.0, 0.25]])
    t, s, a = 0.6, 0.46, 0.7
    x0_hat, x1_hat = x - t * v, x + (1 - t) * v
    # flow_sde
    sig = a * math.sqrt(t / (1 - t))
    out = sde.step("flow_sde", x, v, t, s, noise=torch.zeros_like(x), noise_level=a)
    mean = x + (s - t) * (v + sig**2 / (2 * t) * (x + (1 - t) * v))
    assert torch.allclose(out.mean, mean, atol=1e-6) and torch.equal(out.sample, out.mean)
    assert out.std.item() == pytest.approx(sig * math.sqrt(t - s), rel=1e-6)
    # cps
    out = sde.step("cps", x, v, t, s, noise=torch.ones_like(x), noise_level=a)
    std = s * math.sin(a * math.pi / 2)
    mean = (1 - s) * x0_hat + math.sqrt(s**2 - std**2) * x1_hat
    assert out.std.item() == pytest.approx(std, rel=1e-6)
    assert torch.allclose(out.sample, mean + std, atol=1e-6)
    # ddim
    out = sde.step("ddim", x, v, t, s, noise=torch.ones_like(x), eta=0.8)
    std = 0.8 * s * math.sqrt(1 - t)
    mean = (1 - s) * x0_hat + math.sqrt(s**2 - std**2) * x1_hat
    assert out.std.item() == pytest.approx(std, rel=1e-6)
    assert torch.allclose(out.mean, mean, atol=1e-6)


def test_flow_sde_at_t_one_uses_next_grid_point():
    grid = sde.sd3_time_grid(10)
    t, s = grid[0], grid[1]
    std = sde.step_std("flow_sde", t, s)
    assert torch.isfinite(std)
    assert std.item() == pytest.approx(0.7 * math.sqrt(1 / (1 - s.item())) * math.sqrt(1 - s.item()), rel=1e-5)


def test_per_sample_times_equal_scalar_times():
    velocity = linear_velocity()
    grid = sde.sd3_time_grid(10)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 5, 5, generator=gen)
    noise = torch.randn(x.shape, generator=gen)
    idx = torch.tensor([1, 4, 8])
    for kind in sde.SAMPLERS:
        batched = sde.step(kind, x, velocity(x, grid[idx]), grid[idx], grid[idx + 1], noise=noise)
        for b, j in enumerate(idx.tolist()):
            one = sde.step(kind, x[b:b + 1], velocity(x[b:b + 1], grid[j]), grid[j].item(), grid[j + 1].item(),
                           noise=noise[b:b + 1])
            assert torch.allclose(batched.sample[b:b + 1], one.sample, atol=1e-6), kind


def test_low_precision_inputs_are_computed_in_fp32():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 4, 4, generator=gen)
    v = torch.randn(2, 3, 4, 4, generator=gen)
    for kind in sde.SAMPLERS:
        ref = sde.step(kind, x.bfloat16().float(), v.bfloat16().float(), 0.6, 0.46, noise=torch.zeros_like(x))
        low = sde.step(kind, x.bfloat16(), v.bfloat16(), 0.6, 0.46, noise=torch.zeros_like(x))
        assert low.sample.dtype == torch.float32
        assert torch.equal(low.sample, ref.sample)


def test_step_errors_are_clear():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown sampler 'euler'"):
        sde.step("euler", x, x, 0.5, 0.4)
    with pytest.raises(TypeError, match="'ddim' takes parameters \\['eta'\\]"):
        sde.step("ddim", x, x, 0.5, 0.4, noise_level=0.3)
    with pytest.raises(ValueError, match="shape \\[batch\\] = \\[2\\]"):
        sde.step("ode", x, x, torch.ones(3), 0.4)


def test_log_prob_gaussian_matches_torch_normal():
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 4, 6, 8, generator=g)
    std = torch.rand(3, 1, 1, 1, generator=g) + 0.1
    sample = mean + std * torch.randn(mean.shape, generator=g)
    ref = torch.distributions.Normal(mean.double(), std.double()).log_prob(sample.double())
    got = sde.log_prob(sample, mean, std, reduce="mean")
    assert torch.allclose(got.double(), ref.mean(dim=(1, 2, 3)), atol=1e-6)
    got = sde.log_prob(sample, mean, std, reduce="sum")
    assert torch.allclose(got.double(), ref.sum(dim=(1, 2, 3)), rtol=1e-6)
    tokens = sde.log_prob(sample, mean, std, reduce="tokens", patch_size=2)
    assert tokens.shape == (3, 3 * 4)
    # token (row 1, col 2) is the mean over channels of the 2x2 patch at rows 2-3, cols 4-5
    expect = ref[:, :, 2:4, 4:6].mean(dim=(1, 2, 3))
    assert torch.allclose(tokens[:, 1 * 4 + 2].double(), expect, atol=1e-6)
    assert torch.allclose(tokens.mean(dim=1).double(), ref.mean(dim=(1, 2, 3)), atol=1e-6)


def test_log_prob_cps_convention_and_errors():
    mean = torch.zeros(2, 3, 4, 4)
    sample = torch.full_like(mean, 0.5)
    assert torch.allclose(sde.log_prob(sample, mean, torch.tensor(0.3), convention="cps"), torch.full((2,), -0.25))
    with pytest.raises(ValueError, match="deterministic step"):
        sde.log_prob(sample, mean, torch.tensor(0.0))
    with pytest.raises(ValueError, match="patch_size"):
        sde.log_prob(sample, mean, torch.tensor(1.0), reduce="tokens")
    with pytest.raises(ValueError, match="not divisible"):
        sde.log_prob(sample, mean, torch.tensor(1.0), reduce="tokens", patch_size=3)


def test_degenerate_steps():
    grid = sde.sd3_time_grid(10)
    ddim = sde.degenerate_steps("ddim", grid).tolist()
    assert ddim[0] and ddim[-1] and not any(ddim[1:-1])  # std = 0 at t = 1 and at s = 0
    cps = sde.degenerate_steps("cps", grid).tolist()
    assert cps[-1] and not any(cps[:-1])
    assert all(sde.degenerate_steps("ode", grid).tolist())
    assert not any(sde.degenerate_steps("flow_sde", grid).tolist())
    # a threshold of 0 (sde.min_std=0) still leaves out the steps with no noise at all
    assert sde.degenerate_steps("ddim", grid, threshold=0.0).tolist() == ddim
    assert sde.degenerate_steps("cps", grid, threshold=0.0).tolist() == cps
    assert all(sde.degenerate_steps("ode", grid, threshold=0.0).tolist())


@pytest.mark.parametrize("kind", ["ddim", "cps"])
def test_a_rollout_with_min_std_zero_leaves_out_only_the_noiseless_steps(kind):
    """sde.min_std=0 is a valid setting: the steps of std 0 are ODE steps with no log-probability (it
    raised 'log_prob of a deterministic step'), every other step is trained."""
    from stepfast.rollout import sample_trajectory

    grid = sde.sd3_time_grid(10)
    g = torch.Generator().manual_seed(1)
    x_init, noise = torch.randn(3, 2, 5, generator=g), torch.randn(10, 3, 2, 5, generator=g)
    traj = sample_trajectory(lambda x, t: torch.cos(x) - t[:, None, None], x_init, grid, kind, noise=noise, min_std=0.0)
    stds = sde.step_std(kind, grid[:-1], grid[1:]).tolist()
    assert traj.trained.tolist() == [std > 0 for std in stds] and 0 < traj.trained.sum() < 10
    assert all(not traj.log_probs[j].any() for j in range(10) if not traj.trained[j])


def test_kl_sigma_drops_sqrt_dt_for_flow_sde_only():
    t, s = torch.tensor([0.6]), torch.tensor([0.46])
    assert torch.allclose(sde.kl_sigma("flow_sde", t, s) * torch.sqrt(t - s), sde.step_std("flow_sde", t, s))
    assert torch.allclose(sde.kl_sigma("ddim", t, s), sde.step_std("ddim", t, s))


@pytest.mark.parametrize("kind", ["ddim", "cps"])
def test_a_step_under_min_std_is_an_ode_step_in_the_rollout(kind):
    """sample_trajectory: a step inside the window whose std is under min_std is deterministic, as
    the method has it: the ODE step, not the sampler's step with its small noise (which no trained step
    could learn from, and which would spread a group's rewards). The other steps are the sampler's,
    drawn by the fused step op with their log-prob."""
    from stepfast.kernels import sde_step_with_logprob
    from stepfast.rollout import sample_trajectory

    grid = sde.sd3_time_grid(10)
    g = torch.Generator().manual_seed(0)
    x_init, noise = torch.randn(4, 3, 5, generator=g), torch.randn(10, 4, 3, 5, generator=g)

    def velocity(x, t):
        return torch.sin(3 * x) - x + t[:, None, None]

    params = {"eta": 1.0} if kind == "ddim" else {"noise_level": 0.7}
    stds = [float(sde.step_std(kind, grid[j], grid[j + 1], **params)) for j in range(10)]
    min_std = 0.05
    traj = sample_trajectory(velocity, x_init, grid, kind, noise=noise, min_std=min_std, **params)
    assert traj.trained.tolist() == [std >= min_std for std in stds]
    assert 0 < min(stds[j] for j in range(10) if not traj.trained[j] and stds[j] > 0) < min_std  # a small-noise step
    for j in range(10):
        t, s = grid[j].expand(4), grid[j + 1].expand(4)
        step_kind, step_params = (kind, params) if traj.trained[j] else ("ode", {})
        expected = sde.step(step_kind, traj.states[j], traj.velocities[j], t, s, noise=noise[j], **step_params)
        if traj.trained[j]:  # through the fused op (its own tests hold it to the float64 reference)
            torch.testing.assert_close(traj.states[j + 1], expected.sample, msg=f"step {j}")
            fused = sde_step_with_logprob(kind, traj.states[j], traj.velocities[j], t, s, noise[j], **params)
            assert torch.equal(traj.states[j + 1], fused.sample) and torch.equal(traj.log_probs[j], fused.log_prob)
        else:
            assert torch.equal(traj.states[j + 1], expected.sample), f"step {j}"


def test_steps_after_the_timestep_fraction_are_sampled_with_noise_but_not_trained():
    """Flow-GRPO's train.timestep_fraction = 0.99: the last of 10 flow_sde steps is drawn by the
    sampler as every other step is (the same states as training all of them), with no log-prob and
    not trained; an SDE window that ends before it makes it an ODE step instead (another final image)."""
    from stepfast.rollout import sample_trajectory

    grid = sde.sd3_time_grid(10)
    g = torch.Generator().manual_seed(0)
    x_init, noise = torch.randn(3, 4, 5, generator=g), torch.randn(10, 3, 4, 5, generator=g)

    def velocity(x, t):
        return torch.sin(3 * x) - x + t[:, None, None]

    def run(**kw):
        return sample_trajectory(velocity, x_init, grid, "flow_sde", noise=noise, noise_level=0.7, **kw)

    every, fraction, window = run(), run(timestep_fraction=0.99), run(sde_window=(0, 9))
    assert every.trained.tolist() == [True] * 10
    assert fraction.trained.tolist() == window.trained.tolist() == [True] * 9 + [False]
    assert torch.equal(fraction.states, every.states)
    assert torch.equal(fraction.log_probs[:9], every.log_probs[:9])
    assert bool((every.log_probs[9] != 0).all()) and bool((fraction.log_probs[9] == 0).all())
    assert torch.equal(window.states[:10], every.states[:10])
    ode = every.states[9] + (grid[10] - grid[9]) * every.velocities[9]
    torch.testing.assert_close(window.states[10], ode, rtol=0, atol=1e-6)
    assert (fraction.states[10] - ode).abs().max() > 1e-3
