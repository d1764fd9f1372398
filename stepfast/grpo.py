"""The four stages of one GRPO iteration on an SD3 policy: rollout, estimates, rewards, update.

Each stage is a function of the policy and the batch; `stepfast/train.py` calls them in order.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from . import credit, sde
from .config import Config
from .kernels import sde_logprob
from .loss import grpo_step_loss
from .policy import PromptEmbeddings, decode, reference_policy, velocity
from .estimates import EstimateEngine
from .rollout import Trajectory, sample_trajectory
from .rewards.combine import ScoreError
from .rewards.geneval_remote import is_tag_column


def sde_params(cfg: Config) -> dict:
    return {"flow_sde": {"noise_level": cfg.sde.noise_level}, "cps": {"noise_level": cfg.sde.noise_level},
            "ddim": {"eta": cfg.sde.eta}, "ode": {}}[cfg.sampler]  # fmt: skip


def micro_batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@torch.no_grad()
def rollout(model, cond: PromptEmbeddings, x_init, noise, grid, cfg: Config) -> Trajectory:
    """Sample the local batch in micro-batches (the same ones the update uses, so that the update
    recomputes the rollout's log-probs bit for bit and on-policy ratios are exactly 1)."""
    trajs = []
    for mb in micro_batches(x_init.shape[0], cfg.rollout.micro_batch):
        c = cond.select(mb)
        trajs.append(sample_trajectory(
            lambda x, t: velocity(model, x, t, c, cfg.rollout.cfg), x_init[mb], grid, cfg.sampler,
            noise=noise[:, mb], sde_window=cfg.sde.window, convention=cfg.sde.logprob,
            min_std=cfg.sde.min_std, timestep_fraction=cfg.sde.timestep_fraction, **sde_params(cfg),
        ))  # fmt: skip
    first = trajs[0]
    return Trajectory(
        states=torch.cat([t.states for t in trajs], dim=1),
        velocities=torch.cat([t.velocities for t in trajs], dim=1),
        log_probs=torch.cat([t.log_probs for t in trajs], dim=1),
        grid=first.grid,
        trained=first.trained,
    )


class Estimator:
    """Clean estimates for the trainer through `EstimateEngine`, with the prompt conditioning held in
    persistent buffers (updated in place every iteration), so that on CUDA the substep forward is
    captured in a graph once and replayed in every later iteration."""

    def __init__(self, model, cfg_scale: float, use_cuda_graph: bool | str = "auto", batch: int = 0):
        """batch: states per transformer call (`rollout.estimate_batch`); 0, all of them at once."""
        if batch < 0:
            raise ValueError(f"batch must be >= 0 (0: all states at once), got {batch}")
        self.model, self.cfg_scale, self.batch = model, cfg_scale, batch
        self.cond: PromptEmbeddings | None = None
        self.engine = EstimateEngine(self._velocity, use_cuda_graph)

    def _velocity(self, x, t):
        return velocity(self.model, x, t, self.cond, self.cfg_scale)

    def _load(self, cond: PromptEmbeddings) -> None:
        new = cond.tensors()
        held = self.cond.tensors() if self.cond is not None else None
        same = held is not None and all(
            (x is None) == (held[k] is None) and (x is None or x.shape == held[k].shape) for k, x in new.items()
        )
        if not same:  # new buffers: the captured graphs read the old ones
            self.cond = cond.map(torch.clone)
            self.engine.reset()
            return
        for k, x in new.items():
            if x is not None:
                held[k].copy_(x)

    def __call__(self, cond: PromptEmbeddings, states, t, substeps: int, first_velocity=None, index=None,
                 calls_of: int = 0):  # fmt: skip
        """x0_hat of states [M, ...] at times t [M] (see `EstimateEngine`); state i is conditioned on
        prompt index[i] of `cond` (on its row i without `index`). With `batch` below M the states
        go through in chunks of `batch`, the last padded with repeats of the last state, so that
        every call has one shape (one CUDA graph) and memory is bounded by `batch`, not by M.
        `calls_of`: at least as many chunks as that many states would make (chunks of padding after
        the states): under ZeRO-3 every forward gathers the weights with the other ranks, which
        must make as many, and ranks may hold different numbers of distinct states."""
        m = states.shape[0]
        index = torch.arange(m) if index is None else torch.as_tensor(index).cpu()
        t = torch.as_tensor(t).to(states.device)
        size = self.batch if 0 < self.batch < m else m
        out = []
        for c in range(max(-(-m // size), -(-calls_of // self.batch) if self.batch else 1)):
            lo, hi = min(c * size, m), min((c + 1) * size, m)

            def chunk(x, lo=lo, hi=hi):  # rows lo..hi (a view), padded to `size` with the last state
                if hi - lo == size:
                    return x[lo:hi]
                return torch.cat([x[lo:hi], x[m - 1 :].expand(size - (hi - lo), *x.shape[1:])])

            self._load(cond.select(chunk(index)))
            v = None if first_velocity is None else chunk(first_velocity)
            out.append(self.engine(chunk(states), chunk(t), substeps, v)[: hi - lo])
        return out[0] if len(out) == 1 else torch.cat(out)


@torch.no_grad()
def estimate_images(pipe, estimator: Estimator, cond: PromptEmbeddings, traj: Trajectory, cfg: Config,
                    distinct: bool = True, prompts: list[str] | None = None) -> torch.Tensor:
    """Decoded clean estimates [T, B, 3, H, W] of states 0..T-1 in sampling order: all T x B of them
    as ONE batch per substep (per-sample times; the first substep reuses the rollout's velocity), or in
    chunks of `rollout.estimate_batch` states where that is set.

    distinct: estimate each distinct (state, time, prompt) once, the prompt known by its text in
    `prompts` (else by its embeddings: a row-wise unique that runs serially over each row on CUDA,
    slow at SD3.5's 333 x 4096 values per prompt). With shared initial noise
    (`rollout.same_latent`) a group's members start from one state and stay on one through the
    sampler's deterministic first steps (ddim's std is 0 at t = 1), so their estimates there are one
    image: 2 of the 10 states of the default run, computed once per group instead of once per member."""
    steps, b = traj.num_steps, traj.states.shape[1]
    shape = traj.states.shape[2:]
    index = torch.arange(b).repeat(steps)  # state j of sample i sits at j * B + i
    states = traj.states[:-1].reshape(steps * b, *shape)
    t = traj.grid[:-1].to(traj.states.device).repeat_interleave(b)
    first_velocity = traj.velocities.reshape(steps * b, *shape)
    keep = inverse = None
    if distinct and cfg.rollout.same_latent:
        if prompts is not None:
            if len(prompts) != b:
                raise ValueError(f"got {len(prompts)} prompts for {b} samples")
            known = {text: i for i, text in enumerate(dict.fromkeys(prompts))}
            prompt = torch.tensor([known[text] for text in prompts], device=states.device)
        else:
            prompt = torch.unique(cond.embeds.flatten(1), dim=0, return_inverse=True)[1].to(states.device)
        keep, inverse = distinct_rows(states, t, prompt[index.to(states.device)])
        index, states, t, first_velocity = index[keep.cpu()], states[keep], t[keep], first_velocity[keep]
    # under ZeRO-3 every rank makes as many forwards: the chunks of its states before the sharing
    # above (T x B on every rank), however many that left
    calls_of = steps * b if cfg.optim.zero_stage == 3 else 0
    x0 = estimator(cond, states, t, cfg.rollout.substeps, first_velocity=first_velocity, index=index,
                   calls_of=calls_of)  # fmt: skip
    images = decode(pipe, x0, cfg.rollout.decode_batch)
    if inverse is not None:
        images = images[inverse.to(images.device)]
    return images.reshape(steps, b, *images.shape[1:])


def distinct_rows(states: torch.Tensor, t: torch.Tensor, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep, inverse) for rows [M, ...] with times t [M] and prompt ids [M]: `keep` the first row of
    each set of rows equal in all three, in row order, and `inverse` each row's set, as a position in
    `keep` (so that rows[keep][inverse] gives every row back)."""
    key = torch.cat([states.flatten(1).float(), t[:, None].float(), prompt[:, None].float()], dim=1)
    _, sets = torch.unique(key, dim=0, return_inverse=True)
    m = key.shape[0]
    first = torch.full((int(sets.max()) + 1,), m, dtype=torch.long, device=key.device)
    first.scatter_reduce_(0, sets, torch.arange(m, device=key.device), reduce="amin")
    keep, order = first.sort()  # the sets by their first row
    position = torch.empty_like(order)
    position[order] = torch.arange(len(order), device=order.device)
    return keep, position[sets]


def submit_scores(scorer, images: torch.Tensor, prompts: list[str], metadata: list | None,
                  batch_size: int) -> list[tuple[int, Future]]:  # fmt: skip
    """Queue images [M, 3, H, W] for scoring in chunks of batch_size: (first image, future) per
    chunk, which `collect_scores` gathers."""
    pending = []
    for start in range(0, images.shape[0], batch_size):
        sl = slice(start, start + batch_size)
        future = scorer.submit(images[sl], prompts[sl], None if metadata is None else metadata[sl])
        pending.append((start, future))
        if future.done() and future.exception() is not None:  # scored inline, and failed: the rest would
            break  # too (a dead server, each after its retries); collect_scores raises this one
    return pending


def collect_scores(pending: list[tuple[int, Future]], describe=None) -> dict[str, torch.Tensor]:
    """The scores of every chunk, concatenated: {key: [M]}. The reward's error, if it raised; NaN
    or infinite scores with each image named by `describe(position)`, when given. A per-tag column
    (GenEval's, -10 for the images of other tags) that some chunks lack is -10 there; any other key
    that some chunks lack is an error, since its values would not line up with the images."""
    parts: dict[str, list[torch.Tensor]] = {}
    sizes = []
    for start, future in pending:
        try:
            out = future.result()
        except ScoreError as exc:
            if describe is None:
                raise
            raise exc.naming(lambda i: describe(start + i)) from None
        n = len(out["score"])
        for k, v in out.items():
            column = parts.setdefault(k, [torch.full((s,), -10.0) if is_tag_column(k) else None for s in sizes])
            column.append(torch.as_tensor(v, dtype=torch.float32).reshape(-1))
        for k, column in parts.items():
            if len(column) == len(sizes):  # not in this chunk
                column.append(torch.full((n,), -10.0) if is_tag_column(k) else None)
        sizes.append(n)
    uneven = sorted(k for k, column in parts.items() if any(v is None for v in column))
    if uneven:
        raise ValueError(f"the reward returned {uneven} for some batches of images only, so they cannot be "
                         "lined up with the images")  # fmt: skip
    return {k: torch.cat(v) for k, v in parts.items()}


def advantages(global_rewards: torch.Tensor, cfg: Config, prompts: list[str] | None = None) -> torch.Tensor:
    """Advantages [G * N, T] from the gathered rewards [G * N, T + 1] (group-major); `prompts`: each
    group's prompt text (flow_grpo pools the statistics of groups that share one, as Flow-GRPO does)."""
    g, n = cfg.rollout.groups, cfg.rollout.group_size
    r = global_rewards.reshape(g, n, -1)
    opts = {"eps": cfg.credit_opts.eps, "adv_clip": cfg.credit_opts.adv_clip}
    if cfg.credit == "flow_grpo":
        opts["global_std"] = cfg.credit_opts.global_std
        opts["prompts"] = prompts
    if cfg.credit == "turning_point":
        opts["balance"] = cfg.credit_opts.balance
    return credit.compute_advantages(cfg.credit, r, **opts).reshape(g * n, -1)


@dataclass
class UpdateStats:
    """An iteration's micro-step statistics: a key ending in _min or _max keeps its extreme, any other
    its total (the summary's mean)."""

    totals: dict[str, float] = field(default_factory=dict)
    count: int = 0
    weight: float = 0.0  # the micro-steps' loss weights summed (samples over the mean micro-batch's x step weight)
    first: dict[str, float] = field(default_factory=dict)  # the first micro-step's ratios (on-policy: exactly 1)
    grad_norms: list[float] = field(default_factory=list)

    def add(self, values: dict[str, float], weight: float = 1.0) -> None:
        """One micro-step's statistics; its means count by `weight`, as its loss does in the update."""
        if not self.first:
            self.first = {k: values[k] for k in ("ratio_mean", "ratio_min", "ratio_max")}
        for k, val in values.items():
            if k.endswith("_min"):
                self.totals[k] = min(self.totals.get(k, val), val)
            elif k.endswith("_max"):
                self.totals[k] = max(self.totals.get(k, val), val)
            else:
                self.totals[k] = self.totals.get(k, 0.0) + (val if weight == 1 else weight * val)
        self.count += 1
        self.weight += weight

    def summary(self) -> dict[str, float]:
        out = {k: v / (self.weight or 1) for k, v in self.totals.items() if not k.endswith(("_min", "_max"))}
        out.update({k: v for k, v in self.totals.items() if k.endswith(("_min", "_max"))})
        out.update({f"first_{k}": v for k, v in self.first.items()})
        if self.grad_norms:
            out["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        return out


def update(engine, cond: PromptEmbeddings, traj: Trajectory, adv: torch.Tensor, cfg: Config, ema=None) -> UpdateStats:
    """Backward through every trained step of every micro-batch; DeepSpeed accumulates the gradients
    and steps the optimizer `optim.updates_per_iteration` times (every accumulation boundary)."""
    params = sde_params(cfg)
    b = traj.states.shape[1]
    device = traj.states.device
    stats = UpdateStats()
    steps = traj.trained.nonzero().flatten().tolist()
    step_weight = step_weights(cfg, traj.grid, steps)
    batches = micro_batches(b, cfg.rollout.micro_batch)
    for mb in batches:
        # every sample weighs alike: DeepSpeed averages the micro-steps, each loss a mean over its own
        # samples, so when micro_batch does not divide the rank's samples (a smaller last micro-batch)
        # each micro-batch's loss is scaled by its size over the mean size (1 when they are equal)
        weight = (mb.stop - mb.start) * len(batches) / b
        c = cond.select(mb)
        for j in steps:
            x = traj.states[j, mb]
            # the times on the host for the SDE op, as the rollout passed them (the op's cached
            # coefficient table, no GPU read-back), on the device for the model
            t, s = traj.grid[j].expand(x.shape[0]), traj.grid[j + 1].expand(x.shape[0])
            t_model = t.to(device)
            v = velocity(engine, x, t_model, c, cfg.rollout.cfg)
            v_ref = None
            if cfg.optim.beta > 0:
                with torch.no_grad(), reference_policy(engine.module):
                    v_ref = velocity(engine.module, x, t_model, c, cfg.rollout.cfg)
            out = sde_logprob(cfg.sampler, x, v, t, s, traj.states[j + 1, mb], v_ref=v_ref,
                              convention=cfg.sde.logprob, **params)  # fmt: skip
            step = grpo_step_loss(out.log_prob, traj.log_probs[j, mb], adv[mb, j].to(device),
                                  clip_range=cfg.optim.clip_range, adv_clip=cfg.credit_opts.adv_clip,
                                  kl=out.kl, beta=cfg.optim.beta)  # fmt: skip
            w = weight * step_weight[j]
            engine.backward(step.loss if w == 1 else step.loss * w)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if boundary:
                norm = engine.get_global_grad_norm()
                if norm is not None:
                    stats.grad_norms.append(float(norm))
                if ema is not None:
                    ema.update(engine.module)
            stats.add(step.stats(), w)
    return stats


def step_weights(cfg: Config, grid: torch.Tensor, steps: list[int]) -> dict[int, float]:
    """Each trained step's weight in the update: 1 (`credit_opts.step_weights=uniform`), or with
    `tempflow` TempFlow-GRPO's noise-aware weight, the step's std over the mean std of the trained
    steps (mean 1). TempFlow-GRPO scales step k by sig_k sqrt(dt_k), which is flow_sde's step std;
    for ddim and cps, whose std has no sqrt(dt) factor, it is their step's std alike: the noise the
    step draws, which is what its log-probability can credit."""
    if cfg.credit_opts.step_weights == "uniform" or not steps:
        return {j: 1.0 for j in steps}
    index = torch.tensor(steps)
    std = sde.step_std(cfg.sampler, grid[index], grid[index + 1], **sde_params(cfg)).double()
    return dict(zip(steps, (std / std.mean()).tolist()))


def category_rewards(final: torch.Tensor, tags: list[str | None], group_size: int) -> dict[str, float]:
    """Mean final reward per prompt category in the batch, {"category/<tag>": mean}, from the
    gathered final rewards [G * N] (group-major) and the tag of each group's prompt (GenEval's
    metadata `tag`; groups without one are left out)."""
    per_group = final.reshape(len(tags), group_size).mean(1)
    out: dict[str, list[float]] = {}
    for tag, value in zip(tags, per_group.tolist()):
        if tag:
            out.setdefault(f"category/{tag}", []).append(value)
    return {k: sum(v) / len(v) for k, v in sorted(out.items())}


def gain_magnitudes(global_rewards: torch.Tensor) -> torch.Tensor:
    """Mean |r_{j+1} - r_j| per step over the batch [T]."""
    return (global_rewards[:, 1:] - global_rewards[:, :-1]).abs().mean(0)


def trained_steps(cfg: Config, grid: torch.Tensor | None = None) -> list[int]:
    """The steps the update trains: in the SDE window, with a std of at least sde.min_std on `grid`
    (the trainer's, whose shift is the model scheduler's; default the SD3 grid, shift 3), among the
    first int(sde.timestep_fraction x sde.steps)."""
    grid = sde.sd3_time_grid(cfg.sde.steps) if grid is None else grid
    trained = sde.trained_steps(cfg.sampler, grid, cfg.sde.window, cfg.sde.min_std, cfg.sde.timestep_fraction,
                                **sde_params(cfg))  # fmt: skip
    return trained.nonzero().flatten().tolist()
