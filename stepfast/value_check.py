"""How well do the clean-image estimates that stepwise credit rewards predict what a state leads to?

    python -m stepfast.value_check [--config default] [key=value ...] [--prompts 12] [--members 8]
                                   [--continuations 8] [--substeps 3,10] [--lora DIR] [--out FILE.json]

Stepwise credit scores each intermediate state x_j by the reward of its clean estimate (T' Euler
substeps to t = 0) and credits step j with the change of that reward. The credit is right where the
estimate's reward follows the state's value: the mean final reward of the sampler's continuations
from x_j. This draws, for a few prompts of rollout.prompts, a group of `--members` trajectories with
the run's sampler, guidance and initial-noise sharing, and for each state both the estimate's reward
(for each T' asked) and the value (the mean over `--continuations` draws of the rest of the rollout).
It prints, per state, the correlation of the two within a group (averaged over the groups where
both vary), and per step, the correlation of the estimate's gain with the value's gain and their
mean sizes. A step whose gain does not follow the value is credited with noise.

The value is itself a mean of a few draws, so every correlation is capped below 1 by its noise.
Step 0 is left out: with the initial noise shared in a group (rollout.same_latent) its gain is the
estimate at state 1 less a constant, the state-1 row again.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from stepfast import heldout, sde
from stepfast.config import ConfigError, load_config
from stepfast.data.prompts import PromptRecord, load_prompts
from stepfast.grpo import sde_params
from stepfast.models import check_device, load_lora, load_pipeline
from stepfast.policy import (
    check_resolution, decode, encode_prompts, grid_shift, latent_shape, resolve_model_path, velocity,
)
from stepfast.rollout import estimate_clean_images
from stepfast.startup import build_reward, check_prompts, check_reward_names


def group_correlation(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """The Pearson correlation of a [G, N] with b [G, N] within each group (row), averaged over the
    groups where both vary; (nan, 0) when none does."""
    values = []
    for x, y in zip(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)):
        if x.std() > 0 and y.std() > 0:
            values.append(float(np.corrcoef(x, y)[0, 1]))
    return (float(np.mean(values)) if values else math.nan), len(values)


def summarise(times: list[float], values: np.ndarray, estimates: dict[int, np.ndarray], final: np.ndarray) -> dict:
    """Rows per state and per step from values [G, N, S] and estimates {T': [G, N, S]} of the states
    1..S (times[k] the time of state k + 1) and the final rewards [G, N]. Step j goes from state j to
    state j + 1, the last one to the final image, whose value and estimate are its reward."""
    v = np.concatenate([values, final[..., None]], axis=-1)
    states, steps = [], []
    for k, t in enumerate(times):
        row = {"state": k + 1, "t": t, "value_spread": float(values[..., k].std(axis=1).mean())}
        for tp, est in estimates.items():
            row[f"corr_T{tp}"], row["groups"] = group_correlation(est[..., k], values[..., k])
            row[f"estimate_spread_T{tp}"] = float(est[..., k].std(axis=1).mean())
        states.append(row)
    for k in range(len(times)):
        dv = v[..., k + 1] - v[..., k]
        row = {"step": k + 1, "value_gain": float(np.abs(dv).mean())}
        for tp, est in estimates.items():
            e = np.concatenate([est, final[..., None]], axis=-1)
            de = e[..., k + 1] - e[..., k]
            row[f"corr_T{tp}"], row["groups"] = group_correlation(de, dv)
            row[f"gain_T{tp}"] = float(np.abs(de).mean())
        steps.append(row)
    return {"states": states, "steps": steps}


def format_tables(summary: dict, substeps: list[int]) -> str:
    def num(x):
        return "   nan" if math.isnan(x) else f"{x:+.2f}"

    head = "".join(f"  corr T'={tp:<3}" for tp in substeps)
    lines = [f"state      t{head}  value spread" + "".join(f"  est. spread T'={tp}" for tp in substeps)]
    for r in summary["states"]:
        lines.append(f"{r['state']:>5}  {r['t']:.3f}" + "".join(f"  {num(r[f'corr_T{tp}']):>11}" for tp in substeps)
                     + f"  {r['value_spread']:12.3f}"
                     + "".join(f"  {r[f'estimate_spread_T{tp}']:>16.3f}" for tp in substeps))  # fmt: skip
    lines += ["", f" step{head}  mean |value gain|" + "".join(f"  mean |gain| T'={tp}" for tp in substeps)]
    for r in summary["steps"]:
        lines.append(f"{r['step']:>5}" + "".join(f"  {num(r[f'corr_T{tp}']):>11}" for tp in substeps)
                     + f"  {r['value_gain']:17.3f}"
                     + "".join(f"  {r[f'gain_T{tp}']:>16.3f}" for tp in substeps))  # fmt: skip
    return "\n".join(lines)


class _Sampler:
    """The run's sampler on the model's grid: each step stochastic or ODE as a rollout takes it."""

    def __init__(self, cfg, grid: torch.Tensor):
        self.kind, self.grid, self.params = cfg.sampler, grid, sde_params(cfg)
        self.stochastic = sde.stochastic_steps(cfg.sampler, grid, cfg.sde.window, cfg.sde.min_std, **self.params)

    @torch.no_grad()
    def run(self, vel, x: torch.Tensor, start: int, generator: torch.Generator):
        """States start..T and the velocities at start..T-1, from x at grid[start]."""
        states, velocities = [x], []
        for j in range(start, self.grid.numel() - 1):
            t, s = self.grid[j].expand(x.shape[0]), self.grid[j + 1].expand(x.shape[0])
            v = vel(x, t.to(x.device)).float()
            kind = self.kind if self.stochastic[j] else "ode"
            noise = torch.randn(x.shape, generator=generator).to(x.device) if kind != "ode" else None
            x = sde.step(kind, x, v, t.to(x.device), s.to(x.device), noise=noise,
                         **(self.params if kind != "ode" else {})).sample  # fmt: skip
            states.append(x)
            velocities.append(v)
        return states, velocities


def measure(pipe, reward, records: list[PromptRecord], cfg, members: int, continuations: int, substeps: list[int],
            seed: int = 0, batch_size: int = 64, progress: bool = True) -> dict:  # fmt: skip
    """The summary (see `summarise`) of one group per prompt of `records`, drawn as the trainer
    draws a group with `cfg` (sampler, grid, guidance, resolution, shared initial noise)."""
    device = pipe.transformer.device
    grid = sde.sd3_time_grid(cfg.sde.steps, shift=grid_shift(pipe.scheduler.config))
    sampler = _Sampler(cfg, grid)
    last = grid.numel() - 1
    values, estimates, finals = [], {tp: [] for tp in substeps}, []

    def guided(cond):  # the velocity model of rows conditioned on `cond`, as the rollout guides it
        return lambda x, t: velocity(pipe.transformer, x, t, cond, cfg.rollout.cfg)

    def score(latents, record):
        images = torch.cat([decode(pipe, chunk) for chunk in latents.split(batch_size)])
        n = len(images)  # a record's metadata when its file has them, as the trainer passes them
        out = reward.score(images, [record.prompt] * n, [record.metadata] * n if record.metadata else None)
        return out["score"].double().numpy()

    for g, record in enumerate(tqdm(records, desc="value check", unit="prompt", disable=not progress)):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + g)
        shape = latent_shape(pipe, 1 if cfg.rollout.same_latent else members, cfg.rollout.resolution)
        x0 = torch.randn(shape, generator=gen).expand(members, *shape[1:]).contiguous().to(device)
        group = guided(encode_prompts(pipe, [record.prompt] * members, cfg.rollout.cfg, device))
        states, vels = sampler.run(group, x0, 0, gen)
        finals.append(score(states[-1], record))
        value = np.zeros((members, last - 1))
        est = {tp: np.zeros((members, last - 1)) for tp in substeps}
        for j in range(1, last):
            t = grid[j].expand(members).to(device)
            for tp in substeps:
                x = estimate_clean_images(group, states[j], t, tp, first_velocity=vels[j])
                est[tp][:, j - 1] = score(x, record)
            ends = []
            for chunk in states[j].repeat_interleave(continuations, 0).split(batch_size):
                rows = guided(encode_prompts(pipe, [record.prompt] * len(chunk), cfg.rollout.cfg, device))
                ends.append(sampler.run(rows, chunk, j, gen)[0][-1])
            value[:, j - 1] = score(torch.cat(ends), record).reshape(members, continuations).mean(1)
        values.append(value)
        for tp in substeps:
            estimates[tp].append(est[tp])
    times = [float(grid[j]) for j in range(1, last)]
    return summarise(times, np.stack(values), {tp: np.stack(e) for tp, e in estimates.items()}, np.stack(finals))


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _substeps(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers such as 3,10, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every T' must be at least 1, got {text!r}")
    return list(dict.fromkeys(values))


def main(argv: list[str] | None = None) -> dict:
    head, _usage, *rest = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="python -m stepfast.value_check", description="\n\n".join([head, *rest]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", default="default",
                   help="preset or YAML file, as train.py takes (default: %(default)s)")
    p.add_argument("overrides", nargs="*",
                   help="key=value overrides, as train.py takes (model.path=DIR, rollout.prompts=FILE, ...)")
    p.add_argument("--prompts", type=_positive, default=12,
                   help="prompts of rollout.prompts, spread over their categories (default: 12)")
    p.add_argument("--members", type=int, default=8, help="trajectories a prompt (default: 8; at least 2)")
    p.add_argument("--continuations", type=_positive, default=8,
                   help="draws of the rest of the rollout a state (default: 8)")
    p.add_argument("--substeps", type=_substeps, default=None,
                   help="T' values to compare, e.g. 3,10 (default: rollout.substeps)")
    p.add_argument("--lora", default=None, help="LoRA weights to load first (a checkpoint's lora/ folder)")
    p.add_argument("--seed", type=int, default=0, help="seed of the noise drawn (default: 0)")
    p.add_argument("--batch-size", type=_positive, default=64, help="latents a forward or decode (default: 64)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda when there is a GPU)")
    p.add_argument("--out", default=None, help="also write the tables as JSON to this file")
    args = p.parse_intermixed_args(argv)
    if args.members < 2:
        p.error(f"--members must be at least 2: a correlation within a group needs two trajectories, "
                f"got {args.members}")
    try:
        cfg = load_config(args.config, args.overrides)
        check_reward_names(cfg)
        records = load_prompts(cfg.rollout.prompts)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        p.error(str(exc))
    out = Path(args.out) if args.out else None
    if out is not None and not out.parent.is_dir():
        p.error(f"--out: folder {out.parent} does not exist")
    try:
        device = check_device(args.device)
        pipe = load_pipeline(resolve_model_path(cfg.model.path), device=device)
        check_resolution(pipe, cfg.rollout.resolution, "rollout.resolution")
        if args.lora:
            load_lora(pipe, args.lora)
        reward = build_reward(cfg, device)
    except (ConfigError, FileNotFoundError, NotADirectoryError, ValueError) as exc:
        p.error(str(exc))
    records = [records[i] for i in heldout.spread_indices([r.metadata or {} for r in records], args.prompts)]
    try:  # a prompt the reward cannot score, named by its line before anything is drawn
        check_prompts(reward, records, "rollout.prompts", cfg.rollout.prompts)
    except ConfigError as exc:
        p.error(str(exc))
    substeps = args.substeps or [cfg.rollout.substeps]
    summary = measure(pipe, reward, records, cfg, args.members, args.continuations, substeps, args.seed,
                      args.batch_size)
    summary["settings"] = {"config": args.config, "overrides": args.overrides,
                           "prompts": [r.prompt for r in records], "members": args.members,
                           "continuations": args.continuations, "substeps": substeps, "lora": args.lora,
                           "seed": args.seed}  # fmt: skip
    print(format_tables(summary, substeps))
    if out is not None:
        out.write_text(json.dumps(summary, indent=1))
        print(f"wrote {out}")
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
