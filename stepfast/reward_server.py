"""Serve registered rewards over HTTP, so reward models run in their own process, GPU or environment.

    python -m stepfast.reward_server --rewards shapes,pickscore --port 8600 \
        --reward-options '{"pickscore": {"path": "/models/PickScore_v1", "device": "cuda"}}'

Standard library only (http.server). JSON in, JSON out, images as base64 PNG: nothing is unpickled.
Binds 127.0.0.1 unless --host says otherwise (there is no authentication: expose it only to a
network you trust).

    GET  /health -> {"status": "ok", "rewards": [...], "batch_size": N, "max_request_bytes": N,
                     "max_request_pixels": N}
    POST /score  <- {"rewards": ["shapes"], "images": [b64 png, ...], "prompts": [...],
                     "metadata": [dict | null, ...] (optional)}
                 -> {"scores": {"shapes": {"score": [...], "strict": [...], ...}}}
    POST /check  <- {"rewards": [...], "prompts": [...], "metadata": [...] (optional)}
                 -> {"ok": true} | {"ok": false, "reward": name, "index": i, "error": why}

Errors: 400 for a malformed request (the body says what is wrong: JSON it cannot read, an image
that is no PNG or has over PIL's Image.MAX_IMAGE_PIXELS pixels, prompts or metadata that a served
reward's check() rejects), 404 for another path, 405 for a path asked with the other method
(with an Allow header), 411 without Content-Length, 413 for a body over
--max-request-mb or images that declare more pixels in all than --max-request-mpixels (read from
their headers, before any is decoded), 422 when a reward's scores are not one finite number per
image (NaN, say), 500 when a reward raises while scoring (its error in the body; clients retry
500s, not 4xx: the same images would get the same NaN).

Batching: a single worker thread owns the reward models. It takes the first waiting request, then
keeps collecting requests for up to --batch-window-ms or until --batch-size images, and scores them
in one call per reward (requests with images of one size together), in chunks of --batch-size.
A reward with a check(prompts, metadata) hook (the one train.py calls before drawing any image)
checks each request first: a request it rejects gets a 400 and is left out of the batch, so the
requests batched with it are scored all the same.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import errno
import io
import json
import math
import os
import queue
import socket
import struct
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

if __name__ == "__main__":  # before the imports below (seconds): a Ctrl-C among them is a line, not a traceback
    from stepfast import quiet_ctrl_c_while_starting

    quiet_ctrl_c_while_starting("stepfast reward server")

import numpy as np

if TYPE_CHECKING:
    import torch

_DRAIN_LIMIT = 1 << 30  # a body this much over the limit is not read at all (connection dropped)
_PNG_HEADER = b"\x89PNG\r\n\x1a\n"


class BadRequest(ValueError):
    """The request is malformed; the message says how (sent back with HTTP 400)."""

    status = 400


class TooLarge(BadRequest):
    """The request asks for more than this server takes at once (HTTP 413)."""

    status = 413


class BadScores(ValueError):
    """A reward's scores of a request that are not one finite number per image (HTTP 422: asked
    again, the reward would score the same images alike, so clients do not retry it)."""

    status = 422


@dataclass
class ScoreJob:
    rewards: list[str]
    images: np.ndarray  # uint8 [n, H, W, 3]
    prompts: list[str]
    metadata: list | None
    future: Future


def png_bytes(text, index: int) -> bytes:
    """The bytes of images[index], a base64 string, or BadRequest naming it."""
    if not isinstance(text, str):
        raise BadRequest(f"images[{index}] must be a base64 PNG string, got {type(text).__name__}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"images[{index}] is not a base64-encoded PNG: {exc}") from exc


def png_size(raw: bytes) -> tuple[int, int] | None:
    """(width, height) that the PNG header of `raw` declares, read without decoding; None without one."""
    if len(raw) < 24 or not raw.startswith(_PNG_HEADER) or raw[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", raw[16:24])
    return width, height


def decode_png_bytes(raw: bytes, index: int) -> np.ndarray:
    """images[index] of a request, its PNG bytes, as uint8 [H, W, 3]; BadRequest naming it."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw), formats=["PNG"]) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except Image.DecompressionBombError as exc:  # check_png_size has let no such image through
        raise BadRequest(f"images[{index}] is too large: {exc}") from exc
    except (ValueError, OSError) as exc:
        raise BadRequest(f"images[{index}] is not a base64-encoded PNG: {exc}") from exc


def check_png_size(size: tuple[int, int] | None, index: int) -> None:
    """BadRequest naming the image and its size when its PNG header declares (`png_size`) more
    pixels than PIL's Image.MAX_IMAGE_PIXELS (no limit when that is None). Read before PIL decodes
    anything: a few KB of PNG can declare a 20000x20000 image, gigabytes once decoded. PIL itself
    only warns up to twice its limit; here its limit is the limit."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    if limit is None or size is None:
        return  # no limit, or no PNG header to read: PIL says what is wrong with it
    width, height = size
    if width * height > limit:
        raise BadRequest(f"images[{index}] is {width}x{height} = {width * height} pixels, over this server's "
                         f"limit of {limit} pixels per image (PIL's Image.MAX_IMAGE_PIXELS); send smaller images")


def _served(rewards, served) -> list[str]:
    """A request's "rewards", checked: a non-empty list of names this server serves; else BadRequest."""
    if not isinstance(rewards, list) or not rewards or not all(isinstance(r, str) for r in rewards):
        raise BadRequest('"rewards" must be a non-empty list of reward names')
    missing = [r for r in rewards if r not in served]
    if missing:
        raise BadRequest(f"rewards {missing} are not served here; this server serves {sorted(served)}")
    return rewards


def check_prompts(body: bytes, served) -> dict:
    """The answer to POST /check {rewards, prompts[, metadata]}: {"ok": true} when every named reward
    that has a check(prompts, metadata) hook accepts them, else {"ok": false, "reward", "index" (of the
    first prompt refused, or null), "error"}: what a trainer asks at start, before it draws an image.
    BadRequest for a body that is not such a request."""
    from stepfast.rewards import PromptError

    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRequest(f"body is not JSON this server can read: {type(exc).__name__}") from exc
    if not isinstance(request, dict) or not isinstance(request.get("prompts"), list):
        raise BadRequest("body must be a JSON object with rewards, prompts[, metadata]")
    rewards, prompts, metadata = _served(request.get("rewards"), served), request["prompts"], request.get("metadata")
    if not all(isinstance(p, str) for p in prompts):
        raise BadRequest('"prompts" must be a list of strings')
    if metadata is not None and (not isinstance(metadata, list) or len(metadata) != len(prompts)):
        raise BadRequest(f'"metadata" must be a list of {len(prompts)} objects (or null entries)')
    for name in rewards:
        check = getattr(served[name], "check", None)
        if check is None:
            continue
        try:
            check(prompts, metadata if metadata is not None else [None] * len(prompts))
        except PromptError as exc:
            return {"ok": False, "reward": name, "index": exc.index, "error": f"{exc.by()}{exc.reason}"}
        except ValueError as exc:
            return {"ok": False, "reward": name, "index": None, "error": str(exc)}
    return {"ok": True}


def parse_request(
    body: bytes, served, max_pixels: int | None = None
) -> tuple[list[str], np.ndarray, list[str], list | None]:
    """(rewards, images [n, H, W, 3] uint8, prompts, metadata) of a /score body, or BadRequest;
    TooLarge when its images declare more than `max_pixels` pixels in all (before any is decoded)."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not JSON: {exc}") from exc
    except RecursionError as exc:  # e.g. [[[[...]]]], nested deeper than the parser's recursion allows
        raise BadRequest("body is not JSON this server can read: its arrays or objects are nested too "
                         "deeply") from exc
    if not isinstance(request, dict):
        raise BadRequest("body must be a JSON object with rewards, images, prompts[, metadata]")
    unknown = sorted(set(request) - {"rewards", "images", "prompts", "metadata"})
    if unknown:
        raise BadRequest(f"unknown fields {unknown}; expected rewards, images, prompts, metadata")
    rewards = _served(request.get("rewards"), served)
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
    raws = [png_bytes(text, i) for i, text in enumerate(images)]
    declared = [png_size(raw) for raw in raws]  # from the headers: nothing decoded yet
    for i, size in enumerate(declared):
        check_png_size(size, i)
    total = sum(w * h for w, h in filter(None, declared))
    if max_pixels is not None and total > max_pixels:
        raise TooLarge(f"the {len(raws)} images declare {total} pixels in all, over this server's limit of "
                       f"{max_pixels} per request (--max-request-mpixels); send fewer images per request")
    pixels = [decode_png_bytes(raw, i) for i, raw in enumerate(raws)]
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
            try:
                self._score(jobs)
            except BaseException as exc:  # noqa: BLE001 (a reward raising SystemExit, say: this batch
                # fails with a 500, and the one thread that scores goes on; had it ended, every later
                # request would wait for an answer without end while /health said ok)
                error = RuntimeError(f"a reward raised {type(exc).__name__}: {exc}")
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(error)

    @property
    def alive(self) -> bool:
        """Whether the thread that scores the requests is running."""
        return self._thread.is_alive()

    def _score_members(self, name: str, members: list[ScoreJob], results: dict[int, dict]) -> None:
        """Reward `name` of `members` in one call, into results[id(job)][name]. When that call fails
        and holds several requests, each is scored alone: only a request the reward fails on gets
        the error (a 500, which its client retries), not the others batched with it."""
        try:
            scores = self._score_reward(name, members)
        except Exception as exc:
            if len(members) > 1:
                for job in members:
                    self._score_members(name, [job], results)
            elif not members[0].future.done():
                members[0].future.set_exception(exc)
            return
        start = 0
        for job in members:
            n = len(job.images)
            results[id(job)][name] = {k: v[start : start + n].tolist() for k, v in scores.items()}
            start += n

    def _check(self, job: ScoreJob) -> bool:
        """Whether every reward of `job` that has a check(prompts, metadata) hook accepts its prompts
        and metadata. When one rejects them (a ValueError, the hook's contract for input it cannot
        score), the job's future gets a BadRequest (400) naming the reward, with its message, and
        the job is not scored: the requests batched with it are. Anything else the check raises
        fails this job alone, with a 500."""
        from stepfast.rewards import PromptError

        for name in job.rewards:
            check = getattr(self.rewards[name], "check", None)
            if check is None:
                continue
            try:  # with a record per prompt, as the trainer calls it (None where a request has no metadata)
                check(job.prompts, job.metadata if job.metadata is not None else [None] * len(job.prompts))
            except PromptError as exc:
                # named by its place in the request, from 0, as images[i] is, and by the part of a
                # served `weighted` reward that refused it
                job.future.set_exception(BadRequest(f"reward {name!r} cannot score this request: "
                                                    f"{exc.by()}prompts[{exc.index}]: {exc.reason}"))  # fmt: skip
                return False
            except ValueError as exc:
                job.future.set_exception(BadRequest(f"reward {name!r} cannot score this request: {exc}"))
                return False
            except Exception as exc:
                job.future.set_exception(exc)
                return False
        return True

    def _score(self, jobs: list[ScoreJob]) -> None:
        jobs = [job for job in jobs if self._check(job)]
        results: dict[int, dict] = {id(job): {} for job in jobs}
        for shape in {job.images.shape[1:] for job in jobs}:
            same_size = [job for job in jobs if job.images.shape[1:] == shape]
            for name in dict.fromkeys(n for job in same_size for n in job.rewards):
                self._score_members(name, [job for job in same_size if name in job.rewards], results)
        for job in jobs:
            if not job.future.done():
                job.future.set_result(results[id(job)])

    def _score_reward(self, name: str, members: list[ScoreJob]) -> dict[str, torch.Tensor]:
        import torch  # imported here, so that a command line with bad arguments fails fast

        from stepfast.rewards.combine import ScoreError, check_scores

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
            try:
                chunks.append(check_scores(name, out, len(prompts[i : i + self.batch_size])))
            except ScoreError as exc:  # its positions in the request, not in this chunk of it
                raise BadScores(str(ScoreError(name, exc.kind, [i + k for k in exc.images], len(prompts)))) from None
            except ValueError as exc:
                raise BadScores(str(exc)) from None
        return {key: torch.cat([c[key] for c in chunks]) for key in chunks[0]}


class RewardServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with the rewards, the batcher and the request-size limit."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, rewards: dict, host: str = "127.0.0.1", port: int = 8600,
                 max_request_bytes: int = 256 << 20, batch_size: int = 64, batch_window_s: float = 0.005,
                 verbose: bool = False, bind_and_activate: bool = True, max_request_pixels: int = 256 << 20):
        self.rewards = rewards
        self.max_request_bytes = int(max_request_bytes)
        # decoded, a request takes 3 bytes a pixel: the body limit alone lets a few KB of PNG declare GBs
        self.max_request_pixels = int(max_request_pixels)
        self.verbose = verbose
        if ":" in host:  # an IPv6 address such as ::1
            self.address_family = socket.AF_INET6
        self.batcher = Batcher(rewards, batch_size, batch_window_s)
        super().__init__((host, port), ScoreHandler, bind_and_activate)  # a failed bind calls server_close()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def server_close(self) -> None:
        super().server_close()
        self.batcher.close()


class ScoreHandler(BaseHTTPRequestHandler):
    server: RewardServer
    server_version = "stepfast-reward-server"
    timeout = 300  # seconds a connection may stall while sending its request

    ROUTES = {"/health": "GET", "/score": "POST", "/check": "POST"}

    def _misrouted(self, method: str) -> bool:
        """Answer a path this server does not have (404) or one asked with the other method (405, with
        its Allow header), naming what it serves; False when the request is one it answers."""
        allowed = self.ROUTES.get(self.path)
        if allowed == method:
            return False
        served = ", ".join(f"{m} {p}" for p, m in self.ROUTES.items())
        if allowed is None:
            self._send(404, {"error": f"no such path {self.path!r}; this server answers {served}"})
        else:
            self._send(405, {"error": f"{self.path} takes {allowed}, not {method}; this server answers {served}"},
                       {"Allow": allowed})  # fmt: skip
        return True

    def do_GET(self) -> None:
        if self._misrouted("GET"):
            return
        if not self.server.batcher.alive:
            return self._send(503, {"status": "down", "error": "the server's scoring thread has stopped"})
        self._send(200, {
            "status": "ok",
            "rewards": sorted(self.server.rewards),
            "batch_size": self.server.batcher.batch_size,
            "max_request_bytes": self.server.max_request_bytes,
            "max_request_pixels": self.server.max_request_pixels,
        })

    def do_POST(self) -> None:
        if self._misrouted("POST"):
            return
        length = self.headers.get("Content-Length")
        if length is None:
            return self._send(411, {"error": f"POST {self.path} needs a Content-Length header"})
        if not (length.isascii() and length.isdigit()):  # ('²' is a digit to str.isdigit, not to int)
            return self._send(400, {"error": f"Content-Length must be a number of bytes, got {length!r}"})
        length, limit = int(length), self.server.max_request_bytes
        if length > limit:
            self._drain(length)
            return self._send(413, {
                "error": f"request body of {length} bytes is over this server's limit of {limit} bytes "
                "(--max-request-mb); send fewer images per request"
            })
        body = self.rfile.read(length)
        if self.path == "/check":
            try:
                return self._send(200, check_prompts(body, self.server.rewards))
            except BadRequest as exc:
                return self._send(exc.status, {"error": str(exc)})
        try:
            parsed = parse_request(body, self.server.rewards, self.server.max_request_pixels)
            rewards, images, prompts, metadata = parsed
        except BadRequest as exc:
            return self._send(exc.status, {"error": str(exc)})
        future = self.server.batcher.submit(rewards, images, prompts, metadata)
        try:
            scores = future.result()
        except (BadRequest, BadScores) as exc:  # a reward's check() rejects the request, or its scores are bad
            return self._send(exc.status, {"error": str(exc)})
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

    def _send(self, status: int, payload: dict, headers: dict | None = None) -> None:
        body = json.dumps(payload).encode("utf-8")
        try:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client left (its timeout): nothing to answer
            self.close_connection = True

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        if self.server.verbose:
            super().log_message(format, *args)


def load_rewards(names: list[str], options: dict) -> dict:
    """{name: reward} for `names`, each built with its `options`; ValueError naming the reward, and
    the flag (--rewards or --reward-options) that asks for it, when one cannot be loaded."""
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(f"--reward-options names {unknown}, which are not in --rewards {names}")
    from stepfast import rewards as registry

    loaded = {}
    for name in names:
        opts = options.get(name, {})
        try:
            loaded[name] = registry.load(name, **opts)
        except Exception as exc:  # any failure to build a reward is a bad --rewards / --reward-options
            kind = "" if isinstance(exc, (ValueError, TypeError, ImportError, OSError)) else f"{type(exc).__name__}: "
            why = " ".join(f"{kind}{exc}".split())  # one line
            if opts:
                raise ValueError(f"--reward-options: cannot load reward {name!r} with options "
                                 f"{json.dumps(opts)}: {why}") from exc  # fmt: skip
            raise ValueError(f"--rewards: cannot load reward {name!r}: {why}") from exc
    return loaded


def _reward_options(text: str) -> dict:
    """The --reward-options JSON (or @file holding it); ValueError saying what is wrong."""
    source = "--reward-options"
    if text.startswith("@"):
        path = text[1:]
        if not path:
            raise ValueError("--reward-options @FILE needs a file name after '@'")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"--reward-options: cannot read {path}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise ValueError(f"--reward-options: {path} is not UTF-8 text: {exc}") from exc
        source = f"--reward-options file {path}"
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        shown = " ".join(text.split())
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        raise ValueError(f"{source} is not JSON ({exc}): {shown}") from exc
    if not isinstance(options, dict):
        raise ValueError(f'{source} must be a JSON object {{"reward name": {{"option": value}}}}, '
                         f"got a JSON {type(options).__name__}")  # fmt: skip
    for name, value in options.items():
        if not isinstance(value, dict):
            raise ValueError(f'{source}: the options of {name!r} must be a JSON object {{"option": value}}, '
                             f"got {json.dumps(value)[:100]}")  # fmt: skip
    return options


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stepfast.reward_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rewards", required=True, help="comma-separated reward names or module:attr paths")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8600, help="port, 0 for any free one (default: %(default)s)")
    parser.add_argument("--max-request-mb", type=float, default=256,
                        help="largest request body in MiB (default: %(default)s)")
    parser.add_argument("--max-request-mpixels", type=float, default=256,
                        help="most pixels of all the images of a request, in units of 2^20 (default: %(default)s, "
                             "256 images of 1024x1024)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="most images per reward call (default: %(default)s)")
    parser.add_argument("--batch-window-ms", type=float, default=5,
                        help="how long to gather requests, ms (default: %(default)s)")
    parser.add_argument("--reward-options", default="{}", help='JSON {"name": {...}}, or @file.json')
    parser.add_argument("--verbose", action="store_true", help="log every request")
    args = parser.parse_args(argv)

    def fail(message: str) -> None:  # parser.error without the usage: for failures past the arguments
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    # every argument is checked before any reward loads (a model can take minutes to load)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be 0-65535 (0: any free port), got {args.port}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if not (math.isfinite(args.batch_window_ms) and args.batch_window_ms >= 0):
        parser.error(f"--batch-window-ms must be a number >= 0, got {args.batch_window_ms:g}")
    if not (math.isfinite(args.max_request_mb) and args.max_request_mb > 0):
        parser.error(f"--max-request-mb must be a number > 0, got {args.max_request_mb:g}")
    if not (math.isfinite(args.max_request_mpixels) and args.max_request_mpixels > 0):
        parser.error(f"--max-request-mpixels must be a number > 0, got {args.max_request_mpixels:g}")
    names = list(dict.fromkeys(n.strip() for n in args.rewards.split(",") if n.strip()))
    if not names:
        parser.error(f"--rewards names no reward (got {args.rewards!r}); give comma-separated reward names, "
                     "e.g. --rewards shapes,pickscore")  # fmt: skip
    try:
        options = _reward_options(args.reward_options)
    except ValueError as exc:
        parser.error(str(exc))
    unknown = sorted(set(options) - set(names))
    if unknown:
        parser.error(f"--reward-options names {unknown}, which are not in --rewards {names}")
    # Bind first, so that a taken port or an unknown host fails before any model loads, and listen
    # once the rewards are loaded (until then clients are refused, and retry). The server and its
    # batcher share `rewards`, filled in place.
    rewards: dict = {}
    max_bytes = max(int(args.max_request_mb * (1 << 20)), 1)
    server = RewardServer(rewards, args.host, args.port, max_bytes, args.batch_size, args.batch_window_ms / 1000,
                          args.verbose, bind_and_activate=False,
                          max_request_pixels=max(int(args.max_request_mpixels * (1 << 20)), 1))  # fmt: skip
    try:
        try:
            server.server_bind()
        except (OSError, OverflowError) as exc:  # socket.gaierror (unknown host) is an OSError
            hint = "; is another server on it? pick another --port (0: any free port)" if (
                getattr(exc, "errno", None) == errno.EADDRINUSE) else ""  # fmt: skip
            fail(f"cannot listen on {args.host}:{args.port} (--host/--port): "
                 f"{getattr(exc, 'strerror', None) or exc}{hint}")  # fmt: skip
        # a model reward can take minutes to load, and clients are refused until it has: say so
        print(f"stepfast reward server: loading {', '.join(names)} ...", flush=True)
        try:
            rewards.update(load_rewards(names, options))
        except ValueError as exc:
            fail(str(exc))
        except KeyboardInterrupt:  # Ctrl-C while a model loads: a line, not a traceback from inside it
            print("\nstepfast reward server: interrupted while loading the rewards", file=sys.stderr)
            server.server_close()
            return 130
        try:
            server.server_activate()
        except OSError as exc:
            fail(f"cannot listen on {args.host}:{args.port} (--host/--port): {exc.strerror or exc}")
    except BaseException:
        server.server_close()
        raise
    print(f"stepfast reward server: {', '.join(names)} on {server.url} (pid {os.getpid()})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    from stepfast import ctrl_c_as_usual

    ctrl_c_as_usual()
    sys.exit(main())
