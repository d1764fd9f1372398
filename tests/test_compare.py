"""stepfast.compare: the spec it reads, the runs it skips, resumes and reports, and the summary it writes."""

import json
import math
import sys

import pytest

from stepfast import compare


def write_spec(tmp_path, text: str):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


SPEC = """
name: toy
metric: strict
seeds: [0, 1, 2]
common: "iterations=4"
runs:
  base: ""
  better: "optim.lr=0.01 'reward.weights={random: 1.0}'"
claims:
  - {claim: "better beats base", runs: [better, base]}
"""


def fake_run(folder, values, seconds_per_it, iterations=4, every=2):
    """A finished run's files as the trainer and compare leave them: metrics.csv, eval_*.json, done.json."""
    folder.mkdir(parents=True)
    rows = ["iteration,reward,time/iteration"] + [f"{i},0.5,{seconds_per_it}" for i in range(1, iterations + 1)]
    (folder / "metrics.csv").write_text("\n".join(rows) + "\n")
    tags = ["before", *(f"iter{i:06d}" for i in range(every, iterations, every)), "after"]
    assert len(tags) == len(values)
    for tag, v in zip(tags, values):
        (folder / f"eval_{tag}.json").write_text(json.dumps({"overall": {"strict": v, "score": v / 2, "n": 8}}))
    (folder / "done.json").write_text("{}")


def test_read_spec_splits_overrides_and_names_each_bad_key(tmp_path):
    spec = compare.read_spec(write_spec(tmp_path, SPEC))
    assert spec.runs == {"base": [], "better": ["optim.lr=0.01", "reward.weights={random: 1.0}"]}
    assert spec.common == ["iterations=4"] and spec.seeds == [0, 1, 2] and spec.metric == "strict"
    for bad, says in [
        (SPEC.replace("metric: strict", "metric: loss"), "metric: expected score or strict, got 'loss'"),
        (SPEC.replace("seeds: [0, 1, 2]", "seeds: [0, one]"), "seeds: expected a list of whole numbers"),
        (SPEC.replace("runs: [better, base]", "runs: [better, worse]"), "claims[0]: expected"),
        (SPEC + "itrations: 3\n", "unknown keys ['itrations']"),
        (SPEC.replace("name: toy", "name: a/b"), "name: expected a folder name"),
        (SPEC.replace('  base: ""', "  base: 3"), "runs.base: expected a string of overrides"),
        ("name: toy\n", "runs: expected a mapping"),
    ]:
        with pytest.raises(ValueError, match=f"spec.yaml: {'.*' if 'claims' in says else ''}"):
            compare.read_spec(write_spec(tmp_path, bad))
        with pytest.raises(ValueError) as err:
            compare.read_spec(write_spec(tmp_path, bad))
        assert says in str(err.value)


def test_mean_se_interpolation_and_verdicts():
    mean, se = compare.mean_se([1.0, 2.0, 3.0])
    assert mean == 2.0 and se == pytest.approx(1 / math.sqrt(3))
    assert math.isnan(compare.mean_se([1.0])[1])
    curve = {"seconds": [0.0, 10.0, 20.0], "values": [0.2, 0.4, 0.8]}
    assert compare.at_seconds(curve, 5.0) == pytest.approx(0.3)
    assert compare.at_seconds(curve, 15.0) == pytest.approx(0.6)
    assert compare.at_seconds(curve, 99.0) == 0.8
    assert compare.first_reaching(curve["seconds"], curve["values"], 0.6) == pytest.approx(15.0)
    assert compare.first_reaching(curve["seconds"], curve["values"], 0.9) is None
    assert compare.verdict((0.5, 0.01), (0.3, 0.01)).endswith("confirmed")
    assert compare.verdict((0.3, 0.01), (0.5, 0.01)).endswith("refuted")
    assert compare.verdict((0.31, 0.05), (0.3, 0.05)).endswith("not separable")
    assert "one seed" in compare.verdict((0.3, float("nan")), (0.2, float("nan")))


def test_summary_of_finished_runs(tmp_path):
    spec = compare.read_spec(write_spec(tmp_path, SPEC))
    out = tmp_path / "results"
    for seed, (a, b) in enumerate([(0.1, 0.2), (0.1, 0.3), (0.1, 0.4)]):
        fake_run(compare.run_dir(out, "base", seed), [0.1, 0.15, a + 0.1], seconds_per_it=2.0)
        fake_run(compare.run_dir(out, "better", seed), [0.1, b, b + 0.3], seconds_per_it=4.0)
    compare.run_dir(out, "better", 3).mkdir(parents=True)  # not in the spec's seeds: never read
    (compare.run_dir(out, "base", 0) / "eval_after-before-3.json").write_text("{}")  # set aside by a resume
    summary = compare.summarise(spec, out)
    base, better = summary["runs"]["base"], summary["runs"]["better"]
    assert base["iterations"] == [0, 2, 4] and base["seconds"] == [0.0, 4.0, 8.0]
    assert better["seconds"] == [0.0, 8.0, 16.0] and better["s_per_it"][0] == 4.0
    assert base["gain"][0] == pytest.approx(0.1) and base["gain"][1] == pytest.approx(0.0)
    assert better["gain"][0] == pytest.approx(0.5) and better["gain"][1] == pytest.approx(0.1 / math.sqrt(3))
    # equal wall-clock: the baseline's 8 s; better's seeds there are at their iteration-2 values
    assert summary["equal_seconds"] == 8.0 and better["at_equal_seconds"][0] == pytest.approx(0.3)
    # better's mean curve (0.1, 0.3, 0.6) first reaches the baseline's final 0.2 halfway to 8 s
    assert better["to_baseline"] == pytest.approx(4.0) and base["to_baseline"] == pytest.approx(8.0)
    (claim,) = summary["claims"]
    assert claim["per_iteration"] == "+0.400 ± 0.058: confirmed"
    assert claim["per_second"] == "+0.100 ± 0.058: not separable"  # at 8 s better had half its iterations
    text = compare.markdown(spec, summary, "python -m stepfast.compare spec.yaml", "host")
    assert "| better | `optim.lr=0.01 'reward.weights={random: 1.0}'` | 3 |" in text
    assert "| better beats base (`better` vs `base`) | +0.400 ± 0.058: confirmed |" in text


def test_a_run_not_finished_is_left_out_and_trained_by_main(tmp_path, monkeypatch):
    """main() trains what is not done (seed by seed), skips what is, and rewrites the summary."""
    spec_path = write_spec(tmp_path, SPEC.replace("seeds: [0, 1, 2]", "seeds: [0, 1]"))
    out = tmp_path / "results"
    fake_run(compare.run_dir(out, "base", 0), [0.1, 0.2, 0.3], seconds_per_it=1.0)
    trained = []

    def train_one(spec, out_, run, seed, ranks):
        trained.append((run, seed))
        fake_run(compare.run_dir(out_, run, seed), [0.1, 0.2, 0.4], seconds_per_it=1.0)
        return 1.0

    monkeypatch.setattr(compare, "train_one", train_one)
    assert compare.main([str(spec_path), "--out", str(out), "--ranks", "1"]) == 0
    assert trained == [("better", 0), ("base", 1), ("better", 1)]
    saved = json.loads((out / "results.json").read_text())
    assert saved["runs"]["base"]["seeds"] == [0, 1] and (out / "curves.png").stat().st_size > 0
    assert "| base |" in (out / "results.md").read_text()
    summary = compare.summarise(compare.read_spec(spec_path), out)
    del summary["runs"]["base"]  # a comparison whose baseline has not run yet says so
    summary["claims"] = []
    text = compare.markdown(compare.read_spec(spec_path), summary, "cmd", "host")
    assert "(baseline not run)" in text and "Waiting for runs: better beats base." in text
    trained.clear()
    assert compare.main([str(spec_path), "--out", str(out)]) == 0 and trained == []  # all done: nothing to train


def test_a_failing_run_names_its_log_and_keeps_the_others(tmp_path, monkeypatch, capsys):
    spec_path = write_spec(tmp_path, SPEC.replace("seeds: [0, 1, 2]", "seeds: [0]"))
    out = tmp_path / "results"
    fake_run(compare.run_dir(out, "base", 0), [0.1, 0.2, 0.3], seconds_per_it=1.0)
    script = "import sys; print('stepfast: error: the reward server at 127.0.0.1:9 is down'); sys.exit(2)"
    monkeypatch.setattr(compare, "launch_command", lambda args, ranks: ([sys.executable, "-c", script], {}))
    assert compare.main([str(spec_path), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "better seed 0 failed (exit 2)" in err and "the reward server at 127.0.0.1:9 is down" in err
    assert not (compare.run_dir(out, "better", 0) / "done.json").exists()  # tried again next time
    assert json.loads((out / "results.json").read_text())["runs"]["base"]["seeds"] == [0]


def test_the_launch_is_make_trains(monkeypatch):
    """Several ranks go through DeepSpeed's launcher on a free port, one rank through plain Python;
    the run's overrides come last, after the spec's, so that seed and output_dir are compare's."""
    monkeypatch.setattr(compare, "_cuda_devices", lambda: 0)
    cmd, env = compare.launch_command(["seed=1"], ranks=2)
    assert "--num_gpus" in cmd and cmd[cmd.index("--num_gpus") + 1] == "2"
    assert int(cmd[cmd.index("--master_port") + 1]) > 0 and cmd[-2:] == [str(compare.TRAIN), "seed=1"]
    assert env["DS_ACCELERATOR"] == "cpu" and int(env["OMP_NUM_THREADS"]) >= 1
    cmd, _ = compare.launch_command(["seed=1"], ranks=1)
    assert cmd == [sys.executable, str(compare.TRAIN), "seed=1"]


def test_a_bad_spec_or_run_name_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        compare.main([str(tmp_path / "missing.yaml")])
    assert exit_.value.code == 2 and "missing.yaml: cannot read the comparison" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.main([str(write_spec(tmp_path, SPEC)), "--only", "bettr", "--out", str(tmp_path / "r")])
    assert "--only: no run named 'bettr'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
