"""The start of a run, before it trains: the rewards it builds and what it checks first.

Each check fails with a ConfigError that names the setting at fault (a file and line for a prompt):
`check_reward_names` from the configuration alone; `check_before_start` from the files it names
(output_dir, resume, model.path and the iteration its scheduler lays out, the prompt files, the
rewards' local paths), before the process group starts; `check_prompts` and `check_servers` once
the rewards are built, before the model is loaded. `stepfast/train.py` calls them in that order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import torch

from stepfast import checkpoint, grpo, rewards, sde
from stepfast.config import ConfigError, load_config, shown
from stepfast.data.prompts import PromptRecord, load_prompts, resolve_prompt_file
from stepfast.files import RunLock, check_creatable_dir
from stepfast.models import check_pipeline_dir
from stepfast.policy import cut_prompts, grid_shift, resolve_model_path, token_limits
from stepfast.rewards import PromptError


class PromptFiles(NamedTuple):
    """The prompt files a run reads, read once, before the process group starts."""

    train: list[PromptRecord]  # rollout.prompts
    eval: list[PromptRecord] | None  # eval.prompts, when the run evaluates


def build_reward(cfg, device: torch.device):
    """The weighted training reward of reward.weights, each part with its reward.options (a model
    reward on this rank's device unless they set one); a ConfigError for a part built without an
    option it needs (TypeError) or with a bad one."""
    try:
        options = {name: rewards.with_device(name, cfg.reward.options.get(name), device) for name in cfg.reward.weights}
        return rewards.load_weighted(cfg.reward.weights, options)
    except (TypeError, ValueError, OSError) as exc:  # OSError: a model reward's files, named with it
        raise ConfigError(f"reward.weights / reward.options: {exc}") from exc


def build_eval_reward(cfg, device: torch.device, train_reward=None):
    """The reward that scores held-out samples (eval.reward), with the options reward.options gives
    it, as a train reward has; a ConfigError naming the setting for a bad name or options, or for a
    model whose files do not load. When it is a part of `train_reward` (a WeightedReward), that
    part, built with the same options: a second PickScore would take another 4 GB of the GPU."""
    if train_reward is not None and cfg.eval.reward in train_reward.rewards:
        return train_reward.rewards[cfg.eval.reward]
    try:
        options = rewards.with_device(cfg.eval.reward, cfg.reward.options.get(cfg.eval.reward), device)
        return rewards.load(cfg.eval.reward, **options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"eval.reward: {exc}") from exc
    except OSError as exc:  # a model reward's files (a directory without the weights, say)
        raise ConfigError(f"eval.reward={cfg.eval.reward} (reward.options.{cfg.eval.reward}): "
                          f"{' '.join(str(exc).split())}") from exc  # fmt: skip


def cut_prompt_warning(pipe, texts: list[str], where: str, line_of=None) -> str | None:
    """A warning when some of `texts` are longer than a text encoder of `pipe` takes: they are cut
    there when encoded (as diffusers encodes them, Flow-GRPO's runs included). `where`: the setting
    or option that names them; `line_of(i)`: where prompt i is (`path:line`), for the first one cut."""
    cut = cut_prompts(pipe, texts) if texts else []
    if not cut:
        return None
    limits = {("T5" if name == "tokenizer_3" else "CLIP"): limit for name, limit in token_limits(pipe).items()}
    first = cut[0]
    at = f"{line_of(first)} " if line_of else ""
    return (
        f"{where}: {len(cut)} of {len(texts)} prompts are longer than the text encoders take "
        f"({', '.join(f'{k} {v}' for k, v in limits.items())} tokens) and are cut there when encoded (a "
        f"reward reads the text as its own model takes it); the first: {at}{texts[first]!r}"
    )


def check_prompts(reward, records: list[PromptRecord], setting: str, source: str) -> None:
    """A ConfigError naming the file and line of a prompt that `reward` (if it can check prompts)
    could not score: found at start, not after the first images are drawn. `setting`: the key that
    names the prompt file, `source` its value."""
    if not hasattr(reward, "check"):
        return
    try:
        reward.check([r.prompt for r in records], [r.metadata for r in records])
    except PromptError as exc:
        line = records[exc.index].line if 0 <= exc.index < len(records) else None
        where = f"{resolve_prompt_file(source)}:{line}" if line else f"{source}, prompt {exc.index + 1}"
        raise ConfigError(f"{setting}: {where}: {exc.by()}{exc.reason}") from None
    except ValueError as exc:
        raise ConfigError(f"{setting}={source}: {exc}") from None


def check_servers(by_setting: dict[str, object], world: int = 1, size: int | None = None) -> None:
    """A ConfigError naming the setting when a reward scored by a server (`remote`) cannot reach it,
    the server does not serve what it asks for, or takes fewer pixels a request than one image of
    `size` x `size` has: found at start, not after the first rollout. `by_setting`: each reward by
    the setting that names it. Every rank asks (each scores through its
    own client, and may reach another server), and with several ranks every one stops when one
    fails: a server answers each of them on its own, unlike the files the other checks read."""
    error = None
    for key, reward in by_setting.items():
        if hasattr(reward, "check_server"):
            try:
                reward.check_server(size=size)
            except ValueError as exc:
                error = f"{key}: {exc}"
                break
    if world > 1 and any(hasattr(reward, "check_server") for reward in by_setting.values()):
        errors = [None] * world
        torch.distributed.all_gather_object(errors, error)
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if failed and error is None:
            rank, error = failed[0]
            error = f"(on rank {rank}) {error}"
    if error is not None:
        raise ConfigError(error)


def check_reward_names(cfg) -> None:
    """A ConfigError naming the setting (reward.weights, eval.reward) that names a reward neither
    registered nor given as an import path, with the registered name closest to it."""
    named = {f"reward.weights.{name}": name for name in cfg.reward.weights}
    if cfg.eval.enabled:
        named["eval.reward"] = cfg.eval.reward
    for key, name in named.items():
        try:
            rewards.check_name(name)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from None


def cut_prompt_warnings(pipe, files: dict[str, tuple[str, list[PromptRecord] | None]]) -> list[str]:
    """`cut_prompt_warning` for each prompt file by the setting that names it (setting: (source,
    records); records None or empty when the file is not read, as eval.prompts without evaluation),
    the first cut prompt named by `path:line`."""
    warnings = []
    for setting, (source, records) in files.items():
        if records:
            lines = [f"{resolve_prompt_file(source)}:{r.line}" for r in records]
            warning = cut_prompt_warning(pipe, [r.prompt for r in records], setting, lines.__getitem__)
            warnings += [warning] if warning else []
    return warnings


def tag_problem(records: list[PromptRecord], source) -> str | None:
    """The first line whose GenEval 'tag' (a prompt's category, which the held-out table, the report
    and rollout.balance_categories group by) is there but not text, as `path:line: ...`; else None."""
    for record in records:
        tag = (record.metadata or {}).get("tag")
        if tag is not None and not isinstance(tag, str):
            return f"{resolve_prompt_file(source)}:{record.line}: 'tag' must be text (a category name), got {tag!r}"
    return None


def untagged_problem(records: list[PromptRecord], source) -> str | None:
    """rollout.balance_categories draws each group from a category: the first prompt with no GenEval
    'tag' to draw it by, as `path:line`, with how to train without; else None."""
    for record in records:
        if not (record.metadata or {}).get("tag"):
            return (f"rollout.balance_categories=true needs a 'tag' in every prompt's metadata (GenEval "
                    f"*_metadata.jsonl); line {record.line} of {resolve_prompt_file(source)} ({record.prompt!r}) "
                    f"has none (rollout.balance_categories=false balances none)")  # fmt: skip
    return None


def check_before_start(cfg) -> PromptFiles:
    """What can be checked from the files alone, before the process group (and a first start's build
    of DeepSpeed's op) and the model: a ConfigError naming output_dir when the run could not write
    there or a new run would write over one, resume when its checkpoint is not there, model.path
    when it holds no SD3 pipeline, or a prompt file that cannot be read or has no category to balance
(its line). Returns the
    prompt files read. (Reward names are checked with the configuration, before, by
    `check_reward_names`.) Every such setting at fault is named in the one error, so that a preset
    whose paths are all elsewhere on this machine is fixed in one go."""
    errors = []
    try:
        model_dir = resolve_model_path(cfg.model.path)
        check_pipeline_dir(model_dir)
    except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
        errors.append(f"model.path: {exc}")
    else:  # the steps trained depend on the model's time grid (its scheduler's shift)
        steps = trained_steps_of(cfg)
        if steps is not None and (problem := iteration_problem(cfg, steps, int(os.environ.get("WORLD_SIZE", "1")))):
            errors.append(problem)
    prompt_files = {"rollout.prompts": cfg.rollout.prompts}
    if cfg.eval.enabled:
        prompt_files["eval.prompts"] = cfg.eval.prompts
    read = {}
    for key, source in prompt_files.items():
        try:
            read[key] = load_prompts(source)
        except (FileNotFoundError, ValueError) as exc:
            errors.append(f"{key}: {exc}")
        else:
            if problem := tag_problem(read[key], source):
                errors.append(f"{key}: {problem}")
            elif key == "rollout.prompts" and cfg.rollout.balance_categories:
                if problem := untagged_problem(read[key], source):
                    errors.append(problem)
    errors += missing_reward_paths(cfg)
    try:
        check_creatable_dir(cfg.output_dir)
    except ValueError as exc:
        errors.append(f"output_dir: {exc}")
    else:  # a folder that could not be checked is named above; its files cannot be read either
        if problem := inside_checkpoints(Path(cfg.output_dir)):
            errors.append(problem)
        elif problem := another_run_there(Path(cfg.output_dir)):
            errors.append(problem)
        elif cfg.resume == "none" and (problem := run_in_the_way(Path(cfg.output_dir))):
            errors.append(problem)
    resumed = None
    if cfg.resume not in ("none", "auto"):
        try:
            problem = resume_problem(Path(cfg.resume))
        except OSError as exc:
            problem = f"cannot check {cfg.resume!r}: {exc.strerror or exc}"
        if problem:
            errors.append(f"resume: {problem}")
        else:
            resumed = Path(cfg.resume)
    elif cfg.resume == "auto" and Path(cfg.output_dir).is_dir():
        resumed = checkpoint.latest(Path(cfg.output_dir))
    if resumed is not None and (problem := engine_settings_problem(cfg, resumed)):
        errors.append(problem)
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError(f"{len(errors)} settings name what cannot be used here:\n  " + "\n  ".join(errors))
    return PromptFiles(read["rollout.prompts"], read.get("eval.prompts"))


def scheduler_shift(model_dir: Path) -> float | None:
    """The time-grid shift of the pipeline's scheduler, read as the trainer reads it from the loaded
    pipeline (`policy.grid_shift` of the config diffusers builds: the class's default where
    scheduler_config.json sets none), or None when it cannot be read: loading the pipeline names that."""
    try:
        import diffusers

        _, name = json.loads((Path(model_dir) / "model_index.json").read_text())["scheduler"]
        cls = getattr(diffusers, name)
        return grid_shift(cls.from_config(cls.load_config(Path(model_dir) / "scheduler")).config)
    except Exception:  # noqa: BLE001 (an unreadable or unknown scheduler: the load says what it is)
        return None


def trained_steps_of(cfg) -> list[int] | None:
    """The steps the update trains (grpo.trained_steps) on the time grid of cfg.model.path's scheduler,
    read from its files as the trainer reads it from the loaded pipeline; None when they cannot be
    read (loading the pipeline names why)."""
    shift = scheduler_shift(Path(resolve_model_path(cfg.model.path)))
    return None if shift is None else grpo.trained_steps(cfg, sde.sd3_time_grid(cfg.sde.steps, shift=shift))


def iteration_problem(cfg, steps: list[int], world: int) -> str | None:
    """What keeps an iteration from being laid out on `world` ranks with the trained `steps` (see
    grpo.trained_steps): no step trained, samples that do not split over the ranks, or
    optim.updates_per_iteration not dividing the backward passes; None when it can be."""
    if not steps:
        return (
            f"sampler {cfg.sampler!r} with sde.steps={cfg.sde.steps}, sde.window={cfg.sde.window}, "
            f"sde.min_std={cfg.sde.min_std} and sde.timestep_fraction={cfg.sde.timestep_fraction} trains no "
            "step (every step is an ODE step, has a smaller std, or comes after the fraction trained)"
        )
    total = cfg.rollout.groups * cfg.rollout.group_size
    if total % world:
        return (f"rollout.groups x rollout.group_size = {cfg.rollout.groups} x {cfg.rollout.group_size} = {total} "
                f"samples do not split evenly over {world} ranks")  # fmt: skip
    per_rank = total // world
    micro = len(grpo.micro_batches(per_rank, cfg.rollout.micro_batch))
    calls = len(steps) * micro
    if calls % cfg.optim.updates_per_iteration:
        return (
            f"optim.updates_per_iteration={cfg.optim.updates_per_iteration} must divide the {calls} backward "
            f"passes of an iteration: {len(steps)} trained steps x {micro} micro-batch(es) of "
            f"rollout.micro_batch={cfg.rollout.micro_batch} from this rank's {per_rank} samples; change one of them"
        )
    return None


def settings_file(resumed: Path, iteration: int) -> Path | None:
    """The settings the iterations of checkpoint `resumed` (at `iteration`) ran with: its run's
    config.yaml, or the config-until-<iteration>.yaml an earlier resume kept; None when there is none
    to read (a checkpoint moved out of its run)."""
    checkpoints = Path(resumed).resolve().parent
    if checkpoints.name != "checkpoints":
        return None
    run = checkpoints.parent
    until = run / f"config-until-{iteration:06d}.yaml"
    saved = until if until.is_file() else run / "config.yaml"
    return saved if saved.is_file() else None


def engine_settings_problem(cfg, resumed: Path) -> str | None:
    """Why checkpoint `resumed` cannot continue with `cfg`'s settings of its engine state's layout
    (checkpoint.ENGINE_SETTINGS: the adapter's modules and shapes, ZeRO-3's partitions against
    stages 1 and 2, which DeepSpeed saves alike, the precision's optimizer files), or None. Read from
    the settings the checkpoint ran with; DeepSpeed would say it only after the model and the engine
    are built, in its own words."""
    saved = settings_file(resumed, checkpoint.iteration_of(resumed) or 0)
    try:
        before = load_config(str(saved)) if saved is not None else None
    except Exception:  # noqa: BLE001 (unreadable: the resume warns about it; loading decides)
        before = None
    if before is None:
        return None

    # (key, value before, value now, whether the engine state's layout differs)
    pairs = [("model.lora", before.model.lora, cfg.model.lora, before.model.lora != cfg.model.lora),
             ("optim.zero_stage", before.optim.zero_stage, cfg.optim.zero_stage,
              (before.optim.zero_stage == 3) != (cfg.optim.zero_stage == 3)),
             ("optim.precision", before.optim.precision, cfg.optim.precision,
              before.optim.precision != cfg.optim.precision)]  # fmt: skip
    if before.model.lora and cfg.model.lora:
        pairs += [("model.lora_rank", before.model.lora_rank, cfg.model.lora_rank,
                   before.model.lora_rank != cfg.model.lora_rank),
                  ("model.lora_targets", before.model.lora_targets, cfg.model.lora_targets,
                   set(before.model.lora_targets) != set(cfg.model.lora_targets))]  # fmt: skip
    changed = [f"{key}: {shown(old)} -> {shown(new)}" for key, old, new, differs in pairs if differs]
    if not changed:
        return None
    return (
        f"resume: {resumed} cannot continue with other {'; '.join(changed)} (its settings: {saved}): its "
        "engine state is laid out by them; resume with the checkpoint's, or start a new run (resume=none) "
        "in another output_dir"
    )


def inside_checkpoints(out: Path) -> str | None:
    """Why `out` cannot hold a run, when it is (or lies in) one of a run's checkpoints or that run's
    checkpoints folder: a run deletes its older checkpoints with everything in them, replaces one it
    writes again, and resume reads them; its checkpoints folder is its own. The path is checked as
    given and with its links resolved (a checkpoints folder may be a link to another disk). None
    otherwise."""
    absolute = Path(os.path.abspath(out.expanduser()))
    seen = set()
    for path in (absolute, absolute.resolve()):
        for folder in (path, *path.parents):
            if folder in seen:
                continue
            seen.add(folder)
            try:
                if checkpoint.PATTERN.match(folder.name) and (checkpoint.is_complete(folder) or (folder / "state.pt").exists()):
                    return (f"output_dir {out} lies in the checkpoint {folder}: a run deletes its older checkpoints "
                            "with everything in them, and resume reads them; give a folder outside it")  # fmt: skip
                if folder.name == "checkpoints" and _is_checkpoints_of_a_run(folder):
                    return (f"output_dir {out} lies in the checkpoints folder of the run in {folder.parent}, "
                            "where that run writes and deletes its checkpoints; give a folder outside it")  # fmt: skip
            except OSError:  # a folder above that cannot be searched holds no run this one could be lost in
                continue
    return None


def _is_checkpoints_of_a_run(folder: Path) -> bool:
    """`folder` (named checkpoints) is a run's: beside the run's config.yaml, with its metrics.csv or
    checkpoints in it (a folder of checkpoints moved out of their run is not)."""
    return folder.is_dir() and (folder.parent / "config.yaml").is_file() and (
        (folder.parent / "metrics.csv").exists() or any(checkpoint.PATTERN.match(p.name) for p in folder.iterdir()))


def another_run_there(out: Path, holder: str | None = None) -> str | None:
    """The refusal of output_dir while another run writes there (holds its RunLock; `holder`, the
    lock's holder when already known), or None. Looked at on every rank before the process group,
    when no rank of this run holds the lock yet; looks share the lock, so the ranks of one run do
    not see each other as another run."""
    holder = holder or RunLock.holder(out)
    if holder is None:
        return None
    return (f"output_dir {out}: another run is writing there ({holder}); wait for it to end or stop it, "
            "or give another output_dir")  # fmt: skip


def run_in_the_way(out: Path) -> str | None:
    """What a new run (resume=none) would write over in `out`, said with what to do instead, or None."""
    held = [name for name in ("metrics.csv", "checkpoints") if (out / name).exists()]
    if held and checkpoint.latest(out) is None:
        return (f"output_dir {out} already holds a run ({', '.join(held)}) that stopped before its first "
                "checkpoint: give another output_dir, or start it again there with resume=auto, which "
                "replaces its metrics.csv")  # fmt: skip
    if held:
        return (f"output_dir {out} already holds a run ({', '.join(held)}): continue it from its newest "
                "checkpoint with resume=auto, or give another output_dir")  # fmt: skip
    return None


def resume_problem(path: Path) -> str | None:
    """What keeps resume=PATH from naming a complete checkpoint, or None."""
    if not path.exists():
        return f"checkpoint {str(path)!r} does not exist (use auto, none or a checkpoint dir)"
    if not path.is_dir():
        return f"checkpoint {str(path)!r} is a file, not a checkpoint dir (use auto, none or a checkpoint dir)"
    if checkpoint.is_complete(path):
        missing = [name for name in ("engine", "state.pt", "rng") if not (path / name).exists()]
        return f"{path} is marked complete but has no {' or '.join(missing)} (a damaged checkpoint)" if missing else None
    if (path / "checkpoints").is_dir() or (path / "metrics.csv").exists():
        return (f"{path} is a run's output_dir, not one of its checkpoints: continue its newest with "
                f"output_dir={path} resume=auto, or name one of {path / 'checkpoints'}/checkpoint-NNNNNN")
    return f"{path} is not a complete checkpoint (no COMPLETE marker)"


def missing_reward_paths(cfg) -> list[str]:
    """`reward.options.<reward>.<key>: ... does not exist` for each local-path option
    (`rewards.LOCAL_PATH_OPTIONS`) of a registered reward the run uses whose file or folder is not
    there."""
    used = set(cfg.reward.weights) | ({cfg.eval.reward} if cfg.eval.enabled else set())
    out = []
    for reward, options in cfg.reward.options.items():
        if reward not in used or not isinstance(options, dict):
            continue
        expanded = rewards.expand_home(reward, options)
        for key in rewards.LOCAL_PATH_OPTIONS.get(reward, ()):
            value = expanded.get(key)
            if isinstance(value, str) and value and not Path(value).exists():
                out.append(f"reward.options.{reward}.{key}: {value} does not exist")
    return out
