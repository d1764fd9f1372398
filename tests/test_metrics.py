"""The metrics log on resume: rows past the checkpoint are dropped and the file rewritten, from the rows
the trainer read at start (checked there, before the model loads) without reading the file again."""

import os

import pytest

from stepfast import metrics
from stepfast.metrics import MetricsLogger, read_logged


def write_log(path, rows):
    logger = MetricsLogger(path, enabled=True, tensorboard=False)
    for it, reward in rows:
        logger.log(it, {"reward": reward})
    logger.close()


@pytest.mark.parametrize("given", [True, False])
def test_resume_keeps_the_rows_up_to_the_checkpoint(tmp_path, monkeypatch, given):
    write_log(tmp_path, [(1, 0.5), (2, 0.25), (3, 0.125)])
    logged = read_logged(tmp_path / "metrics.csv")
    if given:  # the rows handed over are the ones used: the file is not read a second time
        monkeypatch.setattr(metrics, "read_logged", lambda *a, **k: pytest.fail("metrics.csv read again"))
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, resume_from=2,
                           logged=logged if given else None)  # fmt: skip
    logger.log(3, {"reward": 1.0})
    logger.close()
    monkeypatch.undo()
    assert read_logged(tmp_path / "metrics.csv") == [
        {"iteration": 1, "reward": 0.5}, {"iteration": 2, "reward": 0.25}, {"iteration": 3, "reward": 1.0}
    ]


def test_resume_purges_the_tensorboard_points_after_the_checkpoint(tmp_path):
    """TensorBoard's own log on resume: the points the dead run logged past the checkpoint are purged,
    so the curve shows iteration 3 once, with the resumed run's value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=True)
    for it, reward in [(1, 0.5), (2, 0.25), (3, 0.125)]:
        logger.log(it, {"reward": reward})
    logger.close()
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=True, resume_from=2)
    logger.log(3, {"reward": 1.0})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.5), (2, 0.25), (3, 1.0)]


def test_a_resumed_run_logs_on_in_the_wandb_run_it_began(tmp_path, monkeypatch):
    """The W&B run id is kept in output_dir/wandb_run_id: a resume passes it again, a run that starts
    from its first iteration (after a failed start, say) gets a new one."""
    import sys
    import types

    calls, ids = [], iter(["first", "second"])
    run = types.SimpleNamespace(log=lambda values, step: None, finish=lambda: None)
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or run,
                                 util=types.SimpleNamespace(generate_id=lambda: next(ids)))
    monkeypatch.setitem(sys.modules, "wandb", fake)

    def start(resume_from):
        logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, wandb=True, resume_from=resume_from)
        logger.log(resume_from + 1, {"reward": 0.5})
        logger.close()
        return calls[-1]["id"], calls[-1]["resume"]

    assert start(0) == ("first", "allow")
    assert (tmp_path / "wandb_run_id").read_text() == "first\n"
    assert start(1) == ("first", "allow")  # resumed: the same W&B run
    assert start(0) == ("second", "allow")  # begun again: a new one, kept for its resumes
    assert start(1) == ("second", "allow")


def test_a_resume_does_not_log_to_wandb_the_iterations_it_holds_already(tmp_path, monkeypatch, capsys):
    """A run stopped after logging iterations 4 and 5 past its checkpoint at 3: W&B, which ignores a
    step it holds (warning at each call), is not sent 4 and 5 again; metrics.csv gets them."""
    import sys
    import types

    sent = []
    run = types.SimpleNamespace(log=lambda values, step: sent.append(step), finish=lambda: None)
    fake = types.SimpleNamespace(init=lambda **kw: run, util=types.SimpleNamespace(generate_id=lambda: "id"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    write_log(tmp_path, [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.5)])
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, wandb=True, resume_from=3)
    assert "the W&B run holds iterations 4-5 of the run stopped after them" in capsys.readouterr().out
    for it in (4, 5, 6):
        logger.log(it, {"reward": it / 100})
    logger.close()
    assert sent == [6]
    assert [r["reward"] for r in read_logged(tmp_path / "metrics.csv")] == [0.1, 0.2, 0.3, 0.04, 0.05, 0.06]
    # a resume from the last row logged holds nothing to skip, and says nothing
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, wandb=True, resume_from=6)
    logger.log(7, {"reward": 0.07})
    logger.close()
    assert sent == [6, 7] and "W&B" not in capsys.readouterr().out


def test_a_row_cut_short_by_a_kill_is_left_out_and_a_row_of_other_length_is_named(tmp_path):
    """The logger writes whole rows; a kill while it appends one leaves a last line without its
    newline, which is a row the run did not finish (past its checkpoint, as a resume drops). A row
    with more or fewer cells than the header anywhere else was edited: named, not read shifted."""
    path = tmp_path / "metrics.csv"
    path.write_text("iteration,reward,loss\n1,0.5,0.1\n2,0.6,0.2\n3,0.4")
    assert [r["iteration"] for r in read_logged(path)] == [1, 2]
    path.write_text("iteration,reward,loss\n1,0.5,0.1\n2,0.6\n3,0.4,0.3\n")
    with pytest.raises(ValueError, match=r"metrics.csv: cannot read .*\(line 3: 2 cells, where the header has 3\)"):
        read_logged(path)
    path.write_text("iteration,reward,loss\n1,0.5,0.1,9\n")
    with pytest.raises(ValueError, match=r"\(line 2: 4 cells, where the header has 3\)"):
        read_logged(path)
    path.write_text("iteration,reward,loss\n1,,0.1\n")  # a column not logged that iteration
    assert read_logged(path) == [{"iteration": 1, "reward": "", "loss": 0.1}]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names the synced files through /proc")
def test_sync_flushes_the_appended_rows_to_disk(tmp_path, monkeypatch):
    """The trainer syncs metrics.csv before each checkpoint: its rows are on disk when the checkpoint is."""
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False)
    logger.log(1, {"reward": 0.5})
    logger.log(2, {"reward": 0.25})  # appended, not rewritten
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or fsync(fd))
    logger.sync()
    assert synced == [str(tmp_path / "metrics.csv")]
    logger.close()


def test_metrics_csv_groups_its_columns_whatever_the_iteration_that_first_logged_them(tmp_path):
    """A category first drawn at iteration 2 lands with the other categories, before the times, and
    the iteration's total time comes last (it was after the first iteration's columns)."""
    import csv

    from stepfast.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, True, False, False, "p", {})
    logger.log(1, {"reward": 0.5, "category/colors": 0.4, "time/rollout": 1.0, "time/iteration": 2.0})
    logger.log(2, {"reward": 0.6, "category/colors": 0.5, "time/rollout": 1.0, "time/iteration": 2.0,
                   "category/counting": 0.7, "grad_norm": 1.5})  # fmt: skip
    logger.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["iteration", "reward", "grad_norm", "category/colors", "category/counting",
                             "time/rollout", "time/iteration"]  # fmt: skip
    assert rows[0]["category/counting"] == "" and rows[1]["category/counting"] == "0.7"
