"""Client of `python -m stepfast.reward_server`: rewards scored in another process or machine.

    reward = stepfast.rewards.load("remote", url="http://127.0.0.1:8600", rewards=["shapes", "pickscore"],
                                   weights={"shapes": 1.0, "pickscore": 0.5}, timeout=120, retries=5)
    out = reward.score(images, prompts, metadata)

With one reward and no `weights` the result is exactly that reward's dict, as if it ran here. With
several, or with `weights`, "score" is their weighted sum (weights default to 1) and each part
appears as "<name>" and "<name>/<key>", as `WeightedReward` lays it out: as `eval.reward`, such a
bundle has no top-level "strict", so the held-out table's strict columns read nan.

Images travel as PNG (lossless: the server scores the same uint8 pixels `to_uint8` gives here),
at most `batch_size` per request, and no more per request than the server's advertised limits
(`max_request_bytes`, `max_request_pixels` of its /health answer, read once) let in: a batch is
split to fit them rather than refused with a 413 after a rollout. Failures are retried with
exponential backoff (see `stepfast.rewards.transport`); after the last retry `RewardServerError`
names the server and the last failure, so a trainer can stop cleanly and keep its last checkpoint.
"""

from __future__ import annotations

import base64
import io
import json
import math

import numpy as np
import torch

from stepfast.rewards.combine import weighted_sum
from stepfast.rewards.images import to_uint8
from stepfast.rewards.transport import (MalformedResponse, RewardServerError, check_client_options, check_url,
                                        get_json, post)

__all__ = ["RemoteReward", "RewardServerError"]


class RemoteReward:
    def __init__(self, url: str = None, rewards=None, weights: dict | None = None, timeout: float = 120.0,
                 retries: int = 5, backoff: float = 1.0, batch_size: int = 64):
        if not url:
            raise TypeError("reward 'remote' needs url=<http://HOST:PORT of a stepfast reward server>")
        check_url(url)
        if isinstance(rewards, str):
            rewards = [r.strip() for r in rewards.split(",") if r.strip()]
        if not rewards:
            raise TypeError("reward 'remote' needs rewards=[names served by the server]")
        self.url = url.rstrip("/")
        self.names = list(dict.fromkeys(rewards))
        if weights is not None:
            extra = sorted(set(weights) - set(self.names))
            if extra:
                raise ValueError(f"weights given for {extra}, which are not in rewards {self.names}")
        self.weights = None if weights is None and len(self.names) == 1 else {
            name: float((weights or {}).get(name, 1.0)) for name in self.names
        }
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.batch_size = int(batch_size)
        check_client_options(self.timeout, self.retries, self.backoff, self.batch_size)
        self._limits: tuple[int | None, int | None] | None = None  # the server's (bytes, pixels) a request

    def health(self, retries: int = 0) -> dict:
        """The server's /health answer, its rewards and limits (one try unless `retries`);
        RewardServerError when it does not answer."""
        return get_json(self.url + "/health", timeout=min(self.timeout, 10.0), retries=retries,
                        backoff=self.backoff, server=self.url)  # fmt: skip

    def check_server(self, size: int | None = None) -> None:
        """A ValueError naming the server when it does not answer /health, does not serve every
        reward asked for, or (given the `size` of the images it will score, square) takes fewer
        pixels a request than one image has: what a trainer checks at start, rather than after its
        first rollout. Tried as a score request is (`retries` more times, with the same backoff:
        about 31 s in all with the defaults), so a server that is still starting is waited for that
        long."""
        try:
            health = self.health(retries=self.retries)
        except RewardServerError as exc:
            raise ValueError(f"{exc}; is it a stepfast reward server (python -m stepfast.reward_server), and "
                             "running?") from None  # fmt: skip
        served = health.get("rewards") if isinstance(health, dict) else None
        if not isinstance(served, list):
            raise ValueError(f"{self.url}/health answered {health!r}: not a stepfast reward server")
        missing = [name for name in self.names if name not in served]
        if missing:
            raise ValueError(f"reward server {self.url} serves {served}, not {missing}")
        self._limits = _limits_of(health)
        max_pixels = self._limits[1]
        if size is not None and max_pixels is not None and size * size > max_pixels:
            raise ValueError(f"reward server {self.url} takes at most {max_pixels} pixels a request (its "
                             f"--max-request-mpixels), fewer than one {size}x{size} image: raise the server's limit")

    def limits(self) -> tuple[int | None, int | None]:
        """The server's limits on one request, (bytes of its body, pixels of its images), as its
        /health says (None for one it does not say); asked once, when first needed. A server that
        does not answer now is asked again next time (the score request then fails and is retried)."""
        if self._limits is None:
            try:
                self._limits = _limits_of(self.health())
            except RewardServerError:
                return None, None
        return self._limits

    def check(self, prompts, metadata=None) -> None:
        """Before any image is drawn: the server's rewards check the prompts (POST /check); a
        PromptError naming the reward and the first prompt one refuses. Nothing is checked where the
        server cannot be asked (not answering: the trainer's server check says so next; or a server
        without /check)."""
        from stepfast.rewards import PromptError

        request = {"rewards": self.names, "prompts": list(prompts)}
        if metadata is not None:
            request["metadata"] = list(metadata)
        try:
            answer = post(self.url + "/check", json.dumps(request).encode("utf-8"), _parse_check,
                          timeout=self.timeout, retries=self.retries, backoff=self.backoff, server=self.url)  # fmt: skip
        except RewardServerError:
            return
        if answer["ok"]:
            return
        where = f"(reward {answer.get('reward')!r} served by {self.url})"
        if isinstance(answer.get("index"), int):
            raise PromptError(answer["index"], f"{answer.get('error')} {where}")
        raise ValueError(f"{answer.get('error')} {where}")

    def score(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        pixels = to_uint8(images)
        prompts = list(prompts)
        if len(pixels) != len(prompts):
            raise ValueError(f"got {len(pixels)} images and {len(prompts)} prompts")
        if not prompts:
            raise ValueError("reward 'remote' got an empty batch")
        if metadata is not None and len(metadata) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts and {len(metadata)} metadata records")
        parts: dict[str, dict[str, list]] = {name: {} for name in self.names}
        # every image encoded first (a request's size is measured before it is cut): the batch's
        # PNGs, a fraction of its pixels, are held at once
        encoded = [encode_png(p) for p in pixels]
        for start, stop in self._requests(encoded, pixels, prompts, metadata):
            request = {"rewards": self.names, "images": encoded[start:stop], "prompts": prompts[start:stop]}
            if metadata is not None:
                request["metadata"] = list(metadata[start:stop])
            try:
                scores = post(
                    self.url + "/score", json.dumps(request).encode("utf-8"),
                    lambda body, n=stop - start: _parse_scores(body, self.names, n),
                    timeout=self.timeout, retries=self.retries, backoff=self.backoff, server=self.url,
                )
            except RewardServerError as exc:
                if stop - start == len(prompts):  # one request: its positions are the batch's
                    raise
                # the server counts images within the request: say where it starts
                raise RewardServerError(
                    exc.url, exc.attempts, f"{exc.last_failure} [in the request of images {start}-{stop - 1} of "
                    f"this batch of {len(prompts)}: add {start} to the image numbers above]"
                ) from None
            for name, keys in scores.items():
                for key, values in keys.items():
                    parts[name].setdefault(key, []).extend(values)
        for name, keys in parts.items():
            uneven = sorted(key for key, values in keys.items() if len(values) != len(prompts))
            if uneven:
                raise RewardServerError(self.url, 1, f"reward {name!r} returned {uneven} for some batches only")
        tensors = {name: {k: torch.tensor(v, dtype=torch.float32) for k, v in keys.items()}
                   for name, keys in parts.items()}
        if self.weights is None:
            return tensors[self.names[0]]
        return weighted_sum(tensors, self.weights)

    def _requests(self, encoded: list[str], pixels: np.ndarray, prompts: list, metadata) -> list[tuple[int, int]]:
        """The batch cut into requests [start, stop): each of at most `batch_size` images, and within
        the server's limits. A ValueError naming the image and the limit when one image alone is over
        it (the server would refuse it, and splitting cannot help)."""
        max_bytes, max_pixels = self.limits()
        keys = {"rewards": self.names, "images": [], "prompts": []} | ({} if metadata is None else {"metadata": []})
        empty = len(json.dumps(keys).encode("utf-8"))
        image_pixels = int(pixels.shape[1]) * int(pixels.shape[2])

        def size(i: int) -> int:  # an upper bound of what image i adds to a request's JSON: ", " and quotes
            n = len(encoded[i]) + 4 + len(json.dumps(prompts[i]).encode("utf-8")) + 2
            return n if metadata is None else n + len(json.dumps(metadata[i]).encode("utf-8")) + 2

        requests, start = [], 0
        while start < len(prompts):
            stop, total = start, empty
            while stop < len(prompts) and stop - start < self.batch_size:
                over_bytes = max_bytes is not None and total + size(stop) > max_bytes
                over_pixels = max_pixels is not None and (stop - start + 1) * image_pixels > max_pixels
                if over_bytes or over_pixels:
                    break
                total, stop = total + size(stop), stop + 1
            if stop == start:
                limit = (f"{max_bytes} bytes a request (its --max-request-mb); image {start} of this batch alone makes "
                         f"a request of {empty + size(start)} bytes") if over_bytes else (
                         f"{max_pixels} pixels a request (its --max-request-mpixels); each image here has "
                         f"{pixels.shape[2]}x{pixels.shape[1]} = {image_pixels}")  # fmt: skip
                raise ValueError(f"reward server {self.url} takes at most {limit}: raise the server's limit")
            requests.append((start, stop))
            start = stop
        return requests


def _limits_of(health) -> tuple[int | None, int | None]:
    """(max_request_bytes, max_request_pixels) of a /health answer; None for one it lacks or garbles."""

    def positive(key):
        value = health.get(key) if isinstance(health, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    return positive("max_request_bytes"), positive("max_request_pixels")


def encode_png(pixels: np.ndarray) -> str:
    """uint8 [H, W, 3] as base64 PNG text, the images of a /score request."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _parse_check(body: bytes) -> dict:
    """A /check answer: {"ok": true} or {"ok": false, "reward", "index", "error"}."""
    answer = json.loads(body)
    if not isinstance(answer, dict) or not isinstance(answer.get("ok"), bool):
        raise MalformedResponse('no "ok" in the answer to /check')
    return answer


def _parse_scores(body: bytes, names: list[str], n: int) -> dict[str, dict[str, list]]:
    """The "scores" of a /score answer, checked: every asked reward, "score", lists of n numbers."""
    answer = json.loads(body)
    scores = answer.get("scores") if isinstance(answer, dict) else None
    if not isinstance(scores, dict):
        raise MalformedResponse('no "scores" object')
    for name in names:
        keys = scores.get(name)
        if not isinstance(keys, dict) or "score" not in keys:
            raise MalformedResponse(f'no "score" for reward {name!r}')
        for key, values in keys.items():
            if not isinstance(values, list) or len(values) != n or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
            ):
                raise MalformedResponse(f"{name}/{key} is not a list of {n} numbers")
            if key == "score" and not all(math.isfinite(float(v)) for v in values):  # float(): OverflowError past one
                raise MalformedResponse(f"{name}/score holds NaN or infinite scores")
    return {name: scores[name] for name in names}
