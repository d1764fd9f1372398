"""ImageReward (Xu et al. 2023): BLIP image-text features scored by an MLP, natively on transformers.

Runs the original THUDM/ImageReward checkpoint without the `image-reward` package (which needs
torchvision and transformers<5): the BLIP ViT and the BLIP text encoder are transformers' own
`BlipVisionModel` and `BlipTextModel`, the head and the preprocessing are written here. Weights,
all as local paths (nothing is downloaded):

- `path`: `ImageReward.pt` from the THUDM/ImageReward model repository, the state dict exactly as
  the package saves it: `blip.visual_encoder.*` (BLIP/timm ViT names), `blip.text_encoder.*` (BLIP
  med.py BERT names) and `mlp.layers.*`. `blip.vision_proj` / `blip.text_proj` (and any other
  `blip.*` head outside the two encoders) are not used by the score and are ignored.
- `med_config`: `med_config.json` from the same repository (the BERT config of the text encoder).
- `tokenizer`: a local directory with the `bert-base-uncased` tokenizer files (`vocab.txt` or
  `tokenizer.json`), e.g. `hf download bert-base-uncased vocab.txt tokenizer.json
  tokenizer_config.json --local-dir DIR`. BLIP's special tokens ([DEC] as bos, [ENC] as additional)
  are added to it as BLIP's `init_tokenizer` does.

The vision tower's size comes from the checkpoint: width from `cls_token`, depth from the number of
`blocks.N`, patch size from `patch_embed.proj`, image size from `pos_embed` ((image/patch)^2 + 1
positions), MLP width from `blocks.0.mlp.fc1`. The head count is not in the weights: option
`vision_heads`, by default width // 64 (BLIP's ViT-B and ViT-L both use 64-wide heads: 16 heads for
ImageReward's ViT-L/16, width 1024); a width that is not a multiple of 64 needs it given. The text
encoder's cross-attention reads image features of the vision width (BLIP sets `encoder_width` to it,
whatever med_config.json says).

The score, as the package's `ImageReward.score` computes it for each (prompt, image) pair:

- image: resize the shorter side to the ViT's image size (224 for the real model; bicubic, PIL, the
  longer side floored as torchvision's Resize), centre crop to a square, to [0, 1], normalise with
  the CLIP mean/std; ViT -> image_embeds (every token, after the final LayerNorm);
- text: the BERT tokenizer, padded to max_length 35 with truncation; the first token stays [CLS]
  (the package's score path does not swap in [ENC], unlike BLIP's ITM head);
- the text encoder, cross-attending to image_embeds with an all-ones image mask; its [CLS] feature
  -> MLP (768 -> 1024 -> 128 -> 64 -> 16 -> 1, no activations, dropouts off at inference)
  -> (r - 0.16717362830052426) / 1.0333394966054072.

Everything runs in fp32 in inference mode, `batch_size` pairs at a time (Flow-GRPO calls the
package's `inference_rank`, one prompt against many images; the score of each pair is the same).
"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import torch
from torch import nn

from stepfast.rewards.images import to_pil
from stepfast.rewards.paths import RewardFileError, require_local

#: the package's normalisation of the MLP output (ImageReward.mean / ImageReward.std)
MEAN = 0.16717362830052426
STD = 1.0333394966054072
#: the package's image normalisation (CLIP's)
PIXEL_MEAN = (0.48145466, 0.4578275, 0.40821073)
PIXEL_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_LENGTH = 35
VISION_LAYER_NORM_EPS = 1e-6  # BLIP's ViT: partial(nn.LayerNorm, eps=1e-6)
MLP_WIDTHS = (1024, 128, 64, 16, 1)
IGNORED_PREFIXES = ("blip.vision_proj.", "blip.text_proj.")
SOURCE = "THUDM/ImageReward"


def _few(keys, n: int = 5) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f" (and {len(keys) - n} more)" if len(keys) > n else "")


# --- key mapping: BLIP/timm ViT names -> transformers' BlipVisionModel ------------------------------

_VISION_RENAMES = [
    (r"cls_token", "embeddings.class_embedding"),
    (r"pos_embed", "embeddings.position_embedding"),
    (r"patch_embed\.proj\.(weight|bias)", r"embeddings.patch_embedding.\1"),
    (r"blocks\.(\d+)\.norm1\.(weight|bias)", r"encoder.layers.\1.layer_norm1.\2"),
    (r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)", r"encoder.layers.\1.self_attn.qkv.\2"),  # fused, same layout
    (r"blocks\.(\d+)\.attn\.proj\.(weight|bias)", r"encoder.layers.\1.self_attn.projection.\2"),
    (r"blocks\.(\d+)\.norm2\.(weight|bias)", r"encoder.layers.\1.layer_norm2.\2"),
    (r"blocks\.(\d+)\.mlp\.fc([12])\.(weight|bias)", r"encoder.layers.\1.mlp.fc\2.\3"),
    (r"norm\.(weight|bias)", r"post_layernorm.\1"),
]
_BLOCK_KEYS = ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")


def _vision_keys(depth: int) -> list[str]:
    """The original names of a BLIP ViT's weights (under blip.visual_encoder.)."""
    keys = ["cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias", "norm.weight", "norm.bias"]
    return keys + [f"blocks.{i}.{m}.{p}" for i in range(depth) for m in _BLOCK_KEYS for p in ("weight", "bias")]


def _vision_key(key: str) -> str:
    """The BlipVisionModel name of an original ViT key (one of _vision_keys)."""
    for pattern, replacement in _VISION_RENAMES:
        if re.fullmatch(pattern, key):
            return re.sub(pattern, replacement, key)
    raise KeyError(key)


def _not_imagereward(path: str, detail: str) -> ValueError:
    return ValueError(f"reward 'imagereward': {path} is not an ImageReward checkpoint ({SOURCE} ImageReward.pt "
                      f"as the image-reward package saves it): {detail}")


def _split_state(state: dict, path: str) -> tuple[dict, dict, dict]:
    """The checkpoint split into (vision, text, mlp) state dicts, each without its prefix."""
    parts = {"blip.visual_encoder.": {}, "blip.text_encoder.": {}, "mlp.": {}}
    unexpected = []
    for key, value in state.items():
        prefix = next((p for p in parts if key.startswith(p)), None)
        if prefix is not None:
            parts[prefix][key[len(prefix):]] = value
        elif not key.startswith(IGNORED_PREFIXES):
            unexpected.append(key)
    absent = [p + "*" for p, part in parts.items() if not part]
    if absent:
        raise _not_imagereward(path, f"missing keys {', '.join(absent)}; it has {_few(state)}")
    if unexpected:
        raise _not_imagereward(path, f"unexpected keys {_few(unexpected)}")
    vision, text, mlp = parts.values()
    text.pop("embeddings.position_ids", None)  # a buffer (an arange) that the package saves; rebuilt here
    return vision, text, mlp


def _infer_vision(vision: dict, path: str, vision_heads) -> dict:
    """BlipVisionConfig arguments read off the ViT weights (original names) and the head count option."""
    needed = ["cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.mlp.fc1.weight"]
    if any(k not in vision for k in needed):
        absent = ["blip.visual_encoder." + k for k in needed if k not in vision]
        raise _not_imagereward(path, "missing keys " + _few(absent))
    width = vision["cls_token"].shape[-1]
    positions = vision["pos_embed"].shape[1]
    patch_weight = vision["patch_embed.proj.weight"]
    patch = patch_weight.shape[-1]
    grid = math.isqrt(max(positions - 1, 0))
    if grid < 1 or grid * grid != positions - 1 or patch_weight.shape[-2] != patch:
        raise _not_imagereward(path, f"pos_embed {tuple(vision['pos_embed'].shape)} and patch_embed.proj "
                                     f"{tuple(patch_weight.shape)} are not those of a square ViT grid")
    depth = 1 + max(int(m.group(1)) for k in vision if (m := re.match(r"blocks\.(\d+)\.", k)))
    if vision_heads is None:
        if width % 64:
            raise ValueError(f"reward 'imagereward': the ViT in {path} is {width} wide, not a multiple of 64 "
                             "(BLIP's head width): give its head count as vision_heads=")
        vision_heads = width // 64
    vision_heads = int(vision_heads)
    if vision_heads <= 0 or width % vision_heads:
        raise ValueError(f"reward 'imagereward': vision_heads={vision_heads} does not divide the ViT width {width}")
    return dict(hidden_size=width, intermediate_size=vision["blocks.0.mlp.fc1.weight"].shape[0],
                num_hidden_layers=depth, num_attention_heads=vision_heads, image_size=grid * patch,
                patch_size=patch, hidden_act="gelu", layer_norm_eps=VISION_LAYER_NORM_EPS, attention_dropout=0.0)


def _text_config(med_config: str, encoder_width: int):
    from transformers import BlipTextConfig

    try:
        with open(med_config) as f:
            med = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"reward 'imagereward': med_config={med_config!r} is not a JSON config: {exc}") from exc
    if not isinstance(med, dict) or "hidden_size" not in med or "vocab_size" not in med:
        raise ValueError(f"reward 'imagereward': med_config={med_config!r} is not a BERT config (med_config.json)")
    if not med.get("add_cross_attention", False):
        raise ValueError(f"reward 'imagereward': med_config={med_config!r} has no add_cross_attention: true; "
                         "ImageReward's text encoder cross-attends to the image")
    if med.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"reward 'imagereward': med_config={med_config!r}: only absolute position embeddings "
                         f"are supported, not {med['position_embedding_type']!r}")
    # Missing fields take transformers.BertConfig's defaults, as BertConfig.from_json_file in the package.
    # BlipTextLayer builds its cross-attention only when is_decoder is set; the forward pass below runs
    # it as an encoder (bidirectional self-attention), as BLIP's med.py BertModel in 'multimodal' mode.
    return BlipTextConfig(
        vocab_size=med["vocab_size"], hidden_size=med["hidden_size"], encoder_hidden_size=encoder_width,
        intermediate_size=med.get("intermediate_size", 3072),
        num_hidden_layers=med.get("num_hidden_layers", 12), num_attention_heads=med.get("num_attention_heads", 12),
        max_position_embeddings=med.get("max_position_embeddings", 512), hidden_act=med.get("hidden_act", "gelu"),
        layer_norm_eps=med.get("layer_norm_eps", 1e-12), hidden_dropout_prob=med.get("hidden_dropout_prob", 0.1),
        attention_probs_dropout_prob=med.get("attention_probs_dropout_prob", 0.1),
        initializer_range=med.get("initializer_range", 0.02), pad_token_id=med.get("pad_token_id", 0),
        is_decoder=True, use_cache=False, bos_token_id=None, eos_token_id=None, sep_token_id=None,  # unused here
    )


class MLP(nn.Module):
    """The package's head: Linear, Dropout(0.2), Linear, Dropout(0.2), Linear, Dropout(0.1), Linear, Linear
    (no activations), in an attribute named `layers` as in the checkpoint's `mlp.layers.*` keys."""

    def __init__(self, input_width: int):
        super().__init__()
        w = (input_width,) + MLP_WIDTHS
        self.layers = nn.Sequential(nn.Linear(w[0], w[1]), nn.Dropout(0.2), nn.Linear(w[1], w[2]), nn.Dropout(0.2),
                                    nn.Linear(w[2], w[3]), nn.Dropout(0.1), nn.Linear(w[3], w[4]),
                                    nn.Linear(w[4], w[5]))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)


def _check_keys(expected, given, prefix: str, path: str) -> None:
    missing = [prefix + k for k in expected if k not in given]
    unexpected = [prefix + k for k in given if k not in expected]
    if missing or unexpected:
        what = "; ".join(s for s in (f"missing keys {_few(missing)}" if missing else "",
                                     f"unexpected keys {_few(unexpected)}" if unexpected else "") if s)
        raise ValueError(f"reward 'imagereward': {path} does not match the ImageReward architecture "
                         f"(ViT size from its weights, text encoder from med_config): {what}")


def _load(module: nn.Module, state: dict, prefix: str, path: str, names: dict | None = None) -> None:
    """Load `state` (the module's own names; `names` maps them back to the checkpoint's) in fp32."""
    own = module.state_dict()
    wrong = [f"{prefix}{(names or {}).get(k, k)} {tuple(v.shape)} (expected {tuple(own[k].shape)})"
             for k, v in state.items() if v.shape != own[k].shape]
    if wrong:
        raise ValueError(f"reward 'imagereward': {path} does not match the ImageReward architecture "
                         f"(ViT size from its weights, text encoder from med_config): shapes of {_few(wrong, 3)}")
    module.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)


def preprocess(image, size: int) -> torch.Tensor:
    """The package's transform: Resize(size, bicubic), CenterCrop(size), ToTensor, Normalize(CLIP)."""
    from PIL import Image

    image = image.convert("RGB")
    w, h = image.size
    if w <= h:
        new_w, new_h = size, int(size * h / w)
    else:
        new_w, new_h = int(size * w / h), size
    if (new_w, new_h) != (w, h):
        image = image.resize((new_w, new_h), Image.BICUBIC)
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    image = image.crop((left, top, left + size, top + size))
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float().div(255)
    mean = torch.tensor(PIXEL_MEAN).view(3, 1, 1)
    std = torch.tensor(PIXEL_STD).view(3, 1, 1)
    return (pixels - mean) / std


def _tokenizer(directory: str):
    from transformers import BertTokenizer

    if not any(os.path.isfile(os.path.join(directory, f)) for f in ("vocab.txt", "tokenizer.json")):
        raise RewardFileError("imagereward", f"reward 'imagereward': tokenizer={directory!r} has neither vocab.txt "
                              "nor tokenizer.json; it should be a local copy of the bert-base-uncased tokenizer")
    tokenizer = BertTokenizer.from_pretrained(directory, local_files_only=True)
    # BLIP's init_tokenizer: [DEC] as bos, [ENC] as the additional special token.
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


class ImageRewardReward:
    """Options: `path` (ImageReward.pt), `med_config` (med_config.json), `tokenizer` (directory of the
    bert-base-uncased tokenizer), `vision_heads` (default width // 64), `device`, `batch_size`."""

    def __init__(self, path=None, med_config=None, tokenizer=None, vision_heads=None, device: str = "cpu",
                 batch_size: int = 16):
        from transformers import BlipTextModel, BlipVisionConfig, BlipVisionModel

        path = require_local("imagereward", "path", path, f"local copy of ImageReward.pt from {SOURCE}", "file")
        med_config = require_local("imagereward", "med_config", med_config,
                                   f"local copy of med_config.json from {SOURCE}", "file")  # fmt: skip
        tokenizer = require_local("imagereward", "tokenizer", tokenizer,
                                  "local directory of the bert-base-uncased tokenizer files", "dir")  # fmt: skip
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        if self.batch_size <= 0:
            raise ValueError(f"reward 'imagereward': batch_size must be positive, got {batch_size}")

        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(f"reward 'imagereward': cannot read {path} as a torch state dict: {exc}") from exc
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"reward 'imagereward': {path} is not a state dict ({SOURCE} ImageReward.pt)")
        vision_state, text_state, mlp_state = _split_state(state, path)
        vision_config = BlipVisionConfig(**_infer_vision(vision_state, path, vision_heads))
        self.image_size = vision_config.image_size
        text_config = _text_config(med_config, vision_config.hidden_size)
        self.tokenizer = _tokenizer(tokenizer)
        if len(self.tokenizer) > text_config.vocab_size:
            raise ValueError(f"reward 'imagereward': tokenizer={tokenizer!r} has {len(self.tokenizer)} tokens with "
                             f"BLIP's [DEC] and [ENC], more than the text encoder's vocab_size "
                             f"{text_config.vocab_size}")
        vision = BlipVisionModel(vision_config)
        text = BlipTextModel(text_config, add_pooling_layer=False)
        head = MLP(text_config.hidden_size)

        _check_keys(_vision_keys(vision_config.num_hidden_layers), vision_state, "blip.visual_encoder.", path)
        _check_keys(text.state_dict(), text_state, "blip.text_encoder.", path)
        _check_keys(head.state_dict(), mlp_state, "mlp.", path)
        names = {_vision_key(k): k for k in vision_state}
        _load(vision, {new: vision_state[k] for new, k in names.items()}, "blip.visual_encoder.", path, names)
        _load(text, text_state, "blip.text_encoder.", path)
        _load(head, mlp_state, "mlp.", path)
        self.vision = vision.float().eval().to(self.device)
        self.text = text.float().eval().to(self.device)
        self.mlp = head.float().eval().to(self.device)

    @torch.inference_mode()
    def score(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        pil = to_pil(images)
        if len(pil) != len(prompts):
            raise ValueError(f"got {len(pil)} images and {len(prompts)} prompts")
        scores = []
        for i in range(0, len(pil), self.batch_size):
            text = self.tokenizer(list(prompts[i : i + self.batch_size]), padding="max_length", truncation=True,
                                  max_length=MAX_LENGTH, return_tensors="pt")
            pixels = torch.stack([preprocess(im, self.image_size) for im in pil[i : i + self.batch_size]])
            image_embeds = self.vision(pixel_values=pixels.to(self.device)).last_hidden_state
            image_mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
            out = self.text(input_ids=text["input_ids"].to(self.device),
                            attention_mask=text["attention_mask"].to(self.device),
                            encoder_hidden_states=image_embeds, encoder_attention_mask=image_mask)
            reward = self.mlp(out.last_hidden_state[:, 0, :].float()).squeeze(1)
            scores.append(((reward - MEAN) / STD).float().cpu())
        if not scores:
            return {"score": torch.zeros(0)}
        return {"score": torch.cat(scores)}
