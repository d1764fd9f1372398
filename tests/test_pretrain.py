"""`python -m stepfast.pretrain`, the command that rebuilds the embedded model, at a few steps: it
writes a pipeline that loads, the same seed writes the same weights, and a bad --vae is named."""

import contextlib
import io
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from stepfast import pretrain
from stepfast.models import EMBEDDED_MODEL, load_pipeline

@pytest.fixture(autouse=True)
def keep_torch_state():
    """pretrain.main sets torch's thread count and seed for the process: put them back for the
    tests that run after these in the same process."""
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    yield
    torch.set_num_threads(threads)
    torch.random.set_rng_state(rng)


TINY = ["--steps", "3", "--vae-steps", "2", "--pool-size", "48", "--batch-size", "8"]


def weights(pipe_dir, part):
    return load_file(Path(pipe_dir) / part / "diffusion_pytorch_model.safetensors")


def test_pretrain_writes_a_loadable_pipeline_and_the_same_seed_the_same_weights(tmp_path):
    first = pretrain.main([*TINY, "--out", str(tmp_path / "a"), "--device", "cpu"])
    second = pretrain.main([*TINY, "--out", str(tmp_path / "b"), "--device", "cpu"])
    other = pretrain.main([*TINY, "--out", str(tmp_path / "c"), "--device", "cpu", "--seed", "1"])
    assert not (tmp_path / "a.tmp").exists() and not (tmp_path / "a.old").exists()
    for part in ("transformer", "vae"):
        a, b, c = weights(first, part), weights(second, part), weights(other, part)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert any(not torch.equal(a[k], c[k]) for k in a)
    pipe = load_pipeline(first)
    # phase 2 sets the VAE's latent statistics: not the library defaults
    assert pipe.vae.config.scaling_factor != 1.0 and pipe.vae.config.shift_factor != 0.0
    images = pipe("a photo of a red circle", num_inference_steps=2, height=64, width=64,
                  generator=torch.Generator().manual_seed(0), output_type="np").images
    assert images.shape == (1, 64, 64, 3)


def test_pretrain_reuses_a_vae_unchanged(tmp_path, capsys):
    out = pretrain.main([*TINY, "--out", str(tmp_path / "m"), "--device", "cpu", "--vae", str(EMBEDDED_MODEL)])
    reused, shipped = weights(out, "vae"), weights(EMBEDDED_MODEL, "vae")
    assert all(torch.equal(reused[k], shipped[k]) for k in shipped)
    said = capsys.readouterr().out  # the VAE it was given, not a "recon loss nan" that reads as a failure
    assert f"(VAE of {EMBEDDED_MODEL}, not trained; transformer loss " in said and "nan" not in said, said


def damaged(tmp_path, name: str, text: str) -> None:
    """A copy of the embedded model at tmp_path with its vae/NAME replaced by `text`."""
    shutil.copytree(EMBEDDED_MODEL, tmp_path, dirs_exist_ok=True)
    (tmp_path / "vae" / name).write_text(text)


@pytest.mark.parametrize("vae, message, damage", [
    ("{tmp}/nowhere", "--vae: pipeline directory {tmp}/nowhere does not exist", None),
    ("{tmp}", "--vae: {tmp} is not a diffusers pipeline directory", None),
    ("{tmp}", "--vae: cannot load the VAE in {tmp}/vae: ", ("config.json", "{")),
    ("{tmp}", "--vae: cannot load the VAE in {tmp}/vae: ", ("diffusion_pytorch_model.safetensors", "cut")),
])  # fmt: skip
def test_pretrain_names_a_bad_vae_directory_before_any_work(tmp_path, vae, message, damage):
    if damage:
        damaged(tmp_path, *damage)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "stepfast.pretrain", "--vae", vae.format(tmp=tmp_path), "--out", str(out), *TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert message.format(tmp=tmp_path) in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def run_pretrain(*args) -> SimpleNamespace:
    """`python -m stepfast.pretrain TINY ARGS` (ARGS last: they win over TINY's), run in this process
    through the main() it calls: .returncode, .stdout and .stderr as a subprocess gives them (the
    refusals are argparse errors, exit status 2). test_pretrain_names_a_bad_vae_directory_before_any_work
    starts the module itself."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            pretrain.main([*TINY, *(str(a) for a in args)])
            code = 0
        except SystemExit as exc:
            code = exc.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.mark.parametrize("args, message", [
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--device", "bogus"], "--device: 'bogus' is not a torch device"),
    (["--seed", "-1"], "--seed must be >= 0 and below 2**63 (a 64-bit generator seed), got -1"),
    (["--seed", str(2**63)], f"--seed must be >= 0 and below 2**63 (a 64-bit generator seed), got {2**63}"),
    (["--snapshot-every", "-2"], "--snapshot-every must be >= 0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--pool-size", "-3"], "--pool-size must be >= 1, got -3"),
    pytest.param(["--device", "cuda"], "--device: 'cuda': cuda is not available on this machine",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])  # fmt: skip
def test_pretrain_names_a_bad_option_before_any_work(tmp_path, args, message):
    out = tmp_path / "out"
    proc = run_pretrain(*args, "--out", str(out))
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_pretrain_replaces_a_pipeline_only_with_overwrite(tmp_path):
    """A pipeline in --out (the shipped model, without --out) is a finished pretraining: replaced only
    when asked, and refused before any work otherwise."""
    from stepfast.models.tiny import tiny_pipeline_dir

    model = tiny_pipeline_dir(tmp_path / "model", seed=0)
    before = {p: p.read_bytes() for p in model.rglob("*") if p.is_file()}
    proc = run_pretrain("--out", str(model))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"--out: {model} holds a pipeline already; give --overwrite to replace it" in proc.stderr
    assert {p: p.read_bytes() for p in model.rglob("*") if p.is_file()} == before
    assert "--overwrite" in run_pretrain("--help").stdout


def test_pretrain_refuses_to_replace_a_directory_that_is_not_a_pipeline(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("my notes\n")
    proc = run_pretrain("--out", str(notes))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"--out: {notes} exists and is not a diffusers pipeline directory" in proc.stderr
    assert [p.name for p in notes.iterdir()] == ["notes.txt"] and (notes / "notes.txt").read_text() == "my notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]  # no .tmp/.old written next to it


@pytest.mark.parametrize("out, extra, message", [
    ("{tmp}/file", [], "--out: {tmp}/file is a file, not a pipeline directory"),
    ("{tmp}/file/model", [], "--out: cannot create {tmp}/file/model: {tmp}/file is a file"),
    ("{tmp}/m", ["--snapshot-every", "1"], "--out: {tmp}/m-snapshots (where --snapshot-every writes"),
    ("{tmp}/notes", [], "--out: {tmp}/notes.tmp exists and is not a diffusers pipeline directory"),
    ("", [], "--out: an empty path (an unset shell variable?)"),
])  # fmt: skip
def test_pretrain_names_an_out_path_it_cannot_write_before_any_work(tmp_path, out, extra, message):
    (tmp_path / "file").write_text("keep\n")
    (tmp_path / "m-snapshots").write_text("keep\n")
    (tmp_path / "notes.tmp").mkdir()  # write_pipeline's working folder: it would be deleted
    (tmp_path / "notes.tmp" / "notes.txt").write_text("keep\n")
    before = {p: p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    proc = run_pretrain("--out", out.format(tmp=tmp_path), *extra)
    assert proc.returncode == 2
    assert message.format(tmp=tmp_path) in proc.stderr and "Traceback" not in proc.stderr
    assert {p: p.read_text() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "m-snapshots", "notes.tmp"]


def test_pretrain_names_a_snapshot_it_would_replace_before_any_work(tmp_path):
    """--snapshot-every writes OUT-snapshots/step-N: a folder there of something else is refused as
    --out is, and an earlier run's snapshot is replaced only with --overwrite (steps 1 and 2 of 3)."""
    notes = tmp_path / "m-snapshots" / "step-2"
    notes.mkdir(parents=True)
    (notes / "notes.txt").write_text("keep\n")
    proc = run_pretrain("--out", str(tmp_path / "m"), "--snapshot-every", "1", "--overwrite")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"--out: {notes} exists and is not a diffusers pipeline directory" in proc.stderr
    assert (notes / "notes.txt").read_text() == "keep\n"
    earlier = tmp_path / "p-snapshots" / "step-1"
    earlier.mkdir(parents=True)
    (earlier / "model_index.json").write_text("{}")
    proc = run_pretrain("--out", str(tmp_path / "p"), "--snapshot-every", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"--out: {earlier} holds a snapshot already (an earlier run's); give --overwrite" in proc.stderr
    assert (earlier / "model_index.json").read_text() == "{}" and not (tmp_path / "p").exists()
    pretrain.check_out(tmp_path / "p", snapshots=[1, 2], overwrite=True)  # asked for: no error
    pretrain.check_out(tmp_path / "p", snapshots=[2])  # step-1 is not written (--snapshot-every 2)


def test_pretrain_may_replace_an_empty_directory_a_pipeline_or_an_interrupted_write(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    (tmp_path / "pipe.tmp" / "transformer").mkdir(parents=True)  # save_pretrained cut short
    (tmp_path / "pipe-snapshots" / "step-1").mkdir(parents=True)
    for name in ("empty", "pipe", "new"):
        pretrain.check_out(tmp_path / name, snapshots=[1], overwrite=True)  # no error
    for name in ("empty", "new"):
        pretrain.check_out(tmp_path / name, snapshots=[1])  # nothing to overwrite
    (tmp_path / "pipe.tmp" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="pipe.tmp exists and is not a diffusers pipeline directory"):
        pretrain.check_out(tmp_path / "pipe", overwrite=True)


def test_ctrl_c_in_pretrain_is_one_line(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrain, "train_vae", interrupted)
    assert pretrain.cli([*TINY, "--out", str(tmp_path / "model"), "--device", "cpu"]) == 130
    err = capsys.readouterr().err
    assert err.endswith("\npython -m stepfast.pretrain: interrupted (--out is replaced only once the new model is "
                        "written whole; snapshots written so far are kept)\n") and "Traceback" not in err  # fmt: skip
    assert not (tmp_path / "model").exists()


def test_pretrain_encodes_its_prompts_as_the_shipped_model_was_built():
    """The shipped model was trained on the prompts encoded as one batch; the trainer encodes each
    text alone (its rows the same bits on any rank layout), which moves the pooled embeddings by a
    rounding. Pretraining keeps the one batch, so `--overwrite` still writes the shipped weights."""
    from stepfast import policy
    from stepfast.data.shapeeval import load_metadata

    pipe = load_pipeline(EMBEDDED_MODEL)
    prompts = [m["prompt"] for m in load_metadata("train")] + [""]  # what pretrain encodes
    embeds, pooled = pretrain.encode_prompts(pipe, prompts, "cpu")
    batch = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device="cpu",
                               do_classifier_free_guidance=False, max_sequence_length=policy.text_length(pipe))  # fmt: skip
    assert torch.equal(embeds, batch[0]) and torch.equal(pooled, batch[2])
    alone = policy.encode_prompts(pipe, prompts, cfg_scale=1.0, device="cpu")
    assert torch.allclose(pooled, alone.pooled, atol=1e-5)  # the same embeddings, but for rounding,
    assert not torch.equal(pooled, alone.pooled)  # which would change the weights the rebuild writes
    with pytest.raises(ValueError, match="repeats one"):
        pretrain.encode_prompts(pipe, ["a red circle", "a red circle"], "cpu")
