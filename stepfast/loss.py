"""The GRPO objective of one denoising step: PPO-clip on the step's likelihood ratio, plus KL.

Flow-GRPO, per trained step j of a batch of trajectories i:

    ratio  = exp(logp_new - logp_old)
    loss   = mean(max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps)))      eps = clip_range
    loss  += beta mean(kl)                                                when beta > 0

with A clipped to +-adv_clip first. Stepwise-Flow-GRPO uses the same objective with a per-step
advantage A_j^i in place of A^i. Log-probs may be per sample [B] or per token [B, L] (spatial credit):
advantages broadcast against them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stepfast.sde import KL_OF_A_DETERMINISTIC_STEP, per_sample


@dataclass
class StepLoss:
    """The loss of one step and what people log about it (statistics are detached)."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor
    ratio_mean: torch.Tensor
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor

    def stats(self) -> dict[str, float]:
        return {name: float(value.detach()) for name, value in vars(self).items()}


def kl_to_reference(mean: torch.Tensor, mean_ref: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Flow-GRPO's KL to the reference policy, per sample [B]:

        kl = mean_CHW (mu_theta - mu_ref)^2 / (2 sig^2)

    sig is the sampler's noise scale WITHOUT the sqrt(dt) of flow_sde (`stepfast.sde.kl_sigma`).
    """
    sigma = torch.as_tensor(sigma, dtype=torch.float32)
    # as the kernels refuse it; read where sigma is (the trainer's times are on the host: no device sync)
    if not torch.compiler.is_compiling() and bool((sigma <= 0).any()):
        raise ValueError(KL_OF_A_DETERMINISTIC_STEP)
    sigma = sigma.to(mean.device)
    sq = (mean.float() - mean_ref.float()) ** 2
    return per_sample(sq, torch.mean) / (2 * sigma.reshape(-1) ** 2)


def grpo_step_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float = 1e-4,
    adv_clip: float = 5.0,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
) -> StepLoss:
    """PPO-clip loss of one step (see the module docstring); `kl` per sample [B] when beta > 0.

    On-policy (log_prob equal to old_log_prob bit for bit) the ratio is exactly 1.
    """
    if log_prob.shape != old_log_prob.shape:
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)} and old_log_prob {tuple(old_log_prob.shape)} differ in shape"
        )
    if beta > 0 and kl is None:
        raise ValueError("beta > 0 needs the per-sample kl to the reference")
    adv = advantages.to(log_prob.dtype).clamp(-adv_clip, adv_clip)
    if adv.dim() < log_prob.dim():
        adv = adv.reshape(*adv.shape, *([1] * (log_prob.dim() - adv.dim())))
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped).mean()
    kl_mean = kl.mean() if kl is not None else torch.zeros((), device=log_prob.device)
    loss = policy_loss + beta * kl_mean if beta > 0 else policy_loss
    with torch.no_grad():
        return StepLoss(
            loss=loss,
            policy_loss=policy_loss.detach(),
            kl=kl_mean.detach(),
            clip_fraction=((ratio - 1.0).abs() > clip_range).float().mean(),
            approx_kl=0.5 * (log_ratio**2).mean(),
            ratio_mean=ratio.mean(),
            ratio_min=ratio.min(),
            ratio_max=ratio.max(),
        )
