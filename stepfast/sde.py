"""Samplers for flow-matching models: one denoising step of each, its log-probability, the time grid.

Conventions (diffusers SD3): time t in [0, 1], t = 1 is pure noise and t = 0 is data;
x_t = (1 - t) x0 + t x1 with x1 ~ N(0, I); the model predicts the velocity v ~ x1 - x0. One step
goes from t to s < t. From one velocity,

    x0_hat = x_t - t v              (clean estimate)
    x1_hat = x_t + (1 - t) v        (noise estimate)

Every sampler step is mean + std * noise, computed in float32 whatever the input dtype (Flow-GRPO
computes all sampler quantities in fp32: bf16 overflows in the mean). The fused kernels in
`stepfast.kernels` reproduce exactly these functions and are tested against them.

Where the samplers belong (measured with exact posterior velocities, see tests/test_marginals.py):
`ode`, `cps` and `ddim` keep the marginal N((1 - s) x0, s^2) exactly for point-mass data, and
`flow_sde` (noise level 0.7) inflates it. For Gaussian data, `ode` and `flow_sde` converge to the data
distribution as the number of steps grows, while `cps` and `ddim` inject O(1) fresh noise every step
and stay short of the data variance even at 400 steps: they are few-step RL samplers, not
general-purpose ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

SAMPLERS = ("ode", "flow_sde", "cps", "ddim")
LOGPROB_CONVENTIONS = ("gaussian", "cps")
REDUCTIONS = ("mean", "sum", "tokens")

#: Default noise parameters: Flow-GRPO's noise level a = 0.7 (flow_sde); CPS's reference value for
#: its angle (cps); eta = 1 for ddim (see DEFAULT_ETA).
DEFAULT_NOISE_LEVEL = {"flow_sde": 0.7, "cps": 0.7}
#: The sources do not state eta. eta = 1 makes std = s sqrt(1 - t), the largest value that keeps
#: std <= s (so sqrt(s^2 - std^2) stays real) at every step of any grid; on the held-out benchmark
#: it also did best of 0.5, 0.75 and 1 (docs/experiments.md).
DEFAULT_ETA = 1.0
#: A step whose std is below this carries no log-probability and no policy-gradient loss.
DEGENERATE_STD = 1e-4


@dataclass
class StepOutput:
    """One sampler step: `sample` = `mean` + `std` * noise. `std` broadcasts against `mean`."""

    sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def _check_kind(kind: str) -> None:
    if kind not in SAMPLERS:
        raise ValueError(f"unknown sampler {kind!r}: expected one of {', '.join(SAMPLERS)}")


def _as_time(t, x: torch.Tensor, name: str) -> torch.Tensor:
    """A time as float32 of shape [B, 1, ..., 1] (a float, a 0-dim tensor or a [B] tensor)."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    if t.dim() == 0:
        t = t.expand(x.shape[0])
    if t.dim() != 1 or t.shape[0] != x.shape[0]:
        raise ValueError(
            f"{name} must be a float or a tensor of shape [batch] = [{x.shape[0]}], got shape {tuple(t.shape)}"
        )
    return t.reshape(-1, *([1] * (x.dim() - 1)))


def sampler_params(kind: str, params: dict) -> dict:
    """The parameters of sampler `kind` as floats, with their defaults: {"noise_level"} for flow_sde
    and cps (cps's at most 1), {"eta"} for ddim (at most 1), none for ode. A TypeError names a
    parameter the sampler does not take, a ValueError one out of range."""
    allowed = {"ode": set(), "flow_sde": {"noise_level"}, "cps": {"noise_level"}, "ddim": {"eta"}}[kind]
    unknown = set(params) - allowed
    if unknown:
        raise TypeError(
            f"sampler {kind!r} takes parameters {sorted(allowed) or 'none'}, got {sorted(unknown)}"
        )
    out = {}
    if "noise_level" in allowed:
        # cps: std = s sin(a pi / 2) rises to s at a = 1 and falls again after it
        top = 1.0 if kind == "cps" else math.inf
        out["noise_level"] = _number(params.get("noise_level", DEFAULT_NOISE_LEVEL[kind]), "noise_level", top)
    if "eta" in allowed:  # std = eta s sqrt(1 - t) must not exceed s
        out["eta"] = _number(params.get("eta", DEFAULT_ETA), "eta", 1.0)
    return out


def _number(value, name: str, top: float) -> float:
    """`value` as a float in [0, top] (finite), or a ValueError naming the parameter."""
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not 0 <= number <= top or math.isinf(number):  # also NaN
        raise ValueError(f"{name} must be {f'in [0, {top:g}]' if top < math.inf else 'a finite number >= 0'}, "
                         f"got {number}")  # fmt: skip
    return number


def step_std(kind: str, t: torch.Tensor, s: torch.Tensor, **params) -> torch.Tensor:
    """The std of the step t -> s (float32, same shape as t).

    ode:      0
    flow_sde: sig sqrt(t - s),  sig = a sqrt(t / (1 - t))      (Flow-GRPO)
    cps:      s sin(a pi / 2)                                   (Coefficients-Preserving Sampling)
    ddim:     eta s sqrt(1 - t)                                 (Stepwise-Flow-GRPO)

    flow_sde at t = 1: the denominator 1 - t vanishes; Flow-GRPO then uses the second point of the
    grid in its place, which is the s of the first step: we use 1 - s there.
    """
    _check_kind(kind)
    p = sampler_params(kind, params)
    if kind == "ode":
        return torch.zeros_like(t)
    if kind == "flow_sde":
        return flow_sde_sigma(t, s, p["noise_level"]) * torch.sqrt(t - s)
    if kind == "cps":
        return s * math.sin(p["noise_level"] * math.pi / 2)
    return p["eta"] * s * torch.sqrt(1 - t)


def flow_sde_sigma(t: torch.Tensor, s: torch.Tensor, noise_level: float) -> torch.Tensor:
    """Flow-GRPO's diffusion coefficient sig = a sqrt(t / (1 - t)), with 1 - s for 1 - t at t = 1."""
    denom = 1 - torch.where(t >= 1, s, t)
    return noise_level * torch.sqrt(t / denom)


#: The error for a KL to the reference of a step with std = 0 (it divides by the step's sigma).
KL_OF_A_DETERMINISTIC_STEP = (
    "KL to the reference of a deterministic step (std = 0): it divides by the step's sigma, so it is "
    "undefined; such a step carries nothing to regularise (see stepfast.sde.degenerate_steps)"
)


def deterministic_step_error(std: torch.Tensor, t=None, s=None) -> str:
    """The error for a Gaussian log-probability of a step with std = 0, naming the samples (of
    per-sample times) whose std it is when not all of them, and where the times are given (per
    sample, as std) the step t -> s of the first."""
    zero = (std.reshape(-1) <= 0).nonzero().reshape(-1).tolist()
    step = ""
    if t is not None and s is not None and zero:
        step = f"t = {float(t.reshape(-1)[zero[0]]):.6g} -> s = {float(s.reshape(-1)[zero[0]]):.6g}"
    what = f"(std = 0{' at ' + step if step else ''})"
    if len(zero) < std.numel():
        shown = ", ".join(map(str, zero[:8])) + (", ..." if len(zero) > 8 else "")
        first = f" (the first at {step})" if step and len(zero) > 1 else f" ({step})" if step else ""
        what = f"(std = 0) at sample{'s' if len(zero) > 1 else ''} {shown} of {std.numel()}{first}"
    return (
        f"log_prob of a deterministic step {what}: such a step carries no log-probability "
        "(see stepfast.sde.degenerate_steps)"
    )


def kl_sigma(kind: str, t, s, **params) -> torch.Tensor:
    """The std that the KL penalty divides by: the step's std WITHOUT the sqrt(t - s) of flow_sde.

    Flow-GRPO's KL to the reference is mean_CHW (mu_theta - mu_ref)^2 / (2 sig^2) with sig its
    diffusion coefficient, not the step's std. For `cps` and `ddim` the std has no sqrt(dt) factor,
    so sig is the step's std itself. Returns float32 with the shape of t.
    """
    t = torch.as_tensor(t, dtype=torch.float32)
    s = torch.as_tensor(s, dtype=torch.float32, device=t.device)
    if kind == "flow_sde":
        return flow_sde_sigma(t, s, sampler_params(kind, params)["noise_level"])
    return step_std(kind, t, s, **params)


def step(
    kind: str,
    x_t: torch.Tensor,
    v: torch.Tensor,
    t,
    s,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    **params,
) -> StepOutput:
    """One step t -> s (s < t) of sampler `kind` from state x_t with velocity v.

    mean, by sampler:
        ode:       x_t + (s - t) v
        flow_sde:  x_t + (s - t) [v + sig^2 / (2 t) (x_t + (1 - t) v)]
        cps, ddim: (1 - s) x0_hat + sqrt(s^2 - std^2) x1_hat
    std: see `step_std`. sample = mean + std * noise, noise ~ N(0, I) drawn with `generator` when not
    given. With std = 0, `cps` and `ddim` reduce to `ode` exactly.

    t and s are floats or tensors of shape [B] (per-sample times). Everything is computed and returned
    in float32.
    """
    _check_kind(kind)
    if x_t.shape != v.shape:
        raise ValueError(f"x_t and v must have the same shape, got {tuple(x_t.shape)} and {tuple(v.shape)}")
    x = x_t.float()
    v = v.float()
    t = _as_time(t, x, "t")
    s = _as_time(s, x, "s")
    std = step_std(kind, t, s, **params)
    if kind == "ode":
        mean = x + (s - t) * v
    elif kind == "flow_sde":
        sig = flow_sde_sigma(t, s, sampler_params(kind, params)["noise_level"])
        mean = x + (s - t) * (v + sig**2 / (2 * t) * (x + (1 - t) * v))
    else:
        x0_hat = x - t * v
        x1_hat = x + (1 - t) * v
        mean = (1 - s) * x0_hat + torch.sqrt(torch.clamp(s**2 - std**2, min=0.0)) * x1_hat
    if kind == "ode":
        return StepOutput(sample=mean, mean=mean, std=std)
    if noise is None:
        noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    elif noise.shape != x.shape:
        raise ValueError(f"noise must have the shape of x_t {tuple(x.shape)}, got {tuple(noise.shape)}")
    return StepOutput(sample=mean + std * noise.float(), mean=mean, std=std)


def log_prob_shape(x: torch.Tensor, reduce: str, patch_size: int | None) -> tuple[int, ...]:
    """The shape of a step's log-probability for states x [B, C, H, W]: [B] for `mean` and `sum`,
    [B, (H / p) (W / p)] for `tokens` (one per DiT patch of side p = patch_size)."""
    if reduce == "tokens":
        return (x.shape[0], (x.shape[-2] // patch_size) * (x.shape[-1] // patch_size))
    return (x.shape[0],)


def log_prob(
    sample: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    convention: str = "gaussian",
    reduce: str = "mean",
    patch_size: int | None = None,
) -> torch.Tensor:
    """Log-probability of `sample` under the step's Gaussian N(mean, std^2), reduced per sample.

    convention:
        gaussian: -(x_s - mu)^2 / (2 std^2) - log std - log sqrt(2 pi)    (Flow-GRPO)
        cps:      -(x_s - mu)^2                                           (CPS's reference code)
    reduce:
        mean:   over all non-batch dims, one scalar per sample: [B] (Flow-GRPO; a sum was unstable)
        sum:    over all non-batch dims: [B]
        tokens: mean over the channels and each patch_size x patch_size spatial patch, in the DiT's
                row-major patch order: [B, (H / p) * (W / p)]
    In a PPO ratio the constants cancel, so both conventions give the same ratio up to the 1/(2 std^2)
    scale. A deterministic step (std = 0) has no log-probability: that is an error for `gaussian`.
    """
    if convention not in LOGPROB_CONVENTIONS:
        raise ValueError(f"unknown log-prob convention {convention!r}: expected one of {LOGPROB_CONVENTIONS}")
    if reduce not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduce!r}: expected one of {REDUCTIONS}")
    x = sample.float()
    mu = mean.float()
    sq = (x - mu) ** 2
    if convention == "gaussian":
        std = torch.as_tensor(std, dtype=torch.float32, device=x.device)
        if not torch.compiler.is_compiling() and bool((std <= 0).any()):  # a traced call cannot read it
            raise ValueError(deterministic_step_error(std))
        elem = -sq / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    else:
        elem = -sq
    if reduce == "mean":
        return per_sample(elem, torch.mean)
    if reduce == "sum":
        return per_sample(elem, torch.sum)
    return patch_mean(elem, patch_size)


def per_sample(x: torch.Tensor, reduction) -> torch.Tensor:
    """`reduction` (torch.mean, torch.sum) over every dimension but the first: [B, ...] -> [B]. A
    [B] tensor is its own per-sample value (an empty dim tuple would reduce over the batch too)."""
    return reduction(x, dim=tuple(range(1, x.dim()))) if x.dim() > 1 else x


def patch_mean(x: torch.Tensor, patch_size: int | None) -> torch.Tensor:
    """Mean of [B, C, H, W] over channels and p x p patches -> [B, (H / p) * (W / p)], row-major."""
    if patch_size is None or patch_size < 1:
        raise ValueError("reduce='tokens' needs patch_size, the DiT's patch size (2 for SD3)")
    if x.dim() != 4:
        raise ValueError(f"reduce='tokens' needs [B, C, H, W] latents, got shape {tuple(x.shape)}")
    b, c, h, w = x.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"latent size {h}x{w} is not divisible by patch_size {p}")
    x = x.reshape(b, c, h // p, p, w // p, p)
    return x.mean(dim=(1, 3, 5)).reshape(b, (h // p) * (w // p))


def sd3_time_grid(num_steps: int, shift: float = 3.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The N + 1 times (sigmas) of diffusers' FlowMatchEulerDiscreteScheduler for N steps, ending at 0.

    Static shift, as SD3/SD3.5 use it: t' = shift t / (1 + (shift - 1) t). diffusers shifts the
    training sigmas once to find sigma_min, spaces N times linearly between sigma_max and sigma_min,
    and shifts those again; we follow it exactly (float32, like diffusers). With N = 10 and shift 3:
    1.00, .96, .91, .86, .79, .71, .60, .46, .28, .01, 0.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")

    def shifted(sig):
        return shift * sig / (1 + (shift - 1) * sig)

    train = np.linspace(1, num_train_timesteps, num_train_timesteps, dtype=np.float32)[::-1].copy()
    train_sigmas = shifted(torch.from_numpy(train / num_train_timesteps))
    sigma_max, sigma_min = train_sigmas[0].item(), train_sigmas[-1].item()
    ts = np.linspace(sigma_max * num_train_timesteps, sigma_min * num_train_timesteps, num_steps)
    sigmas = shifted(ts / num_train_timesteps)
    sigmas = torch.from_numpy(sigmas).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1)])


def degenerate_steps(kind: str, grid: torch.Tensor, threshold: float = DEGENERATE_STD, **params) -> torch.Tensor:
    """Bool [N]: which steps grid[j] -> grid[j + 1] are deterministic (std below `threshold`, or 0
    whatever the threshold: a `threshold` of 0 leaves out only the steps with no noise at all).

    Such a step carries no log-probability and no policy-gradient loss; its reward gain still counts
    in the normalisation statistics of the credit estimators. Under `ddim`, std = 0 at t = 1 and
    std ~ 0 at s ~ 0; under `cps`, std = 0 at s = 0; every `ode` step is deterministic.
    """
    grid = torch.as_tensor(grid, dtype=torch.float32)
    std = step_std(kind, grid[:-1], grid[1:], **params)
    return (std < threshold) | (std <= 0)


def stochastic_steps(
    kind: str, grid: torch.Tensor, window: Sequence[int] | None = None, min_std: float = DEGENERATE_STD, **params
) -> torch.Tensor:
    """Bool [N]: which steps of `grid` are sampled with `kind`: those in the SDE window [a, b) (all
    steps when None) that are not degenerate (`degenerate_steps` with `min_std`). The others are ODE
    steps."""
    grid = torch.as_tensor(grid, dtype=torch.float32)
    steps = grid.numel() - 1
    if window is not None and not (len(window) == 2 and 0 <= window[0] < window[1]):
        raise ValueError(f"the SDE window must be [start, end) with 0 <= start < end, got {window}")
    in_window = torch.zeros(steps, dtype=torch.bool, device=grid.device)
    in_window[slice(*window) if window is not None else slice(None)] = True
    return in_window & ~degenerate_steps(kind, grid, threshold=min_std, **params)


def trained_steps(
    kind: str, grid: torch.Tensor, window: Sequence[int] | None = None, min_std: float = DEGENERATE_STD,
    timestep_fraction: float = 1.0, **params,
) -> torch.Tensor:
    """Bool [N]: which steps of `grid` are trained: the `stochastic_steps` among the first
    int(timestep_fraction * N) (Flow-GRPO's train.timestep_fraction, whose 0.99 leaves the last step
    sampled with noise but never trained)."""
    if not 0 < timestep_fraction <= 1:
        raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction}")
    stochastic = stochastic_steps(kind, grid, window, min_std, **params)
    first = torch.arange(stochastic.numel(), device=stochastic.device) < int(timestep_fraction * stochastic.numel())
    return stochastic & first
