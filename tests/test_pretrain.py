"""`python -m stepfast.pretrain`, the command that rebuilds the embedded model, at a few steps: it
writes a pipeline that loads, the same seed writes the same weights, and a bad --vae is named."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stepfast import pretrain
from stepfast.models import EMBEDDED_MODEL, load_pipeline

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


def test_pretrain_reuses_a_vae_unchanged(tmp_path):
    out = pretrain.main([*TINY, "--out", str(tmp_path / "m"), "--device", "cpu", "--vae", str(EMBEDDED_MODEL)])
    reused, shipped = weights(out, "vae"), weights(EMBEDDED_MODEL, "vae")
    assert all(torch.equal(reused[k], shipped[k]) for k in shipped)


@pytest.mark.parametrize("vae, message", [
    ("{tmp}/nowhere", "--vae: pipeline directory {tmp}/nowhere does not exist"),
    ("{tmp}", "--vae: {tmp} is not a diffusers pipeline directory"),
])  # fmt: skip
def test_pretrain_names_a_bad_vae_directory_before_any_work(tmp_path, vae, message):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "stepfast.pretrain", "--vae", vae.format(tmp=tmp_path), "--out", str(out), *TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert message.format(tmp=tmp_path) in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
