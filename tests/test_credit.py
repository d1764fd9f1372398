"""Advantage estimators: hand examples, identities, and Flow-GRPO's own statistics."""

import math

import numpy as np
import pytest
import torch

from stepfast.credit import compute_advantages, gains, turning_point_rewards


def test_stepwise_hand_example():
    rewards = torch.tensor([[[0.0, 1.0, 3.0], [0.0, 2.0, 1.0]]])  # G=1, N=2, T=2
    # gains [[1, 2], [2, -1]]: mean 1, population std sqrt(1.5)
    std = math.sqrt(1.5)
    expect = torch.tensor([[[0.0, 1.0], [1.0, -2.0]]]) / (std + 1e-4)
    assert torch.allclose(compute_advantages("stepwise", rewards), expect, atol=1e-6)


def test_gains_telescope():
    rewards = torch.randn(4, 6, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g = gains(rewards)
    assert torch.allclose(g.sum(-1), rewards[..., -1] - rewards[..., 0])


def test_shared_noise_group_relative_gains_equal_group_relative_final_reward():
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(3, 8, 11, dtype=torch.float64, generator=gen)
    rewards[..., 0] = torch.randn(3, 1, dtype=torch.float64, generator=gen)  # same initial noise -> same r_0 in a group
    total = gains(rewards).sum(-1)
    final = rewards[..., -1]
    assert torch.allclose(total - total.mean(1, keepdim=True), final - final.mean(1, keepdim=True))
    # and the stepwise advantages of a member sum, up to the joint scale, to its relative final reward
    adv = compute_advantages("stepwise", rewards, adv_clip=1e9).double()
    g = gains(rewards)
    scale = g.std(dim=(1, 2), correction=0) + 1e-4
    rel = (final - final.mean(1, keepdim=True)) / scale[:, None]
    assert torch.allclose(adv.sum(-1) - adv.sum(-1).mean(1, keepdim=True), rel, atol=1e-5)


def test_joint_normalisation_keeps_late_noise_small_per_step_inflates_it():
    g, n, t = 4, 16, 10
    step_gains = torch.randn(g, n, t, generator=torch.Generator().manual_seed(0))
    step_gains[..., :5] *= 1.0    # early steps decide the image
    step_gains[..., 5:] *= 1e-3   # late steps only add noise
    rewards = torch.cat([torch.zeros(g, n, 1), step_gains.cumsum(-1)], dim=-1)
    joint = compute_advantages("stepwise", rewards)
    per_step = compute_advantages("stepwise_per_step", rewards)
    # how much the late steps separate the members of a group: their spread over the group
    assert joint[..., 5:].std(1).max() < 0.01
    assert per_step[..., 5:].std(1).min() > 0.85  # late noise promoted to unit-scale advantages
    # per-step statistics: every step has zero mean and std sigma_j / (sigma_j + eps) over the group
    assert torch.allclose(per_step.mean(1), torch.zeros(g, t), atol=1e-5)
    # (the gains as the credit reads them: differences of the float32 rewards, taken in float64)
    seen = rewards.double().diff(dim=-1)
    sigma = seen.std(1, correction=0)
    assert torch.allclose(per_step.std(1, correction=0).double(), sigma / (sigma + 1e-4), atol=1e-6)
    # joint statistics: zero mean and std sigma / (sigma + eps) over the group's N x T advantages
    assert torch.allclose(joint.mean((1, 2)), torch.zeros(g), atol=1e-5)
    sigma = seen.std((1, 2), correction=0)
    assert torch.allclose(joint.std((1, 2), correction=0).double(), sigma / (sigma + 1e-4), atol=1e-6)


def flow_grpo_stat_tracker(prompts, rewards, global_std):
    """Flow-GRPO's PerPromptStatTracker.update (grpo), in numpy as it is written there."""
    prompts = np.array(prompts)
    rewards = np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        prompt_rewards = rewards[prompts == prompt]
        mean = np.mean(prompt_rewards, axis=0, keepdims=True)
        if global_std:
            std = np.std(rewards, axis=0, keepdims=True) + 1e-4
        else:
            std = np.std(prompt_rewards, axis=0, keepdims=True) + 1e-4
        advantages[prompts == prompt] = (prompt_rewards - mean) / std
    return advantages


@pytest.mark.parametrize("global_std", [False, True])
def test_flow_grpo_hand_example(global_std):
    final = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 3.0]])
    rewards = torch.cat([torch.zeros(2, 3, 4), final[..., None]], dim=-1)  # T = 4
    adv = compute_advantages("flow_grpo", rewards, global_std=global_std)
    if global_std:
        std = math.sqrt(9.5 / 6)  # all six rewards: mean 1.5
        expect = torch.tensor([[-1.0, 0.0, 1.0], [-1.0, -1.0, 2.0]]) / (std + 1e-4)
    else:
        expect = torch.stack([torch.tensor([-1.0, 0.0, 1.0]) / (math.sqrt(2 / 3) + 1e-4),
                              torch.tensor([-1.0, -1.0, 2.0]) / (math.sqrt(2.0) + 1e-4)])
    assert adv.shape == (2, 3, 4)
    assert torch.allclose(adv, expect[..., None].expand(2, 3, 4), atol=1e-6)


@pytest.mark.parametrize("global_std", [False, True])
def test_flow_grpo_matches_flow_grpo_stat_tracker(global_std):
    g, n = 5, 7
    gen = torch.Generator().manual_seed(2)
    final = torch.rand(g, n, dtype=torch.float64, generator=gen) * 3
    rewards = torch.cat([torch.randn(g, n, 10, dtype=torch.float64, generator=gen), final[..., None]], dim=-1)
    prompts = [f"prompt {i}" for i in range(g) for _ in range(n)]
    ref = flow_grpo_stat_tracker(prompts, final.flatten().numpy(), global_std).reshape(g, n)
    ref = np.clip(ref, -5, 5)
    adv = compute_advantages("flow_grpo", rewards, global_std=global_std)
    for j in range(10):
        assert np.allclose(adv[..., j].numpy(), ref, atol=1e-5)


@pytest.mark.parametrize("global_std", [False, True])
def test_flow_grpo_pools_the_groups_of_one_prompt_as_the_stat_tracker_does(global_std):
    """Two groups of the same prompt text (a prompt file listing it twice) share its statistics; with
    every key different the advantages are those of the groups alone, to the bit."""
    g, n = 5, 7
    gen = torch.Generator().manual_seed(2)
    final = torch.rand(g, n, dtype=torch.float64, generator=gen) * 3
    rewards = torch.cat([torch.randn(g, n, 10, dtype=torch.float64, generator=gen), final[..., None]], dim=-1)
    keys = ["a", "b", "a", "c", "b"]
    ref = flow_grpo_stat_tracker([k for k in keys for _ in range(n)], final.flatten().numpy(), global_std)
    adv = compute_advantages("flow_grpo", rewards, global_std=global_std, prompts=keys)
    for j in range(10):
        assert np.allclose(adv[..., j].numpy(), np.clip(ref.reshape(g, n), -5, 5), atol=1e-5)
    distinct = compute_advantages("flow_grpo", rewards, global_std=global_std, prompts=list("abcde"))
    assert torch.equal(distinct, compute_advantages("flow_grpo", rewards, global_std=global_std))
    for keys in (["a", "a", "b"], ["a", "b", "c"]):
        with pytest.raises(ValueError, match="3 keys for 5 groups"):
            compute_advantages("flow_grpo", rewards, prompts=keys)


def test_advantages_are_clipped():
    rewards = torch.zeros(1, 50, 3)
    rewards[0, 0, -1] = 100.0  # one outlier: (100 - 2) / std ~ 7 > 5
    adv = compute_advantages("flow_grpo", rewards)
    assert adv.max() == 5.0
    assert compute_advantages("flow_grpo", rewards, adv_clip=100).max() > 5.0


def test_turning_point_hand_example():
    # sample 0: R = [0, -1, 2, 3]. d = [-1, 3, 1], D = 3, s = [-1, 1, 1]. Step 2 turns: s_1 < 0,
    #   s_2 > 0 and sign(d_2) sign(R_T - R_2) = + -> return-to-go R_T - R_1 = 4.
    # sample 1: R = [0, 1, -2, -3]. d = [1, -3, -1], D = -3, s = [-1, 1, 1]. Step 2 turns with
    #   return-to-go -3 - 1 = -4.
    rewards = torch.tensor([[[0.0, -1.0, 2.0, 3.0], [0.0, 1.0, -2.0, -3.0]]], dtype=torch.float64)
    r = turning_point_rewards(rewards, balance=False)
    assert r.tolist() == [[[-1.0, 4.0, 1.0], [1.0, -4.0, -1.0]]]
    # balanced: one positive and one negative turning point, both kept
    assert turning_point_rewards(rewards, balance=True).tolist() == r.tolist()
    # only a positive turning point: balance keeps none, every step falls back to d_k
    only_pos = rewards[:, :1]
    assert turning_point_rewards(only_pos, balance=True).tolist() == [[[-1.0, 3.0, 1.0]]]
    adv = compute_advantages("turning_point", rewards, balance=False)
    # per-step normalisation over the group of two: +-std / (std + eps), the steps' stds 1, 4 and 1
    std = torch.tensor([1.0, 4.0, 1.0], dtype=torch.float64)
    assert torch.allclose(adv.abs().double(), (std / (std + 1e-4)).expand(1, 2, 3), rtol=0, atol=1e-7)  # float32


def test_turning_point_balance_keeps_the_largest_return_to_go_and_advantages_normalise_them():
    """Three members with turning points of return-to-go +4, +2.5 and -4: balancing keeps one of each
    sign, the largest |return-to-go| (A's +4, not B's +2.5; B falls back to its gain d_k). The estimator's
    advantages are these rewards normalised per step over the group, not the plain gains."""
    rewards = torch.tensor([[[0.0, -1.0, 2.0, 3.0], [0.0, -1.0, 1.0, 1.5], [0.0, 1.0, -2.0, -3.0]]],
                           dtype=torch.float64)  # fmt: skip
    assert turning_point_rewards(rewards, balance=True).tolist() == [[[-1.0, 4.0, 1.0], [-1.0, 2.0, 0.5],
                                                                       [1.0, -4.0, -1.0]]]  # fmt: skip
    r = turning_point_rewards(rewards, balance=False)
    expected = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, correction=0) + 1e-4)
    adv = compute_advantages("turning_point", rewards, balance=False)
    torch.testing.assert_close(adv, expected.float().clamp(-5, 5))


def test_turning_point_balance_breaks_ties_by_position():
    """Five identical members with a turning point of return-to-go +1 and two of -1 (pass/fail rewards
    tie often): B = 2 of each keep it, and of the tied ones the first two members, on every device."""
    rewards = torch.tensor([[[0.0, 0.5, 1.0]] * 5 + [[0.0, -0.5, -1.0]] * 2], dtype=torch.float64)
    kept = turning_point_rewards(rewards, balance=True)[0, :, 0].tolist()
    assert kept == [1.0, 1.0, 0.5, 0.5, 0.5, -1.0, -1.0]


def test_turning_point_first_step_needs_only_the_last_condition():
    # R = [0, 1, 0.5, 2]: d_1 = 1 and R_T - R_1 = 1 > 0 -> the first step turns, to-go R_T - R_0 = 2
    rewards = torch.tensor([[[0.0, 1.0, 0.5, 2.0]]], dtype=torch.float64)
    assert turning_point_rewards(rewards, balance=False)[0, 0, 0].item() == 2.0


def test_nan_reward_names_group_and_sample():
    rewards = torch.zeros(3, 4, 6)
    rewards[2, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="group 2, sample 1, column 5 \\(the final image\\)"):
        compute_advantages("stepwise", rewards)
    rewards = torch.zeros(3, 4, 6)
    rewards[0, 3, 2] = float("inf")
    with pytest.raises(ValueError, match="group 0, sample 3, column 2 \\(the estimate at state 2\\)"):
        compute_advantages("flow_grpo", rewards)


def test_unknown_estimator_and_option():
    with pytest.raises(ValueError, match="unknown credit estimator 'stepwize'.*stepwise"):
        compute_advantages("stepwize", torch.zeros(1, 2, 3))
    with pytest.raises(TypeError, match="credit estimator 'stepwise'"):
        compute_advantages("stepwise", torch.zeros(1, 2, 3), global_std=True)
    with pytest.raises(ValueError, match="shape"):
        compute_advantages("stepwise", torch.zeros(2, 3))


def test_the_credits_the_config_refuses_for_groups_of_one_give_them_no_advantage():
    """config.GROUP_RELATIVE_CREDITS (refused with rollout.group_size=1) are exactly the credits whose
    advantages are all 0 when each group holds one sample."""
    from stepfast.config import GROUP_RELATIVE_CREDITS
    from stepfast.credit import ESTIMATORS

    rewards = torch.rand(3, 1, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    silent = {name for name in ESTIMATORS if not compute_advantages(name, rewards).any()}
    assert silent == set(GROUP_RELATIVE_CREDITS)


def test_a_deterministic_steps_gain_counts_in_the_statistics_of_the_trained_steps():
    """METHOD: a step under sde.min_std carries no loss, but its reward gain still counts in the
    normalisation statistics. With ddim on the default preset's grid, steps 0, 8 and 9 are not
    trained; the advantages the update reads at the trained steps are the joint normalisation over
    all ten steps' gains, not over the trained steps' alone."""
    from stepfast import grpo
    from stepfast.config import load_config

    cfg = load_config("default", ["rollout.groups=2", "rollout.group_size=3"])
    trained = grpo.trained_steps(cfg)
    assert trained == list(range(1, 8))
    g = torch.Generator().manual_seed(7)
    rewards = torch.rand(2 * 3, 11, generator=g, dtype=torch.float64)
    rewards[:, 1] += torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0, -2.0], dtype=torch.float64)  # large gains at step 0
    adv = grpo.advantages(rewards.float(), cfg)[:, trained].double()
    gains = (rewards[:, 1:] - rewards[:, :-1]).reshape(2, 3, 10)
    mean, std = gains.mean(dim=(1, 2), keepdim=True), gains.std(dim=(1, 2), unbiased=False, keepdim=True)
    joint = ((gains - mean) / (std + 1e-4)).clamp(-5, 5).reshape(6, 10)[:, trained]
    torch.testing.assert_close(adv, joint, rtol=1e-5, atol=1e-5)
    part = gains[..., trained]
    alone = ((part - part.mean(dim=(1, 2), keepdim=True)) / (part.std(dim=(1, 2), unbiased=False, keepdim=True) + 1e-4))
    assert (adv - alone.reshape(6, -1)).abs().max() > 0.1  # the statistics of the trained steps alone differ
