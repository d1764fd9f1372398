"""stepfast.checkpoint on its own (one rank, an engine that writes one file): what is kept, in which
order a checkpoint becomes complete, and what loading restores. The trainer's end-to-end resume and
kill tests are in test_train.py."""

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from stepfast import checkpoint


class FileEngine:
    """The two DeepSpeed engine calls checkpoint.py makes, with a state of one number."""

    def __init__(self, value: float = 0.0):
        self.value = value

    def save_checkpoint(self, directory: str, tag: str) -> None:
        Path(directory, tag).mkdir(parents=True)
        torch.save(self.value, Path(directory, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))

    def load_checkpoint(self, directory: str, tag: str):
        self.value = torch.load(Path(directory, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
        return directory, {}


def test_keeps_the_newest_complete_checkpoints_and_drops_stale_partial_ones(tmp_path):
    root = checkpoint.checkpoint_dir(tmp_path)
    root.mkdir(parents=True)
    (root / "checkpoint-000002.tmp").mkdir()  # writes killed before their rename
    (root / "checkpoint-000009.tmp").mkdir()
    for it in (1, 2, 3, 4):
        checkpoint.save(tmp_path, it, FileEngine(it), {"iteration": it}, rank=0, world=1, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-000003", "checkpoint-000004"]
    assert checkpoint.latest(tmp_path) == root / "checkpoint-000004"
    checkpoint.save(tmp_path, 5, FileEngine(5), {"iteration": 5}, rank=0, world=1, keep=3)
    assert sorted(p.name for p in root.iterdir()) == [f"checkpoint-00000{i}" for i in (3, 4, 5)]


def test_a_prune_cut_short_is_finished_by_the_next_one(tmp_path, monkeypatch):
    """A kill while a pruned checkpoint is deleted (its COMPLETE may go first: rmtree's order is the
    folder's) leaves a folder no complete set names; the next save's prune removes it."""
    import shutil

    root = checkpoint.checkpoint_dir(tmp_path)
    for it in (1, 2):
        checkpoint.save(tmp_path, it, FileEngine(it), {"iteration": it}, rank=0, world=1, keep=2)
    real_rmtree = shutil.rmtree

    def killed(path, ignore_errors=False):  # the kill: COMPLETE is gone, the rest is left
        if Path(path).name.startswith("checkpoint-000001"):
            (Path(path) / "COMPLETE").unlink()
            raise KeyboardInterrupt
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 3, FileEngine(3), {"iteration": 3}, rank=0, world=1, keep=2)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert checkpoint.latest(tmp_path) == root / "checkpoint-000003"
    checkpoint.save(tmp_path, 4, FileEngine(4), {"iteration": 4}, rank=0, world=1, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-000003", "checkpoint-000004"]
    # what an earlier version's cut-short prune left: a final-named folder without COMPLETE
    (root / "checkpoint-000002").mkdir()
    (root / "checkpoint-000002" / "state.pt").write_bytes(b"left")
    checkpoint.save(tmp_path, 5, FileEngine(5), {"iteration": 5}, rank=0, world=1, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-000004", "checkpoint-000005"]


def test_a_checkpoint_is_complete_before_it_takes_its_final_name(tmp_path, monkeypatch):
    """COMPLETE is written inside the .tmp folder and the folder then renamed: a kill between the two
    leaves a .tmp folder (never read), never a final-named folder without COMPLETE."""
    renames = []
    rename = Path.rename

    def spy(self, target):
        renames.append((self.name, Path(target).name, (self / "COMPLETE").is_file()))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", spy)
    checkpoint.save(tmp_path, 7, FileEngine(), {"iteration": 7}, rank=0, world=1)
    assert renames == [("checkpoint-000007.tmp", "checkpoint-000007", True)]
    assert checkpoint.iteration_of(checkpoint.latest(tmp_path)) == 7


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names the synced files through /proc")
def test_a_checkpoint_is_on_disk_before_it_takes_its_final_name(tmp_path, monkeypatch):
    """Every file and folder of the checkpoint, COMPLETE included, is flushed (fsync) before the
    rename that makes it the newest, and the rename itself after: a power loss cannot leave a
    complete-named checkpoint whose files the disk never received."""
    import os

    events = []
    fsync, rename = os.fsync, Path.rename

    def fsync_spy(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        return fsync(fd)

    def rename_spy(self, target):
        events.append(("rename", self.absolute()))
        return rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync_spy)
    monkeypatch.setattr(Path, "rename", rename_spy)
    final = checkpoint.save(tmp_path, 7, FileEngine(), {"iteration": 7}, rank=0, world=1,
                            write_weights=lambda folder: (folder / "lora").mkdir() or (folder / "lora" / "w").write_bytes(b"w"))  # fmt: skip
    tmp = final.with_name(final.name + ".tmp").absolute()
    at = events.index(("rename", tmp))
    synced = {path for kind, path in events[:at] if kind == "fsync"}
    written = {tmp / p.relative_to(final) for p in final.rglob("*")} | {tmp}
    assert len(written) == 10 and written <= synced, sorted(written - synced)
    assert ("fsync", final.parent.absolute()) in events[at:]


def test_load_restores_the_engine_every_rng_and_the_state(tmp_path):
    engine = FileEngine(3.5)
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    path = checkpoint.save(tmp_path, 1, engine, {"iteration": 1, "sampler_position": 1}, rank=0, world=1)
    after_save = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(2)  # the resumed process's own state
    np.random.seed(2)
    torch.manual_seed(2)
    restored = FileEngine()
    state = checkpoint.load(path, restored, rank=0)
    assert state == {"iteration": 1, "sampler_position": 1} and restored.value == 3.5
    again = (random.random(), float(np.random.rand()), torch.rand(3))
    assert again[:2] == after_save[:2] and torch.equal(again[2], after_save[2])


def test_load_names_a_folder_that_is_not_a_complete_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no COMPLETE marker"):
        checkpoint.load(tmp_path, FileEngine(), rank=0)
