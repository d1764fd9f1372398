"""ShapeEval: a GenEval analogue on synthetic scenes whose reward can be computed exactly.

GenEval (Ghosh et al., 2023) scores text-to-image models on six kinds of prompts with an object
detector. ShapeEval keeps GenEval's six categories, its prompt templates and its metadata format
(the `*_metadata.jsonl` files Flow-GRPO trains on), but its objects are flat circles, squares and
triangles in saturated colours on a black background, so a scene can be rendered for any prompt
and checked from the pixels alone (`stepfast.rewards.shapes.ShapesReward`).

Categories and prompt templates (as GenEval writes them):

    single_object  "a photo of a {shape}"
    two_object     "a photo of a {shape} and a {shape}"              (two different shapes)
    counting       "a photo of {two|three|four} {shape}s"
    colors         "a photo of a {color} {shape}"
    position       "a photo of a {shape} {left of|right of|above|below} a {shape}"
    color_attr     "a photo of a {color} {shape} and a {color} {shape}"  (different colours)

Metadata follows GenEval: `include` lists clauses {"class", "count", optional "color", optional
"position": [relation, index of the reference clause]}; counting prompts carry GenEval's
`exclude` clause (count + 1 of the same class). For "a photo of a circle left of a square":

    {"tag": "position", "include": [{"class": "square", "count": 1},
     {"class": "circle", "count": 1, "position": ["left of", 0]}],
     "prompt": "a photo of a circle left of a square"}

Unlike GenEval, a colour-attribute prompt may name one shape twice in two colours ("a photo of a
red circle and a blue circle"): it tests binding colours to objects, and it makes the prompt space
large enough that a scene rarely satisfies some other prompt by chance.

The prompt space (378 prompts: 3 single, 3 two-object, 9 counting, 27 colours, 12 position, 324
colour-attribute) holds one wording per distinct scene: "a circle and a square" and "a square and
a circle" ask for the same picture, so only one of them (chosen by a seeded coin) is a prompt, and
likewise "a circle left of a square" / "a square right of a circle". Each category is split
train/test (30% test, at least one prompt) by a seeded shuffle; `python -m stepfast.data.shapeeval
--write` regenerates the shipped files byte for byte.
"""

from __future__ import annotations

import argparse
import colorsys
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")

#: Palette: colour name -> RGB. Hues at least 30 degrees apart plus white, all at full value, so a
#: colour is told apart by hue (white by its low saturation) whatever the brightness of a pixel.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "orange": (255, 128, 0),
    "yellow": (255, 255, 0),
    "green": (0, 255, 0),
    "cyan": (0, 255, 255),
    "blue": (0, 0, 255),
    "purple": (128, 0, 255),
    "magenta": (255, 0, 255),
    "white": (255, 255, 255),
}

CATEGORIES: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

#: GenEval's spatial relations, read as "the first object is <relation> the second".
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
INVERSE_RELATION = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}

NUMBER_WORDS = {2: "two", 3: "three", 4: "four"}

#: GenEval's POSITION_THRESHOLD: centre offsets are shrunk by this fraction of the summed box sizes.
POSITION_THRESHOLD = 0.1

_DATA_DIR = Path(__file__).resolve().parent
TRAIN_METADATA: Path = _DATA_DIR / "shapeeval_train_metadata.jsonl"
TEST_METADATA: Path = _DATA_DIR / "shapeeval_test_metadata.jsonl"
#: The default run's task: 8 train prompts (single_object, counting, colors) that the embedded model
#: passes 6% to 69% of the time (40 ODE steps, CFG 4.5, 16 seeds), so that learning shows in minutes.
MINI_METADATA: Path = _DATA_DIR / "shapeeval_mini_metadata.jsonl"

SPLIT_SEED = 20240611
TEST_FRACTION = 0.3


# ----------------------------------------------------------------------------------------------
# Prompt text <-> metadata
# ----------------------------------------------------------------------------------------------


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _noun(color: str | None, shape: str) -> str:
    """'a circle', 'an orange circle'."""
    phrase = f"{color} {shape}" if color else shape
    return f"{_article(phrase)} {phrase}"


def _metadata(tag: str, include: list[dict], prompt: str) -> dict:
    """A metadata record with GenEval's key order; counting gets GenEval's exclude clause."""
    meta: dict = {"tag": tag, "include": include}
    if tag == "counting":
        meta["exclude"] = [{"class": include[0]["class"], "count": include[0]["count"] + 1}]
    meta["prompt"] = prompt
    return meta


def single_object(shape: str) -> dict:
    return _metadata("single_object", [{"class": shape, "count": 1}], f"a photo of {_noun(None, shape)}")


def two_object(first: str, second: str) -> dict:
    include = [{"class": first, "count": 1}, {"class": second, "count": 1}]
    return _metadata("two_object", include, f"a photo of {_noun(None, first)} and {_noun(None, second)}")


def counting(shape: str, count: int) -> dict:
    return _metadata("counting", [{"class": shape, "count": count}], f"a photo of {NUMBER_WORDS[count]} {shape}s")


def colors(color: str, shape: str) -> dict:
    include = [{"class": shape, "count": 1, "color": color}]
    return _metadata("colors", include, f"a photo of {_noun(color, shape)}")


def position(shape: str, relation: str, reference: str) -> dict:
    """"a photo of a {shape} {relation} a {reference}": the reference is clause 0, as in GenEval."""
    include = [{"class": reference, "count": 1}, {"class": shape, "count": 1, "position": [relation, 0]}]
    return _metadata("position", include, f"a photo of {_noun(None, shape)} {relation} {_noun(None, reference)}")


def color_attr(color1: str, shape1: str, color2: str, shape2: str) -> dict:
    """Two coloured objects. Unlike GenEval the shapes may be equal ("a red circle and a blue
    circle"), which tests binding colours to objects rather than to classes."""
    include = [{"class": shape1, "count": 1, "color": color1}, {"class": shape2, "count": 1, "color": color2}]
    prompt = f"a photo of {_noun(color1, shape1)} and {_noun(color2, shape2)}"
    return _metadata("color_attr", include, prompt)


_SHAPE = "(" + "|".join(SHAPES) + ")"
_COLOR = "(" + "|".join(COLORS) + ")"
_RELATION = "(" + "|".join(RELATIONS) + ")"
_NUMBER = "(" + "|".join(NUMBER_WORDS.values()) + ")"
_A = "an?"
_GRAMMAR = [
    ("counting", re.compile(rf"a photo of {_NUMBER} {_SHAPE}s")),
    ("position", re.compile(rf"a photo of {_A} {_SHAPE} {_RELATION} {_A} {_SHAPE}")),
    ("color_attr", re.compile(rf"a photo of {_A} {_COLOR} {_SHAPE} and {_A} {_COLOR} {_SHAPE}")),
    ("two_object", re.compile(rf"a photo of {_A} {_SHAPE} and {_A} {_SHAPE}")),
    ("colors", re.compile(rf"a photo of {_A} {_COLOR} {_SHAPE}")),
    ("single_object", re.compile(rf"a photo of {_A} {_SHAPE}")),
]
_WORD_TO_NUMBER = {word: n for n, word in NUMBER_WORDS.items()}


def parse_prompt(prompt: str) -> dict:
    """The GenEval metadata of a ShapeEval prompt, recovered from its text alone.

    Case and runs of whitespace are ignored and "a"/"an" are interchangeable; the returned record's
    "prompt" is the text as given. Two-object forms need two different shapes (as in GenEval, whose
    clauses are matched by class); a colour-attribute prompt may repeat a shape in two different
    colours. Raises ValueError naming the prompt when it is not ShapeEval's.
    """
    if not isinstance(prompt, str):
        raise ValueError(f"prompt {prompt!r} is not a string")
    text = " ".join(prompt.lower().split())
    for tag, pattern in _GRAMMAR:
        match = pattern.fullmatch(text)
        if match is None:
            continue
        groups = match.groups()
        if tag == "counting":
            meta = counting(groups[1], _WORD_TO_NUMBER[groups[0]])
        elif tag == "position":
            shape, relation, reference = groups
            if shape == reference:
                raise ValueError(f"ShapeEval prompt {prompt!r} relates a {shape} to itself; use two different shapes")
            meta = position(shape, relation, reference)
        elif tag == "color_attr":
            if groups[:2] == groups[2:]:
                raise ValueError(
                    f"ShapeEval prompt {prompt!r} names the {groups[0]} {groups[1]} twice; "
                    f"write 'a photo of two {groups[1]}s' or use two different objects"
                )
            meta = color_attr(*groups)
        elif tag == "two_object":
            if groups[0] == groups[1]:
                raise ValueError(
                    f"ShapeEval prompt {prompt!r} names the {groups[0]} twice; "
                    f"write 'a photo of two {groups[0]}s' or use two different shapes"
                )
            meta = two_object(*groups)
        elif tag == "colors":
            meta = colors(*groups)
        else:
            meta = single_object(groups[0])
        meta["prompt"] = prompt
        return meta
    raise ValueError(
        f"{prompt!r} is not a ShapeEval prompt: expected 'a photo of' followed by one of "
        f"'a {{shape}}', 'a {{shape}} and a {{shape}}', '{{two|three|four}} {{shape}}s', 'a {{color}} {{shape}}', "
        f"'a {{shape}} {{relation}} a {{shape}}', 'a {{color}} {{shape}} and a {{color}} {{shape}}' with shapes "
        f"{list(SHAPES)}, colours {list(COLORS)} and relations {list(RELATIONS)}"
    )


# ----------------------------------------------------------------------------------------------
# The prompt space and the shipped train/test files
# ----------------------------------------------------------------------------------------------


def enumerate_prompts(seed: int = SPLIT_SEED) -> dict[str, list[dict]]:
    """Every ShapeEval prompt, by category: one wording per distinct scene.

    Where two wordings describe the same scene (the order of "X and Y"; "X left of Y" versus
    "Y right of X") a seeded coin picks one, so both word orders occur across the set.
    """
    coin = np.random.default_rng(seed)

    def flip() -> bool:
        return bool(coin.integers(2))

    pairs = list(itertools.combinations(SHAPES, 2))
    space: dict[str, list[dict]] = {tag: [] for tag in CATEGORIES}
    space["single_object"] = [single_object(s) for s in SHAPES]
    for a, b in pairs:
        space["two_object"].append(two_object(b, a) if flip() else two_object(a, b))
    space["counting"] = [counting(s, n) for s in SHAPES for n in NUMBER_WORDS]
    space["colors"] = [colors(c, s) for c in COLORS for s in SHAPES]
    for (a, b), relation in itertools.product(pairs, RELATIONS):
        space["position"].append(position(b, INVERSE_RELATION[relation], a) if flip() else position(a, relation, b))
    for a, b in itertools.combinations_with_replacement(SHAPES, 2):
        # Same shape: the colour pair is unordered; different shapes: each colour goes to either.
        color_pairs = itertools.combinations(COLORS, 2) if a == b else itertools.permutations(COLORS, 2)
        for ca, cb in color_pairs:
            space["color_attr"].append(color_attr(cb, b, ca, a) if flip() else color_attr(ca, a, cb, b))
    return space


def split_prompts(seed: int = SPLIT_SEED, test_fraction: float = TEST_FRACTION) -> tuple[list[dict], list[dict]]:
    """(train, test) metadata: each category shuffled with `seed`, its first share going to test."""
    rng = np.random.default_rng(seed + 1)
    train, test = [], []
    for tag, records in enumerate_prompts(seed).items():
        order = rng.permutation(len(records))
        n_test = max(1, round(test_fraction * len(records)))
        test += [records[i] for i in order[:n_test]]
        train += [records[i] for i in order[n_test:]]
    return train, test


def _dumps(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def write_metadata(train_path: Path | None = None, test_path: Path | None = None) -> tuple[int, int]:
    """Regenerate the train/test metadata files (the shipped ones by default); their line counts."""
    train_path, test_path = train_path or TRAIN_METADATA, test_path or TEST_METADATA
    train, test = split_prompts()
    Path(train_path).write_text(_dumps(train), encoding="utf-8", newline="\n")
    Path(test_path).write_text(_dumps(test), encoding="utf-8", newline="\n")
    return len(train), len(test)


def load_metadata(split_or_path: str | Path) -> list[dict]:
    """Metadata records of "train", "test", or a GenEval-style `*_metadata.jsonl` file."""
    # Imported here: prompts.py imports this module for the shipped files' paths.
    from stepfast.data.prompts import load_prompts

    path = {"train": TRAIN_METADATA, "test": TEST_METADATA}.get(split_or_path, split_or_path)
    if Path(path).suffix != ".jsonl":
        raise ValueError(f"{path} is not GenEval metadata: expected 'train', 'test' or a .jsonl file")
    return [record.metadata for record in load_prompts(Path(path))]


# ----------------------------------------------------------------------------------------------
# Geometry shared by the renderer and the reward
# ----------------------------------------------------------------------------------------------


def relative_position(box_a, box_b, threshold: float = POSITION_THRESHOLD) -> set[str]:
    """GenEval's relations of box A to box B (boxes [x1, y1, x2, y2], y down).

    The centre offset is shrunk on each axis by `threshold` times the summed box sizes; a relation
    holds when its axis carries more than half of the (unshrunk) offset's length.
    """
    ax1, ay1, ax2, ay2 = (float(v) for v in box_a[:4])
    bx1, by1, bx2, by2 = (float(v) for v in box_b[:4])
    dx, dy = (ax1 + ax2 - bx1 - bx2) / 2, (ay1 + ay2 - by1 - by2) / 2
    rx = math.copysign(max(abs(dx) - threshold * ((ax2 - ax1) + (bx2 - bx1)), 0.0), dx)
    ry = math.copysign(max(abs(dy) - threshold * ((ay2 - ay1) + (by2 - by1)), 0.0), dy)
    if abs(rx) < 1e-3 and abs(ry) < 1e-3:
        return set()
    norm = math.hypot(dx, dy)
    rx, ry = rx / norm, ry / norm
    relations = set()
    if rx < -0.5:
        relations.add("left of")
    if rx > 0.5:
        relations.add("right of")
    if ry < -0.5:
        relations.add("above")
    if ry > 0.5:
        relations.add("below")
    return relations


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------

#: Object size (circle diameter, square side, triangle height) as a fraction of the image side,
#: by number of objects in the scene: crowded scenes get smaller objects so they always fit.
_SIZE_RANGE = {1: (0.24, 0.45), 2: (0.22, 0.34), 3: (0.21, 0.29), 4: (0.2, 0.26)}
#: Triangles are equilateral and upright; their bounding box is 2/sqrt(3) wider than tall.
_TRIANGLE_ASPECT = 2 / math.sqrt(3)
_MARGIN = 0.07  # least gap between objects' boxes, fraction of the image side
_BORDER = 0.04  # least gap between an object and the image edge
_HUE_JITTER = 5 / 360  # palette hues are >= 30 degrees apart: jitter stays far from the midpoints


def _scene_objects(meta: dict) -> list[tuple[str, str | None]]:
    """(shape, colour or None) for every object the metadata asks for, clause by clause."""
    objects = []
    for clause in meta["include"]:
        if clause["class"] not in SHAPES or clause.get("color", "red") not in COLORS:
            raise ValueError(
                f"cannot render {clause} of {meta.get('prompt')!r}: shapes are {SHAPES}, colours {list(COLORS)}"
            )
        objects += [(clause["class"], clause.get("color"))] * int(clause["count"])
    return objects


def _jittered_rgb(color: str, rng: np.random.Generator) -> np.ndarray:
    """A random shade of a palette colour: hue, saturation and value jittered within its class."""
    r, g, b = (v / 255 for v in COLORS[color])
    hue, sat, _ = colorsys.rgb_to_hsv(r, g, b)
    if sat < 0.5:  # white
        sat = rng.uniform(0.0, 0.08)
    else:
        hue = (hue + rng.uniform(-_HUE_JITTER, _HUE_JITTER)) % 1.0
        sat = rng.uniform(0.85, 1.0)
    value = rng.uniform(0.8, 1.0)
    return np.array(colorsys.hsv_to_rgb(hue, sat, value), dtype=np.float32)


def _box_size(shape: str, size: float) -> tuple[float, float]:
    """(width, height) of a shape's bounding box for a nominal size."""
    return (size * _TRIANGLE_ASPECT, size) if shape == "triangle" else (size, size)


def _place(shapes: list[str], image_size: int, rng: np.random.Generator, relation: str | None) -> list[list[float]]:
    """Random non-overlapping boxes [x1, y1, x2, y2] (pixels) for the shapes.

    With a relation (position prompts: object 1 relative to object 0) the layout is accepted only
    when the relation holds with room to spare and the perpendicular one does not hold at all, so
    the scene is unambiguous under GenEval's rule even after the boxes shift by a pixel.
    """
    n = len(shapes)
    lo, hi = _SIZE_RANGE[min(n, 4)]
    margin, border = _MARGIN * image_size, _BORDER * image_size
    for attempt in range(2000):
        scale = 0.97 ** (attempt // 100)  # shrink slowly if a crowded layout keeps failing
        boxes = []
        for shape in shapes:
            w, h = _box_size(shape, rng.uniform(lo, hi) * scale * image_size)
            x = rng.uniform(border, image_size - border - w)
            y = rng.uniform(border, image_size - border - h)
            boxes.append([x, y, x + w, y + h])
        separated = all(
            max(a[0] - b[2], b[0] - a[2], a[1] - b[3], b[1] - a[3]) >= margin
            for a, b in itertools.combinations(boxes, 2)
        )
        if not separated:
            continue
        if relation is not None:
            strong = relative_position(boxes[1], boxes[0], threshold=2.5 * POSITION_THRESHOLD)
            loose = relative_position(boxes[1], boxes[0], threshold=0.0)
            if relation not in strong or loose != {relation}:
                continue
        return boxes
    raise RuntimeError(f"could not place {shapes} in a {image_size}px image")  # pragma: no cover


def _coverage(shape: str, box: list[float], xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Anti-aliased coverage in [0, 1] of a shape over pixel centres (xs [1, W], ys [H, 1]).

    Coverage is 0.5 - signed distance (pixels), clipped: a one-pixel linear ramp across the edge.
    """
    x1, y1, x2, y2 = box
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    if shape == "circle":
        distance = np.sqrt((xs - cx) ** 2 + (ys - cy) ** 2) - (x2 - x1) / 2
    elif shape == "square":
        distance = np.maximum(np.abs(xs - cx) - (x2 - x1) / 2, np.abs(ys - cy) - (y2 - y1) / 2)
    else:  # upright triangle: apex at the top centre, base along the bottom of the box
        half_width, height = (x2 - x1) / 2, y2 - y1
        side = math.hypot(half_width, height)
        # Outward normals of the two slanted sides are (+-height, -half_width) / side.
        slanted = (np.abs(xs - cx) * height - (ys - y1) * half_width) / side
        distance = np.maximum(slanted, ys - y2)
    return np.clip(0.5 - distance, 0.0, 1.0)


def _as_generator(rng) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


@dataclass(frozen=True)
class SceneObject:
    """One object as drawn: its shape, palette colour and box [x1, y1, x2, y2] in pixels."""

    shape: str
    color: str
    box: tuple[float, float, float, float]


def render_scene(
    meta: dict, size: int = 64, rng: np.random.Generator | int | None = None
) -> tuple[np.ndarray, list[SceneObject]]:
    """`render`'s image together with the objects drawn in it (the ground truth of the scene)."""
    rng = _as_generator(rng)
    objects = _scene_objects(meta)
    shapes = [shape for shape, _ in objects]
    relation = next((c["position"][0] for c in meta["include"] if "position" in c), None)
    boxes = _place(shapes, size, rng, relation)
    palette = list(COLORS)
    image = np.zeros((size, size, 3), dtype=np.float32)
    centres = np.arange(size, dtype=np.float32) + 0.5
    drawn = []
    for (shape, color), box in zip(objects, boxes):
        color = color or palette[rng.integers(len(palette))]
        rgb = _jittered_rgb(color, rng)
        # Draw only inside the box grown by two pixels: the rest of the image has zero coverage.
        x0, y0 = max(int(box[0]) - 2, 0), max(int(box[1]) - 2, 0)
        x1, y1 = min(int(box[2]) + 3, size), min(int(box[3]) + 3, size)
        cover = _coverage(shape, box, centres[None, x0:x1], centres[y0:y1, None])
        image[y0:y1, x0:x1] += cover[..., None] * rgb
        drawn.append(SceneObject(shape, color, tuple(box)))
    return np.rint(np.clip(image, 0.0, 1.0) * 255).astype(np.uint8), drawn


def render(meta: dict, size: int = 64, rng: np.random.Generator | int | None = None) -> np.ndarray:
    """A scene satisfying `meta` (a ShapeEval metadata record): uint8 [size, size, 3].

    Objects get random sizes (scaled with the image), random non-overlapping places separated by a
    margin, and a jittered shade of their colour; an object whose colour the prompt does not name
    gets a random palette colour. The background is black. Position prompts are laid out so that
    the asked relation holds clearly and the perpendicular one does not.
    """
    return render_scene(meta, size, rng)[0]


def render_batch(metas: list[dict], size: int = 64, seed: int = 0) -> np.ndarray:
    """Scenes for a list of metadata records, uint8 [B, size, size, 3], reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    if not metas:
        return np.zeros((0, size, size, 3), dtype=np.uint8)
    return np.stack([render(meta, size, rng) for meta in metas])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="regenerate the shipped train/test metadata files")
    args = parser.parse_args(argv)
    if args.write:
        n_train, n_test = write_metadata(TRAIN_METADATA, TEST_METADATA)
        print(f"wrote {n_train} prompts to {TRAIN_METADATA}\nwrote {n_test} prompts to {TEST_METADATA}")
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
