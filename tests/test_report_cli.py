"""python -m stepfast.report RUN_DIR: rebuilds a run's report folder from the files the run keeps
(metrics.csv, config.yaml, eval_*.json), keeps the sample grids already there, and rejects a folder
it cannot use with a one-line error and exit code 2, leaving the old report whole. No training: each
run folder is written here by hand."""

import csv
import json
import subprocess
import sys

import numpy as np
import torch
import pytest
import yaml
from PIL import Image

from stepfast.config import load_config
from stepfast.report import write_report
from stepfast.startup import trained_steps_of

PROG = "python -m stepfast.report: error: "


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stepfast.report", *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def assert_cli_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(PROG), proc.stderr
    for fragment in fragments:
        assert fragment in last, (fragment, last)


def evaluation(rng) -> dict:
    categories = {c: {"strict": float(rng.random()), "score": float(rng.random()), "n": 4}
                  for c in ("colors", "counting")}  # fmt: skip
    overall = {k: float(np.mean([c[k] for c in categories.values()])) for k in ("strict", "score")}
    return {"categories": categories, "overall": {**overall, "n": 8}, "samples": [], "settings": {"seeds": [0]}}


@pytest.fixture
def run(tmp_path):
    """A run folder as the trainer leaves it: 6 iterations, evaluations before, at 3 and after, and a
    report whose sample grid before training is the only thing rebuilding cannot redo."""
    rng = np.random.default_rng(0)
    run = tmp_path / "run"
    run.mkdir()
    # the folder may have moved, and the checkpoint the run resumed from may have been pruned since
    config = {"iterations": 6, "credit": "flow_grpo", "output_dir": "elsewhere",
              "resume": str(tmp_path / "pruned" / "checkpoint-000002")}  # fmt: skip
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    rows = [{"iteration": it, "reward": float(rng.random()), "gain/0": float(rng.random()),
             "gain/1": float(rng.random()), "time/rollout": 1.5, "time/iteration": 2.5}
            for it in range(1, 7)]  # fmt: skip
    rows[2]["eval/strict"] = 0.5  # a column logged in one iteration only: "" in the others
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(run / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: r.get(k, "") for k in fields} for r in rows)
    evals = {tag: evaluation(rng) for tag in ("before", "iter000003", "after")}
    for tag, result in evals.items():
        (run / f"eval_{tag}.json").write_text(json.dumps(result))
    (run / "report").mkdir()
    Image.new("RGB", (8, 4), (200, 10, 10)).save(run / "report" / "samples_before.png")
    (run / "report" / "summary.md").write_text("old summary\n")
    rows = [{k: r.get(k, "") for k in fields} for r in rows]
    return run, rows, {t: {k: e[k] for k in ("overall", "categories")} for t, e in evals.items()}


def test_rebuilds_the_report_of_a_run_folder(run, tmp_path):
    run, rows, evals = run
    grid = (run / "report" / "samples_before.png").read_bytes()
    proc = run_cli(str(run))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    report = run / "report"
    # what write_report makes of the same data, held in memory as the trainer holds it
    cfg = load_config(str(run / "config.yaml"), ["resume=none"])
    expected = write_report(tmp_path / "expected", rows, evals, None, cfg, trained_steps_of(cfg))
    summary = (report / "summary.md").read_text()
    assert summary.startswith((expected / "summary.md").read_text())
    assert "flow_grpo credit" in summary and "Iterations: 6" in summary
    # the figures themselves, not only what write_report makes of them: the train reward at the start
    # and at the end (means over the first and the last 3 of 6 iterations), the mean time per iteration,
    # and the held-out overall from before to after training
    first, last = (np.mean([r["reward"] for r in part]) for part in (rows[:3], rows[3:]))
    assert (f"Iterations: 6; train reward, mean over iterations 1-3: {first:.3f}, 4-6: {last:.3f}; seconds per "
            "iteration, mean over the run: 2.5 (rollout 1.5)." in summary)  # fmt: skip
    b, a = evals["before"]["overall"]["strict"], evals["after"]["overall"]["strict"]
    assert round(a - b, 3) != 0 and f"**Overall (strict): {b:.3f} -> {a:.3f} ({a - b:+.3f})**" in summary
    assert "![before](samples_before.png)" in summary and "samples_after" not in summary
    assert (report / "samples_before.png").read_bytes() == grid
    for figure in ("reward_curve.png", "gain_heatmap.png", "eval_curve.png"):
        assert (report / figure).stat().st_size > 0, figure
    assert sorted(p.name for p in run.iterdir()) == sorted(  # no temporary folder left behind
        ["config.yaml", "metrics.csv", "eval_before.json", "eval_iter000003.json", "eval_after.json", "report"])


def test_a_last_row_cut_short_is_left_out_and_said(run):
    """A run stopped while it wrote a row of metrics.csv leaves that line without its newline: the
    report is rebuilt from the whole rows, and says which line it left out."""
    run, rows, _ = run
    with open(run / "metrics.csv", "a") as f:
        f.write("7,0.9")  # iteration 7's row, cut short
    proc = run_cli(str(run))
    assert proc.returncode == 0, proc.stderr
    assert f"note: {run / 'metrics.csv'}, line 8: a row cut short" in proc.stderr, proc.stderr
    assert "Iterations: 6;" in (run / "report" / "summary.md").read_text()
    with open(run / "metrics.csv", "a") as f:
        f.write("\n")  # now a whole row (with too few cells): an error, not a note
    assert_cli_error(run_cli(str(run)), "line 8", "cells")


def test_needs_a_run_folder():
    assert_cli_error(run_cli(), "RUN_DIR")


def test_a_folder_without_metrics_is_an_error(tmp_path):
    assert_cli_error(run_cli(str(tmp_path)), str(tmp_path), "no metrics.csv")
    assert list(tmp_path.iterdir()) == []


def append(path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


@pytest.mark.parametrize("breakage, fragments", [
    (lambda run: (run / "eval_after.json").write_text("{bad"), ["eval_after.json"]),
    (lambda run: (run / "eval_before.json").write_text('{"overall": {"strict": 1}}'), ["eval_before.json", "overall"]),
    (lambda run: (run / "eval_after.json").write_text(json.dumps({"overall": {"strict": 1, "score": 1, "n": 2},
                                                                   "categories": []})),
     ["eval_after.json", "categories"]),
    (lambda run: (run / "config.yaml").unlink(), ["config.yaml", "missing"]),
    (lambda run: (run / "config.yaml").write_text("credit: nosuch\n"), ["config.yaml", "credit"]),
    (lambda run: append(run / "metrics.csv", "7,abc,,,,,\n"), ["metrics.csv", "line 8", "'abc'",
                                                             "repair it to rebuild the report"]),
    (lambda run: (run / "metrics.csv").write_text("iteration,reward\n"), ["metrics.csv holds no iteration's metrics",
                                                                          "nothing to report"]),
    (lambda run: (run / "metrics.csv").write_text(""), ["metrics.csv holds no iteration's metrics"]),
], ids=["bad eval json", "eval without categories", "eval categories a list", "no config", "bad config", "bad metric",
        "header only", "empty metrics"])  # fmt: skip
def test_a_bad_run_file_is_an_error_and_the_old_report_stays(run, breakage, fragments):
    run, _, _ = run
    breakage(run)
    before = {p.name: p.read_bytes() for p in (run / "report").iterdir()}
    assert_cli_error(run_cli(str(run)), *fragments)
    assert {p.name: p.read_bytes() for p in (run / "report").iterdir()} == before
    assert not [p for p in run.iterdir() if p.name.startswith(".report-")]


def test_a_rebuild_removes_a_plot_of_what_the_run_no_longer_holds(run):
    """The evaluations moved away (as a resume sets a finished run's aside): the eval curve drawn from
    them goes with them, where it stayed beside a summary that no longer showed it."""
    run, _, _ = run
    assert run_cli(str(run)).returncode == 0 and (run / "report" / "eval_curve.png").is_file()
    for path in run.glob("eval_*.json"):
        path.rename(path.with_name(path.stem + "-before-7.json"))
    assert run_cli(str(run)).returncode == 0
    assert not (run / "report" / "eval_curve.png").exists()
    assert sorted(p.name for p in (run / "report").iterdir()) == ["gain_heatmap.png", "reward_curve.png",
                                                                   "samples_before.png", "summary.md"]  # fmt: skip


def test_the_gain_gets_its_standard_error_when_the_evaluations_keep_their_samples(run):
    from stepfast.heldout import paired_gain

    run, _, _ = run
    samples = {}
    for k, tag in enumerate(("before", "after")):
        result = json.loads((run / f"eval_{tag}.json").read_text())
        result["samples"] = [{"prompt": f"p{i % 3}", "tag": ("colors", "counting")[i % 2], "seed": i,
                              "strict": float((i * (k + 2)) % 3 == 0), "score": 0.5} for i in range(12)]  # fmt: skip
        samples[tag] = result["samples"]
        (run / f"eval_{tag}.json").write_text(json.dumps(result))
    gain = paired_gain(samples["before"], samples["after"])
    assert gain["se"] > 0
    assert run_cli(str(run)).returncode == 0
    assert f"± {gain['se']:.3f})**" in (run / "report" / "summary.md").read_text()
    # records that are not per-image results are left out, and the gain is shown without its error
    result = json.loads((run / "eval_after.json").read_text())
    for bad in ([{"strict": 1.0}], [{"prompt": ["p0"], "tag": "colors", "seed": 0, "strict": 1.0}]):
        (run / "eval_after.json").write_text(json.dumps({**result, "samples": bad}))
        proc = run_cli(str(run))
        assert proc.returncode == 0, proc.stderr
        summary = (run / "report" / "summary.md").read_text()
        assert "**Overall (strict): " in summary and "±" not in summary


def test_the_gain_is_read_beside_a_random_reward_control(run):
    """A run on a reward points to the control run that tells its gain from drift; the control's own
    report says that its gain is drift."""
    out, rows, evals = run
    samples = [{"prompt": f"p{i % 3}", "tag": ("colors", "counting")[i % 2], "seed": i, "strict": float(i % 2),
                "score": 0.5} for i in range(12)]  # fmt: skip
    evals = {**evals, "before": {**evals["before"], "samples": samples},
             "after": {**evals["after"], "samples": [{**x, "strict": 1.0} for x in samples]}}  # fmt: skip
    pointer = "The same run on the `random` control reward (`'reward.weights={random: 1.0}'`, the evaluation unchanged)"
    summary = (write_report(out, rows, evals, None, load_config("default", ["iterations=6"])) / "summary.md").read_text()
    assert pointer in summary and "its gain is drift" not in summary
    control = load_config("default", ["iterations=6", "reward.weights={random: 1.0}"])
    summary = (write_report(out, rows, evals, None, control) / "summary.md").read_text()
    assert pointer not in summary
    assert "This run trained on the `random` control reward: its gain is drift, with no signal." in summary


def test_a_report_says_why_evaluations_that_do_not_pair_have_no_gain(run):
    """Evaluations before and after of other seeds (eval settings changed at a resume): the summary
    says the difference is not of the same images, where it gave it without a word."""
    out, rows, evals = run
    sample = {"prompt": "a photo of a circle", "tag": "colors", "strict": 1.0, "score": 1.0}
    evals = {**evals, "before": {**evals["before"], "samples": [{**sample, "seed": 0}]},
             "after": {**evals["after"], "samples": [{**sample, "seed": 4}]}}  # fmt: skip
    summary = (write_report(out, rows, evals, None, load_config("default", ["iterations=6"])) / "summary.md").read_text()
    assert ("Gain (training prompts, unseen seeds) not computed: the evaluations before and after drew other "
            "prompts or seeds (eval settings changed at a resume?); the overall scores above are not of the same "
            "images.") in summary
    assert "Overall (strict): " not in summary  # no difference of other images set out in bold above it
    # the same with no pass/fail to compare (a reward without one): no 'nan -> nan' either
    nan = {**sample, "strict": float("nan")}
    evals = {**evals, "before": {**evals["before"], "samples": [{**nan, "seed": 0}]},
             "after": {**evals["after"], "samples": [{**nan, "seed": 0}]}}  # fmt: skip
    held_out = load_config("default", ["iterations=6", "eval.prompts=shapeeval:test"])
    summary = (write_report(out, rows, evals, None, held_out) / "summary.md").read_text()
    assert "Held-out gain not computed: the eval reward gives no pass/fail (strict) to compare." in summary
    assert "Overall (strict): " not in summary


def test_a_report_of_cells_left_empty_or_columns_added_on_resume(run, tmp_path):
    """A run resumed with other sde.steps logs a gain step the earlier rows lack (the trainer's rows:
    the key missing; metrics.csv: an empty cell), and a time not logged in the last row: the
    heatmap shows them blank and the summary's means leave them out, instead of the report failing
    at the end of the run."""
    out, rows, evals = run
    trainer_rows = [dict(r) for r in rows]
    for r in trainer_rows[3:]:
        r["gain/2"] = 0.25  # from iteration 4 on
    del trainer_rows[-1]["time/rollout"]
    report = write_report(out, trainer_rows, evals, None, load_config("default", ["iterations=6"]), trained=[1, 2])
    assert (report / "gain_heatmap.png").is_file()
    assert "over training (hatched: the steps not trained, 0):" in (report / "summary.md").read_text()
    assert "seconds per iteration, mean over the run: 2.5 (rollout 1.5)." in (report / "summary.md").read_text()
    fields = list(dict.fromkeys(k for r in trainer_rows for k in r))
    with open(out / "metrics.csv", "w", newline="") as f:  # as the logger rewrites it: "" where not logged
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: r.get(k, "") for k in fields} for r in trainer_rows)
    (report / "gain_heatmap.png").unlink()
    proc = run_cli(str(out))
    assert proc.returncode == 0, proc.stderr
    assert (report / "gain_heatmap.png").is_file()
    assert "seconds per iteration, mean over the run: 2.5 (rollout 1.5)." in (report / "summary.md").read_text()


def test_the_evaluate_command_is_given_only_where_it_draws_the_evaluation_again(tmp_path):
    """Its weights: the last iteration's checkpoint, the EMA's where evaluation samples with it, the
    whole transformer after full fine-tuning; absolute, quoted paths. None where stepfast.evaluate
    would draw or score otherwise: another reward or reward options, frozen parts not in fp32, no such
    checkpoint, or a LoRA file without its adapter config (loaded at another scale)."""
    import shlex

    from safetensors.torch import save_file

    from stepfast.report import evaluate_command

    run = tmp_path / "a run"
    ckpt = run / "checkpoints" / "checkpoint-000006"
    prompts = tmp_path / "held out.txt"
    prompts.write_text("a photo of a circle\n")

    def lora(folder, config: bool):
        folder.mkdir(parents=True, exist_ok=True)
        metadata = {"format": "pt", **({"lora_adapter_metadata": "{}"} if config else {})}
        tensors = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 8)}
        save_file(tensors, str(folder / "pytorch_lora_weights.safetensors"), metadata=metadata)

    def command(*overrides):
        return evaluate_command(load_config("default", ["iterations=6", f"eval.prompts={prompts}", "eval.limit=64",
                                                        *overrides]), run)

    assert command() is None  # no checkpoint-000006
    lora(ckpt / "lora", config=False)
    assert command() is None  # saved without its config
    lora(ckpt / "lora", config=True)
    args = shlex.split(command())
    assert args[args.index("--lora") + 1] == str((ckpt / "lora").resolve())
    assert args[args.index("--prompts") + 1] == str(prompts.resolve())
    assert (args[args.index("--limit") + 1], args[args.index("--cfg") + 1]) == ("64", "4.5")
    assert command("optim.ema=0.9") is None  # its lora_ema/ is not there
    lora(ckpt / "lora_ema", config=True)
    assert str(ckpt / "lora_ema") in command("optim.ema=0.9")
    (ckpt / "transformer").mkdir()
    assert f"--transformer '{(ckpt / 'transformer').resolve()}'" in command("model.lora=false", "optim.beta=0")
    assert command("eval.reward=jpeg_compressibility") is None
    assert command("reward.options.shapes.threshold=0.3") is None and command("model.dtype=bf16") is None
    assert command("reward.options.shapes.device=cpu") is not None


def test_the_plots_of_a_short_run_tick_whole_iterations(monkeypatch, tmp_path):
    """Two or three iterations would be ticked at 0.25, 0.5, ... by matplotlib's default locator."""
    import matplotlib.figure

    from stepfast.report import eval_curve, gain_heatmap, reward_curve

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    rows = [{"iteration": it, "reward": 0.1 * it, "category/colors": 0.2 * it, "gain/0": 0.3, "gain/1": 0.1}
            for it in (1, 2)]  # fmt: skip
    rng = np.random.default_rng(0)
    reward_curve(rows, tmp_path / "r.png")
    gain_heatmap(rows, tmp_path / "g.png")
    eval_curve({"before": evaluation(rng), "after": evaluation(rng)}, 2, tmp_path / "e.png")
    axes = [ax for fig in saved for ax in fig.axes if ax.get_xlabel().startswith("iteration")]
    assert len(axes) == 4  # two reward panels, the heatmap, the eval curve (not the colour bar)
    for ax in axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)


def test_a_point_alone_is_drawn_and_evaluations_of_other_images_are_not_joined(monkeypatch, tmp_path):
    """A category drawn in one iteration (and a one-iteration run's reward) is a marked point, where a
    line of one point drew nothing; the eval curve joins only evaluations of the same images, and
    marks where the draws changed (eval settings changed at a resume)."""
    import matplotlib.figure

    from stepfast.report import eval_curve, reward_curve

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    rows = [{"iteration": it, "reward": 0.1 * it, "category/colors": 0.2} for it in range(1, 7)]
    rows[2]["category/color_attr"] = 0.5
    reward_curve(rows, tmp_path / "r.png")
    reward_curve(rows[:1], tmp_path / "one.png")
    lines = [line for fig in saved for ax in fig.axes for line in ax.get_lines()]
    single = [line for line in lines if len(line.get_xdata()) == 1]
    assert {line.get_label() for line in single} == {"color_attr", "colors", "each iteration"}  # colors: the one-row run
    assert all(line.get_marker() not in (None, "", "None") for line in single)

    saved.clear()
    rng = np.random.default_rng(0)

    def drawn(e, seeds):
        return {**e, "samples": [{"prompt": "p", "tag": "colors", "seed": s, "strict": 1.0, "score": 1.0} for s in seeds]}

    evals = {"before": drawn(evaluation(rng), [0, 1]), "iter000003": drawn(evaluation(rng), [0, 1]),
             "after": drawn(evaluation(rng), [0, 1, 2])}  # fmt: skip
    eval_curve(evals, 6, tmp_path / "e.png")
    (ax,) = saved[0].axes
    strict = [line for line in ax.get_lines() if line.get_marker() == "o"]
    assert [list(line.get_xdata()) for line in strict] == [[0, 3], [6]]
    assert [list(line.get_xdata()) for line in ax.get_lines() if line.get_linestyle() == ":"] == [[6, 6]]
    assert "other prompts or seeds from iteration 6 (dotted): not joined" in ax.get_title()
    saved.clear()
    eval_curve({**evals, "after": drawn(evals["after"], [1, 0])}, 6, tmp_path / "e.png")  # the same images
    (ax,) = saved[0].axes
    assert [list(line.get_xdata()) for line in ax.get_lines() if line.get_marker() == "o"] == [[0, 3, 6]]
    assert "not joined" not in ax.get_title()
    # as the trainer writes them: the evaluations between iterations keep no per-image records, and
    # join the run they fall in (of the same images, or not)
    between = {tag: evaluation(rng) for tag in ("iter000002", "iter000004")}
    for after, expected in (([1, 0], [[0, 2, 4, 6]]), ([0, 1, 2], [[0, 2, 4], [6]])):
        saved.clear()
        eval_curve({"before": evals["before"], **between, "after": drawn(evals["after"], after)}, 6, tmp_path / "e.png")
        (ax,) = saved[0].axes
        assert [list(line.get_xdata()) for line in ax.get_lines() if line.get_marker() == "o"] == expected


def test_the_settings_line_counts_in_words():
    from stepfast.report import settings_line

    assert settings_line(load_config("default", ["iterations=1", "rollout.groups=1"])).startswith(
        "Settings: 1 iteration of 1 group of ")
    assert settings_line(load_config("default", ["iterations=2", "rollout.groups=2"])).startswith(
        "Settings: 2 iterations of 2 groups of ")


def test_a_file_given_as_the_run_folder_is_called_a_file(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("iteration,reward\n1,0.5\n")
    assert_cli_error(run_cli(str(path)), str(path), "is a file, not a run folder")
    assert path.read_text() == "iteration,reward\n1,0.5\n"


def test_a_file_where_the_report_folder_goes_is_an_error_and_stays(run):
    run, _, _ = run
    for path in sorted((run / "report").iterdir()):
        path.unlink()
    (run / "report").rmdir()
    (run / "report").write_text("my notes\n")
    assert_cli_error(run_cli(str(run)), str(run / "report"), "is a file, not the run's report folder")
    assert (run / "report").read_text() == "my notes\n"
    assert not [p for p in run.iterdir() if p.name.startswith(".report-")]


def test_ctrl_c_during_a_rebuild_is_a_line_and_leaves_no_temporary_folder(run, monkeypatch, capsys):
    """The plots take seconds; a Ctrl-C among them was a traceback from inside matplotlib."""
    import stepfast.report

    run, _, _ = run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(stepfast.report, "write_report", interrupted)
    try:
        with pytest.raises(SystemExit) as info:
            stepfast.report.main([str(run)])
    except KeyboardInterrupt:  # not let out: it would stop the test session
        pytest.fail("the report let the Ctrl-C out")
    assert info.value.code == 130
    assert capsys.readouterr().err == "\npython -m stepfast.report: interrupted; run it again to rebuild the report\n"
    assert not [p for p in run.iterdir() if p.name.startswith(".report-")]
