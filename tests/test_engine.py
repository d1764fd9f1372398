"""The engine: at the process-group start a lock left by a killed build of DeepSpeed's op is named, not
waited on in silence; the EMA applied for evaluation gives the model its weights back exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from stepfast.engine import SHM_OP, STALE_LOCK_SECONDS, runs_on_cuda, shm_op_built, stale_build_locks

ROOT = Path(__file__).resolve().parent.parent


def lock(root: Path, name: str, age: float, folder: str = "py311_cpu") -> Path:
    """A lock `age` seconds old where torch puts it: under a folder per Python and accelerator in its
    default root, straight under $TORCH_EXTENSIONS_DIR when that is set (folder="")."""
    path = root / folder / name / "lock"
    path.parent.mkdir(parents=True)
    path.touch()
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_only_an_old_lock_of_the_shm_op_is_stale(tmp_path):
    assert stale_build_locks(tmp_path) == []
    fresh = lock(tmp_path / "a", SHM_OP, age=10)  # a build running now: not stale
    assert stale_build_locks(tmp_path / "a") == []
    assert stale_build_locks(tmp_path / "a", now=time.time() + STALE_LOCK_SECONDS) == [(fresh, fresh.stat().st_mtime)]
    lock(tmp_path / "b", "fused_adam", age=10 * STALE_LOCK_SECONDS)  # another op: not loaded at start
    assert stale_build_locks(tmp_path / "b") == []
    assert stale_build_locks(tmp_path / "missing") == []
    direct = lock(tmp_path / "c", SHM_OP, age=2 * STALE_LOCK_SECONDS, folder="")  # $TORCH_EXTENSIONS_DIR's
    assert stale_build_locks(tmp_path / "c") == [(direct, direct.stat().st_mtime)]


def test_the_shm_op_counts_as_built_only_from_this_install(tmp_path):
    """The trainer says a build is coming (a silent minute otherwise) unless the library is there and
    was built from this DeepSpeed install's sources, and no build of it is under way."""
    ours, theirs = "/venv/a/deepspeed/ops/csrc", "/venv/b/deepspeed/ops/csrc"
    assert not shm_op_built(ours, tmp_path / "none")
    for folder in ("py311_cpu", ""):  # the default root's layout, and $TORCH_EXTENSIONS_DIR's
        root = tmp_path / (folder or "direct")
        op = root / folder / SHM_OP
        op.mkdir(parents=True)
        library = op / f"{SHM_OP}.so"

        def built(text: str) -> None:  # a finished build: torch writes the build file, then links
            (op / "build.ninja").write_text(text)
            then = (op / "build.ninja").stat().st_mtime + 1
            library.write_bytes(b"\x7fELF")
            os.utime(library, (then, then))

        (op / "build.ninja").write_text(f"cflags = -I{ours}/cpu/includes -fPIC\n")
        assert not shm_op_built(ours, root)  # a build begun, never finished
        built(f"cflags = -I{ours}/cpu/includes -fPIC\n")
        assert shm_op_built(ours, root)
        assert not shm_op_built(theirs, root)  # another venv's build: rebuilt for this one
        copy = f"/copy{ours}"
        built(f"cflags = -I{copy}/cpu/includes\nbuild shm.o: compile {copy}/x.cpp\n")
        assert not shm_op_built(ours, root)  # another checkout whose path ends in this one's
        built(f"build shm.o: compile {ours}/cpu/comm/shm.cpp\n")
        assert shm_op_built(ours, root)
        # a build under way: another rank of the run began it a moment before (torch writes the build
        # file first and holds the lock while it compiles), another install's library still there
        built(f"cflags = -I{theirs}/cpu/includes\n")
        (op / "build.ninja").write_text(f"cflags = -I{ours}/cpu/includes\n")  # rewritten for this install
        os.utime(op / "build.ninja", (library.stat().st_mtime + 1,) * 2)
        assert not shm_op_built(ours, root)
        built(f"cflags = -I{ours}/cpu/includes\n")
        assert shm_op_built(ours, root)
        (op / "lock").touch()
        assert not shm_op_built(ours, root, lock_wait=0.2)
        # torch holds the lock for a moment to load a built op (another rank starting): not a build
        threading.Timer(0.3, (op / "lock").unlink).start()
        assert shm_op_built(ours, root, lock_wait=5.0)


def first_line_with(marker: str, extensions: Path, out: Path, linger: float = 0.0, seen: list | None = None) -> str:
    """The first stderr line holding `marker` of a one-rank trainer start with torch's extensions under
    `extensions`, which is killed `linger` seconds after (or after 240 s): a build of DeepSpeed's op is
    not waited for. `seen` collects every line read."""
    # DeepSpeed's CPU all-reduce op is a CPU run's: on the CPU on any machine
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}  # fmt: skip
    cmd = [sys.executable, str(ROOT / "stepfast" / "train.py"), f"output_dir={out}", "iterations=1"]
    # its own session, so that the compilers of a build it starts (ninja gives each command a process
    # group of its own) are killed with it
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    seen = [] if seen is None else seen  # read in a thread: a start waiting on the lock has nothing to read
    reader = threading.Thread(target=lambda: seen.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 240
        while not any(marker in line for line in seen) and time.time() < deadline:
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        time.sleep(linger)
    finally:
        try:
            subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)
        except FileNotFoundError:  # no procps: the session's leader's group at least
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(timeout=10)
    found = next((line for line in seen if marker in line), None)
    assert found is not None, "".join(seen)[-3000:]
    return found


def test_the_trainer_names_a_stale_lock_before_deepspeed_waits_on_it(tmp_path):
    """DeepSpeed waits on the lock without end: the warning is the only line the user gets."""
    path = lock(tmp_path / "ext", SHM_OP, age=2 * STALE_LOCK_SECONDS, folder="")  # where torch looks
    seen: list[str] = []
    warning = first_line_with("stepfast: warning", tmp_path / "ext", tmp_path / "run", linger=2.0, seen=seen)
    assert not any("about a minute" in line for line in seen)  # no build notice: DeepSpeed waits, never builds
    assert f"DeepSpeed's {SHM_OP} op has been locked for building since" in warning
    assert f"delete {path}" in warning
    assert not (tmp_path / "run").exists()  # stopped before anything was written


def test_the_trainer_says_a_build_of_deepspeeds_op_is_coming(tmp_path):
    """Where the op is not built for this install, the start says so before the silent minute."""
    line = first_line_with(f"({SHM_OP})", tmp_path / "empty", tmp_path / "run")
    assert "DeepSpeed builds its CPU all-reduce op" in line and "about a minute, once" in line


@pytest.mark.parametrize("gpu, accelerator, expected", [
    (True, None, True), (True, "cuda", True), (True, "cpu", False), (True, " CPU ", False), (False, None, False),
    (False, "cuda", False),
])  # fmt: skip
def test_ds_accelerator_cpu_keeps_a_run_on_the_cpu_of_a_gpu_machine(monkeypatch, gpu, accelerator, expected):
    """DeepSpeed's launcher shows each rank the GPUs even with DS_ACCELERATOR=cpu: the run follows
    the accelerator asked for, not torch's view of the machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    if accelerator is None:
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    else:
        monkeypatch.setenv("DS_ACCELERATOR", accelerator)
    assert runs_on_cuda() is expected


def test_ema_weights_apply_and_come_back_exactly_in_a_bf16_module():
    """Evaluation computes with the EMA, then the model gets its own weights back bit for bit; the
    shadow keeps its fp32 values, which a bf16 model cannot hold (it must not come back rounded)."""

    from stepfast.ema import EMA

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)).to(torch.bfloat16)
    module[1].bias.requires_grad_(False)  # not trained: not the EMA's
    ema = EMA(module, 0.9, zero_stage=2)
    assert set(ema.shadow) == {"0.weight", "0.bias", "1.weight"}
    ema.shadow = {n: torch.randn(v.shape) / 3 for n, v in ema.shadow.items()}  # values bf16 rounds
    shadow = {n: v.clone() for n, v in ema.shadow.items()}
    own = {n: p.detach().clone() for n, p in module.named_parameters()}
    for _ in range(2):  # twice: nothing drifts from one evaluation to the next
        with ema.applied(module):
            for n, p in module.named_parameters():
                expected = shadow[n].to(torch.bfloat16) if n in shadow else own[n]
                assert torch.equal(p.detach(), expected), n
        for n, p in module.named_parameters():
            assert torch.equal(p.detach(), own[n]), f"{n} was not given back"
        for n in shadow:
            assert torch.equal(ema.shadow[n], shadow[n]), f"the EMA of {n} came back rounded"
    with pytest.raises(RuntimeError, match="evaluation failed"):  # the weights come back, the error goes on
        with ema.applied(module):
            raise RuntimeError("evaluation failed")
    assert all(torch.equal(p.detach(), own[n]) for n, p in module.named_parameters())


def test_ema_update_is_the_exponential_average_and_its_state_round_trips():
    """shadow <- decay shadow + (1 - decay) weight, in fp32, for the trainable weights only; state_dict
    and load_state_dict carry it to a fresh EMA (a resumed run), and a state for another model is
    refused by name."""

    from stepfast.ema import EMA

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)).double()
    module[1].bias.requires_grad_(False)
    ema = EMA(module, 0.9, zero_stage=2)
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    expected = {n: start[n].clone() for n in ema.shadow}
    for k in range(3):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn_like(p))
        ema.update(module)
        for n, p in module.named_parameters():
            if n in expected:
                expected[n] = 0.9 * expected[n] + 0.1 * p.detach()
    for n, want in expected.items():
        assert ema.shadow[n].dtype == torch.float32
        torch.testing.assert_close(ema.shadow[n], want.float(), rtol=1e-6, atol=1e-6, msg=n)
        assert not torch.allclose(ema.shadow[n], start[n].float())  # it moved
    fresh = EMA(module, 0.9, zero_stage=2)  # a resumed run starts from the current weights...
    fresh.load_state_dict(ema.state_dict())  # ...and takes the saved average
    assert all(torch.equal(fresh.shadow[n], ema.shadow[n]) for n in ema.shadow)
    other = EMA(torch.nn.Linear(7, 5).double(), 0.9, zero_stage=2)
    with pytest.raises(ValueError, match=r"EMA state lacks 2 weights, e.g. bias"):
        other.load_state_dict({"decay": 0.9, "shadow": {}})


def test_warmup_counts_iterations_whatever_the_optimizer_steps_per_iteration():
    """optim.warmup is in iterations; DeepSpeed steps the scheduler once per optimizer step."""
    from stepfast.engine import warmup_factor

    assert [warmup_factor(s, iterations=2, updates=1) for s in range(3)] == [0.5, 1.0, 1.0]
    assert [warmup_factor(s, iterations=2, updates=2) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert warmup_factor(0, iterations=0, updates=2) == 1.0


def test_the_engine_schedule_warms_up_over_iterations_of_the_runs_optimizer_steps():

    from stepfast.config import load_config
    from stepfast.engine import warmup_scheduler

    cfg = load_config("default", ["optim.warmup=2", "optim.updates_per_iteration=2", "optim.lr=0.1"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    scheduler = warmup_scheduler(optimizer, cfg.optim)
    lrs = []
    for _ in range(5):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1])


def test_deepspeeds_throughput_timer_is_off():
    """It would synchronise the GPU in every forward of engine.module (and break a CUDA-graph capture)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from stepfast.config import load_config
    from stepfast.engine import deepspeed_config

    assert DeepSpeedConfig(deepspeed_config(load_config("default").optim, 4, 2)).timers_config.enabled is False


def test_deepspeed_settings_it_does_not_read_are_named_with_the_closest_it_does():
    """optim.deepspeed is merged into DeepSpeed's config, whose parser ignores keys it does not know:
    a misspelt section would silently do nothing. The keys the installed parser never reads are named."""
    import deepspeed

    from stepfast.config import load_config
    from stepfast.engine import unread_settings

    known = ("{zero_optimization: {offload_optimizer: {device: cpu}}, wall_clock_breakdown: true, "
             "flops_profiler: {enabled: false}, activation_checkpointing: {}, comms_logger: {}, aio: {}")  # fmt: skip
    optim = load_config("default", [f"optim.deepspeed={known}, zero_optimisation: {{}}, tensorbord: {{}}}}"]).optim
    assert unread_settings(optim, 4, 2) == [
        f"optim.deepspeed.tensorbord is not a setting DeepSpeed {deepspeed.__version__} reads, so it has no effect "
        "(did you mean tensorboard?)",
        f"optim.deepspeed.zero_optimisation is not a setting DeepSpeed {deepspeed.__version__} reads, so it has no "
        "effect (did you mean zero_optimization?)",
    ]
    assert unread_settings(load_config("default", [f"optim.deepspeed={known}}}"]).optim, 4, 2) == []
    # no hint towards a key DeepSpeed has removed (it refuses those) or one stepfast sets itself
    optim = load_config("default", ["optim.deepspeed={gradient_clip: 1.0, data_parallel_size: 1}"]).optim
    assert unread_settings(optim, 4, 2) == [
        f"optim.deepspeed.gradient_clip is not a setting DeepSpeed {deepspeed.__version__} reads, so it has no effect "
        "(did you mean gradient_clipping? stepfast sets it from optim.grad_clip)"]
    assert "did you mean" not in unread_settings(load_config("default", ["optim.deepspeed={sparse_atention: {}}"]).optim,
                                                 4, 2)[0]  # fmt: skip
