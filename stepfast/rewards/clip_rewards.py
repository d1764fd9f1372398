"""Rewards built on CLIP: PickScore, CLIPScore and the LAION aesthetic predictor.

Weights are read from local paths given in the options (`path`, `mlp_path`); nothing is downloaded.
Get them once with `hf download REPO --local-dir DIR` (see docs/rewards.md):

- pickscore: `yuvalkirstain/PickScore_v1` (model) and `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`
  (processor; PickScore was trained with that processor), as in Flow-GRPO.
- clipscore and aesthetic: `openai/clip-vit-large-patch14`.
- aesthetic MLP: `sac+logos+ava1-l14-linearMSE.pth` from christophschuhmann/improved-aesthetic-predictor.

Images go through the model's own CLIPProcessor (resize, centre crop, normalise) as PIL images;
models run in fp32, in inference mode, `batch_size` images at a time.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from stepfast.rewards.images import to_pil
from stepfast.rewards.paths import require_local


def _require_path(reward: str, option: str, path, source: str) -> str:
    return require_local(reward, option, path, f"local copy of {source}",
                         hint=f"download {source} there first (hf download {source.split()[0]} "
                              f"--local-dir {os.fspath(path) if path is not None else ''})")  # fmt: skip


def _features(out) -> torch.Tensor:
    # transformers 4.x returns the projected embedding; 5.x an output whose pooler_output it is.
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class _ClipReward:
    """A CLIPModel and its processor loaded from local directories, with batched embeddings."""

    def __init__(self, reward: str, path, processor_path, source: str, device: str, batch_size: int):
        from transformers import CLIPModel, CLIPProcessor

        path = _require_path(reward, "path", path, source)
        processor_path = path if processor_path is None else _require_path(
            reward, "processor_path", processor_path, source
        )
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self.model = CLIPModel.from_pretrained(path).float().eval().to(self.device)
        self.processor = CLIPProcessor.from_pretrained(processor_path)

    def image_embeddings(self, pil_images) -> torch.Tensor:
        """L2-normalised image embeddings [B, D], fp32 on CPU."""
        chunks = []
        for i in range(0, len(pil_images), self.batch_size):
            inputs = self.processor(images=pil_images[i : i + self.batch_size], return_tensors="pt")
            pixels = inputs["pixel_values"].to(self.device, torch.float32)
            chunks.append(_features(self.model.get_image_features(pixel_values=pixels)).float().cpu())
        emb = torch.cat(chunks)
        return emb / emb.norm(dim=-1, keepdim=True)

    def text_embeddings(self, prompts) -> torch.Tensor:
        """L2-normalised text embeddings [B, D] (prompts truncated to 77 tokens), fp32 on CPU."""
        chunks = []
        for i in range(0, len(prompts), self.batch_size):
            inputs = self.processor(
                text=list(prompts[i : i + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=77,
                return_tensors="pt",
            )
            inputs = {k: v.to(self.device) for k, v in inputs.items()}
            chunks.append(_features(self.model.get_text_features(**inputs)).float().cpu())
        emb = torch.cat(chunks)
        return emb / emb.norm(dim=-1, keepdim=True)

    def cosine(self, images, prompts) -> torch.Tensor:
        pil = to_pil(images)
        if len(pil) != len(prompts):
            raise ValueError(f"got {len(pil)} images and {len(prompts)} prompts")
        return (self.image_embeddings(pil) * self.text_embeddings(prompts)).sum(-1)


class PickScoreReward:
    """PickScore (Kirstain et al. 2023): logit_scale * cos(image_emb, text_emb).

    PickScore_v1's learned logit_scale is exp(4.6052) = 100, and its scores of ordinary images sit
    around 18-23. Flow-GRPO trains on that number divided by 26 (`pickscore_scorer.py`, "norm to
    0-1"); it is a fixed rescale, not a bound (a score can pass 1). "score" is raw / `divisor`
    (default 26, as Flow-GRPO), "raw" the PickScore of the paper.
    """

    def __init__(self, path=None, processor_path=None, device: str = "cpu", batch_size: int = 32,
                 divisor: float = 26.0):
        self.clip = _ClipReward("pickscore", path, processor_path, "yuvalkirstain/PickScore_v1 model",
                                device, batch_size)
        self.divisor = float(divisor)

    @torch.inference_mode()
    def score(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        raw = self.clip.model.logit_scale.exp().float().cpu() * self.clip.cosine(images, prompts)
        return {"score": raw / self.divisor, "raw": raw}


class ClipScoreReward:
    """CLIPScore: max(100 * cos(image_emb, text_emb), 0) / 100, with CLIP ViT-L/14.

    100 * max(cos, 0) is torchmetrics' CLIPScore (Hessel et al. 2021 use 2.5 * max(cos, 0)); dividing
    by 100 keeps the reward in [0, 1]. Flow-GRPO's `clip_scorer.py` uses logit_scale * cos / 30
    without the clamp instead: the same ranking of images for a prompt, on another scale. "cosine"
    is the raw cosine similarity.
    """

    def __init__(self, path=None, processor_path=None, device: str = "cpu", batch_size: int = 32):
        self.clip = _ClipReward("clipscore", path, processor_path, "openai/clip-vit-large-patch14 model",
                                device, batch_size)

    @torch.inference_mode()
    def score(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        cos = self.clip.cosine(images, prompts)
        return {"score": torch.clamp(100 * cos, min=0) / 100, "cosine": cos}


class AestheticMLP(nn.Module):
    """The improved-aesthetic-predictor head (sac+logos+ava1-l14-linearMSE): no activations."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(768, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embed: torch.Tensor) -> torch.Tensor:
        return self.layers(embed)


class AestheticReward:
    """LAION aesthetic score: the MLP above on L2-normalised CLIP ViT-L/14 image embeddings.

    "score" is the predictor's output (roughly 1-10, as Flow-GRPO uses it); prompts are ignored.
    """

    def __init__(self, path=None, mlp_path=None, processor_path=None, device: str = "cpu",
                 batch_size: int = 32):
        self.clip = _ClipReward("aesthetic", path, processor_path, "openai/clip-vit-large-patch14 model",
                                device, batch_size)
        dim = self.clip.model.config.projection_dim
        if dim != 768:
            raise ValueError(f"reward 'aesthetic' needs CLIP ViT-L/14 (768-d embeddings); {path} gives {dim}")
        mlp_path = _require_path("aesthetic", "mlp_path", mlp_path,
                                 "christophschuhmann/improved-aesthetic-predictor sac+logos+ava1-l14-linearMSE.pth")
        state = torch.load(mlp_path, map_location="cpu", weights_only=True)
        self.mlp = AestheticMLP()
        try:
            self.mlp.load_state_dict(state)
        except RuntimeError as exc:
            raise ValueError(f"reward 'aesthetic': {mlp_path} is not an aesthetic-predictor state dict: {exc}") from exc
        self.mlp = self.mlp.float().eval().to(self.clip.device)

    @torch.inference_mode()
    def score(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        emb = self.clip.image_embeddings(to_pil(images)).to(self.clip.device)
        return {"score": self.mlp(emb).squeeze(1).float().cpu()}
