"""Prompt files in Flow-GRPO's formats, and their errors."""

import json

import pytest

from stepfast.data.prompts import PromptRecord, load_prompts
from stepfast.data.shapeeval import load_metadata


def test_txt_one_prompt_per_line_blank_lines_skipped(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("a photo of a cat\n\n   \n  a red square  \nthird\n")
    assert load_prompts(path) == [PromptRecord("a photo of a cat"), PromptRecord("a red square"), PromptRecord("third")]
    assert load_prompts(str(path))[0].metadata is None
    assert [r.line for r in load_prompts(path)] == [1, 4, 5]  # each prompt's line, for errors


def test_jsonl_keeps_each_line_as_metadata(tmp_path):
    records = [
        {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}],
         "prompt": "a photo of two clocks"},
        {"prompt": "a photo of a bench", "extra": [1, 2]},
    ]  # fmt: skip
    path = tmp_path / "test_metadata.jsonl"
    path.write_text(json.dumps(records[0]) + "\n\n" + json.dumps(records[1]) + "\n")
    loaded = load_prompts(path)
    assert [r.prompt for r in loaded] == ["a photo of two clocks", "a photo of a bench"]
    assert [r.metadata for r in loaded] == records
    assert [r.line for r in loaded] == [1, 3]


@pytest.mark.parametrize("split", ["train", "test"])
def test_named_shapeeval_sets(split):
    loaded = load_prompts(f"shapeeval:{split}")
    assert [r.metadata for r in loaded] == load_metadata(split)
    assert all(r.prompt == r.metadata["prompt"] for r in loaded)


def test_the_mini_set_is_train_prompts_with_room_to_learn():
    """shapeeval:mini, the default run's task, draws from the train split only (the held-out test
    split stays held out), 8 prompts of ShapeEval's one-object and counting kinds."""
    mini = [r.metadata for r in load_prompts("shapeeval:mini")]
    train = load_metadata("train")
    assert len(mini) == 8 and all(m in train for m in mini)
    assert {m["tag"] for m in mini} == {"single_object", "counting", "colors"}


def _error(path, exc_type=ValueError) -> str:
    with pytest.raises(exc_type) as info:
        load_prompts(path)
    return str(info.value)


def test_missing_file_is_named(tmp_path):
    message = _error(tmp_path / "nope.txt", FileNotFoundError)
    assert str(tmp_path / "nope.txt") in message and "does not exist" in message


@pytest.mark.parametrize("name, text", [("empty.txt", ""), ("blank.txt", "\n  \n\n"), ("empty.jsonl", "\n")])
def test_empty_file_is_an_error(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    message = _error(path)
    assert str(path) in message and "no prompts" in message


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "bad_metadata.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b",,}\n{"prompt": "c"}\n')
    message = _error(path)
    assert message.startswith(f"{path}:3: malformed JSON")


def test_line_without_prompt_names_file_and_line(tmp_path):
    path = tmp_path / "x_metadata.jsonl"
    path.write_text('{"prompt": "a"}\n{"tag": "colors", "include": []}\n')
    message = _error(path)
    assert message.startswith(f"{path}:2:") and "lacks 'prompt'" in message and "tag" in message


@pytest.mark.parametrize(
    "line, complaint",
    [
        ('["a photo of a cat"]', "JSON object"),
        ('{"prompt": 3}', "non-empty string"),
        ('{"prompt": "  "}', "non-empty string"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, line, complaint):
    path = tmp_path / "x.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    message = _error(path)
    assert message.startswith(f"{path}:2:") and complaint in message


def test_bad_utf8_names_its_line(tmp_path):
    path = tmp_path / "x.txt"
    path.write_bytes(b"one\ntwo\nth\xffree\n")
    assert _error(path).startswith(f"{path}:3: not UTF-8")


@pytest.mark.parametrize("name, first", [("x.txt", b"a red circle\n"), ("x.jsonl", b'{"prompt": "a red circle"}\n')])
def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path, name, first):
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + first + first.replace(b"red", b"blue"))
    assert [r.prompt for r in load_prompts(path)] == ["a red circle", "a blue circle"]


def test_unknown_suffix_and_unknown_named_set(tmp_path):
    path = tmp_path / "prompts.csv"
    path.write_text("a\n")
    message = _error(path)
    assert str(path) in message and ".txt" in message and ".jsonl" in message
    assert "shapeeval:train" in _error("shapeeval:validation")
    assert "directory" in _error(tmp_path)


@pytest.mark.parametrize("data", [b"a red circle\rtwo blue squares\r", b"a red circle\r\ntwo blue squares\n",
                                  b"a red circle\ntwo blue squares"])  # fmt: skip
def test_lines_end_as_in_text_mode(tmp_path, data):
    """CR-only (old Mac), CRLF and LF line ends, as Python's text mode reads them (and Flow-GRPO): a
    lone CR had made one prompt of two."""
    path = tmp_path / "x.txt"
    path.write_bytes(data)
    assert [(r.prompt, r.line) for r in load_prompts(path)] == [("a red circle", 1), ("two blue squares", 2)]
    jsonl = tmp_path / "x.jsonl"
    jsonl.write_bytes(b'{"prompt": "a"}\r\r{"prompt": "b"}\r')
    assert [(r.prompt, r.line) for r in load_prompts(jsonl)] == [("a", 1), ("b", 3)]


def test_a_byte_order_mark_inside_the_file_names_its_line(tmp_path):
    path = tmp_path / "x.txt"
    path.write_bytes(b"\xef\xbb\xbfa red circle\n\xef\xbb\xbftwo blue squares\n")  # two files joined
    assert _error(path).startswith(f"{path}:2: starts with a byte order mark (U+FEFF)")


def test_a_file_that_cannot_be_read_is_named(tmp_path, monkeypatch):
    path = tmp_path / "x.txt"
    path.write_text("a red circle\n")

    def refused(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(path), "read_bytes", refused)
    assert _error(path) == f"cannot read prompt file {path}: Permission denied"
