"""Credit assignment: advantage estimators, each a pure function from rewards to advantages.

Every estimator takes `rewards` of shape [G, N, T + 1] (G groups of N trajectories of one prompt, in
sampling order): column 0 is the reward of the clean-image estimate at the initial noise, column j
that of the estimate at state j, column T the reward of the final image. It returns advantages of
shape [G, N, T]: column j is the advantage of the transition from state j to state j + 1.

    flow_grpo          Flow-GRPO: the final reward's group-relative advantage, the same at every step.
    stepwise           Stepwise-Flow-GRPO: per-step reward gains, normalised jointly over the group.
    stepwise_per_step  The paper's ablation: gains normalised per step.
    turning_point      TurningPoint-GRPO: gains, with return-to-go at turning points.

All statistics use the population std (ddof = 0), as Flow-GRPO's numpy code does, and add `eps`
to the std. Advantages are clipped to +-`adv_clip`.
"""

from __future__ import annotations

from typing import Callable

import torch

EPS = 1e-4
ADV_CLIP = 5.0


def check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """Validate rewards [G, N, T + 1] and return them as float64; a NaN or inf names where it is."""
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 3 or rewards.shape[-1] < 2:
        raise ValueError(
            f"rewards must have shape [groups, samples, steps + 1] with steps >= 1, got {tuple(rewards.shape)}"
        )
    bad = ~torch.isfinite(rewards)
    if bool(bad.any()):
        g, n, j = (int(i) for i in bad.nonzero()[0])
        last = rewards.shape[-1] - 1
        what = "the final image" if j == last else f"the estimate at state {j}"
        raise ValueError(
            f"reward is {rewards[g, n, j].item()} for group {g}, sample {n}, column {j} "
            f"({what}); {int(bad.sum())} non-finite reward(s) in all"
        )
    return rewards.to(torch.float64)


def gains(rewards: torch.Tensor) -> torch.Tensor:
    """Reward gain of each transition: g_j = r_{j+1} - r_j, [G, N, T]. They telescope:
    sum_j g_j = r_T - r_0 (final reward minus the reward at the initial noise)."""
    return rewards[..., 1:] - rewards[..., :-1]


def _normalize(x: torch.Tensor, dims: tuple[int, ...], eps: float) -> torch.Tensor:
    mean = x.mean(dim=dims, keepdim=True)
    std = x.std(dim=dims, keepdim=True, correction=0)
    return (x - mean) / (std + eps)


def flow_grpo(rewards, global_std: bool = False, eps: float = EPS, adv_clip: float = ADV_CLIP, prompts=None):
    """Flow-GRPO's advantage of the final reward r_i = rewards[..., -1]:

        A_i = (r_i - mean_prompt(r)) / (std + eps)

    mean and std over the samples of the prompt, or std over the whole batch with `global_std`; the
    same A_i at every step. `prompts`: a key per group (its prompt text). Flow-GRPO keys its statistics
    by prompt (the tokenizer's decoding of it), so groups that share a prompt (a prompt file listing it
    twice) share them; without keys, or with every key different, each group is its own prompt.
    """
    final = rewards[..., -1]
    std = final.std(correction=0) if global_std else None
    if prompts is not None and len(prompts) != final.shape[0]:
        raise ValueError(f"prompts: {len(prompts)} keys for {final.shape[0]} groups")
    if prompts is not None and len(set(prompts)) < len(prompts):
        adv = torch.empty_like(final)
        for key in dict.fromkeys(prompts):
            rows = [g for g, k in enumerate(prompts) if k == key]
            pooled = final[rows]
            spread = std if global_std else pooled.std(correction=0)
            adv[rows] = (pooled - pooled.mean()) / (spread + eps)
        adv = adv.clamp(-adv_clip, adv_clip)
        return adv.unsqueeze(-1).expand(-1, -1, rewards.shape[-1] - 1)
    mean = final.mean(dim=1, keepdim=True)
    if not global_std:
        std = final.std(dim=1, keepdim=True, correction=0)
    adv = ((final - mean) / (std + eps)).clamp(-adv_clip, adv_clip)
    return adv.unsqueeze(-1).expand(-1, -1, rewards.shape[-1] - 1)


def stepwise(rewards, eps: float = EPS, adv_clip: float = ADV_CLIP):
    """Stepwise-Flow-GRPO: each transition is credited with its reward gain, normalised jointly.

        g_j^i = r_{j+1}^i - r_j^i
        A_j^i = (g_j^i - mu) / (sigma + eps),   mu, sigma over ALL N x T gains of the group

    Joint, not per step: per-step statistics inflate the noise of late steps, whose gains are small.
    The advantages are the per-step gains, not returns-to-go. With the initial noise shared in a
    group, r_0 is constant in it, so the group-relative sum of gains equals the group-relative final
    reward: the method refines Flow-GRPO's credit without changing its total.
    """
    return _normalize(gains(rewards), dims=(1, 2), eps=eps).clamp(-adv_clip, adv_clip)


def stepwise_per_step(rewards, eps: float = EPS, adv_clip: float = ADV_CLIP):
    """The paper's ablation: gains normalised per step, A_j^i = (g_j^i - mu_j) / (sigma_j + eps) with
    mu_j, sigma_j over the group's N gains at step j. It gives a late step with tiny gains the same
    advantage scale as an early decisive one, which is why joint normalisation converges faster."""
    return _normalize(gains(rewards), dims=(1,), eps=eps).clamp(-adv_clip, adv_clip)


def turning_point_rewards(rewards: torch.Tensor, balance: bool = True) -> torch.Tensor:
    """TurningPoint-GRPO's per-step rewards before normalisation, [G, N, T].

    R_j = rewards[..., j] (R_0: the estimate at the initial noise, standing for the pure-ODE reward of
    the noise). TP-GRPO defines R_j as the reward of a full ODE completion from the state; stepfast
    passes the T'-substep clean-image estimates that stepwise credit uses (T' Euler steps instead of
    the remaining steps of the grid, shared by both estimators), a cheaper stand-in for it.
    d_k = R_k - R_{k-1} for k = 1..T, global trend D = R_T - R_0, s_k = sign(d_k) sign(D).
    Step k is a turning point when s_{k-1} < 0, s_k > 0 and sign(d_k) sign(R_T - R_k) > 0 (the first
    step needs only the last condition). There the reward is the return-to-go R_T - R_{k-1} instead of
    d_k. With `balance`, positive and negative turning points are balanced over the batch: only the
    B = min(#positive, #negative) of each with the largest |return-to-go| keep it; the others fall
    back to d_k. Ties (common with pass/fail rewards) go to the first in (group, member, step) order,
    on every device: the sources do not say how to break them.
    """
    d = gains(rewards)
    final = rewards[..., -1:]
    trend = torch.sign(final - rewards[..., :1])
    s = torch.sign(d) * trend
    after = torch.sign(d) * torch.sign(final - rewards[..., 1:]) > 0
    turning = after.clone()
    turning[..., 1:] &= (s[..., :-1] < 0) & (s[..., 1:] > 0)
    to_go = final - rewards[..., :-1]
    if balance:
        turning = _balance(turning, to_go)
    return torch.where(turning, to_go, d)


def _balance(turning: torch.Tensor, to_go: torch.Tensor) -> torch.Tensor:
    pos = turning & (to_go > 0)
    neg = turning & (to_go < 0)
    b = min(int(pos.sum()), int(neg.sum()))
    keep = torch.zeros_like(turning)
    for mask in (pos, neg):
        if b == 0:
            break
        scores = torch.where(mask, to_go.abs(), torch.full_like(to_go, -1.0)).flatten()
        keep.view(-1)[scores.sort(descending=True, stable=True).indices[:b]] = True  # topk breaks ties anyhow
    return keep


def turning_point(rewards, balance: bool = True, eps: float = EPS, adv_clip: float = ADV_CLIP):
    """TurningPoint-GRPO: `turning_point_rewards`, normalised per step and per prompt (group)."""
    r = turning_point_rewards(rewards, balance=balance)
    return _normalize(r, dims=(1,), eps=eps).clamp(-adv_clip, adv_clip)


ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "flow_grpo": flow_grpo,
    "stepwise": stepwise,
    "stepwise_per_step": stepwise_per_step,
    "turning_point": turning_point,
}


def compute_advantages(name: str, rewards, **opts) -> torch.Tensor:
    """Advantages [G, N, T] (float32) from rewards [G, N, T + 1] with the estimator `name`."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown credit estimator {name!r}: expected one of {', '.join(ESTIMATORS)}")
    r = check_rewards(rewards)
    try:
        adv = ESTIMATORS[name](r, **opts)
    except TypeError as exc:
        raise TypeError(f"credit estimator {name!r}: {exc}") from exc
    return adv.to(torch.float32).contiguous()
