"""The reward clients' HTTP layer and the remote client's batching, against servers on 127.0.0.1 that
answer as each test needs: which failures are retried and after how long, what the request carries,
and how a batch larger than `batch_size` is cut and put back together."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from stepfast import rewards
from stepfast.rewards import transport
from stepfast.rewards.transport import RewardServerError

from loopback import LoopbackServer


@pytest.fixture
def no_sleep(monkeypatch):
    """Records the waits between tries instead of waiting."""
    waits = []
    monkeypatch.setattr(transport, "time", SimpleNamespace(sleep=waits.append))  # this module's sleeps only
    return waits


def serve(statuses):
    """A server answering each POST with the next status of `statuses` (200: the JSON {"ok": 1})."""
    queue = list(statuses)
    return LoopbackServer(lambda path, body: (queue.pop(0), b'{"ok": 1}'))


def test_waits_double_up_to_the_cap_and_408_429_5xx_are_retried(no_sleep):
    with serve([503, 429, 408, 500, 200]) as server:
        got = transport.post(server.url + "/score?key=v", b"{}", json.loads, retries=5, backoff=20.0)
    assert got == {"ok": 1} and len(server.requests) == 5
    assert no_sleep == [20.0, 40.0, 60.0, 60.0]  # backoff * 2**k, at most MAX_BACKOFF_S
    assert all(path == "/score?key=v" for path, _, _ in server.requests)  # the query string is kept


def test_a_rejected_request_fails_at_once_and_a_failing_server_after_every_try(no_sleep):
    rejected = r"after 1 attempt\(s\); last failure: HTTP 400"
    with serve([400]) as server, pytest.raises(RewardServerError, match=rejected):
        transport.post(server.url, b"{}", json.loads, retries=5, backoff=1.0)
    assert no_sleep == []
    failing = r"after 3 attempt\(s\); last failure: HTTP 502"
    with serve([502] * 3) as server, pytest.raises(RewardServerError, match=failing):
        transport.post(server.url, b"{}", json.loads, retries=2, backoff=1.0)
    assert no_sleep == [1.0, 2.0]


def scores_of_metadata(extra_key_once=False, wrong_length_once=False):
    """A /score answer whose score for each image is its metadata record's "i"."""
    state = {"extra": extra_key_once, "wrong": wrong_length_once}

    def answer(path, body):
        request = json.loads(body)
        values = [float(m["i"]) for m in request["metadata"]]
        scores = {"score": values}
        if state["wrong"]:
            state["wrong"] = False
            scores["score"] = values[:-1]
        if state["extra"]:
            state["extra"] = False
            scores["extra"] = values
        return 200, json.dumps({"scores": {"shapes": scores}}).encode()

    return answer


def test_a_large_batch_is_cut_in_requests_that_each_carry_their_own_metadata(no_sleep):
    images = np.zeros((5, 8, 8, 3), np.uint8)
    with LoopbackServer(scores_of_metadata()) as server:
        reward = rewards.load("remote", url=server.url, rewards=" shapes ,", batch_size=2, retries=0)
        out = reward.score(images, ["p"] * 5, [{"i": i} for i in range(5)])
    assert reward.names == ["shapes"]  # the comma list's names, stripped
    assert out["score"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [len(json.loads(body)["images"]) for _, _, body in server.requests] == [2, 2, 1]


def test_answers_of_the_wrong_length_or_keys_in_some_batches_only_are_named(no_sleep):
    images, metadata = np.zeros((3, 8, 8, 3), np.uint8), [{"i": i} for i in range(3)]
    with LoopbackServer(scores_of_metadata(wrong_length_once=True)) as server:  # malformed: retried, then scored
        out = rewards.load("remote", url=server.url, rewards=["shapes"], retries=1).score(images, ["p"] * 3, metadata)
    assert out["score"].tolist() == [0.0, 1.0, 2.0] and len(server.requests) == 2
    short = LoopbackServer(lambda path, body: (200, b'{"scores": {"shapes": {"score": [1.0]}}}'))
    with short, pytest.raises(RewardServerError, match="shapes/score is not a list of 3 numbers"):
        rewards.load("remote", url=short.url, rewards=["shapes"], retries=0).score(images, ["p"] * 3)
    uneven = LoopbackServer(scores_of_metadata(extra_key_once=True))
    with uneven, pytest.raises(RewardServerError, match=r"reward 'shapes' returned \['extra'\] for some batches only"):
        rewards.load("remote", url=uneven.url, rewards=["shapes"], batch_size=2, retries=0).score(
            images, ["p"] * 3, metadata)  # fmt: skip
