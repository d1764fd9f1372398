"""HTTP with timeouts and retries for the rewards that call a server (remote, vlm, geneval_remote).

One request (a POST; a GET for health checks) is tried `retries + 1` times. Between tries the
client waits `backoff * 2**k` seconds (k = 0, 1, ...; at most `MAX_BACKOFF_S`). A try fails, and is
retried, when the connection cannot be made or breaks, when no byte arrives for `timeout` seconds,
on HTTP 5xx/408/429, and when the answer cannot be parsed. Any other 4xx means the request itself
is wrong: retrying cannot help, so it fails at once. When every try has failed the call raises
`RewardServerError`, which names the server and the last failure; a trainer catches that one type
to stop cleanly.

Only the standard library is used; proxies from the environment are not consulted (reward servers
are usually on the same host or cluster network).
"""

from __future__ import annotations

import http.client
import socket
import time
import urllib.parse
from typing import Any, Callable

MAX_BACKOFF_S = 60.0
_RETRYABLE_STATUS = {408, 429}


class RewardServerError(RuntimeError):
    """A reward server could not give an answer: after all retries, or a request it rejected."""

    def __init__(self, url: str, attempts: int, last_failure: str):
        self.url, self.attempts, self.last_failure = url, attempts, last_failure
        super().__init__(
            f"reward server {url} failed after {attempts} attempt(s); last failure: {last_failure}"
        )


class MalformedResponse(ValueError):
    """The server answered 200 with a body that is not what the protocol says."""


def post(
    url: str,
    body: bytes,
    parse: Callable[[bytes], Any],
    *,
    content_type: str = "application/json",
    headers: dict[str, str] | None = None,
    timeout: float = 120.0,
    retries: int = 5,
    backoff: float = 1.0,
    server: str | None = None,
) -> Any:
    """POST `body` to `url` and return `parse(response_body)`, retrying as the module says.

    `parse` raises `MalformedResponse` (or any ValueError) for an answer it cannot use; that try
    then counts as failed. `server` is how errors name the server (default: `url`).
    """
    sent_headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
    sent_headers.update(headers or {})
    return _request("POST", url, body, sent_headers, parse, timeout, retries, backoff, server)


def get_json(url: str, timeout: float = 10.0, retries: int = 0, backoff: float = 1.0, server: str | None = None,
             headers: dict[str, str] | None = None) -> Any:  # fmt: skip
    """GET `url` and decode its JSON body (a health check), retried as a POST is (none by default)."""
    import json

    return _request("GET", url, None, dict(headers or {}), json.loads, timeout, retries, backoff, server)


def check_url(url: str) -> urllib.parse.SplitResult:
    """`url` split, or a ValueError unless it looks like http(s)://HOST[:PORT][/path]."""
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018  (reading it checks it: a number in 0-65535)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"reward server URL {url!r} must look like http://HOST:PORT/path")
    return parts


def _wait_before(attempt: int, backoff: float) -> None:
    """The pause before try `attempt` (from 0): none before the first, then backoff * 2**k, capped."""
    if attempt:
        time.sleep(min(backoff * 2 ** (attempt - 1), MAX_BACKOFF_S))


def check_accepts_connections(url: str, timeout: float = 10.0, retries: int = 0, backoff: float = 1.0) -> None:
    """A ValueError naming `url` unless its host accepts a TCP connection on its port, tried as a
    request is: for servers whose protocol has no health check, found at start rather than after
    the first images are drawn."""
    parts = check_url(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    last_failure = "no attempt made"
    for attempt in range(retries + 1):
        _wait_before(attempt, backoff)
        try:
            socket.create_connection((parts.hostname, port), timeout=timeout).close()
            return
        except OSError as exc:
            last_failure = f"{type(exc).__name__}: {exc}"
    raise ValueError(f"reward server {url} does not accept connections after {retries + 1} attempt(s) "
                     f"({last_failure}); is it running?")  # fmt: skip


def check_client_options(timeout: float, retries: int, backoff: float, batch_size: int | None = None) -> None:
    """A ValueError naming a reward client's option that cannot work: found when the reward is built
    (the trainer's start), not at its first request."""
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    if not backoff >= 0:
        raise ValueError(f"backoff must be >= 0 seconds, got {backoff}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (images per request), got {batch_size}")


def _request(method, url, body, headers, parse, timeout, retries, backoff, server) -> Any:
    check_client_options(timeout, retries, backoff)
    parts = check_url(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    last_failure = "no attempt made"
    for attempt in range(retries + 1):
        _wait_before(attempt, backoff)
        try:
            status, payload = _send_once(method, parts, path, body, headers, timeout)
        except (socket.timeout, TimeoutError):
            last_failure = f"no answer within the {timeout:g} s timeout"
            continue
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, DNS, bad status line
            last_failure = f"{type(exc).__name__}: {exc}"
            continue
        if status == 200:
            try:
                return parse(payload)
            # MalformedResponse, JSON errors (RecursionError: brackets nested past the parser's depth;
            # OverflowError: a number past a float)
            except (ValueError, TypeError, KeyError, IndexError, RecursionError, OverflowError) as exc:
                last_failure = f"malformed response ({type(exc).__name__}: {exc}): {_excerpt(payload)}"
                continue
        last_failure = f"HTTP {status}: {_excerpt(payload)}"
        if 400 <= status < 500 and status not in _RETRYABLE_STATUS:
            raise RewardServerError(server or url, attempt + 1, last_failure)
    raise RewardServerError(server or url, retries + 1, last_failure)


def _send_once(method, parts, path, body, headers, timeout) -> tuple[int, bytes]:
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=timeout)
    try:
        try:
            conn.request(method, path, body=body, headers=headers)
        except (BrokenPipeError, ConnectionResetError):
            # A server may answer early (413: body too large) and stop reading; its answer is
            # still waiting to be read.
            pass
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _excerpt(payload: bytes, limit: int = 300) -> str:
    text = payload.decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."
