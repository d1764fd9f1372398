"""python -m stepfast.value_check: how well the clean estimates' rewards follow the states' values."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from stepfast.models.tiny import tiny_pipeline_dir
from stepfast.value_check import group_correlation, main, summarise


def test_group_correlation_is_within_groups_and_only_where_both_vary():
    a = np.array([[0.0, 1, 2], [1, 1, 1], [3, 2, 1]])
    b = np.array([[0.0, 2, 4], [0, 1, 2], [0, 1, 5]])
    corr, groups = group_correlation(a, b)
    # row 0 correlates exactly; row 1's estimate is constant and is left out
    assert groups == 2
    assert corr == pytest.approx((1.0 + np.corrcoef([3, 2, 1], [0, 1, 5])[0, 1]) / 2, abs=1e-12)
    corr, groups = group_correlation(np.ones((2, 3)), b[:2])
    assert math.isnan(corr) and groups == 0


def test_summary_rows_and_the_last_step_ending_at_the_final_reward():
    rng = np.random.default_rng(0)
    values, final = rng.random((3, 4, 2)), rng.random((3, 4))
    estimates = {3: values.copy(), 1: rng.random((3, 4, 2))}
    summary = summarise([0.9, 0.5], values, estimates, final)
    assert [(r["state"], r["t"]) for r in summary["states"]] == [(1, 0.9), (2, 0.5)]
    assert [r["step"] for r in summary["steps"]] == [1, 2]
    # an estimate equal to the value follows it, state by state and gain by gain
    assert [r["corr_T3"] for r in summary["states"]] == pytest.approx([1.0, 1.0])
    assert [r["corr_T3"] for r in summary["steps"]] == pytest.approx([1.0, 1.0])
    # step 1: state 1 -> state 2; step 2: state 2 -> the final image, whose value and estimate are its reward
    assert summary["steps"][0]["value_gain"] == pytest.approx(np.abs(values[..., 1] - values[..., 0]).mean())
    assert summary["steps"][1]["value_gain"] == pytest.approx(np.abs(final - values[..., 1]).mean())
    assert summary["steps"][1]["gain_T1"] == pytest.approx(np.abs(final - estimates[1][..., 1]).mean())
    lone = np.corrcoef(final[0] - estimates[1][0, :, 1], final[0] - values[0, :, 1])[0, 1]
    assert group_correlation(final[:1] - estimates[1][:1, :, 1], final[:1] - values[:1, :, 1])[0] == pytest.approx(lone)
    assert summary["states"][0]["value_spread"] == pytest.approx(values[..., 0].std(axis=1).mean())
    assert summary["states"][1]["estimate_spread_T1"] == pytest.approx(estimates[1][..., 1].std(axis=1).mean())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return tiny_pipeline_dir(tmp_path_factory.mktemp("tiny"), seed=0)


def check(tmp_path, model, *extra, prompts="a red circle\na blue square\n"):
    file = tmp_path / "prompts.txt"
    file.write_text(prompts)
    return main([f"model.path={model}", f"rollout.prompts={file}", "rollout.resolution=32", "sde.steps=4",
                 "reward.weights={jpeg_compressibility: 1.0}", "--prompts", "2", "--members", "3",
                 "--device", "cpu", *extra])  # fmt: skip


def test_value_check_draws_the_trainers_groups_and_writes_its_tables(tmp_path, tiny_model, capsys):
    out = tmp_path / "value.json"
    summary = check(tmp_path, tiny_model, "--continuations", "1", "--substeps", "1,2", "--out", str(out))
    printed = capsys.readouterr().out
    assert "corr T'=1" in printed and "corr T'=2" in printed and f"wrote {out}" in printed
    assert [r["state"] for r in summary["states"]] == [1, 2, 3]
    assert [r["step"] for r in summary["steps"]] == [1, 2, 3]
    assert summary["settings"]["prompts"] == ["a red circle", "a blue square"]
    # ddim's last step (t_3 -> 0) has no noise: a state-3 continuation, drawn in a batch of the group's
    # shape, is the member's own final image, so the value gains nothing on that step
    assert summary["steps"][-1]["value_gain"] == 0.0
    assert summary["states"][-1]["value_spread"] > 0  # the members differ: their earlier steps drew noise
    for row in summary["states"] + summary["steps"]:
        for key in ("corr_T1", "corr_T2"):
            assert math.isnan(row[key]) or -1 - 1e-9 <= row[key] <= 1 + 1e-9
    written = json.loads(out.read_text())
    assert [r["t"] for r in written["states"]] == [r["t"] for r in summary["states"]]
    assert written["settings"]["substeps"] == [1, 2]


def test_value_check_follows_the_configs_sampler(tmp_path, tiny_model):
    """With every step an ODE step (sde.min_std above every std), a group's members are one image:
    no value or estimate spreads, and no correlation."""
    summary = check(tmp_path, tiny_model, "sde.min_std=10", "--continuations", "2")
    assert all(r["value_spread"] == 0 for r in summary["states"])
    assert all(math.isnan(r["corr_T3"]) for r in summary["states"] + summary["steps"])


@pytest.mark.parametrize(("args", "message"), [
    (["--members", "1"], "--members must be at least 2"),
    (["optim.lrr=1"], "optim.lr"),
    (["--out", "/nonexistent-folder/v.json"], "--out: folder /nonexistent-folder does not exist"),
    (["--substeps", "3,x"], "comma-separated whole numbers"),
    (["--prompts", "x"], "argument --prompts: expected a whole number, got 'x'"),
    (["--continuations", "0"], "argument --continuations: must be at least 1, got 0"),
])  # fmt: skip
def test_bad_input_is_named_before_anything_is_drawn(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_prompt_the_reward_cannot_score_is_named_by_its_line(tmp_path, tiny_model, capsys):
    file = tmp_path / "prompts.txt"
    file.write_text("a photo of a red circle\na photo of a dog\n")
    with pytest.raises(SystemExit):
        main([f"model.path={tiny_model}", f"rollout.prompts={file}", "rollout.resolution=32", "--prompts", "2"])
    err = capsys.readouterr().err
    assert f"rollout.prompts: {file}:2: reward 'shapes': 'a photo of a dog' is not a ShapeEval prompt" in err
