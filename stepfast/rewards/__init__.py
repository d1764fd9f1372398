"""Rewards: a registry of scorers with one batched interface.

    reward = stepfast.rewards.load("shapes")
    out = reward.score(images, prompts, metadata=None)   # dict[str, Tensor], always with "score"

`images` is a batch in any of the forms `stepfast.rewards.images.to_uint8` accepts (PIL images,
uint8 arrays [B, H, W, 3], float tensors [B, 3, H, W] in [0, 1] or [-1, 1]); `prompts` a list of
strings; `metadata` optional per-prompt dicts (GenEval metadata). Every value of the returned dict is
a tensor of shape [B]; "score" is the scalar reward the trainer maximises.

Rewards are looked up by name in REGISTRY ("module:attribute" strings, imported on first use so
that heavy dependencies load only when asked for), or given as an import path "pkg.module:attr" that
names a reward class, a factory, or a plain function `fn(images, prompts, metadata) -> dict | Tensor`.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any, Callable, Protocol

import torch

from stepfast.config import whole_number


class Reward(Protocol):
    def score(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]: ...


class PromptError(ValueError):
    """A prompt that a reward cannot score, raised by its `check(prompts, metadata)` before any image
    is drawn: `index` (from 0) in the prompts checked, `reason` what is wrong, `reward` the part of a
    weighted reward that refused it. A caller that knows where the prompts came from names the file
    and line instead of the index."""

    def __init__(self, index: int, reason: str, reward: str | None = None):
        self.index, self.reason, self.reward = index, reason, reward
        super().__init__(f"{self.by()}prompt {index + 1}: {reason}")

    def by(self) -> str:
        return f"reward {self.reward!r}: " if self.reward else ""


#: The options of registered rewards that name local files or folders: the trainer checks that they
#: are there before it starts (the reward itself says more when one is there but incomplete).
LOCAL_PATH_OPTIONS: dict[str, tuple[str, ...]] = {
    "pickscore": ("path", "processor_path"),
    "clipscore": ("path", "processor_path"),
    "aesthetic": ("path", "mlp_path", "processor_path"),
    "imagereward": ("path", "med_config", "tokenizer"),
    "ocr": ("model_dir",),
}

#: name -> "module:attribute" of a class or factory called with the reward's options (`register` may
#: also give the class or factory itself, for rewards defined in the running program).
REGISTRY: dict[str, str | Callable[..., Any]] = {
    "shapes": "stepfast.rewards.shapes:ShapesReward",
    "weighted": "stepfast.rewards.combine:WeightedReward",
    "pickscore": "stepfast.rewards.clip_rewards:PickScoreReward",
    "clipscore": "stepfast.rewards.clip_rewards:ClipScoreReward",
    "aesthetic": "stepfast.rewards.clip_rewards:AestheticReward",
    "imagereward": "stepfast.rewards.imagereward:ImageRewardReward",
    "ocr": "stepfast.rewards.ocr:OcrReward",
    "jpeg_compressibility": "stepfast.rewards.jpeg:JpegCompressibility",
    "jpeg_incompressibility": "stepfast.rewards.jpeg:JpegIncompressibility",
    "geneval_remote": "stepfast.rewards.geneval_remote:GenEvalRemoteReward",
    "remote": "stepfast.rewards.remote:RemoteReward",
    "vlm": "stepfast.rewards.vlm:VlmJudgeReward",
    "random": "stepfast.rewards.control:RandomReward",
}


def register(name: str, target: str | Callable[..., Any]) -> None:
    """Register a reward under `name`: an import path "module:attr" or a class/factory. The trainer
    checks the names it is given before it loads any reward: register before it starts (in the
    program that calls `stepfast.train.main`), not from a module that another reward imports."""
    REGISTRY[name] = target


def _import(path: str):
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"reward import path {path!r} must look like 'package.module:attribute'")
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"cannot import reward module {module!r} (from {path!r}): {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportError(f"module {module!r} has no attribute {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    return obj


class FunctionReward:
    """Adapts a plain function fn(images, prompts, metadata) -> dict | Tensor to the interface."""

    def __init__(self, fn: Callable[..., Any], name: str):
        self.fn, self.name = fn, name

    def score(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        out = self.fn(images, prompts, metadata)
        if not isinstance(out, dict):
            out = {"score": out}
        if "score" not in out:
            raise ValueError(f"reward {self.name!r} returned keys {sorted(out)} without 'score'")
        return {k: torch.as_tensor(v, dtype=torch.float32) for k, v in out.items()}


def _is_scorer(fn) -> bool:
    """True for a callable that can be called as a scoring function `fn(images, prompts, metadata)`
    (or whose signature cannot be read: some builtins); False for a factory."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(None, None, None)
    except TypeError:
        return False
    return True


def _check_options(name: str, build, options: dict) -> dict:
    """`options`, checked: a ValueError naming the reward and the options that its class or factory
    does not take, or whose value is not of the plain type it annotates (a whole number written as a
    float, 90.0, is taken for an int, as the configuration's integer keys take it)."""
    try:
        signature = inspect.signature(build)
    except (TypeError, ValueError):  # nothing to check against
        return options
    hints = _type_hints(build)
    try:
        signature.bind(**options)
    except TypeError as exc:
        shown = _signature_text(signature, hints)
        if not options and not isinstance(build, type):  # neither a scorer nor a factory without options
            raise ValueError(
                f"reward {name!r}: {shown} is not a scoring function fn(images, prompts, metadata), and as a "
                f"factory it needs options ({exc}): give them in reward.options"
            ) from None
        takes = [p for p, param in signature.parameters.items() if param.kind is not param.VAR_POSITIONAL]
        guesses = [
            f"{close[0]!r} for {key!r}"
            for key in options if key not in signature.parameters
            for close in [difflib.get_close_matches(key, takes, n=1, cutoff=0.6)] if close
        ]  # fmt: skip
        hint = f"; did you mean {', '.join(guesses)}?" if guesses else ""
        raise ValueError(f"reward {name!r}: options {sorted(options)} do not fit {shown}: {exc}{hint}") from None
    checked = dict(options)
    for key, value in options.items():
        kind, optional = _plain(hints.get(key))
        if kind is None or (optional and value is None):
            continue
        if kind is int and isinstance(value, float) and (whole := whole_number(value)) is not None:
            checked[key] = value = whole
        fits, what = _PLAIN[kind]
        if not fits(value):
            raise ValueError(f"reward {name!r}: option {key} must be {what}{' or null' if optional else ''}, "
                             f"got {value!r}")  # fmt: skip
    return checked


# the plain annotations an option's value is checked against (YAML reads 1 as an int: a float takes it)
_PLAIN = {
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "a whole number"),
    bool: (lambda v: isinstance(v, bool), "true or false"),
    str: (lambda v: isinstance(v, str), "text"),
}


def _plain(hint) -> tuple[type | None, bool]:
    """(the plain type of an annotation, whether it also takes None): `float` -> (float, False),
    `str | None` -> (str, True); (None, False) for any other annotation (not checked)."""
    import types
    import typing

    if hint in _PLAIN:
        return hint, False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1 and rest[0] in _PLAIN and len(typing.get_args(hint)) == 2:
            return rest[0], True
    return None, False


def _signature_text(signature: inspect.Signature, hints: dict) -> str:
    """`(threshold: float = 0.35, ...)`: the signature with its annotations resolved, where a module
    with `from __future__ import annotations` shows them quoted (`threshold: 'float' = 0.35`)."""
    params = [param.replace(annotation=hints.get(name, param.annotation)) for name, param in signature.parameters.items()]
    return str(signature.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _type_hints(build) -> dict:
    """The annotations of a reward class's __init__ or of a factory, resolved; {} when they cannot be."""
    import typing

    try:
        return typing.get_type_hints(build.__init__ if isinstance(build, type) else build)
    except Exception:  # an annotation naming what its module does not import: nothing to check against
        return {}


def check_name(name: str) -> None:
    """A ValueError for a name that is neither registered nor an import path "module:attr", with the
    registered name it is closest to: cheap, so callers check before anything slow starts."""
    if name in REGISTRY or ":" in name:
        return
    close = difflib.get_close_matches(name, list(REGISTRY), n=1, cutoff=0.6)
    raise ValueError(
        f"unknown reward {name!r}{f' (did you mean {close[0]!r}?)' if close else ''}: registered rewards are "
        f"{', '.join(sorted(REGISTRY))}; a custom reward is given as 'package.module:attribute'"
    )


def load(name: str, **options) -> Reward:
    """The reward registered as `name` (or at import path "module:attr"), built with `options`."""
    check_name(name)
    target = REGISTRY.get(name, name)
    obj = _import(target) if isinstance(target, str) else target
    # a factory: a function that cannot score (`make()`, `make(device="cpu")`, `make(path)`); it is
    # called even without options, whose fit is checked first (a missing one named, not a TypeError)
    factory = callable(obj) and not isinstance(obj, type) and not _is_scorer(obj)
    if callable(obj) and (options or isinstance(obj, type) or factory):
        options = _check_options(name, obj, options)
    if isinstance(obj, type):
        return obj(**options)
    if not callable(obj):
        raise TypeError(f"reward {name!r} resolves to {obj!r}, which is neither a class nor a function")
    if options or factory:  # called with the options, it must return a reward
        built = obj(**options)
        if not hasattr(built, "score"):
            raise TypeError(f"reward factory {name!r} returned {type(built).__name__}, which has no score()")
        return built
    return FunctionReward(obj, name)


def takes_option(name: str, option: str) -> bool:
    """Whether the class or factory of reward `name` takes the keyword `option` (False for a plain
    scoring function, or a name that does not resolve: `load` names that problem)."""
    target = REGISTRY.get(name, name if ":" in name else None)
    try:
        obj = _import(target) if isinstance(target, str) else target
        if obj is None or (not isinstance(obj, type) and _is_scorer(obj)):
            return False  # a scoring function takes no options
        return option in inspect.signature(obj).parameters
    except (ImportError, TypeError, ValueError):
        return False


def with_device(name: str, options: dict | None, device) -> dict:
    """`options` for reward `name`, with device=`device` added when its class or factory takes a
    device and the options do not set one: a model reward then runs where the policy runs (each
    rank's own GPU) instead of its default, the CPU. A device of "cuda" without an index is made this
    rank's GPU, so that the reward does not depend on which device the thread that builds or runs it
    has current (a new thread's is the first GPU, another rank's)."""
    options = expand_home(name, options)
    if takes_option(name, "device"):
        if "device" not in options:
            options["device"] = str(device)
        elif str(options["device"]) == "cuda" and torch.device(device).type == "cuda":
            options["device"] = str(device)
    return options


def expand_home(name: str, options: dict | None) -> dict:
    """`options` for reward `name` with `~` expanded in its local-path options (LOCAL_PATH_OPTIONS),
    as a shell would not in `reward.options.pickscore.path=~/models/...`."""
    import os

    options = dict(options or {})
    for key in LOCAL_PATH_OPTIONS.get(name, ()):
        value = options.get(key)
        if isinstance(value, str) and value.startswith("~"):  # (left as it is when there is no home)
            options[key] = os.path.expanduser(value)
    return options


def load_weighted(weights, options=None):
    """The rewards named in `weights`, summed with those weights (see `combine.WeightedReward`)."""
    from .combine import WeightedReward  # combine imports `load` from here

    return WeightedReward(weights, options)
