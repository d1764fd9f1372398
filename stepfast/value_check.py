"""How well do the clean-image estimates that stepwise credit rewards predict what a state leads to?

    python -m stepfast.value_check [--config default] [key=value ...] [--prompts 12] [--members N]
                                   [--continuations 8] [--substeps 3,10] [--lora DIR] [--seed N]
                                   [--out FILE.json] [--overwrite]

Stepwise credit scores each state x_j of a trajectory by the reward of its clean estimate (T' Euler
substeps to t = 0) and credits step j with the change of that reward. The credit is right where the
estimate's reward follows the state's value: the mean final reward of the sampler's continuations
from x_j. This draws, for a few prompts of rollout.prompts, a group of trajectories as a run with
the same settings draws one (sampler, time grid, guidance, resolution, shared initial noise), and
for each state both the estimate's reward (for each T' asked) and the value (the mean over
`--continuations` draws of the rest of the rollout).

It prints, per state, the correlation of the two within a group (averaged over the groups where
both vary), their spreads over a group's members, and the value's noise: the standard error of a
mean of that many draws. Per step, it prints the correlation of the estimate's gain with the value's
gain, and their mean sizes beside the size a value gain has from that noise alone. Where the value
spreads little more than its noise, no estimate can be seen to follow it; where the estimate's gains
are much larger than the value's, they are mostly not the value's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable

if __name__ == "__main__":  # before the imports below (seconds): a Ctrl-C among them is a line, not a traceback
    from stepfast import quiet_ctrl_c_while_starting

    quiet_ctrl_c_while_starting("python -m stepfast.value_check")

import numpy as np
import torch
from tqdm import tqdm

from stepfast import heldout, sde
from stepfast.config import ConfigError, load_config
from stepfast.data.prompts import PromptRecord, load_prompts
from stepfast.files import path_argument, write_atomically
from stepfast.grpo import sde_params
from stepfast.models import check_device, load_lora, load_pipeline, lora_weights_file
from stepfast.policy import (
    DTYPES, check_resolution, decode, encode_prompts, grid_shift, latent_shape, resolve_model_path, velocity,
)
from stepfast.rollout import Velocity, estimate_clean_images
from stepfast.startup import build_reward, check_prompts, check_reward_names, check_servers


def group_correlation(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """The Pearson correlation of a [G, N] with b [G, N] within each group (row), averaged over the
    groups where both vary (by more than rounding); (nan, 0) when none does."""
    values = []
    for x, y in zip(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)):
        if x.std() > 1e-9 and y.std() > 1e-9:
            values.append(float(np.corrcoef(x, y)[0, 1]))
    return (float(np.mean(values)) if values else math.nan), len(values)


class Sampler:
    """The run's sampler on a time grid: each step `kind` or ODE as a rollout takes it (the SDE
    window, steps whose std is under min_std), its noise drawn from a generator on the CPU."""

    def __init__(self, kind: str, grid: torch.Tensor, window=None, min_std: float = sde.DEGENERATE_STD, **params):
        self.kind, self.grid, self.params = kind, grid, params
        self.stochastic = sde.stochastic_steps(kind, grid, window, min_std, **params)

    @torch.no_grad()
    def run(self, vel: Velocity, x: torch.Tensor, start: int, generator: torch.Generator):
        """States start..T and the velocities at states start..T-1, from x at grid[start]."""
        states, velocities = [x], []
        for j in range(start, self.grid.numel() - 1):
            t, s = self.grid[j].expand(x.shape[0]).to(x.device), self.grid[j + 1].expand(x.shape[0]).to(x.device)
            v = vel(x, t).float()
            if self.stochastic[j]:
                noise = torch.randn(x.shape, generator=generator).to(x.device)
                x = sde.step(self.kind, x, v, t, s, noise=noise, **self.params).sample
            else:
                x = sde.step("ode", x, v, t, s).sample
            states.append(x)
            velocities.append(v)
        return states, velocities


def draw_group(sampler: Sampler, vel_for: Callable[[int], Velocity], x0: torch.Tensor, continuations: int,
               substeps: list[int], score: Callable[[torch.Tensor], np.ndarray], generator: torch.Generator,
               batch_size: int = 64) -> dict:  # fmt: skip
    """One group from x0 [N, ...]: per state j = 0..T-1, each member's value (the mean `score` of
    `continuations` runs of the sampler from it; "value" [N, T]) with that mean's standard error
    ("value_se" [N, T]) and the score of its clean estimate for each T' ("estimates" {T': [N, T]});
    and the final scores ("final" [N]). `vel_for(n)` is the velocity model of n rows of the group's
    prompt; the first substep of an estimate reuses the velocity the trajectory took at the state."""
    members, last = x0.shape[0], sampler.grid.numel() - 1
    states, vels = sampler.run(vel_for(members), x0, 0, generator)
    value, value_se = np.zeros((members, last)), np.zeros((members, last))
    estimates = {tp: np.zeros((members, last)) for tp in substeps}
    for j in range(last):
        t = sampler.grid[j].expand(members).to(x0.device)
        for tp in substeps:
            x0_hat = estimate_clean_images(vel_for(members), states[j], t, tp, first_velocity=vels[j])
            estimates[tp][:, j] = score(x0_hat)
        ends = [sampler.run(vel_for(len(chunk)), chunk, j, generator)[0][-1]
                for chunk in states[j].repeat_interleave(continuations, 0).split(batch_size)]  # fmt: skip
        draws = score(torch.cat(ends)).reshape(members, continuations)
        value[:, j] = draws.mean(1)
        value_se[:, j] = draws.std(1, ddof=1) / math.sqrt(continuations) if continuations > 1 else math.nan
    return {"value": value, "value_se": value_se, "estimates": estimates, "final": score(states[-1])}


def summarise(times: list[float], groups: list[dict]) -> dict:
    """Rows per state j = 0..T-1 (times[j] its time) and per step (state j -> j + 1, the last one
    to the final image, whose value and estimate are its score) from `draw_group`'s groups."""
    value = np.stack([g["value"] for g in groups])  # [G, N, T]
    se = np.stack([g["value_se"] for g in groups])
    final = np.stack([g["final"] for g in groups])[..., None]
    estimates = {tp: np.stack([g["estimates"][tp] for g in groups]) for tp in groups[0]["estimates"]}
    v = np.concatenate([value, final], axis=-1)  # the final image ends the last step, for values and estimates
    e = {tp: np.concatenate([est, final], axis=-1) for tp, est in estimates.items()}
    states, steps = [], []
    for j, t in enumerate(times):
        row = {"state": j, "t": t, "value_spread": float(value[..., j].std(axis=1).mean()),
               "value_noise": float(np.sqrt((se[..., j] ** 2).mean()))}  # fmt: skip
        for tp, est in estimates.items():
            row[f"corr_T{tp}"], row[f"groups_T{tp}"] = group_correlation(est[..., j], value[..., j])
            row[f"estimate_spread_T{tp}"] = float(est[..., j].std(axis=1).mean())
        states.append(row)
    for j in range(len(times)):
        dv = v[..., j + 1] - v[..., j]
        # a value gain's size from the draws' noise alone: |N(0, se_j^2 + se_j+1^2)| on average
        noise_var = se[..., j] ** 2 + (se[..., j + 1] ** 2 if j + 1 < len(times) else 0.0)
        row = {"step": j, "value_gain": float(np.abs(dv).mean()),
               "value_gain_noise": float(np.sqrt(2 / math.pi) * np.sqrt(noise_var).mean())}  # fmt: skip
        for tp, est in e.items():
            de = est[..., j + 1] - est[..., j]
            row[f"corr_T{tp}"], row[f"groups_T{tp}"] = group_correlation(de, dv)
            row[f"gain_T{tp}"] = float(np.abs(de).mean())
        steps.append(row)
    return {"states": states, "steps": steps}


def format_tables(summary: dict, substeps: list[int]) -> str:
    def table(rows, columns):
        header = "  ".join(f"{name:>{width}}" for name, width, _ in columns)
        lines = [header]
        for r in rows:
            cells = []
            for name, width, cell in columns:
                x = cell(r)
                if not isinstance(x, str):
                    digits = 2 if name.startswith("corr") else 3
                    x = round(x, digits) + 0.0  # a correlation of -0.004 reads +0.00, not -0.00
                    x = "nan" if math.isnan(x) else f"{x:+.{digits}f}" if digits == 2 else f"{x:.{digits}f}"
                cells.append(f"{x:>{width}}")
            lines.append("  ".join(cells))
        return lines

    corr = [(f"corr T'={tp}", len(f"corr T'={tp}"), lambda r, tp=tp: r[f"corr_T{tp}"]) for tp in substeps]
    state_cols = [("state", 5, lambda r: str(r["state"])), ("t", 5, lambda r: f"{r['t']:.3f}"), *corr,
                  ("value spread", 12, lambda r: r["value_spread"]), ("value noise", 11, lambda r: r["value_noise"]),
                  *[(f"est. spread T'={tp}", len(f"est. spread T'={tp}"), lambda r, tp=tp: r[f"estimate_spread_T{tp}"])
                    for tp in substeps]]  # fmt: skip
    step_cols = [("step", 5, lambda r: str(r["step"])), *corr,
                 ("mean |value gain|", 17, lambda r: r["value_gain"]),
                 ("from noise", 10, lambda r: r["value_gain_noise"]),
                 *[(f"mean |gain| T'={tp}", len(f"mean |gain| T'={tp}"), lambda r, tp=tp: r[f"gain_T{tp}"])
                   for tp in substeps]]  # fmt: skip
    return "\n".join(table(summary["states"], state_cols) + [""] + table(summary["steps"], step_cols))


def measure(pipe, reward, records: list[PromptRecord], cfg, members: int, continuations: int, substeps: list[int],
            seed: int = 0, batch_size: int = 64, progress: bool = True) -> dict:  # fmt: skip
    """The summary (see `summarise`) of one group per prompt of `records`, drawn as the trainer
    draws a group with `cfg` (sampler, grid, guidance, resolution, shared initial noise)."""
    device = pipe.transformer.device
    grid = sde.sd3_time_grid(cfg.sde.steps, shift=grid_shift(pipe.scheduler.config))
    sampler = Sampler(cfg.sampler, grid, cfg.sde.window, cfg.sde.min_std, **sde_params(cfg))
    groups = []
    for g, record in enumerate(tqdm(records, desc="value check", unit="prompt", disable=not progress)):
        embeddings = {}

        def vel_for(n, record=record, embeddings=embeddings):  # n rows of the prompt, guided as the rollout
            if n not in embeddings:
                embeddings[n] = encode_prompts(pipe, [record.prompt] * n, cfg.rollout.cfg, device)
            return lambda x, t: velocity(pipe.transformer, x, t, embeddings[n], cfg.rollout.cfg)

        def score(latents, record=record):  # the metadata of a record that has them, as the trainer passes
            images = torch.cat([decode(pipe, chunk) for chunk in latents.split(batch_size)])
            n = len(images)
            out = reward.score(images, [record.prompt] * n, [record.metadata] * n if record.metadata else None)
            return torch.as_tensor(out["score"]).double().cpu().numpy()

        gen = torch.Generator().manual_seed((seed * 1_000_003 + g) & (2**63 - 1))  # any seed < 2**63
        shape = latent_shape(pipe, 1 if cfg.rollout.same_latent else members, cfg.rollout.resolution)
        x0 = torch.randn(shape, generator=gen).expand(members, *shape[1:]).contiguous().to(device)
        groups.append(draw_group(sampler, vel_for, x0, continuations, substeps, score, gen, batch_size))
    return summarise([float(t) for t in grid[:-1]], groups)


def _whole(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _seed(text: str) -> int:
    value = _whole(0)(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"must be below 2**63 (a 64-bit generator seed), got {value}")
    return value


def _substeps(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers such as 3,10, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every T' must be at least 1, got {text!r}")
    return list(dict.fromkeys(values))


def _json_safe(x):
    """NaN as null: JSON has no NaN."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> dict:
    head, _usage, *rest = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="python -m stepfast.value_check", description="\n\n".join([head, *rest]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", default="default",
                   help="preset or YAML file, as train.py takes (default: %(default)s)")
    p.add_argument("overrides", nargs="*",
                   help="key=value overrides, as train.py takes (model.path=DIR, rollout.prompts=FILE, ...)")
    p.add_argument("--prompts", type=_whole(1), default=12,
                   help="prompts of rollout.prompts, spread over their categories where they have them (default: 12)")
    p.add_argument("--members", type=_whole(2), default=None,
                   help="trajectories a prompt, at least 2 (default: rollout.group_size)")
    p.add_argument("--continuations", type=_whole(2), default=8,
                   help="draws of the rest of the rollout a state, at least 2 (default: 8)")
    p.add_argument("--substeps", type=_substeps, default=None,
                   help="T' values to compare, e.g. 3,10 (default: rollout.substeps)")
    p.add_argument("--lora", type=path_argument, default=None, help="LoRA weights to load first (a checkpoint's lora/ folder)")
    p.add_argument("--seed", type=_seed, default=None, help="seed of the noise drawn (default: the config's seed)")
    p.add_argument("--batch-size", type=_whole(1), default=64,
                   help="latents a continuation or decode call (default: 64)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda when there is a GPU)")
    p.add_argument("--out", type=path_argument, default=None, help="also write the tables as JSON to this file")
    p.add_argument("--overwrite", action="store_true", help="replace a file already at --out")
    args = p.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        check_reward_names(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        p.error(str(exc))
    try:
        records = load_prompts(cfg.rollout.prompts)
    except (FileNotFoundError, ValueError) as exc:
        p.error(f"rollout.prompts: {exc}")
    seed = cfg.seed if args.seed is None else args.seed
    out = Path(args.out) if args.out is not None else None
    if out is not None and not out.parent.is_dir():
        what = "is a file, not a folder" if out.parent.exists() else "does not exist"
        p.error(f"--out: folder {out.parent} {what}")
    if out is not None and out.is_dir():
        p.error(f"--out: {out} is a folder; give a file name (such as {out / 'value_check.json'})")
    if out is not None and out.exists() and not args.overwrite:
        p.error(f"--out: {out} already exists: give another --out, or --overwrite to replace it")
    if args.lora is not None:  # before the model loads: a mistyped path is seen at once
        try:
            lora_weights_file(args.lora)
        except (FileNotFoundError, ValueError) as exc:
            p.error(f"--lora: {exc}")
    try:
        device = check_device(args.device)
    except ValueError as exc:
        p.error(f"--device: {exc}")
    try:
        reward = build_reward(cfg, device)
    except (ConfigError, ValueError) as exc:
        p.error(str(exc))
    try:  # a prompt the reward cannot score, named by its line, and a reward server out of reach: before drawing
        check_prompts(reward, records, "rollout.prompts", cfg.rollout.prompts)
        check_servers({f"reward.options.{name}": part for name, part in reward.rewards.items()},
                      size=cfg.rollout.resolution)  # fmt: skip
    except ConfigError as exc:
        p.error(str(exc))
    # plain prompts (a .txt file) get the record the reward parses them into, with its category
    parse = next((r.record for r in reward.rewards.values() if hasattr(r, "record")), None)
    tags = [r.metadata or (dict(parse(r.prompt)) if parse else {}) for r in records]
    records = [records[i] for i in heldout.spread_indices(tags, args.prompts)]
    try:
        pipe = load_pipeline(resolve_model_path(cfg.model.path), dtype=DTYPES[cfg.model.dtype], device=device)
    except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
        p.error(f"model.path: {exc}")
    try:
        check_resolution(pipe, cfg.rollout.resolution, "rollout.resolution")
    except ValueError as exc:
        p.error(str(exc))
    try:
        if args.lora:
            load_lora(pipe, args.lora)
    except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
        p.error(f"--lora: {exc}")
    substeps = args.substeps or [cfg.rollout.substeps]
    members = args.members or cfg.rollout.group_size
    summary = measure(pipe, reward, records, cfg, members, args.continuations, substeps, seed, args.batch_size)
    summary["settings"] = {"config": args.config, "overrides": args.overrides,
                           "prompts": [r.prompt for r in records], "members": members,
                           "continuations": args.continuations, "substeps": substeps, "lora": args.lora,
                           "seed": seed}  # fmt: skip
    print(format_tables(summary, substeps))
    if out is not None:
        write_atomically(out, lambda tmp: tmp.write_text(json.dumps(_json_safe(summary), indent=1)))
        print(f"wrote {out}")
    return summary


def cli(argv: list[str] | None = None) -> int:
    """`python -m stepfast.value_check`: main(), with Ctrl-C a line, not a traceback (--out is
    written at the end, so nothing is half-written), and exit status 130."""
    try:
        main(argv)
    except KeyboardInterrupt:
        print("\npython -m stepfast.value_check: interrupted (--out is written at the end)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    from stepfast import ctrl_c_as_usual

    ctrl_c_as_usual()
    sys.exit(cli())
