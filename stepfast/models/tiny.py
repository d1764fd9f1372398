"""Tiny Stable Diffusion 3 pipelines: the real diffusers/transformers architectures at toy width.

`build_tiny_pipeline` assembles every component a `StableDiffusion3Pipeline` has (an SD3-style
AutoencoderKL with 16 latent channels, two CLIPTextModelWithProjection encoders with a CLIP BPE
tokenizer, a T5EncoderModel with a Unigram T5 tokenizer, a FlowMatchEulerDiscreteScheduler and an
SD3Transformer2DModel) with random weights, so that the loading, LoRA and sampling code paths are the
ones real checkpoints take. The tokenizers are built locally over a small vocabulary (the words of
ShapeEval prompts plus every byte / character, so any text still tokenizes): nothing is fetched.

`tiny_pipeline_dir(tmp_path, seed)` saves one to disk for tests in about a second.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

#: Words of GenEval-style prompts over shapes and colours; the tokenizers give each one token.
PROMPT_WORDS: tuple[str, ...] = (
    "a", "an", "photo", "of", "and", "the", "left", "right", "above", "below", "on", "to", "top",
    "bottom", "next", "beside", "under", "over", "is", "with", "image", "picture", "object", "objects",
    "one", "two", "three", "four", "five", "six",
    "circle", "circles", "square", "squares", "triangle", "triangles", "shape", "shapes",
    "red", "green", "blue", "yellow", "purple", "orange", "white", "cyan", "magenta", "pink",
    "brown", "gray", "grey", "black",
)  # fmt: skip

@dataclass
class TinyConfig:
    """Widths of the tiny pipeline. The defaults are the shipped embedded model's."""

    image_size: int = 64
    # VAE: len(vae_channels) - 1 halvings, so 64x64 images -> 8x8x16 latents.
    vae_channels: tuple[int, ...] = (8, 16, 32, 64)
    vae_layers_per_block: int = 1
    # Few groups: with one channel per group GroupNorm rescales each channel on its own and the
    # ratios between channels, i.e. the colours, are lost (SD3's VAE has 4+ channels per group).
    vae_norm_groups: int = 1
    # Off: a purely convolutional VAE can be trained on crops (SD3's has attention in its mid block).
    vae_mid_attention: bool = False
    latent_channels: int = 16
    # Transformer: hidden = heads * head_dim; patch 1 over 8x8 latents = 64 image tokens (patch 2,
    # 16 tokens, learned shapes far more slowly: objects straddled the tokens).
    patch_size: int = 1
    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 32
    # Text encoders. CLIP hidden widths add up to at most the T5 width (SD3 pads CLIP to T5's width).
    clip_width: int = 64
    clip_layers: int = 2
    t5_width: int = 128
    t5_layers: int = 2
    # Prompt length in tokens for CLIP and T5. SD3 does not mask padding, so sampling must pad to
    # the length the model was trained with: see `text_length`.
    text_length: int = 12
    scheduler_shift: float = 3.0
    words: tuple[str, ...] = field(default=PROMPT_WORDS)


# --------------------------------------------------------------------------------------------------
# Tokenizers


def bpe_merges(words) -> list[tuple[str, str]]:
    """CLIP-style BPE merges (word ends marked "</w>") that make each of `words` one token.

    Words are taken in sorted order; while BPE with the merges so far leaves a word in several
    pieces, the merge of its first two pieces is appended. An appended merge ranks after all
    earlier ones, so it never changes how an earlier word is split: deterministic, unlike
    `tokenizers`' trainer, which breaks frequency ties differently from run to run.
    """
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for word in sorted(set(words)):
        while len(pieces := _bpe(word, ranks)) > 1:
            ranks[pieces[0], pieces[1]] = len(merges)
            merges.append((pieces[0], pieces[1]))
    return merges


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    pieces = list(word[:-1]) + [word[-1] + "</w>"]
    while len(pieces) > 1:
        pairs = [(ranks.get(pair, len(ranks)), k) for k, pair in enumerate(zip(pieces, pieces[1:]))]
        rank, k = min(pairs)
        if rank == len(ranks):
            break
        pieces[k : k + 2] = [pieces[k] + pieces[k + 1]]
    return pieces


def clip_tokenizer(words, max_length: int):
    """A CLIPTokenizer whose BPE merges make each of `words` one token; other text falls back to
    byte-level pieces, as in CLIP."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    bos, eos = "<|startoftext|>", "<|endoftext|>"
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + [ch + "</w>" for ch in alphabet]
    merges = bpe_merges(w.lower() for w in words)
    tokens += [a + b for a, b in merges]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens + [bos, eos]))}
    return CLIPTokenizer(
        vocab=vocab, merges=merges, bos_token=bos, eos_token=eos, unk_token=eos, pad_token=eos,
        model_max_length=max_length,
    )


def t5_tokenizer(words, max_length: int):
    """A T5Tokenizer (Unigram, SentencePiece-style "▁" word starts) with each of `words` as one
    piece and every printable ASCII character as a fallback piece; no sentinel tokens."""
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + w, -1.0) for w in sorted(set(words))]
    vocab += [(chr(c), -10.0) for c in range(33, 127)]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)


# --------------------------------------------------------------------------------------------------
# Models


def build_tiny_pipeline(seed: int = 0, config: TinyConfig | None = None, **overrides):
    """A StableDiffusion3Pipeline with random weights drawn from `seed` (fp32, CPU).

    `overrides` replace fields of `config` (default TinyConfig()), e.g. num_layers=2.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    cfg = TinyConfig(**{**asdict(config or TinyConfig()), **overrides})
    if 2 * cfg.clip_width > cfg.t5_width:
        raise ValueError(f"2 * clip_width ({2 * cfg.clip_width}) must be <= t5_width ({cfg.t5_width})")
    words = tuple(cfg.words)
    tokenizer = clip_tokenizer(words, cfg.text_length)
    tokenizer_3 = t5_tokenizer(words, cfg.text_length)

    # Components are built in a fixed order from one seed, so a seed names one pipeline.
    torch.manual_seed(seed)
    clip_configs = [
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=cfg.clip_width,
            intermediate_size=2 * cfg.clip_width,
            projection_dim=cfg.clip_width,
            num_hidden_layers=cfg.clip_layers,
            num_attention_heads=max(1, cfg.clip_width // 32),
            max_position_embeddings=cfg.text_length,
            hidden_act="gelu",
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        for _ in range(2)
    ]
    text_encoder = CLIPTextModelWithProjection(clip_configs[0])
    text_encoder_2 = CLIPTextModelWithProjection(clip_configs[1])
    text_encoder_3 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_3),
            d_model=cfg.t5_width,
            d_kv=32,
            d_ff=2 * cfg.t5_width,
            num_layers=cfg.t5_layers,
            num_heads=max(1, cfg.t5_width // 32),
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            feed_forward_proj="gated-gelu",
            pad_token_id=tokenizer_3.pad_token_id,
            eos_token_id=tokenizer_3.eos_token_id,
            decoder_start_token_id=tokenizer_3.pad_token_id,
        )
    )
    levels = len(cfg.vae_channels)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=tuple(cfg.vae_channels),
        layers_per_block=cfg.vae_layers_per_block,
        latent_channels=cfg.latent_channels,
        norm_num_groups=cfg.vae_norm_groups,
        mid_block_add_attention=cfg.vae_mid_attention,
        sample_size=cfg.image_size,
        # SD3's VAE has no quant convs; scaling/shift are set from data by pretraining.
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=1.0,
        shift_factor=0.0,
    )
    latent_size = cfg.image_size // 2 ** (levels - 1)
    transformer = SD3Transformer2DModel(
        sample_size=latent_size,
        patch_size=cfg.patch_size,
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        num_layers=cfg.num_layers,
        attention_head_dim=cfg.head_dim,
        num_attention_heads=cfg.num_heads,
        joint_attention_dim=cfg.t5_width,
        caption_projection_dim=cfg.num_heads * cfg.head_dim,
        pooled_projection_dim=2 * cfg.clip_width,
        pos_embed_max_size=latent_size // cfg.patch_size,
        qk_norm="rms_norm",
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=cfg.scheduler_shift)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer(words, cfg.text_length),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    for module in (text_encoder, text_encoder_2, text_encoder_3, vae, transformer):
        module.eval()
    return pipe


def save_pipeline(pipe, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Save `pipe` in diffusers format (safetensors) under `path`; returns the path.

    dtype=torch.float16 rewrites the saved floating-point weights in half precision (half the
    size on disk) and leaves `pipe` untouched; from_pretrained still loads them in fp32 (or the
    torch_dtype it is given), since every config records float32.
    """
    from safetensors.torch import load_file, save_file

    path = Path(path)
    pipe.save_pretrained(path, safe_serialization=True)
    if dtype is not None:
        for file in sorted(path.glob("*/*.safetensors")):
            tensors = load_file(file)
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
            save_file(tensors, file, metadata={"format": "pt"})
    return path


def tiny_pipeline_dir(tmp_path: str | Path, seed: int = 0, **overrides) -> Path:
    """Build a small random pipeline (narrower than the embedded one unless overridden) and save it
    under tmp_path/"tiny-sd3-{seed}"; returns the directory. About a second on a CPU."""
    small = dict(vae_channels=(8, 16, 16, 16), num_layers=2, num_heads=2, head_dim=16)
    pipe = build_tiny_pipeline(seed, **{**small, **overrides})
    return save_pipeline(pipe, Path(tmp_path) / f"tiny-sd3-{seed}")
