"""The trainer end to end on a tiny random SD3 pipeline saved to disk, run as the user runs it
(`python stepfast/train.py` and `deepspeed --num_gpus 2 stepfast/train.py`) in subprocesses."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from stepfast import checkpoint, grpo
from stepfast.config import ConfigError, load_config
from stepfast.data.prompts import load_prompts
from stepfast.data.sampler import KRepeatSampler
from stepfast.engine import SHM_DIR, free_port
from stepfast.models import EMBEDDED_MODEL

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "stepfast" / "train.py"
DEEPSPEED = Path(sys.executable).parent / "deepspeed"


def env(cuda: bool = False):
    """The trainer's environment: on the CPU unless `cuda` (a CUDA test), on a GPU machine too. The
    suite's runs are CPU runs, gloo ranks whose results are compared to the bit; `deepspeed --num_gpus
    2` would otherwise put rank 1 on a second GPU, which a one-GPU machine lacks."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT), e.get("PYTHONPATH", "")])
    e["OMP_NUM_THREADS"] = "1"
    if not cuda:
        e.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    for quiet in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):  # some tests count the bars drawn
        e.pop(quiet, None)
    return e


def base_config(model_dir: Path, out: Path, **extra) -> dict:
    cfg = {
        "iterations": 4, "output_dir": str(out), "seed": 3, "checkpoint_every": 2, "keep_checkpoints": 3,
        "model": {"path": str(model_dir), "lora_rank": 4, "lora_alpha": 8},
        "sde": {"steps": 5},
        "rollout": {"groups": 2, "group_size": 4, "micro_batch": 4, "substeps": 2, "cfg": 2.0},
        "optim": {"lr": 3e-2, "clip_range": 0.2, "updates_per_iteration": 1},
        "reward": {"weights": {"train_helpers:brightness": 1.0}},
        "eval": {"before_after": False},
        "log": {"tensorboard": True, "report": True},
    }  # fmt: skip
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(config: Path, *overrides, ranks: int = 1, timeout: int = 600, check: bool = True, extra_env=None,
          port: int | None = None, cuda: bool = False):
    if ranks == 1:
        cmd = [sys.executable, str(TRAIN), "--config", str(config), *overrides]
    else:
        cmd = [str(DEEPSPEED), "--num_gpus", str(ranks), "--master_port", str(port or free_port()), str(TRAIN),
               "--config", str(config), *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env={**env(cuda), **(extra_env or {})}, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture
def start(monkeypatch, capsys):
    """The trainer's main() in this process, for what it refuses before the process group starts
    (and a build of DeepSpeed's op with it): start(config, *overrides) -> (exit code, stderr). A start
    that reached the process group fails the test."""
    import stepfast.train

    def reached(*args, **kwargs):
        raise AssertionError("the start reached the process group")

    monkeypatch.setattr(stepfast.train, "init_distributed", reached)

    def run(config: Path, *overrides) -> tuple[int, str]:
        code = stepfast.train.main(["--config", str(config), *overrides])
        return code, capsys.readouterr().err

    return run


def metrics(out: Path) -> list[dict]:
    with (out / "metrics.csv").open() as f:
        return [{k: float(v) if v not in ("",) else None for k, v in r.items()} for r in csv.DictReader(f)]


def test_category_rewards_average_each_category_over_its_groups():
    final = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.4, 0.0, 0.9, 0.3])  # 3 groups of 3
    out = grpo.category_rewards(final, ["colors", None, "colors"], group_size=3)
    assert list(out) == ["category/colors"]
    assert out["category/colors"] == pytest.approx((0.5 + 0.4) / 2)
    assert grpo.category_rewards(final, [None, None, None], group_size=3) == {}
    with pytest.raises(RuntimeError):
        grpo.category_rewards(final, ["a", "b"], group_size=3)  # 9 rewards are not 2 groups of 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from stepfast.models.tiny import tiny_pipeline_dir

    return tiny_pipeline_dir(tmp_path_factory.mktemp("model"), seed=0)


@pytest.fixture(scope="module")
def baseline(model_dir, tmp_path_factory):
    """A 4-iteration single-rank run, checkpoints at 2 and 4."""
    tmp = tmp_path_factory.mktemp("baseline")
    out = tmp / "run"
    config = write_config(tmp / "cfg.yaml", base_config(model_dir, out))
    train(config)
    return config, out


@pytest.fixture(scope="module")
def warm_baseline(model_dir, tmp_path_factory):
    """The baseline with a learning-rate warmup over its 4 iterations and an EMA, so that a resume
    from checkpoint 2 has a scheduler and an EMA to restore."""
    tmp = tmp_path_factory.mktemp("warm_baseline")
    out = tmp / "run"
    cfg = base_config(model_dir, out)
    cfg["optim"].update(warmup=4, ema=0.9)
    config = write_config(tmp / "cfg.yaml", cfg)
    train(config)
    return config, out


def test_run_writes_metrics_checkpoints_and_report(baseline):
    config, out = baseline
    rows = metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        # on-policy: the first micro-step of every iteration recomputes the rollout's log-probs exactly;
        # with one optimizer step per iteration, at its end, so does every other (the gradients of all
        # the micro-steps accumulate in the engine)
        assert r["first_ratio_min"] == 1.0 and r["first_ratio_max"] == 1.0
        assert r["ratio_min"] == 1.0 and r["ratio_max"] == 1.0
        for phase in ("rollout", "estimates", "rewards", "update"):
            assert r[f"time/{phase}"] > 0
        assert r["gain/0"] is not None
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0  # a gradient reached the adapter
    # the default prompts carry GenEval tags: each iteration logs the reward of the categories it drew,
    # and the groups' category rewards average back to the batch reward
    cfg = yaml.safe_load(config.read_text())
    prompts = load_prompts("shapeeval:train")
    sampler = KRepeatSampler(len(prompts), cfg["rollout"]["groups"], cfg["rollout"]["group_size"], world=1, rank=0,
                             seed=cfg["seed"])  # fmt: skip
    for r in rows:
        tags = [prompts[i].metadata["tag"] for i in sampler.group_prompts(int(r["iteration"]))]
        logged = {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("category/") and v is not None}
        assert set(logged) == set(tags)
        assert sum(logged[t] for t in tags) / len(tags) == pytest.approx(r["reward"], abs=1e-6)
    done = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert done == ["checkpoint-000002", "checkpoint-000004"]
    assert (out / "checkpoints" / "checkpoint-000004" / "lora" / "pytorch_lora_weights.safetensors").exists()
    assert (out / "report" / "summary.md").exists() and (out / "report" / "reward_curve.png").exists()
    assert (out / "report" / "gain_heatmap.png").exists()
    assert list((out / "tensorboard").iterdir())


def signal_after_checkpoint_2(config: Path, out: Path, sig: int, err: Path, ranks: int = 1,
                              while_running: Callable[[int], object] | None = None) -> int:  # fmt: skip
    """Starts the trainer on `config`, sends it `sig` once checkpoint 2 of `out` is complete, and
    returns its exit code; its stderr goes to `err` (a file: an unread pipe fills and stalls the run).
    `while_running(pid)`, if given, is called just before the signal, with the trainer's pid.
    With ranks > 1 the run goes through the deepspeed launcher in a process group of its own, and
    the signal goes to that whole group, as a terminal sends Ctrl-C."""
    if ranks == 1:
        cmd = [sys.executable, str(TRAIN), "--config", str(config)]
    else:
        cmd = [str(DEEPSPEED), "--num_gpus", str(ranks), "--master_port", str(free_port()), str(TRAIN),
               "--config", str(config)]  # fmt: skip
    # Ctrl-C as a terminal gives it: a suite started in the background (`make test &` in a script)
    # has SIGINT ignored, which a child inherits and Python then keeps (as it should, for nohup); a
    # signal with a handler here is reset to the default in the child instead
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with err.open("w") as handle:
        try:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=handle, text=True,
                                    start_new_session=ranks > 1)  # fmt: skip
        finally:
            signal.signal(signal.SIGINT, previous)
        try:
            deadline = time.time() + 600
            while not checkpoint.is_complete(out / "checkpoints" / "checkpoint-000002"):
                assert proc.poll() is None, err.read_text()[-3000:]
                assert time.time() < deadline
                time.sleep(0.05)
            if while_running is not None:
                while_running(proc.pid)
            if ranks > 1:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
            code = proc.wait(timeout=120)
            # the `deepspeed` runner exits soon after a Ctrl-C, its launcher and ranks after it: wait for
            # them all (the launcher gives each rank 30 s after its SIGTERM)
            deadline = time.time() + 90
            while ranks > 1 and time.time() < deadline:
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            return code
        finally:  # a run that outlived the signal does not train on after the test
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if ranks > 1:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its ranks too


def test_resume_after_sigkill_is_exact(warm_baseline, tmp_path):
    from safetensors.torch import load_file

    from stepfast.files import RunLock

    config, base_out = warm_baseline
    out = tmp_path / "run"
    cfg = yaml.safe_load(config.read_text())
    cfg["output_dir"] = str(out)
    config = write_config(tmp_path / "cfg.yaml", cfg)
    held = []
    signal_after_checkpoint_2(config, out, signal.SIGKILL, tmp_path / "stderr.txt",
                              while_running=lambda pid: held.append((pid, RunLock.holder(out))))  # fmt: skip
    assert checkpoint.latest(out).name == "checkpoint-000002"
    # the killed run held output_dir; the kernel let it go with the process: the resume is not refused
    (pid, holder), = held
    assert holder is not None and holder.startswith(f"pid {pid}: ") and RunLock.holder(out) is None
    resumed = train(config, "resume=auto")
    assert "other settings" not in resumed.stderr and not list(out.glob("config-until-*"))  # the same settings
    got, want = metrics(out), metrics(base_out)
    assert [r["iteration"] for r in got] == [1, 2, 3, 4]
    # the learning rate each iteration trained with: a quarter more of it at each of the 4 warmup
    # iterations: a scheduler started afresh at the resume would give iterations 3 and 4 other rates
    assert [r["lr"] for r in want] == pytest.approx([3e-2 * k / 4 for k in (1, 2, 3, 4)], rel=1e-12)
    skip = {k for k in want[0] if k.startswith("time/")}
    for it in (2, 3):  # iterations 3 and 4
        for key in want[it]:
            if key not in skip:
                assert got[it][key] == want[it][key], (it + 1, key, got[it][key], want[it][key])
    # the EMA went on from the checkpoint's, not from the weights of iteration 2
    ema = [load_file(run / "checkpoints" / "checkpoint-000004" / "lora_ema" / "pytorch_lora_weights.safetensors")
           for run in (out, base_out)]  # fmt: skip
    assert ema[0].keys() == ema[1].keys() and all(torch.equal(ema[0][k], ema[1][k]) for k in ema[1])


def test_ctrl_c_says_where_training_stopped_without_a_traceback(baseline, tmp_path, start):
    config, _ = baseline
    out = tmp_path / "run"
    cfg = yaml.safe_load(config.read_text())
    cfg["output_dir"] = str(out)
    cfg["iterations"] = 1000  # still training when the signal comes (an iteration here takes ~0.3 s)
    err = tmp_path / "stderr.txt"
    config = write_config(tmp_path / "cfg.yaml", cfg)
    refusals = []

    def second_run(pid: int) -> None:
        """The same command again while the run trains (a second terminal): refused, whatever its
        resume, naming the process that writes there (the trainer's first rank holds output_dir)."""
        for resume in ("auto", "none"):
            refusals.append((pid, *start(config, f"resume={resume}")))

    returncode = signal_after_checkpoint_2(config, out, signal.SIGINT, err, while_running=second_run)
    assert len(refusals) == 2
    for pid, code, refused in refusals:
        said = re.fullmatch(rf"stepfast: config error: output_dir {re.escape(str(out))}: another run is writing there "
                            rf"\(pid {pid}: (.+)\); wait for it to end or stop it, or give another output_dir\n",
                            refused)  # fmt: skip
        assert code == 2 and said, refused
        command = f"{sys.executable} {TRAIN} --config {config}"  # its command line, cut short if long
        assert said[1] == command or (said[1].endswith("...") and command.startswith(said[1][:-3])), said[1]
    stderr = err.read_text()
    assert returncode == 130, stderr[-3000:]
    # the exception's name alone (Ctrl-C has no message), where to go on from and how
    assert re.search(r"stepfast: training stopped at iteration \d+: KeyboardInterrupt\n", stderr), stderr[-3000:]
    last = re.search(r"stepfast: last checkpoint: (\S+); resume=auto \(the same command and output_dir\) continues", stderr)
    assert last and Path(last[1]).parent == out / "checkpoints" and Path(last[1]).name >= "checkpoint-000002"
    assert "Traceback" not in stderr, stderr[-3000:]


def test_sigterm_says_where_training_stopped_as_ctrl_c_does(baseline, tmp_path):
    """A kill, `timeout` or a scheduler's time limit: where to go on from, exit status 143."""
    config, _ = baseline
    out = tmp_path / "run"
    cfg = {**yaml.safe_load(config.read_text()), "output_dir": str(out), "iterations": 1000}
    err = tmp_path / "stderr.txt"
    returncode = signal_after_checkpoint_2(write_config(tmp_path / "cfg.yaml", cfg), out, signal.SIGTERM, err)
    stderr = err.read_text()
    assert returncode == 143, stderr[-3000:]
    assert re.search(r"stepfast: training stopped at iteration \d+: SIGTERM \(deepspeed sends it to every rank at a "
                     r"Ctrl-C; or a kill, a time limit\)\n", stderr), stderr[-3000:]  # fmt: skip
    assert "stepfast: last checkpoint: " in stderr and "Traceback" not in stderr, stderr[-3000:]
    # TensorBoard's writer holds what it has not written (every two minutes): flushed at the stop
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    last = metrics(out)[-1]
    logged = [tag for tag, value in last.items() if tag != "iteration" and value is not None]
    assert logged and all(events.Scalars(tag)[-1].step == int(last["iteration"]) for tag in logged)


def test_ctrl_c_to_the_deepspeed_launcher_says_where_training_stopped(baseline, tmp_path):
    """Ctrl-C reaches the launcher and both ranks, and the launcher follows it with a SIGTERM to each
    rank in turn: rank 0 still says where training stopped and where to go on from, once, and no
    rank prints a traceback (the runner's own, of its wait, is DeepSpeed's)."""
    config, _ = baseline
    out = tmp_path / "run"
    cfg = {**yaml.safe_load(config.read_text()), "output_dir": str(out), "iterations": 1000}
    err = tmp_path / "stderr.txt"
    signal_after_checkpoint_2(write_config(tmp_path / "cfg.yaml", cfg), out, signal.SIGINT, err, ranks=2)
    stderr = err.read_text()
    assert len(re.findall(r"stepfast: training stopped at iteration \d+: (KeyboardInterrupt|SIGTERM)", stderr)) == 1, stderr[-3000:]
    assert stderr.count("stepfast: last checkpoint: ") == 1, stderr[-3000:]
    assert "[rank0]: Traceback" not in stderr and "[rank1]: Traceback" not in stderr, stderr[-3000:]


def test_a_rank_that_fails_alone_is_the_one_named(model_dir, tmp_path):
    """One rank's reward raises: rank 0, which finds it gone at a collective, says that another rank
    stopped and where to go on from, without a traceback of the lost connection; the failing rank's
    own error is the one traceback."""
    out = tmp_path / "run"
    cfg = base_config(model_dir, out, iterations=4, checkpoint_every=1, log={"report": False, "tensorboard": False},
                      reward={"weights": {"train_helpers:fails_on_rank_1_once_there": 1.0}})  # fmt: skip
    marker = out / "checkpoints" / "checkpoint-000001" / "COMPLETE"  # it fails in iteration 2
    proc = train(write_config(tmp_path / "cfg.yaml", cfg), ranks=2, check=False, timeout=300,
                 extra_env={"STEPFAST_TEST_FAIL_ONCE": str(marker)})  # fmt: skip
    assert proc.returncode != 0
    assert re.search(r"stepfast: training stopped at iteration \d: another rank stopped \(it prints its own "
                     r"error\); here: ", proc.stderr), proc.stderr[-4000:]  # fmt: skip
    assert proc.stderr.count("Traceback") == 1 and "RuntimeError: the reward broke on rank 1" in proc.stderr, proc.stderr[-4000:]
    assert f"stepfast: last checkpoint: {out / 'checkpoints' / 'checkpoint-000001'}" in proc.stderr


def test_only_a_collective_that_lost_its_peer_is_said_as_one(monkeypatch):
    """'Another rank stopped' is said of gloo's error in a run of several ranks, raised in
    torch.distributed: not of a user's error that quotes a broken pipe, nor of a reward server's
    reset connection (a RuntimeError too), nor on one rank; its first line only."""
    from stepfast import train as train_module
    from stepfast.rewards.transport import RewardServerError

    def raised(exc: BaseException, where: str) -> BaseException:
        try:
            exec(compile("raise exc", where, "exec"), {"exc": exc})
        except BaseException as caught:
            return caught

    gloo = "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1\nmore"
    in_collective = raised(RuntimeError(gloo), "/venv/site-packages/torch/distributed/distributed_c10d.py")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_module._lost_peer(in_collective)
    assert train_module._why_stopped(in_collective) == (
        "another rank stopped (it prints its own error); here: RuntimeError: [../third_party/gloo/gloo/transport/"
        "tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    assert not train_module._lost_peer(raised(RuntimeError(gloo), "/home/me/my_reward.py"))
    server = RewardServerError("http://x", 6, "ConnectionResetError: [Errno 104] Connection reset by peer")
    assert not train_module._lost_peer(raised(server, "/venv/site-packages/torch/distributed/x.py"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not train_module._lost_peer(in_collective)


def test_main_in_process_leaves_sigterm_alone(monkeypatch):
    """Only the script's entry point turns SIGTERM into a stop: a caller of main() keeps its own."""
    from stepfast import train as train_module

    before = signal.getsignal(signal.SIGTERM)
    seen = []
    monkeypatch.setattr(train_module, "_main", lambda argv: seen.append(signal.getsignal(signal.SIGTERM)) or 0)
    assert train_module.main([]) == 0 and seen == [before]
    assert signal.getsignal(signal.SIGTERM) is before


def test_ctrl_c_outside_training_is_one_line(monkeypatch, capsys):
    from stepfast import train as train_module

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "_main", interrupted)
    monkeypatch.delenv("RANK", raising=False)
    assert train_module.main([]) == 130
    assert capsys.readouterr().err == "\nstepfast: interrupted before training began or after it ended\n"


def test_interrupted_checkpoint_write_leaves_previous_usable(baseline, tmp_path):
    config, base_out = baseline
    out = tmp_path / "run"
    shutil.copytree(base_out, out)
    # a kill while checkpoint 6 was being written: its .tmp folder is half full, no COMPLETE marker
    partial = out / "checkpoints" / "checkpoint-000006.tmp"
    shutil.copytree(out / "checkpoints" / "checkpoint-000004", partial)
    (partial / "COMPLETE").unlink()
    (partial / "state.pt").write_bytes(b"truncated")
    assert checkpoint.latest(out).name == "checkpoint-000004"
    cfg = yaml.safe_load(config.read_text())
    cfg["output_dir"] = str(out)
    saved = (out / "config.yaml").read_text()
    proc = train(write_config(tmp_path / "cfg.yaml", cfg), "resume=auto", "iterations=5", "optim.lr=0.01")
    assert [r["iteration"] for r in metrics(out)] == [1, 2, 3, 4, 5]
    assert not partial.exists()
    # resumed with another learning rate: said, and the settings of iterations 1-4 kept beside the new ones
    kept = out / "config-until-000004.yaml"
    assert (f"stepfast: warning: resumed from {out / 'checkpoints' / 'checkpoint-000004'} with other settings than "
            f"those of {out / 'config.yaml'}: optim.lr: 0.03 -> 0.01. The run goes on with these; the settings "
            f"before are kept in {kept}") in proc.stderr, proc.stderr[-3000:]
    assert kept.read_text() == saved and load_config(str(out / "config.yaml")).optim.lr == 0.01


def test_saved_lora_loads_and_changes_samples(baseline, model_dir):
    from diffusers import StableDiffusion3Pipeline

    _, out = baseline
    pipe = StableDiffusion3Pipeline.from_pretrained(model_dir)

    def sample():
        g = torch.Generator().manual_seed(0)
        return pipe(["a photo of a circle"], num_inference_steps=4, guidance_scale=1.0, height=64, width=64,
                    generator=g, output_type="pt", max_sequence_length=12).images

    before = sample()
    pipe.load_lora_weights(str(out / "checkpoints" / "checkpoint-000004" / "lora"))
    after = sample()
    assert (after - before).abs().max() > 1e-3
    # at the scale it was trained with (lora_alpha 8 over rank 4): the file holds the adapter's config,
    # without which diffusers takes alpha = rank, half the trained scale here
    (config,) = pipe.transformer.peft_config.values()
    assert (config.r, config.lora_alpha) == (4, 8)


def test_ema_lora_is_saved_beside_the_trained_one(model_dir, tmp_path):
    """With EMA on, evaluation samples with the EMA weights; the checkpoint holds them as a LoRA too."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    # a prompt longer than the tiny model's text encoders take (12 tokens): said once at start, not at
    # every encoding (diffusers' notice)
    prompts = tmp_path / "prompts.txt"
    long = "a photo of a red circle next to a green square above a blue triangle and two yellow circles"
    prompts.write_text(f"a photo of a red circle\n{long}\n")
    # held-out prompts: eval.limit draws the one short prompt, the long one is never encoded, so it is
    # not said (the warning counts the prompts a run draws)
    eval_prompts = tmp_path / "eval.txt"
    eval_prompts.write_text(f"a photo of a circle\n{long}\n")
    cfg = base_config(model_dir, out, iterations=2, optim={"lr": 3e-2, "clip_range": 0.2, "ema": 0.5}, log={"report": False},
                      rollout={"prompts": str(prompts), "balance_categories": False},
                      eval={"every": 2, "prompts": str(eval_prompts), "reward": "train_helpers:brightness", "limit": 1,
                            "seeds": 1, "min_images": 0, "steps": 2})  # fmt: skip
    proc = train(write_config(tmp_path / "cfg.yaml", cfg))
    assert proc.stderr.count("stepfast: warning: rollout.prompts: 1 of 2 prompts are longer than the text encoders "
                             f"take (CLIP 12, T5 12 tokens)") == 1 and f"the first: {prompts}:2 " in proc.stderr  # fmt: skip
    assert "eval.prompts:" not in proc.stderr and (out / "eval_iter000002.json").exists()
    assert "was truncated because" not in proc.stderr + proc.stdout
    assert "Token indices sequence length" not in proc.stderr + proc.stdout  # transformers' notice, too
    ckpt = out / "checkpoints" / "checkpoint-000002"
    trained = load_file(ckpt / "lora" / "pytorch_lora_weights.safetensors")
    ema = load_file(ckpt / "lora_ema" / "pytorch_lora_weights.safetensors")
    shadow = torch.load(ckpt / "state.pt", weights_only=False)["ema"]["shadow"]
    assert trained.keys() == ema.keys() and len(shadow) == len(ema)
    for name, weight in shadow.items():
        assert torch.equal(ema["transformer." + name.replace(".default.", ".")], weight)
    assert any(not torch.equal(trained[k], ema[k]) for k in ema)


def test_full_fine_tuning_checkpoints_the_transformer_and_its_ema(model_dir, tmp_path):
    """model.lora=false: the checkpoint holds the trained transformer in diffusers' format, equal to
    the engine's weights and loadable into the pipeline in place of its own, and the EMA's beside it."""
    from safetensors.torch import load_file

    from stepfast.models import load_pipeline, load_transformer

    out = tmp_path / "run"
    cfg = base_config(model_dir, out, iterations=1, model={"lora": False},
                      optim={"lr": 1e-3, "ema": 0.5}, log={"report": False})  # fmt: skip
    train(write_config(tmp_path / "cfg.yaml", cfg))
    ckpt = out / "checkpoints" / "checkpoint-000001"
    assert not (ckpt / "lora").exists()
    engine = torch.load(ckpt / "engine" / "state" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    shadow = torch.load(ckpt / "state.pt", weights_only=False)["ema"]["shadow"]
    pipe = load_pipeline(model_dir)
    base = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    load_transformer(pipe, ckpt / "transformer")
    loaded = pipe.transformer.state_dict()
    assert loaded.keys() == base.keys() and not pipe.transformer.training
    assert engine.keys() == loaded.keys() and all(torch.equal(loaded[k], engine[k]) for k in engine)
    assert shadow.keys() == dict(pipe.transformer.named_parameters()).keys()  # every weight trained
    assert any(not torch.equal(loaded[k], base[k]) for k in engine)
    ema = load_file(ckpt / "transformer_ema" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(ema[k], shadow[k]) for k in shadow)
    assert any(not torch.equal(ema[k], loaded[k]) for k in shadow)


def test_a_transformer_above_the_shard_size_is_saved_in_shards_that_load_back(model_dir, tmp_path):
    """save_transformer splits as diffusers does (numbered files and an index) above max_shard_size,
    and the pieces load back through load_transformer as the weights given; below it, one file."""
    from stepfast.models import load_pipeline, load_transformer
    from stepfast.policy import save_transformer

    pipe = load_pipeline(model_dir)
    generator = torch.Generator().manual_seed(0)
    weights = {n: p.detach() + torch.randn(p.shape, generator=generator) for n, p in pipe.transformer.named_parameters()}
    size = sum(v.numel() * v.element_size() for v in pipe.transformer.state_dict().values())
    save_transformer(pipe.transformer, tmp_path / "sharded", weights, max_shard_size=size // 3)
    save_transformer(pipe.transformer, tmp_path / "whole", weights)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("diffusion_pytorch_model-*.safetensors"))
    assert len(shards) >= 3 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors"), shards
    assert (tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert not (tmp_path / "sharded" / "diffusion_pytorch_model.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    for folder in ("sharded", "whole"):
        fresh = load_transformer(load_pipeline(model_dir), tmp_path / folder).transformer
        loaded = dict(fresh.named_parameters())
        assert loaded.keys() == weights.keys()
        assert all(torch.equal(loaded[n], weights[n].to(loaded[n].dtype)) for n in weights), folder


def test_the_sd35_presets_precision_runs_bf16_weights_bf16_engine_and_checkpointing(model_dir, tmp_path):
    """model.dtype=bf16, optim.precision=bf16 and gradient checkpointing, as the SD3.5 presets set
    them: the run trains (the first micro-step still on-policy to the bit), saves the optimizer's
    fp32 master weights of the LoRA, not the bf16 copies the model computes with, and resumes from its
    checkpoint (whose optimizer shards DeepSpeed names bf16_zero_pp_rank_*)."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    cfg = base_config(model_dir, out, iterations=2, model={"dtype": "bf16", "gradient_checkpointing": True},
                      optim={"precision": "bf16"}, log={"report": False})  # fmt: skip
    train(write_config(tmp_path / "cfg.yaml", cfg))
    rows = metrics(out)
    assert all(r["first_ratio_min"] == 1.0 == r["first_ratio_max"] for r in rows)
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    lora = load_file(out / "checkpoints" / "checkpoint-000002" / "lora" / "pytorch_lora_weights.safetensors")
    assert any(not torch.equal(v, v.bfloat16().float()) for v in lora.values())  # not bf16-rounded
    assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)  # B starts at zero: trained
    assert list((out / "checkpoints" / "checkpoint-000002").rglob("bf16_zero_pp_rank_0_*optim_states.pt"))
    resumed = train(write_config(tmp_path / "cfg.yaml", cfg), "iterations=3", "resume=auto")
    assert f"resumed from {out / 'checkpoints' / 'checkpoint-000002'} at iteration 3" in resumed.stdout
    rows = metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[2]["first_ratio_min"] == 1.0 == rows[2]["first_ratio_max"]  # on-policy after the resume too


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_check.sh runs it)")
@pytest.mark.parametrize("precision, stage", [("fp32", 2), ("bf16", 2), ("fp32", 3)])
def test_cuda_run_uses_triton_and_the_graph_and_stays_on_policy(model_dir, tmp_path, precision, stage):
    """On a GPU, the real trainer with its GPU paths: the Triton SDE kernels, the estimates' CUDA graph
    (captured at the first iteration, replayed at the next ones with new prompts; eager under ZeRO-3),
    NCCL, the EMA applied for evaluation. Every iteration's first micro-step is on-policy to the bit. In
    fp32 the first iteration (before any update) gives the CPU run's rewards to within float error:
    the same noise, drawn on the CPU whatever the device; the GPU differs in summation order and TF32
    convolutions."""
    out = tmp_path / "run"
    extra = {"iterations": 3, "optim": {"ema": 0.9, "zero_stage": stage}, "log": {"report": False},
             "eval": {"before_after": True, "reward": "train_helpers:brightness_eval", "limit": 4, "seeds": 1,
                      "min_images": 0, "steps": 6}}  # fmt: skip
    if precision == "bf16":  # the SD3.5 presets' settings
        extra["model"] = {"dtype": "bf16", "gradient_checkpointing": True}
        extra["optim"]["precision"] = "bf16"
    config = write_config(tmp_path / "cfg.yaml", base_config(model_dir, out, **extra))
    run = train(config, cuda=True)
    estimates = "in a CUDA graph" if stage < 3 else "eager"
    assert f"1 rank on cuda, SDE kernels triton, estimates {estimates}, ZeRO-{stage}" in run.stdout, run.stdout[-2000:]
    assert "CUDA graph capture of the velocity failed" not in run.stderr, run.stderr[-3000:]
    rows = metrics(out)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    print(f"\n{precision} ZeRO-{stage}: first-micro-step ratios " +
          ", ".join(f"[{r['first_ratio_min']!r}, {r['first_ratio_max']!r}]" for r in rows))  # fmt: skip
    assert all(r["first_ratio_min"] == 1.0 == r["first_ratio_max"] for r in rows)
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    assert (out / "eval_after.json").exists()
    assert (out / "checkpoints" / "checkpoint-000003" / "lora_ema" / "pytorch_lora_weights.safetensors").exists()
    if (precision, stage) == ("fp32", 2):
        cpu_out = tmp_path / "cpu"
        proc = train(config, f"output_dir={cpu_out}", "iterations=1", "eval.before_after=false")
        assert "1 rank on cpu" in proc.stdout
        cpu = metrics(cpu_out)[0]
        print(f"fp32 iteration 1, cuda - cpu: reward {rows[0]['reward'] - cpu['reward']:.2e}, "
              f"reward_std {rows[0]['reward_std'] - cpu['reward_std']:.2e}")
        assert rows[0]["reward"] == pytest.approx(cpu["reward"], abs=1e-3)
        assert rows[0]["reward_std"] == pytest.approx(cpu["reward_std"], abs=1e-3)


def test_deepspeed_settings_reach_the_engine_optimizer_offload_as_documented():
    """optim.deepspeed as the example in docs/configuration.md, through a config override: the engine
    built from it offloads the optimizer to the CPU (torch's AdamW runs there; DeepSpeed refuses it
    unless told not to insist on its own compiled CPU Adam)."""
    probe = ("import torch; from stepfast.config import load_config; from stepfast.engine import build_engine, "
             "init_distributed; init_distributed(); optim = load_config('default', ['optim.deepspeed="
             "{zero_optimization: {offload_optimizer: {device: cpu}}}']).optim; "
             "engine, _, _ = build_engine(torch.nn.Linear(3, 2), optim, 1, 1); print('offload', engine.zero_cpu_offload())")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert "offload True" in proc.stdout, proc.stderr[-3000:]


def test_ema_applied_under_zero3_reaches_every_partition():
    """Evaluation applies the EMA to the model: under ZeRO-3 on two ranks, with every weight split
    across them, the model must compute with the EMA inside `EMA.applied` and get its weights back
    after (DeepSpeed drops writes into gathered weights unless told which rank's to keep)."""
    cmd = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(free_port()), str(ROOT / "tests" / "zero3_ema_check.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.count("OK") == 2, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("lora", [True, False])
def test_zero3_checkpoints_gather_partitioned_weights(model_dir, tmp_path, lora):
    """Under ZeRO-3 a weight above stage3_param_persistence_threshold lives in pieces across the
    ranks: the checkpoint's LoRA or transformer is gathered whole, and so is the EMA, which each rank
    keeps in part. Threshold 0 partitions every weight; lr 0 keeps the initial ones, which are known:
    the base transformer, LoRA B zero; and the EMA of unchanging weights is those weights."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    zero3 = {"zero_stage": 3, "lr": 0.0, "ema": 0.5,
             "deepspeed": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}  # fmt: skip
    cfg = base_config(model_dir, out, iterations=1, model={"lora": lora}, optim=zero3, log={"report": False})
    proc = train(write_config(tmp_path / "cfg.yaml", cfg), ranks=2)
    for call in ("all_gather_into_tensor", "reduce_scatter_tensor"):  # torch's warnings about DeepSpeed's calls
        assert f"{call}` is deprecated" not in proc.stderr, proc.stderr[-3000:]
    ckpt = out / "checkpoints" / "checkpoint-000001"
    if lora:
        saved = load_file(ckpt / "lora" / "pytorch_lora_weights.safetensors")
        a = [v for k, v in saved.items() if "lora_A" in k]
        b = [v for k, v in saved.items() if "lora_B" in k]
        assert len(a) == len(b) > 0 and all(v.shape[0] == 4 and v.abs().sum() > 0 for v in a)  # rank 4
        assert all(v.shape[1] == 4 and not v.any() for v in b)
    else:
        saved = load_file(ckpt / "transformer" / "diffusion_pytorch_model.safetensors")
        base = load_file(model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
        assert saved.keys() == base.keys()
        assert all(torch.equal(saved[k], base[k].float()) for k in base)
    name = "lora/pytorch_lora_weights" if lora else "transformer/diffusion_pytorch_model"
    ema = load_file(ckpt / f"{name.replace('/', '_ema/')}.safetensors")
    assert ema.keys() == saved.keys() and all(torch.equal(ema[k], saved[k]) for k in saved)
    shadow = torch.load(ckpt / "state.pt", weights_only=False)["ema"]["shadow"]
    if lora:  # state.pt names the adapter's weights as the model does, the file as diffusers does
        assert sorted(tuple(v.shape) for v in shadow.values()) == sorted(tuple(v.shape) for v in saved.values())
    else:
        assert len(shadow) > 0 and all(torch.equal(shadow[k], saved[k]) for k in shadow)


def test_two_ranks_equal_one_rank(baseline, tmp_path):
    config, base_out = baseline
    cfg = yaml.safe_load(config.read_text())
    cfg["output_dir"] = str(tmp_path / "run")
    cfg["optim"]["zero_stage"] = 2
    cfg["log"] = {"tensorboard": False, "report": False}
    port = free_port()
    proc = train(write_config(tmp_path / "cfg.yaml", cfg), "iterations=2", ranks=2, port=port)
    assert "all_gather_into_tensor` is deprecated" not in proc.stderr, proc.stderr[-3000:]  # about DeepSpeed's call
    # the loading bars of the model's three text encoders are drawn by the first rank alone (the two
    # drew theirs over each other's)
    assert proc.stderr.count("Loading weights:   0%|          | 0/") == 3, proc.stderr[-3000:]
    # DeepSpeed's CPU all-reduce segments (66 MiB of RAM per rank) do not outlive the run; their names
    # hold the run's port (other runs may be going on beside this one)
    assert not list(SHM_DIR.glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    got, want = metrics(tmp_path / "run"), metrics(base_out)
    assert [r["iteration"] for r in got] == [1, 2]
    keys = [k for k in want[0] if not k.startswith("time/")]
    for i in range(2):
        for key in keys:
            if want[i][key] is None:  # a prompt category that iteration did not draw
                assert got[i].get(key) is None, (i + 1, key)
            else:
                assert got[i][key] == pytest.approx(want[i][key], abs=1e-5, rel=1e-5), (i + 1, key)


def test_the_reports_evaluate_command_draws_the_evaluation_after_training_again(model_dir, tmp_path, monkeypatch):
    """summary.md gives the `python -m stepfast.evaluate` command for the evaluation after training; run
    from the run folder, it draws the same images (the sample grids below their titles, pixel for pixel:
    the tiny model's images score 0 whatever they are) and scores them alike, image by image."""
    import shlex

    from stepfast import evaluate

    out = tmp_path / "run"
    evaluation = {"before_after": True, "prompts": "shapeeval:test", "reward": "shapes", "limit": 2, "seeds": 2,
                  "min_images": 0, "steps": 2, "batch_size": 3}  # fmt: skip
    cfg = base_config(model_dir, out, iterations=1, checkpoint_every=0, eval=evaluation,
                      log={"tensorboard": False, "report": True})  # fmt: skip
    train(write_config(tmp_path / "cfg.yaml", cfg))
    summary = (out / "report" / "summary.md").read_text()
    (command,) = [line.strip() for line in summary.splitlines() if line.strip().startswith("python -m stepfast.evaluate")]
    args = shlex.split(command)[3:]
    assert args[args.index("--lora") + 1] == str((out / "checkpoints" / "checkpoint-000001" / "lora").resolve())
    assert args[args.index("--model") + 1] == str(model_dir.resolve())
    monkeypatch.chdir(tmp_path.parent)  # its paths are absolute: it runs from anywhere
    # with the trainer's one thread (OMP_NUM_THREADS=1 above): the images depend on the thread count
    # by rounding (a float summed in another order), which here moved two pixels by one level
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = evaluate.main([*args, "--out", str(tmp_path / "again"), "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    kept = json.loads((out / "eval_after.json").read_text())["samples"]
    assert [(s["prompt"], s["seed"], s["strict"], s["score"]) for s in result["samples"]] == [
        (s["prompt"], s["seed"], s["strict"], s["score"]) for s in kept]  # fmt: skip
    from PIL import Image

    from stepfast.heldout import GRID_LINE

    head = 2 * GRID_LINE + 8  # the titles differ ("after training" in the report)
    drawn = np.asarray(Image.open(tmp_path / "again" / "samples.png"))[head:]
    assert np.array_equal(np.asarray(Image.open(out / "report" / "samples_after.png"))[head:], drawn)
    assert drawn.std() > 0
    assert "Settings: 1 iteration of 2 groups of 4, 5 steps, T' = 2, CFG 2, LoRA rank 4, lr 0.03" in summary


def test_evaluation_is_shared_by_the_ranks(model_dir, tmp_path):
    """Two ranks draw half of the held-out images each (ZeRO-3: the same pipeline calls on both, an
    odd number of images) and rank 0 writes the table one rank writes alone."""
    evaluation = {"before_after": True, "prompts": "shapeeval:test", "reward": "train_helpers:brightness_eval",
                  "limit": 7, "seeds": 1, "min_images": 3, "steps": 2, "batch_size": 3}  # fmt: skip
    results = {}
    for ranks in (1, 2):
        out = tmp_path / f"ranks{ranks}"
        cfg = base_config(model_dir, out, iterations=1, checkpoint_every=0, eval=evaluation,
                          optim={"zero_stage": 3}, log={"tensorboard": False, "report": True})  # fmt: skip
        proc = train(write_config(tmp_path / f"cfg{ranks}.yaml", cfg), ranks=ranks)
        results[ranks] = {tag: json.loads((out / f"eval_{tag}.json").read_text()) for tag in ("before", "after")}
        # the gain with its standard error, printed and in the report
        gain = results[ranks]["after"]["overall"]["strict"] - results[ranks]["before"]["overall"]["strict"]
        assert f"stepfast: held-out gain {gain:+.3f} ± " in proc.stdout, proc.stdout[-2000:]
        assert f"({gain:+.3f} ± " in (out / "report" / "summary.md").read_text()
        # the checkpoint (written before the evaluation after training) keeps every image's result of
        # the one before, so a resumed run can still give the gain its error
        kept = torch.load(out / "checkpoints" / "checkpoint-000001" / "state.pt", weights_only=False)["evals"]
        assert kept["before"]["samples"] == results[ranks]["before"]["samples"]
    for tag in ("before", "after"):
        one, two = results[1][tag]["samples"], results[2][tag]["samples"]
        # 7 prompts: counting gets two (2 seeds each), the other categories one (3 seeds): 19 images
        assert len(one) == len(two) == 19
        assert [(s["prompt"], s["seed"]) for s in two] == [(s["prompt"], s["seed"]) for s in one]
        for a, b in zip(one, two):  # the pixels agree up to rounding: 6.6e-7 at most, measured
            assert b["score"] == pytest.approx(a["score"], abs=1e-5)
    # rank 0 alone receives the images, in plan order: the report's sample grids match one rank's
    for tag in ("before", "after"):
        grids = [np.asarray(Image.open(tmp_path / f"ranks{r}" / "report" / f"samples_{tag}.png"), dtype=float)
                 for r in (1, 2)]  # fmt: skip
        assert grids[0].shape == grids[1].shape
        diff = np.abs(grids[0] - grids[1])  # a pixel off by 6.6e-7 crosses a rounding step at most
        assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, (tag, diff.max(), (diff > 0).mean())


SMALL_EVAL = {"prompts": "shapeeval:test", "reward": "train_helpers:brightness_eval", "limit": 3, "seeds": 1,
              "min_images": 0, "steps": 2, "batch_size": 3}  # fmt: skip


def test_periodic_evaluations_and_the_report_of_a_resumed_run(model_dir, tmp_path):
    """eval.every evaluates between iterations (not the last one, which the evaluation after training
    covers), and a run resumed after the evaluation before training still shows its sample grid."""
    out = tmp_path / "run"
    evaluation = {**SMALL_EVAL, "before_after": True, "every": 1}
    cfg = base_config(model_dir, out, iterations=1, checkpoint_every=1, eval=evaluation,
                      log={"tensorboard": False, "report": True})  # fmt: skip
    config = write_config(tmp_path / "cfg.yaml", cfg)
    train(config)
    report = out / "report"
    grid = (report / "samples_before.png").read_bytes()
    ended = {name: (out / name).read_bytes() for name in ("eval_after.json", "report/samples_after.png",
                                                          "report/eval_curve.png", "report/reward_curve.png",
                                                          "report/gain_heatmap.png")}  # fmt: skip
    summary = (report / "summary.md").read_text()
    proc = train(config, "resume=auto", "iterations=3")
    # the first attempt's evaluation after training (of iteration 1's weights) is set aside, not lost:
    # had this run crashed, its report would have shown it as the evaluation after training
    assert (f"the report and evaluations of weights past iteration 1 that {out} held are kept as eval_after-before-2.json, "
            "report/eval_curve-before-2.png, report/gain_heatmap-before-2.png, report/reward_curve-before-2.png, "
            "report/samples_after-before-2.png, report/summary-before-2.md: this "
            "run draws its own") in proc.stdout, proc.stdout[-2000:]  # fmt: skip
    for name, data in ended.items():
        kept = out / name.replace(".", "-before-2.")
        assert kept.read_bytes() == data and (out / name).read_bytes() != data
    # the kept summary shows the kept files
    kept = (report / "summary-before-2.md").read_text()
    for name in ("eval_after.json", "samples_after.png", "eval_curve.png", "reward_curve.png", "gain_heatmap.png"):
        assert name in summary and name.replace(".", "-before-2.") in kept and name not in kept, name
    # and says when it was set aside, and that the checkpoints it names go as the resumed run prunes
    assert "Set aside when the run was resumed to train on from iteration 1: " in kept
    assert "(`keep_checkpoints`)" in kept and "Set aside" not in summary
    # 3 prompts of 3 categories, 1 seed: the gain has nothing to redraw for a standard error; the
    # summary says so as the run does, and how to read the gain (beside the random control)
    assert "(one image a category: no standard error)" in proc.stdout, proc.stdout[-2000:]
    assert "Held-out gain " in kept and "(one image a category: no standard error). The same run on the `random`" in kept
    rows = metrics(out)
    assert [r["eval/strict"] is not None for r in rows] == [False, True, False]
    evaluated = json.loads((out / "eval_iter000002.json").read_text())
    assert rows[1]["eval/strict"] == evaluated["overall"]["strict"]
    assert sorted(p.name for p in out.glob("eval_*.json")) == ["eval_after-before-2.json", "eval_after.json",
                                                                "eval_before.json", "eval_iter000002.json"]  # fmt: skip
    summary = (report / "summary.md").read_text()
    assert "![before](samples_before.png)" in summary and "![after](samples_after.png)" in summary
    assert (report / "samples_before.png").read_bytes() == grid  # drawn once, before training


def test_a_run_resumed_from_another_folders_checkpoint_brings_its_evaluations(model_dir, tmp_path):
    """Forked from another run's checkpoint, a run's report shows the evaluation before training from
    that checkpoint: the folder gets eval_before.json (and the ones between iterations) and the grid
    before, so `python -m stepfast.report` rebuilds the same summary from the folder's own files. From a
    checkpoint moved out of its run, the evaluations are written from the checkpoint."""
    from stepfast.report import rebuild_report

    out = tmp_path / "run"
    cfg = base_config(model_dir, out, iterations=2, checkpoint_every=1,
                      eval={**SMALL_EVAL, "before_after": True, "every": 1},
                      log={"tensorboard": False, "report": True})  # fmt: skip
    config = write_config(tmp_path / "cfg.yaml", cfg)
    train(config, "iterations=1")
    ckpt = out / "checkpoints" / "checkpoint-000001"
    moved = tmp_path / "moved" / "checkpoint-000001"
    shutil.copytree(ckpt, moved)
    for source, fork in ((ckpt, tmp_path / "fork"), (moved, tmp_path / "fork_moved")):
        proc = train(config, f"output_dir={fork}", f"resume={source}", "iterations=2")
        said = ("stepfast: eval_before.json, report/samples_before.png copied from {out}, whose checkpoint" if source == ckpt
                else f"stepfast: eval_before.json written from the checkpoint {source}, which this run continues")
        assert said.format(out=out) in proc.stdout, proc.stdout[-2000:]
        before = json.loads((fork / "eval_before.json").read_text())
        original = json.loads((out / "eval_before.json").read_text())
        if source == ckpt:  # the file itself, settings and all
            assert before == original
            assert (fork / "report/samples_before.png").read_bytes() == (out / "report/samples_before.png").read_bytes()
        else:  # the checkpoint's figures and every image's result
            assert {k: before[k] for k in ("overall", "categories", "samples")} == {
                k: original[k] for k in ("overall", "categories", "samples")}
            assert not (fork / "report/samples_before.png").exists()
        summary = (fork / "report" / "summary.md").read_text()
        assert "## Held-out evaluation before training" in summary and "(one image a category" in summary
        copy = tmp_path / f"{fork.name}_copy"
        shutil.copytree(fork, copy)
        rebuilt = (rebuild_report(copy) / "summary.md").read_text().replace(str(copy), str(fork))
        assert set(summary.splitlines()) <= set(rebuilt.splitlines())


def test_evaluations_brought_from_another_folder_replace_none_of_this_ones(tmp_path, capsys):
    """runfolder.bring_evaluations in-process: an evaluation without pass/fail (overall strict NaN) is
    still recognised as the checkpoint's and copied whole; files here of another evaluation (an
    earlier start in this folder) are kept aside, the grid with its evaluation; a folder already
    holding the checkpoint's evaluation is left as it is."""
    from stepfast.runfolder import bring_evaluations

    run, out = tmp_path / "run", tmp_path / "fork"
    ckpt = run / "checkpoints" / "checkpoint-000002"
    ckpt.mkdir(parents=True)
    (run / "report").mkdir()
    (run / "report" / "samples_before.png").write_bytes(b"grid of the run")
    held = {"overall": {"strict": float("nan"), "score": 0.5, "n": 2}, "categories": {}}
    (run / "eval_before.json").write_text(json.dumps({**held, "settings": {"seeds": [0]}}))
    (out / "report").mkdir(parents=True)
    (out / "eval_before.json").write_text(json.dumps({**held, "overall": {"strict": 0.0, "score": 0.1, "n": 2}}))
    (out / "report" / "samples_before.png").write_bytes(b"grid of another start")
    bring_evaluations(out, ckpt, {"before": held}, report=True, start=3)
    said = capsys.readouterr().out
    assert json.loads((out / "eval_before.json").read_text())["settings"] == {"seeds": [0]}  # the run's file, whole
    assert (out / "report" / "samples_before.png").read_bytes() == b"grid of the run"
    assert json.loads((out / "eval_before-before-3.json").read_text())["overall"]["strict"] == 0.0
    assert (out / "report" / "samples_before-before-3.png").read_bytes() == b"grid of another start"
    assert "eval_before-before-3.json, report/samples_before-before-3.png kept: of another evaluation" in said
    assert f"eval_before.json, report/samples_before.png copied from {run}" in said
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    bring_evaluations(out, ckpt, {"before": held}, report=True, start=3)  # again: nothing to do
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files and capsys.readouterr().out == ""
    # a run's own checkpoint, its checkpoints folder a link to another disk: nothing to bring
    disk = tmp_path / "disk"
    (run / "checkpoints").rename(disk)
    (run / "checkpoints").symlink_to(disk)
    (run / "eval_before.json").unlink()
    bring_evaluations(run, run / "checkpoints" / "checkpoint-000002", {"before": held}, report=True, start=3)
    assert not (run / "eval_before.json").exists() and capsys.readouterr().out == ""


def test_a_second_resume_at_the_same_iteration_keeps_both_attempts_evaluations(tmp_path, capsys):
    from stepfast.runfolder import set_aside_later_evaluations

    (tmp_path / "report").mkdir()
    for attempt in ("first", "second"):
        (tmp_path / "eval_after.json").write_text(attempt)
        (tmp_path / "eval_iter000001.json").write_text(attempt)  # of weights the resume keeps
        set_aside_later_evaluations(tmp_path, start=3)
    assert (tmp_path / "eval_after-before-3.json").read_text() == "first"
    assert (tmp_path / "eval_after-before-3-2.json").read_text() == "second"
    assert not (tmp_path / "eval_after.json").exists() and (tmp_path / "eval_iter000001.json").read_text() == "second"
    assert "are kept as eval_after-before-3-2.json: this run draws its own" in capsys.readouterr().out


def test_kl_two_updates_per_iteration_and_a_last_evaluation_without_one_after(model_dir, tmp_path):
    """optim.beta > 0 (the SD3.5 presets' KL to the adapter-free reference) and two optimizer steps per
    iteration through a real engine (ZeRO-1, which no other run here builds); with eval.before_after
    off, eval.every evaluates the last iteration too."""
    out = tmp_path / "run"
    cfg = base_config(model_dir, out, iterations=2, checkpoint_every=0, eval={**SMALL_EVAL, "every": 2},
                      optim={"lr": 3e-2, "clip_range": 0.2, "updates_per_iteration": 2, "beta": 0.5,
                             "zero_stage": 1},
                      log={"tensorboard": False, "report": False})  # fmt: skip
    proc = train(write_config(tmp_path / "cfg.yaml", cfg))
    assert ", ZeRO-1, " in proc.stdout, proc.stdout[-2000:]
    rows = metrics(out)
    for r in rows:
        assert r["first_ratio_min"] == 1.0 == r["first_ratio_max"]
        # the micro-steps after the first of the two optimizer steps see weights it moved
        assert (r["ratio_min"], r["ratio_max"]) != (1.0, 1.0)
        # the LoRA's B starts at zero: the policy is its reference until the first step moves it away
        assert r["kl"] > 0
    assert [r["eval/strict"] is not None for r in rows] == [False, True]
    assert (out / "eval_iter000002.json").is_file() and not (out / "eval_after.json").exists()


@pytest.mark.parametrize("trained", ["train_helpers:ScaledBrightness", "train_helpers:brightness"])
def test_eval_reward_gets_its_options_and_may_have_no_strict(model_dir, tmp_path, trained):
    """As the SD3.5 presets' eval rewards: options from reward.options, whether the eval reward is
    also the training reward (the presets) or not (evaluating with PickScore a run trained on
    another reward), and (PickScore) no pass/fail."""
    name = "train_helpers:ScaledBrightness"
    out = tmp_path / "run"
    cfg = base_config(model_dir, out, iterations=1, checkpoint_every=0,
                      reward={"weights": {trained: 1.0}, "options": {name: {"scale": 0.5}}},
                      eval={"before_after": True, "reward": name, "limit": 2, "seeds": 1, "min_images": 0,
                            "steps": 2},
                      log={"tensorboard": False, "report": True})  # fmt: skip
    proc = train(write_config(tmp_path / "cfg.yaml", cfg))
    assert "eval before: overall strict nan score" in proc.stdout
    before = json.loads((out / "eval_before.json").read_text())
    scores = [s["score"] for s in before["samples"]]
    assert len(scores) == 2 and all(0 <= x <= 0.5 for x in scores)  # brightness in [0, 1], scaled by 0.5
    assert all(math.isnan(s["strict"]) for s in before["samples"])
    # no pass/fail, no gain in it: the run says so
    assert "stepfast: held-out gain not computed: the eval reward gives no pass/fail (strict) to compare" in proc.stdout
    summary = (out / "report" / "summary.md").read_text()
    assert "±" not in summary and "Overall (strict): " not in summary  # no 'nan -> nan (+nan)'


# --- bad input: a clear error, exit code 2, nothing lost ----------------------------------------


def test_unknown_config_key_suggests_the_closest(model_dir, tmp_path, start):
    config = write_config(tmp_path / "cfg.yaml", base_config(model_dir, tmp_path / "run"))
    code, err = start(config, "optim.lerning_rate=1")
    assert code == 2
    assert "unknown config key 'optim.lerning_rate'" in err


def test_help_names_the_presets_where_the_keys_are_and_what_a_run_writes(capsys):
    from stepfast.config import CONFIG_DIR
    from stepfast.train import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    presets = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    assert len(presets) == 5 and f"preset name ({', '.join(presets)}; default: default)" in text
    assert "Every key, its type and its default is in stepfast/config.py" in text and "checkpoints/" in text


@pytest.mark.parametrize("overrides", [["optim.lerning_rate=1"], ["model.path=/nonexistent"]])
def test_a_refusal_before_the_process_group_is_said_by_the_nodes_first_rank_alone(model_dir, tmp_path, start,
                                                                                    monkeypatch, overrides):  # fmt: skip
    """Under a launcher every rank reads the same config and files: the message came once per rank."""
    import stepfast.train

    config = write_config(tmp_path / "cfg.yaml", base_config(model_dir, tmp_path / "run"))
    waits = []
    monkeypatch.setattr(stepfast.train.time, "sleep", waits.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    # silent, and slower to exit than the first rank: a launcher kills all ranks at the first exit
    assert start(config, *overrides) == (2, "") and waits == [3]
    monkeypatch.setenv("LOCAL_RANK", "0")
    code, err = start(config, *overrides)
    assert code == 2 and err.startswith("stepfast: config error: ") and err.count("\n") == 1 and waits == [3]
    monkeypatch.setenv("LOCAL_RANK", "1")  # left in the environment of a run without a launcher
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert start(config, *overrides)[1].startswith("stepfast: config error: ")


@pytest.mark.skipif(Path("/models").exists() or Path("/data/pickscore").exists(), reason="the preset's paths exist")
def test_every_path_a_preset_cannot_find_is_named_at_once(tmp_path, capsys):
    """An SD3.5 preset on a machine without its model, prompts and reward weights: one error lists
    them all, before the process group and the model (in-process: nothing else would start)."""
    from stepfast.train import main

    assert main(["--config", "sd3_medium_pickscore", f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert ("stepfast: config error: 5 settings name what cannot be used here:\n"
            "  model.path: pipeline directory /models/stable-diffusion-3.5-medium does not exist\n"
            "  rollout.prompts: prompt file /data/pickscore/train.txt does not exist\n"
            "  eval.prompts: prompt file /data/pickscore/test.txt does not exist\n"
            "  reward.options.pickscore.path: /models/PickScore_v1 does not exist\n"
            "  reward.options.pickscore.processor_path: /models/CLIP-ViT-H-14-laion2B-s32B-b79K does not exist"
            ) in err  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_missing_model_directory(tmp_path, start):
    """Named from the files alone, before the process group starts (and a build of DeepSpeed's op)."""
    config = write_config(tmp_path / "cfg.yaml", base_config(tmp_path / "nowhere", tmp_path / "run"))
    code, err = start(config)
    assert code == 2
    assert f"model.path: pipeline directory {tmp_path / 'nowhere'} does not exist" in err


@pytest.mark.parametrize("section", ["rollout", "eval"])
@pytest.mark.parametrize("content, messages", [
    ("", ("holds no prompts",)),
    ('{"prompt": "a photo of a circle"}\n{"prompt": "a photo of\n', (":2: malformed JSON",)),
    ('{"prompt": "a photo of a dog", "tag": "single_object", "include": [{"class": "dog", "count": 1}]}\n',
     ("prompts_metadata.jsonl:1: ", "the record of prompt 'a photo of a dog': include[0] asks for class 'dog'")),
])  # fmt: skip
def test_bad_prompt_file(model_dir, tmp_path, content, messages, section, start):
    """Train or eval prompts: the error comes at start, before any iteration or checkpoint. An empty
    or malformed file is named from the file alone, before the process group; a record the reward
    cannot score once the reward is loaded (a trainer started as a user starts it)."""
    prompts = tmp_path / "prompts_metadata.jsonl"
    prompts.write_text(content)
    options = {"prompts": str(prompts), **({"every": 2} if section == "eval" else {})}
    scored = {"reward": {"weights": {"shapes": 1.0}}} if section == "rollout" else {}  # eval's is shapes
    cfg = base_config(model_dir, tmp_path / "run", **{section: options}, **scored)
    config = write_config(tmp_path / "cfg.yaml", cfg)
    if "dog" in content:
        proc = train(config, check=False)
        code, err = proc.returncode, proc.stderr
    else:
        code, err = start(config)
    assert code == 2
    assert str(prompts) in err and all(message in err for message in messages)
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.csv").exists()


@pytest.mark.parametrize("section", ["rollout", "eval"])
def test_a_prompt_the_reward_cannot_score_is_named_by_its_line(model_dir, tmp_path, section):
    """Blank lines are skipped when a .txt file is read, so the prompt's line is not its count."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n\na photo of a circle\na red circle\n")  # the last is not a ShapeEval prompt
    options = {"prompts": str(prompts), **({"every": 2} if section == "eval" else {})}
    scored = {"reward": {"weights": {"shapes": 1.0}}} if section == "rollout" else {}
    cfg = base_config(model_dir, tmp_path / "run", **{section: options}, **scored)
    proc = train(write_config(tmp_path / "cfg.yaml", cfg), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    by = "reward 'shapes': " if section == "rollout" else ""  # the train reward is a weighted one
    assert f"stepfast: error: {section}.prompts: {prompts}:4: {by}'a red circle'" in proc.stderr


@pytest.mark.parametrize("section, options, message", [
    ("reward", {"weights": {"shapez": 1.0}}, "reward.weights.shapez: unknown reward 'shapez' (did you mean 'shapes'?)"),
    ("eval", {"reward": "pickscor", "every": 2}, "eval.reward: unknown reward 'pickscor' (did you mean 'pickscore'?)"),
    ("eval", {"reward": "no_such_module:score", "every": 2}, "cannot import reward module 'no_such_module'"),
])  # fmt: skip
def test_bad_reward_name(model_dir, tmp_path, section, options, message, start):
    """Train or eval reward: the error names it, at start, before any iteration or checkpoint; a name
    not registered before the process group starts (and a build of DeepSpeed's op with it)."""
    cfg = base_config(model_dir, tmp_path / "run", **{section: options})
    config = write_config(tmp_path / "cfg.yaml", cfg)
    if "did you mean" in message:  # a registered name: checked from the config alone
        code, err = start(config)
    else:  # an import path is only tried where the reward loads
        proc = train(config, check=False)
        code, err = proc.returncode, proc.stderr
    assert code == 2
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.csv").exists()


@pytest.mark.parametrize("section", ["reward", "eval"])
def test_a_model_reward_without_its_weights_is_named(tmp_path, section):
    """A reward's path that exists but holds no model (transformers raises a bare OSError): a
    ConfigError naming the setting and the reward, which the trainer prints without a traceback."""
    from stepfast.startup import build_eval_reward, build_reward

    empty = tmp_path / "clip"
    empty.mkdir()
    overrides = [f"reward.options={{clipscore: {{path: {empty}}}}}"]
    if section == "reward":
        cfg = load_config("default", [*overrides, "reward.weights={clipscore: 1.0}"])
        build, where = build_reward, "reward.weights / reward.options: reward 'clipscore' cannot load its files:"
    else:
        cfg = load_config("default", [*overrides, "eval.reward=clipscore"])
        build, where = build_eval_reward, "eval.reward=clipscore (reward.options.clipscore):"
    with pytest.raises(ConfigError) as err:
        build(cfg, torch.device("cpu"))
    assert str(err.value).startswith(where) and str(empty) in str(err.value)


def test_an_eval_reward_that_is_also_trained_on_is_loaded_once():
    from stepfast.startup import build_eval_reward, build_reward

    cfg = load_config("default", ["reward.weights={shapes: 1.0, jpeg_compressibility: 0.1}", "eval.reward=shapes",
                                  "reward.options={shapes: {min_area: 0.01}}"])  # fmt: skip
    train_reward = build_reward(cfg, torch.device("cpu"))
    assert build_eval_reward(cfg, torch.device("cpu"), train_reward) is train_reward.rewards["shapes"]
    cfg.eval.reward = "jpeg_incompressibility"  # not trained on: its own
    assert type(build_eval_reward(cfg, torch.device("cpu"), train_reward)).__name__ == "JpegIncompressibility"


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_without_the_package_is_a_clear_error(model_dir, tmp_path):
    cfg = base_config(model_dir, tmp_path / "run", log={"wandb": True})
    proc = train(write_config(tmp_path / "cfg.yaml", cfg), check=False)
    assert proc.returncode == 2
    assert "log.wandb=true, but wandb is not installed" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def copy_run(baseline, tmp_path) -> tuple[Path, Path, dict[Path, bytes]]:
    """A copy of the baseline run, its config, and the bytes of every file in it (to check that a
    failed start changes none)."""
    config, base_out = baseline
    out = tmp_path / "run"
    shutil.copytree(base_out, out)
    cfg = yaml.safe_load(config.read_text())
    cfg["output_dir"] = str(out)
    files = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    return write_config(tmp_path / "cfg.yaml", cfg), out, files


def assert_unchanged(out: Path, files: dict[Path, bytes]) -> None:
    now = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert now.keys() == files.keys() and all(now[p] == files[p] for p in files)


def test_a_run_that_came_to_its_folder_since_it_looked_is_refused_before_writing(tmp_path):
    """Two runs started together both find output_dir free before the process group; the first
    rank takes the folder's lock just before the run writes there, and the one that comes second
    is refused then, having written nothing."""
    from types import SimpleNamespace

    from stepfast.files import RunLock
    from stepfast.train import Trainer

    out = tmp_path / "run"
    other, mine = RunLock(out), RunLock(out)
    trainer = SimpleNamespace(main=True, world=1, device=torch.device("cpu"), out=out)
    assert other.take() is None  # a lock is per open folder: one taken here is another run's to the trainer
    try:
        with pytest.raises(ConfigError, match=rf"^output_dir {re.escape(str(out))}: another run is writing there "
                                              rf"\(pid {os.getpid()}: .+\); wait for it to end"):  # fmt: skip
            Trainer._take_output_dir(trainer, mine)
        assert list(out.iterdir()) == []
    finally:
        other.release()
    try:
        Trainer._take_output_dir(trainer, mine)
        assert RunLock.holder(out).startswith(f"pid {os.getpid()}: ")  # held, until the run stops
    finally:
        mine.release()
    assert RunLock.holder(out) is None and list(out.iterdir()) == []


def test_a_run_is_refused_a_folder_another_run_writes_and_changes_nothing(baseline, tmp_path, start):
    """Looked at before the process group, on every rank (none of this run holds it yet)."""
    from stepfast.files import RunLock

    config, out, files = copy_run(baseline, tmp_path)
    other = RunLock(out)
    assert other.take() is None
    try:
        for resume in ("none", "auto"):  # not "already holds a run: ... resume=auto" over a live run
            code, err = start(config, f"resume={resume}")
            assert code == 2 and err.startswith(f"stepfast: config error: output_dir {out}: another run is writing "
                                                f"there (pid {os.getpid()}: "), err  # fmt: skip
        assert_unchanged(out, files)
    finally:
        other.release()


def test_a_new_run_into_a_finished_one_is_refused(baseline, tmp_path, start):
    """Before the process group (and a first start's minute of DeepSpeed's op build)."""
    config, out, files = copy_run(baseline, tmp_path)
    code, err = start(config)
    assert code == 2
    assert (f"output_dir {out} already holds a run (metrics.csv, checkpoints): continue it from its newest "
            "checkpoint with resume=auto") in err
    assert_unchanged(out, files)


@pytest.mark.parametrize("inner, message", [
    ("checkpoints/checkpoint-000002", "lies in the checkpoint {out}/checkpoints/checkpoint-000002: a run deletes"),
    ("checkpoints/checkpoint-000002/sub", "lies in the checkpoint {out}/checkpoints/checkpoint-000002: a run deletes"),
    ("checkpoints", "lies in the checkpoints folder of the run in {out}, where that run writes and deletes"),
    ("checkpoints/checkpoint-000009", "lies in the checkpoints folder of the run in {out}, where that run writes"),
])  # fmt: skip
@pytest.mark.parametrize("resume", ["none", "auto"])
def test_a_run_inside_another_runs_checkpoints_is_refused(baseline, tmp_path, start, inner, message, resume):
    """The outer run prunes its older checkpoints (keep_checkpoints) with whatever lies in them: a run
    written there would be lost without a word, whether it starts or resumes."""
    config, out, files = copy_run(baseline, tmp_path)
    code, err = start(config, f"output_dir={out / inner}", f"resume={resume}")
    assert code == 2, err
    assert f"output_dir {out / inner} " + message.format(out=out) in err
    assert_unchanged(out, files)


def test_a_folder_named_checkpoints_that_holds_no_run_is_a_fine_output_dir(tmp_path):
    """Only a run's checkpoints are refused: a hand-written config.yaml beside a folder of that name
    is not a run, nor is a folder of checkpoints moved out of their run; a run's checkpoints folder
    that is a link to another disk is its run's all the same."""
    from stepfast.startup import inside_checkpoints

    (tmp_path / "config.yaml").write_text("iterations: 1\n")
    assert inside_checkpoints(tmp_path / "checkpoints") is None
    (tmp_path / "checkpoints" / "checkpoint-000010").mkdir(parents=True)  # moved here, its run elsewhere
    (tmp_path / "config.yaml").unlink()
    assert inside_checkpoints(tmp_path / "checkpoints" / "run2") is None
    run, disk = tmp_path / "run", tmp_path / "disk"
    (disk / "checkpoint-000002").mkdir(parents=True)
    run.mkdir()
    (run / "config.yaml").write_text("iterations: 4\n")
    (run / "checkpoints").symlink_to(disk)
    problem = inside_checkpoints(run / "checkpoints" / "checkpoint-000050")
    assert problem.endswith(f"lies in the checkpoints folder of the run in {run}, where that run writes and deletes "
                            "its checkpoints; give a folder outside it")  # fmt: skip


def test_a_new_run_keeps_a_config_yaml_it_finds_in_its_output_dir(model_dir, tmp_path):
    """A hand-written config kept in output_dir and given with --config: the run writes its resolved
    settings as config.yaml, and keeps the file that was there (its comments with it), once."""
    out = tmp_path / "run"
    out.mkdir()
    cfg = base_config(model_dir, out, iterations=1, checkpoint_every=1, log={"report": False, "tensorboard": False})
    own = out / "config.yaml"
    text = "# my experiment: hand-written notes\n" + yaml.safe_dump(cfg)
    own.write_text(text)
    proc = train(own)
    kept = out / "config-before-1.yaml"
    assert kept.read_text() == text and proc.stderr.count(f"the file there before is kept as {kept}") == 1
    assert own.read_text() != text and load_config(str(own)).iterations == 1


@pytest.mark.parametrize("target, message", [
    ("{out}", "resume: {out} is a run's output_dir, not one of its checkpoints: continue its newest with "
              "output_dir={out} resume=auto, or name one of {out}/checkpoints/checkpoint-NNNNNN"),
    ("{out}/checkpoints/checkpoint-000003", "resume: checkpoint '{out}/checkpoints/checkpoint-000003' does not exist"),
    ("{out}/metrics.csv", "resume: checkpoint '{out}/metrics.csv' is a file, not a checkpoint dir"),
    ("{out}/checkpoints/half", "resume: {out}/checkpoints/half is not a complete checkpoint (no COMPLETE marker)"),
])  # fmt: skip
def test_a_resume_that_names_no_checkpoint_says_what_it_names(baseline, tmp_path, capsys, target, message):
    """Refused before the process group and the model (in-process: nothing else would start)."""
    from stepfast.train import main

    config, out, _ = copy_run(baseline, tmp_path)
    (out / "checkpoints" / "half").mkdir()
    files = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert main(["--config", str(config), f"resume={target.format(out=out)}", f"output_dir={tmp_path / 'other'}"]) == 2
    assert message.format(out=out) in capsys.readouterr().err
    assert_unchanged(out, files)


def test_an_output_dir_that_cannot_be_searched_is_a_config_error(tmp_path, monkeypatch, start):
    """Named once, as the folder that cannot be checked, not as a traceback from the run-in-the-way check."""
    from pathlib import Path as RealPath

    config = write_config(tmp_path / "cfg.yaml", base_config(EMBEDDED_MODEL, tmp_path / "locked" / "run"))
    exists = RealPath.exists

    def guarded(self):  # the folder above the run cannot be searched
        if str(self).startswith(str(tmp_path / "locked")):
            raise PermissionError(13, "Permission denied", str(self))
        return exists(self)

    monkeypatch.setattr(RealPath, "exists", guarded)
    code, err = start(config)
    assert code == 2, err
    assert f"output_dir: cannot check {tmp_path / 'locked' / 'run'} (can a folder above it be searched?)" in err


def test_a_run_stopped_before_its_first_checkpoint_is_named_so(baseline, tmp_path, start):
    """Nothing to continue from: the refusal does not send the user to resume=auto as if there were,
    and resume=auto, which starts such a run again, says that it replaces the old metrics.csv."""
    config, out, _ = copy_run(baseline, tmp_path)
    shutil.rmtree(out / "checkpoints")
    files = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    code, err = start(config)
    assert code == 2
    assert (f"output_dir {out} already holds a run (metrics.csv) that stopped before its first checkpoint: give "
            "another output_dir, or start it again there with resume=auto, which replaces its metrics.csv"
            ) in err  # fmt: skip
    assert_unchanged(out, files)
    proc = train(config, "resume=auto", "iterations=1")
    assert f"resume=auto found no checkpoint in {out}; starting fresh (replacing its metrics.csv)" in proc.stdout
    assert [r["iteration"] for r in metrics(out)] == [1]


def test_an_ema_turned_on_at_a_resume_averages_from_the_resumed_weights(baseline, tmp_path):
    """The baseline ran without an EMA; resumed with optim.ema=0.5 for one more iteration, the EMA is
    the mean of checkpoint 4's weights and iteration 5's, not of the initial weights and iteration 5's."""
    from safetensors.torch import load_file

    config, out, _ = copy_run(baseline, tmp_path)
    proc = train(config, "resume=auto", "iterations=5", "optim.ema=0.5", "log.report=false")
    assert f"{out}/checkpoints/checkpoint-000004 holds no EMA (optim.ema was 0): the EMA starts from its weights" in proc.stdout
    before, after = (load_file(out / "checkpoints" / f"checkpoint-00000{i}" / "lora" / "pytorch_lora_weights.safetensors")
                     for i in (4, 5))  # fmt: skip
    shadow = torch.load(out / "checkpoints" / "checkpoint-000005" / "state.pt", weights_only=False)["ema"]["shadow"]
    assert len(shadow) == len(after) > 0
    for name, weight in shadow.items():
        key = "transformer." + name.replace(".default.", ".")
        assert torch.equal(weight, before[key].mul(0.5).add(after[key], alpha=0.5)), name


def test_a_run_killed_after_its_last_checkpoint_finishes_on_resume(baseline, tmp_path):
    """Killed between the last checkpoint and the end (its report): resume=auto with the same
    iterations trains nothing more and writes what was left."""
    config, out, files = copy_run(baseline, tmp_path)
    shutil.rmtree(out / "report")
    proc = train(config, "resume=auto")
    assert (f"resumed from {out}/checkpoints/checkpoint-000004 at iteration 5: iterations=4 are done, nothing is "
            "left to train (raise iterations to train on)") in proc.stdout
    assert f"stepfast: done; checkpoint {out}/checkpoints/checkpoint-000004" in proc.stdout
    assert (out / "report" / "summary.md").is_file()
    assert [r["iteration"] for r in metrics(out)] == [1, 2, 3, 4]  # no iteration trained again
    assert {p for p in files if "report" not in p.parts} <= {p for p in out.rglob("*") if p.is_file()}


@pytest.mark.parametrize("overrides, damage, message", [
    (["resume=auto", "iterations=6"], True, "metrics.csv: cannot read the metrics logged so far"),
    # the baseline ran on one rank: ZeRO's optimizer state cannot be split across two
    (["resume=auto", "iterations=6"], False, "checkpoint-000004 was written by 1 rank(s) and this run has 2: "
                                             "DeepSpeed cannot re-split ZeRO's optimizer state"),
])  # fmt: skip
def test_bad_input_stops_every_rank_of_two(baseline, tmp_path, overrides, damage, message):
    """Every rank makes the start-up checks, so no rank is left waiting in a collective for one that
    stopped: the launcher exits with the error's code well inside the timeout, the run unchanged."""
    config, out, _ = copy_run(baseline, tmp_path)
    if damage:
        (out / "metrics.csv").write_text("garbage,header\n1,2\n")
    files = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    proc = train(config, *overrides, ranks=2, check=False, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert message in proc.stderr
    assert_unchanged(out, files)


def test_a_reward_server_is_checked_by_every_rank_and_stops_them_all(model_dir, tmp_path, monkeypatch):
    """Each rank scores through its own client: each asks the server, and they all stop when any
    one cannot reach it (it could be another server per node), instead of waiting in a collective."""
    from stepfast.config import ConfigError
    from stepfast.startup import check_servers

    class Answers:
        size = None

        def check_server(self, size=None):
            self.size = size

    def gathered(out, mine):  # as all_gather_object on rank 0 of two, whose rank 1 failed
        out[:] = [mine, "reward.options.remote: reward server http://node1:8600 failed after 6 attempt(s)"]

    monkeypatch.setattr(torch.distributed, "all_gather_object", gathered)
    with pytest.raises(ConfigError, match=r"^\(on rank 1\) reward.options.remote: reward server http://node1:8600"):
        check_servers({"reward.options.remote": Answers()}, world=2)
    check_servers({"reward.options.shapes": object()}, world=2)  # no server to ask: no collective
    answers = Answers()
    check_servers({"reward.options.remote": answers}, world=1, size=64)
    assert answers.size == 64  # the images' side, which the server's pixel limit is checked against

    cfg = base_config(model_dir, tmp_path / "run", reward={
        "weights": {"remote": 1.0}, "options": {"remote": {"url": "http://127.0.0.1:9", "rewards": ["shapes"],
                                                           "retries": 0}}})  # fmt: skip
    proc = train(write_config(tmp_path / "cfg.yaml", cfg), ranks=2, check=False, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr[-2000:])
    assert "reward.options.remote: reward server http://127.0.0.1:9 failed after 1 attempt(s)" in proc.stderr
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_reward_server_too_small_for_the_rollouts_images_is_refused_at_start(model_dir, tmp_path):
    """The server check is given the rollout's resolution: a server whose pixel limit a single image
    of that side is over is named at start, not after the first rollout."""
    from loopback import LoopbackServer

    health = json.dumps({"rewards": ["shapes"], "max_request_pixels": 1000}).encode()
    with LoopbackServer(lambda path, body: None, get=lambda path, headers: (200, health)) as server:
        cfg = base_config(model_dir, tmp_path / "run", rollout={"resolution": 32}, reward={
            "weights": {"remote": 1.0}, "options": {"remote": {"url": server.url, "rewards": ["shapes"], "retries": 0}}})
        proc = train(write_config(tmp_path / "cfg.yaml", cfg), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr[-2000:])
    assert (f"reward.options.remote: reward server {server.url} takes at most 1000 pixels a request (its "
            "--max-request-mpixels), fewer than one 32x32 image: raise the server's limit") in proc.stderr, proc.stderr[-2000:]
    assert [path for path, _, _ in server.requests] == ["/check"]  # the prompts were checked, nothing scored
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_changed_settings_are_compared_with_those_the_checkpoints_iterations_ran_with(tmp_path, capsys):
    """runfolder.keep_changed_settings in-process: a second resume from the same checkpoint compares
    with (and keeps) the settings iterations 1-4 ran with, not those of the attempt between; a
    checkpoint of another output_dir is compared, nothing kept here; one moved out of its run's
    checkpoints folder has no settings to compare; an unreadable file is a warning, not an error."""
    from stepfast.config import to_yaml
    from stepfast.runfolder import keep_changed_settings

    def resume(out: Path, checkpoint: Path, *overrides: str) -> str:
        cfg = load_config("default", [f"output_dir={out}", *overrides])
        keep_changed_settings(cfg, out, checkpoint, 4)
        (out / "config.yaml").write_text(to_yaml(cfg))  # as the trainer then writes it
        return capsys.readouterr().err

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "checkpoint-000004"
    ckpt.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(load_config("default", [f"output_dir={run}", "optim.lr=0.03"])))
    original = (run / "config.yaml").read_text()
    assert "optim.lr: 0.03 -> 0.01" in resume(run, ckpt, "optim.lr=0.01")
    assert "optim.lr: 0.03 -> 0.02" in resume(run, ckpt, "optim.lr=0.02")  # that attempt died before checkpoint 5
    assert (run / "config-until-000004.yaml").read_text() == original
    assert resume(run, ckpt, "optim.lr=0.03") == ""  # back to the settings iterations 1-4 ran with

    other = tmp_path / "other"
    other.mkdir()
    err = resume(other, ckpt, "optim.lr=0.05")  # that run's settings of iterations 1-4; nothing kept here
    until = run / "config-until-000004.yaml"
    assert f"than those of {until}: optim.lr: 0.03 -> 0.05. The run goes on with these\n" in err
    assert not list(other.glob("config-until-*"))
    (run / "config-until-000004.yaml").unlink()  # a run resumed without changes has none: its config.yaml
    (run / "config.yaml").write_text(original)
    assert f"than those of {run / 'config.yaml'}: optim.lr: 0.03 -> 0.04." in resume(other, ckpt, "optim.lr=0.04")
    (run / "config-until-000004.yaml").write_text(original)

    moved = tmp_path / "moved" / "checkpoint-000004"
    moved.mkdir(parents=True)
    (moved.parent.parent / "config.yaml").write_text("an unrelated file")
    assert resume(other, moved, "optim.lr=0.06") == ""

    (run / "config-until-000004.yaml").write_bytes(b"\xff\xfe not yaml")
    assert "(which this version cannot read: " in resume(run, ckpt, "optim.lr=0.07")


def test_the_settings_a_checkpoint_is_laid_out_by_are_compared_by_layout(tmp_path):
    """ZeRO stages 1 and 2 save the same engine state (a run may move between them), and a LoRA's
    targets are a set; stage 3, the precision, the adapter's rank or targets, or LoRA against full
    fine-tuning are refused, named old -> new."""
    from stepfast.config import to_yaml
    from stepfast.startup import engine_settings_problem

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "checkpoint-000004"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("4")
    written = ["optim.zero_stage=2", "model.lora_targets=[attn.to_q, attn.to_v]"]
    (run / "config.yaml").write_text(to_yaml(load_config("default", written)))

    def problem(*overrides):
        return engine_settings_problem(load_config("default", [*written, *overrides]), ckpt)

    assert problem() is None and problem("optim.zero_stage=1") is None
    assert problem("model.lora_targets=[attn.to_v, attn.to_q]") is None and problem("optim.lr=0.5") is None
    assert "cannot continue with other optim.zero_stage: 2 -> 3 (its settings: " in problem("optim.zero_stage=3")
    assert "model.lora_targets: [attn.to_q, attn.to_v] -> [attn.to_q]" in problem("model.lora_targets=[attn.to_q]")
    assert "model.lora: true -> false" in problem("model.lora=false", "optim.beta=0")
    assert "optim.precision: fp32 -> bf16" in problem("optim.precision=bf16")
    (run / "config.yaml").write_text(to_yaml(load_config("default", [*written, "model.lora=false", "optim.beta=0"])))
    assert problem("model.lora=false", "optim.beta=0", "model.lora_rank=4") is None  # no adapter on either side


@pytest.mark.parametrize("damage, overrides, message", [
    ("engine", [], "is marked complete but has no engine"),
    ("rng", [], "holds optimizer shards of 1 rank(s) and RNG files of ranks none (a damaged checkpoint)"),
    ("truncate", [], "cannot be loaded into this run (RuntimeError"),
    (None, ["model.lora_rank=8"], "checkpoint-000004 cannot continue with other model.lora_rank: 4 -> 8 (its "
                                  "settings: {out}/config.yaml)"),
    (None, ["optim.zero_stage=3"], "cannot continue with other optim.zero_stage: 2 -> 3"),
    (None, ["optim.precision=bf16"], "cannot continue with other optim.precision: fp32 -> bf16"),
    ("engine", ["resume={out}/checkpoints/checkpoint-000004"], "checkpoint-000004 is marked complete but has no "
                                                               "engine (a damaged checkpoint)"),
    ("metrics", [], "metrics.csv: cannot read the metrics logged so far"),
    (None, ["resume={out}/checkpoints/checkpoint-000002"], "holds a later checkpoint"),
    (None, ["iterations=3"], "iterations=3, but {out}/checkpoints/checkpoint-000004 is at iteration 4: a run "
                             "cannot go back"),
])  # fmt: skip
def test_resume_names_a_damaged_or_mismatched_run_and_changes_nothing(baseline, tmp_path, damage, overrides, message):
    config, out, _ = copy_run(baseline, tmp_path)
    overrides = [o.format(out=out) for o in overrides]
    newest = out / "checkpoints" / "checkpoint-000004"
    if damage in ("engine", "rng"):
        shutil.rmtree(newest / damage)
    elif damage == "truncate":
        (newest / "state.pt").write_bytes((newest / "state.pt").read_bytes()[:100])
    elif damage == "metrics":
        (out / "metrics.csv").write_text("garbage,header\n1,2\n")
    files = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    proc = train(config, "resume=auto", "iterations=6", *overrides, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert message.format(out=out) in proc.stderr
    assert_unchanged(out, files)


def fp16_runs_here() -> bool:
    """Whether DeepSpeed accepts optim.precision=fp16 on this machine: on CUDA, and on a CPU whose
    oneDNN computes in fp16 (AVX512-FP16: DeepSpeed's CPU accelerator asks torch, as here)."""
    if torch.cuda.is_available():
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


@pytest.mark.parametrize("overrides, message", [
    (["reward.options={train_helpers:brightness: {bogus: 1}}"], "options ['bogus'] do not fit"),
    (["optim.deepspeed={amp: {enabled: true}}"], "DeepSpeed refused this run's settings (optim.zero_stage=2, "
     "optim.precision=fp32, optim.deepspeed={'amp': {'enabled': True}}): NVIDIA Apex AMP integration has been removed"),
    (["rollout.resolution=72"], "rollout.resolution=72: this model draws images whose side is a multiple of 8 px "
     "up to 64 px"),  # its position embedding holds 8 x 8 patches
    (["rollout.resolution=60"], "rollout.resolution=60: this model draws images whose side is a multiple of 8 px"),
    (["reward.weights={remote: 1.0}", "reward.options={remote: {url: 'http://127.0.0.1:9', rewards: [shapes], "
      "retries: 0}}"], "reward.options.remote: reward server http://127.0.0.1:9 failed after 1 attempt(s)"),
    (["reward.weights={remote: 1.0}", "reward.options={remote: {url: '127.0.0.1:9', rewards: [shapes]}}"],
     "reward.weights / reward.options: reward server URL '127.0.0.1:9' must look like http://HOST:PORT/path"),
    (["eval.before_after=true", "eval.reward=remote",
      "reward.options={remote: {url: 'http://127.0.0.1:9', rewards: [shapes], retries: 0}}"],
     "eval.reward=remote (reward.options.remote): reward server http://127.0.0.1:9 failed after 1 attempt(s)"),
    pytest.param(["optim.precision=fp16"], "DeepSpeed refused this run's settings (optim.zero_stage=2, "
                 "optim.precision=fp16, optim.deepspeed={}): Type fp16 is not supported on your device",
                 marks=pytest.mark.skipif(fp16_runs_here(), reason="this machine runs fp16 (CUDA, or a CPU "
                                          "whose oneDNN has fp16, which DeepSpeed's CPU accelerator then allows)")),
])  # fmt: skip
def test_settings_that_cannot_run_are_named_at_start(model_dir, tmp_path, overrides, message):
    config = write_config(tmp_path / "cfg.yaml", base_config(model_dir, tmp_path / "run"))
    proc = train(config, *overrides, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert message in proc.stderr
    assert not (tmp_path / "run" / "config.yaml").exists() and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("world, overrides, message", [
    (1, ["sde.steps=2", "sde.min_std=0.5"], "sde.min_std=0.5 and sde.timestep_fraction=1.0 trains no step"),
    (1, ["sde.eta=0"], "sampler 'ddim' with sde.steps=5"),
    (1, ["optim.updates_per_iteration=4"], "optim.updates_per_iteration=4 must divide the 6 backward passes of an "
     "iteration: 3 trained steps x 2 micro-batch(es) of rollout.micro_batch=4 from this rank's 8 samples"),
    (3, [], "rollout.groups x rollout.group_size = 2 x 4 = 8 samples do not split evenly over 3 ranks"),
    (2, ["optim.updates_per_iteration=2"], "optim.updates_per_iteration=2 must divide the 3 backward passes"),
])  # fmt: skip
def test_an_iteration_that_cannot_be_laid_out_is_named_before_the_process_group(model_dir, tmp_path, start, monkeypatch,
                                                                               world, overrides, message):
    """The steps trained (the model's time grid: its scheduler's shift), the ranks' shares of the samples
    and the optimizer steps' shares of the backward passes are known from the files: refused before the
    process group and the model load, by the launcher's world size."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", "0")
    config = write_config(tmp_path / "cfg.yaml", base_config(model_dir, tmp_path / "run"))
    code, err = start(config, *overrides)
    assert code == 2 and message in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("shift", [None, 2.0])
def test_the_start_checks_read_the_time_grid_as_the_trainer_does(model_dir, tmp_path, shift):
    """The start checks read the scheduler's shift from its config file, the trainer from the loaded
    pipeline: where the file sets none, diffusers fills in its class's default (1.0, not SD3's 3.0), and
    both must see that one, or the start could refuse a run the trainer would train (or pass one it refuses)."""
    from stepfast.models import load_pipeline
    from stepfast.policy import grid_shift
    from stepfast.startup import scheduler_shift

    model = Path(shutil.copytree(model_dir, tmp_path / "model"))
    config_file = model / "scheduler" / "scheduler_config.json"
    config = json.loads(config_file.read_text())
    config.pop("shift", None) if shift is None else config.update(shift=shift)
    config_file.write_text(json.dumps(config))
    assert scheduler_shift(model) == grid_shift(load_pipeline(model).scheduler.config) == (shift or 1.0)


def test_balanced_categories_need_a_tag_on_every_prompt_before_the_start(model_dir, tmp_path, start):
    """Named with the other settings the files show at fault, before the process group (and a first
    start's build of DeepSpeed's op): the default preset balances categories."""
    prompts = tmp_path / "prompts_metadata.jsonl"
    prompts.write_text('{"prompt": "a photo of a circle", "tag": "single_object"}\n\n{"prompt": "a photo of a square"}\n')
    cfg = base_config(model_dir, tmp_path / "run", rollout={"prompts": str(prompts), "balance_categories": True})
    code, err = start(write_config(tmp_path / "cfg.yaml", cfg), f"model.path={tmp_path / 'nothing'}")
    assert code == 2
    assert "2 settings name what cannot be used here" in err and "model.path" in err
    assert f"line 3 of {prompts} ('a photo of a square') has none" in err  # its line, not its count


def test_a_trainer_built_without_the_start_checks_refuses_untagged_prompts_too(model_dir, tmp_path):
    from types import SimpleNamespace

    from stepfast.data.prompts import load_prompts
    from stepfast.train import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a circle\n")
    cfg = load_config("default", [f"rollout.prompts={prompts}", "rollout.balance_categories=true"])
    trainer = SimpleNamespace(cfg=cfg, prompts=load_prompts(str(prompts)))
    with pytest.raises(ConfigError, match=f"line 1 of {re.escape(str(prompts))}"):
        Trainer._strata(trainer)


@pytest.mark.parametrize("setting", ["rollout.prompts", "eval.prompts"])
@pytest.mark.parametrize("tag", [1, 0, False, ["colors"]])
def test_a_tag_that_is_not_text_is_named_by_its_line_before_the_start(model_dir, tmp_path, start, setting, tag):
    """The held-out table, the report and category balancing group prompts by tag: one of another type
    raised a TypeError naming no line (0 and False read as no tag)."""
    prompts = tmp_path / "prompts_metadata.jsonl"
    prompts.write_text('{"prompt": "a photo of a circle", "tag": "single_object"}\n'
                       + json.dumps({"prompt": "a photo of a square", "tag": tag}) + "\n")  # fmt: skip
    cfg = base_config(model_dir, tmp_path / "run", eval={"before_after": True})
    code, err = start(write_config(tmp_path / "cfg.yaml", cfg), f"{setting}={prompts}")
    assert code == 2
    assert f"{setting}: {prompts}:2: 'tag' must be text (a category name), got {tag!r}" in err


def test_nan_reward_stops_with_a_clear_error_and_keeps_checkpoints(baseline, tmp_path):
    config, base_out = baseline
    out = tmp_path / "run"
    shutil.copytree(base_out, out)
    cfg = yaml.safe_load(config.read_text())
    cfg["output_dir"] = str(out)
    cfg["reward"] = {"weights": {"train_helpers:nan_reward": 1.0}}
    proc = train(write_config(tmp_path / "cfg.yaml", cfg), "resume=auto", "iterations=6", check=False)
    assert proc.returncode == 2
    # the image, by its group, member and prompt, and the error said once, not again by main()
    named = r"returned NaN scores for 1 of 8 images: group \d, member \d \('[^']+'\): the final image"
    assert len(re.findall(named, proc.stderr)) == 1, proc.stderr[-2000:]
    assert "last checkpoint" in proc.stderr and "checkpoint-000004" in proc.stderr
    assert checkpoint.latest(out).name == "checkpoint-000004"


def test_a_reward_error_names_the_estimate_by_its_sample_and_state():
    from types import SimpleNamespace

    from stepfast.data.sampler import LocalBatch
    from stepfast.train import Trainer

    batch = LocalBatch(indices=[0, 1, 2], groups=[1, 1, 2], members=[2, 3, 0], start=6)
    trainer = SimpleNamespace(grid=torch.tensor([1.0, 0.75, 0.5, 0.0]))
    final, estimate = Trainer._image_names(trainer, batch, ["a cat", "a cat", "a dog"])
    assert final(2) == "group 3, member 1 ('a dog'): the final image"
    assert estimate(3 * 2 + 1) == "group 2, member 4 ('a cat'): the estimate from state 2 (t = 0.500)"


def test_reward_server_death_stops_training_with_its_error_and_keeps_checkpoints(model_dir, tmp_path):
    """The server is started on loopback by this test and killed after checkpoint 2."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "stepfast.reward_server", "--rewards", "train_helpers:brightness", "--port", str(port)],
        cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert "reward server" in server.stdout.readline()  # serving
        out = tmp_path / "run"
        cfg = base_config(model_dir, out, iterations=8, reward={
            "weights": {"remote": 1.0},
            "options": {"remote": {"url": f"http://127.0.0.1:{port}", "rewards": ["train_helpers:brightness"],
                                   "retries": 2, "backoff": 0.05, "timeout": 5.0}},
        })  # fmt: skip
        config = write_config(tmp_path / "cfg.yaml", cfg)
        trainer = subprocess.Popen([sys.executable, str(TRAIN), "--config", str(config)], cwd=ROOT, env=env(),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        marker = out / "checkpoints" / "checkpoint-000002" / "COMPLETE"
        deadline = time.time() + 600
        while not marker.exists():
            assert trainer.poll() is None and time.time() < deadline
            time.sleep(0.05)
        server.kill()
        server.wait()
        _, stderr = trainer.communicate(timeout=600)
    finally:
        server.kill()
    assert trainer.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]  # its message, not a traceback
    assert "RewardServerError" in stderr and f"127.0.0.1:{port}" in stderr
    assert "last checkpoint" in stderr
    latest = checkpoint.latest(out)
    assert latest is not None and latest.name in ("checkpoint-000002", "checkpoint-000004")
    assert (latest / "lora" / "pytorch_lora_weights.safetensors").exists()
