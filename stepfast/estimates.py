"""Batched clean-image estimates with the substep forward captured once in a CUDA graph.

`EstimateEngine(velocity)(states, t, substeps, first_velocity)` runs
`stepfast.rollout.estimate_clean_images` (the same substep loop): T' Euler (ODE)
substeps from t to 0, substep i from t (1 - i / T') to t (1 - (i + 1) / T'), all M states as one batch,
the first substep reusing the rollout's velocity. What changes is how the velocity runs on CUDA: the
forward of the whole batch is captured once in a CUDA graph, with static input buffers for the states
and the per-sample times (device tensors, so one graph serves every substep), and replayed T' - 1
times: one launch per substep instead of thousands of kernel launches from Python.

The CUDA-graph contract: the velocity must be capturable (no host synchronisation such as .item(), no
data-dependent shapes) and must read everything except (x, t) from tensors that stay where they are
between calls (update them in place with copy_), because a replay reads the memory the capture saw.
A new velocity, or new conditioning tensors, need a new engine or `reset()`. Where capture fails the
engine says why once (a RuntimeWarning) and runs the substeps eagerly; on CPU it always runs eagerly.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from .rollout import estimate_clean_images

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _CapturedForward:
    """velocity(x, t) for one batch shape, captured in a CUDA graph with static x and t buffers."""

    def __init__(self, velocity: Velocity, x: torch.Tensor, t: torch.Tensor, warmup: int):
        self.x = x.clone()
        self.t = t.clone()
        # warm up on a side stream (cuBLAS handles, autotuning, lazy init) before capturing, as
        # torch.cuda.graphs recommends
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                velocity(self.x, self.t)
        torch.cuda.current_stream(x.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's capture-unsafe calls are errors. The reward may be scoring
        # the final images on the GPU in its own thread meanwhile (reward.async_scoring), which the
        # default "global" mode would turn into a failed capture or an error in the reward
        previous = torch.cuda.current_stream()  # what the graph context makes way for: the current device's
        try:
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.out = velocity(self.x, self.t)
        except BaseException:
            # a failed capture raises from the graph context's exit before it gives back the stream it
            # captured on: without this, the run would go on, eagerly, on that side stream
            torch.cuda.set_stream(previous)
            raise

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.x.copy_(x)
        self.t.copy_(t)
        self.graph.replay()
        return self.out  # overwritten by the next replay: consumed before it


class EstimateEngine:
    """Clean estimates x0_hat of many states at per-sample times, the substep forward in a CUDA graph.

    use_cuda_graph: "auto" (capture on CUDA, fall back to eager with a warning where capture fails),
    True (capture, and raise where it fails or the states are not on CUDA), False (always eager).
    warmup: eager forwards before the capture of a new batch shape.
    """

    def __init__(self, velocity: Velocity, use_cuda_graph: bool | str = "auto", warmup: int = 2):
        if use_cuda_graph not in ("auto", True, False):
            raise ValueError(f"use_cuda_graph must be 'auto', True or False, got {use_cuda_graph!r}")
        self.velocity = velocity
        self.use_cuda_graph = use_cuda_graph
        self.warmup = warmup
        self._captured: dict[tuple, _CapturedForward] = {}
        self.fallback_reason: str | None = None  # why the engine runs eagerly on CUDA, once known

    def reset(self) -> None:
        """Drop the captured graphs (and their memory pools): the next call captures again."""
        self._captured.clear()
        self.fallback_reason = None

    @torch.no_grad()
    def __call__(
        self,
        states: torch.Tensor,
        t: torch.Tensor,
        substeps: int,
        first_velocity: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x0_hat [M, ...] of states [M, ...] at times t [M] after `substeps` Euler substeps (see
        `stepfast.rollout.estimate_clean_images`, which this reproduces number for number)."""
        if substeps < 1:
            raise ValueError(f"substeps must be >= 1, got {substeps}")
        x = states.float()
        t = torch.as_tensor(t, dtype=torch.float32, device=x.device).reshape(-1)
        if t.shape[0] != x.shape[0]:
            raise ValueError(f"t must have one time per state: {x.shape[0]} states, got {t.shape[0]} times")
        if first_velocity is not None and first_velocity.shape != x.shape:
            raise ValueError(
                f"first_velocity must have the shape of states {tuple(x.shape)}, got {tuple(first_velocity.shape)}"
            )
        forward_calls = substeps - (first_velocity is not None)
        forward = self._forward(x, t) if forward_calls > 0 else self.velocity
        return estimate_clean_images(forward, x, t, substeps, first_velocity)

    def _forward(self, x: torch.Tensor, t: torch.Tensor) -> Velocity:
        """The captured forward for this batch, or the eager velocity."""
        if self.use_cuda_graph is False:
            return self.velocity
        if x.device.type != "cuda":
            if self.use_cuda_graph is True:
                raise ValueError(f"use_cuda_graph=True needs CUDA tensors, got states on {x.device}")
            return self.velocity
        if self.fallback_reason is not None:
            return self.velocity
        key = (tuple(x.shape), x.device)
        if key not in self._captured:
            try:
                self._captured[key] = _CapturedForward(self.velocity, x, t, self.warmup)
            except Exception as exc:  # capture is best effort unless asked for
                if self.use_cuda_graph is True:
                    raise RuntimeError(f"CUDA graph capture of the velocity failed: {exc}") from exc
                self.fallback_reason = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"EstimateEngine: CUDA graph capture of the velocity failed ({self.fallback_reason}); "
                    "running the substeps eagerly",
                    RuntimeWarning,
                    stacklevel=3,
                )
                torch.cuda.synchronize(x.device)
                return self.velocity
        return self._captured[key]
