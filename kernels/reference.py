"""The torch backend of the fused ops, built on `stepfast.sde` (the reference every kernel matches):
plain autograd code, whose backward is whatever autograd makes of the forward.
"""

from __future__ import annotations

import torch

from stepfast import sde
from stepfast.loss import kl_to_reference


def _mean(kind: str, x_t: torch.Tensor, v: torch.Tensor, t, s, **params) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the step, from `stepfast.sde.step` (a zero noise: no random draw)."""
    zero = torch.zeros((), dtype=torch.float32, device=x_t.device).expand(x_t.shape)
    out = sde.step(kind, x_t, v, t, s, noise=zero, **params)
    return out.mean, out.std


def _log_prob(sample, mean, std, t, s, convention, reduce, patch_size) -> torch.Tensor:
    """`stepfast.sde.log_prob`, with a step of std 0 named by its times t -> s, as the kernels name it."""
    if convention == "gaussian" and not torch.compiler.is_compiling():  # a traced call cannot read it
        std = torch.as_tensor(std)
        if bool((std <= 0).any()):
            # per sample ([B], or one for all): std is [B, 1, 1, 1] for per-sample times
            std, t, s = torch.broadcast_tensors(*(torch.as_tensor(u).double().cpu().reshape(-1) for u in (std, t, s)))
            raise ValueError(sde.deterministic_step_error(std, t, s))
    return sde.log_prob(sample, mean, std, convention, reduce, patch_size)


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
    return out.sample, _log_prob(out.sample, out.mean, out.std, t, s, convention, reduce, patch_size)


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
    log_prob = _log_prob(sample, mean, std, t, s, convention, reduce, patch_size)
    if v_ref is None:
        return log_prob, None
    mean_ref, _ = _mean(kind, x_t, v_ref, t, s, **params)
    return log_prob, kl_to_reference(mean, mean_ref, sde.kl_sigma(kind, t, s, **params))
