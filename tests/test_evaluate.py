"""The evaluation command and its in-process entry point."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from stepfast import evaluate as ev
from stepfast import heldout
from stepfast.data.shapeeval import CATEGORIES, load_metadata
from stepfast.models import EMBEDDED_MODEL, load_lora, load_pipeline, load_transformer
from stepfast.models.tiny import tiny_pipeline_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_pipeline_dir(tmp_path_factory.mktemp("tiny"), seed=0)
    return path, load_pipeline(path)


class CountingReward:
    """Scores every image by its mean brightness; records what it was given."""

    def __init__(self):
        self.calls = []

    def score(self, images, prompts, metadata=None):
        self.calls.append((images, list(prompts), metadata))
        bright = torch.as_tensor(np.asarray(images), dtype=torch.float32).mean(dim=(1, 2, 3)) / 255
        return {"score": bright, "strict": (bright > 0).float(), "category": torch.zeros(len(prompts))}


def test_overall_is_the_mean_over_categories_not_over_images():
    tags = ["counting"] * 3 + ["position"]
    table = heldout.geneval_table(tags, np.array([1.0, 1.0, 1.0, 0.0]), np.array([1.0, 0.5, 0.0, 0.25]))
    assert table["categories"]["counting"] == {"strict": 1.0, "score": 0.5, "n": 3}
    assert table["categories"]["position"] == {"strict": 0.0, "score": 0.25, "n": 1}
    assert table["overall"]["strict"] == pytest.approx(0.5)  # images would say 0.75
    assert table["overall"]["score"] == pytest.approx(0.375)
    assert list(table["categories"]) == ["counting", "position"]  # GenEval's order


def records(strict: dict[tuple[str, str], list[float]]) -> list[dict]:
    """Evaluation "samples" records: {(tag, prompt): strict of seeds 0, 1, ...}."""
    return [{"prompt": prompt, "tag": tag, "seed": seed, "strict": float(x), "score": float(x)}
            for (tag, prompt), values in strict.items() for seed, x in enumerate(values)]  # fmt: skip


def test_paired_gain_is_the_overall_difference_with_a_bootstrap_standard_error():
    rng = np.random.default_rng(1)
    before = {("colors", f"p{i}"): rng.integers(0, 2, 4) for i in range(6)}
    before.update({("single_object", "square"): rng.integers(0, 2, 32)})
    after = {k: np.where(rng.random(len(v)) < 0.3, 1 - v, v) for k, v in before.items()}
    gain = heldout.paired_gain(records(before), records(after))
    tables = [heldout.geneval_table([s["tag"] for s in r], np.array([s["strict"] for s in r]), np.array([0.0] * len(r)))
              for r in (records(before), records(after))]  # fmt: skip
    assert gain["gain"] == pytest.approx(tables[1]["overall"]["strict"] - tables[0]["overall"]["strict"], abs=1e-12)
    # One category of one prompt: the bootstrap redraws its seeds, so the standard error is that of a
    # mean of n paired differences, std / sqrt(n) (the bootstrap's own std uses 1/n, not 1/(n-1)).
    one = {("single_object", "square"): before[("single_object", "square")]}
    moved = {("single_object", "square"): after[("single_object", "square")]}
    d = (moved[("single_object", "square")] - one[("single_object", "square")]).astype(float)
    single = heldout.paired_gain(records(one), records(moved), resamples=4000)
    assert single["se"] == pytest.approx(d.std(ddof=0) / np.sqrt(len(d)), rel=0.08)
    # The same images before and after: no gain and no spread; the same draws give the same answer.
    assert heldout.paired_gain(records(before), records(before)) == {"gain": 0.0, "se": 0.0, "resamples": 1000}
    assert heldout.paired_gain(records(before), records(after)) == gain


def test_paired_gain_of_one_image_a_category_has_no_standard_error():
    """Nothing to redraw: no standard error (not a spread of 0)."""
    before = records({("colors", "a"): [0], ("counting", "b"): [1]})
    after = records({("colors", "a"): [1], ("counting", "b"): [1]})
    assert heldout.paired_gain(before, after) == {"gain": 0.5, "se": None, "resamples": 0}
    two = records({("colors", "a"): [0, 1], ("counting", "b"): [1]})
    assert heldout.paired_gain(two, two)["se"] == 0.0  # two images of colors: redrawn, and equal


def test_a_run_says_its_held_out_gain_or_why_it_has_none():
    """The trainer printed nothing when both evaluations ran but did not pair up (eval settings
    changed at a resume), so a run ended without a gain and without a word."""
    from stepfast.report import gain_line

    before = records({("colors", "a"): [0, 1], ("counting", "b"): [1, 0]})
    after = records({("colors", "a"): [1, 1], ("counting", "b"): [1, 0]})
    gain = heldout.paired_gain(before, after)
    assert gain_line({"before": {"samples": before}, "after": {"samples": after}}) == (
        f"held-out gain {gain['gain']:+.3f} ± {gain['se']:.3f} (one standard error over the prompts and seeds drawn)")
    assert gain_line({"before": {"samples": before[:1]}, "after": {"samples": after[:1]}}) == (
        "held-out gain +1.000 (one image a category: no standard error)")
    other_seeds = [{**r, "seed": r["seed"] + 4} for r in after]
    assert gain_line({"before": {"samples": before}, "after": {"samples": other_seeds}}) == (
        "held-out gain not computed: the evaluations before and after drew other prompts or seeds (eval settings "
        "changed at a resume?); the overall scores above are not of the same images")
    no_pass = [{**r, "strict": float("nan")} for r in after]
    assert gain_line({"before": {"samples": before}, "after": {"samples": no_pass}}) == (
        "held-out gain not computed: the eval reward gives no pass/fail (strict) to compare")
    assert gain_line({"before": {"samples": before}}) is None and gain_line({}) is None
    assert gain_line({"before": {"samples": []}, "after": {"samples": []}}) is None  # no image records kept


def test_a_run_names_what_its_evaluation_measures():
    """The default run evaluates its training prompts (with seeds training never draws): its gain is
    named so, where a run on other eval prompts says held-out."""
    from stepfast.config import load_config
    from stepfast.report import eval_measure, gain_line

    assert eval_measure(load_config("default")) == "training prompts, unseen seeds"
    assert eval_measure(load_config("shapeeval_heldout")) == "held-out prompts"
    assert eval_measure(load_config("default", ["eval.prompts=shapeeval:test"])) == "held-out prompts"
    before = records({("colors", "a"): [0, 1], ("counting", "b"): [1, 0]})
    line = gain_line({"before": {"samples": before}, "after": {"samples": before}},
                     measure="training prompts, unseen seeds")
    assert line.startswith("gain (training prompts, unseen seeds) +0.000 ± 0.000 (one standard error")


def test_paired_gain_standard_error_redraws_the_prompts_of_each_category():
    """With every seed of a prompt giving the same difference, only the prompt draw spreads the
    gain: its standard error is that of the mean over categories of each category's prompt mean,
    sqrt(sum_c var_c / n_c) / C (variances over prompts, 1/n as the bootstrap's)."""
    colors = [1, 0, 0, 1, 0]
    counting = [-1, 0, 1, 1]
    before = {("colors", f"c{i}"): [0] * 4 for i in range(5)}
    before.update({("counting", f"n{i}"): [1] * 4 for i in range(4)})
    after = {("colors", f"c{i}"): [d] * 4 for i, d in enumerate(colors)}
    after.update({("counting", f"n{i}"): [1 + d] * 4 for i, d in enumerate(counting)})
    gain = heldout.paired_gain(records(before), records(after), resamples=4000)
    assert gain["gain"] == pytest.approx((np.mean(colors) + np.mean(counting)) / 2)
    want = np.sqrt(np.var(colors) / 5 + np.var(counting) / 4) / 2
    assert gain["se"] == pytest.approx(want, rel=0.08)


def test_paired_gain_needs_the_same_draws_with_a_pass_fail():
    before = records({("colors", "a"): [1, 0], ("counting", "b"): [0, 0]})
    for after in (before[:-1], before + before[:1], [dict(s, seed=s["seed"] + 1) for s in before],
                  [dict(s, tag="position") for s in before], [dict(s, strict=float("nan")) for s in before]):
        assert heldout.paired_gain(before, after) is None
    assert heldout.paired_gain([], []) is None
    # a prompt file that lists a prompt twice draws each (prompt, seed) twice: still paired, in order
    twice = before + before
    gain = heldout.paired_gain(twice, [dict(s, strict=1.0) for s in twice])
    assert gain is not None and gain["gain"] == pytest.approx(((1 - 0.5) + (1 - 0.0)) / 2)


def test_limit_spreads_prompts_over_categories():
    metadata = load_metadata("test")
    picked = heldout.spread_over_categories(metadata, 8)
    assert len(picked) == 8
    assert {m["tag"] for m in picked} == set(CATEGORIES)
    assert len({m["prompt"] for m in picked}) == 8
    for tag in CATEGORIES:  # each category's first prompts, in file order
        mine = [m for m in picked if m["tag"] == tag]
        assert mine == [m for m in metadata if m["tag"] == tag][: len(mine)], tag


def test_small_categories_get_more_seeds_up_to_min_images():
    metadata = [{"prompt": "a", "tag": "single_object"}, {"prompt": "b", "tag": "counting"},
                {"prompt": "c", "tag": "counting"}, {"prompt": "d", "tag": "counting"}] + [
                {"prompt": f"e{i}", "tag": "colors"} for i in range(9)]  # fmt: skip
    plan = heldout.plan_samples(metadata, seeds=[3, 5], min_images=9)
    seeds = {}
    for meta, seed in plan:
        seeds.setdefault(meta["prompt"], []).append(seed)
    assert seeds["a"] == [3, 5, 6, 7, 8, 9, 10, 11, 12]  # 1 prompt: 9 images, numbered on from the last seed
    assert seeds["b"] == seeds["d"] == [3, 5, 6]  # 3 prompts: ceil(9 / 3) = 3 seeds each
    assert all(seeds[f"e{i}"] == [3, 5] for i in range(9))  # 18 images already
    assert [m["prompt"] for m, _ in plan[:9]] == ["a"] * 9  # prompt-major
    assert len(heldout.plan_samples(metadata, seeds=2)) == 2 * len(metadata)  # min_images=0: GenEval's plan
    # at least min_images: 10 images over 3 counting prompts are 4 seeds each, not 3
    seeds = Counter(m["prompt"] for m, _ in heldout.plan_samples(metadata, seeds=[3, 5], min_images=10))
    assert (seeds["a"], seeds["b"], seeds["e0"]) == (10, 4, 2)
    with pytest.raises(ValueError, match="min_images"):
        heldout.plan_samples(metadata, 2, min_images=-1)


def test_summary_counts_images_names_untagged_categories_and_tables_strict_before_score():
    plan = [({"prompt": "a photo of a circle"}, 0), ({"prompt": "a photo of two circles"}, 0),
            ({"prompt": "a photo of a cat"}, 0), ({"prompt": "a photo of a square", "tag": "colors"}, 1),
            ({"prompt": "a photo of a square", "tag": "colors"}, 2)]
    scored = {"strict": np.array([1.0, 0.0, 1.0, 0.0, 1.0]), "score": np.array([0.75, 0.5, 1.0, 0.25, 0.25]),
              "category": np.array([0, 2, -1, 0, 0]), "pixels": np.zeros((5, 8, 8, 3), np.uint8), "seconds": {}}
    result = heldout.summarise(plan, scored, {})
    assert [s["tag"] for s in result["samples"]] == ["single_object", "counting", "other", "colors", "colors"]
    assert result["overall"]["n"] == 5 and result["categories"]["colors"]["n"] == 2  # images, not categories
    table = heldout.markdown_table(result).splitlines()
    assert table[0] == "| category | strict | score | n |"
    assert "| single_object | 1.000 | 0.750 | 1 |" in table and "| colors | 0.500 | 0.250 | 2 |" in table
    assert table[-1] == "| **overall** | **0.625** | **0.625** | 5 |"


@pytest.mark.parametrize("n, world", [(7, 2), (10, 3), (2, 3), (5, 1)])
def test_shards_pad_to_equal_lengths_and_unshard_restores_the_order(n, world):
    plan = list(range(n))
    shares = [heldout.shard(plan, rank, world) for rank in range(world)]
    assert len({len(share) for share, _ in shares}) == 1  # the same pipeline calls on every rank
    parts = []
    for share, real in shares:
        values = np.array(share[:real], dtype=float)
        parts.append({"strict": values, "score": values * 2, "category": values, "seconds": {"sampling": real},
                      "pixels": np.repeat(values.astype(np.uint8)[:, None, None, None], 3, axis=3)})  # fmt: skip
    merged = heldout.unshard(parts, world)
    assert merged["strict"].tolist() == plan and merged["score"].tolist() == [2 * p for p in plan]
    assert merged["pixels"][:, 0, 0, 0].tolist() == plan
    assert merged["seconds"]["sampling"] == max(real for _, real in shares)


class _Scores:
    """An evaluation reward that returns what it is given, whatever the images."""

    def __init__(self, **out):
        self.out = out

    def score(self, images, prompts, metadata=None):
        return self.out


@pytest.mark.parametrize("out, message", [
    ({"score": torch.tensor([0.5, float("nan"), 0.2])},
     "reward 'judge' returned NaN scores for 1 of 3 images: prompt 'b', seed 0$"),
    ({"score": torch.zeros(4)}, r"reward 'judge' returned 'score' of shape \(4,\), expected \[3\]"),
    ({"score": torch.zeros(3), "strict": torch.zeros(2)}, r"'strict' of shape \(2,\)"),
])  # fmt: skip
def test_evaluation_scores_are_checked_and_a_bad_one_names_its_image(monkeypatch, out, message):
    """As the training reward's are: a NaN would otherwise be averaged into the held-out table."""
    monkeypatch.setattr(heldout, "sample_images", lambda pipe, prompts, *a: torch.zeros(len(prompts), 3, 8, 8))
    plan = [({"prompt": "a"}, 0), ({"prompt": "b"}, 0), ({"prompt": "a"}, 1)]
    with pytest.raises(ValueError, match=message):
        heldout.draw_and_score(None, plan, 2, 1.0, reward=_Scores(**out), reward_name="judge", progress=False)


def test_prompt_text_file_is_parsed_and_bad_lines_are_named(tmp_path):
    good = tmp_path / "p.txt"
    good.write_text("a photo of two circles\n\na photo of a red square\n")
    assert [m["tag"] for m in ev.read_prompts(str(good))] == ["counting", "colors"]
    bad = tmp_path / "bad.txt"
    bad.write_text("a photo of a circle\na photo of a dog\n")
    with pytest.raises(ValueError, match="bad.txt:2"):
        ev.read_prompts(str(bad))


def test_prompt_files_are_read_as_the_trainer_reads_them(tmp_path):
    """Through stepfast.data.prompts: a byte that is not UTF-8 is named by file and line (not a bare
    'utf-8' codec error), the shipped sets answer to the trainer's names too, and a valid .txt
    (blank lines, CRLF) reads as before."""
    latin = tmp_path / "latin.txt"
    latin.write_bytes("a photo of a circle\na photo of two caf\u00e9s\n".encode("latin-1"))
    with pytest.raises(ValueError, match=f"{latin}:2: not UTF-8 text"):
        ev.read_prompts(str(latin))
    assert_refused_before_the_model_loads("--prompts", latin, f"--prompts: {latin}:2: not UTF-8 text", tmp_path)
    good = tmp_path / "p.txt"
    good.write_bytes(b"a photo of two circles\r\n\n  \na photo of a red square")
    assert [m["tag"] for m in ev.read_prompts(str(good))] == ["counting", "colors"]
    assert ev.read_prompts("shapeeval:test") == ev.read_prompts("test") == load_metadata("test")
    assert ev.read_prompts("shapeeval:train") == ev.read_prompts("train") == load_metadata("train")
    (tmp_path / "folder.txt").mkdir()
    with pytest.raises(ValueError, match="folder.txt is a directory"):
        ev.read_prompts(str(tmp_path / "folder.txt"))
    with pytest.raises(ValueError, match="'tset' is not train, test, shapeeval:train"):
        ev.read_prompts("tset")
    (tmp_path / "prompts").mkdir()  # a folder, with no suffix: named as what it is
    with pytest.raises(ValueError, match=f"prompt file {tmp_path / 'prompts'} is a directory"):
        ev.read_prompts(str(tmp_path / "prompts"))
    with pytest.raises(FileNotFoundError, match=f"prompt file {tmp_path / 'missing.jsonl'} does not exist"):
        ev.read_prompts(str(tmp_path / "missing.jsonl"))


def test_seeds_fix_the_images_whatever_the_batch_size(tiny):
    _, pipe = tiny
    metadata = load_metadata("test")[:3]
    reward = CountingReward()
    a = heldout.evaluate(pipe, metadata, seeds=2, steps=2, batch_size=6, reward=reward, progress=False, keep_images=True)
    b = heldout.evaluate(pipe, metadata, seeds=2, steps=2, batch_size=4, reward=reward, progress=False, keep_images=True)
    # Same noise per (prompt, seed); only float rounding of batched matmuls may move a level.
    diff = np.abs(a["images"].astype(int) - b["images"].astype(int))
    assert diff.max() <= 2 and (diff > 0).mean() < 1e-3
    assert [s["seed"] for s in a["samples"]] == [0, 1] * 3
    assert [s["prompt"] for s in a["samples"]] == [m["prompt"] for m in metadata for _ in range(2)]
    # Different seeds give different images; the reward saw the metadata of each image.
    assert not np.array_equal(a["images"][0], a["images"][1])
    assert reward.calls[0][2][0] is metadata[0] and len(reward.calls[0][1]) == 6
    assert a["overall"]["score"] == pytest.approx(np.mean([s["score"] for s in a["samples"]]))


@pytest.mark.parametrize("trained", ["transformer", "frozen"])
def test_a_transformer_in_another_dtype_than_the_frozen_parts_samples(tiny, trained):
    """optim.precision=bf16 with model.dtype=fp32 (DeepSpeed casts the trained transformer), or the
    other way round: the pipeline makes its latents in the text encoders' dtype, and the images are
    those of the all-float32 pipeline up to bf16 rounding. The hooks leave the pipeline as it was."""
    path, _ = tiny
    pipe = load_pipeline(path)
    prompts, seeds = ["a photo of a red circle", "a photo of two squares"], [0, 1]
    reference = heldout.sample_images(pipe, prompts, seeds, 2, 4.5, progress=False)
    parts = [pipe.transformer] if trained == "transformer" else [pipe.text_encoder, pipe.text_encoder_2,
                                                                  pipe.text_encoder_3, pipe.vae]  # fmt: skip
    for part in parts:
        part.to(torch.bfloat16)
    images = heldout.sample_images(pipe, prompts, seeds, 2, 4.5, progress=False)
    assert images.dtype == torch.float32 and (images - reference).abs().mean() < 0.01  # 0.0024 measured
    assert not pipe.transformer._forward_pre_hooks and not pipe.transformer._forward_hooks


def test_min_images_draws_more_seeds_and_the_grid_shows_the_first_ones(tiny):
    _, pipe = tiny
    metadata = load_metadata("test")[:3]  # one prompt in each of three categories
    reward = CountingReward()
    result = heldout.evaluate(pipe, metadata, seeds=2, steps=2, min_images=3, batch_size=4, reward=reward,
                         progress=False, keep_images=True)  # fmt: skip
    assert [s["seed"] for s in result["samples"]] == [0, 1, 2] * 3
    assert result["settings"]["seeds"] == [0, 1] and result["settings"]["min_images"] == 3
    assert all(row["n"] == 3 for row in result["categories"].values())
    same = heldout.evaluate(pipe, metadata, seeds=3, steps=2, batch_size=5, reward=reward, progress=False, keep_images=True)
    diff = np.abs(result["images"].astype(int) - same["images"].astype(int))
    assert diff.max() <= 2  # seed 2 is the same image whichever way it was asked for
    grid = heldout.sample_grid(result["images"], result["samples"], columns=2, scale=1)
    line = heldout.GRID_LINE  # the seed and score under each image
    assert grid.size[1] == 3 * (64 + 6 + line) and grid.size[0] == 300 + 2 * (64 + 6)
    titled = heldout.sample_grid(result["images"], result["samples"], columns=2, scale=1, title="after")
    assert titled.size[1] == grid.size[1] + 2 * line + 8  # a header: the title, the key to the frames


def test_grid_frames_say_pass_fail_or_none_and_large_images_shrink():
    """Green for a strict pass, red for a fail, grey where the reward has no pass/fail (NaN is truthy:
    it must not read as a pass); tiles of 256 px for large images, twice the size for small ones."""
    samples = [{"prompt": "p", "tag": "colors", "seed": s, "strict": v, "score": 0.5}
               for s, v in enumerate([1.0, 0.0, float("nan")])]  # fmt: skip
    for side, tile in ((64, 128), (1024, 256)):
        grid = heldout.sample_grid(np.zeros((3, side, side, 3), dtype=np.uint8), samples, columns=3)
        assert grid.size == (300 + 3 * (tile + 6), tile + 6 + heldout.GRID_LINE)
        frames = [grid.getpixel((300 + c * (tile + 6) + 1, 1)) for c in range(3)]
        assert frames == [(40, 200, 60), (210, 50, 50), (120, 120, 120)]


def test_lora_changes_the_samples(tiny, tmp_path):
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig, get_peft_model_state_dict

    path, _ = tiny
    pipe = load_pipeline(path)
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights="gaussian"))
    for name, param in pipe.transformer.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)  # peft starts B at zero: make the LoRA act
    StableDiffusion3Pipeline.save_lora_weights(tmp_path / "lora", get_peft_model_state_dict(pipe.transformer),
                                               transformer_lora_adapter_metadata=pipe.transformer.peft_config["default"].to_dict())  # fmt: skip

    metadata = load_metadata("test")[:2]
    base = heldout.evaluate(load_pipeline(path), metadata, 1, 2, reward=CountingReward(), progress=False, keep_images=True)
    tuned_pipe = load_lora(load_pipeline(path), tmp_path / "lora")
    tuned = heldout.evaluate(tuned_pipe, metadata, 1, 2, reward=CountingReward(), progress=False, keep_images=True)
    assert not np.array_equal(base["images"], tuned["images"])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_lora(load_pipeline(path), tmp_path / "nowhere")


def test_lora_keys_that_reach_no_module_are_an_error_not_the_base_model(tiny, tmp_path, caplog):
    """diffusers drops the keys it cannot place with at most a notice: a LoRA in peft's own key format
    (save_pretrained's base_model.model.*) would sample as the base model, and one with keys of modules
    the model lacks with part of its adapter. Both are named."""
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    path, _ = tiny
    pipe = load_pipeline(path)
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k"]))
    StableDiffusion3Pipeline.save_lora_weights(tmp_path / "lora", get_peft_model_state_dict(pipe.transformer),
                                               transformer_lora_adapter_metadata=pipe.transformer.peft_config["default"].to_dict())  # fmt: skip
    weights = load_file(tmp_path / "lora" / "pytorch_lora_weights.safetensors")
    load_lora(load_pipeline(path), tmp_path / "lora")  # as saved: every tensor placed
    peft_keys = {k.replace("transformer.", "base_model.model.", 1): v for k, v in weights.items()}
    save_file(peft_keys, tmp_path / "peft.safetensors")
    unscaled = "holds no adapter config (lora_alpha, in its metadata): diffusers loads it with lora_alpha = its rank"
    with pytest.warns(UserWarning, match=re.escape(unscaled)), pytest.raises(
            ValueError, match=rf"{tmp_path}/peft.safetensors hold {len(weights)} LoRA tensors, but none of "
                              r"them reached a module of this StableDiffusion3Pipeline \(keys such as "
                              r"'base_model\.model\..*It would sample as the base model does"):  # fmt: skip
        load_lora(load_pipeline(path), tmp_path / "peft.safetensors")
    # diffusers' notice, which calls it "safe to ignore", is dropped: the error says what it means
    assert not [r for r in caplog.records if "No LoRA keys" in r.getMessage()]
    extra = {**weights, **{k.replace("transformer_blocks.0.", "nosuch.0.", 1): v.clone() for k, v in weights.items()
                           if k.startswith("transformer.transformer_blocks.0.")}}  # fmt: skip
    save_file(extra, tmp_path / "extra.safetensors")
    with pytest.warns(UserWarning, match=re.escape(unscaled)), pytest.raises(
            ValueError, match=rf"hold {len(extra)} LoRA tensors, but only {len(weights)} of them reached.*"
                              "It would sample with part of the adapter"):  # fmt: skip
        load_lora(load_pipeline(path), tmp_path / "extra.safetensors")
    # a pickled state dict is checked alike, and never holds the config
    unpickled = "holds no adapter config (lora_alpha, a pickled state dict has no metadata for it)"
    torch.save(peft_keys, tmp_path / "peft.bin")
    with pytest.warns(UserWarning, match=re.escape(unpickled)), pytest.raises(
            ValueError, match=rf"{tmp_path}/peft.bin hold {len(weights)} LoRA tensors, but none of them"):
        load_lora(load_pipeline(path), tmp_path / "peft.bin")
    torch.save(weights, tmp_path / "lora.bin")
    with pytest.warns(UserWarning, match=re.escape(unpickled)):
        load_lora(load_pipeline(path), tmp_path / "lora.bin")
    (tmp_path / "bad.bin").write_bytes((tmp_path / "lora.bin").read_bytes()[:100])  # cut short
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=rf"cannot load LoRA weights {tmp_path}/bad.bin: "
                                                                     "not a readable state dict"):  # fmt: skip
        load_lora(load_pipeline(path), tmp_path / "bad.bin")


def test_the_command_says_a_lora_lacks_its_adapter_config_in_one_line(tiny, tmp_path):
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig, get_peft_model_state_dict

    path, _ = tiny
    pipe = load_pipeline(path)
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q"]))
    StableDiffusion3Pipeline.save_lora_weights(tmp_path / "lora", get_peft_model_state_dict(pipe.transformer))
    proc = run_evaluate("--model", path, "--lora", tmp_path / "lora", "--limit", "1", "--seeds", "1", "--min-images",
                        "0", "--steps", "1", "--out", tmp_path / "out")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "adapter config" in line]
    assert lines == [f"warning: {tmp_path}/lora/pytorch_lora_weights.safetensors holds no adapter config (lora_alpha, "
                     "in its metadata): diffusers loads it with lora_alpha = its rank, which is not the trained scale "
                     "when alpha was another (stepfast's checkpoints before it saved the config: alpha = 2 x rank, "
                     "loaded at half the scale)"], proc.stderr[-2000:]  # fmt: skip
    assert "UserWarning" not in proc.stderr and "No LoRA keys" not in proc.stderr


def test_evaluation_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "eval"
    result = ev.main(
        ["--model", EMBEDDED_MODEL, "--limit", "8", "--seeds", "2", "--min-images", "4", "--steps", "6", "--out", str(out)]
    )
    printed = capsys.readouterr().out
    assert "| **overall** |" in printed and "| counting |" in printed
    assert "8 prompts x 2+ seeds (24 images), 6 steps" in printed  # --min-images topped some up
    saved = json.loads((out / "results.json").read_text())
    assert set(saved["categories"]) == set(CATEGORIES)
    assert saved["settings"]["steps"] == 6 and saved["settings"]["seeds"] == [0, 1]
    # the trainer's batch size by default (the images depend on it by rounding), recorded with the device
    from stepfast.config import EvalConfig

    assert saved["settings"]["batch_size"] == EvalConfig().batch_size == 64 and saved["settings"]["device"] == "cpu"
    # 8 prompts: counting and colors get two, the other categories one, drawn with 4 seeds
    assert len(saved["samples"]) == 24 and all(row["n"] == 4 for row in saved["categories"].values())
    means = [saved["categories"][c]["strict"] for c in CATEGORIES]
    assert saved["overall"]["strict"] == pytest.approx(np.mean(means))
    for sample in saved["samples"]:
        assert sample["strict"] in (0.0, 1.0) and 0.0 <= sample["score"] <= 1.0
        assert sample["strict"] <= sample["score"] + 1e-6  # a strict pass is a full score
    assert (out / "results.md").read_text().count("\n") == 2 + len(CATEGORIES) + 1
    from PIL import Image

    grid = Image.open(out / "samples.png")
    assert grid.size[1] >= 8 * 64  # one row per prompt
    assert result["overall"]["strict"] == saved["overall"]["strict"]
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md", "samples.png"]  # no .tmp
    # a second evaluation into the same folder: refused before sampling, the first one kept ...
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    again = ["--model", EMBEDDED_MODEL, "--limit", "1", "--seeds", "1", "--min-images", "0", "--steps", "2",
             "--out", str(out)]  # fmt: skip
    with pytest.raises(SystemExit):
        ev.main(again)
    assert f"{out} already holds an evaluation (results.json, results.md, samples.png)" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    # results.json alone gone (deleted; or another tool's table kept beside its images): still refused
    (out / "results.json").unlink()
    del files["results.json"]
    with pytest.raises(SystemExit):
        ev.main(again)
    assert f"{out} already holds an evaluation (results.md, samples.png): give another --out" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    # ... unless asked to replace it
    ev.main(again + ["--overwrite"])
    assert len(json.loads((out / "results.json").read_text())["samples"]) == 1  # one prompt, one seed
    assert "1 prompt x 1 seed (1 image), 2 steps" in capsys.readouterr().out  # no top-up: no "+"


@pytest.mark.parametrize("flag", ["--out", "--prompts", "--model", "--lora", "--transformer"])
def test_an_empty_path_is_refused_not_read_as_the_current_directory(flag, capsys, tmp_path, monkeypatch):
    """`--out "$OUT"` with OUT unset would write results.json into the current directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        ev.main([flag, ""])
    assert info.value.code == 2
    assert f"argument {flag}: an empty path (an unset shell variable?)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_in_the_evaluation_command_is_one_line(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(heldout, "evaluate", interrupted)
    proc = run_evaluate("--limit", "1", "--seeds", "1", "--steps", "1", "--out", tmp_path / "out")
    assert proc.returncode == 130
    assert proc.stderr.endswith("\npython -m stepfast.evaluate: interrupted (the results are written at the end)\n")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_evaluate_rejects_empty_input(tiny):
    _, pipe = tiny
    with pytest.raises(ValueError, match="at least one prompt"):
        heldout.evaluate(pipe, [], reward=CountingReward())
    with pytest.raises(ValueError, match="at least one seed"):
        heldout.evaluate(pipe, load_metadata("test")[:1], seeds=[], reward=CountingReward())


@pytest.mark.parametrize("args, message", [
    (["--lora", "{tmp}/no_lora"], "error: --lora: LoRA weights {tmp}/no_lora do not exist"),
    (["--prompts", "{tmp}/none_metadata.jsonl"], "prompt file {tmp}/none_metadata.jsonl does not exist"),
    (["--model", "{tmp}/no_model"], "error: --model: pipeline directory {tmp}/no_model does not exist"),
])  # fmt: skip
def test_evaluation_command_names_bad_input_without_a_traceback(tmp_path, args, message):
    out = tmp_path / "out"
    proc = run_evaluate(*(a.format(tmp=tmp_path) for a in args), "--out", str(out))
    assert proc.returncode == 2
    assert message.format(tmp=tmp_path) in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_the_evaluation_command_is_its_cli():
    """`python -m stepfast.evaluate` runs cli(), which the other tests call in-process."""
    cmd = [sys.executable, "-m", "stepfast.evaluate", "--model", "/nonexistent/model", "--out", "/nonexistent/out"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "python -m stepfast.evaluate: error: --model: pipeline directory /nonexistent/model does not exist" in proc.stderr


def test_evaluation_command_names_a_tag_that_is_not_text(tmp_path):
    """The table groups images by tag: a list there raised an unhashable-type TypeError."""
    prompts = tmp_path / "geneval_metadata.jsonl"
    prompts.write_text('{"tag": ["colors"], "include": [{"class": "circle", "count": 1}], "prompt": "a photo of a circle"}\n')
    message = f"{prompts}:1: 'tag' must be text (a category name), got ['colors']"
    assert_refused_before_the_model_loads("--prompts", prompts, message, tmp_path)


def test_evaluation_command_refuses_records_shapeeval_cannot_draw_before_the_model_loads(tmp_path):
    """A GenEval metadata file ("dog") would score 0 everywhere after minutes of sampling."""
    prompts = tmp_path / "geneval_metadata.jsonl"
    prompts.write_text('{"tag": "single_object", "include": [{"class": "circle", "count": 1}], '
                       '"prompt": "a photo of a circle"}\n\n'
                       '{"tag": "single_object", "include": [{"class": "dog", "count": 1}], '
                       '"prompt": "a photo of a dog"}\n')  # fmt: skip
    # named by its file and line, as the trainer names it (the second record, after a blank line)
    message = f"--prompts: {prompts}:3: the record of prompt 'a photo of a dog': include[0] asks for class 'dog'"
    assert_refused_before_the_model_loads("--prompts", prompts, message, tmp_path)


def run_evaluate(*args) -> SimpleNamespace:
    """`python -m stepfast.evaluate ARGS`, run in this process through the cli() it calls:
    .returncode and .stderr as a subprocess gives them."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = ev.cli([str(a) for a in args])
        except SystemExit as exc:  # argparse's errors
            code = exc.code
    return SimpleNamespace(returncode=code, stderr=err.getvalue())


@pytest.mark.parametrize("out, message", [
    ("{tmp}/results", "--out: {tmp}/results is a file, not a directory"),
    ("{tmp}/results/eval", "--out: cannot create {tmp}/results/eval: {tmp}/results is a file"),
])  # fmt: skip
def test_evaluation_command_checks_out_before_sampling(tmp_path, out, message):
    (tmp_path / "results").write_text("earlier results\n")
    # --size 60 is refused only once the model is loaded: reaching it shows --out was checked before
    proc = run_evaluate("--out", out.format(tmp=tmp_path), "--limit", "1", "--seeds", "1", "--min-images", "0",
                        "--steps", "1", "--size", "60")  # fmt: skip
    assert proc.returncode == 2
    assert message.format(tmp=tmp_path) in proc.stderr and "Traceback" not in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["results"]
    assert (tmp_path / "results").read_text() == "earlier results\n"


def assert_refused_before_the_model_loads(flag: str, path, message: str, tmp_path) -> None:
    """The command names the bad `flag` path and stops before loading the model (a missing model
    that it would otherwise report), writing nothing."""
    out = tmp_path / "out"
    proc = run_evaluate(flag, str(path), "--model", str(tmp_path / "no_model"), "--out", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr and f"error: {flag}" in proc.stderr and "no_model" not in proc.stderr
    assert not out.exists()


def not_lora(kind, tmp_path, model):
    """A path given as --lora that holds no LoRA weights."""
    if kind == "text file":
        path = tmp_path / "notes.txt"
        path.write_text("not weights")
    elif kind == "text file named .safetensors":
        path = tmp_path / "lora.safetensors"
        path.write_text("not weights")
    elif kind == "empty directory":
        path = tmp_path / "lora"
        path.mkdir()
    elif kind == "checkpoint directory":  # its LoRA is in lora/ (here a stand-in file: the hint reads names only)
        path = tmp_path / "checkpoint-000040"
        (path / "lora").mkdir(parents=True)
        (path / "lora" / "pytorch_lora_weights.safetensors").write_text("stand-in")
    else:  # a model's weights: a directory holding one .safetensors file, of no LoRA
        path = model / "transformer"
    return path


@pytest.mark.parametrize("kind, message", [
    ("text file", "LoRA weights {path} are not a .safetensors (or .bin) file: expected a directory holding "
                  "pytorch_lora_weights.safetensors, or that .safetensors file"),
    ("text file named .safetensors", "LoRA weights {path} are not a readable .safetensors file"),
    ("empty directory", "LoRA directory {path} holds no .safetensors files: expected"),
    ("checkpoint directory", "LoRA directory {path} holds no .safetensors files (a checkpoint? its LoRA is "
                             "{path}/lora): expected"),
    ("transformer weights", "{path}/diffusion_pytorch_model.safetensors holds no LoRA weights"),
])  # fmt: skip
def test_load_lora_names_what_is_not_lora_weights(tiny, tmp_path, kind, message):
    model, pipe = tiny
    path = not_lora(kind, tmp_path, model)
    with pytest.raises(ValueError) as info:
        load_lora(pipe, path)
    assert message.format(path=path) in str(info.value)
    assert_refused_before_the_model_loads("--lora", path, message.format(path=path), tmp_path)


@pytest.mark.parametrize("kind, message", [
    ("missing", "transformer directory {path} does not exist"),
    ("file", "transformer {path} is not a directory (expected config.json and diffusion_pytorch_model.safetensors)"),
    ("empty", "transformer directory {path} lacks config.json, diffusion_pytorch_model.safetensors (diffusers' "
              "format, as a full fine-tuning checkpoint's transformer/ folder)"),
    ("lora", "transformer directory {path} lacks config.json, diffusion_pytorch_model.safetensors (it holds a "
             "LoRA, {path}: load that as a LoRA, not as a transformer)"),
    # a LoRA run's checkpoint, and a full fine-tuning's (or a pipeline) where its transformer/ was meant
    ("lora checkpoint", "transformer directory {path} lacks config.json, diffusion_pytorch_model.safetensors "
                        "(it holds a LoRA, {path}/lora: load that as a LoRA, not as a transformer)"),
    ("checkpoint", "transformer directory {path} lacks config.json, diffusion_pytorch_model.safetensors (a "
                   "checkpoint or a pipeline? its transformer is {path}/transformer)"),
])  # fmt: skip
def test_load_transformer_names_what_is_not_a_transformer(tiny, tmp_path, kind, message):
    model, pipe = tiny
    path = tmp_path / "transformer"
    if kind == "file":
        path.write_text("not weights")
    elif kind != "missing":
        path.mkdir()
    if kind == "lora":
        (path / "pytorch_lora_weights.safetensors").write_bytes(b"")
    elif kind == "lora checkpoint":
        (path / "lora").mkdir()
        (path / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"")
        (path / "state.pt").write_bytes(b"")
    elif kind == "checkpoint":
        (path / "transformer").mkdir()
        (path / "transformer" / "config.json").write_text("{}")
    with pytest.raises((FileNotFoundError, ValueError)) as info:
        load_transformer(pipe, path)
    assert message.format(path=path) in str(info.value)
    assert_refused_before_the_model_loads("--transformer", path, message.format(path=path), tmp_path)


def test_load_transformer_refuses_another_architecture_and_keeps_the_pipeline(tiny):
    model, pipe = tiny
    own = pipe.transformer
    with pytest.raises(ValueError, match="is not this pipeline's architecture"):
        load_transformer(pipe, f"{EMBEDDED_MODEL}/transformer")
    assert pipe.transformer is own


def test_lora_and_transformer_are_one_or_the_other(tmp_path):
    proc = run_evaluate("--lora", str(tmp_path), "--transformer", str(tmp_path), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--device", "bogus"], "--device: 'bogus' is not a torch device"),
    (["--size", "0"], "--size must be positive, got 0"),
    (["--size", "-64"], "--size must be positive, got -64"),
    (["--cfg", "nan"], "--cfg must be a finite number, got nan"),
    (["--cfg", "inf"], "--cfg must be a finite number, got inf"),
    # checked once the model is loaded
    (["--size", "60"], "--size=60: this model draws images whose side is a multiple of 8 px up to 64 px"),
    (["--size", "72"], "--size=72: this model draws images whose side is a multiple of 8 px up to 64 px"),
    pytest.param(["--device", "cuda"], "--device: 'cuda': cuda is not available on this machine",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])  # fmt: skip
def test_evaluation_command_names_a_bad_option_without_a_traceback(tmp_path, args, message):
    proc = run_evaluate(*args, "--out", str(tmp_path / "out"), "--limit", "1", "--seeds", "1", "--min-images", "0",
                        "--steps", "1")  # fmt: skip
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (["--cfg", "-3"], "--cfg must be >= 0, got -3.0"),  # as the trainer's eval.cfg
    (["--steps", "0"], "--steps must be positive, got 0"),
    (["--seeds", "0"], "--seeds must be positive, got 0"),
    (["--batch-size", "-1"], "--batch-size must be positive, got -1"),
    (["--limit", "0"], "--limit must be positive, got 0"),
    (["--min-images", "-1"], "--min-images must be >= 0, got -1"),
])  # fmt: skip
def test_evaluation_command_names_a_bad_number_before_sampling(tmp_path, capsys, args, message):
    """Each numeric option out of range is refused by name, with its value, before the model loads."""
    with pytest.raises(SystemExit) as exit_:
        ev.main(["--out", str(tmp_path / "out"), "--limit", "1", "--seeds", "1", "--min-images", "0", "--steps", "1",
                 "--device", "cpu", *args])  # fmt: skip
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_lora_weights_may_be_a_pickled_bin_file(tmp_path):
    from stepfast.models import lora_weights_file

    weights = tmp_path / "pytorch_lora_weights.bin"
    torch.save({"transformer.x.lora_A.weight": torch.zeros(1)}, weights)
    assert lora_weights_file(weights) == weights
    with pytest.raises(FileNotFoundError):
        lora_weights_file(tmp_path / "missing.bin")


def test_the_trainer_spreads_a_txt_file_of_eval_prompts_as_evaluate_does(tmp_path):
    """eval.prompts given as a .txt file of ShapeEval prompts: the trainer's held-out plan (the
    prompts over categories, the seeds per category) is the one `stepfast.evaluate` makes of the same
    file. It treated the file as one category (256 images against 349, two categories left out)."""
    import random
    from types import SimpleNamespace

    from stepfast.config import load_config
    from stepfast.data.prompts import load_prompts
    from stepfast.train import Trainer

    texts = [m["prompt"] for m in load_metadata("test")]
    random.Random(0).shuffle(texts)
    path = tmp_path / "test_prompts.txt"
    path.write_text("\n".join(texts) + "\n")
    cfg = load_config("shapeeval_heldout", [f"eval.prompts={path}"])
    fake = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), reward=None, world=1)
    setup = Trainer._eval_setup(fake, load_prompts(path))
    metas = heldout.spread_over_categories(ev.read_prompts(str(path)), cfg.eval.limit)
    plan = heldout.plan_samples(metas, cfg.eval.seeds, cfg.eval.min_images)
    assert setup.metadata == metas and setup.plan == plan
    assert len(plan) == 349 and len({m["tag"] for m in metas}) == 6
