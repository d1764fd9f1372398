"""OCR reward: the text-similarity formula always; EasyOCR with its real weights where it installs."""

import numpy as np
import pytest
import torch

from stepfast import rewards
from stepfast.rewards.ocr import OcrReward, levenshtein, quoted_text, text_similarity


def easyocr_problem() -> str | None:
    """Why EasyOCR cannot run here, or None when it can."""
    try:
        import easyocr  # noqa: F401
        import easyocr_en_models  # noqa: F401
    except Exception as exc:  # not installed, or torchvision failing to load beside this torch
        return (f"EasyOCR cannot run here ({type(exc).__name__}: {exc}). The ocr extra needs torchvision, "
                f"and PyPI's torchvision wheels load only beside PyPI's (CUDA) torch, not torch {torch.__version__}")
    return None


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("flaw", "lawn") == 2
    assert levenshtein("same", "same") == 0


def test_quoted_text_and_similarity_follow_flow_grpo():
    assert quoted_text('A neon sign that says "Open Late" over a door') == "Open Late"
    with pytest.raises(ValueError, match="double quotes"):
        quoted_text("a sign with no quoted text")
    assert text_similarity("OPEN LATE", "Open Late") == 1.0  # spaces and case do not count
    assert text_similarity("welcome! openlate 24h", "Open Late") == 1.0  # contained: distance 0
    assert text_similarity("openlata", "Open Late") == pytest.approx(1 - 1 / 8)
    assert text_similarity("", "Open Late") == 0.0
    assert text_similarity("x" * 50, "Open Late") == 0.0  # distance clamped to the target length


class FakeReader:
    """Stands in for easyocr.Reader: what it 'reads' in each image, in EasyOCR's result format."""

    def __init__(self, texts):
        self.texts, self.calls = texts, []

    def readtext_batched(self, images, batch_size):
        self.calls.append((len(images), images[0].shape, batch_size))
        return [[([[0, 0]] * 4, part, conf) for part, conf in found] for found in self.texts]


def test_score_joins_what_the_reader_finds():
    reward = object.__new__(OcrReward)
    reward.batch_size = 8
    reward.reader = FakeReader([[("Hel", 0.9), ("lo", 0.8)], [("noise", 0.0), ("Hallo", 0.7)], []])
    images = np.zeros((3, 16, 24, 3), dtype=np.uint8)
    out = reward.score(images, ['a "Hello" sign', 'say "hello"', 'a "Hello"'])
    torch.testing.assert_close(out["score"], torch.tensor([1.0, 0.8, 0.0]))
    torch.testing.assert_close(out["exact"], torch.tensor([1.0, 0.0, 0.0]))
    assert reward.reader.calls == [(3, (16, 24, 3), 8)]
    modes = []
    reward.read = lambda images: modes.append(torch.is_inference_mode_enabled()) or ["Hello"]
    reward.score(images[:1], ['a "Hello" sign'])
    assert modes == [True]  # the reader runs in inference mode, as every model reward's does


def test_the_readers_nets_are_not_spread_over_every_gpu(monkeypatch, tmp_path):
    """EasyOCR wraps its nets in DataParallel on a GPU (over every visible one, which fails unless
    they sit on the first): each rank's reward uses them unwrapped, on the device it was given."""
    import sys
    import types

    made = {}

    class Reader:  # EasyOCR's Reader as far as the reward uses it: the nets it builds for a GPU
        def __init__(self, languages, gpu, **options):
            made.update(languages=languages, gpu=gpu, options=options)
            self.detector = torch.nn.DataParallel(torch.nn.Conv2d(3, 2, 1))
            self.recognizer = torch.nn.DataParallel(torch.nn.Linear(4, 2))

    monkeypatch.setitem(sys.modules, "easyocr", types.SimpleNamespace(Reader=Reader))
    reward = OcrReward(device="cuda:1", model_dir=str(tmp_path))
    assert made["gpu"] == "cuda:1" and made["options"]["model_storage_directory"] == str(tmp_path)
    assert type(reward.reader.detector) is torch.nn.Conv2d and type(reward.reader.recognizer) is torch.nn.Linear


def render_text(text: str, size=(320, 72)) -> np.ndarray:
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((12, 14), text, fill="black", font=ImageFont.load_default(size=36))
    return np.asarray(image)


@pytest.mark.slow
def test_easyocr_reads_rendered_text():
    problem = easyocr_problem()
    if problem:
        pytest.skip(problem)
    reward = rewards.load("ocr")
    images = np.stack([render_text("Hello World"), render_text("Quick Fox")])
    prompts = ['A poster that says "Hello World"', 'A poster that says "Hello World"']
    out = reward.score(images, prompts)
    assert out["score"][0] >= 0.9, reward.read(images)
    assert out["score"][1] <= 0.5, reward.read(images)


def test_missing_easyocr_is_a_clear_import_error():
    if easyocr_problem() is None:
        pytest.skip("easyocr works here")
    with pytest.raises(ImportError, match=r"stepfast\[ocr\]"):
        rewards.load("ocr")
