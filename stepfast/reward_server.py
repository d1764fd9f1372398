"""Serve registered rewards over HTTP, so reward models run in their own process, GPU or environment.

    python -m stepfast.reward_server --rewards shapes,pickscore --port 8600 \
        --reward-options '{"pickscore": {"path": "/models/PickScore_v1", "device": "cuda"}}'

Standard library only (http.server). JSON in, JSON out, images as base64 PNG: nothing is unpickled.
Binds 127.0.0.1 unless --host says otherwise (there is no authentication: expose it only to a
network you trust).

    GET  /health -> {"status": "ok", "rewards": [...], "batch_size": N, "max_request_bytes": N}
    POST /score  <- {"rewards": ["shapes"], "images": [b64 png, ...], "prompts": [...],
                     "metadata": [dict | null, ...] (optional)}
                 -> {"scores": {"shapes": {"score": [...], "strict": [...], ...}}}

Errors: 400 for a malformed request (the body says what is wrong), 404 for another path, 411
without Content-Length, 413 for a body over --max-request-mb, 500 when a reward raises (its error
in the body; clients retry 500s).

Batching: a single worker thread owns the reward models. It takes the first waiting request, then
keeps collecting requests for up to --batch-window-ms or until --batch-size images, and scores them
in one call per reward (requests with images of one size together), in chunks of --batch-size.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import io
import json
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch

_DRAIN_LIMIT = 1 << 30  # a body this much over the limit is not read at all (connection dropped)


class BadRequest(ValueError):
    """The request is malformed; the message says how (sent back with HTTP 400)."""


@dataclass
class ScoreJob:
    rewards: list[str]
    images: np.ndarray  # uint8 [n, H, W, 3]
    prompts: list[str]
    metadata: list | None
    future: Future


def decode_png(text, index: int) -> np.ndarray:
    from PIL import Image

    if not isinstance(text, str):
        raise BadRequest(f"images[{index}] must be a base64 PNG string, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
        with Image.open(io.BytesIO(raw), formats=["PNG"]) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (binascii.Error, ValueError, OSError) as exc:
        raise BadRequest(f"images[{index}] is not a base64-encoded PNG: {exc}") from exc


def parse_request(body: bytes, served) -> tuple[list[str], np.ndarray, list[str], list | None]:
    """(rewards, images [n, H, W, 3] uint8, prompts, metadata) of a /score body, or BadRequest."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not JSON: {exc}") from exc
    if not isinstance(request, dict):
        raise BadRequest("body must be a JSON object with rewards, images, prompts[, metadata]")
    unknown = sorted(set(request) - {"rewards", "images", "prompts", "metadata"})
    if unknown:
        raise BadRequest(f"unknown fields {unknown}; expected rewards, images, prompts, metadata")
    rewards = request.get("rewards")
    if not isinstance(rewards, list) or not rewards or not all(isinstance(r, str) for r in rewards):
        raise BadRequest('"rewards" must be a non-empty list of reward names')
    missing = [r for r in rewards if r not in served]
    if missing:
        raise BadRequest(f"rewards {missing} are not served here; this server serves {sorted(served)}")
    images, prompts = request.get("images"), request.get("prompts")
    if not isinstance(images, list) or not images:
        raise BadRequest('"images" must be a non-empty list of base64 PNG strings')
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest('"prompts" must be a list of strings')
    if len(prompts) != len(images):
        raise BadRequest(f"got {len(images)} images but {len(prompts)} prompts")
    metadata = request.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, list) or len(metadata) != len(images):
            raise BadRequest(f'"metadata" must be a list of {len(images)} objects (or null entries)')
        if not all(m is None or isinstance(m, dict) for m in metadata):
            raise BadRequest('"metadata" entries must be JSON objects or null')
    pixels = [decode_png(text, i) for i, text in enumerate(images)]
    sizes = sorted({p.shape for p in pixels})
    if len(sizes) > 1:
        raise BadRequest(f"all images of a request must have one size; got {sizes}")
    return list(dict.fromkeys(rewards)), np.stack(pixels), prompts, metadata


class Batcher:
    """One worker thread that scores queued jobs, several requests per reward call."""

    def __init__(self, rewards: dict, batch_size: int = 64, window_s: float = 0.005):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.rewards, self.batch_size, self.window_s = rewards, batch_size, window_s
        self.queue: queue.Queue = queue.Queue()
        self.calls = 0  # reward score() calls made, for tests and logs
        self._thread = threading.Thread(target=self._run, name="reward-batcher", daemon=True)
        self._thread.start()

    def submit(self, rewards, images, prompts, metadata) -> Future:
        job = ScoreJob(rewards, images, prompts, metadata, Future())
        self.queue.put(job)
        return job.future

    def close(self) -> None:
        self.queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            jobs, count = [job], len(job.images)
            deadline = time.monotonic() + self.window_s
            while count < self.batch_size:
                try:
                    nxt = self.queue.get(timeout=max(deadline - time.monotonic(), 0))
                except queue.Empty:
                    break
                if nxt is None:
                    self.queue.put(None)  # stop after this batch
                    break
                jobs.append(nxt)
                count += len(nxt.images)
            self._score(jobs)

    def _score(self, jobs: list[ScoreJob]) -> None:
        results: dict[int, dict] = {id(job): {} for job in jobs}
        for shape in {job.images.shape[1:] for job in jobs}:
            same_size = [job for job in jobs if job.images.shape[1:] == shape]
            for name in dict.fromkeys(n for job in same_size for n in job.rewards):
                members = [job for job in same_size if name in job.rewards]
                try:
                    scores = self._score_reward(name, members)
                except Exception as exc:  # sent back to each request as a 500
                    for job in members:
                        if not job.future.done():
                            job.future.set_exception(exc)
                    continue
                start = 0
                for job in members:
                    n = len(job.images)
                    results[id(job)][name] = {k: v[start : start + n].tolist() for k, v in scores.items()}
                    start += n
        for job in jobs:
            if not job.future.done():
                job.future.set_result(results[id(job)])

    def _score_reward(self, name: str, members: list[ScoreJob]) -> dict[str, torch.Tensor]:
        from stepfast.rewards.combine import check_scores

        images = np.concatenate([job.images for job in members])
        prompts = [p for job in members for p in job.prompts]
        if all(job.metadata is None for job in members):
            metadata = None
        else:
            metadata = [m for job in members for m in (job.metadata or [None] * len(job.images))]
        chunks = []
        for i in range(0, len(images), self.batch_size):
            meta = None if metadata is None else metadata[i : i + self.batch_size]
            out = self.rewards[name].score(images[i : i + self.batch_size], prompts[i : i + self.batch_size], meta)
            self.calls += 1
            chunks.append(check_scores(name, out, len(prompts[i : i + self.batch_size])))
        return {key: torch.cat([c[key] for c in chunks]) for key in chunks[0]}


class RewardServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with the rewards, the batcher and the request-size limit."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, rewards: dict, host: str = "127.0.0.1", port: int = 8600,
                 max_request_bytes: int = 256 << 20, batch_size: int = 64, batch_window_s: float = 0.005,
                 verbose: bool = False):
        self.rewards = rewards
        self.max_request_bytes = int(max_request_bytes)
        self.verbose = verbose
        self.batcher = Batcher(rewards, batch_size, batch_window_s)
        super().__init__((host, port), ScoreHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def server_close(self) -> None:
        super().server_close()
        self.batcher.close()


class ScoreHandler(BaseHTTPRequestHandler):
    server: RewardServer
    server_version = "stepfast-reward-server"
    timeout = 300  # seconds a connection may stall while sending its request

    def do_GET(self) -> None:
        if self.path != "/health":
            return self._send(404, {"error": f"no such path {self.path!r}; use GET /health or POST /score"})
        self._send(200, {
            "status": "ok",
            "rewards": sorted(self.server.rewards),
            "batch_size": self.server.batcher.batch_size,
            "max_request_bytes": self.server.max_request_bytes,
        })

    def do_POST(self) -> None:
        if self.path != "/score":
            return self._send(404, {"error": f"no such path {self.path!r}; use POST /score"})
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            return self._send(411, {"error": "POST /score needs a Content-Length header"})
        length, limit = int(length), self.server.max_request_bytes
        if length > limit:
            self._drain(length)
            return self._send(413, {
                "error": f"request body of {length} bytes is over this server's limit of {limit} bytes "
                "(--max-request-mb); send fewer images per request"
            })
        body = self.rfile.read(length)
        try:
            rewards, images, prompts, metadata = parse_request(body, self.server.rewards)
        except BadRequest as exc:
            return self._send(400, {"error": str(exc)})
        future = self.server.batcher.submit(rewards, images, prompts, metadata)
        try:
            scores = future.result()
        except Exception as exc:
            return self._send(500, {"error": f"{type(exc).__name__}: {exc}"})
        self._send(200, {"scores": scores})

    def _drain(self, length: int) -> None:
        """Read and drop the body so that the client, still sending, gets the 413 and not a reset."""
        if length - self.server.max_request_bytes > _DRAIN_LIMIT:
            self.close_connection = True
            return
        remaining = length
        while remaining > 0:
            chunk = self.rfile.read(min(remaining, 1 << 20))
            if not chunk:
                break
            remaining -= len(chunk)

    def _send(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        if self.server.verbose:
            super().log_message(format, *args)


def load_rewards(names: list[str], options: dict) -> dict:
    from stepfast import rewards as registry

    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(f"--reward-options names {unknown}, which are not in --rewards {names}")
    return {name: registry.load(name, **options.get(name, {})) for name in names}


def _reward_options(text: str) -> dict:
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--reward-options is not JSON ({exc}): {text[:200]}")
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise SystemExit('--reward-options must be a JSON object {"reward name": {"option": value}}')
    return options


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stepfast.reward_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rewards", required=True, help="comma-separated reward names or module:attr paths")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8600, help="port (0: any free port)")
    parser.add_argument("--max-request-mb", type=float, default=256, help="largest request body, MiB")
    parser.add_argument("--batch-size", type=int, default=64, help="most images per reward call")
    parser.add_argument("--batch-window-ms", type=float, default=5, help="how long to gather requests")
    parser.add_argument("--reward-options", default="{}", help='JSON {"name": {...}}, or @file.json')
    parser.add_argument("--verbose", action="store_true", help="log every request")
    args = parser.parse_args(argv)

    names = [n.strip() for n in args.rewards.split(",") if n.strip()]
    try:
        rewards = load_rewards(names, _reward_options(args.reward_options))
    except (ValueError, TypeError, ImportError, OSError) as exc:
        raise SystemExit(f"reward server: cannot load rewards {names}: {exc}") from exc
    server = RewardServer(rewards, args.host, args.port, int(args.max_request_mb * (1 << 20)),
                          args.batch_size, args.batch_window_ms / 1000, args.verbose)
    print(f"stepfast reward server: {', '.join(names)} on {server.url} (pid {os.getpid()})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    sys.exit(main())
