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
import logging
import warnings
from pathlib import Path

import torch

#: The shipped tiny SD3 pipeline (diffusers format), rebuilt by `python -m stepfast.pretrain`.
EMBEDDED_MODEL: str = str(Path(__file__).resolve().parent / "embedded")

#: The `_class_name`s of model_index.json that an SD3 pipeline directory may give.
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
    listed = [name for name, entry in spec.items()
              if not name.startswith("_") and isinstance(entry, list) and entry and entry[0] is not None]  # fmt: skip
    missing = [name for name in listed if not (path / name).is_dir()]
    if missing:
        raise ValueError(f"{path}: model_index.json lists {missing} but those subfolders are missing")
    incomplete = [f"{name}/ has no {lack}" for name in listed if (lack := _component_lack(path / name, name))]
    if incomplete:
        raise ValueError(f"{path}: a component is incomplete ({'; '.join(incomplete)}): a partial download or copy?")
    return path


#: The components an SD3 pipeline draws with, by the files diffusers and transformers load them from;
#: others a pipeline may hold (an IP-Adapter's image_encoder, its feature_extractor) are not checked.
_MODELS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.json", "spiece.model")


def _component_lack(folder: Path, name: str) -> str | None:
    """What a component folder of a pipeline lacks for it to load, or None: the scheduler its
    scheduler_config.json, a tokenizer any of its files, a model its config.json and weights (every
    shard its index names)."""
    if name == "scheduler":
        return None if (folder / "scheduler_config.json").is_file() else "scheduler_config.json"
    if name.startswith("tokenizer"):
        found = any((folder / f).is_file() for f in _TOKENIZER_FILES)
        return None if found else f"tokenizer files ({', '.join(_TOKENIZER_FILES)})"
    if name not in _MODELS:
        return None
    if not (folder / "config.json").is_file():
        return "config.json"
    # sharded weights: one index with every shard it names there will do (a folder may ship both a
    # .safetensors and a .bin index, and a download keep one format)
    lacks = []
    for index in sorted(folder.glob("*.index.json")):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            lacks.append(f"readable {index.name}")
            continue
        absent = sorted(f for f in shards if not (folder / f).is_file())
        if not absent:
            return None
        lacks.append(f"{absent[0]}{f' (and {len(absent) - 1} more shards)' if len(absent) > 1 else ''}, which "
                     f"{index.name} names")  # fmt: skip
    if lacks:
        return lacks[0]
    weights = [*folder.glob("*.safetensors"), *folder.glob("*.bin")]
    return None if weights else "weights (*.safetensors or *.bin)"


def load_pipeline(path: str | Path = EMBEDDED_MODEL, dtype: torch.dtype = torch.float32, device=None):
    """A StableDiffusion3Pipeline from the diffusers directory `path`, weights in `dtype`, on
    `device` (left on the CPU when None), all modules in eval mode with gradients off."""
    from diffusers import StableDiffusion3Pipeline

    path = check_pipeline_dir(path)
    try:
        pipe = StableDiffusion3Pipeline.from_pretrained(path, **_dtype_kwarg(dtype))
    except OSError as exc:  # a component folder without its config or weights, or a damaged file
        raise ValueError(f"cannot load the pipeline in {path}: {exc}") from exc
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        module = getattr(pipe, name, None)
        if module is not None:
            module.eval().requires_grad_(False)
    if device is not None:
        # diffusers warns that a float16 pipeline on the CPU "will fail": torch runs float16 on the CPU
        pipe.to(device, silence_dtype_warnings=True)
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


def check_device(name: str) -> torch.device:
    """`name` as a torch.device when this machine can run on it; a ValueError naming it otherwise
    (an unknown device string, CUDA on a machine without it, a CUDA index past the last GPU)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name!r} is not a torch device (expected cpu, cuda or cuda:N)") from None
    if device.type == "cpu":
        return device
    backends = {"cuda": torch.cuda, "mps": getattr(torch.backends, "mps", None), "xpu": getattr(torch, "xpu", None)}
    backend = backends.get(device.type)
    if backend is None:
        raise ValueError(f"{name!r}: device type {device.type!r} is not supported (expected cpu, cuda or cuda:N)")
    if not backend.is_available():
        built = " (this torch was built without CUDA)" if device.type == "cuda" and torch.version.cuda is None else ""
        raise ValueError(f"{name!r}: {device.type} is not available on this machine{built}; use cpu")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if device.index is not None and device.index >= count:
        raise ValueError(f"{name!r}: this machine has {count} {device.type} device(s) (indices 0-{count - 1})")
    return device


def lora_weights_file(path: str | Path) -> Path:
    """The .safetensors file of the LoRA weights at `path` (a directory written by
    `save_lora_weights`, or the file itself), checked by reading its header only (no weights):
    FileNotFoundError when `path` does not exist, ValueError naming it when it holds no LoRA."""
    path = Path(path)
    expected = ("expected a directory holding pytorch_lora_weights.safetensors, or that .safetensors file "
                "(StableDiffusion3Pipeline.save_lora_weights)")  # fmt: skip
    if not path.exists():
        raise FileNotFoundError(f"LoRA weights {path} do not exist")
    if path.is_dir():
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if "pytorch_lora_weights.safetensors" in files:
            file = path / "pytorch_lora_weights.safetensors"
        elif len(files) == 1:
            file = path / files[0]
        else:
            inside = (path / "lora" / "pytorch_lora_weights.safetensors").is_file() and not files
            hint = f" (a checkpoint? its LoRA is {path / 'lora'})" if inside else ""
            raise ValueError(f"LoRA directory {path} holds {files or 'no .safetensors files'}{hint}: {expected}")
    elif path.suffix == ".bin" and path.is_file():  # a pickled state dict: diffusers reads it
        return path
    elif path.suffix != ".safetensors":
        raise ValueError(f"LoRA weights {path} are not a .safetensors (or .bin) file: {expected}")
    else:
        file = path
    if not file.is_file():
        raise ValueError(f"LoRA weights {file} are not a file: {expected}")
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            keys = list(handle.keys())
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"LoRA weights {file} are not a readable .safetensors file ({exc}): {expected}") from None
    if not any("lora" in key for key in keys):
        shown = f"{len(keys)} tensors such as {keys[0]!r}" if keys else "no tensors"
        raise ValueError(f"{file} holds no LoRA weights ({shown}, none named '*lora*'): {expected}")
    return file


def load_lora(pipe, path: str | Path, adapter_name: str = "default"):
    """Load LoRA weights in diffusers format (`save_lora_weights`: a directory holding
    pytorch_lora_weights.safetensors, or that .safetensors file) onto `pipe`; returns `pipe`.
    FileNotFoundError when `path` does not exist, ValueError naming it when it is not such weights
    (see `lora_weights_file`, which checks that without a pipeline) or they do not fit `pipe`."""
    file = lora_weights_file(path)
    if not holds_adapter_config(file):
        where = "in its metadata" if file.suffix == ".safetensors" else "a pickled state dict has no metadata for it"
        warnings.warn(
            f"{file} holds no adapter config (lora_alpha, {where}): diffusers loads it with lora_alpha = "
            "its rank, which is not the trained scale when alpha was another (stepfast's checkpoints before it "
            "saved the config: alpha = 2 x rank, loaded at half the scale)", stacklevel=2,
        )  # fmt: skip
    names = _tensor_names(file)  # the tensors the check after loading expects placed
    # diffusers says, for each text encoder and the transformer, that the file holds no LoRA of it: a
    # transformer's adapter (stepfast's) never holds one of the text encoders, and a file whose
    # tensors reach no module is named below (_check_attached), the notice aside
    logs, quiet = [logging.getLogger(f"diffusers.loaders.{name}") for name in ("lora_base", "peft")], _NoLoraKeys()
    for log in logs:
        log.addFilter(quiet)
    attached = _lora_tensors(pipe)
    try:
        pipe.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name=adapter_name)
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        mismatched = [line.strip() for line in str(exc).splitlines() if line.strip().startswith("size mismatch")]
        if mismatched:  # torch lists every tensor; one says what is wrong
            raise ValueError(
                f"cannot load LoRA weights {file} onto this {type(pipe).__name__}: {len(mismatched)} of their "
                f"tensors {'has' if len(mismatched) == 1 else 'have'} other shapes than the model's, the first: "
                f"{mismatched[0]} Were they trained on another model?"
            ) from exc
        raise ValueError(f"cannot load LoRA weights {file} onto {type(pipe).__name__}: {exc}") from exc
    finally:
        for log in logs:
            log.removeFilter(quiet)
    _check_attached(file, names, _lora_tensors(pipe) - attached, type(pipe).__name__)
    return pipe


_PIPELINE_MODULES = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")


def _lora_tensors(pipe) -> int:
    """How many LoRA tensors (lora_A/lora_B weights, biases, DoRA magnitudes) the pipeline's
    transformer and text encoders hold."""
    modules = (getattr(pipe, name, None) for name in _PIPELINE_MODULES)
    return sum(sum(1 for name, _ in m.named_parameters() if "lora_" in name)
               for m in modules if isinstance(m, torch.nn.Module))  # fmt: skip


def _tensor_names(file: Path) -> list[str]:
    """The tensor names of a LoRA file: a .safetensors file's header, or a .bin state dict's keys."""
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    try:
        return list(torch.load(file, map_location="cpu", weights_only=True))
    except Exception as exc:  # noqa: BLE001 (a truncated or foreign pickle: any of pickle's and torch's errors)
        raise ValueError(f"cannot load LoRA weights {file}: not a readable state dict ({type(exc).__name__}: "
                         f"{exc})") from exc  # fmt: skip


def _check_attached(file: Path, names: list[str], attached: int, pipeline: str) -> None:
    """A ValueError when the LoRA tensors of `file` (named `names`) did not all reach a module:
    diffusers drops the keys it cannot place (another format, another model's modules) with at most
    a notice, and the pipeline would then sample as the base model does, or with part of the adapter."""
    keys = [k for k in names if "lora" in k and not k.endswith(".alpha")]  # kohya's alphas: scales
    if attached >= len(keys):
        return
    what, then = ("none of them", "as the base model does") if attached == 0 else (
        f"only {attached} of them", "with part of the adapter")
    raise ValueError(
        f"LoRA weights {file} hold {len(keys)} LoRA tensors, but {what} reached a module of this {pipeline} (keys "
        f"such as {keys[0]!r}): keys in another format (diffusers' is 'transformer.<module>.lora_A.weight', as "
        "StableDiffusion3Pipeline.save_lora_weights writes them), or for modules this model lacks (trained on "
        f"another model?). It would sample {then}"
    )


class _NoLoraKeys(logging.Filter):
    """Drops diffusers' notice that a LoRA file holds nothing for one of the pipeline's modules."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No LoRA keys associated to")


def holds_adapter_config(file: Path) -> bool:
    """Whether a LoRA file carries its adapter's config: a .safetensors file in its metadata (diffusers'
    `lora_adapter_metadata`, written by save_lora_weights(..., transformer_lora_adapter_metadata=));
    a pickled .bin state dict never does."""
    if file.suffix != ".safetensors":
        return False
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            return "lora_adapter_metadata" in (handle.metadata() or {})
    except Exception:  # noqa: BLE001 (an unreadable file: loading it names the problem)
        return True


TRANSFORMER_WEIGHTS = "diffusion_pytorch_model.safetensors"


def check_transformer_dir(path: str | Path) -> Path:
    """`path` as a Path when it holds a transformer in diffusers' format (config.json and
    diffusion_pytorch_model.safetensors, as a full fine-tuning checkpoint's `transformer/`);
    FileNotFoundError or ValueError naming it otherwise. Reads no weights."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"transformer directory {path} does not exist")
    if not path.is_dir():
        raise ValueError(f"transformer {path} is not a directory (expected config.json and {TRANSFORMER_WEIGHTS})")
    missing = [name for name in ("config.json", TRANSFORMER_WEIGHTS) if not (path / name).is_file()]
    sharded = (path / (TRANSFORMER_WEIGHTS.replace(".safetensors", ".safetensors.index.json"))).is_file()
    if missing and not (missing == [TRANSFORMER_WEIGHTS] and sharded):
        if (path / "transformer" / "config.json").is_file():  # a checkpoint of a full fine-tuning, or a pipeline
            hint = f" (a checkpoint or a pipeline? its transformer is {path / 'transformer'})"
        elif (path / "lora").is_dir() or (path / "pytorch_lora_weights.safetensors").is_file():
            lora = path / "lora" if (path / "lora").is_dir() else path
            hint = f" (it holds a LoRA, {lora}: load that as a LoRA, not as a transformer)"
        else:
            hint = ""
        raise ValueError(f"transformer directory {path} lacks {', '.join(missing)}{hint} (diffusers' format, as "
                         "a full fine-tuning checkpoint's transformer/ folder)")  # fmt: skip
    return path


def load_transformer(pipe, path: str | Path):
    """Replace `pipe`'s transformer with the one saved at `path` (diffusers' format), in the same
    dtype and on the same device, in eval mode with gradients off; returns `pipe`. FileNotFoundError
    or ValueError naming `path` when it is not such a transformer or does not fit `pipe`."""
    from diffusers import SD3Transformer2DModel

    path = check_transformer_dir(path)
    old = pipe.transformer
    try:
        new = SD3Transformer2DModel.from_pretrained(path, **_dtype_kwarg(old.dtype))
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        raise ValueError(f"cannot load the transformer in {path}: {exc}") from exc
    changed = sorted(k for k in set(new.config) | set(old.config)
                     if not k.startswith("_") and new.config.get(k) != old.config.get(k))  # fmt: skip
    if changed:
        raise ValueError(f"the transformer in {path} is not this pipeline's architecture (config differs in {changed})")
    pipe.transformer = new.to(old.device).eval().requires_grad_(False)
    return pipe
