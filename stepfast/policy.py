"""The policy: a diffusers SD3 pipeline whose transformer is trained (LoRA or full), seen as a
velocity model with prompt conditioning and classifier-free guidance.

The text encoders and the VAE stay frozen: prompts are encoded once per iteration, images are
decoded once per reward batch. The reference policy for the KL penalty is the same transformer with
its LoRA adapter disabled, so no second copy of the weights is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .models import EMBEDDED_MODEL, load_pipeline, text_length

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PromptEmbeddings:
    """Conditional (and, with CFG, unconditional) embeddings of a batch of prompts."""

    embeds: torch.Tensor  # [B, L, D]
    pooled: torch.Tensor  # [B, P]
    neg_embeds: torch.Tensor | None = None
    neg_pooled: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """Every field by name (None for the unconditional ones without CFG)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def map(self, fn) -> "PromptEmbeddings":
        """fn applied to every tensor (None stays None)."""
        return PromptEmbeddings(**{k: None if x is None else fn(x) for k, x in self.tensors().items()})

    def select(self, index) -> "PromptEmbeddings":
        return self.map(lambda x: x[index])


def grid_shift(scheduler_config) -> float:
    """The shift of the SD3 time grid (stepfast.sde.sd3_time_grid) that a pipeline's scheduler config
    gives, as diffusers built it (its class's defaults filled in); 3.0, SD3's, for a scheduler that has
    none. The trainer's grid and the start checks' both come from here."""
    return float(scheduler_config.get("shift", 3.0))


def resolve_model_path(path: str) -> str:
    return EMBEDDED_MODEL if path == "embedded" else path


def load_policy_pipeline(cfg: ModelConfig, device: torch.device):
    """The pipeline with the trainable transformer prepared (LoRA adapter, checkpointing, attention)."""
    pipe = load_pipeline(resolve_model_path(cfg.path), dtype=DTYPES[cfg.dtype], device=device)
    transformer = pipe.transformer
    if cfg.attention == "xformers":
        try:
            transformer.enable_xformers_memory_efficient_attention()
        except Exception as exc:  # not installed, or no CUDA
            raise ValueError(f"model.attention=xformers, but xformers cannot be used here: {exc}") from exc
    if cfg.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if cfg.lora:
        from peft import LoraConfig

        check_lora_targets(transformer, cfg.lora_targets)
        transformer.requires_grad_(False)
        transformer.add_adapter(
            LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, init_lora_weights="gaussian",
                       target_modules=list(cfg.lora_targets))
        )
        # trainable weights in fp32 whatever the base dtype: optimizer states stay exact
        for p in transformer.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    else:
        transformer.requires_grad_(True)
    return pipe


def check_lora_targets(transformer: torch.nn.Module, targets) -> None:
    """Every LoRA target names modules of the transformer, as peft matches them (the module's name, or
    its ending after a dot). peft itself refuses only a list of which nothing matches: with one target
    mistyped beside good ones it would train the others and say nothing."""
    names = [name for name, _ in transformer.named_modules() if name]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return
    # the linear layers, named as a target names them: one block's names stand for every block's
    linear = sorted({re.sub(r"^\w+\.\d+\.", "", n)
                     for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)})
    named = []
    for target in missing:
        close = difflib.get_close_matches(target, linear, n=1, cutoff=0.6)
        named.append(repr(target) + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(
        f"model.lora_targets: {', '.join(named)} {'matches' if len(missing) == 1 else 'match'} no module of the "
        f"transformer; its linear layers are {', '.join(linear)}"
    )


def quiet_loading_bars() -> None:
    """Turns off transformers' progress bars (a text encoder's weights loading, and huggingface_hub's
    downloads with them): on the ranks other than the first, which would draw the same bars over each
    other's. (diffusers draws its pipeline bar on the first rank alone already.)"""
    import transformers.utils.logging

    transformers.utils.logging.disable_progress_bar()


def token_limits(pipe) -> dict[str, int]:
    """The tokens each of the pipeline's text encoders takes of a prompt, by tokenizer attribute:
    CLIP's model_max_length (77 for SD3.5), T5's `text_length` (diffusers' max_sequence_length)."""
    limits = {}
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        tokenizer = getattr(pipe, name, None)
        if tokenizer is not None:
            limits[name] = text_length(pipe) if name == "tokenizer_3" else int(tokenizer.model_max_length)
    return limits


def cut_prompts(pipe, prompts: list[str]) -> list[int]:
    """The positions of the prompts that some text encoder of `pipe` takes only the start of (their
    tokens past its limit, `token_limits`, are dropped when they are encoded, as diffusers encodes)."""
    cut = set()
    for name, limit in token_limits(pipe).items():
        ids = getattr(pipe, name)(list(prompts), verbose=False)["input_ids"]  # no warning per long prompt
        cut.update(i for i, tokens in enumerate(ids) if len(tokens) > limit)
    return sorted(cut)


class _TruncationNotices(logging.Filter):
    """Drops diffusers' notice, logged at every encoding of a prompt it cuts, once the prompts were
    checked at start (`cut_prompts`): a run would print it at every iteration."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "was truncated because" not in record.getMessage()


def quiet_truncation_notices(pipe) -> None:
    """After `cut_prompts` has been said: drops diffusers' notice from its SD3 pipeline's logger (once),
    and marks `pipe`'s tokenizers as having given transformers' own about a long prompt, which each
    tokenizer gives once (the tokenizers of other models, a reward's, keep theirs)."""
    log = logging.getLogger("diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3")
    if not any(isinstance(f, _TruncationNotices) for f in log.filters):
        log.addFilter(_TruncationNotices())
    for name in token_limits(pipe):
        said = getattr(getattr(pipe, name), "deprecation_warnings", None)
        if isinstance(said, dict):
            said["sequence-length-is-longer-than-the-specified-maximum"] = True


@torch.no_grad()
def encode_prompts(pipe, prompts: list[str], cfg_scale: float, device) -> PromptEmbeddings:
    """The embeddings of each of `prompts` (and of the empty prompt with guidance), one row each.

    Each distinct text is encoded once, on its own, and its row repeated: a group's members share
    their prompt (the SD3.5 presets' 24 members a prompt took 24 T5 passes each), and a text's row is
    then the same bits however the groups are shared out over ranks (a batch's shape changes its
    rounding, as the VAE's does: `decode`)."""
    if not prompts:
        raise ValueError("encode_prompts needs at least one prompt, got none")
    guided = cfg_scale > 1
    distinct = list(dict.fromkeys([*prompts, ""] if guided else prompts))  # "" the negative prompt
    rows = [pipe.encode_prompt(prompt=[text], prompt_2=None, prompt_3=None, device=device,
                               do_classifier_free_guidance=False, max_sequence_length=text_length(pipe))
            for text in distinct]  # fmt: skip
    embeds, pooled = torch.cat([r[0] for r in rows]), torch.cat([r[2] for r in rows])
    row = {text: i for i, text in enumerate(distinct)}
    index = torch.tensor([row[text] for text in prompts], device=embeds.device)
    cond = PromptEmbeddings(embeds.index_select(0, index), pooled.index_select(0, index))
    if not guided:
        return cond
    empty = torch.full_like(index, row[""])
    return PromptEmbeddings(cond.embeds, cond.pooled, embeds.index_select(0, empty), pooled.index_select(0, empty))


def velocity(transformer, x: torch.Tensor, t: torch.Tensor, cond: PromptEmbeddings, cfg_scale: float) -> torch.Tensor:
    """v(x, t | prompt), guided: v_u + w (v_c - v_u) when cfg_scale > 1. t: [B] in [0, 1].

    The SD3 transformer takes timesteps on diffusers' 0..1000 scale, in float32 whatever its dtype (as
    diffusers' pipeline passes them): it embeds them in float32 and casts after, where bf16 timesteps
    would move the 10-step grid's 602.15 to 604.
    """
    dtype = next(transformer.parameters()).dtype
    if cfg_scale > 1:
        xin = torch.cat([x, x])
        tin = torch.cat([t, t])
        emb = torch.cat([cond.neg_embeds, cond.embeds])
        pooled = torch.cat([cond.neg_pooled, cond.pooled])
    else:
        xin, tin, emb, pooled = x, t, cond.embeds, cond.pooled
    out = transformer(
        hidden_states=xin.to(dtype), timestep=tin.float() * 1000, encoder_hidden_states=emb.to(dtype),
        pooled_projections=pooled.to(dtype), return_dict=False,
    )[0].float()  # fmt: skip
    if cfg_scale > 1:
        v_u, v_c = out.chunk(2)
        return v_u + cfg_scale * (v_c - v_u)
    return out


@contextlib.contextmanager
def reference_policy(transformer):
    """The reference policy for the KL: the base weights, i.e. the LoRA adapter disabled."""
    if not getattr(transformer, "_hf_peft_config_loaded", False):
        raise ValueError("the KL penalty (optim.beta > 0) needs LoRA: the reference is the model without its adapter")
    transformer.disable_adapters()
    try:
        yield transformer
    finally:
        transformer.enable_adapters()


def check_resolution(pipe, size: int, key: str) -> None:
    """A ValueError naming `key` when the pipeline cannot draw size x size images: their side must be
    a multiple of the VAE's factor times the transformer's patch, and their patches must fit in its
    position embedding (pos_embed_max_size patches a side, when it has a largest size)."""
    step = pipe.vae_scale_factor * pipe.patch_size
    patches = pipe.transformer.config.get("pos_embed_max_size")
    largest = patches * step if patches else None
    if size % step or (largest is not None and size > largest):
        most = f" up to {largest} px" if largest is not None else ""
        raise ValueError(f"{key}={size}: this model draws images whose side is a multiple of {step} px{most}")


def latent_shape(pipe, batch: int, resolution: int) -> tuple[int, ...]:
    scale = pipe.vae_scale_factor
    if resolution % scale:
        raise ValueError(f"rollout.resolution {resolution} must be a multiple of the VAE's factor {scale}")
    return (batch, pipe.transformer.config.in_channels, resolution // scale, resolution // scale)


#: Latents per VAE call of `decode` (the trainer's `rollout.decode_batch`). Every call decodes exactly
#: this many, so that an image's pixels do not depend on how many others are decoded with it: oneDNN
#: and cuDNN choose their algorithms by shape, and on a CPU the tiny VAE rounds a batch of 14
#: differently from one of 28. A run on two ranks then decodes every image as a run on one rank does.
DECODE_BATCH = 16


@torch.no_grad()
def decode(pipe, latents: torch.Tensor, batch_size: int = DECODE_BATCH) -> torch.Tensor:
    """Latents -> images as float [B, 3, H, W] in [0, 1] (on the CPU), decoded in chunks of exactly
    `batch_size`, the last one padded with copies of its last latent (see DECODE_BATCH)."""
    vae = pipe.vae
    if batch_size < 1:
        raise ValueError(f"decode: batch_size must be >= 1, got {batch_size}")
    if latents.shape[0] == 0:
        raise ValueError("decode: no latents to decode")
    out = []
    for chunk in latents.split(batch_size):
        n = chunk.shape[0]
        if n < batch_size:
            chunk = torch.cat([chunk, chunk[-1:].expand(batch_size - n, *chunk.shape[1:])])
        z = chunk.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        img = vae.decode(z, return_dict=False)[0][:n]
        out.append((img.float() / 2 + 0.5).clamp(0, 1).cpu())
    return torch.cat(out)


def save_transformer(
    transformer, directory: str | Path, weights: dict[str, torch.Tensor], max_shard_size: int | str = "10GB"
) -> None:
    """A fully fine-tuned transformer in diffusers' format (config.json and
    diffusion_pytorch_model.safetensors: `SD3Transformer2DModel.from_pretrained(directory)`); above
    `max_shard_size`, split as diffusers splits it (diffusion_pytorch_model-0000k-of-0000n.safetensors
    with an index), since one file of SD3.5-Large's 8B weights would be 16 GB.

    weights: every parameter by `named_parameters` name (gathered where ZeRO-3 partitions them, or
    the EMA's shadow), written in the transformer's dtype; its buffers are taken from the module."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    params = dict(transformer.named_parameters())
    missing = sorted(set(params) - set(weights))
    if missing:
        raise ValueError(f"save_transformer: no weights given for {len(missing)} parameters, e.g. {missing[0]}")
    state = {k: v for k, v in transformer.state_dict().items() if k not in params}  # persistent buffers
    state.update({k: weights[k].to(params[k].dtype) for k in params})
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    transformer.save_config(directory)
    split = split_torch_state_dict_into_shards(
        state, max_shard_size=max_shard_size, filename_pattern="diffusion_pytorch_model{suffix}.safetensors"
    )
    for filename, names in split.filename_to_tensors.items():
        save_file({k: state[k].detach().cpu().contiguous() for k in names}, directory / filename,
                  metadata={"format": "pt"})  # fmt: skip
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": split.tensor_to_filename}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        (directory / "diffusion_pytorch_model.safetensors.index.json").write_text(text, encoding="utf-8")


def save_lora(transformer, directory: str | Path, weights: dict[str, torch.Tensor] | None = None) -> None:
    """The adapter in diffusers' format (loadable with `pipe.load_lora_weights(directory)`).

    weights: the adapter's parameters by `named_parameters` name (the EMA's shadow) to write in place
    of the transformer's current ones.
    """
    from diffusers import StableDiffusion3Pipeline
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(transformer, state_dict=weights)
    state = {k: v.detach().float().cpu().contiguous() for k, v in state.items()}
    # the adapter's config goes with it (in the file's metadata): without it, load_lora_weights takes
    # lora_alpha = rank, and an adapter trained at alpha = 2 x rank loads at half its scale
    metadata = transformer.peft_config["default"].to_dict()
    if isinstance(metadata.get("target_modules"), (set, frozenset)):  # in one order: the same bytes each save
        metadata["target_modules"] = sorted(metadata["target_modules"])
    StableDiffusion3Pipeline.save_lora_weights(str(directory), transformer_lora_layers=state,
                                               transformer_lora_adapter_metadata=metadata)  # fmt: skip
