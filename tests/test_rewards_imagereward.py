"""ImageReward on a tiny random checkpoint in the original ImageReward.pt format, loaded from disk.

The checkpoint is written key by key as the image-reward package saves its state dict
(`blip.visual_encoder.*` in BLIP/timm ViT names, `blip.text_encoder.*` in BLIP med.py BERT names,
`mlp.layers.*`), with a tiny med_config.json and a tiny bert tokenizer directory, and goes through
`stepfast.rewards.load("imagereward", ...)`. The expected scores come from a plain-torch forward pass
written from the formulas on the raw state dict (fused qkv split by hand, cross-attention, masks),
not from the transformers modules the reward uses.
"""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stepfast import rewards

# the image-reward package's constants, typed from its source (ImageReward.py)
PACKAGE_MEAN = 0.16717362830052426
PACKAGE_STD = 1.0333394966054072
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

WORDS = ["a", "red", "cat", "photo", "of", "dog", "two", "blue", "squares", "on", "mat", "text", "the", "green",
         "tree", "in", "field", "and"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
# tiny sizes; the vision width differs from the text width so that the cross-attention's key/value
# projections (vision width -> text width) are exercised, as in the real model (1024 -> 768)
VISION = dict(width=48, depth=2, heads=3, patch=8, image=32, mlp=192)
TEXT = dict(hidden=32, layers=2, heads=2, intermediate=64, max_positions=40, eps=1e-12)
PROMPTS = ["a red cat", "a photo of a dog", "two blue squares", "a cat on a red mat", "text"]


def tiny_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """A random state dict with the keys and shapes ImageReward's nn.Module has (tiny sizes)."""
    g = torch.Generator().manual_seed(seed)

    def lin(prefix, n_in, n_out, scale=1.0):
        return {prefix + ".weight": scale * torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in),
                prefix + ".bias": scale * 0.1 * torch.randn(n_out, generator=g)}

    def ln(prefix, n):
        return {prefix + ".weight": 1 + 0.1 * torch.randn(n, generator=g),
                prefix + ".bias": 0.1 * torch.randn(n, generator=g)}

    v, t = VISION, TEXT
    sd = {}
    P = "blip.visual_encoder."
    grid = v["image"] // v["patch"]
    # the ViT's residual stream is kept small (~1e-2) so that its LayerNorms' eps (1e-6) shows in the scores
    small = 0.01
    sd[P + "cls_token"] = small * torch.randn(1, 1, v["width"], generator=g)
    sd[P + "pos_embed"] = small * torch.randn(1, grid * grid + 1, v["width"], generator=g)
    patch_fan_in = 3 * v["patch"] ** 2
    sd[P + "patch_embed.proj.weight"] = (small * torch.randn(v["width"], 3, v["patch"], v["patch"], generator=g)
                                         / math.sqrt(patch_fan_in))
    sd[P + "patch_embed.proj.bias"] = small * torch.randn(v["width"], generator=g)
    for i in range(v["depth"]):
        b = f"{P}blocks.{i}."
        sd |= ln(b + "norm1", v["width"]) | lin(b + "attn.qkv", v["width"], 3 * v["width"])
        sd |= lin(b + "attn.proj", v["width"], v["width"], small) | ln(b + "norm2", v["width"])
        sd |= lin(b + "mlp.fc1", v["width"], v["mlp"]) | lin(b + "mlp.fc2", v["mlp"], v["width"], small)
    sd |= ln(P + "norm", v["width"])

    T = "blip.text_encoder."
    h = t["hidden"]
    sd[T + "embeddings.position_ids"] = torch.arange(t["max_positions"]).expand(1, -1)  # a buffer the package saves
    sd[T + "embeddings.word_embeddings.weight"] = torch.randn(len(VOCAB) + 2, h, generator=g)
    sd[T + "embeddings.position_embeddings.weight"] = torch.randn(t["max_positions"], h, generator=g)
    sd |= ln(T + "embeddings.LayerNorm", h)
    for i in range(t["layers"]):
        b = f"{T}encoder.layer.{i}."
        for part, kv_width in (("attention", h), ("crossattention", v["width"])):
            sd |= lin(b + part + ".self.query", h, h)
            sd |= lin(b + part + ".self.key", kv_width, h) | lin(b + part + ".self.value", kv_width, h)
            sd |= lin(b + part + ".output.dense", h, h) | ln(b + part + ".output.LayerNorm", h)
        sd |= lin(b + "intermediate.dense", h, t["intermediate"])
        sd |= lin(b + "output.dense", t["intermediate"], h) | ln(b + "output.LayerNorm", h)
    # BLIP_Pretrain's projections: saved in ImageReward.pt, unused by the score
    sd |= lin("blip.vision_proj", v["width"], 16) | lin("blip.text_proj", h, 16)

    widths = [h, 1024, 128, 64, 16, 1]
    for index, (n_in, n_out) in zip((0, 2, 4, 6, 7), zip(widths, widths[1:])):
        sd |= lin(f"mlp.layers.{index}", n_in, n_out)
    return sd


def write_checkpoint(directory, seed=0, state=None):
    from transformers import BertTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    torch.save(tiny_state_dict(seed) if state is None else state, directory / "ImageReward.pt")
    med = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
           "hidden_dropout_prob": 0.1, "hidden_size": TEXT["hidden"], "initializer_range": 0.02,
           "intermediate_size": TEXT["intermediate"], "layer_norm_eps": TEXT["eps"],
           "max_position_embeddings": TEXT["max_positions"], "model_type": "bert",
           "num_attention_heads": TEXT["heads"], "num_hidden_layers": TEXT["layers"], "pad_token_id": 0,
           "type_vocab_size": 2, "vocab_size": len(VOCAB) + 2,
           # as in the real med_config.json, encoder_width is not the ViT's width: BLIP overrides it
           "encoder_width": 768, "add_cross_attention": True}
    (directory / "med_config.json").write_text(json.dumps(med))
    tok = directory / "bert-base-uncased"
    tok.mkdir()
    (tok / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    tokenizer = BertTokenizer.from_pretrained(tok, local_files_only=True)
    assert tokenizer.tokenize("A red CAT") == ["a", "red", "cat"]
    tokenizer.save_pretrained(tok)
    return directory


def load(directory, **options):
    options = {"vision_heads": VISION["heads"], **options}
    return rewards.load("imagereward", path=str(directory / "ImageReward.pt"),
                        med_config=str(directory / "med_config.json"),
                        tokenizer=str(directory / "bert-base-uncased"), **options)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("imagereward"))


@pytest.fixture(scope="module")
def reward(ckpt):
    return load(ckpt)


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(len(PROMPTS), 40, 52, 3), dtype=np.uint8)


# --- the reference: plain torch on the raw state dict ---------------------------------------------

def token_ids(prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[CLS] words [SEP] [PAD]..., to 35 (the package's padding='max_length', max_length=35)."""
    ids = [VOCAB.index("[CLS]")] + [VOCAB.index(w) for w in prompt.lower().split()][:33] + [VOCAB.index("[SEP]")]
    mask = [1] * len(ids) + [0] * (35 - len(ids))
    return torch.tensor([ids + [0] * (35 - len(ids))]), torch.tensor([mask])


def attention(q, k, v, heads, key_mask=None):
    """Multi-head softmax(q k^T / sqrt(d)) v; heads are contiguous slices of the feature axis."""
    B, Lq, D = q.shape
    d = D // heads
    q, k, v = (x.reshape(B, x.shape[1], heads, d).transpose(1, 2) for x in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask.bool()[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, Lq, D)


def reference_score(sd, pixels, input_ids, mask) -> torch.Tensor:
    W = lambda name: (sd[name + ".weight"], sd[name + ".bias"])  # noqa: E731
    linear = lambda x, name: F.linear(x, *W(name))  # noqa: E731
    norm = lambda x, name, eps: F.layer_norm(x, x.shape[-1:], *W(name), eps=eps)  # noqa: E731

    # BLIP ViT (timm): patches, [cls] + pos_embed, pre-norm blocks with a fused qkv, final norm (eps 1e-6)
    P, D = "blip.visual_encoder.", VISION["width"]
    x = F.conv2d(pixels, *W(P + "patch_embed.proj"), stride=VISION["patch"]).flatten(2).transpose(1, 2)
    x = torch.cat([sd[P + "cls_token"].expand(len(x), -1, -1), x], 1) + sd[P + "pos_embed"]
    for i in range(VISION["depth"]):
        b = f"{P}blocks.{i}."
        q, k, v = linear(norm(x, b + "norm1", 1e-6), b + "attn.qkv").split(D, dim=-1)
        x = x + linear(attention(q, k, v, VISION["heads"]), b + "attn.proj")
        x = x + linear(F.gelu(linear(norm(x, b + "norm2", 1e-6), b + "mlp.fc1")), b + "mlp.fc2")
    image = norm(x, P + "norm", 1e-6)

    # BLIP med.py BERT in 'multimodal' mode: post-norm layers, self-attention (padding masked), then
    # cross-attention to every image token, then the feed-forward
    T, eps, heads = "blip.text_encoder.", TEXT["eps"], TEXT["heads"]
    h = sd[T + "embeddings.word_embeddings.weight"][input_ids] + sd[T + "embeddings.position_embeddings.weight"][:35]
    h = norm(h, T + "embeddings.LayerNorm", eps)
    for i in range(TEXT["layers"]):
        b = f"{T}encoder.layer.{i}."
        s = b + "attention."
        a = attention(linear(h, s + "self.query"), linear(h, s + "self.key"), linear(h, s + "self.value"), heads, mask)
        h = norm(linear(a, s + "output.dense") + h, s + "output.LayerNorm", eps)
        c = b + "crossattention."
        a = attention(linear(h, c + "self.query"), linear(image, c + "self.key"), linear(image, c + "self.value"),
                      heads)
        h = norm(linear(a, c + "output.dense") + h, c + "output.LayerNorm", eps)
        f = linear(F.gelu(linear(h, b + "intermediate.dense")), b + "output.dense")
        h = norm(f + h, b + "output.LayerNorm", eps)

    r = h[:, 0]
    for index in (0, 2, 4, 6, 7):  # dropouts are identities at inference, and there are no activations
        r = linear(r, f"mlp.layers.{index}")
    return ((r - PACKAGE_MEAN) / PACKAGE_STD).squeeze(1)


def normalised(image_u8: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(np.array(image_u8)).permute(2, 0, 1).double() / 255
    return ((x - torch.tensor(CLIP_MEAN, dtype=torch.float64)[:, None, None])
            / torch.tensor(CLIP_STD, dtype=torch.float64)[:, None, None]).float()


def test_matches_a_plain_torch_forward_of_the_raw_checkpoint(ckpt, reward):
    sd = torch.load(ckpt / "ImageReward.pt", weights_only=True)
    rng = np.random.default_rng(1)
    # at the ViT's own size (32), the package's resize and centre crop leave the pixels as they are
    imgs = rng.integers(0, 256, size=(3, 32, 32, 3), dtype=np.uint8)
    prompts = ["a red cat", "the green tree in a field and a blue dog on a red mat", "text"]
    got = reward.score(imgs, prompts)["score"]
    assert got.shape == (3,) and got.dtype == torch.float32
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids, mask = token_ids(prompt)
            expected = reference_score(sd, normalised(imgs[i])[None], ids, mask)
            torch.testing.assert_close(got[i : i + 1], expected, atol=1e-5, rtol=1e-5)


def test_tokens_are_cls_words_sep_padded_to_35(reward):
    enc = reward.tokenizer(["a red cat"], padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    ids, mask = token_ids("a red cat")
    assert enc["input_ids"].tolist() == ids.tolist() and enc["attention_mask"].tolist() == mask.tolist()
    # BLIP's special tokens come right after the vocabulary, as [DEC] = 30522 and [ENC] = 30523 in bert-base
    assert reward.tokenizer.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [len(VOCAB), len(VOCAB) + 1]


def test_scores_batches_of_any_form(reward, images):
    from PIL import Image

    out = reward.score(images, PROMPTS)
    assert set(out) == {"score"}
    score = out["score"]
    assert score.shape == (len(PROMPTS),) and score.dtype == torch.float32 and torch.isfinite(score).all()
    assert score.std() > 0
    torch.testing.assert_close(reward.score(images, PROMPTS)["score"], score, rtol=0, atol=0)  # deterministic
    torch.testing.assert_close(reward.score([Image.fromarray(a) for a in images], PROMPTS)["score"], score)
    as_float = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    torch.testing.assert_close(reward.score(as_float, PROMPTS)["score"], score)


def test_batch_size_does_not_change_scores(ckpt, reward, images):
    whole = reward.score(images, PROMPTS)["score"]
    for batch_size in (1, 2):
        chunked = load(ckpt, batch_size=batch_size).score(images, PROMPTS)["score"]
        torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-5)


def test_scores_depend_on_prompt_and_image(reward, images):
    score = reward.score(images, PROMPTS)["score"]
    other_prompts = reward.score(images, PROMPTS[1:] + PROMPTS[:1])["score"]
    assert (other_prompts - score).abs().min() > 1e-4
    same_prompt = reward.score(images, [PROMPTS[0]] * len(PROMPTS))["score"]
    assert (same_prompt - same_prompt[0]).abs()[1:].min() > 1e-4
    assert reward.score(images[:0], [])["score"].shape == (0,)
    with pytest.raises(ValueError, match="2 images and 1 prompts"):
        reward.score(images[:2], PROMPTS[:1])


def test_long_prompts_are_truncated_to_35_tokens(reward, images):
    words = " ".join(WORDS * 3).split()
    assert len(words) > 40
    long, cut = " ".join(words), " ".join(words[:33])  # [CLS] + 33 words + [SEP] = 35
    scores = reward.score(images[:2], [long, cut])["score"]
    assert torch.isfinite(scores).all()
    torch.testing.assert_close(reward.score(images[:1], [long])["score"], reward.score(images[:1], [cut])["score"])


def test_preprocess_resizes_the_short_side_and_centre_crops():
    from PIL import Image

    from stepfast.rewards.imagereward import preprocess

    rng = np.random.default_rng(2)
    wide = Image.fromarray(rng.integers(0, 256, size=(40, 61, 3), dtype=np.uint8))  # h=40, w=61
    # torchvision Resize(32): h -> 32, w -> int(32 * 61 / 40) = 48 (floored), bicubic; then the crop
    # starts at round((48 - 32) / 2) = 8
    expected = normalised(np.asarray(wide.resize((48, 32), Image.BICUBIC))[:, 8:40])
    torch.testing.assert_close(preprocess(wide, 32), expected, atol=1e-6, rtol=0)
    tall = Image.fromarray(rng.integers(0, 256, size=(45, 32, 3), dtype=np.uint8))  # no resize, crop rows 6..38
    torch.testing.assert_close(preprocess(tall, 32), normalised(np.asarray(tall)[6:38]), atol=1e-6, rtol=0)


def test_missing_files_are_named(ckpt, tmp_path):
    paths = dict(path=str(ckpt / "ImageReward.pt"), med_config=str(ckpt / "med_config.json"),
                 tokenizer=str(ckpt / "bert-base-uncased"))
    with pytest.raises(TypeError, match="needs path=.*ImageReward.pt"):
        rewards.load("imagereward", med_config=paths["med_config"], tokenizer=paths["tokenizer"])
    with pytest.raises(TypeError, match="needs tokenizer=.*bert-base-uncased"):
        rewards.load("imagereward", path=paths["path"], med_config=paths["med_config"])
    for option in paths:
        nowhere = str(tmp_path / "nowhere")
        with pytest.raises(FileNotFoundError, match=f"{option}='{nowhere}'"):
            rewards.load("imagereward", **{**paths, option: nowhere})
    empty = tmp_path / "empty_tokenizer"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer=.*neither vocab.txt nor tokenizer.json"):
        rewards.load("imagereward", **{**paths, "tokenizer": str(empty)}, vision_heads=VISION["heads"])


def test_rejects_other_checkpoints(ckpt, tmp_path):
    def load_state(state, **options):
        torch.save(state, tmp_path / "other.pt")
        return rewards.load("imagereward", path=str(tmp_path / "other.pt"), med_config=str(ckpt / "med_config.json"),
                            tokenizer=str(ckpt / "bert-base-uncased"), **{"vision_heads": VISION["heads"], **options})

    # the LAION aesthetic predictor's MLP: keys of another model altogether
    aesthetic = {f"layers.{i}.weight": torch.zeros(2, 2) for i in (0, 2, 4, 6, 7)}
    with pytest.raises(ValueError, match=r"not an ImageReward checkpoint.*missing keys blip\.visual_encoder\.\*"):
        load_state(aesthetic)
    # a BLIP checkpoint in transformers' names (vision_model.*) rather than the package's
    hf_named = {k.replace("blip.visual_encoder.", "vision_model."): v for k, v in tiny_state_dict(0).items()}
    with pytest.raises(ValueError, match=r"missing keys blip\.visual_encoder\.\*"):
        load_state(hf_named)
    state = tiny_state_dict(0)
    del state["blip.text_encoder.encoder.layer.1.crossattention.self.key.weight"]
    state["blip.text_encoder.pooler.dense.weight"] = torch.zeros(TEXT["hidden"], TEXT["hidden"])
    with pytest.raises(ValueError, match=r"missing keys blip\.text_encoder\.encoder\.layer\.1\.crossattention\.self"
                                         r"\.key\.weight; unexpected keys blip\.text_encoder\.pooler\.dense\.weight"):
        load_state(state)
    state = tiny_state_dict(0)
    state["blip.visual_encoder.blocks.0.attn.q_bias"] = torch.zeros(VISION["width"])
    with pytest.raises(ValueError, match=r"unexpected keys blip\.visual_encoder\.blocks\.0\.attn\.q_bias"):
        load_state(state)
    state = tiny_state_dict(0)
    state["blip.text_encoder.encoder.layer.0.intermediate.dense.weight"] = torch.zeros(7, TEXT["hidden"])
    with pytest.raises(ValueError, match=r"does not match the ImageReward architecture.*shapes of blip\.text_encoder"
                                         r"\.encoder\.layer\.0\.intermediate\.dense\.weight \(7, 32\) "
                                         r"\(expected \(64, 32\)\)"):
        load_state(state)
    state = tiny_state_dict(0)
    state["blip.visual_encoder.blocks.1.attn.qkv.weight"] = torch.zeros(3 * VISION["width"], 8)
    with pytest.raises(ValueError, match=r"shapes of blip\.visual_encoder\.blocks\.1\.attn\.qkv\.weight \(144, 8\)"):
        load_state(state)
    with pytest.raises(ValueError, match="48 wide.*vision_heads="):
        load_state(tiny_state_dict(0), vision_heads=None)
    with pytest.raises(ValueError, match="vision_heads=5 does not divide the ViT width 48"):
        load_state(tiny_state_dict(0), vision_heads=5)
    torch.save({"model": tiny_state_dict(0)}, tmp_path / "wrapped.pt")
    with pytest.raises(ValueError, match="is not a state dict"):
        rewards.load("imagereward", path=str(tmp_path / "wrapped.pt"), med_config=str(ckpt / "med_config.json"),
                     tokenizer=str(ckpt / "bert-base-uncased"), vision_heads=VISION["heads"])
