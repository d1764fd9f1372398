"""Pipelines: loading diffusers SD3 checkpoints, and the embedded model that ships in the repo.

    from stepfast.models import EMBEDDED_MODEL, load_pipeline, text_length
    pipe = load_pipeline(EMBEDDED_MODEL)                      # StableDiffusion3Pipeline, fp32, CPU
    images = pipe(prompts, max_sequence_length=text_length(pipe), ...).images

SD3 does not mask padding tokens, so a model sees its prompts padded to one fixed T5 length; the
embedded model was trained at `text_length(pipe)` tokens (diffusers' default of 256 would give it
prompts it never saw). Real SD3 checkpoints get diffusers' default.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

#: The shipped tiny SD3 pipeline (diffusers format), rebuilt by `python -m stepfast.pretrain`.
EMBEDDED_MODEL: str = str(Path(__file__).resolve().parent / "embedded")

#: Files of an SD3 pipeline directory that `from_pretrained` reads first.
_SD3_CLASSES = ("StableDiffusion3Pipeline",)
_DIFFUSERS_DEFAULT_TEXT_LENGTH = 256


def check_pipeline_dir(path: str | Path) -> Path:
    """`path` as a Path when it is a diffusers SD3 pipeline directory; a clear error otherwise."""
    path = Path(path)
    if not path.exists():
        hint = ""
        if path.resolve() == Path(EMBEDDED_MODEL):
            hint = "; rebuild it with `python -m stepfast.pretrain`"
        raise FileNotFoundError(f"pipeline directory {path} does not exist{hint}")
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is a file, not a diffusers pipeline directory")
    index = path / "model_index.json"
    if not index.is_file():
        raise ValueError(
            f"{path} is not a diffusers pipeline directory: it has no model_index.json "
            "(expected the output of StableDiffusion3Pipeline.save_pretrained)"
        )
    try:
        spec = json.loads(index.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{index}: malformed JSON ({exc.msg} at line {exc.lineno})") from None
    cls = spec.get("_class_name") if isinstance(spec, dict) else None
    if cls not in _SD3_CLASSES:
        raise ValueError(f"{index}: _class_name is {cls!r}, expected one of {list(_SD3_CLASSES)}")
    missing = [
        name
        for name in ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
        if isinstance(spec.get(name), list) and spec[name][0] is not None and not (path / name).is_dir()
    ]
    if missing:
        raise ValueError(f"{path}: model_index.json lists {missing} but those subfolders are missing")
    return path


def load_pipeline(path: str | Path = EMBEDDED_MODEL, dtype: torch.dtype = torch.float32, device=None):
    """A StableDiffusion3Pipeline from the diffusers directory `path`, weights in `dtype`, on
    `device` (left on the CPU when None), all modules in eval mode with gradients off."""
    from diffusers import StableDiffusion3Pipeline

    path = check_pipeline_dir(path)
    pipe = StableDiffusion3Pipeline.from_pretrained(path, **_dtype_kwarg(dtype))
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        module = getattr(pipe, name, None)
        if module is not None:
            module.eval().requires_grad_(False)
    if device is not None:
        pipe.to(device)
    return pipe


def _dtype_kwarg(dtype: torch.dtype) -> dict:
    """diffusers 0.42 renamed from_pretrained's torch_dtype to dtype (the old name warns)."""
    import diffusers

    major, minor = (int(v) for v in diffusers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (0, 42) else {"torch_dtype": dtype}


def text_length(pipe) -> int:
    """The T5 prompt length (`max_sequence_length`) to encode prompts at for this pipeline: the
    tokenizer's limit when it is below diffusers' default of 256 (the tiny models record the length
    they were trained at there), else 256."""
    tokenizer = getattr(pipe, "tokenizer_3", None)
    limit = getattr(tokenizer, "model_max_length", None) or _DIFFUSERS_DEFAULT_TEXT_LENGTH
    return int(min(limit, _DIFFUSERS_DEFAULT_TEXT_LENGTH))


def load_lora(pipe, path: str | Path, adapter_name: str = "default"):
    """Load LoRA weights in diffusers format (`save_lora_weights`: a directory holding
    pytorch_lora_weights.safetensors, or that .safetensors file) onto `pipe`; returns `pipe`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"LoRA weights {path} do not exist")
    if path.is_dir():
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if "pytorch_lora_weights.safetensors" in files:
            weight_name = "pytorch_lora_weights.safetensors"
        elif len(files) == 1:
            weight_name = files[0]
        else:
            raise ValueError(
                f"LoRA directory {path} holds {files or 'no .safetensors files'}: expected "
                "pytorch_lora_weights.safetensors (StableDiffusion3Pipeline.save_lora_weights)"
            )
        directory = path
    else:
        directory, weight_name = path.parent, path.name
    try:
        pipe.load_lora_weights(str(directory), weight_name=weight_name, adapter_name=adapter_name)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ValueError(f"cannot load LoRA weights {directory / weight_name} onto {type(pipe).__name__}: {exc}") from exc
    return pipe
