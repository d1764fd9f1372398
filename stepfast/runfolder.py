"""A run's output_dir across its attempts: the checkpoint a run continues from, and what a run keeps
of the attempts before it (their settings, their evaluations of later weights), so that a resume
neither mixes two runs nor loses a file. The trainer calls these; each names what it refuses or
keeps."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from stepfast import checkpoint
from stepfast.config import ConfigError, changed_settings, load_config
from stepfast.files import write_atomically
from stepfast.report import eval_iteration
from stepfast.startup import settings_file


def resume_path(cfg, out: Path) -> Path | None:
    """The checkpoint a run continues from: none, the newest complete one in `out`, or the one named."""
    if cfg.resume == "none":
        return None
    return checkpoint.latest(out) if cfg.resume == "auto" else Path(cfg.resume)


def check_resumable(cfg, resumed: Path, out: Path, world: int) -> None:
    """A ConfigError when the checkpoint `resumed` cannot continue this run: written by another number
    of ranks, older than `out`'s newest, or past `iterations`."""
    checkpoint.check_world(resumed, world)
    check_no_later_checkpoints(resumed, out)
    done = checkpoint.iteration_of(resumed)
    if done is not None and done > cfg.iterations:  # (equal: the evaluation and report are left to do)
        raise ConfigError(
            f"iterations={cfg.iterations}, but {resumed} is at iteration {done}: a run cannot go back; give "
            f"iterations >= {done}, or another output_dir"
        )


def check_no_later_checkpoints(resumed: Path, out: Path) -> None:
    """A ConfigError when `out` holds checkpoints newer than the one resumed: the two runs' checkpoints
    would mix (resume=auto picking the abandoned run's newest after a crash), and metrics.csv would
    lose the rows after the resumed iteration."""
    iteration, newest = checkpoint.iteration_of(resumed), checkpoint.latest(out)
    later = checkpoint.iteration_of(newest) if newest is not None else None
    if iteration is not None and later is not None and later > iteration:
        raise ConfigError(
            f"resume={resumed} continues from iteration {iteration}, but output_dir {out} holds a later "
            f"checkpoint, {newest}: continuing here would mix the two runs' checkpoints and drop metrics.csv's "
            f"rows after iteration {iteration}. Give another output_dir, or move the later checkpoints and "
            "metrics.csv away"
        )


def keep_changed_settings(cfg, out: Path, resumed: Path, iteration: int) -> None:
    """A run resumed from `resumed` (at `iteration`) with other settings than those its iterations ran
    with (its run's config.yaml, or the config-until-<iteration>.yaml an earlier resume kept) says
    which; in `out` the old settings are kept, as config-until-<iteration>.yaml, before the new
    config.yaml replaces them. A warning only: nothing here stops the run."""
    saved = settings_file(resumed, iteration)
    if saved is None:  # a checkpoint moved out of its run: no settings to compare
        return
    run = saved.parent
    until = run / f"config-until-{iteration:06d}.yaml"
    try:
        changed = changed_settings(load_config(str(saved)), cfg)
    except Exception as exc:  # noqa: BLE001 (an unreadable file is reported, not fatal)
        changed = [f"(which this version cannot read: {exc})"]
    if not changed:
        return
    kept = ""
    if run == out.resolve():  # this run's own settings: kept before config.yaml is replaced
        if saved != until:
            write_atomically(until, lambda tmp: tmp.write_bytes(saved.read_bytes()))
        kept = f"; the settings before are kept in {until}"
    print(f"stepfast: warning: resumed from {resumed} with other settings than those of {saved}: "
          f"{', '.join(changed)}. The run goes on with these{kept}", file=sys.stderr)  # fmt: skip


def keep_other_config(out: Path, text: str) -> None:
    """A new run's config.yaml (`text`) replaces a file of that name already in `out` (a hand-written
    config given with --config, say, or an attempt's that stopped before a checkpoint with other
    settings): one that says otherwise is kept first, as config-before-<n>.yaml, and said."""
    path = out / "config.yaml"
    if not path.is_file() or path.read_text(errors="replace") == text:
        return
    kept = _first_free(out / f"config-before-{n}.yaml" for n in itertools.count(1))
    write_atomically(kept, lambda tmp: tmp.write_bytes(path.read_bytes()))
    print(f"stepfast: {path} is replaced by this run's settings; the file there before is kept as {kept}",
          file=sys.stderr)  # fmt: skip


def set_aside_later_evaluations(out: Path, start: int) -> None:
    """A run resumed to train on from iteration `start`: the evaluations a previous attempt wrote of
    later weights (the one after training of a run that ended at the resumed checkpoint, its sample
    grid, the evaluation curve; those between iterations past it) and the summary of the training
    that went on past it (the one a finished run wrote, with or without evaluations, and its reward
    and gain plots)
    would stand in this run's report until replaced, and past a crash they would not be. Each is
    kept as <name>-before-<start> (-2, -3, ... when an earlier resume at `start` kept one), which the
    report does not read; a kept summary names the kept files, and says when it was set aside and that
    the checkpoints it names may be gone."""
    report = out / "report"
    later = [out / "eval_after.json", report / "samples_after.png", report / "eval_curve.png", report / "summary.md",
             report / "reward_curve.png", report / "gain_heatmap.png"]  # the summary's own plots, redrawn at the end
    later += [p for p in out.glob("eval_iter*.json") if (eval_iteration(p.stem[5:], 0) or 0) >= start]
    moved = {}
    for path in sorted(p for p in later if p.is_file()):
        kept = _kept_name(path, start)
        os.replace(path, kept)
        moved[path] = kept
    summary = moved.pop(report / "summary.md", None)
    if summary is not None:
        text = summary.read_text(errors="replace")
        for path, kept in moved.items():
            text = text.replace(path.name, kept.name)
        text = text.rstrip("\n") + (
            f"\n\n---\n\nSet aside when the run was resumed to train on from iteration {start - 1}: the run went on "
            "past these results. The checkpoints it names go as the resumed run writes newer ones "
            "(`keep_checkpoints`), unless they are moved out of the run folder first.\n")
        write_atomically(summary, lambda tmp: tmp.write_text(text))
        moved[report / "summary.md"] = summary
    if moved:
        print(f"stepfast: the report and evaluations of weights past iteration {start - 1} that {out} held are kept as "
              f"{', '.join(str(kept.relative_to(out)) for kept in moved.values())}: this run draws its own")


def bring_evaluations(out: Path, resumed: Path, evals: dict, report: bool, start: int) -> None:
    """A run resumed from another folder's checkpoint: the evaluations that checkpoint holds (the one
    before training, those between iterations) as eval_<tag>.json here, and the sample grid before
    training when `report`, so that this folder's report can be rebuilt from its own files
    (`python -m stepfast.report`) as the trainer writes it. Each file is copied from the checkpoint's
    run when it is there and holds the checkpoint's figures, else written from the checkpoint (the
    figures and every image's result; a grid cannot be). A file here of another evaluation (an
    earlier start in this folder) is kept as <name>-before-<start>, as `set_aside_later_evaluations`
    keeps one, and a grid with it; a grid that cannot be copied is a warning."""
    # the checkpoint's run: from the path as given (a checkpoints folder may be a link to another
    # disk), else with its links resolved (a link to a checkpoint)
    run = next((p.parent.parent for p in (resumed, resumed.resolve()) if p.parent.name == "checkpoints"), None)
    if run is not None and run.resolve() == out.resolve():
        return
    resumed = resumed.resolve()

    def same(data, held) -> bool:  # NaN (a reward without pass/fail) equals itself in JSON's text
        return isinstance(data, dict) and json.dumps(data.get("overall"), sort_keys=True) == json.dumps(
            held.get("overall"), sort_keys=True)

    def read(path: Path):
        try:
            return json.loads(path.read_text()) if path.is_file() else None
        except (OSError, ValueError):
            return None

    brought, written, kept = [], [], []

    def set_aside(path: Path) -> None:
        aside = _kept_name(path, start)
        os.replace(path, aside)
        kept.append(str(aside.relative_to(out)))

    here: dict[str, bool] = {}  # tag: whether this folder already held the checkpoint's evaluation
    for tag, held in evals.items():
        path = out / f"eval_{tag}.json"
        here[tag] = path.exists() and same(read(path), held)
        if here[tag]:
            continue
        if path.exists():
            set_aside(path)
        data = read(run / path.name) if run is not None else None
        if not same(data, held):  # that file is gone or of another evaluation: the checkpoint's own
            data = held
            written.append(path.name)
        else:
            brought.append(path.name)
        write_atomically(path, lambda tmp, data=data: tmp.write_text(json.dumps(data, indent=2)))
    grid = out / "report" / "samples_before.png"
    if report and "before" in evals and not here["before"]:  # a grid here is of another evaluation
        source = run / "report" / "samples_before.png" if run is not None else None
        try:
            if grid.exists():
                set_aside(grid)
            if "eval_before.json" in brought and source.is_file():  # copied from the run just above
                grid.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(grid, lambda tmp: shutil.copyfile(source, tmp))
                brought.append(str(grid.relative_to(out)))
        except OSError as exc:
            print(f"stepfast: warning: cannot copy {source} to {grid} ({exc}): this folder's report shows no "
                  "sample grid before training", file=sys.stderr)  # fmt: skip
    if kept:
        print(f"stepfast: {', '.join(kept)} kept: of another evaluation than the checkpoint {resumed} holds")
    if brought:
        print(f"stepfast: {', '.join(brought)} copied from {run}, whose checkpoint this run continues, for "
              "this folder's report")
    if written:
        print(f"stepfast: {', '.join(written)} written from the checkpoint {resumed}, which this run continues, "
              "for this folder's report")


def _kept_name(path: Path, start: int) -> Path:
    """Where a file a resume at `start` sets aside is kept: <name>-before-<start>, -2, -3, ... after an
    earlier resume at `start` kept one."""
    return _first_free(path.with_name(f"{path.stem}-before-{start}{'' if n == 1 else f'-{n}'}{path.suffix}")
                       for n in itertools.count(1))  # fmt: skip


def _first_free(names: Iterable[Path]) -> Path:
    """The first of `names` that nothing is at: where a file is kept without replacing one kept before."""
    return next(path for path in names if not path.exists())
