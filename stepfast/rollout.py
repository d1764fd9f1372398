"""Trajectories and their clean-image estimates, for any velocity model.

A velocity model is a callable `velocity(x, t) -> v` with x [B, ...] and per-sample times t [B]. The
trainer wraps a diffusers transformer (with its prompt embeddings and CFG) into one; tests use small
MLPs. Nothing here knows about prompts, rewards or the optimiser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import sde
from .kernels import sde_step_with_logprob

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Trajectory:
    """T steps of a sampler from the times grid[0] > ... > grid[T] for a batch of B samples.

    states[j] is x at grid[j] (states[0] the initial noise, states[T] the final sample);
    velocities[j] the model's velocity at states[j]; log_probs[j] the log-probability of the
    transition states[j] -> states[j + 1] under the sampling policy (0 where the step is not
    trained); trained[j] whether step j is trained: stochastic, and among the first
    int(timestep_fraction * T) steps (a later stochastic step is sampled but carries no log-prob).
    """

    states: torch.Tensor  # [T + 1, B, ...]
    velocities: torch.Tensor  # [T, B, ...]
    log_probs: torch.Tensor  # [T, B] (or [T, B, tokens])
    grid: torch.Tensor  # [T + 1]
    trained: torch.Tensor  # [T] bool

    @property
    def num_steps(self) -> int:
        return self.velocities.shape[0]


@torch.no_grad()
def sample_trajectory(
    velocity: Velocity,
    x_init: torch.Tensor,
    grid: torch.Tensor,
    kind: str = "ddim",
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    sde_window: tuple[int, int] | None = None,
    convention: str = "gaussian",
    reduce: str = "mean",
    patch_size: int | None = None,
    min_std: float = sde.DEGENERATE_STD,
    timestep_fraction: float = 1.0,
    **params,
) -> Trajectory:
    """Run the sampler from x_init along `grid`, keeping every state, velocity and old log-prob.

    noise: optional [T, B, ...] step noises (otherwise drawn from `generator`). sde_window=(a, b):
    only steps a <= j < b use `kind`; the others are ODE steps (Flow-GRPO's fast presets). Steps with
    std below `min_std` are deterministic: they carry no log-probability and are not trained. Only
    the first int(timestep_fraction * T) steps are trained; a later step is still the sampler's, and
    carries no log-probability either (Flow-GRPO's train.timestep_fraction).
    """
    grid = torch.as_tensor(grid, dtype=torch.float32)
    steps = grid.numel() - 1
    stochastic = sde.stochastic_steps(kind, grid, sde_window, min_std, **params)
    trained = sde.trained_steps(kind, grid, sde_window, min_std, timestep_fraction, **params)
    x = x_init.float()
    b = x.shape[0]
    states, velocities, log_probs = [x], [], []
    for j in range(steps):
        t, s = grid[j].expand(b), grid[j + 1].expand(b)  # on the host: see below
        v = velocity(x, t.to(x.device)).float()
        if stochastic[j]:
            # the fused op: the sample and its log-prob in one pass, the log-prob bit for bit what the
            # update's sde_logprob recomputes from the stored sample (the ratio starts at exactly 1); the
            # times from the host grid, whose coefficient table the op caches without reading a GPU back
            sample, lp = sde_step_with_logprob(kind, x, v, t, s, None if noise is None else noise[j],
                                               convention=convention, reduce=reduce, patch_size=patch_size,
                                               generator=generator, **params)  # fmt: skip
            if not trained[j]:
                lp = torch.zeros_like(lp)
        else:  # ODE outside the window and where the std is under min_std: an untrained step adds no noise
            sample = sde.step("ode", x, v, t.to(x.device), s.to(x.device)).sample
            lp = torch.zeros(sde.log_prob_shape(x, reduce, patch_size), device=x.device)
        x = sample
        states.append(x)
        velocities.append(v)
        log_probs.append(lp)
    return Trajectory(
        states=torch.stack(states),
        velocities=torch.stack(velocities),
        log_probs=torch.stack(log_probs),
        grid=grid,
        trained=trained,
    )


@torch.no_grad()
def estimate_clean_images(
    velocity: Velocity,
    states: torch.Tensor,
    t: torch.Tensor,
    substeps: int,
    first_velocity: torch.Tensor | None = None,
) -> torch.Tensor:
    """Clean estimates x0_hat of states [M, ...] at per-sample times t [M] by `substeps` Euler (ODE)
    substeps from t to 0, all M states as ONE batch per substep.

    Substep i goes from t (1 - i / T') to t (1 - (i + 1) / T'). substeps = 1 is the one-step Tweedie
    estimate x_t - t v. The first substep reuses `first_velocity` (the rollout's velocity at the
    same state and time) when given, so T' substeps cost T' - 1 forward passes.
    """
    if substeps < 1:
        raise ValueError(f"substeps must be >= 1, got {substeps}")
    x = states.float()
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device).reshape(-1)
    for i in range(substeps):
        t_i = t * (1 - i / substeps)
        t_next = t * (1 - (i + 1) / substeps)
        v = first_velocity if (i == 0 and first_velocity is not None) else velocity(x, t_i)
        x = sde.step("ode", x, v, t_i, t_next).sample
    return x


def trajectory_estimates(velocity: Velocity, traj: Trajectory, substeps: int) -> torch.Tensor:
    """Clean estimates of every intermediate state of a trajectory, plus its final sample:
    [T + 1, B, ...] in sampling order (column 0: the estimate at the initial noise; column T: the
    final sample), the images whose rewards feed `stepfast.credit.compute_advantages`."""
    steps, b = traj.num_steps, traj.states.shape[1]
    shape = traj.states.shape[2:]
    t = traj.grid[:-1].to(traj.states.device).repeat_interleave(b)
    est = estimate_clean_images(
        velocity,
        traj.states[:-1].reshape(steps * b, *shape),
        t,
        substeps,
        first_velocity=traj.velocities.reshape(steps * b, *shape),
    )
    return torch.cat([est.reshape(steps, b, *shape), traj.states[-1:]], dim=0)


def _seed(*keys: int) -> int:
    """A 63-bit seed from integer keys (stable across processes, unlike hash())."""
    import hashlib

    digest = hashlib.blake2b("/".join(str(int(k)) for k in keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sample_noise(
    seed: int, iteration: int, groups: list[int], members: list[int], shape: tuple[int, ...], steps: int,
    same_latent: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(initial noise [B, *shape], step noises [T, B, *shape]) on the CPU, float32.

    Each sample's noise is a function of (seed, iteration, group, member) only, never of the rank or
    of how samples are split into micro-batches, so results do not depend on the number of ranks.
    With same_latent every member of a group starts from the group's noise.
    """
    init, step_noise = [], []
    for g, n in zip(groups, members):
        gen = torch.Generator().manual_seed(_seed(seed, iteration, g, -1 if same_latent else n, 0))
        init.append(torch.randn(shape, generator=gen))
        gen = torch.Generator().manual_seed(_seed(seed, iteration, g, n, 1))
        step_noise.append(torch.randn((steps, *shape), generator=gen))
    return torch.stack(init), torch.stack(step_noise, dim=1)
