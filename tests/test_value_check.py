"""python -m stepfast.value_check: how well the clean estimates' rewards follow the states' values."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from stepfast import sde
from stepfast.models.tiny import tiny_pipeline_dir
from stepfast.rollout import sample_trajectory
from stepfast.value_check import Sampler, draw_group, format_tables, group_correlation, main, summarise

GRID = sde.sd3_time_grid(5)


def toy_velocity(x, t):
    """Row by row, so that a row's result does not depend on the batch it is in."""
    return 0.5 * x - t.view(-1, 1, 1) + torch.sin(3 * x)


def mean_score(latents):
    return latents.double().mean(dim=(1, 2)).numpy()


def test_group_correlation_is_within_groups_and_only_where_both_vary():
    a = np.array([[0.0, 1, 2], [1, 1, 1], [3, 2, 1]])
    b = np.array([[0.0, 2, 4], [0, 1, 2], [0, 1, 5]])
    corr, groups = group_correlation(a, b)
    # row 0 correlates exactly; row 1's estimate is constant and is left out
    assert groups == 2
    assert corr == pytest.approx((1.0 + np.corrcoef([3, 2, 1], [0, 1, 5])[0, 1]) / 2, abs=1e-12)
    corr, groups = group_correlation(np.ones((2, 3)), b[:2])
    assert math.isnan(corr) and groups == 0


@pytest.mark.parametrize(("kind", "params", "window"), [
    ("ddim", {"eta": 1.0}, None), ("flow_sde", {"noise_level": 0.7}, None), ("cps", {"noise_level": 0.7}, [1, 3]),
])  # fmt: skip
def test_the_sampler_draws_the_rollouts_trajectory(kind, params, window):
    """Given the same noise at its stochastic steps, it takes the rollout's steps (the trainer's
    sample_trajectory), ODE steps where the window or min_std say so: the same states up to float32
    rounding (the rollout's stochastic steps go through the fused step op, these through sde.step)."""
    x0 = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(kind, GRID, window, 0.05, **params)
    states, velocities = sampler.run(toy_velocity, x0, 0, torch.Generator().manual_seed(7))
    replay, noise = torch.Generator().manual_seed(7), torch.zeros(5, *x0.shape)
    for j in range(5):
        if sampler.stochastic[j]:
            noise[j] = torch.randn(x0.shape, generator=replay)
    traj = sample_trajectory(toy_velocity, x0, GRID, kind, noise=noise, sde_window=window, min_std=0.05, **params)
    assert sampler.stochastic.any() and not sampler.stochastic.all()
    torch.testing.assert_close(torch.stack(states), traj.states, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(velocities), traj.velocities, rtol=1e-5, atol=1e-5)


def test_a_group_scores_each_states_estimate_and_its_continuations():
    sampler = Sampler("ddim", GRID, None, 0.05, eta=1.0)
    x0 = torch.randn(1, 4, 5, generator=torch.Generator().manual_seed(1)).expand(4, 4, 5).contiguous()
    group = draw_group(sampler, lambda n: toy_velocity, x0, 3, [1, 2], mean_score, torch.Generator().manual_seed(3))
    assert group["value"].shape == group["value_se"].shape == group["estimates"][1].shape == (4, 5)
    # the trajectory is the generator's first draw: redrawn, its states give the T' = 1 estimates,
    # x_j - t_j v(x_j) with the velocity the trajectory took at x_j
    states, _ = sampler.run(toy_velocity, x0, 0, torch.Generator().manual_seed(3))
    for j in range(5):
        t = GRID[j].expand(4)
        expected = mean_score(states[j] - t.view(-1, 1, 1) * toy_velocity(states[j], t))
        np.testing.assert_allclose(group["estimates"][1][:, j], expected, atol=1e-6)
    np.testing.assert_allclose(group["final"], mean_score(states[-1]), atol=1e-6)
    # ddim's first step draws no noise: the members are one state there, and their estimates agree
    assert np.ptp(group["estimates"][2][:, 1]) < 1e-9
    # its last step (t_4 -> 0) draws none either: every continuation of state 4 is the member's own
    # final image, so the value there is the final score, with no noise
    np.testing.assert_allclose(group["value"][:, 4], group["final"], atol=1e-6)
    assert np.all(group["value_se"][:, 4] < 1e-6) and np.all(group["value_se"][:, 1] > 0)


def test_summary_rows_and_the_last_step_ending_at_the_final_score():
    rng = np.random.default_rng(0)
    groups = []
    for _ in range(3):
        value = rng.random((4, 2))
        groups.append({"value": value, "value_se": np.full((4, 2), 0.1), "final": rng.random(4),
                       "estimates": {3: value.copy(), 1: rng.random((4, 2))}})  # fmt: skip
    summary = summarise([1.0, 0.5], groups)
    value, final = np.stack([g["value"] for g in groups]), np.stack([g["final"] for g in groups])
    est1 = np.stack([g["estimates"][1] for g in groups])
    assert [(r["state"], r["t"]) for r in summary["states"]] == [(0, 1.0), (1, 0.5)]
    assert [r["step"] for r in summary["steps"]] == [0, 1]
    # an estimate equal to the value follows it, state by state and gain by gain
    assert [r["corr_T3"] for r in summary["states"]] == pytest.approx([1.0, 1.0])
    assert [r["corr_T3"] for r in summary["steps"]] == pytest.approx([1.0, 1.0])
    # step 0: state 0 -> state 1; step 1: state 1 -> the final image, whose value and estimate are its score
    assert summary["steps"][0]["value_gain"] == pytest.approx(np.abs(value[..., 1] - value[..., 0]).mean())
    assert summary["steps"][1]["value_gain"] == pytest.approx(np.abs(final - value[..., 1]).mean())
    assert summary["steps"][1]["gain_T1"] == pytest.approx(np.abs(final - est1[..., 1]).mean())
    last = [np.corrcoef(final[g] - est1[g, :, 1], final[g] - value[g, :, 1])[0, 1] for g in range(3)]
    assert summary["steps"][1]["corr_T1"] == pytest.approx(np.mean(last))
    assert summary["states"][0]["value_spread"] == pytest.approx(value[..., 0].std(axis=1).mean())
    assert summary["states"][1]["estimate_spread_T1"] == pytest.approx(est1[..., 1].std(axis=1).mean())
    assert summary["states"][0]["value_noise"] == pytest.approx(0.1)
    # a gain between two values of standard error 0.1 has a mean size sqrt(2 / pi) sqrt(0.02) from noise
    assert summary["steps"][0]["value_gain_noise"] == pytest.approx(math.sqrt(2 / math.pi) * math.sqrt(0.02))
    assert summary["steps"][1]["value_gain_noise"] == pytest.approx(math.sqrt(2 / math.pi) * 0.1)


def test_the_tables_print_a_correlation_that_rounds_to_zero_as_plus_zero():
    """A correlation of -0.004 read -0.00, a sign that says nothing; nan stays nan."""
    state = {"state": 0, "t": 1.0, "corr_T1": -0.004, "value_spread": -0.0001, "value_noise": 0.1,
             "estimate_spread_T1": 0.25}  # fmt: skip
    step = {"step": 0, "corr_T1": float("nan"), "value_gain": 0.5, "value_gain_noise": 0.0, "gain_T1": 0.0004}
    rows = [line.split() for line in format_tables({"states": [state], "steps": [step]}, [1]).splitlines()]
    assert rows[1] == ["0", "1.000", "+0.00", "0.000", "0.100", "0.250"]
    assert rows[-1] == ["0", "nan", "0.500", "0.000", "0.000"]
    state["corr_T1"] = -0.006
    assert format_tables({"states": [state], "steps": [step]}, [1]).splitlines()[1].split()[2] == "-0.01"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return tiny_pipeline_dir(tmp_path_factory.mktemp("tiny"), seed=0)


def check(tmp_path, model, *extra, prompts="a red circle\na blue square\n"):
    file = tmp_path / "prompts.txt"
    file.write_text(prompts)
    return main([f"model.path={model}", f"rollout.prompts={file}", "rollout.resolution=32", "sde.steps=4",
                 "reward.weights={jpeg_compressibility: 1.0}", "--prompts", "2", "--members", "3",
                 "--continuations", "2", "--device", "cpu", *extra])  # fmt: skip


def test_value_check_on_a_pipeline_prints_and_writes_its_tables(tmp_path, tiny_model, capsys):
    out = tmp_path / "value.json"
    summary = check(tmp_path, tiny_model, "--substeps", "1,2", "--out", str(out))
    printed = capsys.readouterr().out
    assert "corr T'=1" in printed and "corr T'=2" in printed and "value noise" in printed
    assert f"wrote {out}" in printed
    assert [r["state"] for r in summary["states"]] == [0, 1, 2, 3]
    assert [r["step"] for r in summary["steps"]] == [0, 1, 2, 3]
    assert summary["settings"]["prompts"] == ["a red circle", "a blue square"]
    assert summary["settings"]["members"] == 3
    # the members share their initial noise (the default preset) and ddim's first step draws none
    assert summary["states"][0]["estimate_spread_T1"] == 0 and math.isnan(summary["states"][0]["corr_T1"])
    assert summary["states"][-1]["value_spread"] > 0  # later steps drew noise
    for row in summary["states"] + summary["steps"]:
        for key in ("corr_T1", "corr_T2"):
            assert math.isnan(row[key]) or -1 - 1e-9 <= row[key] <= 1 + 1e-9
    written = json.loads(out.read_text())  # standard JSON: NaN written as null
    assert written["states"][0]["corr_T1"] is None
    assert [r["t"] for r in written["states"]] == [r["t"] for r in summary["states"]]
    assert written["settings"]["substeps"] == [1, 2]


def test_value_check_follows_the_configs_sampler(tmp_path, tiny_model):
    """With every step an ODE step (sde.min_std above every std), a group's members are one image:
    no value or estimate spreads, no noise, and no correlation."""
    summary = check(tmp_path, tiny_model, "sde.min_std=10")
    assert all(r["value_spread"] == 0 and r["value_noise"] == 0 for r in summary["states"])
    assert all(math.isnan(r["corr_T3"]) for r in summary["states"] + summary["steps"])


@pytest.mark.parametrize(("args", "message"), [
    (["--members", "1"], "argument --members: must be at least 2, got 1"),
    (["--continuations", "1"], "argument --continuations: must be at least 2, got 1"),
    (["--prompts", "x"], "argument --prompts: expected a whole number, got 'x'"),
    (["--substeps", "3,x"], "comma-separated whole numbers"),
    (["optim.lrr=1"], "optim.lr"),
    (["--out", "/nonexistent-folder/v.json"], "--out: folder /nonexistent-folder does not exist"),
    (["--out", ""], "argument --out: an empty path"),
    (["--seed", "-1"], "argument --seed: must be at least 0, got -1"),
    (["--seed", str(2**64)], "argument --seed: must be below 2**63"),
    (["--lora", "/nonexistent-lora"], "--lora: LoRA weights /nonexistent-lora do not exist"),
    (["--device", "gpu"], "--device: 'gpu'"),
    (["rollout.prompts=/nonexistent-prompts.txt"], "rollout.prompts: "),
    (["model.path=/nonexistent-model"], "model.path: "),
])  # fmt: skip
def test_bad_input_is_named_before_anything_is_drawn(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_an_out_that_is_a_folder_or_a_file_already_there_is_refused_before_anything_is_drawn(tmp_path, capsys):
    folder = tmp_path / "tables"
    folder.mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(folder)])
    assert exc.value.code == 2
    assert f"--out: {folder} is a folder; give a file name" in capsys.readouterr().err
    earlier = tmp_path / "value.json"
    earlier.write_text('{"earlier": 1}')
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(earlier)])
    assert exc.value.code == 2
    assert f"--out: {earlier} already exists: give another --out, or --overwrite" in capsys.readouterr().err
    assert earlier.read_text() == '{"earlier": 1}' and sorted(p.name for p in tmp_path.iterdir()) == ["tables", "value.json"]


def test_an_out_under_a_file_says_so(tmp_path, capsys):
    (tmp_path / "afile").write_text("kept")
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "afile" / "v.json")])
    assert exc.value.code == 2
    assert f"--out: folder {tmp_path / 'afile'} is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "kept"


def test_the_configs_seed_is_the_default_and_any_64_bit_seed_draws(tmp_path, tiny_model):
    """The noise of prompt g is seeded from (seed, g): a seed near 2**63 overflowed the generator's
    seed; `seed=` (the config's) is the default of --seed, which replaces it."""
    big = 2**63 - 1
    summary = check(tmp_path, tiny_model, f"seed={big}", "--prompts", "1", "--members", "2")
    assert summary["settings"]["seed"] == big
    assert check(tmp_path, tiny_model, f"seed={big}", "--seed", "4", "--prompts", "1",
                 "--members", "2")["settings"]["seed"] == 4  # fmt: skip


def test_overwrite_replaces_an_earlier_file(tmp_path, tiny_model):
    out = tmp_path / "value.json"
    out.write_text('{"earlier": 1}')
    check(tmp_path, tiny_model, "--out", str(out), "--overwrite")
    assert "states" in json.loads(out.read_text())


def test_ctrl_c_in_the_command_is_one_line(monkeypatch, capsys):
    import stepfast.value_check as value_check

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(value_check, "main", interrupted)
    assert value_check.cli([]) == 130
    assert capsys.readouterr().err == "\npython -m stepfast.value_check: interrupted (--out is written at the end)\n"


def test_a_prompt_the_reward_cannot_score_is_named_by_its_line(tmp_path, capsys):
    file = tmp_path / "prompts.txt"
    file.write_text("a photo of a red circle\na photo of a dog\n")
    with pytest.raises(SystemExit):
        main([f"rollout.prompts={file}", "--prompts", "2"])
    err = capsys.readouterr().err
    assert f"rollout.prompts: {file}:2: reward 'shapes': 'a photo of a dog' is not a ShapeEval prompt" in err


def test_a_reward_server_out_of_reach_is_named_before_the_model_loads(capsys, monkeypatch):
    import stepfast.value_check as value_check

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the reward server was checked")

    monkeypatch.setattr(value_check, "load_pipeline", no_model)
    with pytest.raises(SystemExit) as exc:
        main(["reward.weights={remote: 1.0}", "--prompts", "1",
              "reward.options={remote: {url: 'http://127.0.0.1:9', rewards: [shapes], retries: 0}}"])  # fmt: skip
    assert exc.value.code == 2
    assert "reward.options.remote: reward server http://127.0.0.1:9 failed after 1 attempt(s)" in capsys.readouterr().err
