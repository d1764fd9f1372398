"""Atomic checkpoints that let a run continue exactly.

    output_dir/checkpoints/checkpoint-000010/
        lora/pytorch_lora_weights.safetensors   the adapter, diffusers format (pipe.load_lora_weights)
        lora_ema/pytorch_lora_weights.safetensors   with optim.ema > 0: the EMA weights, same format
        transformer/, transformer_ema/          in place of lora/, lora_ema/ with model.lora=false: the
                                                whole transformer (SD3Transformer2DModel.from_pretrained)
        engine/                                 DeepSpeed state: weights, optimizer, LR scheduler
        rng/rank{r}.pt                          RNG states of every rank
        state.pt                                iteration, EMA, prompt-sampler position, evaluations so far
        COMPLETE                                written last

Every rank writes into `checkpoint-000010.tmp/` and flushes it to disk; after a barrier rank 0 writes
COMPLETE and renames the folder. A kill or a power loss at any moment leaves either the old set of
checkpoints or the old set plus the new one (less those pruned: renamed `.deleting` first): a `.tmp`
or `.deleting` folder is never read, and `resume=auto` takes the newest folder with COMPLETE in it.
The next prune removes what a kill left.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from stepfast.files import sync, sync_folder

PATTERN = re.compile(r"^checkpoint-(\d{6})$")


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under output_dir, or None."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if PATTERN.match(p.name) and is_complete(p)]
    return max(done, key=lambda p: p.name) if done else None


def is_complete(path: str | Path) -> bool:
    """Whether a checkpoint folder was written to the end: its COMPLETE marker is written last."""
    return (Path(path) / "COMPLETE").exists()


def iteration_of(path: str | Path) -> int | None:
    """The iteration a complete checkpoint folder holds (its COMPLETE marker says), or None."""
    try:
        return int((Path(path) / "COMPLETE").read_text().strip())
    except (OSError, ValueError):
        return None


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def save(output_dir, iteration: int, engine, state: dict, rank: int, world: int, write_weights=None,
         keep: int = 2) -> Path:  # fmt: skip
    """Write checkpoint `iteration` atomically (collective: every rank calls it).

    write_weights(folder), on rank 0: writes the weights in diffusers' format (`lora/`, `lora_ema/`
    or `transformer/`, `transformer_ema/`) into the checkpoint folder being written."""
    root = checkpoint_dir(output_dir)
    final = root / f"checkpoint-{iteration:06d}"
    tmp = root / f"checkpoint-{iteration:06d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(world)
    engine.save_checkpoint(str(tmp / "engine"), tag="state")
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank{rank}.pt")
    if rank == 0:
        torch.save(state, tmp / "state.pt")
        if write_weights is not None:
            write_weights(tmp)
    _barrier(world)
    if int(os.environ.get("LOCAL_RANK", rank)) == 0:
        sync(tmp)  # once per node, its ranks' files whole: on disk before COMPLETE can name them
    _barrier(world)
    if rank == 0:
        (tmp / "COMPLETE").write_text(f"{iteration}\n")
        sync(tmp / "COMPLETE")
        sync_folder(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        sync_folder(root)
        prune(root, keep)
    _barrier(world)
    return final


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, stale .tmp folders, and what an earlier
    prune left half deleted. A checkpoint is first renamed to `.deleting` (one atomic step out of
    the complete set), so that a kill during its deletion leaves a folder the next prune finds."""
    done = sorted(p for p in root.iterdir() if PATTERN.match(p.name) and is_complete(p))
    for old in done[: max(len(done) - keep, 0)]:
        doomed = old.with_name(old.name + ".deleting")
        old.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    # checkpoints are written under .tmp and renamed complete: a checkpoint-NNNNNN folder older than
    # the newest complete one, without COMPLETE, is one whose deletion an earlier version cut short
    newest = done[-1].name if done else None
    debris = [p for p in root.iterdir() if PATTERN.match(p.name) and newest and p.name < newest and not is_complete(p)]
    for stale in [*root.glob("checkpoint-*.tmp"), *root.glob("checkpoint-*.deleting"), *debris]:
        shutil.rmtree(stale, ignore_errors=True)


#: Settings a checkpoint's engine state is laid out by (startup.engine_settings_problem: ZeRO stages 1
#: and 2 save alike, and the LoRA's targets in any order): a run resumed from it keeps them.
ENGINE_SETTINGS = ("model.lora", "model.lora_rank", "model.lora_targets", "optim.zero_stage", "optim.precision")


def check_world(path: Path, world: int) -> None:
    """A ValueError naming checkpoint `path` when it was written by another number of ranks than
    `world` (DeepSpeed writes one optimizer shard per rank, and cannot re-split them), or when its
    RNG files do not match its shards (a damaged checkpoint). Checks only a folder marked complete
    that has its engine state: `load` names what else is missing."""
    path = Path(path)
    if not is_complete(path) or not (path / "engine").is_dir():
        return
    # zero_pp_rank_{r}_mp_rank_00_optim_states.pt, with a bf16_ prefix under bf16
    shards = len(list((path / "engine").glob("*/*zero_pp_rank_*_optim_states.pt")))
    ranks = sorted(int(p.stem[4:]) for p in (path / "rng").glob("rank*.pt") if p.stem[4:].isdigit())
    if shards == 0 or ranks != list(range(shards)):
        raise ValueError(
            f"checkpoint {path} is marked complete but holds optimizer shards of {shards} rank(s) and RNG "
            f"files of ranks {ranks or 'none'} (a damaged checkpoint)"
        )
    if shards != world:
        raise ValueError(
            f"checkpoint {path} was written by {shards} rank(s) and this run has {world}: DeepSpeed cannot "
            f"re-split ZeRO's optimizer state across another number of ranks; resume on {shards} rank(s) "
            "in total, or start a new run in another output_dir"
        )


def load(path: Path, engine, rank: int) -> dict:
    """Restore engine, RNG of this rank, and return the saved state dict."""
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
    missing = [name for name in ("engine", "state.pt") if not (path / name).exists()]
    if missing:
        raise FileNotFoundError(f"{path} is marked complete but has no {' or '.join(missing)}")
    try:
        load_path, _ = engine.load_checkpoint(str(path / "engine"), tag="state")
        if load_path is None:
            raise FileNotFoundError(f"{path / 'engine'}: DeepSpeed found no engine state to load")
        set_rng_state(torch.load(path / "rng" / f"rank{rank}.pt", weights_only=False))  # see check_world
        return torch.load(path / "state.pt", weights_only=False)
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, AssertionError, KeyError, EOFError, FileNotFoundError, pickle.UnpicklingError) as exc:
        # a truncated file, weights of another shape, or DeepSpeed looking for the files of another
        # ZeRO stage or precision: name the checkpoint and the likely causes
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ValueError(
            f"checkpoint {path} cannot be loaded into this run ({type(exc).__name__}: {first}); a damaged "
            f"file, or a run with other settings than the checkpoint's ({', '.join(ENGINE_SETTINGS)}, or "
            "another model.path)"
        ) from exc
