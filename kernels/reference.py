"""The torch backend of the fused ops, built on `stepfast.sde` (the reference every kernel matches), and
the Flow-GRPO eager code the benchmarks time the kernels against.

Both are plain autograd code: the backward is whatever autograd makes of the forward.
"""

from __future__ import annotations

import math

import torch

from stepfast import sde
from stepfast.loss import kl_to_reference


def _mean(kind: str, x_t: torch.Tensor, v: torch.Tensor, t, s, **params) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the step, from `stepfast.sde.step` (a zero noise: no random draw)."""
    zero = torch.zeros((), dtype=torch.float32, device=x_t.device).expand(x_t.shape)
    out = sde.step(kind, x_t, v, t, s, noise=zero, **params)
    return out.mean, out.std


def sde_step_with_logprob(
    kind: str,
    x_t: torch.Tensor,
    v: torch.Tensor,
    t,
    s,
    noise: torch.Tensor | None,
    convention: str = "gaussian",
    reduce: str = "mean",
    patch_size: int | None = None,
    generator: torch.Generator | None = None,
    **params,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`stepfast.sde.step` then `stepfast.sde.log_prob`; an `ode` step has log-prob zeros."""
    out = sde.step(kind, x_t, v, t, s, noise=noise, generator=generator, **params)
    if kind == "ode":
        return out.sample, torch.zeros(sde.log_prob_shape(x_t, reduce, patch_size), device=x_t.device)
    return out.sample, sde.log_prob(out.sample, out.mean, out.std, convention, reduce, patch_size)


def sde_logprob(
    kind: str,
    x_t: torch.Tensor,
    v: torch.Tensor,
    t,
    s,
    sample: torch.Tensor,
    v_ref: torch.Tensor | None = None,
    convention: str = "gaussian",
    reduce: str = "mean",
    patch_size: int | None = None,
    **params,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log-prob of `sample` under the step from (x_t, v), and Flow-GRPO's KL to the reference
    (stepfast.loss) against v_ref."""
    mean, std = _mean(kind, x_t, v, t, s, **params)
    log_prob = sde.log_prob(sample, mean, std, convention, reduce, patch_size)
    if v_ref is None:
        return log_prob, None
    mean_ref, _ = _mean(kind, x_t, v_ref, t, s, **params)
    return log_prob, kl_to_reference(mean, mean_ref, sde.kl_sigma(kind, t, s, **params))


def flow_grpo_logprob(
    x_t: torch.Tensor,
    v: torch.Tensor,
    t: torch.Tensor,
    s: torch.Tensor,
    sample: torch.Tensor,
    v_ref: torch.Tensor | None = None,
    noise_level: float = 0.7,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Flow-GRPO's training-side log-prob of a `flow_sde` step, written the way Flow-GRPO writes it
    (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py and its train loop): float32 casts, the mean
    formula, the Gaussian log-prob per element, then a mean over C, H, W; KL likewise. The eager
    baseline of benchmarks/test_bench_kernels.py. t, s: float32 [B] (t < 1 here: the benchmark times
    an interior step)."""
    model_output = v.float()
    latents = x_t.float()
    prev_sample = sample.float()
    view = (-1, *([1] * (latents.dim() - 1)))
    sigma = t.view(view)
    sigma_prev = s.view(view)
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - sigma)) * noise_level
    prev_sample_mean = latents * (1 + std_dev_t**2 / (2 * sigma) * dt) + model_output * (
        1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)
    ) * dt
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    if v_ref is None:
        return log_prob, None
    ref_output = v_ref.float()
    prev_sample_mean_ref = latents * (1 + std_dev_t**2 / (2 * sigma) * dt) + ref_output * (
        1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)
    ) * dt
    kl = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=tuple(range(1, latents.ndim)), keepdim=True) / (
        2 * std_dev_t**2
    )
    return log_prob, kl.reshape(-1)


def flow_grpo_step_with_logprob(
    x_t: torch.Tensor, v: torch.Tensor, t: torch.Tensor, s: torch.Tensor, noise: torch.Tensor, noise_level: float = 0.7
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flow-GRPO's rollout step (`sde_step_with_logprob` with a given noise), eager; t < 1."""
    model_output = v.float()
    latents = x_t.float()
    view = (-1, *([1] * (latents.dim() - 1)))
    sigma = t.view(view)
    dt = s.view(view) - sigma
    std_dev_t = torch.sqrt(sigma / (1 - sigma)) * noise_level
    prev_sample_mean = latents * (1 + std_dev_t**2 / (2 * sigma) * dt) + model_output * (
        1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)
    ) * dt
    prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * noise.float()
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
