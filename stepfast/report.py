"""The report folder written at the end of a run: curves, the per-step gain heatmap, sample grids
before and after training, and a Markdown summary."""

from __future__ import annotations

import math

from pathlib import Path

if __name__ == "__main__":  # before the imports below (seconds): a Ctrl-C among them is a line, not a traceback
    from stepfast import quiet_ctrl_c_while_starting

    quiet_ctrl_c_while_starting("python -m stepfast.report")

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _column(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["iteration"], r[key]) for r in rows if r.get(key, "") not in ("", None)]
    if not pts:
        return np.array([]), np.array([])
    it, val = zip(*pts)
    return np.asarray(it, dtype=float), np.asarray(val, dtype=float)


def _moving_mean(values: np.ndarray, parts: int = 10) -> tuple[int, np.ndarray]:
    """A trailing mean over a window of a `parts`-th of the points (at least 2): (window, means), the
    mean i ending at point i + window - 1."""
    k = max(len(values) // parts, 2)
    return k, np.convolve(values, np.ones(k) / k, mode="valid")


def _iteration_axis(ax, label: str = "iteration") -> None:
    """An x axis of iterations: labelled, and ticked only at whole iterations (a short run's axis
    would otherwise read 0.5, 1.5, ...)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def reward_curve(rows: list[dict], path: Path) -> None:
    """The train reward over iterations, with its trailing mean; with tagged prompts (GenEval
    categories), a second panel on the same scale with each category's reward, a trailing mean over
    the iterations that drew it."""
    plt = _plt()
    categories = sorted({k for r in rows for k in r if k.startswith("category/")})
    fig, axes = plt.subplots(1, 2 if categories else 1, figsize=(11 if categories else 6, 3.8), squeeze=False,
                             sharey=True)  # fmt: skip
    ax = axes[0, 0]
    it, r = _column(rows, "reward")
    ax.plot(it, r, color="C0", alpha=0.45, linewidth=1, marker="." if len(r) < 5 else None, label="each iteration")
    if len(r) >= 5:
        k, mean = _moving_mean(r)
        ax.plot(it[k - 1:], mean, color="C0", linewidth=2, label=f"trailing mean, {k} iterations")
    ax.set_title("Train reward (mean over the iteration's final images)", fontsize=9)
    _iteration_axis(ax)
    ax.set_ylabel("reward")
    ax.legend(fontsize=8)
    if categories:
        ax = axes[0, 1]
        windows = set()
        for n, key in enumerate(categories):
            it, r = _column(rows, key)
            raw = len(r) < 5  # each point as drawn, marked: a category drawn once is a point, not a line
            if not raw:
                k, mean = _moving_mean(r, parts=5)  # a category is drawn in only some iterations
                it, r = it[k - 1:], mean
                windows.add(k)
            ax.plot(it, r, color=f"C{(n + 2) % 10}", marker="." if raw else None, label=key.split("/", 1)[1])
        if windows:
            window = "-".join(str(w) for w in sorted({min(windows), max(windows)}))
            ax.set_title(f"By prompt category: trailing mean of {window} of the iterations that drew it", fontsize=9)
        else:  # too few points in every category for a mean: each as drawn
            ax.set_title("By prompt category: the iterations that drew it", fontsize=9)
        _iteration_axis(ax)
        ax.set_ylabel("reward")
        ax.yaxis.set_tick_params(labelleft=True)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def eval_tag(iteration: int) -> str:
    """The tag of the evaluation after `iteration` (eval_{tag}.json), between "before" and "after"."""
    return f"iter{iteration:06d}"


def eval_iteration(tag: str, iterations: int) -> int | None:
    """The iteration an evaluation tag stands for: 0 before training, `iterations` after it; None for
    a tag the trainer does not write."""
    if tag in ("before", "after"):
        return 0 if tag == "before" else iterations
    digits = tag.removeprefix("iter")
    return int(digits) if tag.startswith("iter") and digits.isascii() and digits.isdigit() else None


def eval_curve(evals: dict, iterations: int, path: Path, gain: dict | None = None,
               measure: str = "held-out prompts") -> None:
    """The held-out overall scores at each evaluation (on [0, 1] when they all lie there, as pass rates
    and ShapeEval's scores do): markers, joined only when there are more than two; the title gives the
    gain before -> after and its standard error (`gain`: `held_out_gain(evals)`, when there is one)."""
    plt = _plt()
    points = sorted(((eval_iteration(tag, iterations), e["overall"]["strict"], e["overall"]["score"], _draws(e))
                     for tag, e in evals.items()), key=lambda p: p[0])  # fmt: skip
    # runs of evaluations that drew the same images (a resume that changed the eval settings starts
    # another): points are joined within one only, and a dotted line marks where each new one starts.
    # Evaluations between iterations keep no per-image records: they join the run they fall in.
    segments: list[list] = []
    drawn: list = []  # each segment's draws, None until one of its evaluations says them
    for p in points:
        if segments and (p[3] is None or drawn[-1] is None or p[3] == drawn[-1]):
            segments[-1].append(p)
            drawn[-1] = drawn[-1] if drawn[-1] is not None else p[3]
        else:
            segments.append([p])
            drawn.append(p[3])
    style = "-" if len(points) > 2 else ""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for n, seg in enumerate(segments):
        x = [p[0] for p in seg]
        ax.plot(x, [p[1] for p in seg], "o" + style, color="C0", label=None if n else "overall (strict)")
        ax.plot(x, [p[2] for p in seg], "s" + ("--" if style else ""), color="C1",
                label=None if n else "overall (partial score)")  # fmt: skip
        if n:
            ax.axvline(x[0], color="0.6", linestyle=":", linewidth=1)
    values = [v for p in points for v in p[1:3]]
    if all(0 <= v <= 1 for v in values if v == v):  # pass rates and [0, 1] scores: their whole range
        ax.set_ylim(0, 1)
    _iteration_axis(ax, "iteration (0: before training)")
    ax.set_ylabel("eval score")
    line = "" if gain is None else f"\nstrict, before -> after: {gain['gain']:+.3f}" + (
        f" ± {gain['se']:.3f} (one standard error)" if gain["se"] is not None else "")  # fmt: skip
    if len(segments) > 1:
        starts = ", ".join(str(seg[0][0]) for seg in segments[1:])
        line += f"\nother prompts or seeds from iteration {starts} (dotted): not joined"
    ax.set_title(f"Eval overall on the {measure} (mean of the categories){line}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draws(evaluation: dict) -> tuple | None:
    """The (category, prompt, seed) of every image an evaluation drew, sorted, or None when it kept
    no per-image records (those between iterations keep none): two evaluations of the same draws
    score the same images."""
    samples = evaluation.get("samples")
    if not samples or not _are_samples(samples):
        return None
    return tuple(sorted((str(s["tag"]), str(s["prompt"]), s["seed"]) for s in samples))


def _number(cell) -> float:
    """A metrics.csv cell as a float: NaN where nothing was logged ("" or a column the row lacks)."""
    return float("nan") if cell in ("", None) else float(cell)


def gain_heatmap(rows: list[dict], path: Path, trained: list[int] | None = None) -> list[int] | None:
    """Mean |reward gain| per denoising step (rows) over training (columns); the steps not in
    `trained` (when known) hatched: their gains count in the statistics, but no gradient flows there.
    Returns those steps ([] when none is, or `trained` is not known); None when no gain was logged,
    and nothing is drawn."""
    keys = sorted({k for r in rows for k in r if k.startswith("gain/")}, key=lambda k: int(k.split("/")[1]))
    rows = [r for r in rows if not all(np.isnan(_number(r.get(k))) for k in keys)]  # some gain logged
    if not keys or not rows:
        return None
    # a step not logged at an iteration (a run resumed with other sde.steps) is a blank cell
    data = np.array([[_number(r.get(k)) for r in rows] for k in keys])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    im = ax.imshow(data, aspect="auto", origin="upper", cmap="viridis",
                   extent=(rows[0]["iteration"] - 0.5, rows[-1]["iteration"] + 0.5, len(keys) - 0.5, -0.5))
    steps = [int(k.split("/")[1]) for k in keys]
    ax.set_yticks(range(len(keys)), [str(j) for j in steps])
    title = "Mean |reward gain| of each denoising step"
    untrained = [] if trained is None else [j for j in steps if j not in trained]
    for j in untrained:
        ax.axhspan(j - 0.5, j + 0.5, facecolor="none", edgecolor="white", hatch="//", linewidth=0)
    if untrained:
        title += f"\nhatched: not trained (deterministic, below sde.min_std or outside the window): {untrained}"
    ax.set_title(title, fontsize=9)
    _iteration_axis(ax)
    ax.set_ylabel("denoising step j (x_j -> x_j+1)")
    fig.colorbar(im, ax=ax, label="mean |gain|")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return untrained


def held_out_gain(evals: dict) -> dict | None:
    """`stepfast.heldout.paired_gain` of evals["before"] to evals["after"] when both hold their
    "samples" records (as eval_*.json do), else None."""
    from stepfast.heldout import paired_gain

    samples = [evals.get(tag, {}).get("samples") for tag in ("before", "after")]
    if not all(isinstance(s, list) for s in samples):
        return None
    return paired_gain(*samples)


_UNSET = object()


def eval_measure(cfg) -> str:
    """What a run's evaluation measures, in words: "held-out prompts", or, when it draws the training
    prompts (with seeds that the rollout, whose noise comes from 63-bit hashes, never uses), that."""
    return "training prompts, unseen seeds" if cfg.eval.prompts == cfg.rollout.prompts else "held-out prompts"


def gain_line(evals: dict, gain=_UNSET, measure: str = "held-out prompts") -> str | None:
    """What a run says of its eval gain on `measure` (`eval_measure`): the gain and its standard error
    (`held_out_gain`, or `gain` when already computed from `evals`), or why there is none although
    both evaluations ran; None when they did not both run."""
    name = "held-out gain" if measure == "held-out prompts" else f"gain ({measure})"
    samples = [evals.get(tag, {}).get("samples") for tag in ("before", "after")]
    if not all(isinstance(s, list) and s for s in samples):  # not both run, or their images not kept
        return None
    gain = held_out_gain(evals) if gain is _UNSET else gain
    if gain is None:
        if not all(math.isfinite(s["strict"]) for part in samples for s in part):
            return f"{name} not computed: the eval reward gives no pass/fail (strict) to compare"
        return (f"{name} not computed: the evaluations before and after drew other prompts or seeds (eval "
                "settings changed at a resume?); the overall scores above are not of the same images")
    if gain["se"] is None:
        return f"{name} {gain['gain']:+.3f} (one image a category: no standard error)"
    return (f"{name} {gain['gain']:+.3f} ± {gain['se']:.3f} (one standard error over the prompts and "
            "seeds drawn)")


#: The plots `write_report` draws when the run's files hold what they show (the sample grids aside).
PLOTS = frozenset({"reward_curve.png", "gain_heatmap.png", "eval_curve.png"})


def write_report(out: Path, rows: list[dict], evals: dict, after: dict | None, cfg,
                 trained: list[int] | None = None, run_dir: Path | None = None) -> Path:  # fmt: skip
    """report/ of a run, in `out`: curves, tables, the held-out gain, and the sample grids: the one
    after training drawn from `after`'s images, the one before linked where the trainer saved it.
    `trained`: the denoising steps the update trains, hatched apart in the gain heatmap when given;
    `run_dir`: the run folder, with its checkpoints, when the report is written elsewhere first."""
    from stepfast.heldout import markdown_table

    report = Path(out) / "report"
    report.mkdir(parents=True, exist_ok=True)
    lines = [f"# stepfast run: {cfg.credit} credit, {cfg.sampler} sampler", "", settings_line(cfg), ""]
    if rows:
        reward_curve(rows, report / "reward_curve.png")
        lines += ["![reward](reward_curve.png)", "", training_line(rows), ""]
    if (untrained := gain_heatmap(rows, report / "gain_heatmap.png", trained)) is not None:
        note = f" (hatched: the steps not trained, {', '.join(map(str, untrained))})" if untrained else ""
        lines += [f"Mean |reward gain| per denoising step over training{note}:", "", "![gains](gain_heatmap.png)", ""]
    gain = held_out_gain(evals)  # a bootstrap: once, for the plot and the summary
    measure = eval_measure(cfg)
    if evals:
        eval_curve(evals, cfg.iterations, report / "eval_curve.png", gain, measure)
        lines += ["![eval](eval_curve.png)", ""]
    for tag in ("before", "after"):
        if tag in evals:
            heading = "Held-out evaluation" if measure == "held-out prompts" else f"Evaluation ({measure})"
            lines += [f"## {heading} {tag} training", "", markdown_table(evals[tag]),
                      "Overall is the mean of the categories, as GenEval's; n counts images (prompts x seeds).", ""]
    if "before" in evals and "after" in evals:
        b, a = evals["before"]["overall"]["strict"], evals["after"]["overall"]["strict"]
        line = gain_line(evals, gain, measure)  # why there is no standard error, or no gain, when the samples say
        if gain is None and line:  # not of the same images, or no pass/fail: no difference to give
            lines += [line[0].upper() + line[1:] + ".", ""]
        elif gain is None or gain["se"] is None:
            lines += [f"**Overall (strict): {b:.3f} -> {a:.3f} ({a - b:+.3f})**", ""]
            if line:
                lines += [line[0].upper() + line[1:] + "." + control_note(cfg), ""]
        else:
            lines += [f"**Overall (strict): {b:.3f} -> {a:.3f} ({a - b:+.3f} ± {gain['se']:.3f})**", "",
                      f"± one standard error of the gain over the eval draws ({measure}): a paired bootstrap of each "
                      f"category's prompts and their seeds ({gain['resamples']:,} resamples). Runs with another "
                      "training seed spread on top of it." + control_note(cfg), ""]  # fmt: skip
    if "after" in evals:
        lines += ["The evaluation after training is of the weights of the run's last checkpoint; every image's "
                  "prompt, seed and scores are in eval_after.json (`samples`)."]  # fmt: skip
        if command := evaluate_command(cfg, run_dir or out):
            lines += ["To draw it again:", "", f"    {command}"]
        lines += [""]
    if (report / "samples_before.png").is_file():  # the trainer saves it when it draws it, before training
        lines += grid_link("before")
    if after is not None and "images" in after:
        save_grid(out, "after", after, cfg)
        lines += grid_link("after")
    (report / "summary.md").write_text("\n".join(lines))
    return report


def control_note(cfg) -> str:
    """For a run trained on a reward: how to see what its gain is worth (a run on the `random` control
    reward, which moves the weights as much with no signal); nothing for a run that is that control."""
    if set(cfg.reward.weights) == {"random"}:
        return " This run trained on the `random` control reward: its gain is drift, with no signal."
    return (" The same run on the `random` control reward (`'reward.weights={random: 1.0}'`, the evaluation "
            "unchanged) shows how far the weights' drift alone moves the measure: read the gain beside it.")


def settings_line(cfg) -> str:
    """The settings a reader compares runs by, in one line (all of them are in config.yaml)."""
    rollout, optim = cfg.rollout, cfg.optim
    adapter = f"LoRA rank {cfg.model.lora_rank}" if cfg.model.lora else "full fine-tuning"
    return (f"Settings: {cfg.iterations} iteration{'s' if cfg.iterations != 1 else ''} of {rollout.groups} "
            f"group{'s' if rollout.groups != 1 else ''} of {rollout.group_size}, "
            f"{cfg.sde.steps} steps, T' = {rollout.substeps}, CFG {rollout.cfg:g}, {adapter}, lr {optim.lr:g}, "
            f"KL {optim.beta:g}, seed {cfg.seed} (every setting: config.yaml).")


def training_line(rows: list[dict]) -> str:
    """The train reward at the start and at the end of training (means over windows of up to 10
    iterations: one iteration's reward swings with the prompts it draws) and the mean time per
    iteration, split as logged."""
    it = [r["iteration"] for r in rows]
    reward = np.array([_number(r.get("reward")) for r in rows])
    k = max(min(10, len(rows) // 2), 1)

    def span(part: slice) -> str:
        first, last = it[part][0], it[part][-1]
        return f"{first}" if first == last else f"{first}-{last}"

    if k > 1:
        trend = (f"mean over iterations {span(slice(0, k))}: {np.nanmean(reward[:k]):.3f}, "
                 f"{span(slice(len(rows) - k, None))}: {np.nanmean(reward[-k:]):.3f}")  # fmt: skip
    elif len(rows) > 1:
        trend = f"iteration {it[0]}: {reward[0]:.3f}, iteration {it[-1]}: {reward[-1]:.3f}"
    else:
        trend = f"iteration {it[0]}: {reward[0]:.3f}"
    times = {}
    for key in dict.fromkeys(key for r in rows for key in r if str(key).startswith("time/")):
        values = np.array([_number(r.get(key)) for r in rows])
        if not np.isnan(values).all():
            times[key] = float(np.nanmean(values))
    spent = ""
    if "time/iteration" in times:
        split = ", ".join(f"{key[5:]} {v:.1f}" for key, v in times.items() if key != "time/iteration")
        spent = f"; seconds per iteration, mean over the run: {times['time/iteration']:.1f}" + (f" ({split})" if split else "")
    return f"Iterations: {it[-1]}; train reward, {trend}{spent}."


def evaluate_command(cfg, out: Path) -> str | None:
    """The `python -m stepfast.evaluate` command that draws the run's evaluation after training again
    from the checkpoint of its last iteration in `out` (the run folder), its paths absolute so that it
    runs from anywhere; None where it would not draw the same: an evaluation reward other than the
    one `stepfast.evaluate` scores with (shapes, with its default options), frozen parts not in fp32,
    that checkpoint not in `out`, or a LoRA file without its adapter config (one saved before the
    config went with it, which diffusers loads at another scale)."""
    import shlex

    from stepfast.models import holds_adapter_config, lora_weights_file

    options = {k: v for k, v in (cfg.reward.options.get("shapes") or {}).items() if k != "device"}
    if cfg.eval.reward != "shapes" or options or cfg.model.dtype != "fp32":
        return None
    weights = Path(out).resolve() / "checkpoints" / f"checkpoint-{cfg.iterations:06d}" / (
        ("lora" if cfg.model.lora else "transformer") + ("_ema" if cfg.optim.ema > 0 else ""))  # fmt: skip
    if not weights.is_dir():
        return None
    if cfg.model.lora:
        try:
            if not holds_adapter_config(lora_weights_file(weights)):
                return None
        except (FileNotFoundError, ValueError):
            return None

    def where(value: str) -> str:  # a path as the run took it (from the folder it was started in)
        return str(Path(value).resolve()) if Path(value).exists() else value

    args = ["python", "-m", "stepfast.evaluate"]
    if cfg.model.path != "embedded":
        args += ["--model", where(cfg.model.path)]
    args += ["--lora" if cfg.model.lora else "--transformer", str(weights), "--prompts", where(cfg.eval.prompts)]
    if cfg.eval.limit:
        args += ["--limit", str(cfg.eval.limit)]
    args += ["--seeds", str(cfg.eval.seeds), "--min-images", str(cfg.eval.min_images), "--steps", str(cfg.eval.steps),
             "--cfg", repr(cfg.eval.cfg), "--size", str(cfg.rollout.resolution), "--batch-size", str(cfg.eval.batch_size)]
    return shlex.join(args)


def save_grid(out: Path, tag: str, result: dict, cfg) -> Path:
    """report/samples_{tag}.png of an evaluation kept with its images. The trainer saves the grid
    before training as soon as it is drawn, so that the report of a resumed run still shows it."""
    from stepfast.heldout import sample_grid
    from stepfast.files import write_atomically

    title = f"Samples {tag} training ({eval_measure(cfg)})"
    grid = sample_grid(result["images"], result["samples"], columns=len(result["settings"]["seeds"]),
                       max_rows=cfg.log.grid_prompts, title=title)  # fmt: skip
    path = Path(out) / "report" / f"samples_{tag}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda tmp: grid.save(tmp, format="PNG"))
    return path


def grid_link(tag: str) -> list[str]:
    """The summary.md lines that show report/samples_{tag}.png."""
    return [f"Samples {tag} training:", "", f"![{tag}](samples_{tag}.png)", ""]


# -- python -m stepfast.report RUN_DIR: rebuild the report folder of a finished run ----------------


class RunFolderError(ValueError):
    """A run folder that the report cannot be rebuilt from; the message says what is missing or wrong."""


def read_metrics(path: Path) -> list[dict]:
    """The rows of a run's metrics.csv, read as the trainer reads them on resume; a last row cut
    short is left out, and said on stderr."""
    import sys

    from stepfast.metrics import read_logged

    def say_cut(line: int) -> None:
        print(f"python -m stepfast.report: note: {path}, line {line}: a row cut short (the run was stopped "
              "while it wrote it) is left out", file=sys.stderr)  # fmt: skip

    try:
        rows = read_logged(path, required=("iteration", "reward"), advice="repair it to rebuild the report",
                           on_cut=say_cut)  # fmt: skip
    except ValueError as exc:
        raise RunFolderError(str(exc)) from exc
    if not rows:
        raise RunFolderError(f"{path} holds no iteration's metrics (the run stopped before it logged one): "
                             "nothing to report")  # fmt: skip
    return rows


def _is_evaluation(result) -> bool:
    """True for {"overall": row, "categories": {name: row}}, each row with numbers strict, score, n."""

    def is_row(row) -> bool:
        return isinstance(row, dict) and all(isinstance(row.get(k), (int, float)) for k in ("strict", "score", "n"))

    return (isinstance(result, dict) and is_row(result.get("overall"))
            and isinstance(result.get("categories"), dict) and all(map(is_row, result["categories"].values())))


def _are_samples(samples) -> bool:
    """True for a list of per-image records with prompt, tag, seed and a numeric strict."""
    return isinstance(samples, list) and all(
        isinstance(s, dict) and isinstance(s.get("strict"), (int, float)) and isinstance(s.get("seed"), int)
        and isinstance(s.get("prompt"), str) and isinstance(s.get("tag"), str)
        for s in samples
    )  # fmt: skip


def read_evals(run_dir: Path) -> dict:
    """{tag: {"overall", "categories"}} of the run's eval_before/iterNNNNNN/after.json, in that order;
    before and after also with their "samples" records when the files hold them."""
    import json

    found = {}
    for path in run_dir.glob("eval_*.json"):
        tag = path.name[len("eval_"):-len(".json")]
        if eval_iteration(tag, 0) is None:
            continue  # not written by the trainer
        try:
            result = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RunFolderError(f"cannot read {path}: {exc}") from exc
        if not _is_evaluation(result):
            raise RunFolderError(f"{path}: not an evaluation result (needs \"overall\" and \"categories\" "
                                 "with strict, score and n)")  # fmt: skip
        found[tag] = {"overall": result["overall"], "categories": result["categories"]}
        if tag in ("before", "after") and _are_samples(result.get("samples")):
            found[tag]["samples"] = result["samples"]  # for the gain's standard error

    def order(tag):  # before, the iterations in order, after
        return (tag == "after", eval_iteration(tag, 0))

    return {tag: found[tag] for tag in sorted(found, key=order)}


def read_config(path: Path):
    from stepfast.config import ConfigError, load_config

    if not path.is_file():
        raise RunFolderError(f"{path} is missing (the trainer writes it when a run starts)")
    try:
        return load_config(str(path), ["resume=none"])  # the checkpoint it resumed from may be pruned
    except (ConfigError, OSError, UnicodeDecodeError) as exc:
        message = str(exc)
        raise RunFolderError(message if str(path) in message else f"{path}: {message}") from exc


def rebuild_report(run_dir) -> Path:
    """Rewrite RUN_DIR/report from the files of the run: metrics.csv, config.yaml, eval_*.json. The
    sample grids are not rebuilt (the images are not kept): those already in the report are kept,
    and linked. Written to a temporary folder first, so a failure leaves the old report whole."""
    import os
    import shutil
    import tempfile

    from stepfast.startup import trained_steps_of  # the model's time grid, when the model is still there

    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise RunFolderError(f"{run_dir} is a file, not a run folder (one holds metrics.csv, config.yaml "
                             "and eval_*.json)")  # fmt: skip
    if not run_dir.is_dir():
        raise RunFolderError(f"no run folder {run_dir}")
    metrics = run_dir / "metrics.csv"
    if not metrics.is_file():
        raise RunFolderError(f"{run_dir} has no metrics.csv: not a run folder (one holds metrics.csv, "
                             "config.yaml and eval_*.json)")  # fmt: skip
    rows, cfg, evals = read_metrics(metrics), read_config(run_dir / "config.yaml"), read_evals(run_dir)
    report = run_dir / "report"
    if report.exists() and not report.is_dir():  # checked before anything is written
        raise RunFolderError(f"{report} is a file, not the run's report folder: move it away and run again")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".report-", dir=run_dir))
    except OSError as exc:
        raise RunFolderError(f"cannot write in {run_dir}: {exc}") from exc
    try:
        fresh = write_report(tmp, rows, evals, None, cfg, trained_steps_of(cfg), run_dir=run_dir)
        lines = [line for tag in ("before", "after") if (report / f"samples_{tag}.png").is_file()
                 for line in grid_link(tag)]  # fmt: skip
        if lines:
            summary = fresh / "summary.md"
            summary.write_text(summary.read_text() + "\n" + "\n".join(lines))
        report.mkdir(exist_ok=True)
        written = {path.name for path in fresh.iterdir()}
        for path in fresh.iterdir():
            os.replace(path, report / path.name)
        for name in PLOTS - written:  # a plot of what the run's files no longer hold (eval_after.json moved away)
            (report / name).unlink(missing_ok=True)
    except OSError as exc:
        raise RunFolderError(f"cannot write {report}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m stepfast.report",
        description="Rebuild the report folder of a run (the trainer writes it at the end of a run) from "
        "the run's metrics.csv, config.yaml and eval_*.json; the sample grids already there are kept.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's output_dir")
    args = parser.parse_args(argv)
    try:
        report = rebuild_report(args.run_dir)
    except RunFolderError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback; the run's files are only read
        parser.exit(130, f"\n{parser.prog}: interrupted; run it again to rebuild the report\n")
    print(f"wrote {report / 'summary.md'}")
    return 0


if __name__ == "__main__":
    from stepfast import ctrl_c_as_usual

    ctrl_c_as_usual()
    raise SystemExit(main())
