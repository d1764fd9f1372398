"""Flow-GRPO's own eager code for a `flow_sde` step and its log-prob, the baseline that
benchmarks/test_bench_kernels.py times the fused kernels against (written as Flow-GRPO writes it, in
flow_grpo/diffusers_patch/sd3_sde_with_logprob.py and its train loop). tests/test_kernels.py checks it
computes what the kernels compute, so the benchmark compares the same numbers.
"""

from __future__ import annotations

import math

import torch


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
