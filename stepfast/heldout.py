"""Held-out evaluation as the trainer and `python -m stepfast.evaluate` run it: which images to draw,
drawing and scoring them (shared out over ranks), the GenEval-style table, the paired gain between
two evaluations, and the sample grid.

Every prompt is sampled once per seed (seed s draws the initial noise of every prompt's s-th
image, as GenEval does, so the noise does not depend on the batch size or on how many ranks share
the work, and the images depend on them only by rounding). A category with fewer than `min_images` images gets more seeds for each of its prompts
(ShapeEval's test split has one single_object and one two_object prompt: at 4 seeds, one image
would move the overall by 0.04). Images are drawn by the pipeline's own `__call__`: Euler steps of
the flow ODE with classifier-free guidance against the empty prompt. The table gives per category
the strict accuracy (GenEval's number: every clause of the prompt holds) and the mean partial
score, and overall their mean over categories (GenEval's overall is the unweighted mean of its six
task accuracies, not the mean over images).
"""

from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import torch
from tqdm.auto import tqdm

from stepfast.data.shapeeval import CATEGORIES
from stepfast.models import text_length


def spread_over_categories(metadata: list[dict], limit: int | None) -> list[dict]:
    """The first `limit` records taken round-robin over categories (in file order within each),
    so that a small limit still covers every category."""
    return [metadata[i] for i in spread_indices(metadata, limit)]


def spread_indices(metadata: list[dict], limit: int | None) -> list[int]:
    """The indices of the records `spread_over_categories` picks, in its order."""
    if limit is None or limit >= len(metadata):
        return list(range(len(metadata)))
    by_tag: dict[str, list[int]] = {}
    for i, meta in enumerate(metadata):
        by_tag.setdefault(meta.get("tag", ""), []).append(i)
    queues = [by_tag[t] for t in sorted(by_tag, key=lambda t: CATEGORIES.index(t) if t in CATEGORIES else 99)]
    picked: list[int] = []
    while len(picked) < limit:
        for queue in queues:
            if queue and len(picked) < limit:
                picked.append(queue.pop(0))
    return picked


@torch.no_grad()
def sample_images(
    pipe,
    prompts: list[str],
    seeds: list[int],
    steps: int,
    cfg: float,
    batch_size: int = 32,
    size: int | None = None,
    progress: bool = True,
    desc: str = "sampling",
) -> torch.Tensor:
    """Images [N, 3, H, W] in [0, 1] (on the CPU) for prompt i drawn with seed seeds[i]; `desc` names
    the progress bar."""
    size = size or pipe.default_sample_size * pipe.vae_scale_factor
    previous = dict(getattr(pipe, "_progress_bar_config", {}))
    pipe.set_progress_bar_config(disable=True)
    # the pipeline makes its latents in the text encoders' dtype (model.dtype); a transformer trained
    # in another (optim.precision) gets its inputs in its dtype, as the trainer's own calls cast them
    hooks = _CastToTransformer().attach(pipe.transformer)
    images = []
    try:
        bar = tqdm(total=len(prompts), desc=desc, unit="img", disable=not progress, dynamic_ncols=True)
        for start in range(0, len(prompts), batch_size):
            chunk = slice(start, start + batch_size)
            # CPU generators: the same seed gives the same noise on every device.
            generators = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds[chunk]]
            out = pipe(
                prompt=prompts[chunk],
                num_inference_steps=steps,
                guidance_scale=cfg,
                height=size,
                width=size,
                generator=generators,
                max_sequence_length=text_length(pipe),
                output_type="pt",
            )
            images.append(out.images.float().cpu())
            bar.update(len(generators))
        bar.close()
    finally:
        pipe._progress_bar_config = previous
        for hook in hooks:
            hook.remove()
    return torch.cat(images)


class _CastToTransformer:
    """Hooks that give the SD3 transformer its floating inputs in its own dtype (but the timestep,
    which it embeds in float32, as diffusers passes it: see `stepfast.policy.velocity`) and its
    output back in the dtype of the latents it was given: the scheduler steps them in the output's."""

    def attach(self, transformer) -> list:
        return [transformer.register_forward_pre_hook(self.inputs, with_kwargs=True),
                transformer.register_forward_hook(self.output)]  # fmt: skip

    def inputs(self, module, args, kwargs):
        dtype = next(module.parameters()).dtype
        self.latents_dtype = kwargs["hidden_states"].dtype if "hidden_states" in kwargs else args[0].dtype
        args = tuple(a.to(dtype) if i < 3 and torch.is_tensor(a) and a.is_floating_point() else a  # not timestep
                     for i, a in enumerate(args))  # fmt: skip
        kwargs = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() and k != "timestep" else v
                  for k, v in kwargs.items()}  # fmt: skip
        return args, kwargs

    def output(self, module, args, output):
        if isinstance(output, tuple):
            return (output[0].to(self.latents_dtype), *output[1:])
        output.sample = output.sample.to(self.latents_dtype)
        return output


def geneval_table(categories: list[str], strict: np.ndarray, score: np.ndarray) -> dict:
    """Per-category strict accuracy / mean score / count, and overall = mean over categories."""
    table = {}
    names = [c for c in CATEGORIES if c in categories] + sorted(set(categories) - set(CATEGORIES))
    for name in names:
        mask = np.array([c == name for c in categories])
        table[name] = {"strict": float(strict[mask].mean()), "score": float(score[mask].mean()), "n": int(mask.sum())}
    overall = {
        "strict": float(np.mean([row["strict"] for row in table.values()])) if table else float("nan"),
        "score": float(np.mean([row["score"] for row in table.values()])) if table else float("nan"),
        "n": len(categories),
    }
    return {"categories": table, "overall": overall}


def paired_gain(before: list[dict], after: list[dict], resamples: int = 1000, seed: int = 0) -> dict | None:
    """The overall strict gain from `before` to `after`, two evaluations' "samples" records of the
    same prompts and seeds, with its standard error over those draws: a paired bootstrap that
    redraws each category's prompts, then each drawn prompt's seeds, with replacement, and takes
    after minus before on the same images. It says how much the gain owes to which prompts and
    seeds were drawn; the spread between training runs of different seeds comes on top of it.
    se is None when every category holds one image. None when the records do not pair up (other
    prompts or seeds). A prompt listed twice in the
    prompt file gives the same (prompt, seed) twice: the k-th of each pairs with the k-th."""

    def keys(samples):
        seen: Counter = Counter()
        for s in samples:
            seen[s["prompt"], s["seed"]] += 1
            yield (s["prompt"], s["seed"], seen[s["prompt"], s["seed"]]), s

    pairs = {key: [s["tag"], s["strict"], None] for key, s in keys(before)}
    for key, s in keys(after):
        pair = pairs.get(key)
        if pair is None or pair[0] != s["tag"] or pair[2] is not None:
            return None
        pair[2] = s["strict"]
    if not pairs or not all(pair[2] is not None and math.isfinite(pair[1]) and math.isfinite(pair[2])
                            for pair in pairs.values()):  # fmt: skip
        return None  # unpaired, or a reward without pass/fail (strict NaN)
    by_category: dict[str, dict[str, list[float]]] = {}
    for (prompt, _, _), (tag, strict_before, strict_after) in pairs.items():
        by_category.setdefault(tag, {}).setdefault(prompt, []).append(strict_after - strict_before)
    rng = np.random.default_rng(seed)
    gains = np.zeros(resamples)
    for prompts in by_category.values():
        diffs = [np.asarray(d) for d in prompts.values()]
        for r in range(resamples):
            prompts_drawn = rng.integers(len(diffs), size=len(diffs))
            drawn = [diffs[i][rng.integers(len(diffs[i]), size=len(diffs[i]))] for i in prompts_drawn]
            gains[r] += np.concatenate(drawn).mean() / len(by_category)
    gain = float(np.mean([np.concatenate(list(p.values())).mean() for p in by_category.values()]))
    if all(len(p) == 1 and len(next(iter(p.values()))) == 1 for p in by_category.values()):
        return {"gain": gain, "se": None, "resamples": 0}  # one image a category: nothing to redraw
    return {"gain": gain, "se": float(gains.std(ddof=1)), "resamples": resamples}


def seed_list(seeds: int | list[int]) -> list[int]:
    return list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]


def plan_samples(metadata: list[dict], seeds: int | list[int] = 4, min_images: int = 0) -> list[tuple[dict, int]]:
    """(record, seed) of every image to draw, prompt-major: every prompt once per seed.

    With min_images, the prompts of a category with few of them get more seeds (numbered on from
    the given ones), so that the category's accuracy rests on at least min_images images: the
    overall is the unweighted mean over categories, and a category of one prompt x 4 seeds moves
    it by 1/24 per image.
    """
    if not metadata:
        raise ValueError("evaluate() needs at least one prompt")
    base = seed_list(seeds)
    if not base:
        raise ValueError("evaluate() needs at least one seed")
    if min_images < 0:
        raise ValueError(f"min_images must be >= 0, got {min_images}")
    per_tag = Counter(meta.get("tag", "") for meta in metadata)
    plan = []
    for meta in metadata:
        wanted = max(len(base), -(-min_images // per_tag[meta.get("tag", "")]))
        extra = list(range(max(base) + 1, max(base) + 1 + wanted - len(base)))
        plan += [(meta, s) for s in base + extra]
    return plan


def draw_and_score(pipe, plan: list[tuple[dict, int]], steps: int, cfg: float, *, batch_size: int = 32,
                   reward=None, reward_name: str = "shapes", size: int | None = None,
                   progress: bool = True, desc: str = "sampling") -> dict:  # fmt: skip
    """Sample and score the images of `plan` (or of one rank's share of it) with `reward` (ShapeEval's
    when None), named `reward_name` in its errors: scores that are not one finite number per image
    are refused, each bad image named by its prompt and seed. Returns, in plan order, numpy arrays
    "strict", "score", "category" (the reward's; -1 where it gives none) and "pixels" (uint8
    [N, H, W, 3]), and "seconds"."""
    from stepfast.rewards.combine import ScoreError, check_scores

    if reward is None:
        from stepfast.rewards import load

        reward = load("shapes")
    metas = [m for m, _ in plan]
    prompts = [m["prompt"] for m in metas]
    start = time.perf_counter()
    images = sample_images(pipe, prompts, [s for _, s in plan], steps, cfg, batch_size, size, progress, desc)
    sampled = time.perf_counter()
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    try:
        out = check_scores(reward_name, reward.score(pixels, prompts, metas), len(metas))
    except ScoreError as exc:
        raise exc.naming(lambda i: f"prompt {prompts[i]!r}, seed {plan[i][1]}") from None
    scored = time.perf_counter()
    return {
        "strict": _strict(out, len(metas)),
        "score": out["score"].float().numpy(),
        "category": out.get("category", torch.full((len(metas),), -1.0)).float().numpy(),
        "pixels": pixels,
        "seconds": {"sampling": sampled - start, "scoring": scored - sampled},
    }


def _strict(out: dict, n: int) -> np.ndarray:
    """The pass/fail of each image: "strict" (ShapeEval), "strict_accuracy" (GenEval's server), or
    NaN for a reward without one (PickScore): its strict columns then read nan."""
    for key in ("strict", "strict_accuracy"):
        if key in out:
            return out[key].float().numpy()
    return np.full(n, np.nan, dtype=np.float32)


def shard(plan: list, rank: int, world: int) -> tuple[list, int]:
    """Rank `rank`'s share of `plan` (every world-th image), padded with repeats to the length every
    rank gets so that all ranks make the same pipeline calls (ZeRO-3 gathers weights collectively).
    Returns (share, number of real entries: the padding follows them)."""
    mine = plan[rank::world]
    length = -(-len(plan) // world)
    filler = mine[-1:] or plan[:1]
    return mine + filler * (length - len(mine)), len(mine)


def unshard(parts: list[dict], world: int) -> dict:
    """The `draw_and_score` outputs of every rank's share (rank order, padding cut) back in plan
    order; "seconds" are the slowest rank's. Parts may leave out "pixels" (only scores travel)."""
    out = {key: interleave([p[key] for p in parts], world) for key in parts[0] if key != "seconds"}
    out["seconds"] = {k: max(p["seconds"][k] for p in parts) for k in parts[0]["seconds"]}
    return out


def interleave(pieces: list[np.ndarray], world: int) -> np.ndarray:
    """Rank r's piece holds plan entries r, r + world, ...: put them back in plan order."""
    merged = np.empty((sum(len(x) for x in pieces), *pieces[0].shape[1:]), dtype=pieces[0].dtype)
    for rank, piece in enumerate(pieces):
        merged[rank::world] = piece
    return merged


def summarise(plan: list[tuple[dict, int]], scored: dict, settings: dict, keep_images: bool = False) -> dict:
    """The GenEval table of the scored plan, with every sample's record and the settings."""
    tags = [
        m.get("tag") or (CATEGORIES[int(c)] if 0 <= int(c) < len(CATEGORIES) else "other")
        for (m, _), c in zip(plan, scored["category"].tolist())
    ]
    result = geneval_table(tags, scored["strict"], scored["score"])
    result["samples"] = [
        {"prompt": m["prompt"], "tag": t, "seed": s, "strict": float(a), "score": float(b)}
        for (m, s), t, a, b in zip(plan, tags, scored["strict"], scored["score"])
    ]
    result["settings"] = {**settings, "size": int(scored["pixels"].shape[1])}
    result["seconds"] = scored["seconds"]
    if keep_images:
        result["images"] = scored["pixels"]
    return result


def settings(pipe, metadata: list[dict], seeds: int | list[int], steps: int, cfg: float, min_images: int = 0,
             batch_size: int | None = None) -> dict:  # fmt: skip
    """What `summarise` records of how the samples were drawn (the batch size too: the images depend
    on it by rounding)."""
    return {"prompts": len(metadata), "seeds": seed_list(seeds), "min_images": min_images, "steps": steps,
            "cfg": cfg, "text_length": text_length(pipe), "batch_size": batch_size}  # fmt: skip


def evaluate(
    pipe,
    metadata: list[dict],
    seeds: int | list[int] = 4,
    steps: int = 40,
    cfg: float = 4.5,
    *,
    min_images: int = 0,
    batch_size: int = 32,
    reward=None,
    size: int | None = None,
    progress: bool = True,
    keep_images: bool = False,
) -> dict:
    """Sample every prompt of `metadata` once per seed and score it with the ShapeEval reward.

    seeds: a count n (seeds 0..n-1) or an explicit list; min_images: see `plan_samples`. Returns
    {"overall": {"strict", "score", "n"}, "categories": {name: {...}}, "samples": [per-image
    records], "settings": {...}, "seconds": {...}} and, with keep_images, "images": uint8
    [N, H, W, 3] in sample order (prompt-major: all seeds of prompt 0 first).
    """
    plan = plan_samples(metadata, seeds, min_images)
    scored = draw_and_score(pipe, plan, steps, cfg, batch_size=batch_size, reward=reward, size=size,
                            progress=progress)  # fmt: skip
    return summarise(plan, scored, settings(pipe, metadata, seeds, steps, cfg, min_images, batch_size), keep_images)


# --------------------------------------------------------------------------------------------------
# Reports


def markdown_table(result: dict) -> str:
    lines = ["| category | strict | score | n |", "|---|---:|---:|---:|"]
    for name, row in result["categories"].items():
        lines.append(f"| {name} | {row['strict']:.3f} | {row['score']:.3f} | {row['n']} |")
    row = result["overall"]
    lines.append(f"| **overall** | **{row['strict']:.3f}** | **{row['score']:.3f}** | {row['n']} |")
    return "\n".join(lines) + "\n"


#: The sample grid's frames: a strict pass, a fail, a reward without pass/fail (strict NaN).
PASS, FAIL, NO_VERDICT = (40, 200, 60), (210, 50, 50), (120, 120, 120)


def sample_grid(images: np.ndarray, samples: list[dict], columns: int, max_rows: int = 32,
                scale: float | None = None, title: str | None = None):  # fmt: skip
    """A PIL image: one row per prompt (up to max_rows, spread over categories: its category and its
    prompt, wrapped) with its first `columns` seeds; each image framed green when it passes strictly,
    red when it fails, grey for a reward without pass/fail (strict NaN), with its seed and score under
    it. `title`: a header line above, with the key to the frames. scale: the tiles' size over the
    images'; by default 2 up to 128 px (ShapeEval's 64 px stay legible) and 256 px tiles above (a
    1024 px evaluation of 32 prompts would otherwise be a 66,000 px tall grid)."""
    from PIL import Image, ImageDraw

    rows = _prompt_rows(samples)
    if len(rows) > max_rows:
        rows = [r["indices"] for r in spread_over_categories(
            [{"tag": samples[r[0]]["tag"], "indices": r} for r in rows], max_rows)]  # fmt: skip
    if scale is None:
        scale = 2 if images.shape[1] <= 128 else 256 / images.shape[1]
    h, w = max(round(images.shape[1] * scale), 1), max(round(images.shape[2] * scale), 1)
    resample = Image.NEAREST if scale >= 1 else Image.BILINEAR
    font = _font(GRID_FONT)
    label_w, pad, text_h = 300, 3, GRID_LINE
    cell_w, cell_h = w + 2 * pad, h + 2 * pad + text_h
    head_h = 2 * GRID_LINE + 8 if title else 0
    grey = (200, 200, 200)
    key = [("frame: ", grey), ("passes (strict)", PASS), (", ", grey), ("fails", FAIL), (", ", grey),
           ("no pass/fail", NO_VERDICT), (";  under each image: s<seed> and its partial score", grey)]  # fmt: skip
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    key_w = 8 + sum(measure.textlength(text, font=font) for text, _ in key) if title else 0
    width = max(label_w + columns * cell_w, math.ceil(key_w))
    grid = Image.new("RGB", (width, head_h + len(rows) * cell_h), (24, 24, 24))
    draw = ImageDraw.Draw(grid)
    if title:
        draw.text((4, 4), title, fill=(240, 240, 240), font=font)
        x = 4
        for text, colour in key:
            draw.text((x, 4 + GRID_LINE), text, fill=colour, font=font)
            x += draw.textlength(text, font=font)
    for y, row in enumerate(rows):
        first, top = samples[row[0]], head_h + y * cell_h
        lines = [(f"[{first['tag']}]", (190, 190, 190))]
        lines += [(line, (235, 235, 235)) for line in _wrap(draw, str(first["prompt"]), font, label_w - 8)]
        lines = lines[: max((cell_h - 4) // GRID_LINE, 1)]
        y0 = top + max((cell_h - len(lines) * GRID_LINE) // 2, 2)
        for k, (text, colour) in enumerate(lines):
            draw.text((4, y0 + k * GRID_LINE), text, fill=colour, font=font)
        for c, i in enumerate(row[:columns]):
            x0, y0 = label_w + c * cell_w, top
            strict = samples[i]["strict"]
            frame = NO_VERDICT if math.isnan(strict) else PASS if strict == 1 else FAIL
            draw.rectangle([x0, y0, x0 + cell_w - 1, y0 + h + 2 * pad - 1], fill=frame)
            tile = Image.fromarray(images[i]).resize((w, h), resample)
            grid.paste(tile, (x0 + pad, y0 + pad))
            draw.text((x0 + pad, y0 + h + 2 * pad), f"s{samples[i]['seed']} {samples[i]['score']:.2f}",
                      fill=(230, 230, 230), font=font)  # fmt: skip
    return grid


GRID_FONT, GRID_LINE = 13, 16  # the grid's text size and line height, in pixels


def _font(size: int):
    """PIL's default font at `size` px (a TrueType font where PIL has FreeType), else its bitmap font."""
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError, ImportError):  # an older PIL, or one without FreeType
        return ImageFont.load_default()


def _wrap(draw, text: str, font, width: float) -> list[str]:
    """`text` in lines of at most `width` px (a word longer than that keeps a line of its own)."""
    lines: list[str] = []
    for word in text.split():
        if lines and draw.textlength(f"{lines[-1]} {word}", font=font) <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines or [""]


def _prompt_rows(samples: list[dict]) -> list[list[int]]:
    """Indices of each prompt's samples (consecutive runs of the same prompt)."""
    rows: list[list[int]] = []
    for i, sample in enumerate(samples):
        if rows and samples[rows[-1][0]]["prompt"] == sample["prompt"]:
            rows[-1].append(i)
        else:
            rows.append([i])
    return rows
