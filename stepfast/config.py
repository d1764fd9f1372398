"""Training configuration: typed dataclasses, YAML presets, and `key=value` overrides.

    cfg = load_config("default", ["iterations=20", "rollout.group_size=8", "credit=flow_grpo"])

A preset is a YAML file in `stepfast/configs/` (by name) or any YAML path; overrides use dotted paths
into the dataclasses. A mistyped key is an error that names it and suggests the closest valid one; a
value of the wrong type is an error that names the key, the value and the expected type.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class ConfigError(ValueError):
    """A bad configuration: unknown key, wrong type, unreadable file."""


@dataclass
class ModelConfig:
    path: str = "embedded"  # a diffusers SD3 pipeline directory; "embedded" is the shipped tiny model
    dtype: str = "fp32"  # weights and compute of the frozen parts: fp32 | bf16 | fp16
    lora: bool = True  # LoRA adapters (peft) on `lora_targets`; false = full fine-tuning
    lora_rank: int = 32
    lora_alpha: int = 64
    # Flow-GRPO's targets: the attention projections of the SD3 transformer.
    lora_targets: list[str] = field(
        default_factory=lambda: [
            "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
            "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
        ]
    )  # fmt: skip
    gradient_checkpointing: bool = False
    attention: str = "sdpa"  # sdpa | xformers (when installed)


@dataclass
class SdeConfig:
    steps: int = 10  # T: denoising steps of a training rollout
    eta: float = 1.0  # ddim noise scale (std = eta s sqrt(1 - t))
    noise_level: float = 0.7  # flow_sde / cps noise level a
    # [start, end): SDE steps (trained, up to timestep_fraction); ODE elsewhere. None = all
    window: list[int] | None = None
    # train the first int(timestep_fraction x steps) steps only; the later ones are still sampled with
    # the SDE (Flow-GRPO's train.timestep_fraction: 0.99 never trains the last step)
    timestep_fraction: float = 1.0
    logprob: str = "gaussian"  # gaussian | cps
    min_std: float = 1e-4  # steps with a smaller std are deterministic: not trained


@dataclass
class RolloutConfig:
    prompts: str = "shapeeval:train"  # .txt, GenEval *_metadata.jsonl, or shapeeval:train|test
    balance_categories: bool = False  # equal share of groups per metadata `tag` (GenEval category)
    groups: int = 8  # G: prompts per iteration (over all ranks)
    group_size: int = 4  # N: samples per prompt
    same_latent: bool = True  # share the initial noise inside a group (stepwise needs it)
    cfg: float = 4.5  # classifier-free guidance scale while sampling (1 = off)
    resolution: int = 64
    substeps: int = 3  # T': Euler substeps of each clean-image estimate
    # states per transformer call in the clean estimates (0: all of a rank's at once, one call per
    # substep); bounds their memory, which grows with groups x group_size x sde.steps otherwise
    estimate_batch: int = 0
    micro_batch: int = 8  # samples per forward/backward (per rank)
    # latents per VAE call (images and clean estimates), every call padded to it so that an image's
    # pixels do not depend on its rank's share of the batch; lower it for large images
    decode_batch: int = 16


@dataclass
class CreditConfig:
    global_std: bool = False  # flow_grpo: std over the whole batch instead of the group
    adv_clip: float = 5.0
    eps: float = 1e-4
    balance: bool = True  # turning_point: balance positive and negative turning points
    # uniform | tempflow (TempFlow-GRPO's noise-aware weighting: each trained step's loss scaled by the
    # step's std, normalised to mean 1 over the trained steps); any credit
    step_weights: str = "uniform"


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup: int = 0  # iterations of linear LR warm-up
    grad_clip: float = 1.0
    clip_range: float = 1e-4  # PPO ratio clip
    beta: float = 0.0  # KL weight to the reference (adapter disabled)
    updates_per_iteration: int = 1  # optimizer steps per iteration (the batch split evenly)
    ema: float = 0.0  # EMA decay of the trainable weights (0 = off); used for evaluation
    zero_stage: int = 2  # DeepSpeed ZeRO stage: 1, 2 or 3
    precision: str = "fp32"  # fp32 | bf16 | fp16 for the trained transformer (DeepSpeed)
    # merged into the shipped configs/deepspeed/zero{stage}.json, e.g. CPU offload:
    # {zero_optimization: {offload_optimizer: {device: cpu}}}; the keys other settings own are refused
    deepspeed: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    weights: dict[str, float] = field(default_factory=lambda: {"shapes": 1.0})
    options: dict[str, dict] = field(default_factory=dict)  # per-reward options (paths, url, ...)
    batch_size: int = 256  # images per reward call
    async_scoring: bool = True  # score in a background thread while the estimates are computed


@dataclass
class EvalConfig:
    before_after: bool = True  # evaluate the base model before training and the result after it
    every: int = 0  # iterations between evaluations during training (0 = none)
    prompts: str = "shapeeval:test"
    # scores held-out samples, built with reward.options[<name>] when given; its "score", and its
    # "strict" (or GenEval's "strict_accuracy") where it has one
    reward: str = "shapes"
    seeds: int = 4
    min_images: int = 32  # more seeds for the prompts of a category with fewer images (0 = off)
    steps: int = 40
    cfg: float = 4.5
    limit: int = 0  # prompts evaluated (0 = all)
    batch_size: int = 64

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates at all (and so reads eval.prompts and eval.reward)."""
        return self.before_after or self.every > 0


@dataclass
class LogConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "stepfast"
    report: bool = True  # write the report folder at the end
    grid_prompts: int = 8  # prompts in the before/after sample grids


@dataclass
class Config:
    iterations: int = 30
    output_dir: str = "runs/default"
    resume: str = "none"  # none | auto | a checkpoint directory
    seed: int = 0
    credit: str = "stepwise"  # flow_grpo | stepwise | stepwise_per_step | turning_point
    sampler: str = "ddim"  # flow_sde | cps | ddim (ode, deterministic, has nothing to train)
    checkpoint_every: int = 10  # iterations between checkpoints (0 = only at the end)
    keep_checkpoints: int = 2
    model: ModelConfig = field(default_factory=ModelConfig)
    sde: SdeConfig = field(default_factory=SdeConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    credit_opts: CreditConfig = field(default_factory=CreditConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _type_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class _Loader(yaml.SafeLoader):
    """YAML as PyYAML reads it, except that 1e-5 and 5e8 are numbers (YAML 1.2), not strings: inside
    free-form mappings (optim.deepspeed, reward.options) no field type converts them afterwards; and a
    key given twice in one mapping is an error (PyYAML keeps the last in silence)."""

    def construct_mapping(self, node, deep=False):
        # the mapping's own keys, as written (merge keys `<<` bring in keys meant to be overridden)
        seen = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            written = (key_node.tag, key_node.value)
            if written in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"found the key {key_node.value!r} twice (first on line {seen[written] + 1})", key_node.start_mark,
                )  # fmt: skip
            seen[written] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """Writes what `_Loader` reads back the same: a string such as "1e3" is quoted."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)


def yaml_problem(exc: yaml.YAMLError, where: str = "line") -> str:
    """A YAML error in one line, where PyYAML gives several and names the text "<unicode string>":
    `line 3, column 1: expected the node content, but found '<stream end>'`. `where="column"` leaves
    the line out (an override's value is one line)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None)
    if mark is None or problem is None:
        return " ".join(str(exc).split())
    at = f"column {mark.column + 1}" if where == "column" else f"line {mark.line + 1}, column {mark.column + 1}"
    return f"{at}: {problem}"


def to_yaml(cfg) -> str:
    """The configuration as YAML that `load_config` reads back to the same configuration."""
    return yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False)


def changed_settings(before: Config, after: Config, ignore=("iterations", "resume", "output_dir")) -> list[str]:
    """The settings `after` gives otherwise than `before`, one `key: old -> new` each, in the order
    of the configuration, apart from `ignore` (those a resumed run changes as a matter of course)."""
    pairs = ((key, _get_dotted(before, key), _get_dotted(after, key)) for key in _dotted_keys() if key not in ignore)
    return [f"{key}: {shown(old)} -> {shown(new)}" for key, old, new in pairs if old != new]


def shown(value) -> str:
    """A setting's value as YAML writes it inline (null, [0, 9], 0.001, shapeeval:train)."""
    text = yaml.dump(value, Dumper=_Dumper, default_flow_style=True, width=10**6)
    return text.strip().removesuffix("...").strip()


#: Flow-GRPO's names (config/base.py) for settings stepfast names otherwise, by the name's last part:
#: (Flow-GRPO's key, stepfast's). A researcher coming from it types these first.
FLOW_GRPO_NAMES = {
    "learning_rate": ("train.learning_rate", "optim.lr"),
    "adam_beta1": ("train.adam_beta1", "optim.betas"),
    "adam_beta2": ("train.adam_beta2", "optim.betas"),
    "adam_weight_decay": ("train.adam_weight_decay", "optim.weight_decay"),
    "max_grad_norm": ("train.max_grad_norm", "optim.grad_clip"),
    "adv_clip_max": ("train.adv_clip_max", "credit_opts.adv_clip"),
    "timestep_fraction": ("train.timestep_fraction", "sde.timestep_fraction"),
    "sde_window_range": ("sample.sde_window_range", "sde.window"),
    "num_steps": ("sample.num_steps", "sde.steps"),
    "eval_num_steps": ("sample.eval_num_steps", "eval.steps"),
    "guidance_scale": ("sample.guidance_scale", "rollout.cfg"),
    "eval_guidance_scale": ("sample.eval_guidance_scale", "eval.cfg"),
    "num_image_per_prompt": ("sample.num_image_per_prompt", "rollout.group_size"),
    "batch_size": ("train.batch_size", "rollout.micro_batch"),
    "train_batch_size": ("sample.train_batch_size", "rollout.micro_batch"),
    "num_epochs": ("num_epochs", "iterations"),
    "resume_from": ("resume_from", "resume"),
    "logdir": ("logdir", "output_dir"),
    "save_freq": ("save_freq", "checkpoint_every"),
    "eval_freq": ("eval_freq", "eval.every"),
    "num_checkpoint_limit": ("num_checkpoint_limit", "keep_checkpoints"),
    "mixed_precision": ("mixed_precision", "optim.precision"),
    "use_lora": ("use_lora", "model.lora"),
    "pretrained": ("pretrained.model", "model.path"),
    "dataset": ("dataset", "rollout.prompts"),
    "prompt_fn": ("prompt_fn", "rollout.prompts"),
    "reward_fn": ("reward_fn", "reward.weights"),
}


@functools.cache
def _dotted_keys(cls=None, prefix: str = "") -> tuple[str, ...]:
    """Every setting of the configuration as its dotted key (`rollout.group_size`)."""
    cls = Config if cls is None else cls
    keys: list[str] = []
    for name, hint in _type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            keys += _dotted_keys(hint, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return tuple(keys)


def _settings_named(leaf: str, typed: str, section: str = "") -> list[str]:
    """The settings a key ending in `leaf` may mean, as a suggestion writes them: Flow-GRPO's name
    for one (in `section` "eval" its `eval_` names, `eval.num_steps` -> `eval.steps`), then every
    setting whose key ends in `leaf` (`group_size` -> `rollout.group_size`); failing both, the
    Flow-GRPO name `leaf` is nearly spelt as. `typed`: the key as given, never suggested back."""
    ours = [k for k in _dotted_keys() if k.rsplit(".", 1)[-1] == leaf]
    theirs = next((n for n in (f"eval_{leaf}" if section == "eval" else leaf, leaf) if n in FLOW_GRPO_NAMES), None)
    if theirs is None and not ours:  # a name of ours typed in the wrong place is not a misspelt one of theirs
        theirs = next(iter(difflib.get_close_matches(leaf, list(FLOW_GRPO_NAMES), n=1, cutoff=0.8)), None)
    found = [f"{FLOW_GRPO_NAMES[theirs][1]!r} (Flow-GRPO's {FLOW_GRPO_NAMES[theirs][0]})"] if theirs else []
    if section != "eval" or not found:
        found += [repr(k) for k in ours if k != typed and not (theirs and k == FLOW_GRPO_NAMES[theirs][1])]
    return found


def _suggest(key: str, options, prefix: str = "", rest: list[str] | None = None) -> str:
    """'; did you mean <prefix><closest>?' (the full dotted key), or the valid keys of the section.
    With `rest` (`options` are the fields of a section of Config, `rest` the parts of the dotted key
    typed after `key`), the setting meant comes first: a misspelt section's (`evl.steps`), one of the
    name typed in another section (`group_size`, or `sample.noise_level` in Flow-GRPO's sections) or
    Flow-GRPO's name for a setting, unless a key of this section is spelt nearly alike."""
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    near = difflib.get_close_matches(key, list(options), n=1, cutoff=0.8)  # spelt nearly alike
    if rest is not None:
        typed = ".".join([prefix + key, *rest])
        if rest:  # key names a section
            if near and (fixed := ".".join([prefix + near[0], *rest])) in _dotted_keys():
                return f"; did you mean {fixed!r}?"
            if found := _settings_named(rest[-1], typed, key):  # one of Flow-GRPO's (sample.num_steps)
                return "; did you mean " + " or ".join(found) + "?"
        found = _settings_named(key, typed, prefix.rstrip("."))
        if found and not near:
            return "; did you mean " + " or ".join(found) + "?"
    names = ", ".join(sorted(set(options)))
    return f"; did you mean {prefix + close[0]!r}?" if close else f"; valid keys: {names}"


def _next_keys(section: dict) -> list[str]:
    """The first key of a section given whole, which names the setting meant (`sample: {num_steps:
    10}`), as `_suggest`'s `rest`; none when it is not text."""
    return [key for key in section if isinstance(key, str)][:1]


def whole_number(value: float) -> int | None:
    """`value` as an int when it is a whole number below 2**53 (where every integer is a float exactly,
    so it is the integer typed: 1e3 is 1000), else None. Integer keys, and a reward's integer
    options, take such a float."""
    return int(value) if value.is_integer() and abs(value) < 2**53 else None


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """`value` checked against the annotation `tp` (ints widen to floats); ConfigError otherwise."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        kt, vt = args if args else (Any, Any)
        return {_coerce(k, kt, where): _coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is int and isinstance(value, float):  # iterations=1e3, which YAML reads as a float
        if (whole := whole_number(value)) is not None:
            return whole
        raise ConfigError(f"{where}: expected a whole number{' below 2**53' if value.is_integer() else ''}, "
                          f"got {value!r}")  # fmt: skip
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r} ({type(value).__name__})")
    return value


def _apply(obj, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    fields = _fields(type(obj))
    hints = _type_hints(type(obj))
    for key, value in data.items():
        where = f"{prefix}{key}"
        if not isinstance(key, str):
            raise ConfigError(f"config key {where!r} is {type(key).__name__}, not text: keys are names of settings")
        if key not in fields:
            rest = _next_keys(value) if isinstance(value, dict) else []  # a section given whole
            raise ConfigError(f"unknown config key {where!r}{_suggest(key, fields, prefix, rest=rest)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _apply(current, value, f"{where}.")
        else:
            setattr(obj, key, _coerce(value, hints[key], where))


def _set_dotted(cfg: Config, dotted: str, value: Any, raw: str | None = None) -> None:
    """cfg.<dotted> = value. `raw`: the text typed on the command line, kept as it is for a key that
    holds text when YAML read it as something else that is not a list or a mapping: a number, a
    boolean, a date (output_dir=1e-3, output_dir=2024-06-01)."""
    obj = cfg
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = _fields(type(obj))
        where = ".".join(parts[: i + 1])
        if part not in fields:
            rest = parts[i + 1 :] or (_next_keys(value) if isinstance(value, dict) else [])
            raise ConfigError(f"unknown config key {where!r}{_suggest(part, fields, where[: -len(part)], rest=rest)}")
        if i == len(parts) - 1:
            current = getattr(obj, part)
            if dataclasses.is_dataclass(current):
                _apply(current, value, f"{where}.")
            else:
                hint = _type_hints(type(obj))[part]
                if raw is not None and hint is str and value is not None and not isinstance(value, (str, list, dict)):
                    value = raw.strip()
                setattr(obj, part, _coerce(value, hint, where))
        else:
            current = getattr(obj, part)
            if isinstance(current, dict):  # into a mapping (reward.options.pickscore.device=...)
                # a reward named by import path has dots of its own (reward.options.pkg.mod:Cls.device)
                names = set(current) | ({*cfg.reward.weights, cfg.eval.reward} if obj is cfg.reward else set())
                # a name it knows, else one given by import path (its module's dots joined back); under a
                # known name, an option's key that is such a name too (remote's weights.pkg.mod:Cls)
                known = _split_known(parts[i + 1 :], names)
                keys = known[:2] + _split_import_path(known[2:]) if known else _split_import_path(parts[i + 1 :])
                new = _set_in(current, keys, value, where)
                setattr(obj, part, _coerce(new, _type_hints(type(obj))[part], where))
                return
            if not dataclasses.is_dataclass(current):
                raise ConfigError(f"config key {where!r} is a value, not a section")
            obj = current


def _split_import_path(keys: list[str]) -> list[str]:
    """`keys` with the parts of an import path "pkg.mod:attr" joined back (up to the part that holds
    the colon): reward.options.pkg.mod:Cls.device -> [pkg.mod:Cls, device]; unchanged without one."""
    for j, key in enumerate(keys):
        if ":" in key:
            return [".".join(keys[: j + 1]), *keys[j + 1 :]]
    return keys


def _split_known(keys: list[str], names) -> list[str] | None:
    """`keys` with its first ones joined back into the longest of `names` they spell; None if they
    spell none."""
    joined = ".".join(keys)
    for name in sorted(names, key=len, reverse=True):
        if joined == name or joined.startswith(name + "."):
            rest = joined[len(name) + 1 :]
            return [name] + (rest.split(".") if rest else [])
    return None


def _set_in(mapping: dict, keys: list[str], value: Any, where: str) -> dict:
    """A copy of `mapping` with mapping[k1][k2]...[kn] = value, the other entries kept."""
    out = copy.deepcopy(mapping)
    inner = out
    for depth, key in enumerate(keys[:-1]):
        inner = inner.setdefault(key, {})
        if not isinstance(inner, dict):
            raise ConfigError(f"config key {where}.{'.'.join(keys[: depth + 1])} holds {inner!r}, not a mapping")
    inner[keys[-1]] = value
    return out


def preset_path(name: str) -> Path:
    """The YAML file `--config NAME` names: a file, else a shipped preset by its name, or by
    `configs/NAME.yaml` (as the presets are laid out in the package: `stepfast/configs/NAME.yaml`)."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or "/" in name:
        if path.is_file():
            return path
        if path.parent == Path("configs") and (CONFIG_DIR / path.name).is_file():
            return CONFIG_DIR / path.name
        if not (CONFIG_DIR / f"{name}.yaml").exists():
            what = "is a directory" if path.is_dir() else "does not exist"
            if (CONFIG_DIR / path.name).is_file():
                what += f"; the preset of that name is --config {path.stem}"
            raise ConfigError(f"config file {name!r} {what}")
    candidate = CONFIG_DIR / f"{name}.yaml"
    if candidate.exists():
        return candidate
    presets = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    close = difflib.get_close_matches(name, presets, n=1, cutoff=0.6)
    hint = f"; did you mean --config {close[0]}?" if close else ""
    raise ConfigError(f"no config {name!r}: not a YAML file, and the presets are {', '.join(presets)}{hint}")


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` as (key, value), the value read as YAML (1.2 numbers)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key=value (dotted keys, e.g. optim.lr=1e-4)")
    key, _, raw = text.partition("=")
    try:
        value = _yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: cannot parse the value: {yaml_problem(exc, 'column')}") from None
    return key.strip(), value


def load_config(preset: str | None = "default", overrides: list[str] | None = None) -> Config:
    """The preset (a name in stepfast/configs or a YAML path) with `key=value` overrides applied."""
    cfg = Config()
    if preset:
        path = preset_path(preset)
        try:
            data = _yaml(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: malformed YAML: {yaml_problem(exc)}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
        try:
            _apply(cfg, data)
        except ConfigError as exc:  # the key is the file's, not an override's
            raise ConfigError(f"{path}: {exc}") from None
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(cfg, key, value, raw=text.partition("=")[2])
    _expand_home(cfg)
    validate(cfg)
    return cfg


#: The keys that name a file or folder: `~` there is the home folder, as a shell expands it in
#: `output_dir=~/runs` but not in `model.path=~/models` (it expands only a word's start).
PATH_KEYS = ("output_dir", "resume", "model.path", "rollout.prompts", "eval.prompts")


def _expand_home(cfg: Config) -> None:
    for key in PATH_KEYS:
        value = _get_dotted(cfg, key)
        if isinstance(value, str) and value.startswith("~"):  # (left as it is when there is no home)
            _set_dotted(cfg, key, os.path.expanduser(value))


#: The choices of the enumerated keys (config imports nothing of stepfast; a test checks that these
#: names match stepfast.sde.SAMPLERS and stepfast.credit.ESTIMATORS).
SAMPLERS = ("ode", "flow_sde", "cps", "ddim")
CREDIT_ESTIMATORS = ("flow_grpo", "stepwise", "stepwise_per_step", "turning_point")
LOGPROB_CONVENTIONS = ("gaussian", "cps")
STEP_WEIGHTS = ("uniform", "tempflow")


# DeepSpeed settings that come from other keys (stepfast.engine.deepspeed_config fills them in)
DEEPSPEED_KEYS_OWNED = {
    ("train_micro_batch_size_per_gpu",): "rollout.micro_batch",
    ("train_batch_size",): "rollout.micro_batch (and the backward passes of an iteration)",
    ("gradient_accumulation_steps",): "the backward passes of an iteration / optim.updates_per_iteration",
    ("gradient_clipping",): "optim.grad_clip",
    ("bf16", "enabled"): "optim.precision",
    ("fp16", "enabled"): "optim.precision",
    ("optimizer",): "optim.lr, optim.betas and optim.weight_decay (torch's AdamW)",
    ("scheduler",): "optim.warmup",
    ("zero_optimization", "stage"): "optim.zero_stage",
}


def _get_dotted(cfg: Config, dotted: str) -> Any:
    """cfg.<dotted> (a dotted key of the dataclasses, such as "optim.precision")."""
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def validate(cfg: Config) -> None:
    """A ConfigError naming the first key whose value cannot run, with what it must be."""
    _check_choices(cfg)
    _check_numbers(cfg)
    _check_model_and_rewards(cfg)
    _check_not_empty(cfg)
    _check_deepspeed(cfg)
    # The paths (output_dir, a resume checkpoint) are checked where the run starts
    # (stepfast.startup.check_before_start), not here: a config is also read to print or to rebuild a
    # report, on machines where those paths need not exist.


def _check_choices(cfg: Config) -> None:
    """Keys that name one of a fixed set (sampler, credit, dtypes, ZeRO stage)."""
    trainable = tuple(s for s in SAMPLERS if s != "ode")
    if cfg.sampler == "ode":
        raise ConfigError(f"sampler: 'ode' is deterministic, so no step has a log-probability to train (evaluation "
                          f"samples with it); choose one of {', '.join(trainable)}")  # fmt: skip
    choices = {
        "sampler": trainable,  # a guess at a mistyped name offers only what can train
        "credit": CREDIT_ESTIMATORS,
        "sde.logprob": LOGPROB_CONVENTIONS,
        "credit_opts.step_weights": STEP_WEIGHTS,
        "model.dtype": ("fp32", "bf16", "fp16"),
        "optim.precision": ("fp32", "bf16", "fp16"),
        "model.attention": ("sdpa", "xformers"),
    }
    for key, allowed in choices.items():
        value = _get_dotted(cfg, key)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), list(allowed), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}{hint}")
    if cfg.optim.zero_stage not in (1, 2, 3):
        raise ConfigError(f"optim.zero_stage: {cfg.optim.zero_stage} is not 1, 2 or 3")


#: Credits whose statistics are over a group's members only (per step or per trajectory).
GROUP_RELATIVE_CREDITS = ("flow_grpo", "stepwise_per_step", "turning_point")


def _check_numbers(cfg: Config) -> None:
    """Counts, rates and scales: their signs, finiteness and the samplers' ranges."""
    positive = {
        "iterations": cfg.iterations, "rollout.groups": cfg.rollout.groups,
        "rollout.group_size": cfg.rollout.group_size, "rollout.substeps": cfg.rollout.substeps,
        "rollout.micro_batch": cfg.rollout.micro_batch, "rollout.resolution": cfg.rollout.resolution,
        "rollout.decode_batch": cfg.rollout.decode_batch,
        "sde.steps": cfg.sde.steps, "optim.updates_per_iteration": cfg.optim.updates_per_iteration,
        "keep_checkpoints": cfg.keep_checkpoints, "reward.batch_size": cfg.reward.batch_size,
        "eval.seeds": cfg.eval.seeds, "eval.steps": cfg.eval.steps, "eval.batch_size": cfg.eval.batch_size,
        "log.grid_prompts": cfg.log.grid_prompts,
    }  # fmt: skip
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    non_negative = {
        "seed": cfg.seed, "checkpoint_every": cfg.checkpoint_every, "eval.every": cfg.eval.every,
        "eval.limit": cfg.eval.limit, "eval.min_images": cfg.eval.min_images, "optim.warmup": cfg.optim.warmup,
        "optim.lr": cfg.optim.lr,
        "optim.weight_decay": cfg.optim.weight_decay, "optim.grad_clip": cfg.optim.grad_clip,
        "optim.beta": cfg.optim.beta, "sde.min_std": cfg.sde.min_std, "sde.eta": cfg.sde.eta,
        "rollout.estimate_batch": cfg.rollout.estimate_batch,
        "sde.noise_level": cfg.sde.noise_level, "rollout.cfg": cfg.rollout.cfg, "eval.cfg": cfg.eval.cfg,
        "credit_opts.adv_clip": cfg.credit_opts.adv_clip, "credit_opts.eps": cfg.credit_opts.eps,
    }  # fmt: skip
    for key, value in non_negative.items():
        if not value >= 0:  # also catches NaN
            raise ConfigError(f"{key} must be >= 0, got {value}")
    # inf is no limit for the clips; for these it would make every sample or step NaN
    finite = {"optim.lr": cfg.optim.lr, "optim.weight_decay": cfg.optim.weight_decay, "optim.beta": cfg.optim.beta,
              "sde.eta": cfg.sde.eta, "sde.noise_level": cfg.sde.noise_level, "sde.min_std": cfg.sde.min_std,
              "rollout.cfg": cfg.rollout.cfg, "eval.cfg": cfg.eval.cfg,
              **{f"reward.weights.{k}": v for k, v in cfg.reward.weights.items()}}  # fmt: skip
    for key, value in finite.items():
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
    # every advantage would be 0 (adv_clip 0, eps inf), or 0/0 = NaN in a group of equal rewards (eps 0)
    if not cfg.credit_opts.adv_clip > 0:
        raise ConfigError(f"credit_opts.adv_clip must be > 0 (0 clips every advantage to 0: nothing trains), got "
                          f"{cfg.credit_opts.adv_clip}")  # fmt: skip
    if not (cfg.credit_opts.eps > 0 and math.isfinite(cfg.credit_opts.eps)):
        raise ConfigError(f"credit_opts.eps must be a finite number > 0 (it keeps a group of equal rewards from "
                          f"dividing 0 by 0), got {cfg.credit_opts.eps}")  # fmt: skip
    if cfg.seed >= 2**63:
        raise ConfigError(f"seed must be below 2**63 (a 64-bit generator seed), got {cfg.seed}")
    if cfg.sampler == "cps" and cfg.sde.noise_level > 1:
        raise ConfigError(f"sde.noise_level must be at most 1 with sampler=cps (std = s sin(a pi / 2) peaks at a = 1), "
                          f"got {cfg.sde.noise_level}")  # fmt: skip
    if cfg.sde.eta > 1:
        raise ConfigError(f"sde.eta must be at most 1 (std = eta s sqrt(1 - t) must not exceed s), got {cfg.sde.eta}")
    if not cfg.optim.clip_range > 0:
        raise ConfigError(f"optim.clip_range must be > 0, got {cfg.optim.clip_range}")
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {cfg.optim.betas}")
    if cfg.sde.window is not None:
        w = cfg.sde.window
        if len(w) != 2 or not 0 <= w[0] < w[1] <= cfg.sde.steps:
            raise ConfigError(f"sde.window must be [start, end) with 0 <= start < end <= {cfg.sde.steps}, got {w}")
    if not 0 < cfg.sde.timestep_fraction <= 1:
        raise ConfigError(f"sde.timestep_fraction must be in (0, 1], got {cfg.sde.timestep_fraction}")
    if not 0 <= cfg.optim.ema < 1:
        raise ConfigError(f"optim.ema must be in [0, 1), got {cfg.optim.ema}")
    if cfg.rollout.group_size == 1 and cfg.credit in GROUP_RELATIVE_CREDITS:
        raise ConfigError(
            f"credit={cfg.credit} compares the members of a group, and rollout.group_size=1 leaves each "
            "sample alone in its group: every advantage would be 0 and nothing would train; give "
            "rollout.group_size >= 2 (credit=stepwise normalises over a group's steps as well)"
        )


def _check_model_and_rewards(cfg: Config) -> None:
    """The LoRA adapter's settings, the rewards and their options, and the KL's reference."""
    if cfg.model.lora:
        if cfg.model.lora_rank < 1:
            raise ConfigError(f"model.lora_rank must be >= 1, got {cfg.model.lora_rank}")
        if not cfg.model.lora_alpha > 0:
            raise ConfigError(f"model.lora_alpha must be > 0 (the adapter's scale is alpha / rank), got "
                              f"{cfg.model.lora_alpha}")  # fmt: skip
        if not cfg.model.lora_targets:
            raise ConfigError("model.lora_targets is empty: name the modules to adapt, or set model.lora=false")
    if not cfg.reward.weights:
        raise ConfigError("reward.weights is empty: give at least one reward, e.g. reward.weights={shapes: 1.0}")
    if not any(cfg.reward.weights.values()):
        raise ConfigError(f"reward.weights are all 0 ({', '.join(cfg.reward.weights)}): every reward, so every "
                          "advantage, would be 0 and nothing would train")  # fmt: skip
    unused = sorted(set(cfg.reward.options) - set(cfg.reward.weights) - {cfg.eval.reward})
    if unused:
        names = [*cfg.reward.weights, cfg.eval.reward]
        raise ConfigError(
            f"reward.options.{unused[0]}: {unused[0]!r} is neither a reward in reward.weights nor eval.reward"
            f"{_suggest(unused[0], names, 'reward.options.')}"
        )
    if cfg.optim.beta > 0 and not cfg.model.lora:
        raise ConfigError(
            "optim.beta > 0 (the KL penalty) needs model.lora=true: the reference policy is the model "
            "with its adapter disabled"
        )


def _check_not_empty(cfg: Config) -> None:
    """Paths and names that an unset shell variable would leave empty."""
    evaluated = ("eval.prompts", "eval.reward") if cfg.eval.enabled else ()
    for key in ("resume", "model.path", "rollout.prompts", *evaluated):
        if not str(_get_dotted(cfg, key)).strip():
            raise ConfigError(f"{key} is empty (an unset variable?)")
    if not str(cfg.output_dir).strip():
        raise ConfigError("output_dir is empty (an unset variable?): give the folder the run writes to")


def _check_deepspeed(cfg: Config) -> None:
    """optim.deepspeed: no key that another setting owns, and what the EMA cannot follow."""
    for keys, owner in DEEPSPEED_KEYS_OWNED.items():
        section = cfg.optim.deepspeed
        for depth, key in enumerate(keys):
            if key in section and depth == len(keys) - 1:
                raise ConfigError(f"optim.deepspeed.{'.'.join(keys)} is set by {owner}; set that instead")
            if key not in section:
                break
            if not isinstance(section[key], dict):
                raise ConfigError(f"optim.deepspeed.{'.'.join(keys[: depth + 1])} must be a mapping "
                                  f"(it holds {'.'.join(keys[depth + 1:])}), got {section[key]!r}")  # fmt: skip
            section = section[key]
    zero = cfg.optim.deepspeed.get("zero_optimization")
    offload_param = zero.get("offload_param") if isinstance(zero, dict) else None
    if offload_param is not None and not isinstance(offload_param, dict):
        raise ConfigError(f"optim.deepspeed.zero_optimization.offload_param must be a mapping (e.g. {{device: cpu}}), "
                          f"got {offload_param!r}")  # fmt: skip
    offload = (offload_param or {}).get("device")
    if cfg.optim.ema > 0 and cfg.optim.zero_stage == 3 and offload == "nvme":
        raise ConfigError(
            "optim.ema with ZeRO-3 weights offloaded to NVMe (optim.deepspeed.zero_optimization.offload_param."
            "device=nvme) is not supported: each rank averages its partitions in memory; offload them to the "
            "cpu, or set optim.ema=0"
        )


def config_warnings(cfg: Config, trained: list[int] | None = None) -> list[str]:
    """Settings that run but are probably not what was meant, one sentence each (the trainer prints
    them at start). `trained`: the steps the update trains (stepfast.grpo.trained_steps), when known."""
    out = []
    last = cfg.sde.steps - 1
    if trained and last in trained and last > 0:
        fix = ("set sde.timestep_fraction=0.99 (as the flow_grpo preset does: the step is still sampled with "
               "noise) or raise sde.min_std (it becomes an ODE step)") if len(trained) > 1 else (
               "it is the only step trained here: start sde.window earlier")  # fmt: skip
        out.append(
            f"sampler={cfg.sampler} trains the last step (t_1 -> 0, the smallest std of the grid), which "
            f"Flow-GRPO never trains: its log-prob gradient scales as 1/std and can outweigh every other "
            f"step; {fix}"
        )
    if cfg.credit in ("stepwise", "stepwise_per_step") and not cfg.rollout.same_latent:
        out.append(
            f"credit={cfg.credit} with rollout.same_latent=false: a group's members start from different "
            "noise, so the reward of their first estimate differs and their gains no longer sum to the "
            "group-relative final reward; set rollout.same_latent=true unless that is the ablation you want"
        )
    if cfg.optim.warmup > cfg.iterations:
        out.append(f"optim.warmup={cfg.optim.warmup} is longer than iterations={cfg.iterations}: the learning rate "
                   f"never reaches optim.lr={cfg.optim.lr:g}")  # fmt: skip
    if cfg.eval.every > cfg.iterations:
        out.append(f"eval.every={cfg.eval.every} is longer than iterations={cfg.iterations}: no evaluation runs "
                   "during training")  # fmt: skip
    return out
