"""Prompt files in Flow-GRPO's formats.

* `.txt`: one prompt per line; blank lines are skipped (Flow-GRPO's `TextPromptDataset`).
* `.jsonl`: GenEval metadata (Flow-GRPO's `GenEvalPromptDataset`, files named
  `*_metadata.jsonl`): one JSON object per line holding at least a "prompt" string; the whole
  object is the prompt's metadata, handed to rewards that read it (GenEval, ShapeEval).
* "shapeeval:train", "shapeeval:test", "shapeeval:mini": the ShapeEval metadata files shipped with
  stepfast (mini: 8 train prompts, the default run's task).

Bad input raises an error that names the file, the line and what is wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from stepfast.data.shapeeval import MINI_METADATA, TEST_METADATA, TRAIN_METADATA

#: Names accepted in place of a path.
NAMED_PROMPT_FILES: dict[str, Path] = {
    "shapeeval:train": TRAIN_METADATA, "shapeeval:test": TEST_METADATA, "shapeeval:mini": MINI_METADATA,
}


@dataclass(frozen=True)
class PromptRecord:
    """One prompt, with its metadata record when the file carries one (GenEval JSONL)."""

    prompt: str
    metadata: dict | None = None
    line: int | None = field(default=None, compare=False)  # its line in the file (from 1), for errors


def resolve_prompt_file(path_or_name: str | Path) -> Path:
    """The file behind a path or one of NAMED_PROMPT_FILES."""
    if isinstance(path_or_name, str) and path_or_name in NAMED_PROMPT_FILES:
        return NAMED_PROMPT_FILES[path_or_name]
    if isinstance(path_or_name, str) and path_or_name.startswith("shapeeval:"):
        raise ValueError(f"unknown prompt set {path_or_name!r}: named sets are {', '.join(NAMED_PROMPT_FILES)}")
    return Path(path_or_name)


def numbered_lines(path: Path):
    """(line number, text) of each line, decoding line by line so a bad byte names its line. Lines end
    at "\n", "\r\n" or "\r" (Python's text mode, which Flow-GRPO reads its files in); a byte order
    mark opening the file (as some Windows editors save UTF-8) is not part of its first line, and one
    opening a later line (files joined together) is an error naming it."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read prompt file {path}: {exc.strerror or exc}") from None
    for number, raw in enumerate(re.split(rb"\r\n|\r|\n", data), start=1):
        try:
            text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{number}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if text.startswith("\ufeff"):
            raise ValueError(f"{path}:{number}: starts with a byte order mark (U+FEFF), which only a file's "
                             "first line may: were files joined together? Remove it")  # fmt: skip
        yield number, text


def _read_txt(path: Path) -> list[PromptRecord]:
    return [PromptRecord(text.strip(), line=n) for n, text in numbered_lines(path) if text.strip()]


def _read_jsonl(path: Path) -> list[PromptRecord]:
    records = []
    for number, text in numbered_lines(path):
        if not text.strip():
            continue
        try:
            item = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: malformed JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object with a 'prompt', got {type(item).__name__}")
        if "prompt" not in item:
            raise ValueError(f"{path}:{number}: line lacks 'prompt' (keys: {', '.join(item) or 'none'})")
        if not isinstance(item["prompt"], str) or not item["prompt"].strip():
            raise ValueError(f"{path}:{number}: 'prompt' must be a non-empty string, got {item['prompt']!r}")
        records.append(PromptRecord(item["prompt"], item, line=number))
    return records


def load_prompts(path_or_name: str | Path) -> list[PromptRecord]:
    """The prompts of a `.txt` or GenEval `.jsonl` file, or of a named set ("shapeeval:train")."""
    path = resolve_prompt_file(path_or_name)
    try:
        found = path.exists()
    except OSError as exc:  # under a folder that may not be searched
        raise ValueError(f"cannot read prompt file {path}: {exc.strerror or exc}") from None
    if not found:
        raise FileNotFoundError(f"prompt file {path} does not exist")
    if path.is_dir():
        raise ValueError(f"prompt file {path} is a directory; expected a .txt or .jsonl file")
    if path.suffix == ".txt":
        records = _read_txt(path)
    elif path.suffix == ".jsonl":
        records = _read_jsonl(path)
    else:
        raise ValueError(
            f"prompt file {path} has suffix {path.suffix!r}; expected .txt (one prompt per line) "
            "or .jsonl (GenEval metadata, one JSON object with a 'prompt' per line)"
        )
    if not records:
        raise ValueError(f"prompt file {path} holds no prompts")
    return records
