"""The DeepSpeed engine that runs the update, the process group, and gathering ZeRO-3 weights.

On CPU the process group uses gloo, on CUDA nccl. `python stepfast/train.py` without the deepspeed
launcher runs as a single rank. The optimizer is torch's AdamW handed to DeepSpeed (no JIT-compiled
ops, so the same code runs on any machine); ZeRO stage 1, 2 or 3 partitions its state.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import os
import re
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from .config import OptimConfig

CONFIG_DIR = Path(__file__).resolve().parent / "configs" / "deepspeed"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The JIT-built op DeepSpeed loads when the process group starts, and how long its build may hold
# the lock (a build takes about a minute on 2 cores): a lock older than that was left by a killed build.
SHM_OP = "deepspeed_shm_comm"
STALE_LOCK_SECONDS = 300
# Where DeepSpeed's CPU all-reduce keeps one shared-memory segment per rank (shm_open on Linux).
SHM_DIR = Path("/dev/shm")


def _shm_op_files(root: str | os.PathLike | None, name: str) -> list[Path]:
    """Every `name` file of the shared-memory op's builds where torch puts them: straight under
    $TORCH_EXTENSIONS_DIR (or `root`), or under a folder per Python and accelerator in its default
    root."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(root or os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return sorted([*root.glob(f"{SHM_OP}/{name}"), *root.glob(f"*/{SHM_OP}/{name}")])


def shm_op_built(source: str | os.PathLike, root: str | os.PathLike | None = None, lock_wait: float = 3.0) -> bool:
    """Whether DeepSpeed's shared-memory op is built from `source` (its install's `ops/csrc`): the
    library is there and its build file compiles that source (a path of its own, not the tail of
    another). Another install (another venv, or the same one reached through another path) rebuilds
    it, for about a minute on 2 cores, when the process group starts. A build under way (its lock
    held, or its build file newer than the library, which torch rewrites first) is not one: another
    rank of the same run may have begun it a moment before this one looks. torch takes the lock to
    load a built op too, for a moment: a lock is waited on for up to `lock_wait` seconds before it
    counts as a build's."""
    pattern = re.compile(rf"(?:^|[\s=]|-I){re.escape(os.fspath(source))}/", re.MULTILINE)

    def finished(build: Path) -> bool:
        library, lock = build.parent / f"{SHM_OP}.so", build.parent / "lock"
        if not (library.is_file() and library.stat().st_mtime >= build.stat().st_mtime):
            return False
        deadline = time.monotonic() + lock_wait
        while lock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not lock.exists()

    try:
        return any(pattern.search(b.read_text()) and finished(b) for b in _shm_op_files(root, "build.ninja"))
    except OSError:
        return False


def shm_op_will_build(root: str | os.PathLike | None = None) -> bool:
    """Whether DeepSpeed will build its shared-memory op when the process group starts, as it decides
    (deepspeed.comm.torch.build_shm_op and OpBuilder.load): only where its accelerator has the op
    (the CPU), the op can build here, no prebuilt one was installed with DeepSpeed
    (DS_BUILD_SHM_COMM=1), and `shm_op_built` finds none from this install."""
    import deepspeed
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return False
    if installed_ops.get(builder.NAME, False) and accelerator_name == get_accelerator()._name:
        return False
    return not shm_op_built(Path(deepspeed.__file__).parent / "ops" / "csrc", root)


def stale_build_locks(root: str | os.PathLike | None = None, now: float | None = None) -> list[tuple[Path, float]]:
    """(lock file, its time) of each build of DeepSpeed's shared-memory op locked for over STALE_LOCK_SECONDS.

    DeepSpeed builds (or, once built, checks) its CPU shared-memory communication op whenever the
    process group starts, with torch's cpp_extension under a lock file: $TORCH_EXTENSIONS_DIR/<op>/lock
    when that is set, else <default root>/py311_cpu/<op>/lock (one folder per Python and accelerator).
    A start killed while it holds the lock leaves the file, and every later start waits for it forever
    without a word.
    """
    now = time.time() if now is None else now
    try:
        locks = _shm_op_files(root, "lock")
    except OSError:
        return []
    stale = []
    for lock in locks:
        try:
            since = lock.stat().st_mtime
        except OSError:  # released meanwhile
            continue
        if now - since > STALE_LOCK_SECONDS:
            stale.append((lock, since))
    return stale


class Placement(NamedTuple):
    """Where this process runs: its rank, the number of ranks, and its device."""

    rank: int
    world: int
    device: torch.device


def runs_on_cuda() -> bool:
    """Whether this process trains on a GPU: torch sees one, and DS_ACCELERATOR does not name the CPU.
    `DS_ACCELERATOR=cpu` makes DeepSpeed's accelerator the CPU's, and the run follows it (gloo ranks on
    a GPU machine, as the test suite's are): DeepSpeed's launcher still shows each rank the GPUs."""
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "").strip().lower() != "cpu"


def init_distributed() -> Placement:
    """Join (or create) the process group; returns this process's placement."""
    import deepspeed

    # ZeRO gathers its partitions through torch.distributed.all_gather_into_tensor (and ZeRO-3 reduces
    # gradients through reduce_scatter_tensor), which torch deprecates: each rank warned once about
    # DeepSpeed's own calls, which a run's settings cannot avoid
    deprecated = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
    warnings.filterwarnings("ignore", message=deprecated, category=FutureWarning)

    stale = stale_build_locks()
    if not stale and os.environ.get("RANK", "0") == "0" and shm_op_will_build():  # (a stale lock is waited on)
        print(f"stepfast: DeepSpeed builds its CPU all-reduce op ({SHM_OP}) for this environment before the "
              "run starts: about a minute, once", file=sys.stderr, flush=True)  # fmt: skip
    for lock, since in stale:
        print(f"stepfast: warning: DeepSpeed's {SHM_OP} op has been locked for building since "
              f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(since))}, and DeepSpeed waits for the lock "
              f"without end. If no other process is building it, a killed start left the lock: delete "
              f"{lock}", file=sys.stderr, flush=True)  # fmt: skip

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    cuda = runs_on_cuda()
    if cuda:  # before the process group forms, so that NCCL's first collective uses this rank's GPU
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        device = torch.device("cuda", local)
    else:
        release_shm_name(rank, world)
        device = torch.device("cpu")
    return Placement(rank, world, device)


def shm_buffer(rank: int) -> Path:
    """The shared-memory segment of DeepSpeed's CPU all-reduce for this rank (csrc/cpu/comm/shm.cpp)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return SHM_DIR / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_name(rank: int, world: int) -> None:
    """Remove the name of this rank's DeepSpeed all-reduce segment, keeping the memory mapped.

    When the launcher says every rank shares the machine, DeepSpeed's CPU process group maps a 66 MiB
    segment in /dev/shm per rank and never unlinks it: each `deepspeed --num_gpus N` run on CPU left
    N x 66 MiB of RAM behind until reboot. Once every rank has mapped every segment (each rank maps its
    peers' before init_distributed returns; the barrier waits for all of them), the names are no longer
    needed: the mappings stay valid, and the memory is freed when the ranks exit, however they exit.
    """
    if world > 1:
        dist.barrier()
    with contextlib.suppress(FileNotFoundError):  # no segment: DeepSpeed's shm op is not in use
        shm_buffer(rank).unlink()


def deepspeed_config(optim: OptimConfig, micro_batch: int, accumulation: int) -> dict:
    """The ZeRO config shipped in configs/deepspeed/zero{stage}.json, filled in for this run."""
    path = CONFIG_DIR / f"zero{optim.zero_stage}.json"
    config = json.loads(path.read_text())
    config.update({
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": optim.grad_clip,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # torch's AdamW is the optimizer, with offload too
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer hooks the module's forward and, from the third step on,
        # synchronises the GPU there: in every rollout, estimate and evaluation forward, and inside
        # the estimate engine's CUDA-graph capture, where a synchronisation is illegal
        "timers": {"throughput": {"enabled": False}},
    })  # fmt: skip
    config["bf16"] = {"enabled": optim.precision == "bf16"}
    config["fp16"] = {"enabled": optim.precision == "fp16", "initial_scale_power": 16}
    return merged(config, optim.deepspeed)


#: Top-level DeepSpeed keys that deepspeed.initialize reads itself, not its config parser.
READ_BY_INITIALIZE = {"data_parallel_size"}


class _ReadKeys(dict):
    """A config dict that records the keys read from it (shared by its shallow copies, which is how
    DeepSpeed's parser reads a config)."""

    def __init__(self, *args, read: set | None = None):
        super().__init__(*args)
        self.read = set() if read is None else read

    def get(self, key, *default):
        self.read.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def __copy__(self):
        return _ReadKeys(self, read=self.read)


def unread_settings(optim: OptimConfig, micro_batch: int, accumulation: int) -> list[str]:
    """A warning for each top-level key of optim.deepspeed that the installed DeepSpeed's config parser
    never reads (misspelt, or of another DeepSpeed version), which would have no effect. None when
    the parser refuses the config: build_engine reports that."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    config = _ReadKeys(deepspeed_config(optim, micro_batch, accumulation))
    try:
        DeepSpeedConfig(config)
    except Exception:  # noqa: BLE001 - build_engine names the setting DeepSpeed refuses
        return []
    from deepspeed.runtime import config as ds_config

    from stepfast.config import DEEPSPEED_KEYS_OWNED

    removed = set(getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", ()))  # read only to be refused
    owned = {keys[0]: owner for keys, owner in DEEPSPEED_KEYS_OWNED.items() if len(keys) == 1}
    read = {k for k in config.read if isinstance(k, str)} | READ_BY_INITIALIZE
    found = []
    for key in sorted(k for k in optim.deepspeed if k not in read):
        near = difflib.get_close_matches(key, sorted(read - removed), n=1)
        hint = ""
        if near and near[0] in owned:
            hint = f" (did you mean {near[0]}? stepfast sets it from {owned[near[0]]})"
        elif near:
            hint = f" (did you mean {near[0]}?)"
        found.append(f"optim.deepspeed.{key} is not a setting DeepSpeed {deepspeed.__version__} reads, so it "
                        f"has no effect{hint}")  # fmt: skip
    return found


def merged(base: dict, extra: dict) -> dict:
    """`base` with `extra` merged in, mapping into mapping (neither is changed)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def warmup_factor(step: int, iterations: int, updates: int = 1) -> float:
    """The learning rate's factor at optimizer step `step` (from 0; DeepSpeed steps the scheduler at
    every optimizer step): rising linearly over the first `iterations` iterations of `updates`
    optimizer steps each, then 1."""
    steps = max(iterations, 0) * updates
    return min(1.0, (step + 1) / steps) if steps else 1.0


def warmup_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate's linear warmup over `optim.warmup` iterations of `optim.updates_per_iteration`
    optimizer steps each."""
    factor = functools.partial(warmup_factor, iterations=optim.warmup, updates=optim.updates_per_iteration)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def trainable_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every parameter of `module` that is trained (requires grad)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def build_engine(module: torch.nn.Module, optim: OptimConfig, micro_batch: int, accumulation: int):
    """(engine, optimizer, lr scheduler) for the trainable parameters of `module`."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfigError

    params = [p for _, p in trainable_parameters(module)]
    if not params:
        raise ValueError("the model has no trainable parameters (check model.lora / model.lora_targets)")
    optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    scheduler = warmup_scheduler(optimizer, optim)
    try:
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler,
            config=deepspeed_config(optim, micro_batch, accumulation),
        )  # fmt: skip
    except (ValueError, AssertionError, DeepSpeedConfigError) as exc:  # its config's checks; a precision this device lacks
        raise ValueError(
            f"DeepSpeed refused this run's settings (optim.zero_stage={optim.zero_stage}, optim.precision="
            f"{optim.precision}, optim.deepspeed={optim.deepspeed}): {exc}"
        ) from exc
    return engine, optimizer, scheduler


def gathered(params: list[torch.nn.Parameter], zero3: bool, modify: bool = False):
    """A context in which `params` are whole on every rank: under ZeRO-3 they are gathered from the
    ranks' partitions (a collective every rank enters) and partitioned again on exit. DeepSpeed
    drops what is written into them unless `modify`: then rank 0's values are partitioned back
    (write the same values on every rank)."""
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None)


@torch.no_grad()
def trainable_weights(module: torch.nn.Module, zero3: bool, keep: bool) -> dict[str, torch.Tensor]:
    """The trainable parameters of `module` by `named_parameters` name, as CPU tensors, to write out:
    the optimizer's fp32 master copies where DeepSpeed keeps them (under bf16 or fp16 the module
    holds only rounded copies), assembled from the ranks' partitions; else the module's own weights,
    gathered under ZeRO-3. Collective: every rank enters it; only ranks with `keep` hold the tensors
    (the others get {}). A weight already on the CPU outside ZeRO-3 is returned itself, not a copy:
    write it out before the next update."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, param in trainable_parameters(module):
        master = safe_get_full_fp32_param(param)  # None where no optimizer holds an fp32 copy
        if master is not None:
            if keep:
                out[name] = master.detach().cpu()
            continue
        with gathered([param], zero3):
            if keep:  # a gathered weight is freed on exit: keep a copy of it
                out[name] = param.detach().to("cpu", copy=zero3)
    return out


def all_gather_cat(x: torch.Tensor, world: int) -> torch.Tensor:
    """Concatenate equal-shaped tensors of every rank along dim 0, in rank order."""
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def reduce_stats(values: dict[str, float], world: int, device) -> dict[str, float]:
    """Combine per-rank statistics for logging: keys ending in _min take the minimum over ranks,
    _max the maximum, every other key the mean."""
    if world == 1 or not values:
        return values
    keys = sorted(values)
    out = {}
    for suffix, op in (("_min", dist.ReduceOp.MIN), ("_max", dist.ReduceOp.MAX), ("", dist.ReduceOp.SUM)):
        group = [k for k in keys if k not in out and k.endswith(suffix)]
        if not group:
            continue
        t = torch.tensor([values[k] for k in group], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        scale = world if op == dist.ReduceOp.SUM else 1
        out.update({k: v / scale for k, v in zip(group, t.tolist())})
    return {k: out[k] for k in values}
