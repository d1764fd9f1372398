"""Evaluate a pipeline on ShapeEval prompts and print a GenEval-style table.

    python -m stepfast.evaluate --model DIR [--lora DIR | --transformer DIR] [--prompts test] [--seeds 4] [--min-images 32]
                                [--steps 40] [--cfg 4.5] [--out DIR] [--overwrite] [--limit N] [--batch-size 64]
                                [--size N] [--device cpu|cuda]

Every prompt is sampled once per seed, and a category with fewer than --min-images images gets more
seeds for each of its prompts; images are drawn by the pipeline's own `__call__` (the flow ODE with
classifier-free guidance) and scored by the ShapeEval reward (`stepfast.rewards.shapes`), exactly
as the trainer's evaluations are (`stepfast.heldout` says how, and what the table's numbers mean).
`--out` receives results.json (table, settings and every sample's scores), results.md (the table)
and samples.png (a grid of images with their scores); an earlier evaluation there is kept unless
--overwrite.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import replace
from pathlib import Path

if __name__ == "__main__":  # before the imports below (seconds): a Ctrl-C among them is a line, not a traceback
    from stepfast import quiet_ctrl_c_while_starting

    quiet_ctrl_c_while_starting("python -m stepfast.evaluate")

import torch

from stepfast import heldout
from stepfast.config import ConfigError
from stepfast.data.prompts import PromptRecord, load_prompts, resolve_prompt_file
from stepfast.data.shapeeval import parse_prompt
from stepfast.files import check_creatable_dir, path_argument, write_atomically
from stepfast.models import (
    EMBEDDED_MODEL,
    check_device,
    check_pipeline_dir,
    check_transformer_dir,
    load_lora,
    load_pipeline,
    load_transformer,
    lora_weights_file,
)
from stepfast.policy import check_resolution, quiet_truncation_notices
from stepfast.startup import check_prompts, cut_prompt_warning, tag_problem


def read_prompts(source: str) -> list[dict]:
    """Metadata records for "train", "test" (or "shapeeval:train", "shapeeval:test"), a GenEval
    `*.jsonl` metadata file, or a `.txt` file of ShapeEval prompts (one per line, blank lines
    skipped, parsed into metadata). Files are read by `stepfast.data.prompts`, as the trainer reads
    them: a missing file, a directory, a line that is not UTF-8 or not JSON raises an error naming
    the file (and the line, `path:line`), as do a GenEval `tag` that is not text and a `.txt` prompt
    ShapeEval cannot parse."""
    return [record.metadata for record in read_prompt_records(source)[1]]


def read_prompt_records(source: str) -> tuple[Path, list[PromptRecord]]:
    """`read_prompts`'s file and its records, each with its line and its metadata (parsed from the
    text for a `.txt` file)."""
    path = resolve_prompt_file(f"shapeeval:{source}" if source in ("train", "test") else source)
    if path.suffix not in (".txt", ".jsonl") and not path.exists():
        raise ValueError(f"{source!r} is not train, test, shapeeval:train, shapeeval:test, a GenEval "
                         "*_metadata.jsonl file or a .txt file of prompts (one per line)")  # fmt: skip
    # names a missing file, a directory, another suffix, a bad line (path:line), a file of no prompts
    records = load_prompts(path)
    if problem := tag_problem(records, path):  # the table groups by tag
        raise ValueError(problem)
    if path.suffix == ".jsonl":
        return path, records  # their metadata as shapeeval.load_metadata reads them
    parsed = []
    for record in records:
        try:
            parsed.append(replace(record, metadata=parse_prompt(record.prompt)))
        except ValueError as exc:
            raise ValueError(f"{path}:{record.line}: {exc}") from None
    return path, parsed


REPORT_FILES = ("results.json", "results.md", "samples.png")


def check_out_dir(out: Path, overwrite: bool = False) -> None:
    """A ValueError naming `out` when `write_results` could not write there: `out` must be a
    directory or not exist yet (then its nearest existing parent must be a writable directory),
    none of the report files in it may be a directory, and, unless `overwrite`, it must not hold an
    earlier evaluation. Checked before any sampling."""
    check_creatable_dir(out, holds=", ".join(REPORT_FILES))
    for name in REPORT_FILES:
        if (out / name).is_dir():
            raise ValueError(f"{out / name} is a directory: the report file cannot be written there")
    held = [name for name in REPORT_FILES if (out / name).exists()]
    if not overwrite and held:  # any of them: results.md or samples.png alone is one's table or images
        raise ValueError(f"{out} already holds an evaluation ({', '.join(held)}): give another --out, or "
                         "--overwrite to replace it")  # fmt: skip


def write_results(result: dict, out: Path, columns: int) -> None:
    """results.json, results.md and samples.png into `out`, each written whole then renamed into
    place: an interrupted write leaves the file it replaces."""
    out.mkdir(parents=True, exist_ok=True)
    serialisable = {k: v for k, v in result.items() if k != "images"}
    files = {"results.json": lambda p: p.write_text(json.dumps(serialisable, indent=2) + "\n"),
             "results.md": lambda p: p.write_text(heldout.markdown_table(result))}  # fmt: skip
    if "images" in result:
        grid = heldout.sample_grid(result["images"], result["samples"], columns, title="Samples")
        files["samples.png"] = lambda p: grid.save(p, format="PNG")
    for name, write in files.items():
        write_atomically(out / name, write)


def main(argv: list[str] | None = None) -> dict:
    from stepfast.config import EvalConfig

    parser = argparse.ArgumentParser(prog="python -m stepfast.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_MODEL, type=path_argument,
                        help="diffusers SD3 pipeline directory (default: the embedded model)")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--lora", default=None, type=path_argument, help="LoRA weights to load onto the transformer")
    weights.add_argument("--transformer", default=None, type=path_argument,
                         help="a fully fine-tuned transformer (a checkpoint's transformer/) to use instead")
    parser.add_argument("--prompts", default="test", type=path_argument,
                        help="train | test | shapeeval:train | shapeeval:test | shapeeval:mini | *_metadata.jsonl | "
                             "prompts .txt (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=4,
                        help="images per prompt, seeds 0..N-1, and more where --min-images asks for them "
                             "(default: %(default)s)")
    parser.add_argument("--min-images", type=int, default=32,
                        help="more seeds for the prompts of a category with fewer images than this "
                             "(0: off; default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="sampling steps (default: %(default)s)")
    parser.add_argument("--cfg", type=float, default=4.5,
                        help="classifier-free guidance scale (default: %(default)s)")
    parser.add_argument("--out", default="outputs/evaluate", type=path_argument,
                        help="directory for results.json/.md and samples.png (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace an evaluation already in --out")
    parser.add_argument("--limit", type=int, default=None,
                        help="evaluate only N prompts, spread over categories (default: all)")
    parser.add_argument("--batch-size", type=int, default=EvalConfig.batch_size,
                        help="images per pipeline call, the trainer's eval.batch_size by default: the images "
                             "depend on it by rounding (default: %(default)s)")  # fmt: skip
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
        source, records = read_prompt_records(args.prompts)
    except (FileNotFoundError, ValueError) as exc:
        parser.error(f"--prompts: {exc}")
    records = [records[i] for i in heldout.spread_indices([r.metadata for r in records], args.limit)]
    metadata = [record.metadata for record in records]
    from stepfast.rewards import load

    reward = load("shapes")
    try:  # a record ShapeEval cannot score (GenEval's "dog"), named by its line before anything is drawn
        check_prompts(reward, records, "--prompts", str(source))
    except ConfigError as exc:
        parser.error(str(exc))
    for flag, check in (("--lora", lora_weights_file), ("--transformer", check_transformer_dir),
                        ("--model", check_pipeline_dir)):  # fmt: skip
        value = getattr(args, flag[2:])
        if value is not None:
            try:  # before the model loads
                check(value)
            except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
                parser.error(f"{flag}: {exc}")
    pipe = load_pipeline(args.model, device=device)
    warning = cut_prompt_warning(pipe, [m["prompt"] for m in metadata], f"--prompts {args.prompts}")
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    quiet_truncation_notices(pipe)
    if args.lora:
        with warnings.catch_warnings(record=True) as caught:  # a line each, not Python's warning format
            warnings.simplefilter("always")
            load_lora(pipe, args.lora)
        for warning in caught:
            if issubclass(warning.category, UserWarning):
                print(f"warning: {warning.message}", file=sys.stderr)
            else:  # deprecations and the like go through Python's filters (DeprecationWarning hidden)
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if args.transformer:
        load_transformer(pipe, args.transformer)
    if args.size is not None:
        try:
            check_resolution(pipe, args.size, "--size")
        except ValueError as exc:
            parser.error(str(exc))
    result = heldout.evaluate(
        pipe, metadata, args.seeds, args.steps, args.cfg, min_images=args.min_images, batch_size=args.batch_size,
        size=args.size, keep_images=True, reward=reward,
    )
    result["settings"].update(model=str(args.model), lora=args.lora, transformer=args.transformer,
                              prompt_source=args.prompts, device=str(device))  # fmt: skip
    print(heldout.markdown_table(result), end="")
    images = len(result["samples"])
    topped_up = images > len(metadata) * args.seeds  # --min-images added seeds somewhere
    print(
        f"{len(metadata)} prompt{'s' * (len(metadata) != 1)} x {args.seeds}{'+' * topped_up} "
        f"seed{'s' * (args.seeds != 1 or topped_up)} ({images} image{'s' * (images != 1)}), "
        f"{args.steps} step{'s' * (args.steps != 1)}, "
        f"cfg {args.cfg}: "
        f"sampling {result['seconds']['sampling']:.1f} s, scoring {result['seconds']['scoring']:.1f} s"
    )
    write_results(result, out, columns=args.seeds)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'samples.png'}")
    return result


def cli(argv: list[str] | None = None) -> int:
    """`python -m stepfast.evaluate`: main(), with bad input (model or LoRA directory, prompt file)
    named in one line, no traceback, and exit status 2, as argparse's own errors."""
    try:
        main(argv)
    except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
        print(f"python -m stepfast.evaluate: error: {exc}", file=sys.stderr)  # as argparse's errors begin
        return 2
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback; nothing is written before the end
        print("\npython -m stepfast.evaluate: interrupted (the results are written at the end)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    from stepfast import ctrl_c_as_usual

    ctrl_c_as_usual()
    sys.exit(cli())
