"""What importing stepfast does to the process beyond defining its modules, and what a wheel of it
(`pip install .`) ships."""

import fnmatch
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_only_transformers_torchvision_fallback_notice_is_dropped():
    import stepfast  # noqa: F401 (installs the filter)

    logger = logging.getLogger("transformers.utils.import_utils")

    def kept(message: str) -> bool:
        return logger.filter(logger.makeRecord(logger.name, logging.WARNING, __file__, 1, message, None, None))

    assert not kept("`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil`")
    assert kept("Could not import module 'CLIPImageProcessor'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed gives the notice only without a GPU")
def test_deepspeeds_accelerator_notice_is_dropped_and_its_other_messages_kept():
    """Without a GPU DeepSpeed warned at every start that it set its accelerator to CPU; the trainer's
    first line says where it runs."""
    code = ("import stepfast; from deepspeed.accelerator import get_accelerator; from deepspeed.utils import logger; "
            "print(get_accelerator().device_name()); logger.warning('kept')")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == "cpu"
    assert "Setting accelerator to CPU" not in proc.stdout + proc.stderr and "kept" in proc.stdout


def test_loading_a_pipeline_module_prints_no_torchvision_notice():
    """diffusers' SD3 pipeline imports transformers' image processors: on a machine without
    torchvision the notice came on every start of the trainer and the evaluation."""
    code = "import stepfast, stepfast.models; from diffusers import StableDiffusion3Pipeline"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "requires torchvision" not in proc.stderr


def test_the_gpu_check_names_an_interpreter_without_stepfast_before_it_starts(tmp_path):
    """benchmarks/gpu_check.sh's trainer phases start `python stepfast/train.py` in subprocesses,
    which need an installed stepfast (stepfast.kernels is mapped from kernels/ by the install)."""
    python = tmp_path / "python"  # this interpreter without its site-packages: no stepfast installed
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["bash", str(root / "benchmarks" / "gpu_check.sh")], env={**os.environ, "PYTHON": str(python)},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"gpu_check: {python} cannot import stepfast.kernels (ModuleNotFoundError: " in proc.stderr
    assert "install stepfast into it first" in proc.stderr


def test_the_gpu_check_refuses_arguments_it_would_ignore():
    """It runs every CUDA check: `gpu_check.sh -k kernels` would have run them all, filter unread."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["bash", str(root / "benchmarks" / "gpu_check.sh"), "-k", "kernels"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("gpu_check: takes no arguments (got: -k kernels); it runs every CUDA check")


def _shipped(rel: Path, patterns: list[str]) -> bool:
    """Whether setuptools' package-data globs take `rel` (a path inside its package): '*' stays in one
    folder, as in glob, unlike fnmatch on a whole path."""
    return any(len(p.split("/")) == len(rel.parts) and all(map(fnmatch.fnmatchcase, rel.parts, p.split("/")))
               for p in patterns)  # fmt: skip


def test_a_wheel_ships_every_module_and_data_file_of_the_tree():
    """The suite runs on an editable install, which reads everything from the tree; a wheel holds only
    the packages and package-data pyproject.toml lists. Every Python module must sit in a listed
    package and every other file (configs, prompts, the embedded model) match a package-data pattern
    of the package that holds it, or `pip install .` leaves it out and only its users find out."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {pkg: ROOT / tool["package-dir"].get(pkg, pkg.replace(".", "/")) for pkg in tool["packages"]}
    built = ("__pycache__", ".pyc", ".so")  # bytecode, and the C++ extension setup.py builds into the wheel
    files = [f for folder in (ROOT / "stepfast", ROOT / "kernels") for f in folder.rglob("*")
             if f.is_file() and not any(part.endswith(built) for part in f.parts)]  # fmt: skip
    assert any(f.suffix == ".yaml" for f in files) and any("embedded" in f.parts for f in files)
    missing = []
    for f in files:
        holders = [(pkg, folder) for pkg, folder in folders.items() if f.is_relative_to(folder)]
        pkg, folder = max(holders, key=lambda h: len(h[1].parts), default=(None, None))
        if pkg is None:
            missing.append(f"{f.relative_to(ROOT)} (in no listed package)")
        elif f.suffix == ".py":
            if f.parent != folder:
                missing.append(f"{f.relative_to(ROOT)} (its folder is no listed package)")
        elif not _shipped(f.relative_to(folder), tool.get("package-data", {}).get(pkg, [])):
            missing.append(f"{f.relative_to(ROOT)} (no package-data pattern of {pkg})")
    assert not missing, "a wheel would leave out: " + "; ".join(missing)
