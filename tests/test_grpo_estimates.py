"""grpo.estimate_images: one batch of clean estimates per substep, each distinct state estimated once."""

import pytest
import torch

from stepfast import grpo
from stepfast.config import load_config
from stepfast.models import load_pipeline
from stepfast.models.tiny import tiny_pipeline_dir
from stepfast.policy import PromptEmbeddings, decode, encode_prompts, latent_shape, velocity
from stepfast.rollout import sample_noise
from stepfast.sde import sd3_time_grid


def test_distinct_rows_keeps_the_first_of_each_set_in_order():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 2, 3, generator=g)
    t = torch.tensor([0.9, 0.5, 0.9, 0.5, 0.9, 0.9])
    prompt = torch.tensor([0, 0, 0, 1, 0, 1])
    rows[2], rows[4] = rows[0], rows[0]  # rows 2 and 4 are row 0: the same state, time and prompt
    rows[5] = rows[0]  # the same state and time, another prompt
    rows[3] = rows[1]  # the same state and time, another prompt
    keep, inverse = grpo.distinct_rows(rows, t, prompt)
    assert keep.tolist() == [0, 1, 3, 5]
    assert inverse.tolist() == [0, 1, 0, 2, 0, 3]
    assert torch.equal(rows[keep][inverse], rows) and torch.equal(t[keep][inverse], t)
    assert torch.equal(prompt[keep][inverse], prompt)
    t[2] = 0.5  # another time: its own set
    assert grpo.distinct_rows(rows, t, prompt)[0].tolist() == [0, 1, 2, 3, 5]


class CountingEstimator:
    """grpo.Estimator, recording how many states each call estimated."""

    def __init__(self, estimator):
        self.estimator, self.rows = estimator, []

    def __call__(self, cond, states, t, substeps, first_velocity=None, index=None, calls_of=0):
        self.rows.append(states.shape[0])
        return self.estimator(cond, states, t, substeps, first_velocity, index, calls_of)


TEXTS = ["a photo of a red circle"] * 4 + ["a photo of two squares"] * 4


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """A default-preset rollout of 2 groups of 4 on a tiny model: ddim, shared initial noise."""
    torch.manual_seed(0)
    model = tiny_pipeline_dir(tmp_path_factory.mktemp("tiny"), seed=0)
    cfg = load_config("default", [f"model.path={model}", "sde.steps=5", "rollout.groups=2", "rollout.group_size=4",
                                  "rollout.micro_batch=8", "rollout.substeps=2", "rollout.cfg=2.0"])  # fmt: skip
    pipe = load_pipeline(model)
    cond = encode_prompts(pipe, TEXTS, cfg.rollout.cfg, torch.device("cpu"))
    shape = latent_shape(pipe, 1, pipe.default_sample_size * pipe.vae_scale_factor)[1:]
    grid = sd3_time_grid(cfg.sde.steps, shift=3.0)

    def run(same_latent: bool, config=cfg):
        """The rollout of the two groups, with the fixture's settings or those of `config`."""
        groups, members = [0] * 4 + [1] * 4, list(range(4)) * 2
        x_init, noise = sample_noise(config.seed, 1, groups, members, shape, config.sde.steps, same_latent)
        return grpo.rollout(pipe.transformer, cond, x_init, noise, grid, config)

    return cfg, pipe, cond, run


def test_shared_states_are_estimated_once_and_give_every_member_the_same_image(rollout):
    cfg, pipe, cond, run = rollout
    traj = run(same_latent=True)
    # ddim's first step is deterministic: members of a group share states 0 and 1, and no other
    assert all(torch.equal(traj.states[j, g * 4], traj.states[j, g * 4 + n]) for j in (0, 1) for g in (0, 1)
               for n in range(4))  # fmt: skip
    assert not torch.equal(traj.states[2, 0], traj.states[2, 1])
    counting = CountingEstimator(grpo.Estimator(pipe.transformer, cfg.rollout.cfg, use_cuda_graph=False))
    images = grpo.estimate_images(pipe, counting, cond, traj, cfg)
    every = grpo.estimate_images(pipe, counting, cond, traj, cfg, distinct=False)
    by_text = grpo.estimate_images(pipe, counting, cond, traj, cfg, prompts=TEXTS)  # prompts known by their text
    assert counting.rows == [5 * 8 - 2 * 2 * 3, 5 * 8, 5 * 8 - 2 * 2 * 3]  # 2 shared states x 2 groups x 3 members
    assert torch.equal(by_text, images)
    assert images.shape == every.shape == (5, 8, 3, *images.shape[-2:])
    torch.testing.assert_close(images, every, rtol=0, atol=1e-5)
    for j in (0, 1):
        for g in (0, 1):
            assert all(torch.equal(images[j, g * 4], images[j, g * 4 + n]) for n in range(4))


def test_without_shared_noise_every_state_is_estimated(rollout):
    cfg, pipe, cond, run = rollout
    cfg = load_config("default", [f"model.path={cfg.model.path}", "sde.steps=5", "rollout.groups=2",
                                  "rollout.group_size=4", "rollout.micro_batch=8", "rollout.substeps=2",
                                  "rollout.cfg=2.0", "rollout.same_latent=false"])  # fmt: skip
    counting = CountingEstimator(grpo.Estimator(pipe.transformer, cfg.rollout.cfg, use_cuda_graph=False))
    grpo.estimate_images(pipe, counting, cond, run(same_latent=False), cfg)
    assert counting.rows == [5 * 8]


def test_each_estimate_is_euler_substeps_from_its_own_state_and_time_to_zero(rollout):
    """Image j of sample i is the decoded T'-substep Euler estimate from state j at grid[j], computed
    here one state at a time with fresh velocities (no reused first velocity, no batching across
    states): the batched path must take each state's own time."""
    cfg, pipe, cond, run = rollout
    traj = run(same_latent=True)
    estimator = grpo.Estimator(pipe.transformer, cfg.rollout.cfg, use_cuda_graph=False)
    images = grpo.estimate_images(pipe, estimator, cond, traj, cfg)
    substeps = cfg.rollout.substeps
    for j in range(traj.num_steps):
        x, t = traj.states[j], traj.grid[j].expand(traj.states.shape[1])
        for i in range(substeps):
            t_i, t_next = t * (1 - i / substeps), t * (1 - (i + 1) / substeps)
            v = velocity(pipe.transformer, x, t_i, cond, cfg.rollout.cfg)
            x = x + (t_next - t_i).reshape(-1, 1, 1, 1) * v
        torch.testing.assert_close(images[j], decode(pipe, x), rtol=0, atol=1e-4, msg=f"state {j}")


@pytest.mark.parametrize("batch", [7, 28, 64])  # 28 distinct states: chunks of 7, 7, 7, 7 / one of 28 / one
def test_estimates_in_chunks_are_the_estimates_and_never_exceed_the_chunk(rollout, batch):
    """rollout.estimate_batch bounds the rows of every transformer call (x2 with CFG), every call of
    one shape (the last chunk padded) so that one CUDA graph serves them, and changes no image
    beyond the rounding of a smaller matrix product."""
    cfg, pipe, cond, run = rollout
    traj = run(same_latent=True)
    whole = grpo.estimate_images(pipe, grpo.Estimator(pipe.transformer, cfg.rollout.cfg, use_cuda_graph=False),
                                 cond, traj, cfg)  # fmt: skip
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, k: seen.append(k["hidden_states"].shape[0]),
                                                      with_kwargs=True)  # fmt: skip
    try:
        chunked = grpo.estimate_images(pipe, grpo.Estimator(pipe.transformer, cfg.rollout.cfg, use_cuda_graph=False,
                                                            batch=batch), cond, traj, cfg)  # fmt: skip
    finally:
        hook.remove()
    m = 5 * 8 - 2 * 2 * 3  # the distinct states (see above)
    size = min(batch, m)
    assert seen == [2 * size] * (-(-m // size) * (cfg.rollout.substeps - 1))  # CFG doubles; the first substep is reused
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5)


def test_a_chunk_pads_with_its_last_state_and_keeps_each_states_prompt():
    """Padding rows are estimated and dropped; each state keeps the prompt `index` gives it."""
    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, return_dict):
            seen.append(encoder_hidden_states[:, 0, 0].tolist())
            return (hidden_states * 0 + encoder_hidden_states[:, :1, :1, None] * self.w,)

    cond = PromptEmbeddings(torch.arange(3.0).reshape(3, 1, 1), torch.zeros(3, 1))
    states, t = torch.zeros(5, 1, 2, 2), torch.full((5,), 0.5)
    index = torch.tensor([2, 0, 1, 1, 2])
    x0 = grpo.Estimator(Model(), 1.0, use_cuda_graph=False, batch=2)(cond, states, t, 1, index=index)
    # one Euler step from t = 0.5 to 0 with v = the prompt's value: x0 = -0.5 v
    torch.testing.assert_close(x0[:, 0, 0, 0], -0.5 * index.float())
    assert seen == [[2.0, 0.0], [1.0, 1.0], [2.0, 2.0]]  # the last chunk padded with its state
    # ZeRO-3: as many calls as another rank's 9 states make (5 chunks), the extra ones padding only
    seen.clear()
    x0 = grpo.Estimator(Model(), 1.0, use_cuda_graph=False, batch=2)(cond, states, t, 1, index=index, calls_of=9)
    torch.testing.assert_close(x0[:, 0, 0, 0], -0.5 * index.float())
    assert seen == [[2.0, 0.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]


def test_under_zero3_every_rank_makes_the_forwards_of_its_states_before_sharing(rollout):
    """Ranks keep different numbers of distinct states (a group split across them shares fewer),
    and under ZeRO-3 each forward is a collective: the chunk count follows B x T on every rank."""
    cfg, pipe, cond, run = rollout
    traj = run(same_latent=True)
    zero3 = load_config("default", [f"model.path={cfg.model.path}", "sde.steps=5", "rollout.groups=2",
                                    "rollout.group_size=4", "rollout.micro_batch=8", "rollout.substeps=2",
                                    "rollout.cfg=2.0", "optim.zero_stage=3", "rollout.estimate_batch=7"])  # fmt: skip
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, k: seen.append(k["hidden_states"].shape[0]),
                                                      with_kwargs=True)  # fmt: skip
    try:
        estimator = grpo.Estimator(pipe.transformer, cfg.rollout.cfg, use_cuda_graph=False, batch=7)
        images = grpo.estimate_images(pipe, estimator, cond, traj, zero3)
    finally:
        hook.remove()
    assert seen == [2 * 7] * -(-(5 * 8) // 7)  # 6 chunks of the 40 states, though 28 are distinct (4 chunks)
    whole = grpo.estimate_images(pipe, grpo.Estimator(pipe.transformer, cfg.rollout.cfg, use_cuda_graph=False),
                                 cond, traj, cfg)  # fmt: skip
    torch.testing.assert_close(images, whole, rtol=0, atol=1e-5)


def test_the_sde_window_is_the_only_stochastic_and_trained_part_of_the_rollout(rollout):
    """sde.window=[1, 3]: steps 1 and 2 draw noise, carry a log-prob and are trained; steps 0, 3 and
    4 are plain ODE steps with no log-prob, and grpo.trained_steps (which sizes the update) agrees."""
    cfg, _, _, run = rollout
    cfg = load_config("default", [f"model.path={cfg.model.path}", "sde.steps=5", "rollout.groups=2",
                                  "rollout.group_size=4", "rollout.micro_batch=8", "rollout.cfg=2.0",
                                  "sde.window=[1, 3]", "sde.min_std=0.0001"])  # fmt: skip
    traj = run(same_latent=True, config=cfg)
    grid = traj.grid
    assert traj.trained.tolist() == [False, True, True, False, False]
    assert grpo.trained_steps(cfg, grid) == [1, 2]
    for j in range(cfg.sde.steps):
        ode = traj.states[j] + (grid[j + 1] - grid[j]) * traj.velocities[j]
        if j in (1, 2):
            assert (traj.states[j + 1] - ode).abs().max() > 1e-3 and bool((traj.log_probs[j] != 0).all())
        else:
            torch.testing.assert_close(traj.states[j + 1], ode, rtol=0, atol=1e-6)
            assert bool((traj.log_probs[j] == 0).all())
    # without the window every step with a std above sde.min_std is trained (ddim: not the first,
    # deterministic at t = 1, nor the last, to t = 0)
    no_window = load_config("default", ["sde.steps=5", "sde.min_std=0.0001"])
    assert grpo.trained_steps(no_window, grid) == [1, 2, 3]


def test_advantages_follow_the_credit_options():
    """grpo.advantages passes credit_opts on: flow_grpo's global_std divides by the batch's std, not
    each group's."""
    rewards = torch.tensor([[0.0, 1.0, 0.0, 1.0], [0.0, 0.1, 0.0, 0.1]]).reshape(8, 1).expand(8, 6).clone()
    per_group = grpo.advantages(rewards, load_config("flow_grpo", ["rollout.groups=2", "rollout.group_size=4",
                                                                   "credit_opts.global_std=false"]))  # fmt: skip
    global_std = grpo.advantages(rewards, load_config("flow_grpo", ["rollout.groups=2", "rollout.group_size=4",
                                                                    "credit_opts.global_std=true"]))  # fmt: skip
    # per group each group's std scales its own advantages; with one std for the batch the low-spread group gets less
    # (+-std / (std + eps): the groups' stds are 0.5 and 0.05)
    unit = torch.tensor([0.5 / (0.5 + 1e-4)] * 4 + [0.05 / (0.05 + 1e-4)] * 4)
    torch.testing.assert_close(per_group[:, 0], unit * torch.tensor([-1.0, 1, -1, 1, -1, 1, -1, 1]), rtol=0, atol=1e-6)
    final = rewards[:, -1].reshape(2, 4)
    want = (final - final.mean(1, keepdim=True)) / (final.std(correction=0) + load_config("flow_grpo").credit_opts.eps)
    torch.testing.assert_close(global_std[:, 0], want.flatten(), rtol=1e-5, atol=1e-6)
    # the two groups drew one prompt: its statistics are those of all eight samples
    pooled = grpo.advantages(rewards, load_config("flow_grpo", ["rollout.groups=2", "rollout.group_size=4"]),
                             prompts=["a red circle", "a red circle"])  # fmt: skip
    all8 = final.flatten()
    want = (all8 - all8.mean()) / (all8.std(correction=0) + load_config("flow_grpo").credit_opts.eps)
    torch.testing.assert_close(pooled[:, 0], want, rtol=1e-5, atol=1e-6)


def test_category_rewards_average_each_groups_members_then_the_groups_of_a_tag():
    final = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 0.0])  # 3 groups of 3, group-major
    got = grpo.category_rewards(final, ["colors", None, "colors"], group_size=3)
    assert got == pytest.approx({"category/colors": (1 / 3 + 2 / 3) / 2})
    got = grpo.category_rewards(final, ["colors", "counting", "position"], group_size=3)
    assert got == pytest.approx({"category/colors": 1 / 3, "category/counting": 1 / 3, "category/position": 2 / 3})


def test_update_stats_average_over_micro_steps_and_keep_extremes_and_the_first():
    stats = grpo.UpdateStats(grad_norms=[1.0, 3.0])
    for loss, lo, hi in ((1.0, 1.0, 1.0), (2.0, 0.9, 1.1), (3.0, 0.95, 1.2)):
        stats.add({"loss": loss, "ratio_mean": (lo + hi) / 2, "ratio_min": lo, "ratio_max": hi})
    assert stats.summary() == pytest.approx({"loss": 2.0, "ratio_mean": (2.0 + 2.0 + 2.15) / 6, "ratio_min": 0.9,
                                             "ratio_max": 1.2, "first_ratio_mean": 1.0, "first_ratio_min": 1.0,
                                             "first_ratio_max": 1.0, "grad_norm": 2.0})  # fmt: skip


def test_update_stats_weigh_micro_steps_as_the_loss_does():
    """Micro-batches of 3, 3 and 2 samples weigh 9/8, 9/8 and 6/8 in the update's loss: the logged
    means are of the samples, not of the micro-steps; extremes and the first micro-step stay as they are."""
    stats = grpo.UpdateStats()
    for loss, weight in ((1.0, 9 / 8), (1.0, 9 / 8), (3.0, 6 / 8)):
        stats.add({"loss": loss, "ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": loss}, weight)
    summary = stats.summary()
    assert summary["loss"] == pytest.approx((3 * 1.0 + 3 * 1.0 + 2 * 3.0) / 8) and stats.count == 3
    assert summary["ratio_max"] == 3.0 and summary["first_ratio_max"] == 1.0
