"""ShapeEval: prompt grammar, shipped GenEval-format files, and the scene renderer."""

import collections
import colorsys
import itertools

import numpy as np
import pytest

from stepfast.data import shapeeval
from stepfast.data.shapeeval import (
    CATEGORIES,
    COLORS,
    SHAPES,
    TEST_METADATA,
    TRAIN_METADATA,
    load_metadata,
    parse_prompt,
    relative_position,
    render,
    render_batch,
    render_scene,
)

# ----------------------------------------------------------------------------------------------
# Shipped files


def test_shipped_files_are_what_the_generator_writes(tmp_path):
    train, test = tmp_path / "train_metadata.jsonl", tmp_path / "test_metadata.jsonl"
    shapeeval.write_metadata(train, test)
    assert train.read_bytes() == TRAIN_METADATA.read_bytes()
    assert test.read_bytes() == TEST_METADATA.read_bytes()


def test_command_line_writes_the_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shapeeval, "TRAIN_METADATA", tmp_path / "train.jsonl")
    monkeypatch.setattr(shapeeval, "TEST_METADATA", tmp_path / "test.jsonl")
    shapeeval.main(["--write"])
    assert (tmp_path / "train.jsonl").read_bytes() == TRAIN_METADATA.read_bytes()
    assert (tmp_path / "test.jsonl").read_bytes() == TEST_METADATA.read_bytes()
    assert f"{len(load_metadata('test'))} prompts to {tmp_path / 'test.jsonl'}" in capsys.readouterr().out


def test_load_metadata_takes_paths_and_rejects_plain_prompt_files(tmp_path):
    assert load_metadata(TEST_METADATA) == load_metadata(str(TEST_METADATA)) == load_metadata("test")
    path = tmp_path / "prompts.txt"
    path.write_text("a photo of a circle\n")
    with pytest.raises(ValueError, match="not GenEval metadata"):
        load_metadata(path)


def test_split_is_disjoint_covers_every_category_and_the_whole_space():
    train, test = load_metadata("train"), load_metadata("test")
    train_prompts, test_prompts = {r["prompt"] for r in train}, {r["prompt"] for r in test}
    assert len(train_prompts) == len(train) and len(test_prompts) == len(test), "duplicate prompts"
    assert not train_prompts & test_prompts
    assert len(test) >= 64
    assert {r["tag"] for r in test} == set(CATEGORIES) == {r["tag"] for r in train}
    space = shapeeval.enumerate_prompts()
    assert train_prompts | test_prompts == {r["prompt"] for records in space.values() for r in records}
    # Each category is split about 30/70, so the test set is not dominated by chance.
    for tag, records in space.items():
        share = sum(r["tag"] == tag for r in test) / len(records)
        assert share == pytest.approx(0.3, abs=0.1) or len(records) <= 3


def test_every_shipped_record_is_parse_prompt_of_its_prompt():
    for split in ("train", "test"):
        for record in load_metadata(split):
            assert parse_prompt(record["prompt"]) == record
            assert list(record) == [k for k in ("tag", "include", "exclude", "prompt") if k in record]


def test_one_wording_per_scene():
    """No two prompts ask for the same picture (e.g. "X and Y" and "Y and X")."""

    def scene(record):
        objects = tuple(sorted((c["class"], c.get("color"), c["count"]) for c in record["include"]))
        relation = None
        for clause in record["include"]:
            if "position" in clause:
                rel, ref = clause["position"]
                pair = (clause["class"], record["include"][ref]["class"])
                # "a left of b" is "b right of a": key on the alphabetically first shape.
                relation = (rel, pair) if pair[0] < pair[1] else (shapeeval.INVERSE_RELATION[rel], pair[::-1])
        return objects, relation

    records = load_metadata("train") + load_metadata("test")
    counts = collections.Counter(scene(r) for r in records)
    assert max(counts.values()) == 1
    # ...and both word orders occur.
    pairs = [r["include"] for r in records if r["tag"] == "color_attr"]
    assert len({(a["class"], b["class"]) for a, b in pairs if a["class"] != b["class"]}) == 6


# ----------------------------------------------------------------------------------------------
# Prompt grammar


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("a photo of a triangle", {"tag": "single_object", "include": [{"class": "triangle", "count": 1}]}),
        (
            "a photo of a circle and a square",
            {"tag": "two_object", "include": [{"class": "circle", "count": 1}, {"class": "square", "count": 1}]},
        ),
        (
            "a photo of three squares",
            {
                "tag": "counting",
                "include": [{"class": "square", "count": 3}],
                "exclude": [{"class": "square", "count": 4}],
            },
        ),
        (
            "a photo of an orange circle",
            {"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "orange"}]},
        ),
        (
            "a photo of a circle left of a square",
            {
                "tag": "position",
                "include": [
                    {"class": "square", "count": 1},
                    {"class": "circle", "count": 1, "position": ["left of", 0]},
                ],
            },
        ),
        (
            "a photo of a red triangle and a white circle",
            {
                "tag": "color_attr",
                "include": [
                    {"class": "triangle", "count": 1, "color": "red"},
                    {"class": "circle", "count": 1, "color": "white"},
                ],
            },
        ),
        (
            "a photo of a blue circle and a yellow circle",
            {
                "tag": "color_attr",
                "include": [
                    {"class": "circle", "count": 1, "color": "blue"},
                    {"class": "circle", "count": 1, "color": "yellow"},
                ],
            },
        ),
    ],
)
def test_parse_prompt_gives_geneval_metadata(prompt, expected):
    assert parse_prompt(prompt) == {**expected, "prompt": prompt}


def test_parse_prompt_ignores_case_spacing_and_article():
    meta = parse_prompt("  A photo of  a Orange   circle ")
    assert meta["include"] == [{"class": "circle", "count": 1, "color": "orange"}]
    assert meta["prompt"] == "  A photo of  a Orange   circle "


@pytest.mark.parametrize(
    "prompt",
    [
        "a photo of a dog",
        "a photo of a circle and a circle",
        "a photo of five circles",
        "a photo of one circle",
        "a photo of a square above a square",
        "a photo of a red circle and a red circle",
        "a photo of a black circle",
        "a circle",
        "",
    ],
)
def test_parse_prompt_rejects_other_text_naming_it(prompt):
    with pytest.raises(ValueError, match="ShapeEval prompt") as info:
        parse_prompt(prompt)
    assert repr(prompt) in str(info.value)


def test_palette_is_saturated_and_distinct():
    assert {"red", "green", "blue", "yellow"} <= set(COLORS) and len(COLORS) >= 6
    hues = []
    for name, rgb in COLORS.items():
        hue, sat, value = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
        assert value == 1.0
        if name != "white":
            assert sat == 1.0
            hues.append(hue * 360)
    gaps = [min(abs(a - b), 360 - abs(a - b)) for a, b in itertools.combinations(hues, 2)]
    assert min(gaps) >= 29.5


# ----------------------------------------------------------------------------------------------
# Geometry


def test_relative_position_follows_geneval():
    square = [10, 10, 20, 20]
    assert relative_position([30, 10, 40, 20], square) == {"right of"}
    assert relative_position([-10, 10, 0, 20], square) == {"left of"}
    assert relative_position([10, -10, 20, 0], square) == {"above"}  # y grows downwards
    assert relative_position([10, 30, 20, 40], square) == {"below"}
    assert relative_position([30, 30, 40, 40], square) == {"right of", "below"}  # diagonal: both
    assert relative_position([11, 11, 21, 21], square) == set()  # offset within the size allowance
    # A 5-pixel shift of 10-pixel boxes, less the allowance 0.1 * (10 + 10), is 3/5 > 1/2 of it...
    assert relative_position([15, 10, 25, 20], square) == {"right of"}
    # ...a 4-pixel one only 2/4, and with twice the allowance the 5-pixel one is 1/5.
    assert relative_position([14, 10, 24, 20], square) == set()
    assert relative_position([15, 10, 25, 20], square, threshold=0.2) == set()


# ----------------------------------------------------------------------------------------------
# Renderer


def _hue_degrees(rgb):
    return colorsys.rgb_to_hsv(*(c / 255 for c in rgb))[0] * 360


def test_render_conventions_and_determinism():
    meta = parse_prompt("a photo of four triangles")
    for size in (32, 64, 97, 256):
        image = render(meta, size=size, rng=3)
        assert image.shape == (size, size, 3) and image.dtype == np.uint8
        assert (image[0] == 0).all() and (image[-1] == 0).all() and (image[:, 0] == 0).all(), "border is black"
        lit = image.max(-1) > 0
        assert 0.04 < lit.mean() < 0.5, "four objects cover a sizable but minor part of the image"
    np.testing.assert_array_equal(render(meta, rng=5), render(meta, rng=5))
    assert not np.array_equal(render(meta, rng=5), render(meta, rng=6))
    np.testing.assert_array_equal(render(meta, rng=np.random.default_rng(5)), render(meta, rng=5))


def test_render_batch_is_reproducible_and_shaped():
    metas = load_metadata("test")[:10]
    batch = render_batch(metas, size=48, seed=1)
    assert batch.shape == (10, 48, 48, 3) and batch.dtype == np.uint8
    np.testing.assert_array_equal(batch, render_batch(metas, size=48, seed=1))
    assert not np.array_equal(batch, render_batch(metas, size=48, seed=2))
    assert render_batch([], size=32, seed=0).shape == (0, 32, 32, 3)


def test_render_rejects_unknown_classes():
    with pytest.raises(ValueError, match="dog"):
        render({"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a photo of a dog"})


@pytest.mark.parametrize("size", [64, 128])
def test_rendered_scenes_hold_what_the_prompt_asks(size):
    rng = np.random.default_rng(0)
    metas = load_metadata("test") * 2
    for meta in metas:
        image, objects = render_scene(meta, size=size, rng=rng)
        asked = collections.Counter()
        for clause in meta["include"]:
            asked[clause["class"], clause.get("color")] += clause["count"]
        drawn = collections.Counter(
            (o.shape, o.color if (o.shape, o.color) in asked else None) for o in objects
        )
        assert drawn == asked, meta["prompt"]
        for a, b in itertools.combinations(objects, 2):
            gap = max(a.box[0] - b.box[2], b.box[0] - a.box[2], a.box[1] - b.box[3], b.box[1] - a.box[3])
            assert gap >= 0.07 * size - 1e-6, "objects keep a margin"
        for obj in objects:
            assert 0 <= obj.box[0] < obj.box[2] <= size and 0 <= obj.box[1] < obj.box[3] <= size
            # The brightest pixel in the box is the object's colour, jittered within its class.
            x1, y1, x2, y2 = (int(v) for v in obj.box)
            patch = image[y1:y2 + 1, x1:x2 + 1].reshape(-1, 3)
            pixel = patch[patch.astype(int).sum(1).argmax()]
            assert pixel.max() >= 0.8 * 255 - 1
            if obj.color == "white":
                assert pixel.min() >= 0.9 * pixel.max() - 1
            else:
                gap = abs(_hue_degrees(pixel) - _hue_degrees(COLORS[obj.color]))
                assert min(gap, 360 - gap) <= 7
        for clause in meta["include"]:
            if "position" in clause:
                relation, reference = clause["position"]
                assert relative_position(objects[1].box, objects[reference].box) == {relation}, meta["prompt"]


def test_unnamed_colours_are_drawn_from_the_whole_palette():
    rng = np.random.default_rng(0)
    meta = parse_prompt("a photo of four circles")
    seen = collections.Counter(o.color for _ in range(60) for o in render_scene(meta, rng=rng)[1])
    assert set(seen) == set(COLORS)


def test_sizes_vary_and_scale_with_the_image():
    meta = parse_prompt("a photo of a square")
    widths = {size: [render_scene(meta, size, rng)[1][0].box for rng in range(40)] for size in (64, 256)}
    for size, boxes in widths.items():
        relative = np.array([(b[2] - b[0]) / size for b in boxes])
        assert relative.min() >= 0.2 and relative.max() <= 0.46 and relative.std() > 0.03
    assert SHAPES == ("circle", "square", "triangle")
