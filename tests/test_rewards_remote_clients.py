"""The VLM-judge and GenEval clients against small servers the tests start on 127.0.0.1."""

import base64
import io
import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from stepfast import rewards
from stepfast.rewards.transport import RewardServerError

from loopback import LoopbackServer


@pytest.fixture
def images():
    rng = np.random.default_rng(5)
    return rng.integers(0, 256, size=(5, 20, 28, 3), dtype=np.uint8)


PROMPTS = ["a red cube", "two cats", "unjudgeable", "a sign", "a dog"]


def judge_answer(fail_first: list):
    """An OpenAI-compatible judge: 'Final Score: 1 + 4 * mean brightness', read from the data URL."""

    def answer(path, body):
        if fail_first:
            fail_first.pop()
            return 500, b'{"error": "warming up"}'
        request = json.loads(body)
        image_part, text_part = request["messages"][0]["content"]
        assert request["model"] == "judge-7b" and request["temperature"] == 0.0
        prefix = "data:image/png;base64,"
        assert image_part["image_url"]["url"].startswith(prefix)
        png = base64.b64decode(image_part["image_url"]["url"][len(prefix):])
        pixels = np.asarray(Image.open(io.BytesIO(png), formats=["PNG"]).convert("RGB"))
        caption = text_part["text"].split("Caption: ")[1]
        if "unjudgeable" in caption:
            content = "I cannot rate this."
        else:
            content = f"Looks fine for [{caption}]. Final Score: {1 + 4 * pixels.mean() / 255:.2f}"
        reply = {"choices": [{"message": {"role": "assistant", "content": content}}], "size": pixels.shape}
        return 200, json.dumps(reply).encode()

    return answer


def test_vlm_judge_scores_and_parses(images):
    server = LoopbackServer(judge_answer(fail_first=[True]))
    try:
        reward = rewards.load("vlm", url=server.url, model="judge-7b", image_size=None,
                              prompt_template="Rate it. Caption: {prompt}", score_regex=r"Final Score:\s*([0-9.]+)",
                              max_score=5, concurrency=3, retries=2, backoff=0.01, timeout=10)
        out = reward.score(images, PROMPTS)
        raw = torch.tensor([float(f"{1 + 4 * a.mean() / 255:.2f}") for a in images])
        raw[2] = 0.0  # no "Final Score" in the answer: 0, as Flow-GRPO
        torch.testing.assert_close(out["raw"], raw)
        torch.testing.assert_close(out["score"], raw / 5)
        torch.testing.assert_close(out["parsed"], torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]))
        assert all(path == "/v1/chat/completions" for path, _, _ in server.requests)
        assert len(server.requests) == 6  # five images and one retried 500
    finally:
        server.close()


def test_vlm_judge_defaults_follow_unified_reward(images):
    sizes = []

    def answer(path, body):
        request = json.loads(body)
        url = request["messages"][0]["content"][0]["image_url"]["url"]
        sizes.append(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size)
        text = request["messages"][0]["content"][1]["text"]
        assert text.startswith("<image>\n") and text.endswith("Text Caption: [a red cube]")
        return 200, json.dumps({"choices": [{"message": {"content": "Final Score: 4"}}]}).encode()

    server = LoopbackServer(answer)
    try:
        reward = rewards.load("vlm", url=server.url + "/v1", retries=0, timeout=10, api_key="k")
        out = reward.score(images[:2], PROMPTS[:1] * 2)
        torch.testing.assert_close(out["score"], torch.tensor([0.8, 0.8]))
        assert sizes == [(512, 512)] * 2
        assert server.requests[0][1]["Authorization"] == "Bearer k"
    finally:
        server.close()
    with pytest.raises(RewardServerError, match="failed after 2 attempt"):
        rewards.load("vlm", url=server.url, retries=1, backoff=0.01, timeout=2).score(images[:1], PROMPTS[:1])


TAGS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]


def geneval_answer(fail_first: list, every_tag: bool = True):
    """Flow-GRPO's GenEval server protocol, with results computed from the metadata; the per-tag
    dicts hold every tag, or (every_tag=False) only the tags of the batch's images."""

    def answer(path, body):
        if fail_first:
            fail_first.pop()
            return 500, b"Traceback: CUDA out of memory"
        request = pickle.loads(body)
        for jpeg in request["images"]:
            assert Image.open(io.BytesIO(jpeg), formats=["JPEG"]).size == (28, 20)
        metas = request["meta_datas"]
        strict = [float(m["i"] % 2) for m in metas]
        tags = TAGS if every_tag else sorted({m["tag"] for m in metas})
        group = {t: [s if m["tag"] == t else -10.0 for s, m in zip(strict, metas)] for t in tags}
        response = {
            "scores": [m["i"] / 10 for m in metas],
            "rewards": [0.0 if request["only_strict"] else 1.0 for _ in metas],
            "strict_rewards": strict,
            "group_rewards": group,
            "group_strict_rewards": group,
        }
        return 200, pickle.dumps(response)

    return answer


def test_geneval_remote_protocol(images):
    server = LoopbackServer(geneval_answer(fail_first=[True]))
    try:
        metas = [{"i": i, "tag": TAGS[i % 3], "prompt": p} for i, p in enumerate(PROMPTS)]
        reward = rewards.load("geneval_remote", url=server.url, batch_size=2, retries=2, backoff=0.01, timeout=10)
        out = reward.score(images, PROMPTS, metas)
        torch.testing.assert_close(out["score"], torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4]))
        torch.testing.assert_close(out["strict_accuracy"], torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0]))
        torch.testing.assert_close(out["accuracy"], torch.zeros(5))  # only_strict: no loose check
        torch.testing.assert_close(out["two_object_strict_accuracy"], torch.tensor([-10.0, 1.0, -10.0, -10.0, 0.0]))
        groups = {f"{t}_{k}" for t in TAGS for k in ("accuracy", "strict_accuracy")}
        assert set(out) == {"score", "accuracy", "strict_accuracy"} | groups
        assert len(server.requests) == 4  # three batches and one retried 500
        loose = rewards.load("geneval_remote", url=server.url, only_strict=False, retries=0)
        loose = loose.score(images, PROMPTS, metas)
        torch.testing.assert_close(loose["accuracy"], torch.ones(5))
    finally:
        server.close()
    with pytest.raises(ValueError, match="one GenEval metadata record per image"):
        reward.score(images, PROMPTS)
    with pytest.raises(TypeError, match="pickle"):
        rewards.load("geneval_remote")


def test_geneval_remote_fills_the_tags_a_batch_lacks_with_minus_ten(images):
    """A batch's answer may hold only the tags of its own images: a tag first seen in a later batch,
    or missing from one, still gets a value for every image (-10 for the images of other tags)."""
    metas = [{"i": i, "tag": tag, "prompt": p} for i, (tag, p) in enumerate(zip(
        ["colors", "colors", "counting", "colors", "position"], PROMPTS))]  # batches of 2: {colors}, {colors, counting}, {position}
    with LoopbackServer(geneval_answer([], every_tag=False)) as server:
        out = rewards.load("geneval_remote", url=server.url, batch_size=2, retries=0).score(images, PROMPTS, metas)
    strict = [0.0, 1.0, 0.0, 1.0, 0.0]
    for tag in ("colors", "counting", "position"):
        expected = [s if m["tag"] == tag else -10.0 for s, m in zip(strict, metas)]
        torch.testing.assert_close(out[f"{tag}_strict_accuracy"], torch.tensor(expected), msg=tag)
    assert "single_object_accuracy" not in out


def test_geneval_remote_is_checked_before_any_image_is_drawn():
    """Its address when it loads, its server at start (a TCP connection: the protocol has no health
    check), and a GenEval record for every prompt: a .txt prompt file has none."""
    with pytest.raises(ValueError, match=r"URL '127.0.0.1:18085' must look like http://HOST:PORT"):
        rewards.load("geneval_remote", url="127.0.0.1:18085")
    with LoopbackServer(geneval_answer([])) as server:
        reward = rewards.load("geneval_remote", url=server.url, retries=0)
        reward.check_server()
    with pytest.raises(ValueError, match=rf"reward server {server.url} does not accept connections after 2 attempt"):
        rewards.load("geneval_remote", url=server.url, retries=1, backoff=0.01).check_server()
    reward.check(["a", "b"], [{"tag": "colors"}, {"tag": "counting"}])
    with pytest.raises(rewards.PromptError, match=r"prompt 2: .*GenEval metadata records"):
        reward.check(["a", "b"], [{"tag": "colors"}, None])
    with pytest.raises(rewards.PromptError, match=r"prompt 1: "):
        reward.check(["a"], None)


def test_vlm_judge_is_checked_at_load_and_start():
    with pytest.raises(ValueError, match="must look like http://HOST:PORT"):
        rewards.load("vlm", url="localhost:8000")
    models = json.dumps({"object": "list", "data": [{"id": "judge-7b"}, {"id": "other"}]}).encode()
    keys = []

    def listing(path, headers):  # a server that wants its key for the list too
        keys.append(headers.get("Authorization"))
        if headers.get("Authorization") != "Bearer k":
            return 401, b'{"error": "no key"}'
        return (200, models) if path == "/v1/models" else (404, b"")

    with LoopbackServer(judge_answer([]), get=listing) as server:
        rewards.load("vlm", url=server.url, model="judge-7b", retries=0, api_key="k").check_server()
        with pytest.raises(ValueError, match=r"/v1/models serves \['judge-7b', 'other'\], not model='judge-8b'"):
            rewards.load("vlm", url=server.url + "/v1", model="judge-8b", retries=0, api_key="k").check_server()
        with pytest.raises(ValueError, match=r"/v1/models refused the request \(HTTP 401: .*\): check api_key"):
            rewards.load("vlm", url=server.url, model="judge-7b", retries=0, api_key="wrong").check_server()
    assert keys == ["Bearer k", "Bearer k", "Bearer wrong"]
    with LoopbackServer(judge_answer([])) as server:  # no model list (GET answers 501): taken at its word
        rewards.load("vlm", url=server.url, model="anything", retries=0).check_server()
    with pytest.raises(ValueError, match="does not accept connections"):
        rewards.load("vlm", url=server.url, retries=0).check_server()


def test_ocr_refuses_a_prompt_without_quoted_text_before_any_image_is_drawn():
    from stepfast.rewards.ocr import OcrReward

    reward = object.__new__(OcrReward)  # check() reads no model (EasyOCR need not be installed)
    reward.check(['a sign that says "open"', 'a "b" c'])
    with pytest.raises(rewards.PromptError, match=r"prompt 2: OCR reward needs prompts with the text to render"):
        reward.check(['a sign that says "open"', "a sign with no text"])


def test_the_per_tag_columns_are_told_apart_from_the_per_image_ones():
    """The trainer logs the mean of each reward column; GenEval's per-tag columns hold -10 for other
    tags' images, so they are left out (category/<tag> is logged instead)."""
    from stepfast.rewards.geneval_remote import is_tag_column

    assert is_tag_column("two_object_strict_accuracy") and is_tag_column("geneval_remote/colors_accuracy")
    for key in ("score", "accuracy", "strict_accuracy", "geneval_remote", "geneval_remote/strict_accuracy"):
        assert not is_tag_column(key), key


def test_the_default_judge_pattern_reads_a_1_to_5_score_and_nothing_past_it():
    """'Final Score: 10' is off the judge's 1-5 scale: no score (0, as an answer without one), not 1."""
    import re

    from stepfast.rewards.vlm import UNIFIED_REWARD_REGEX

    def read(text):
        match = re.search(UNIFIED_REWARD_REGEX, text)
        return match.group(1) if match else None

    assert [read(f"Final Score: {x}") for x in ("4", "4.5", "5.0", "1")] == ["4", "4.5", "5.0", "1"]
    assert read("Final Score: 10") is None and read("Final Score: 4.5.1") is None and read("Final Score: 0") is None
    assert read("the image ... Final Score: 3. It matches the caption.") == "3"
