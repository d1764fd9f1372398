"""Image batches in the forms rewards accept, converted to one layout."""

from __future__ import annotations

import numpy as np
import torch


def to_uint8(images) -> np.ndarray:
    """A batch of RGB images as uint8 [B, H, W, 3].

    Accepts a list of PIL images; a uint8 array or tensor [B, H, W, 3] (or one image [H, W, 3]);
    a float tensor or array [B, 3, H, W] (or [3, H, W]) in [0, 1], or in [-1, 1] when any value is
    negative. Floats are clamped and rounded to the nearest level.
    """
    if isinstance(images, (list, tuple)):
        if not images:
            return np.zeros((0, 0, 0, 3), dtype=np.uint8)
        if hasattr(images[0], "convert"):  # PIL
            return np.stack([np.asarray(im.convert("RGB"), dtype=np.uint8) for im in images])
        images = np.stack([np.asarray(im) for im in images])
    if isinstance(images, torch.Tensor):
        if images.dtype == torch.uint8:
            images = images.cpu().numpy()
        else:
            images = images.detach().float().cpu().numpy()
    arr = np.asarray(images)
    if arr.dtype == np.uint8:
        if arr.ndim == 3:
            arr = arr[None]
        if arr.ndim != 4 or arr.shape[-1] != 3:
            raise ValueError(f"uint8 images must be [B, H, W, 3], got shape {arr.shape}")
        return arr
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4 or arr.shape[1] != 3:
        raise ValueError(f"float images must be [B, 3, H, W], got shape {arr.shape}")
    arr = arr.astype(np.float32)
    if arr.size and arr.min() < 0:
        arr = (arr + 1) / 2
    arr = np.clip(arr, 0, 1).transpose(0, 2, 3, 1)
    return np.rint(arr * 255).astype(np.uint8)


def to_pil(images) -> list:
    """A batch as a list of PIL RGB images."""
    from PIL import Image

    return [Image.fromarray(a) for a in to_uint8(images)]
