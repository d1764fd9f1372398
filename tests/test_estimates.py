"""EstimateEngine computes exactly stepfast.rollout.estimate_clean_images; on CUDA, through a CUDA graph.

Tests whose name contains "cuda" need a GPU (benchmarks/gpu_check.sh runs them) and skip without one.
"""

from __future__ import annotations

import contextlib
import types
import warnings

import pytest
import torch

from stepfast.estimates import EstimateEngine
from stepfast.rollout import estimate_clean_images

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class TinyVelocity(torch.nn.Module):
    """A velocity model with per-sample time dependence: v = MLP([x, t]) reshaped like x."""

    def __init__(self, shape=(4, 6, 6), hidden=32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        n = 1
        for d in shape:
            n *= d
        self.shape = shape
        self.net = torch.nn.Sequential(torch.nn.Linear(n + 1, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, n))
        self.calls = 0

    def forward(self, x, t):
        self.calls += 1
        h = torch.cat([x.flatten(1), t[:, None].to(x.dtype)], dim=1)
        return self.net(h).reshape(x.shape)


def states_and_times(m=7, shape=(4, 6, 6), device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(m, *shape, generator=g).to(device)
    t = torch.rand(m, generator=g).clamp(0.05, 1.0).to(device)
    return states, t


@pytest.mark.parametrize("substeps", [1, 2, 5])
@pytest.mark.parametrize("with_first", [False, True])
def test_engine_equals_estimate_clean_images_on_cpu(substeps, with_first):
    velocity = TinyVelocity()
    states, t = states_and_times()
    first = velocity(states, t).detach() if with_first else None
    engine = EstimateEngine(velocity)
    with torch.no_grad():
        expected = estimate_clean_images(velocity, states, t, substeps, first_velocity=first)
    got = engine(states, t, substeps, first_velocity=first)
    assert got.dtype == torch.float32 and got.shape == states.shape
    assert torch.equal(got, expected)


def test_estimates_are_euler_substeps_from_t_to_zero():
    """The reference itself, written out: T' = 3 Euler steps of t/3 each, the velocity taken at t, 2t/3
    and t/3 (the engine's test above compares it with this function)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, generator=g)

    def velocity(x, t):
        return x @ w * (1 + t[:, None]) - t[:, None]

    x, t = torch.randn(3, 4, generator=g), torch.tensor([0.9, 0.5, 0.2])
    h = x - (t[:, None] / 3) * velocity(x, t)
    h = h - (t[:, None] / 3) * velocity(h, t * 2 / 3)
    h = h - (t[:, None] / 3) * velocity(h, t / 3)
    torch.testing.assert_close(estimate_clean_images(velocity, x, t, 3), h, rtol=1e-6, atol=1e-6)


def test_engine_forward_count_and_tweedie():
    velocity = TinyVelocity()
    states, t = states_and_times()
    engine = EstimateEngine(velocity)
    with torch.no_grad():
        first = velocity(states, t)
    velocity.calls = 0
    engine(states, t, 5, first_velocity=first)
    assert velocity.calls == 4  # T' - 1 forwards: the first substep reuses the rollout's velocity
    velocity.calls = 0
    one = engine(states, t, 1, first_velocity=first)
    assert velocity.calls == 0
    assert torch.equal(one, states - t[:, None, None, None] * first)  # one-step Tweedie estimate


def test_engine_rejects_bad_input():
    engine = EstimateEngine(TinyVelocity())
    states, t = states_and_times()
    with pytest.raises(ValueError, match="substeps must be >= 1"):
        engine(states, t, 0)
    with pytest.raises(ValueError, match="one time per state"):
        engine(states, t[:3], 2)
    with pytest.raises(ValueError, match="use_cuda_graph"):
        EstimateEngine(TinyVelocity(), use_cuda_graph="yes")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        EstimateEngine(TinyVelocity(), use_cuda_graph=True)(states, t, 2)


@needs_cuda
@pytest.mark.parametrize("substeps", [2, 5])
def test_cuda_graph_engine_equals_eager(substeps):
    velocity = TinyVelocity().cuda()
    states, t = states_and_times(device="cuda")
    with torch.no_grad():
        first = velocity(states, t)
        expected = estimate_clean_images(velocity, states, t, substeps, first_velocity=first)
    engine = EstimateEngine(velocity, use_cuda_graph=True)
    got = engine(states, t, substeps, first_velocity=first)
    # cuBLAS may pick another algorithm inside a capture: float32 rounding differences only
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # later calls replay: the Python velocity is not run at all, and new inputs give new results
    states2, t2 = states_and_times(device="cuda", seed=2)
    with torch.no_grad():
        first2 = velocity(states2, t2)
        expected2 = estimate_clean_images(velocity, states2, t2, substeps, first_velocity=first2)
    velocity.calls = 0
    got2 = engine(states2, t2, substeps, first_velocity=first2)
    assert velocity.calls == 0
    torch.testing.assert_close(got2, expected2, rtol=1e-5, atol=1e-5)


@needs_cuda
def test_cuda_graph_engine_falls_back_once_and_says_why():
    class Syncing(TinyVelocity):
        def forward(self, x, t):
            if float(t.max().item()) > 2:  # a host sync: not capturable
                raise AssertionError
            return super().forward(x, t)

    velocity = Syncing().cuda()
    states, t = states_and_times(device="cuda")
    engine = EstimateEngine(velocity)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = engine(states, t, 3)
        engine(states, t, 3)
    assert sum("capture" in str(w.message) for w in caught) == 1
    assert engine.fallback_reason
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # not the failed capture's stream
    with torch.no_grad():
        expected = estimate_clean_images(velocity, states, t, 3)
    assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="capture"):
        EstimateEngine(Syncing().cuda(), use_cuda_graph=True)(states, t, 3)


def test_a_failed_capture_gives_back_the_stream_it_captured_on(monkeypatch):
    """torch's graph context makes its capture stream current on entry and, when the capture fails,
    raises from its exit before restoring the stream before it: the engine restores it, so that the
    eager fallback runs on the stream the run was using (checked here with torch.cuda's stream and
    graph calls stood in for, as torch's context does them; on a GPU by the CUDA fallback test)."""
    from stepfast import estimates

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            pass

    default = Stream("default")
    current = [default]

    class Graph:  # torch.cuda.graph as far as streams go: switch on entry, fail on exit without switching back
        def __init__(self, graph, **options):
            pass

        def __enter__(self):
            current[0] = Stream("capture")

        def __exit__(self, *exc):
            raise RuntimeError("operation not permitted when stream is capturing")

    fake = types.SimpleNamespace(
        Stream=lambda device=None: Stream("side"), stream=lambda stream: contextlib.nullcontext(),
        current_stream=lambda device=None: current[0], set_stream=lambda stream: current.__setitem__(0, stream),
        CUDAGraph=lambda: None, graph=Graph)  # fmt: skip
    velocity, (states, t) = TinyVelocity(), states_and_times()
    monkeypatch.setattr(estimates.torch, "cuda", fake)
    with pytest.raises(RuntimeError, match="not permitted"):
        estimates._CapturedForward(velocity, states, t, warmup=0)
    assert current == [default]


@needs_cuda
def test_cuda_graph_engine_sees_conditioning_updated_in_place():
    """The documented contract: other inputs live in fixed tensors, updated with copy_."""
    velocity = TinyVelocity().cuda()
    scale = torch.ones((), device="cuda")

    def conditioned(x, t):
        return velocity(x, t) * scale

    states, t = states_and_times(device="cuda")
    engine = EstimateEngine(conditioned, use_cuda_graph=True)
    engine(states, t, 3)
    scale.copy_(torch.tensor(0.5))
    with torch.no_grad():
        expected = estimate_clean_images(conditioned, states, t, 3)
    torch.testing.assert_close(engine(states, t, 3), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_cuda_graph_engine_sees_weights_an_optimizer_step_changed(device):
    """The trainer captures the estimates once (on CUDA) and replays them every iteration after an
    optimizer step, and inside the EMA's swap of the weights: both write the parameters in place,
    which a replay reads. A replay with the old weights would score the new policy's states with the
    old one. (On the CPU the engine runs eagerly: the same checks, without a graph.)"""
    velocity = TinyVelocity().to(device)
    states, t = states_and_times(device=device)
    engine = EstimateEngine(velocity, use_cuda_graph=device == "cuda")

    def same(got, expected):  # eagerly, the same calls: to the bit; a graph's kernels may round otherwise
        if device == "cpu":
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    before = engine(states, t, 3).clone()
    optimizer = torch.optim.AdamW(velocity.parameters(), lr=1e-2)
    velocity(states, t).square().mean().backward()
    optimizer.step()
    with torch.no_grad():
        expected = estimate_clean_images(velocity, states, t, 3)
    assert (expected - before).abs().max() > 1e-3
    same(engine(states, t, 3), expected)
    with torch.no_grad():  # as EMA.applied: other weights copied into the same tensors
        for p in velocity.parameters():
            p.copy_(p * 0.5)
        expected = estimate_clean_images(velocity, states, t, 3)
    same(engine(states, t, 3), expected)
