"""Evaluate a pipeline on ShapeEval prompts and print a GenEval-style table.

    python -m stepfast.evaluate --model DIR [--lora DIR | --transformer DIR] [--prompts test] [--seeds 4] [--min-images 32]
                                [--steps 40] [--cfg 4.5] [--out DIR] [--overwrite] [--limit N] [--batch-size 32]
                                [--size N] [--device cpu|cuda]

Every prompt is sampled once per seed (seed s draws the initial noise of every prompt's s-th
image, as GenEval does, so results do not depend on the batch size or on how many ranks share
the work). A category with fewer than --min-images images gets more seeds for each of its prompts
(ShapeEval's test split has one single_object and one two_object prompt: at 4 seeds, one image
would move the overall by 0.04). Images are drawn by the pipeline's own
`__call__`: Euler steps of the flow ODE with classifier-free guidance against the empty prompt.
Each image is scored by the ShapeEval reward (`stepfast.rewards.shapes`). The table gives per
category the strict accuracy (GenEval's number: every clause of the prompt holds) and the mean
partial score, and overall their mean over categories (GenEval's overall is the unweighted mean
of its six task accuracies, not the mean over images). `--out` receives results.json (table,
settings and every sample's scores), results.md (the table) and samples.png (a grid of images
with their scores); an earlier evaluation there is kept unless --overwrite.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from stepfast.data.prompts import numbered_lines, load_prompts, resolve_prompt_file
from stepfast.data.shapeeval import CATEGORIES, parse_prompt
from stepfast.files import check_creatable_dir, write_atomically
from stepfast.models import (
    EMBEDDED_MODEL,
    check_device,
    check_transformer_dir,
    load_lora,
    load_pipeline,
    load_transformer,
    lora_weights_file,
    text_length,
)


def read_prompts(source: str) -> list[dict]:
    """Metadata records for "train", "test" (or "shapeeval:train", "shapeeval:test"), a GenEval
    `*.jsonl` metadata file, or a `.txt` file of ShapeEval prompts (one per line, blank lines
    skipped, parsed into metadata). Files are read by `stepfast.data.prompts`, as the trainer reads
    them: a missing file, a directory, a line that is not UTF-8 or not JSON raises an error naming
    the file (and the line, `path:line`), as does a `.txt` prompt ShapeEval cannot parse."""
    path = resolve_prompt_file(f"shapeeval:{source}" if source in ("train", "test") else source)
    if path.suffix not in (".txt", ".jsonl") and not path.exists():
        raise ValueError(f"{source!r} is not train, test, shapeeval:train, shapeeval:test, a GenEval "
                         "*_metadata.jsonl file or a .txt file of prompts (one per line)")  # fmt: skip
    # names a missing file, a directory, another suffix, a bad line (path:line), a file of no prompts
    records = load_prompts(path)
    if path.suffix == ".jsonl":
        return [record.metadata for record in records]  # as shapeeval.load_metadata reads them
    parsed = []
    for record in records:
        try:
            parsed.append(parse_prompt(record.prompt))
        except ValueError as exc:  # named by its line, which the file is read again to find
            line = next(n for n, text in numbered_lines(path) if text.strip() == record.prompt)
            raise ValueError(f"{path}:{line}: {exc}") from None
    return parsed


def spread_over_categories(metadata: list[dict], limit: int | None) -> list[dict]:
    """The first `limit` records taken round-robin over categories (in file order within each),
    so that a small limit still covers every category."""
    if limit is None or limit >= len(metadata):
        return list(metadata)
    by_tag: dict[str, list[dict]] = {}
    for meta in metadata:
        by_tag.setdefault(meta.get("tag", ""), []).append(meta)
    queues = [by_tag[t] for t in sorted(by_tag, key=lambda t: CATEGORIES.index(t) if t in CATEGORIES else 99)]
    picked: list[dict] = []
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
) -> torch.Tensor:
    """Images [N, 3, H, W] in [0, 1] (on the CPU) for prompt i drawn with seed seeds[i]."""
    size = size or pipe.default_sample_size * pipe.vae_scale_factor
    previous = dict(getattr(pipe, "_progress_bar_config", {}))
    pipe.set_progress_bar_config(disable=True)
    images = []
    try:
        bar = tqdm(total=len(prompts), desc="sampling", unit="img", disable=not progress, dynamic_ncols=True)
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
    return torch.cat(images)


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
    None when the records do not pair up (other prompts or seeds). A prompt listed twice in the
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
                   reward=None, size: int | None = None, progress: bool = True) -> dict:  # fmt: skip
    """Sample and score the images of `plan` (or of one rank's share of it). Returns, in plan
    order, numpy arrays "strict", "score", "category" (the reward's; -1 where it gives none) and
    "pixels" (uint8 [N, H, W, 3]), and "seconds"."""
    if reward is None:
        from stepfast.rewards import load

        reward = load("shapes")
    metas = [m for m, _ in plan]
    prompts = [m["prompt"] for m in metas]
    start = time.perf_counter()
    images = sample_images(pipe, prompts, [s for _, s in plan], steps, cfg, batch_size, size, progress)
    sampled = time.perf_counter()
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    out = reward.score(pixels, prompts, metas)
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


def settings(pipe, metadata: list[dict], seeds: int | list[int], steps: int, cfg: float, min_images: int = 0) -> dict:
    """What `summarise` records of how the samples were drawn."""
    return {"prompts": len(metadata), "seeds": seed_list(seeds), "min_images": min_images, "steps": steps,
            "cfg": cfg, "text_length": text_length(pipe)}  # fmt: skip


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
    return summarise(plan, scored, settings(pipe, metadata, seeds, steps, cfg, min_images), keep_images)


# --------------------------------------------------------------------------------------------------
# Reports


def markdown_table(result: dict) -> str:
    lines = ["| category | strict | score | n |", "|---|---:|---:|---:|"]
    for name, row in result["categories"].items():
        lines.append(f"| {name} | {row['strict']:.3f} | {row['score']:.3f} | {row['n']} |")
    row = result["overall"]
    lines.append(f"| **overall** | **{row['strict']:.3f}** | **{row['score']:.3f}** | {row['n']} |")
    return "\n".join(lines) + "\n"


def sample_grid(images: np.ndarray, samples: list[dict], columns: int, max_rows: int = 32,
                scale: float | None = None):  # fmt: skip
    """A PIL image: one row per prompt (up to max_rows, spread over categories) with its first
    `columns` seeds; each image framed green when it passes strictly, red when it fails, grey for a
    reward without pass/fail (strict NaN), with its score. scale: the tiles' size over the images';
    by default 2 up to 128 px (ShapeEval's 64 px stay legible) and 256 px tiles above (a 1024 px
    evaluation of 32 prompts would otherwise be a 66,000 px tall grid)."""
    from PIL import Image, ImageDraw

    rows = _prompt_rows(samples)
    if len(rows) > max_rows:
        rows = [r["indices"] for r in spread_over_categories(
            [{"tag": samples[r[0]]["tag"], "indices": r} for r in rows], max_rows)]  # fmt: skip
    if scale is None:
        scale = 2 if images.shape[1] <= 128 else 256 / images.shape[1]
    h, w = max(round(images.shape[1] * scale), 1), max(round(images.shape[2] * scale), 1)
    resample = Image.NEAREST if scale >= 1 else Image.BILINEAR
    label_w, pad, text_h = 300, 3, 12
    cell_w, cell_h = w + 2 * pad, h + 2 * pad + text_h
    grid = Image.new("RGB", (label_w + columns * cell_w, len(rows) * cell_h), (24, 24, 24))
    draw = ImageDraw.Draw(grid)
    for y, row in enumerate(rows):
        first = samples[row[0]]
        draw.text((4, y * cell_h + cell_h // 2 - 12), f"[{first['tag']}]", fill=(160, 160, 160))
        draw.text((4, y * cell_h + cell_h // 2), first["prompt"], fill=(230, 230, 230))
        for c, i in enumerate(row[:columns]):
            x0, y0 = label_w + c * cell_w, y * cell_h
            strict = samples[i]["strict"]
            frame = (120, 120, 120) if math.isnan(strict) else (40, 200, 60) if strict == 1 else (210, 50, 50)
            draw.rectangle([x0, y0, x0 + cell_w - 1, y0 + h + 2 * pad - 1], fill=frame)
            tile = Image.fromarray(images[i]).resize((w, h), resample)
            grid.paste(tile, (x0 + pad, y0 + pad))
            draw.text((x0 + pad, y0 + h + 2 * pad), f"s{samples[i]['seed']} {samples[i]['score']:.2f}", fill=(230, 230, 230))
    return grid


def _prompt_rows(samples: list[dict]) -> list[list[int]]:
    """Indices of each prompt's samples (consecutive runs of the same prompt)."""
    rows: list[list[int]] = []
    for i, sample in enumerate(samples):
        if rows and samples[rows[-1][0]]["prompt"] == sample["prompt"]:
            rows[-1].append(i)
        else:
            rows.append([i])
    return rows


REPORT_FILES = ("results.json", "results.md", "samples.png")


def check_out_dir(out: Path, overwrite: bool = False) -> None:
    """A ValueError naming `out` when `write_report` could not write there: `out` must be a
    directory or not exist yet (then its nearest existing parent must be a writable directory),
    none of the report files in it may be a directory, and, unless `overwrite`, it must not hold an
    earlier evaluation. Checked before any sampling."""
    check_creatable_dir(out, holds=", ".join(REPORT_FILES))
    for name in REPORT_FILES:
        if (out / name).is_dir():
            raise ValueError(f"{out / name} is a directory: the report file cannot be written there")
    if not overwrite and (out / "results.json").exists():
        raise ValueError(f"{out} already holds an evaluation (results.json): give another --out, or "
                         "--overwrite to replace it")  # fmt: skip


def write_report(result: dict, out: Path, columns: int) -> None:
    """results.json, results.md and samples.png into `out`, each written whole then renamed into
    place: an interrupted write leaves the file it replaces."""
    out.mkdir(parents=True, exist_ok=True)
    serialisable = {k: v for k, v in result.items() if k != "images"}
    files = {"results.json": lambda p: p.write_text(json.dumps(serialisable, indent=2) + "\n"),
             "results.md": lambda p: p.write_text(markdown_table(result))}  # fmt: skip
    if "images" in result:
        grid = sample_grid(result["images"], result["samples"], columns)
        files["samples.png"] = lambda p: grid.save(p, format="PNG")
    for name, write in files.items():
        write_atomically(out / name, write)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m stepfast.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_MODEL,
                        help="diffusers SD3 pipeline directory (default: the embedded model)")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--lora", default=None, help="LoRA weights to load onto the transformer")
    weights.add_argument("--transformer", default=None,
                         help="a fully fine-tuned transformer (a checkpoint's transformer/) to use instead")
    parser.add_argument("--prompts", default="test",
                        help="train | test | shapeeval:train | shapeeval:test | *_metadata.jsonl | prompts .txt "
                             "(default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=4, help="images per prompt, seeds 0..N-1 (default: %(default)s)")
    parser.add_argument("--min-images", type=int, default=32,
                        help="more seeds for the prompts of a category with fewer images than this "
                             "(0: off; default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="sampling steps (default: %(default)s)")
    parser.add_argument("--cfg", type=float, default=4.5,
                        help="classifier-free guidance scale (default: %(default)s)")
    parser.add_argument("--out", default="outputs/evaluate",
                        help="directory for results.json/.md and samples.png (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace an evaluation already in --out")
    parser.add_argument("--limit", type=int, default=None,
                        help="evaluate only N prompts, spread over categories (default: all)")
    parser.add_argument("--batch-size", type=int, default=32, help="images per pipeline call (default: %(default)s)")
    parser.add_argument("--size", type=int, default=None, help="image side (default: the model's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to sample (default: %(default)s)")
    args = parser.parse_args(argv)
    for flag, value in (("--seeds", args.seeds), ("--steps", args.steps), ("--batch-size", args.batch_size),
                        ("--limit", args.limit), ("--size", args.size)):  # fmt: skip
        if value is not None and value < 1:
            parser.error(f"{flag} must be positive, got {value}")
    if args.min_images < 0:
        parser.error(f"--min-images must be >= 0, got {args.min_images}")
    if not math.isfinite(args.cfg):
        parser.error(f"--cfg must be a finite number, got {args.cfg}")
    if args.cfg < 0:  # as the trainer's eval.cfg
        parser.error(f"--cfg must be >= 0, got {args.cfg}")
    # Checked before the model is loaded and the images drawn, which can take minutes.
    try:
        device = check_device(args.device)
    except ValueError as exc:
        parser.error(f"--device: {exc}")
    out = Path(args.out)
    try:
        check_out_dir(out, overwrite=args.overwrite)
    except ValueError as exc:
        parser.error(f"--out: {exc}")

    try:  # a missing or unreadable prompt file, named with its bad line
        metadata = spread_over_categories(read_prompts(args.prompts), args.limit)
    except (FileNotFoundError, ValueError) as exc:
        parser.error(f"--prompts: {exc}")
    from stepfast.rewards import load

    reward = load("shapes")
    try:  # a record ShapeEval cannot score (GenEval's "dog"), named before anything is drawn
        reward.check([m.get("prompt") for m in metadata], metadata)
    except ValueError as exc:
        raise ValueError(f"--prompts {args.prompts}: {exc}") from None
    if args.lora:
        lora_weights_file(args.lora)  # FileNotFoundError / ValueError naming it, before the model loads
    if args.transformer:
        check_transformer_dir(args.transformer)
    pipe = load_pipeline(args.model, device=device)
    if args.lora:
        load_lora(pipe, args.lora)
    if args.transformer:
        load_transformer(pipe, args.transformer)
    multiple = pipe.vae_scale_factor * pipe.patch_size
    if args.size is not None and args.size % multiple:
        parser.error(f"--size must be a multiple of {multiple} for this model, got {args.size}")
    result = evaluate(
        pipe, metadata, args.seeds, args.steps, args.cfg, min_images=args.min_images, batch_size=args.batch_size,
        size=args.size, keep_images=True, reward=reward,
    )
    result["settings"].update(model=str(args.model), lora=args.lora, transformer=args.transformer,
                              prompt_source=args.prompts)  # fmt: skip
    print(markdown_table(result), end="")
    print(
        f"{len(metadata)} prompts x {args.seeds}+ seeds ({len(result['samples'])} images), {args.steps} steps, "
        f"cfg {args.cfg}: "
        f"sampling {result['seconds']['sampling']:.1f} s, scoring {result['seconds']['scoring']:.1f} s"
    )
    write_report(result, out, columns=args.seeds)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'samples.png'}")
    return result


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
        # bad input (model or LoRA directory, prompt file): the message names it, no traceback
        print(f"stepfast.evaluate: error: {exc}", file=sys.stderr)
        sys.exit(2)
