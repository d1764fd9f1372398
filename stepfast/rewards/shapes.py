"""ShapesReward: GenEval's rules, scored from the pixels of ShapeEval scenes.

GenEval finds objects with a detector and colours with CLIP; on ShapeEval scenes (flat shapes in
palette colours on black, `stepfast.data.shapeeval`) both can be read off the pixels:

1. Objects: pixels brighter than `threshold` (max channel) form the foreground; its connected
   components (8-connected, one image at a time, the whole batch in one scipy call) are the
   objects. Components smaller than `min_area` or larger than `max_area` (fractions of the image)
   are dropped as specks or background.
2. Shape: from intensity-weighted complex moments of the component (grown by two pixels to take in
   its blurred rim), with z = (x - cx) + i (y - cy) and E the weighted mean,

       m2 = |E z^2| / E|z|^2,   m3 = |E z^3| / (E|z|^2)^(3/2),   m4 = |E z^4| / (E|z|^2)^2.

   A disc has m2 = m3 = m4 = 0; an axis-aligned square m4 = 0.6; an equilateral triangle
   m3 = 0.8 (its 3-fold symmetry zeroes m2 and m4). All three are invariant to rotation and scale,
   and E z^k (k >= 1) is unchanged by an isotropic Gaussian blur, so blur moves only the
   normaliser. The class is the circle when m3 and m4 are both under 0.27 (well below the
   square's and triangle's values even after blur or JPEG), else the square when m4 > m3, else
   the triangle; a component with m2 > 0.3 (elongated, so none of the three) is "unknown".
3. Colour: each foreground pixel is classed by hue (white by low saturation; dark rim pixels keep
   their hue, so blur does not change it); the object's colour is its pixels' majority class.
   An object whose majority holds under half of its pixels is "unknown" too (noise, merged
   objects of different colours).
4. Boxes are the components' pixel bounding boxes [x1, y1, x2, y2], used with GenEval's
   relative-position rule.

Scoring follows Flow-GRPO's GenEval reward server (`evaluate_reward`), clause by clause:

* strict = 1 when every include clause holds exactly: the number of objects of its class equals
  its count, the number of those with its colour equals its count (if a colour is asked), and
  every one of them stands in the asked relation to every object of the reference clause (if a
  position is asked); and no exclude clause is violated (GenEval: fewer than `count` objects of
  that class). With `exclusive=True` (default) it also needs no object of a class the prompt
  does not name: ShapeEval scenes hold only what the prompt asks for (GenEval, on photographs,
  ignores other classes; `exclusive=False` reproduces that).
* score = mean over clause terms, times a precision factor. Terms per include clause: count
  max(0, 1 - |found - count| / count); colour (if asked) the same on the number of objects of
  that colour, 0 when the class count is wrong; position (if asked) 1 when the relation holds,
  else 0 (also when the count or the reference clause failed). With `exclusive=True` the mean is
  multiplied by n_asked / (n_asked + n_extra), n_extra the objects of unnamed classes, so stray
  objects cost score without ever making a stray object worth more than a missing one. For
  counting prompts with nothing extra: score = max(0, 1 - |found - asked| / asked), as in
  Flow-GRPO.
* category = index of the prompt's tag in CATEGORIES (-1 for a tag outside them).
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass

import numpy as np
import torch
from scipy import ndimage

from stepfast.data.shapeeval import (
    CATEGORIES, COLORS, POSITION_THRESHOLD, RELATIONS, SHAPES, parse_prompt, relative_position,
)
from stepfast.rewards import PromptError
from stepfast.rewards.images import to_uint8

UNKNOWN = "unknown"

_COLOR_NAMES = tuple(COLORS)
_WHITE_SATURATION = 0.45  # palette white has saturation 0, every other palette colour 1
_GROW = 2  # pixels added around a component for its moments: the blurred rim belongs to it
_MOMENT_FLOOR = 8.0  # channel-mean level taken as black: cancels the mean of background noise
# Shape decision on (m2, m3, m4): see the module docstring for the prototypes.
_MAX_ELONGATION = 0.3
_MIN_HARMONIC = 0.27


@dataclass(frozen=True)
class DetectedObject:
    """One object found in an image."""

    shape: str  # one of SHAPES, or "unknown"
    color: str  # a palette colour name, or "unknown"
    box: tuple[int, int, int, int]  # [x1, y1, x2, y2]: pixel edges, x right, y down
    area: int  # foreground pixels


def _hue_table() -> np.ndarray:
    """Palette index of the nearest palette hue, for each whole degree of hue."""
    hues, indices = [], []
    for index, rgb in enumerate(COLORS.values()):
        hue, sat, _ = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
        if sat >= _WHITE_SATURATION:
            hues.append(hue * 360)
            indices.append(index)
    degrees = np.arange(360)[:, None]
    gap = np.abs(degrees - np.array(hues)[None, :])
    gap = np.minimum(gap, 360 - gap)
    return np.array(indices, dtype=np.int64)[gap.argmin(1)]


_HUE_TO_COLOR = _hue_table()
_WHITE_INDEX = next((i for i, rgb in enumerate(COLORS.values()) if min(rgb) == max(rgb)), -1)


def _pixel_colors(red: np.ndarray, green: np.ndarray, blue: np.ndarray) -> np.ndarray:
    """Palette index of each pixel (1-D uint8 channels): hue class, or white when unsaturated."""
    r, g, b = red.astype(np.float32), green.astype(np.float32), blue.astype(np.float32)
    high, low = np.maximum(np.maximum(r, g), b), np.minimum(np.minimum(r, g), b)
    delta = np.maximum(high - low, 1e-6)
    hue = np.where(high == r, (g - b) / delta, np.where(high == g, (b - r) / delta + 2, (r - g) / delta + 4))
    classes = _HUE_TO_COLOR[np.rint(hue * 60).astype(np.int64) % 360]
    if _WHITE_INDEX >= 0:
        classes = np.where(high - low < _WHITE_SATURATION * high, _WHITE_INDEX, classes)
    return classes


def _sanitize(images):
    """Replace NaN/inf in float inputs so that arbitrary tensors convert to pixels."""
    if isinstance(images, torch.Tensor) and images.is_floating_point():
        return torch.nan_to_num(images.detach().float(), nan=0.0, posinf=1.0, neginf=-1.0)
    if isinstance(images, np.ndarray) and np.issubdtype(images.dtype, np.floating):
        return np.nan_to_num(images.astype(np.float32), nan=0.0, posinf=1.0, neginf=-1.0)
    return images


class ShapesReward:
    """GenEval-style reward for ShapeEval prompts, computed from the pixels alone.

    Options: `threshold` foreground level (fraction of 255, on the max channel); `min_area`,
    `max_area` component sizes kept (fractions of the image area); `exclusive` whether objects of
    classes the prompt does not name fail `strict` and lower `score`; `position_threshold`
    GenEval's box-size allowance for relations.
    """

    def __init__(
        self,
        threshold: float = 0.35,
        min_area: float = 0.004,
        max_area: float = 0.5,
        exclusive: bool = True,
        position_threshold: float = POSITION_THRESHOLD,
    ):
        # checked here, not at the first image: a threshold of 5 would fail every image without a word
        if not 0 < threshold < 1:
            raise ValueError(f"shapes: threshold (a fraction of 255) must be in (0, 1), got {threshold}")
        if not 0 <= min_area < max_area <= 1:
            raise ValueError(f"shapes: min_area and max_area (fractions of the image) must satisfy "
                             f"0 <= min_area < max_area <= 1, got {min_area} and {max_area}")  # fmt: skip
        if not position_threshold >= 0:
            raise ValueError(f"shapes: position_threshold must be >= 0, got {position_threshold}")
        self.threshold = threshold
        self.min_area = min_area
        self.max_area = max_area
        self.exclusive = exclusive
        self.position_threshold = position_threshold
        self._parsed: dict[str, dict] = {}

    # ------------------------------------------------------------------------------------------
    def detect(self, images) -> list[list[DetectedObject]]:
        """The objects in each image of a batch (any form `to_uint8` accepts)."""
        pixels = to_uint8(_sanitize(images))
        batch, height, width = pixels.shape[:3]
        if batch == 0 or height == 0 or width == 0:
            return [[] for _ in range(batch)]
        red, green, blue = pixels[..., 0], pixels[..., 1], pixels[..., 2]
        brightest = np.maximum(np.maximum(red, green), blue)
        plane_only = np.zeros((3, 3, 3), dtype=bool)
        plane_only[1] = True  # 8-connected within an image, never across the batch
        labels, n = ndimage.label(brightest > round(self.threshold * 255), structure=plane_only)
        if n == 0:
            return [[] for _ in range(batch)]
        areas = np.bincount(labels.ravel(), minlength=n + 1)
        keep = (areas >= self.min_area * height * width) & (areas <= self.max_area * height * width)
        keep[0] = False
        kept = int(keep.sum())
        if kept == 0:
            return [[] for _ in range(batch)]
        renumber = np.zeros(n + 1, dtype=np.int32)
        renumber[keep] = np.arange(1, kept + 1, dtype=np.int32)
        labels = renumber[labels]
        areas = areas[keep]

        # Colour: majority vote of the component's pixels.
        inside = np.flatnonzero(labels)
        owner = labels.ravel()[inside].astype(np.int64)
        classes = _pixel_colors(red.ravel()[inside], green.ravel()[inside], blue.ravel()[inside])
        votes = np.bincount(owner * len(COLORS) + classes, minlength=(kept + 1) * len(COLORS))
        votes = votes.reshape(kept + 1, len(COLORS))[1:]
        colors = votes.argmax(1)
        purity = votes.max(1) / np.maximum(votes.sum(1), 1)

        # Shape from the moments; a component of mixed colours is no single ShapeEval object.
        level = red.astype(np.uint16) + green + blue
        m2, m3, m4 = shape_moments(level, labels, kept)
        shapes = np.where(m4 > m3, SHAPES.index("square"), SHAPES.index("triangle"))
        shapes = np.where(np.maximum(m3, m4) < _MIN_HARMONIC, SHAPES.index("circle"), shapes)
        shapes = np.where((m2 > _MAX_ELONGATION) | (purity < 0.5), -1, shapes)

        found: list[list[DetectedObject]] = [[] for _ in range(batch)]
        for index, where in enumerate(ndimage.find_objects(labels)):
            image, rows, cols = where
            found[image.start].append(
                DetectedObject(
                    shape=SHAPES[shapes[index]] if shapes[index] >= 0 else UNKNOWN,
                    color=_COLOR_NAMES[colors[index]] if shapes[index] >= 0 else UNKNOWN,
                    box=(cols.start, rows.start, cols.stop, rows.stop),
                    area=int(areas[index]),
                )
            )
        return found

    # ------------------------------------------------------------------------------------------
    def _metadata(self, prompt: str) -> dict:
        """parse_prompt, cached: GRPO scores each prompt many times over."""
        meta = self._parsed.get(prompt)
        if meta is None:
            if len(self._parsed) >= 100_000:  # ShapeEval has a few hundred prompts; bound odd inputs
                self._parsed.clear()
            meta = self._parsed[prompt] = parse_prompt(prompt)
        return meta

    def record(self, prompt: str, record: dict | None = None) -> dict:
        """The GenEval record an image of `prompt` is scored against: `record` when it has clauses
        ("include"), else the prompt parsed (a ShapeEval prompt: records from a file of plain prompts
        hold only {"prompt": ...}). ValueError naming the prompt when the record asks for a class or
        colour that ShapeEval does not draw (GenEval's "dog"), when a clause is malformed (no count,
        a position naming no earlier clause), or when the prompt is not ShapeEval's."""
        if record is None:
            return self._metadata(prompt)
        if not isinstance(record, dict):
            raise ValueError(f"the record of prompt {prompt!r} must be a JSON object, got {record!r}")
        if "include" not in record:
            return self._metadata(prompt)
        for where, clauses in (("include", record["include"]), ("exclude", record.get("exclude", []))):
            if not isinstance(clauses, list) or (where == "include" and not clauses):
                raise ValueError(f"the record of prompt {prompt!r}: {where!r} must be a list of clauses"
                                 f"{' (at least one)' if where == 'include' else ''}, got {clauses!r}")  # fmt: skip
            for i, clause in enumerate(clauses):
                problem = _clause_problem(clause, i if where == "include" else None)
                if problem:
                    raise ValueError(f"the record of prompt {prompt!r}: {where}[{i}] {problem}")
        return record

    def check(self, prompts, metadata=None) -> None:
        """Before any image is drawn: a ValueError naming the first prompt (from 1) that cannot be
        scored."""
        for i, prompt in enumerate(prompts):
            try:
                self.record(prompt, None if metadata is None else metadata[i])
            except ValueError as exc:
                raise PromptError(i, str(exc)) from None

    def score(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        """Per image: "score" (partial credit in [0, 1]), "strict" (0/1), "category" (index).

        `metadata`, when given, holds per-prompt GenEval records (entries that are None or have no
        clauses are parsed from the prompt); ShapeEval's records are exactly what `parse_prompt`
        returns for their prompts.
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        detections = self.detect(images)
        if len(detections) != len(prompts):
            raise ValueError(f"got {len(detections)} images but {len(prompts)} prompts")
        if metadata is not None and len(metadata) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(metadata)} metadata records")
        scores, stricts, categories = [], [], []
        for i, (objects, prompt) in enumerate(zip(detections, prompts)):
            meta = self.record(prompt, None if metadata is None else metadata[i])
            strict, partial = evaluate(objects, meta, self.exclusive, self.position_threshold)
            scores.append(partial)
            stricts.append(float(strict))
            tag = meta.get("tag")
            categories.append(CATEGORIES.index(tag) if tag in CATEGORIES else -1)
        return {
            "score": torch.tensor(scores, dtype=torch.float32),
            "strict": torch.tensor(stricts, dtype=torch.float32),
            "category": torch.tensor(categories, dtype=torch.float32),
        }


def shape_moments(level: np.ndarray, labels: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(m2, m3, m4) of components 1..n of `labels` [B, H, W], weighting pixels by `level` [B, H, W].

    `level` is the channel sum (0..765). Each component is grown by _GROW pixels so its blurred rim
    counts, and weights are taken above _MOMENT_FLOOR. See the module docstring for the definitions.
    """
    height, width = labels.shape[1:]
    grown = ndimage.maximum_filter(labels, size=(1, 2 * _GROW + 1, 2 * _GROW + 1)).ravel()
    where = np.flatnonzero(grown)
    owner = grown[where]
    weight = np.maximum(level.ravel()[where].astype(np.float32) - 3 * _MOMENT_FLOOR, 0.0)
    total = np.bincount(owner, weight, n + 1)[1:] + 1e-9

    def mean(values):
        return np.bincount(owner, weight * values, n + 1)[1:] / total

    xs = (where % width).astype(np.float32)
    ys = ((where // width) % height).astype(np.float32)
    dx = xs - np.concatenate([[0.0], mean(xs)]).astype(np.float32)[owner]
    dy = ys - np.concatenate([[0.0], mean(ys)]).astype(np.float32)[owner]
    dx2, dy2, dxy = dx * dx, dy * dy, dx * dy
    spread = np.maximum(mean(dx2 + dy2), 1e-9)
    m2 = np.hypot(mean(dx2 - dy2), mean(2 * dxy)) / spread
    m3 = np.hypot(mean(dx * (dx2 - 3 * dy2)), mean(dy * (3 * dx2 - dy2))) / spread**1.5
    m4 = np.hypot(mean(dx2 * dx2 - 6 * dx2 * dy2 + dy2 * dy2), mean(4 * dxy * (dx2 - dy2))) / spread**2
    return m2, m3, m4


def _clause_problem(clause, index: int | None) -> str | None:
    """What is wrong with a GenEval clause ({"class", "count"[, "color"][, "position"]}), or None.
    `index`: the clause's place among the include clauses (a position refers to an earlier one);
    None for an exclude clause."""
    if not isinstance(clause, dict):
        return f"must be an object with a class and a count, got {clause!r}"
    cls, count, color = clause.get("class"), clause.get("count"), clause.get("color")
    if cls not in SHAPES or (color is not None and color not in COLORS):
        bad = f"class {cls!r}" if cls not in SHAPES else f"colour {color!r}"
        return (f"asks for {bad}, which ShapeEval does not draw (shapes: {', '.join(SHAPES)}; "
                f"colours: {', '.join(COLORS)})")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        return f"needs a count, a whole number >= 1, got {count!r}"
    if "position" in clause:
        position = clause["position"]
        if index is None:
            return "is an exclude clause: it cannot ask for a position"
        if (not isinstance(position, (list, tuple)) or len(position) != 2 or position[0] not in RELATIONS
                or isinstance(position[1], bool) or not isinstance(position[1], int) or not 0 <= position[1] < index):
            return (f"position must be [relation, index of an earlier include clause] with relation one of "
                    f"{', '.join(RELATIONS)}, got {position!r}")  # fmt: skip
    return None


def evaluate(
    objects: list[DetectedObject],
    meta: dict,
    exclusive: bool = True,
    position_threshold: float = POSITION_THRESHOLD,
) -> tuple[bool, float]:
    """(strict, score) of detected objects against a GenEval metadata record.

    The rules of Flow-GRPO's `evaluate_reward` (see the module docstring), generalised to prompts
    that name a class in more than one clause ("a red circle and a blue circle"): a clause's class
    count is compared with the total asked for that class, its colour count with the total asked
    for that class in that colour. For GenEval's prompts (one clause per class) nothing changes.
    """
    by_class: dict[str, list[DetectedObject]] = {}
    for obj in objects:
        by_class.setdefault(obj.shape, []).append(obj)
    class_total: dict[str, int] = {}
    color_total: dict[tuple[str, str], int] = {}
    for clause in meta["include"]:
        class_total[clause["class"]] = class_total.get(clause["class"], 0) + int(clause["count"])
        if "color" in clause:
            key = (clause["class"], clause["color"])
            color_total[key] = color_total.get(key, 0) + int(clause["count"])

    strict = True
    terms: list[float] = []
    matched_groups: list[list[DetectedObject] | None] = []
    for clause in meta["include"]:
        asked = class_total[clause["class"]]
        group = by_class.get(clause["class"], [])
        terms.append(max(0.0, 1.0 - abs(len(group) - asked) / asked))
        matched = len(group) == asked
        if not matched and ("color" in clause or "position" in clause):
            terms.append(0.0)
        if matched and "color" in clause:
            asked = color_total[(clause["class"], clause["color"])]
            group = [obj for obj in group if obj.color == clause["color"]]
            terms.append(max(0.0, 1.0 - abs(len(group) - asked) / asked))
            matched = len(group) == asked
        if "position" in clause and matched:
            relation, reference = clause["position"]
            targets = matched_groups[reference] if 0 <= reference < len(matched_groups) else None
            matched = targets is not None and all(
                relation in relative_position(obj.box, target.box, position_threshold)
                for obj in group
                for target in targets
            )
            terms.append(float(matched))
        strict = strict and matched
        matched_groups.append(group if matched else None)
    for clause in meta.get("exclude", []):
        if len(by_class.get(clause["class"], [])) >= int(clause["count"]):
            strict = False
    partial = sum(terms) / len(terms) if terms else 0.0
    if exclusive:
        extra = sum(len(group) for shape, group in by_class.items() if shape not in class_total)
        asked = sum(class_total.values())
        strict = strict and extra == 0
        partial *= asked / (asked + extra) if asked + extra else 0.0
    return strict, partial
