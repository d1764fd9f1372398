"""grpo.update on a real SD3 policy: the gradient it takes is the policy gradient of the advantages it
is given, sample by sample and step by step (sign and step index included)."""

import pytest
import torch

from stepfast import grpo
from stepfast.config import load_config
from stepfast.kernels import sde_logprob
from stepfast.models import load_pipeline
from stepfast.models.tiny import tiny_pipeline_dir
from stepfast.policy import encode_prompts, latent_shape, velocity
from stepfast.rollout import sample_noise
from stepfast.sde import sd3_time_grid


class Engine(torch.nn.Module):
    """What grpo.update needs of a DeepSpeed engine: the forward, a backward by plain autograd, and no
    optimizer step (the gradients stay to be read)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        pass

    def is_gradient_accumulation_boundary(self):
        return False


def rollout(tmp_path, members: int, clip_range: float):
    """(config, pipeline with a trainable transformer, conditioning, trajectory) of one group of
    `members` on a tiny SD3 model: 4 ddim steps, micro-batches of 2, no CFG."""
    torch.manual_seed(0)
    model = tiny_pipeline_dir(tmp_path, seed=0)
    cfg = load_config("default", [f"model.path={model}", "sde.steps=4", "sde.min_std=0.0001", "rollout.groups=1",
                                  f"rollout.group_size={members}", "rollout.micro_batch=2", "rollout.cfg=1.0",
                                  f"optim.clip_range={clip_range}", "optim.beta=0"])  # fmt: skip
    pipe = load_pipeline(model)
    pipe.transformer.requires_grad_(True)
    cond = encode_prompts(pipe, ["a photo of a red circle"] * members, cfg.rollout.cfg, torch.device("cpu"))
    shape = latent_shape(pipe, 1, pipe.default_sample_size * pipe.vae_scale_factor)[1:]
    x_init, noise = sample_noise(0, 1, [0] * members, list(range(members)), shape, cfg.sde.steps, True)
    traj = grpo.rollout(pipe.transformer, cond, x_init, noise, sd3_time_grid(cfg.sde.steps), cfg)
    return cfg, pipe, cond, traj


def test_update_gradient_is_minus_advantage_times_grad_log_prob(tmp_path):
    """On-policy (every ratio 1) the PPO-clip loss's gradient is that of -mean_i(A_ij log p_ij) summed
    over the trained steps j: a flipped sign or an advantage taken from the neighbouring step fails."""
    cfg, pipe, cond, traj = rollout(tmp_path, members=2, clip_range=0.2)
    grid = traj.grid
    trained = traj.trained.nonzero().flatten().tolist()
    assert len(trained) >= 2  # the step index matters
    adv = torch.randn(2, cfg.sde.steps, generator=torch.Generator().manual_seed(1))  # per sample and step
    grpo.update(Engine(pipe.transformer), cond, traj, adv, cfg)
    got = [p.grad.clone() for p in pipe.transformer.parameters()]
    pipe.transformer.zero_grad()
    for j in trained:
        t, s = grid[j].expand(2), grid[j + 1].expand(2)
        v = velocity(pipe.transformer, traj.states[j], t, cond, cfg.rollout.cfg)
        lp = sde_logprob(cfg.sampler, traj.states[j], v, t, s, traj.states[j + 1], eta=cfg.sde.eta).log_prob
        (-(adv[:, j] * lp).mean()).backward()
    want = [p.grad for p in pipe.transformer.parameters()]
    assert any(w.abs().sum() > 0 for w in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)


def test_every_sample_weighs_alike_when_the_micro_batches_differ_in_size(tmp_path):
    """3 samples in micro-batches of 2 and 1: a plain mean per micro-step would give the third sample
    the weight of the other two together. The engine sums the micro-steps (DeepSpeed then divides by
    their number), so the update must take 2 x the gradient of the mean over all 3 samples."""
    cfg, pipe, cond, traj = rollout(tmp_path, members=3, clip_range=0.2)
    grid = traj.grid
    trained = traj.trained.nonzero().flatten().tolist()
    adv = torch.randn(3, cfg.sde.steps, generator=torch.Generator().manual_seed(2))
    grpo.update(Engine(pipe.transformer), cond, traj, adv, cfg)
    got = [p.grad.clone() for p in pipe.transformer.parameters()]
    pipe.transformer.zero_grad()
    for j in trained:
        lp = []
        for mb in (slice(0, 2), slice(2, 3)):  # the model's forward on the update's micro-batches: the same rounding
            t, s = grid[j].expand(mb.stop - mb.start), grid[j + 1].expand(mb.stop - mb.start)
            v = velocity(pipe.transformer, traj.states[j, mb], t, cond.select(mb), cfg.rollout.cfg)
            lp.append(sde_logprob(cfg.sampler, traj.states[j, mb], v, t, s, traj.states[j + 1, mb],
                                  eta=cfg.sde.eta).log_prob)  # fmt: skip
        (-2 * (adv[:, j] * torch.cat(lp)).mean()).backward()
    want = [p.grad for p in pipe.transformer.parameters()]
    assert any(w.abs().sum() > 0 for w in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)


class SteppingEngine(Engine):
    """An engine whose every backward is an accumulation boundary: an SGD step on each, with a known
    gradient norm per step."""

    def __init__(self, module, lr):
        super().__init__(module)
        self.lr, self.norms = lr, []

    def is_gradient_accumulation_boundary(self):
        return True

    def step(self):
        with torch.no_grad():
            norm = torch.sqrt(sum((p.grad**2).sum() for p in self.module.parameters() if p.grad is not None))
            for p in self.module.parameters():
                if p.grad is not None:
                    p -= self.lr * p.grad
                    p.grad = None
        self.norms.append(float(norm))

    def get_global_grad_norm(self):
        return self.norms[-1]


def test_update_reports_the_first_micro_step_on_policy_and_every_optimizer_step(tmp_path):
    """With an optimizer step after every backward, later micro-steps are off-policy (ratio != 1) but
    the logged first_* statistics are the first micro-step's (ratio exactly 1), grad_norm is the mean
    over the optimizer steps, and the EMA is updated once per optimizer step."""
    cfg, pipe, cond, traj = rollout(tmp_path, members=4, clip_range=10)
    adv = torch.randn(4, cfg.sde.steps, generator=torch.Generator().manual_seed(1))

    class CountingEMA:
        updates = 0

        def update(self, module):
            CountingEMA.updates += 1

    engine = SteppingEngine(pipe.transformer, lr=1e-2)
    stats = grpo.update(engine, cond, traj, adv, cfg, ema=CountingEMA())
    calls = int(traj.trained.sum()) * 2  # trained steps x 2 micro-batches
    summary = stats.summary()
    assert stats.count == calls == len(engine.norms) == CountingEMA.updates
    assert summary["first_ratio_mean"] == summary["first_ratio_min"] == summary["first_ratio_max"] == 1.0
    assert (summary["ratio_min"], summary["ratio_max"]) != (1.0, 1.0)  # the later micro-steps moved off-policy
    assert summary["grad_norm"] == pytest.approx(sum(engine.norms) / calls)


def test_tempflow_weights_each_steps_loss_by_its_std_over_the_mean(tmp_path):
    """credit_opts.step_weights=tempflow: the update's gradient is that of sum_j w_j (-mean_i A_ij log p_ij)
    with w_j the step's std over the trained steps' mean std (ddim: eta s sqrt(1 - t), in float64 here)."""
    cfg, pipe, cond, traj = rollout(tmp_path, members=2, clip_range=0.2)
    cfg.credit_opts.step_weights = "tempflow"
    grid = traj.grid.double()
    trained = traj.trained.nonzero().flatten().tolist()
    std = {j: cfg.sde.eta * float(grid[j + 1]) * (1 - float(grid[j])) ** 0.5 for j in trained}
    weight = {j: std[j] * len(trained) / sum(std.values()) for j in trained}
    assert max(weight.values()) / min(weight.values()) > 1.5  # the weighting matters on this grid
    assert grpo.step_weights(cfg, traj.grid, trained) == pytest.approx(weight, rel=1e-6)
    adv = torch.randn(2, cfg.sde.steps, generator=torch.Generator().manual_seed(3))
    grpo.update(Engine(pipe.transformer), cond, traj, adv, cfg)
    got = [p.grad.clone() for p in pipe.transformer.parameters()]
    pipe.transformer.zero_grad()
    for j in trained:
        t, s = traj.grid[j].expand(2), traj.grid[j + 1].expand(2)
        v = velocity(pipe.transformer, traj.states[j], t, cond, cfg.rollout.cfg)
        lp = sde_logprob(cfg.sampler, traj.states[j], v, t, s, traj.states[j + 1], eta=cfg.sde.eta).log_prob
        (-weight[j] * (adv[:, j] * lp).mean()).backward()
    want = [p.grad for p in pipe.transformer.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("sampler", ["flow_sde", "cps"])
def test_tempflow_weights_of_the_other_samplers(sampler):
    """flow_sde's weight is TempFlow-GRPO's sig_k sqrt(dt_k), sig = a sqrt(t / (1 - t)) (1 - s at t = 1);
    cps's is its std, s sin(a pi / 2); uniform's is 1 at every step."""
    import math

    cfg = load_config("flow_grpo" if sampler == "flow_sde" else "default",
                      [f"sampler={sampler}", "credit_opts.step_weights=tempflow", "sde.min_std=0.0001"])  # fmt: skip
    grid = sd3_time_grid(cfg.sde.steps)
    steps = grpo.trained_steps(cfg, grid)
    a, g = cfg.sde.noise_level, grid.double().tolist()
    if sampler == "flow_sde":
        std = {j: a * math.sqrt(g[j] / (1 - (g[j + 1] if g[j] == 1 else g[j]))) * math.sqrt(g[j] - g[j + 1])
               for j in steps}  # fmt: skip
    else:
        std = {j: g[j + 1] * math.sin(a * math.pi / 2) for j in steps}
    want = {j: std[j] * len(steps) / sum(std.values()) for j in steps}
    assert grpo.step_weights(cfg, grid, steps) == pytest.approx(want, rel=1e-6)
    cfg.credit_opts.step_weights = "uniform"
    assert grpo.step_weights(cfg, grid, steps) == {j: 1.0 for j in steps}
