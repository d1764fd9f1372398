"""JPEG (in)compressibility, as Flow-GRPO's `jpeg_compressibility` and `jpeg_incompressibility`.

Each image is encoded as JPEG at quality 95 with PIL; its size in kB (bytes / 1000) is the measure.
Flow-GRPO's incompressibility reward is that size; its compressibility reward is -size / 500 (the
division keeps the reward near the scale of the others). Both are exactly reproduced here; "kb" is
the size itself.
"""

from __future__ import annotations

import io

import torch

from stepfast.rewards.images import to_pil

QUALITY = 95


def jpeg_sizes_kb(images, quality: int = QUALITY) -> torch.Tensor:
    """Size in kB of each image of the batch as a JPEG at `quality`."""
    sizes = []
    for image in to_pil(images):
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegIncompressibility:
    """score = JPEG size in kB (quality 95): larger files, more detail."""

    def __init__(self, quality: int = QUALITY):
        self.quality = int(quality)

    def score(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        kb = jpeg_sizes_kb(images, self.quality)
        return {"score": kb, "kb": kb.clone()}


class JpegCompressibility:
    """score = -(JPEG size in kB) / `scale` (quality 95; scale 500 as Flow-GRPO)."""

    def __init__(self, quality: int = QUALITY, scale: float = 500.0):
        self.quality, self.scale = int(quality), float(scale)

    def score(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        kb = jpeg_sizes_kb(images, self.quality)
        return {"score": -kb / self.scale, "kb": kb}
