"""The reward server and its client, live on loopback: exact scores, batching, bad requests, and a
client that survives 500s, malformed answers, slow answers, dropped connections and a restart, then
fails with RewardServerError naming the server. Every server here is started by the test on
127.0.0.1 and every loop is bounded."""

import base64
import http.client
import json
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
import torch

from stepfast import rewards
from stepfast.data.shapeeval import load_metadata, render_batch
from stepfast.reward_server import Batcher, BadRequest, RewardServer
from stepfast.rewards.remote import RewardServerError, encode_png

from loopback import LoopbackServer

FAST = dict(retries=3, backoff=0.01, timeout=10.0)


@pytest.fixture(scope="module")
def scenes():
    metas = load_metadata("train")[:6]
    return render_batch(metas, size=64, seed=0), [m["prompt"] for m in metas], metas


@pytest.fixture(scope="module")
def local():
    return {"shapes": rewards.load("shapes"), "jpeg_compressibility": rewards.load("jpeg_compressibility")}


def start(served, port=0, **options) -> RewardServer:
    server = RewardServer(served, "127.0.0.1", port, **options)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def stop(server) -> None:
    server.shutdown()
    server.server_close()


@pytest.fixture
def server(local):
    server = start(local)
    yield server
    stop(server)


def assert_same(remote: dict, expected: dict) -> None:
    assert set(remote) == set(expected)
    for key in expected:
        assert torch.equal(remote[key], expected[key]), (key, remote[key], expected[key])


def test_remote_scores_equal_local_scores(server, local, scenes):
    images, prompts, metas = scenes
    assert rewards.load("remote", url=server.url, rewards=["shapes"]).health()["rewards"] == [
        "jpeg_compressibility", "shapes"]
    remote = rewards.load("remote", url=server.url, rewards=["shapes"], **FAST)
    assert_same(remote.score(images, prompts), local["shapes"].score(images, prompts))
    assert_same(remote.score(images, prompts, metas), local["shapes"].score(images, prompts, metas))
    as_float = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255  # float input, [0, 1]
    assert_same(remote.score(as_float, prompts), local["shapes"].score(as_float, prompts))

    weights = {"shapes": 1.0, "jpeg_compressibility": 0.25}
    both = rewards.load("remote", url=server.url, rewards=list(weights), weights=weights, batch_size=4, **FAST)
    assert_same(both.score(images, prompts), rewards.load_weighted(weights).score(images, prompts))


class Recording:
    """`reward`, recording the number of images of each call."""

    def __init__(self, reward):
        self.reward, self.batches = reward, []

    def score(self, images, prompts, metadata=None):
        self.batches.append(len(prompts))
        return self.reward.score(images, prompts, metadata)


def test_concurrent_requests_share_reward_calls(local, scenes):
    images, prompts, _ = scenes
    counting = Recording(local["shapes"])
    # the batch closes when its 6 images are in, not at the end of a window a busy machine could miss
    batcher = Batcher({"shapes": counting}, batch_size=6, window_s=60)
    futures = [batcher.submit(["shapes"], images[i : i + 2], prompts[i : i + 2], None) for i in (0, 2, 4)]
    results = [f.result(10) for f in futures]
    batcher.close()
    assert counting.batches == [6]  # three requests, one reward call
    for i, result in zip((0, 2, 4), results):
        expected = local["shapes"].score(images[i : i + 2], prompts[i : i + 2])
        assert result["shapes"] == {k: v.tolist() for k, v in expected.items()}

    counting.batches.clear()
    server = start({"shapes": counting}, batch_size=4, batch_window_s=0.05)
    try:
        remote = rewards.load("remote", url=server.url, rewards=["shapes"], **FAST)
        out = [None] * 6

        def score_one(i):
            out[i] = remote.score(images[i : i + 1], prompts[i : i + 1])

        threads = [threading.Thread(target=score_one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        for i in range(6):
            assert_same(out[i], local["shapes"].score(images[i : i + 1], prompts[i : i + 1]))
        assert sum(counting.batches) == 6 and max(counting.batches) <= 4
    finally:
        stop(server)


def post_raw(server, body: bytes, path="/score"):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_a_wrong_path_or_method_says_what_the_server_answers(server):
    """A path asked with the other method is a 405 naming the one it takes (and its Allow header), not
    a 404 denying the path; an unknown path a 404; both list every route, /check too."""
    served = "this server answers GET /health, POST /score, POST /check"
    cases = [("GET", "/score", 405, "/score takes POST, not GET", "POST"),
             ("GET", "/check", 405, "/check takes POST, not GET", "POST"),
             ("POST", "/health", 405, "/health takes GET, not POST", "GET"),
             ("GET", "/other", 404, "no such path '/other'", None),
             ("POST", "/other", 404, "no such path '/other'", None)]  # fmt: skip
    for method, path, status, message, allow in cases:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        try:
            conn.request(method, path, body=b"{}" if method == "POST" else None)
            resp = conn.getresponse()
            answer = json.loads(resp.read())
        finally:
            conn.close()
        assert resp.status == status and answer["error"] == f"{message}; {served}", (method, path, answer)
        assert resp.getheader("Allow") == allow


def test_bad_requests_get_clear_errors(server, scenes, local):
    images, prompts, _ = scenes
    png = encode_png(images[0])
    cases = [
        (b"{not json", "not JSON"),
        (json.dumps({"images": [png], "prompts": ["a"]}).encode(), "non-empty list of reward names"),
        (json.dumps({"rewards": ["pickscore"], "images": [png], "prompts": ["a"]}).encode(),
         "not served here; this server serves ['jpeg_compressibility', 'shapes']"),
        (json.dumps({"rewards": ["shapes"], "images": [png, png], "prompts": ["a"]}).encode(), "2 images but 1 prompts"),
        (json.dumps({"rewards": ["shapes"], "images": ["@@@"], "prompts": ["a"]}).encode(), "images[0] is not a base64"),
        (json.dumps({"rewards": ["shapes"], "images": [png, encode_png(images[1][:32])], "prompts": ["a", "b"]}).encode(),
         "one size"),
        (json.dumps({"rewards": ["shapes"], "images": [png], "prompts": ["a"], "extra": 1}).encode(), "unknown fields"),
    ]
    cases.append((json.dumps({"rewards": ["shapes"], "images": [png, png], "prompts": ["a", "b"],
                              "metadata": [None]}).encode(), '"metadata" must be a list of 2 objects'))  # fmt: skip
    for body, message in cases:
        status, answer = post_raw(server, body)
        assert status == 400 and message in answer["error"], (message, status, answer)
    assert post_raw(server, b"{}", path="/other")[0] == 404

    # a reward that raises: 500 with its error; the client retries, then names it
    failing = start({"shapes": rewards.load(f"{__name__}:explodes")})
    try:
        with pytest.raises(RewardServerError, match="HTTP 500.*reward model exploded"):
            rewards.load("remote", url=failing.url, rewards=["shapes"], **FAST).score(images[:1], prompts[:1])
    finally:
        stop(failing)

    # a reward that returns NaN: 422 with its error, at once (the same images would score alike)
    failing = start({"shapes": rewards.load(f"{__name__}:gives_nan")})
    try:
        with pytest.raises(RewardServerError, match=r"after 1 attempt.*HTTP 422.*NaN scores for images \[0\]"):
            rewards.load("remote", url=failing.url, rewards=["shapes"], **FAST).score(images[:1], prompts[:1])
    finally:
        stop(failing)
    # named by its position in the request, not in the server's chunk of it (chunks of 2 here)
    failing = start({"shapes": rewards.load(f"{__name__}:nan_for_the_last_prompt")}, batch_size=2)
    try:
        with pytest.raises(RewardServerError, match=r"HTTP 422.*NaN scores for images \[2\] of 3"):
            rewards.load("remote", url=failing.url, rewards=["shapes"], **FAST).score(images[:3], ["a", "b", "last"])
    finally:
        stop(failing)

    small = start(local, max_request_bytes=4096)
    try:
        status, answer = post_raw(small, b"x" * 100_000)
        assert status == 413 and "limit of 4096 bytes" in answer["error"]
        remote = rewards.load("remote", url=small.url, rewards=["shapes"], **FAST)
        remote.limits = lambda: (None, None)  # a client that does not know the limit sends it all at once
        with pytest.raises(RewardServerError, match="after 1 attempt.*HTTP 413") as info:
            remote.score(images, prompts)  # a request error is not retried
        assert info.value.url == small.url
    finally:
        stop(small)


def test_the_client_splits_a_batch_to_fit_the_servers_advertised_limits(local, scenes):
    """The server's /health says its limits; the client cuts a batch into requests that fit them
    (read once), so a small limit costs requests, not a 413 after a rollout. One image over a limit
    alone is an error naming the server, the limit and the image, sent nowhere."""
    images, prompts, metas = scenes
    request_bytes = len(json.dumps({"rewards": ["shapes"], "images": [encode_png(i) for i in images[:2]],
                                    "prompts": prompts[:2], "metadata": metas[:2]}).encode())  # fmt: skip
    small = start(local, max_request_bytes=request_bytes + 8)  # two images a request, not three
    try:
        remote = rewards.load("remote", url=small.url, rewards=["shapes"], **FAST)
        sent = []
        remote._requests = lambda *args, cut=remote._requests: sent.append(cut(*args)) or sent[-1]
        assert_same(remote.score(images, prompts, metas), local["shapes"].score(images, prompts, metas))
        (cuts,) = sent
        assert cuts[0] == (0, 2) and [c[0] for c in cuts[1:]] == [c[1] for c in cuts[:-1]] and cuts[-1][1] == 6
        for start_, stop_ in cuts:  # each request as sent fits
            assert len(json.dumps({"rewards": ["shapes"], "images": [encode_png(i) for i in images[start_:stop_]],
                                   "prompts": prompts[start_:stop_], "metadata": metas[start_:stop_]}).encode()
                       ) <= request_bytes + 8  # fmt: skip
        assert remote.limits() == (request_bytes + 8, 256 << 20)
    finally:
        stop(small)

    one = start(local, max_request_bytes=300)
    try:
        with pytest.raises(ValueError, match=rf"reward server {one.url} takes at most 300 bytes a request "
                                             r"\(its --max-request-mb\); image 0 of this batch alone makes a request of"):
            rewards.load("remote", url=one.url, rewards=["shapes"], **FAST).score(images, prompts)
    finally:
        stop(one)


def explodes(images, prompts, metadata):
    raise RuntimeError("reward model exploded")


def gives_nan(images, prompts, metadata):
    return {"score": torch.full((len(prompts),), float("nan"))}


def nan_for_the_last_prompt(images, prompts, metadata):
    return {"score": torch.tensor([float("nan") if p == "last" else 0.5 for p in prompts])}


def blank_png(width: int, height: int) -> str:
    """A base64 1-bit black PNG of width x height, built row by row: a 20000x20000 one is ~50 KB of
    base64 that PIL would decode into gigabytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer, row = zlib.compressobj(9), b"\0" * (1 + (width + 7) // 8)  # filter byte, then the bits
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1 bit, greyscale
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    return base64.b64encode(raw).decode("ascii")


def test_an_image_too_large_to_decode_is_a_bad_request(server, scenes, monkeypatch):
    """A small PNG declaring a huge image (a decompression bomb) is a 400 naming the image, its size
    and the limit, found from its header before PIL decodes it; PIL's limit is the limit, also in
    the band up to twice it, where PIL itself only warns and would decode the image."""
    from PIL import Image

    images, _, _ = scenes
    limit = Image.MAX_IMAGE_PIXELS
    body = {"rewards": ["shapes"], "images": [encode_png(images[0]), blank_png(20000, 20000)], "prompts": ["a", "b"]}
    status, answer = post_raw(server, json.dumps(body).encode())
    assert status == 400, (status, answer)
    for fragment in ("images[1]", "20000x20000", f"limit of {limit} pixels"):
        assert fragment in answer["error"], (fragment, answer)

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 64 - 1)  # 64x64 is over it, but not twice over
    body = {"rewards": ["shapes"], "images": [blank_png(64, 64)], "prompts": ["a"]}
    status, answer = post_raw(server, json.dumps(body).encode())
    assert status == 400 and "images[0] is 64x64" in answer["error"] and "limit of 4095 pixels" in answer["error"], (
        status, answer)


def test_images_over_the_request_pixel_limit_are_refused_before_decoding(local, scenes):
    """Each image under PIL's limit, but many of them: the total the headers declare is capped per
    request (413, which the client does not retry), and /health says the cap, which the client keeps
    to (it splits a batch over it; an image over it alone is an error)."""
    images, prompts, _ = scenes
    small = start(local, max_request_pixels=3 * 64 * 64)
    try:
        assert rewards.load("remote", url=small.url, rewards=["shapes"]).health()["max_request_pixels"] == 3 * 64 * 64
        body = {"rewards": ["shapes"], "images": [blank_png(64, 64)] * 4, "prompts": ["a"] * 4}
        status, answer = post_raw(small, json.dumps(body).encode())
        assert status == 413 and answer["error"].startswith(
            "the 4 images declare 16384 pixels in all, over this server's limit of 12288 per request"), (status, answer)
        remote = rewards.load("remote", url=small.url, rewards=["shapes"], **FAST)
        blind = rewards.load("remote", url=small.url, rewards=["shapes"], **FAST)
        blind.limits = lambda: (None, None)  # a client that does not know the limit sends it all at once
        with pytest.raises(RewardServerError, match="after 1 attempt.*HTTP 413.*declare 16384 pixels"):
            blind.score(images[:4], prompts[:4])
        assert_same(remote.score(images[:4], prompts[:4]), local["shapes"].score(images[:4], prompts[:4]))
        with pytest.raises(ValueError, match=r"takes at most 12288 pixels a request \(its --max-request-mpixels\); "
                                             r"each image here has 128x128 = 16384"):
            remote.score(np.zeros((2, 128, 128, 3), np.uint8), prompts[:2])
        # found at start by the trainer's server check, which knows the rollout's resolution
        remote.check_server(size=64)
        with pytest.raises(ValueError, match=r"takes at most 12288 pixels a request \(its --max-request-mpixels\), "
                                             r"fewer than one 128x128 image: raise the server's limit"):
            rewards.load("remote", url=small.url, rewards=["shapes"], **FAST).check_server(size=128)
    finally:
        stop(small)


def test_json_nested_too_deeply_is_a_bad_request(server):
    status, answer = post_raw(server, b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "not JSON" in answer["error"] and "nested too deeply" in answer["error"], (status, answer)
    status, answer = post_raw(server, b'{"rewards": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert status == 400 and "nested too deeply" in answer["error"], (status, answer)


def test_prompts_or_metadata_a_reward_rejects_are_bad_requests(server, scenes):
    """Input a reward's check() rejects is a 400 with the reward's message, which the client does not
    retry; a reward that passes the check and then fails while scoring is still a 500."""
    images, prompts, _ = scenes
    png = encode_png(images[0])
    cases = [
        ({"prompts": ["a photo of a dog"]}, ["reward 'shapes' cannot score this request", "is not a ShapeEval prompt"]),
        ({"prompts": [prompts[0]], "metadata": [{"include": [{"class": "dog", "count": 1}]}]},
         ["reward 'shapes'", "asks for class 'dog'"]),
        ({"prompts": [prompts[0]] * 2, "metadata": [None, {"include": "oops", "prompt": prompts[0]}]},
         ["reward 'shapes'", "prompts[1]:", "'include' must be a list of clauses", "got 'oops'"]),
        ({"prompts": [prompts[0]], "metadata": [{"include": [{"class": "circle"}], "prompt": prompts[0]}]},
         ["reward 'shapes'", "include[0] needs a count"]),
    ]
    for fields, fragments in cases:
        body = {"rewards": ["shapes"], "images": [png] * len(fields["prompts"]), **fields}  # one image per prompt
        status, answer = post_raw(server, json.dumps(body).encode())
        assert status == 400, (fields, status, answer)
        for fragment in fragments:
            assert fragment in answer["error"], (fragment, answer)

    remote = rewards.load("remote", url=server.url, rewards=["shapes"], **FAST)
    with pytest.raises(RewardServerError, match="after 1 attempt.*HTTP 400.*not a ShapeEval prompt"):
        remote.score(images[:1], ["a photo of a dog"])
    assert_same(remote.score(images, prompts), rewards.load("shapes").score(images, prompts))

    class ChecksThenExplodes:
        def check(self, prompts, metadata=None):
            pass

        def score(self, images, prompts, metadata=None):
            raise RuntimeError("reward model exploded")

    failing = start({"shapes": ChecksThenExplodes()})
    try:
        body = json.dumps({"rewards": ["shapes"], "images": [png], "prompts": ["a"]}).encode()
        status, answer = post_raw(failing, body)
        assert status == 500 and "reward model exploded" in answer["error"], (status, answer)
    finally:
        stop(failing)


class Checking(Recording):
    """`reward`, recording the number of images of each call, with the reward's check()."""

    def check(self, prompts, metadata=None):
        self.reward.check(prompts, metadata)


@pytest.mark.parametrize("wrapper, error, message, batches", [
    # the shared call fails: each request is then scored alone, and only the bad one gets the error
    ("Recording", ValueError, "a photo of a dog", [6, 2, 2, 2]),
    # the reward's check() rejects one request before scoring: a 400, and it leaves the batch
    ("Checking", BadRequest, "reward 'shapes'.*a photo of a dog", [4]),
])  # fmt: skip
def test_a_request_the_reward_cannot_score_fails_alone(local, scenes, wrapper, error, message, batches):
    """Requests batched into one reward call: only the request the reward cannot score ("a photo of a
    dog") gets the error, not the others that shared its batch, which get their scores."""
    images, prompts, _ = scenes
    reward = {"Recording": Recording, "Checking": Checking}[wrapper](local["shapes"])
    batcher = Batcher({"shapes": reward}, batch_size=6, window_s=60)  # closed by its 6 images, as above
    asked = [prompts[0:2], ["a photo of a dog", prompts[3]], prompts[4:6]]
    futures = [batcher.submit(["shapes"], images[i : i + 2], p, None) for i, p in zip((0, 2, 4), asked)]
    with pytest.raises(error, match=message):
        futures[1].result(10)
    for i in (0, 2):
        expected = local["shapes"].score(images[2 * i : 2 * i + 2], asked[i])
        assert futures[i].result(10)["shapes"] == {k: v.tolist() for k, v in expected.items()}
    batcher.close()
    assert reward.batches == batches


def test_a_check_gets_one_record_per_prompt_as_the_trainer_gives_it(local, scenes):
    """A request without metadata: the check gets [None] * n, as from the trainer, not None."""
    images, prompts, _ = scenes

    class LoopsOverRecords(Recording):
        def check(self, prompts, metadata=None):
            assert len(metadata) == len(prompts)  # a check written against the trainer's calls
            self.reward.check(prompts, metadata)

    batcher = Batcher({"shapes": LoopsOverRecords(local["shapes"])}, batch_size=64, window_s=0.01)
    try:
        got = batcher.submit(["shapes"], images[:2], prompts[:2], None).result(10)["shapes"]
    finally:
        batcher.close()
    assert got == {k: v.tolist() for k, v in local["shapes"].score(images[:2], prompts[:2]).items()}


class FaultProxy(LoopbackServer):
    """A loopback proxy in front of a reward server that injects one fault per request, in order:
    "500", "malformed", "partial" (valid JSON without scores), "slow" (answers after `slow_s`, or
    when the proxy is closed), "drop" (closes without answering); "ok" (also when the list is empty)
    forwards the request."""

    def __init__(self, upstream_port: int, faults: list[str], slow_s: float = 1.5):
        faults = list(faults)
        self.closed = threading.Event()

        def answer(path, body):
            fault = faults.pop(0) if faults else "ok"
            if fault == "drop":
                return None
            if fault == "500":
                return 500, b'{"error": "injected failure"}'
            if fault == "malformed":
                return 200, b'{"scores": {"shapes": [1, 2'
            if fault == "partial":
                return 200, b'{"result": "no scores here"}'
            if fault == "nan":  # as JSON's NaN token, which Python's parser reads
                return 200, b'{"scores": {"shapes": {"score": [NaN, 1.0, 1.0, 1.0, 1.0, 1.0]}}}'
            if fault == "huge":  # an integer past any float
                return 200, b'{"scores": {"shapes": {"score": [1' + b"0" * 400 + b"]}}}"
            if fault == "deep":  # brackets nested past the JSON parser's depth
                return 200, b"[" * 200000
            if fault == "slow":
                self.closed.wait(slow_s)
            conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=10)
            try:
                conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                return resp.status, resp.read()
            finally:
                conn.close()

        super().__init__(answer)

    def close(self):
        self.closed.set()
        super().close()


@pytest.fixture
def proxy_factory(server):
    proxies = []

    def make(faults, **kw):
        proxies.append(FaultProxy(server.server_address[1], faults, **kw))
        return proxies[-1]

    yield make
    for p in proxies:
        p.close()


def test_client_retries_500s_malformed_and_dropped_answers(proxy_factory, local, scenes):
    images, prompts, _ = scenes
    proxy = proxy_factory(["500", "malformed", "drop", "partial"])
    remote = rewards.load("remote", url=proxy.url, rewards=["shapes"], retries=4, backoff=0.01, timeout=10)
    assert_same(remote.score(images, prompts), local["shapes"].score(images, prompts))
    assert len(proxy.requests) == 5


def test_client_times_out_a_slow_answer_then_retries(proxy_factory, local, scenes):
    images, prompts, _ = scenes
    # The slow answer is held until the test ends (a minute at most): a client that waited for it
    # would have sent one request, not two.
    proxy = proxy_factory(["slow"], slow_s=60.0)
    remote = rewards.load("remote", url=proxy.url, rewards=["shapes"], retries=2, backoff=0.01, timeout=0.5)
    assert_same(remote.score(images, prompts), local["shapes"].score(images, prompts))
    assert len(proxy.requests) == 2


def test_client_gives_up_with_an_error_naming_the_server(proxy_factory, scenes):
    images, prompts, _ = scenes
    proxy = proxy_factory(["500"] * 10)
    remote = rewards.load("remote", url=proxy.url, rewards=["shapes"], retries=3, backoff=0.01, timeout=10)
    with pytest.raises(RewardServerError) as info:
        remote.score(images, prompts)
    message = str(info.value)
    assert proxy.url in message and "4 attempt(s)" in message and "HTTP 500" in message and "injected failure" in message
    assert info.value.attempts == 4 and len(proxy.requests) == 4


def test_client_survives_a_server_restart_and_names_a_dead_server(local, scenes):
    images, prompts, _ = scenes
    server = start(local)
    port, url = server.server_address[1], server.url
    remote = rewards.load("remote", url=url, rewards=["shapes"], retries=6, backoff=0.1, timeout=10)
    expected = local["shapes"].score(images, prompts)
    assert_same(remote.score(images, prompts), expected)

    stop(server)  # the server dies between two batches ...
    result = {}
    worker = threading.Thread(target=lambda: result.update(remote.score(images, prompts)))
    worker.start()
    time.sleep(0.4)
    restarted = start(local, port=port)  # ... and comes back while the client retries
    worker.join(15)
    try:
        assert_same(result, expected)
    finally:
        stop(restarted)

    # a server that stays dead: after the retries, an error that names it and the last failure
    quick = rewards.load("remote", url=url, rewards=["shapes"], retries=2, backoff=0.01, timeout=2)
    with pytest.raises(RewardServerError, match=f"reward server {url} failed after 3 attempt.*Connection"):
        quick.score(images, prompts)


@pytest.mark.slow
def test_command_line_server(tmp_path, local, scenes):
    images, prompts, _ = scenes
    proc = subprocess.Popen(
        [sys.executable, "-m", "stepfast.reward_server", "--rewards", "jpeg_compressibility,shapes", "--port", "0",
         "--reward-options", json.dumps({"jpeg_compressibility": {"scale": 100}})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        loading = proc.stdout.readline()  # before the rewards load (minutes for a model), clients refused meanwhile
        assert loading == "stepfast reward server: loading jpeg_compressibility, shapes ...\n", loading
        line = proc.stdout.readline()  # printed once the server listens
        assert "on http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" on ")[1].split()[0]
        remote = rewards.load("remote", url=url, rewards=["jpeg_compressibility"], **FAST)
        assert remote.health()["rewards"] == ["jpeg_compressibility", "shapes"]
        expected = rewards.load("jpeg_compressibility", scale=100).score(images, prompts)
        assert_same(remote.score(images, prompts), expected)
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_client_checks_the_server_answers_and_serves_its_rewards(server):
    """What the trainer checks at start: /health answers and lists every reward asked for; a dead
    server is named after the client's retries, as a score request would be."""
    rewards.load("remote", url=server.url, rewards=["shapes"], **FAST).check_server()
    with pytest.raises(ValueError, match=rf"reward server {server.url} serves \['jpeg_compressibility', 'shapes'\], "
                                         r"not \['pickscore'\]"):
        rewards.load("remote", url=server.url, rewards=["shapes", "pickscore"], **FAST).check_server()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ValueError, match=rf"reward server {dead} failed after 4 attempt\(s\); last failure: "
                                         r"ConnectionRefusedError.*is it a stepfast reward server"):
        rewards.load("remote", url=dead, rewards=["shapes"], **FAST).check_server()
    # another service, or a wrong path: a 404, which no retry mends (one attempt of the six allowed)
    with pytest.raises(ValueError, match=rf"reward server {server.url}/api failed after 1 attempt\(s\); last "
                                         r"failure: HTTP 404"):
        rewards.load("remote", url=server.url + "/api", rewards=["shapes"], retries=5, backoff=10).check_server()
    for url in ("127.0.0.1:8600", "http://127.0.0.1:86OO", "http://127.0.0.1:99999"):  # a port that is none
        with pytest.raises(ValueError, match=f"reward server URL '{url}' must look like http://HOST:PORT"):
            rewards.load("remote", url=url, rewards=["shapes"])


# -- the command line: bad arguments are one-line errors with exit code 2 -------------------------

PROG = "python -m stepfast.reward_server: error: "


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stepfast.reward_server", *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def assert_cli_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit code 2, no traceback, the server never started, and a last stderr line that is the
    error and holds every fragment; returns that line."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert " on http://" not in proc.stdout, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith(PROG), proc.stderr
    assert sum("error:" in line for line in lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])
    return lines[-1]


BAD_ARGUMENTS = [
    (["--reward-options", "{bad"], ["--reward-options", "is not JSON", "{bad"]),
    (["--reward-options", "[]"], ["--reward-options", "must be a JSON object", "list"]),
    (["--reward-options", '{"shapes": 3}'], ["--reward-options", "options of 'shapes'", "got 3"]),
    (["--reward-options", '{"shapes": {"no_such_option": 1}}'], ["--reward-options", "'shapes'", "no_such_option"]),
    (["--reward-options", '{"pickscore": {}}'], ["--reward-options", "pickscore", "not in --rewards"]),
    (["--port", "-1"], ["--port", "0-65535", "-1"]),
    (["--port", "70000"], ["--port", "0-65535", "70000"]),
    (["--batch-size", "0"], ["--batch-size", ">= 1", "got 0"]),
    (["--batch-window-ms", "-1"], ["--batch-window-ms", ">= 0"]),
    (["--max-request-mb", "-1"], ["--max-request-mb", "> 0", "-1"]),
    (["--max-request-mb", "0"], ["--max-request-mb", "> 0"]),
    (["--max-request-mpixels", "0"], ["--max-request-mpixels", "> 0", "got 0"]),
    (["--host", "no.such.host.invalid", "--port", "0"], ["cannot listen on no.such.host.invalid:0", "--host"]),
]


@pytest.mark.parametrize("args, fragments", BAD_ARGUMENTS, ids=[" ".join(args) for args, _ in BAD_ARGUMENTS])
def test_command_line_rejects_bad_arguments(args, fragments):
    assert_cli_error(run_cli("--rewards", "shapes", *args), *fragments)


@pytest.mark.parametrize("names, fragments", [
    ("", ["--rewards", "names no reward"]),
    (" , ,", ["--rewards", "names no reward"]),
    ("shapes,nosuch", ["--rewards", "unknown reward 'nosuch'"]),
])
def test_command_line_rejects_bad_reward_names(names, fragments):
    assert_cli_error(run_cli("--rewards", names, "--port", "0"), *fragments)


def test_command_line_names_a_missing_options_file(tmp_path):
    missing = tmp_path / "missing.json"
    assert_cli_error(run_cli("--rewards", "shapes", "--reward-options", f"@{missing}"),
                     "--reward-options", "cannot read", str(missing), "No such file")  # fmt: skip


def test_command_line_port_in_use_is_an_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli("--rewards", "shapes", "--port", str(port))
    assert_cli_error(proc, f"cannot listen on 127.0.0.1:{port}", "Address already in use", "--port")


def test_ctrl_c_while_the_rewards_load_is_one_line_and_frees_the_port(monkeypatch, capsys):
    """A model reward can take minutes to load, the moment Ctrl-C is most likely: a line, exit 130,
    and the port bound before loading is let go."""
    import stepfast.reward_server as reward_server

    bound = []

    def interrupted(names, options):
        raise KeyboardInterrupt

    close = RewardServer.server_close
    monkeypatch.setattr(reward_server, "load_rewards", interrupted)
    monkeypatch.setattr(RewardServer, "server_close", lambda self: bound.append(self.server_address) or close(self))
    assert reward_server.main(["--rewards", "shapes", "--port", "0"]) == 130
    out, err = capsys.readouterr()
    assert out == "stepfast reward server: loading shapes ...\n"
    assert err == "\nstepfast reward server: interrupted while loading the rewards\n"
    assert bound and bound[0][1] > 0  # closed once bound (to the free port 0 picked)


def test_batched_requests_keep_their_own_metadata_with_and_without_it():
    """Requests with metadata and without it, scored in one reward call cut in batch_size chunks:
    each image is scored with its own record (None for a request that sent none)."""
    from concurrent.futures import Future

    from stepfast.reward_server import Batcher, ScoreJob

    class EchoIndex:
        def score(self, images, prompts, metadata=None):
            records = metadata or [None] * len(prompts)
            return {"score": torch.tensor([-1.0 if m is None else float(m["i"]) for m in records])}

    batcher = Batcher({"echo": EchoIndex()}, batch_size=2)
    try:
        jobs = [ScoreJob(["echo"], np.zeros((n, 4, 4, 3), np.uint8), ["p"] * n, meta, Future())
                for n, meta in [(2, None), (3, [{"i": 10}, {"i": 11}, {"i": 12}]), (1, None)]]  # fmt: skip
        batcher._score(jobs)
        assert [job.future.result(5)["echo"]["score"] for job in jobs] == [[-1.0, -1.0], [10.0, 11.0, 12.0], [-1.0]]
        assert batcher.calls == 3  # 6 images in chunks of 2
    finally:
        batcher.close()


class Exits:
    """A reward whose first call raises SystemExit (a BaseException, not an Exception)."""

    def __init__(self, reward):
        self.reward, self.calls = reward, 0

    def score(self, images, prompts, metadata=None):
        self.calls += 1
        if self.calls == 1:
            raise SystemExit("the reward's library called sys.exit")
        return self.reward.score(images, prompts, metadata)


def test_a_reward_that_raises_systemexit_fails_its_batch_and_the_server_goes_on(local, scenes):
    """The one thread that scores survives it: the batch gets the error (a 500 to its clients), the
    next request its scores. Had the thread ended, every later request would wait without end while
    /health said ok; /health says so when the thread is gone."""
    images, prompts, _ = scenes
    batcher = Batcher({"shapes": Exits(local["shapes"])}, batch_size=2, window_s=0.01)
    with pytest.raises(RuntimeError, match="a reward raised SystemExit: the reward's library called sys.exit"):
        batcher.submit(["shapes"], images[:2], prompts[:2], None).result(10)
    expected = local["shapes"].score(images[2:4], prompts[2:4])
    assert batcher.submit(["shapes"], images[2:4], prompts[2:4], None).result(10)["shapes"] == {
        k: v.tolist() for k, v in expected.items()}  # fmt: skip
    assert batcher.alive
    batcher.close()
    server = start(local)
    try:
        server.batcher.close()  # as if the thread had died
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        conn.request("GET", "/health")
        answer = conn.getresponse()
        assert answer.status == 503 and "scoring thread has stopped" in answer.read().decode()
        conn.close()
    finally:
        stop(server)


def test_a_content_length_that_is_not_a_number_is_a_bad_request(server):
    """'²' is a digit to str.isdigit but not to int(): it broke the handler, which dropped the
    connection without an answer."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.putrequest("POST", "/score")
    conn.putheader("Content-Length", "²")
    conn.endheaders()
    answer = conn.getresponse()
    assert answer.status == 400 and "Content-Length must be a number of bytes" in answer.read().decode()
    conn.close()


def test_client_retries_answers_whose_scores_are_not_finite_or_not_parseable(proxy_factory, local, scenes):
    """NaN or infinite scores, a number past a float, JSON nested past the parser's depth: malformed
    answers, retried as the others, not an OverflowError or RecursionError out of the client."""
    images, prompts, _ = scenes
    proxy = proxy_factory(["nan", "huge", "deep"])
    remote = rewards.load("remote", url=proxy.url, rewards=["shapes"], retries=3, backoff=0.01, timeout=10)
    assert_same(remote.score(images, prompts), local["shapes"].score(images, prompts))
    assert len(proxy.requests) == 4
    proxy = proxy_factory(["nan"] * 3)
    remote = rewards.load("remote", url=proxy.url, rewards=["shapes"], retries=2, backoff=0.01, timeout=10)
    with pytest.raises(RewardServerError, match="shapes/score holds NaN or infinite scores"):
        remote.score(images, prompts)


def test_a_rejection_of_one_of_several_requests_says_where_its_images_start(server, scenes):
    """The trainer scores 256 images a call; the client sends them batch_size at a time, and the server
    numbers the images within its request: the error says which request it was."""
    images, prompts, _ = scenes
    asked = list(prompts[:5]) + ["a photo of a dog"]
    remote = rewards.load("remote", url=server.url, rewards=["shapes"], batch_size=4, **FAST)
    with pytest.raises(RewardServerError) as info:
        remote.score(images, asked)
    message = str(info.value)
    assert "HTTP 400" in message and "in the request of images 4-5 of this batch of 6: add 4 to the image numbers above" in message
    one = rewards.load("remote", url=server.url, rewards=["shapes"], batch_size=8, **FAST)
    with pytest.raises(RewardServerError) as info:
        one.score(images, asked)
    assert "in the request of images" not in str(info.value)  # one request: its numbers are the batch's


@pytest.mark.parametrize("options, message", [
    ({"batch_size": 0}, "batch_size must be >= 1 (images per request), got 0"),
    ({"timeout": 0}, "timeout must be > 0 seconds, got 0.0"),
    ({"retries": -1}, "retries must be >= 0, got -1"),
    ({"backoff": -1}, "backoff must be >= 0 seconds, got -1.0"),
])  # fmt: skip
def test_client_options_that_cannot_work_are_refused_when_the_reward_is_built(options, message):
    for name, required in (("remote", {"rewards": ["shapes"]}), ("geneval_remote", {})):
        with pytest.raises(ValueError, match=re.escape(message)):
            rewards.load(name, url="http://127.0.0.1:9", **required, **options)


def test_the_client_checks_prompts_with_the_server_before_any_image(server):
    """POST /check: the served rewards' check hooks, so a trainer scoring through the server names a
    prompt it cannot score at start (its file and line), as it does for a local reward; a server
    that does not answer is left to the server check, which names it."""
    from stepfast.rewards import PromptError

    remote = rewards.load("remote", url=server.url, rewards=["shapes"], **FAST)
    remote.check(["a photo of a circle", "a photo of two squares"])
    with pytest.raises(PromptError) as info:
        remote.check(["a photo of a circle", "a photo of a dog"])
    assert info.value.index == 1 and "'a photo of a dog' is not a ShapeEval prompt" in info.value.reason
    assert f"(reward 'shapes' served by {server.url})" in info.value.reason
    status, answer = post_raw(server, json.dumps({"rewards": ["nope"], "prompts": []}).encode(), path="/check")
    assert status == 400 and "not served here" in answer["error"]
    dead = rewards.load("remote", url="http://127.0.0.1:9", rewards=["shapes"], retries=0, timeout=1)
    assert dead.check(["a photo of a dog"]) is None


def test_a_served_weighted_reward_names_the_part_that_refused_a_prompt(scenes):
    """A served `weighted` reward whose part refuses a prompt: the 400 of /score and the answer of
    /check name that part as well as the served reward, as the weighted reward does when local."""
    from stepfast.rewards import PromptError

    images, prompts, _ = scenes
    mixed = rewards.load("weighted", weights={"jpeg_compressibility": 0.5, "shapes": 1.0})
    served = start({"mixed": mixed})
    try:
        body = {"rewards": ["mixed"], "images": [encode_png(images[0])] * 2, "prompts": [prompts[0], "a dog"]}
        status, answer = post_raw(served, json.dumps(body).encode())
        assert status == 400, (status, answer)
        assert "reward 'mixed' cannot score this request: reward 'shapes': prompts[1]:" in answer["error"], answer
        remote = rewards.load("remote", url=served.url, rewards=["mixed"], **FAST)
        with pytest.raises(PromptError) as info:
            remote.check([prompts[0], "a dog"])
        assert info.value.index == 1 and info.value.reason.startswith("reward 'shapes': "), info.value.reason
        assert info.value.reason.endswith(f"(reward 'mixed' served by {served.url})"), info.value.reason
    finally:
        stop(served)
