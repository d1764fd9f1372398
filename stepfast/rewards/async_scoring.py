"""Score a batch of images in the background while the caller goes on computing.

    scorer = AsyncScorer(reward)
    pending = scorer.submit(images, prompts, metadata)   # returns at once
    ...                                                   # the trainer: the clean-image estimates
    scores = pending.result()                             # the reward's dict; its error, if it raised

One worker thread scores submitted batches in order, so a reward model is only ever used by one
thread. Tensors and arrays are copied on submit (an async copy on the GPU), so the caller may reuse
its buffers; a list of PIL images is copied as a list. `InlineScorer` has the same interface and
scores at once in the calling thread (`reward.async_scoring=false`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch


class AsyncScorer:
    def __init__(self, reward, device=None):
        if not hasattr(reward, "score"):
            raise TypeError(f"AsyncScorer needs a reward with score(), got {type(reward).__name__}")
        self.reward = reward
        # CUDA's current device is the thread's own, and a new thread's is the first GPU: the worker is
        # set to `device` (the rank's), so that a reward that puts tensors on "cuda" puts them there
        on_gpu = device is not None and torch.device(device).type == "cuda"
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="reward-scorer",
            initializer=torch.cuda.set_device if on_gpu else None, initargs=(torch.device(device),) if on_gpu else (),
        )  # fmt: skip

    def submit(self, images, prompts, metadata=None) -> Future:
        """Queue a batch; the Future's result() is reward.score(images, prompts, metadata)."""
        if isinstance(images, torch.Tensor):
            images = images.detach().clone()
        elif isinstance(images, np.ndarray):
            images = images.copy()
        else:
            images = list(images)
        prompts = list(prompts)
        metadata = None if metadata is None else list(metadata)
        return self._pool.submit(self.reward.score, images, prompts, metadata)

    def close(self, wait: bool = True) -> None:
        """Stop the worker (after the queued batches when `wait`)."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self) -> "AsyncScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InlineScorer:
    """The AsyncScorer interface, scoring at once in the calling thread."""

    def __init__(self, reward):
        self.reward = reward

    def submit(self, images, prompts, metadata=None) -> Future:
        """A done Future: the scores, or the reward's error, which result() raises (as AsyncScorer's
        does, so that the caller that collects the batches names the images of a bad score)."""
        done = Future()
        try:
            done.set_result(self.reward.score(images, prompts, metadata))
        except Exception as exc:  # noqa: BLE001 - handed on, as a worker thread's would be
            done.set_exception(exc)
        return done

    def close(self, wait: bool = True) -> None:
        pass
