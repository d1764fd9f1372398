"""Evaluate a pipeline on ShapeEval prompts and print a GenEval-style table.

    python -m stepfast.evaluate --model DIR [--lora DIR] [--prompts test] [--seeds 4] [--steps 40]
                                [--cfg 4.5] [--out DIR] [--limit N] [--batch-size 32]

Every prompt is sampled once per seed (seed s draws the initial noise of every prompt's s-th
image, as GenEval does, so results do not depend on the batch size) by the pipeline's own
`__call__`: Euler steps of the flow ODE with classifier-free guidance against the empty prompt.
Each image is scored by the ShapeEval reward (`stepfast.rewards.shapes`). The table gives per
category the strict accuracy (GenEval's number: every clause of the prompt holds) and the mean
partial score, and overall their mean over categories (GenEval's overall is the unweighted mean
of its six task accuracies, not the mean over images). `--out` receives results.json (table,
settings and every sample's scores), results.md (the table) and samples.png (a grid of images
with their scores).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from stepfast.data.shapeeval import CATEGORIES, load_metadata, parse_prompt
from stepfast.models import EMBEDDED_MODEL, load_lora, load_pipeline, text_length


def read_prompts(source: str) -> list[dict]:
    """Metadata records for "train", "test", a GenEval `*.jsonl` metadata file, or a `.txt` file
    of ShapeEval prompts (one per line, parsed into metadata)."""
    if source.endswith(".txt"):
        path = Path(source)
        lines = [(n, line.strip()) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
        if not lines:
            raise ValueError(f"{path}: no prompts")
        records = []
        for n, prompt in lines:
            try:
                records.append(parse_prompt(prompt))
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: {exc}") from None
        return records
    return load_metadata(source)


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


def evaluate(
    pipe,
    metadata: list[dict],
    seeds: int | list[int] = 4,
    steps: int = 40,
    cfg: float = 4.5,
    *,
    batch_size: int = 32,
    reward=None,
    size: int | None = None,
    progress: bool = True,
    keep_images: bool = False,
) -> dict:
    """Sample every prompt of `metadata` once per seed and score it with the ShapeEval reward.

    seeds: a count n (seeds 0..n-1) or an explicit list. Returns {"overall": {"strict", "score",
    "n"}, "categories": {name: {...}}, "samples": [per-image records], "settings": {...},
    "seconds": {...}} and, with keep_images, "images": uint8 [N, H, W, 3] in sample order
    (prompt-major: all seeds of prompt 0 first).
    """
    if not metadata:
        raise ValueError("evaluate() needs at least one prompt")
    seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    if not seed_list:
        raise ValueError("evaluate() needs at least one seed")
    if reward is None:
        from stepfast.rewards import load

        reward = load("shapes")
    metas = [m for m in metadata for _ in seed_list]
    prompts = [m["prompt"] for m in metas]
    sample_seeds = seed_list * len(metadata)

    start = time.perf_counter()
    images = sample_images(pipe, prompts, sample_seeds, steps, cfg, batch_size, size, progress)
    sampled = time.perf_counter()
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    out = reward.score(pixels, prompts, metas)
    scored = time.perf_counter()

    strict = out["strict"].float().numpy()
    score = out["score"].float().numpy()
    tags = [
        m.get("tag") or (CATEGORIES[int(c)] if 0 <= int(c) < len(CATEGORIES) else "other")
        for m, c in zip(metas, out.get("category", torch.full((len(metas),), -1.0)).tolist())
    ]
    result = geneval_table(tags, strict, score)
    result["samples"] = [
        {"prompt": p, "tag": t, "seed": s, "strict": float(a), "score": float(b)}
        for p, t, s, a, b in zip(prompts, tags, sample_seeds, strict, score)
    ]
    result["settings"] = {
        "prompts": len(metadata), "seeds": seed_list, "steps": steps, "cfg": cfg,
        "size": int(images.shape[-1]), "text_length": text_length(pipe),
    }  # fmt: skip
    result["seconds"] = {"sampling": sampled - start, "scoring": scored - sampled}
    if keep_images:
        result["images"] = pixels
    return result


# --------------------------------------------------------------------------------------------------
# Reports


def markdown_table(result: dict) -> str:
    lines = ["| category | strict | score | n |", "|---|---:|---:|---:|"]
    for name, row in result["categories"].items():
        lines.append(f"| {name} | {row['strict']:.3f} | {row['score']:.3f} | {row['n']} |")
    row = result["overall"]
    lines.append(f"| **overall** | **{row['strict']:.3f}** | **{row['score']:.3f}** | {row['n']} |")
    return "\n".join(lines) + "\n"


def sample_grid(images: np.ndarray, samples: list[dict], columns: int, max_rows: int = 32, scale: int = 2):
    """A PIL image: one row per prompt (up to max_rows, spread over categories), one column per
    seed; each image framed green when it passes strictly, red otherwise, with its score."""
    from PIL import Image, ImageDraw

    rows = len(samples) // columns
    order = _spread_rows(samples, columns, max_rows) if rows > max_rows else list(range(rows))
    h, w = images.shape[1] * scale, images.shape[2] * scale
    label_w, pad, text_h = 300, 3, 12
    cell_w, cell_h = w + 2 * pad, h + 2 * pad + text_h
    grid = Image.new("RGB", (label_w + columns * cell_w, len(order) * cell_h), (24, 24, 24))
    draw = ImageDraw.Draw(grid)
    for y, r in enumerate(order):
        first = samples[r * columns]
        draw.text((4, y * cell_h + cell_h // 2 - 12), f"[{first['tag']}]", fill=(160, 160, 160))
        draw.text((4, y * cell_h + cell_h // 2), first["prompt"], fill=(230, 230, 230))
        for c in range(columns):
            i = r * columns + c
            x0, y0 = label_w + c * cell_w, y * cell_h
            frame = (40, 200, 60) if samples[i]["strict"] else (210, 50, 50)
            draw.rectangle([x0, y0, x0 + cell_w - 1, y0 + h + 2 * pad - 1], fill=frame)
            tile = Image.fromarray(images[i]).resize((w, h), Image.NEAREST)
            grid.paste(tile, (x0 + pad, y0 + pad))
            draw.text((x0 + pad, y0 + h + 2 * pad), f"s{samples[i]['seed']} {samples[i]['score']:.2f}", fill=(230, 230, 230))
    return grid


def _spread_rows(samples: list[dict], columns: int, max_rows: int) -> list[int]:
    rows = [{"tag": samples[r * columns]["tag"], "row": r} for r in range(len(samples) // columns)]
    return [m["row"] for m in spread_over_categories(rows, max_rows)]


def write_report(result: dict, out: Path, columns: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    serialisable = {k: v for k, v in result.items() if k != "images"}
    (out / "results.json").write_text(json.dumps(serialisable, indent=2) + "\n")
    (out / "results.md").write_text(markdown_table(result))
    if "images" in result:
        sample_grid(result["images"], result["samples"], columns).save(out / "samples.png")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_MODEL, help="diffusers SD3 pipeline directory")
    parser.add_argument("--lora", default=None, help="LoRA weights to load onto the transformer")
    parser.add_argument("--prompts", default="test", help="train | test | *_metadata.jsonl | prompts .txt")
    parser.add_argument("--seeds", type=int, default=4, help="images per prompt (seeds 0..N-1)")
    parser.add_argument("--steps", type=int, default=40, help="sampling steps")
    parser.add_argument("--cfg", type=float, default=4.5, help="classifier-free guidance scale")
    parser.add_argument("--out", default="outputs/evaluate", help="directory for results.json/.md and samples.png")
    parser.add_argument("--limit", type=int, default=None, help="evaluate only N prompts, spread over categories")
    parser.add_argument("--batch-size", type=int, default=32, help="images per pipeline call")
    parser.add_argument("--size", type=int, default=None, help="image side (default: the model's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.steps < 1 or args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--seeds, --steps, --batch-size and --limit must be positive")

    metadata = spread_over_categories(read_prompts(args.prompts), args.limit)
    pipe = load_pipeline(args.model, device=args.device)
    if args.lora:
        load_lora(pipe, args.lora)
    result = evaluate(
        pipe, metadata, args.seeds, args.steps, args.cfg, batch_size=args.batch_size, size=args.size, keep_images=True
    )
    result["settings"].update(model=str(args.model), lora=args.lora, prompt_source=args.prompts)
    print(markdown_table(result), end="")
    print(
        f"{len(metadata)} prompts x {args.seeds} seeds, {args.steps} steps, cfg {args.cfg}: "
        f"sampling {result['seconds']['sampling']:.1f} s, scoring {result['seconds']['scoring']:.1f} s"
    )
    out = Path(args.out)
    write_report(result, out, columns=args.seeds)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'samples.png'}")
    return result


if __name__ == "__main__":
    main()
