"""PickScore, CLIPScore and the aesthetic predictor on tiny random CLIPs saved to and loaded from disk.

The expected values come from CLIPModel's own forward (logits_per_image = logit_scale * cos), an
independent path from the rewards' get_image_features / get_text_features code.
"""

import json

import numpy as np
import pytest
import torch
from torch import nn

from stepfast import rewards


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte-to-printable-character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def write_clip(directory, projection_dim: int, seed: int) -> None:
    """A tiny CLIPModel + CLIPProcessor (byte-level BPE vocab written here) saved to `directory`."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    chars = list(bytes_to_unicode().values())
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for token in chars + [c + "</w>" for c in chars] + ["ca", "cat</w>", "re", "red</w>"]:
        vocab.setdefault(token, len(vocab))
    merges = ["c a", "ca t</w>", "r e", "re d</w>"]
    tok_dir = directory / "tokenizer_files"
    tok_dir.mkdir(parents=True)
    (tok_dir / "vocab.json").write_text(json.dumps(vocab))
    (tok_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tokenizer = CLIPTokenizer(vocab=str(tok_dir / "vocab.json"), merges=str(tok_dir / "merges.txt"),
                              model_max_length=77)
    assert tokenizer.tokenize("a red cat") == ["a</w>", "red</w>", "cat</w>"]
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=projection_dim,
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(directory)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(directory)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("clip_l14_like")
    write_clip(directory, projection_dim=768, seed=0)
    return directory


PROMPTS = ["a red cat", "a photo of a dog", "two blue squares", "a cat on a red mat", "text", "red red red"]


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(len(PROMPTS), 40, 48, 3), dtype=np.uint8)


def reference_logits(clip_dir, images, prompts):
    """diag(logits_per_image) from CLIPModel.forward: logit_scale.exp() * cos(image, text)."""
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(clip_dir).eval()
    processor = CLIPProcessor.from_pretrained(clip_dir)
    inputs = processor(text=prompts, images=[Image.fromarray(a) for a in images], return_tensors="pt",
                       padding=True)
    with torch.no_grad():
        out = model(**inputs)
    return out.logits_per_image.diagonal(), model.logit_scale.exp().detach()


def test_pickscore_is_logit_scale_times_cosine_over_26(clip_dir, images):
    reward = rewards.load("pickscore", path=str(clip_dir))
    out = reward.score(images, PROMPTS)
    logits, _ = reference_logits(clip_dir, images, PROMPTS)
    assert set(out) == {"score", "raw"}
    torch.testing.assert_close(out["raw"], logits)
    torch.testing.assert_close(out["score"], logits / 26)
    assert out["score"].dtype == torch.float32 and out["score"].shape == (len(PROMPTS),)


def test_pickscore_batches_inputs_and_prompts(clip_dir, images):
    whole = rewards.load("pickscore", path=str(clip_dir), batch_size=64).score(images, PROMPTS)["score"]
    chunked = rewards.load("pickscore", path=str(clip_dir), batch_size=4).score(images, PROMPTS)["score"]
    torch.testing.assert_close(chunked, whole)
    # the same pixels as a float tensor in [-1, 1]
    as_float = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
    torch.testing.assert_close(rewards.load("pickscore", path=str(clip_dir)).score(as_float, PROMPTS)["score"], whole)
    # scores follow the prompt: swapping prompts changes them
    swapped = rewards.load("pickscore", path=str(clip_dir)).score(images, PROMPTS[::-1])["score"]
    assert not torch.allclose(swapped, whole)


def test_clipscore_is_clamped_cosine(clip_dir, images):
    out = rewards.load("clipscore", path=str(clip_dir)).score(images, PROMPTS)
    logits, scale = reference_logits(clip_dir, images, PROMPTS)
    cos = logits / scale
    assert (cos < 0).any() and (cos > 0).any(), "the fixture should exercise both sides of the clamp"
    torch.testing.assert_close(out["cosine"], cos)
    torch.testing.assert_close(out["score"], torch.clamp(100 * cos, min=0) / 100)
    assert (out["score"][cos < 0] == 0).all()


def test_aesthetic_mlp_on_normalised_image_features(clip_dir, images, tmp_path):
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    torch.manual_seed(1)
    mlp = nn.Sequential(nn.Linear(768, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                        nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))
    # the original checkpoint's keys: the Sequential sits in an attribute named "layers"
    torch.save({f"layers.{k}": v for k, v in mlp.state_dict().items()}, tmp_path / "aesthetic.pth")

    reward = rewards.load("aesthetic", path=str(clip_dir), mlp_path=str(tmp_path / "aesthetic.pth"))
    out = reward.score(images, PROMPTS)

    model = CLIPModel.from_pretrained(clip_dir).eval()
    pixels = CLIPProcessor.from_pretrained(clip_dir)(images=[Image.fromarray(a) for a in images],
                                                     return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        emb = model(pixel_values=pixels, input_ids=torch.zeros(len(images), 2, dtype=torch.long)).image_embeds
        expected = mlp.eval()(emb).squeeze(1)  # image_embeds are already L2-normalised by CLIPModel
    torch.testing.assert_close(out["score"], expected)
    assert out["score"].std() > 0


def test_aesthetic_rejects_wrong_files(clip_dir, tmp_path):
    torch.save({"weight": torch.zeros(3)}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="not an aesthetic-predictor state dict"):
        rewards.load("aesthetic", path=str(clip_dir), mlp_path=str(tmp_path / "bad.pth"))
    small = tmp_path / "clip16"
    write_clip(small, projection_dim=16, seed=2)
    with pytest.raises(ValueError, match="ViT-L/14"):
        rewards.load("aesthetic", path=str(small), mlp_path=str(tmp_path / "bad.pth"))


def test_missing_weights_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.*PickScore_v1"):
        rewards.load("pickscore", path=str(tmp_path / "nowhere"))
    with pytest.raises(TypeError, match="needs path="):
        rewards.load("clipscore")
