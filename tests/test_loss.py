"""The per-step PPO-clip loss and the KL penalty."""

import pytest
import torch

from stepfast import sde
from stepfast.loss import grpo_step_loss, kl_to_reference


def test_on_policy_ratio_is_exactly_one_and_gradient_is_policy_gradient():
    logp = torch.randn(6, requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -1.0])
    out = grpo_step_loss(logp, logp.detach().clone(), adv, clip_range=1e-4)
    assert out.ratio_mean.item() == 1.0 and out.ratio_min.item() == 1.0 and out.ratio_max.item() == 1.0
    assert out.clip_fraction.item() == 0.0 and out.approx_kl.item() == 0.0
    out.loss.backward()
    assert torch.allclose(logp.grad, -adv / 6)


def test_clipping_stops_the_gradient_outside_the_trust_region():
    old = torch.zeros(4)
    new = torch.tensor([0.3, 0.3, -0.3, -0.3], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    out = grpo_step_loss(new, old, adv, clip_range=0.2)
    out.loss.backward()
    # ratio 1.35 > 1.2 with A > 0: clipped, no gradient; with A < 0: the unclipped term is larger
    # ratio 0.74 < 0.8 with A < 0: clipped; with A > 0: unclipped, gradient flows
    r = torch.exp(torch.tensor(0.3)), torch.exp(torch.tensor(-0.3))
    assert torch.allclose(new.grad, torch.tensor([0.0, r[0] / 4, -r[1] / 4, 0.0]))
    assert out.clip_fraction.item() == 1.0
    expect = torch.stack([-1.2 * torch.ones(()), r[0], -r[1], 0.8 * torch.ones(())]).mean()
    assert torch.allclose(out.policy_loss, expect)


def test_advantages_are_clipped_and_broadcast_to_tokens():
    logp = torch.zeros(2, 5, requires_grad=True)
    out = grpo_step_loss(logp, torch.zeros(2, 5), torch.tensor([10.0, -10.0]), adv_clip=5.0)
    out.loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-5.0] * 5, [5.0] * 5]) / 10)


def test_kl_term():
    mean = torch.randn(3, 4, 5, 5)
    mean_ref = mean + 0.1
    t, s = torch.full((3,), 0.6), torch.full((3,), 0.46)
    sigma = sde.kl_sigma("flow_sde", t, s)
    kl = kl_to_reference(mean, mean_ref, sigma)
    assert torch.allclose(kl, 0.01 / (2 * sigma**2))
    logp = torch.zeros(3, requires_grad=True)
    out = grpo_step_loss(logp, torch.zeros(3), torch.zeros(3), kl=kl, beta=0.04)
    assert torch.allclose(out.loss, 0.04 * kl.mean())
    with pytest.raises(ValueError, match="beta > 0 needs"):
        grpo_step_loss(logp, torch.zeros(3), torch.zeros(3), beta=0.04)


def test_stats_are_plain_floats():
    out = grpo_step_loss(torch.zeros(2), torch.zeros(2), torch.ones(2))
    stats = out.stats()
    assert set(stats) >= {"loss", "clip_fraction", "approx_kl", "ratio_mean", "ratio_min", "ratio_max", "kl"}
    assert all(isinstance(v, float) for v in stats.values())


def test_logged_statistics_off_policy():
    """clip_fraction counts ratios strictly outside [1 - eps, 1 + eps]; approx_kl is mean(log_ratio^2) / 2."""
    old = torch.zeros(4, dtype=torch.float64)
    log_ratio = torch.tensor([0.0, 0.1, -0.3, 0.5], dtype=torch.float64)
    ratio = log_ratio.exp()
    eps = float(ratio[1] - 1)  # ratio[1] sits exactly on the edge: inside the trust region
    stats = grpo_step_loss(old + log_ratio, old, torch.ones(4, dtype=torch.float64), clip_range=eps).stats()
    assert stats["clip_fraction"] == 0.5
    assert stats["approx_kl"] == pytest.approx(0.5 * float((log_ratio**2).mean()))
    assert (stats["ratio_min"], stats["ratio_max"]) == pytest.approx((float(ratio.min()), float(ratio.max())))
    assert stats["ratio_mean"] == pytest.approx(float(ratio.mean()))
