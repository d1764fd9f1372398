"""The fused SDE ops against a float64 reference, for every sampler, backend and reduction.

The reference (`Torch64`) is stepfast.sde's and stepfast.loss's formulas written out line by line in
float64 (sde.py itself computes in float32), differentiated by autograd. Acceptance:
    float32 inputs: outputs and gradients within 1e-5 relative (atol 1e-5 x the reference's largest entry);
    bfloat16 / float16 inputs: no worse than the eager torch code (the torch backend, stepfast.sde) on the
    same inputs, both measured against float64; "no worse" allows 1e-6 (relative to the largest entry)
    for the float32 rounding that precedes the final rounding of both.
Shapes are odd on purpose (prime sizes, batch 1, patch 3, non-contiguous views, several blocks per sample).
The triton backend runs in the Triton interpreter on CPU tensors (kernels/sde_step.py `launcher`), so
these tests need no TRITON_INTERPRET setting and no particular import order. Tests whose id contains
"cuda" run the compiled kernels when a GPU is present (benchmarks/gpu_check.sh); without one, the
compiler still builds every kernel launch for sm_80 and sm_90 (`test_triton_kernels_compile_for_nvidia_gpus`).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch

from stepfast import sde
from stepfast.kernels import dispatch, sde_logprob, sde_step_with_logprob, select_backend
from stepfast.kernels import cpp as cpp_backend

KINDS = ["flow_sde", "cps", "ddim"]
CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def backends_for(device: str) -> list[str]:
    return ["torch", "cpp", "triton"] if device == "cpu" else ["torch", "triton"]


DEVICE_BACKENDS = [(d, b) for d in DEVICES for b in backends_for(d)]
DEVICE_BACKEND_IDS = [f"{d}-{b}" for d, b in DEVICE_BACKENDS]
# The fused backends alone, for tests that measure a kernel against the eager torch code (the torch
# backend against itself could not fail).
FUSED_BACKENDS = [(d, b) for d, b in DEVICE_BACKENDS if b != "torch"]
FUSED_BACKEND_IDS = [f"{d}-{b}" for d, b in FUSED_BACKENDS]


@pytest.fixture(autouse=True)
def _cpp_backend_is_what_runs(request):
    """A test asked for the cpp backend runs the C++ kernels or is skipped, saying why: without
    stepfast._C the dispatcher falls back to torch, and the test would check torch under cpp's name."""
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("backend") == "cpp" and not cpp_backend.AVAILABLE:
        pytest.skip(f"stepfast._C is not available ({cpp_backend.REASON})")


# ----------------------------------------------------------------------------------------------------
# float64 reference


class Torch64:
    """stepfast.sde.step / log_prob and stepfast.loss.kl_to_reference in float64 (times rounded to
    float32 first, as stepfast.sde does)."""

    @staticmethod
    def time(t, x):
        t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
        if t.dim() == 0:
            t = t.expand(x.shape[0])
        return t.double().reshape(-1, *([1] * (x.dim() - 1)))

    @staticmethod
    def std(kind, t, s, noise_level=None, eta=1.0):
        a = sde.DEFAULT_NOISE_LEVEL.get(kind, 0.0) if noise_level is None else noise_level
        if kind == "ode":
            return torch.zeros_like(t)
        if kind == "flow_sde":
            return Torch64.sigma(t, s, a) * torch.sqrt(t - s)
        if kind == "cps":
            return s * math.sin(a * math.pi / 2)
        return eta * s * torch.sqrt(1 - t)

    @staticmethod
    def sigma(t, s, a):
        return a * torch.sqrt(t / (1 - torch.where(t >= 1, s, t)))

    @staticmethod
    def mean(kind, x, v, t, s, **params):
        x, v = x.double(), v.double()
        t, s = Torch64.time(t, x), Torch64.time(s, x)
        std = Torch64.std(kind, t, s, **params)
        if kind == "ode":
            return x + (s - t) * v, std
        if kind == "flow_sde":
            sig = Torch64.sigma(t, s, params.get("noise_level", sde.DEFAULT_NOISE_LEVEL[kind]))
            return x + (s - t) * (v + sig**2 / (2 * t) * (x + (1 - t) * v)), std
        x0_hat = x - t * v
        x1_hat = x + (1 - t) * v
        return (1 - s) * x0_hat + torch.sqrt(torch.clamp(s**2 - std**2, min=0.0)) * x1_hat, std

    @staticmethod
    def log_prob(sample, mean, std, convention, reduce, patch_size):
        sq = (sample.double() - mean) ** 2
        if convention == "gaussian":
            elem = -sq / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
        else:
            elem = -sq
        if reduce == "mean":
            return elem.mean(dim=tuple(range(1, elem.dim())))
        if reduce == "sum":
            return elem.sum(dim=tuple(range(1, elem.dim())))
        return sde.patch_mean(elem, patch_size)

    @staticmethod
    def kl(kind, mean, mean_ref, t, s, **params):
        t, s = Torch64.time(t, mean).reshape(-1), Torch64.time(s, mean).reshape(-1)
        if kind == "flow_sde":
            sig = Torch64.sigma(t, s, params.get("noise_level", sde.DEFAULT_NOISE_LEVEL[kind]))
        else:
            sig = Torch64.std(kind, t, s, **params).expand(t.shape)
        sq = (mean - mean_ref) ** 2
        return sq.mean(dim=tuple(range(1, sq.dim()))) / (2 * sig**2)


# ----------------------------------------------------------------------------------------------------
# cases

# name: (shape, reduce, patch_size, times given as floats, non-contiguous views)
CASES = {
    "mean_prime": ((3, 5, 7, 11), "mean", None, False, False),
    "mean_batch1_float_times": ((1, 5, 7, 11), "mean", None, True, False),
    "mean_transposed": ((3, 5, 7, 11), "mean", None, False, True),
    "sum_multiblock": ((2, 3, 50, 50), "sum", None, False, False),
    "mean_3d": ((2, 13, 17), "mean", None, False, False),
    "tokens_p2": ((3, 5, 14, 10), "tokens", 2, False, False),
    "tokens_batch1": ((1, 3, 6, 4), "tokens", 2, False, False),
    "tokens_p3_transposed": ((2, 3, 9, 6), "tokens", 3, False, True),
}


def times_for(kind: str, batch: int, as_float: bool):
    """Per-sample times, with flow_sde's special first step t = 1 in the batch."""
    if as_float:
        return 0.7, 0.55
    t = [1.0 if kind == "flow_sde" else 0.96, 0.6, 0.35][:batch]
    s = [0.91, 0.46, 0.28][:batch]
    return torch.tensor(t), torch.tensor(s)


def make_inputs(kind, case, device="cpu", dtype=torch.float32, seed=0):
    shape, reduce, patch, as_float, transposed = CASES[case]
    g = torch.Generator().manual_seed(seed)

    def rand(scale=1.0):
        if transposed:  # a [.., W, H] tensor viewed as [.., H, W]: not contiguous
            x = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g).transpose(-1, -2)
        else:
            x = torch.randn(*shape, generator=g)
        return (scale * x).to(device=device, dtype=dtype)

    t, s = times_for(kind, shape[0], as_float)
    x_t, v = rand(), rand()
    v_old = v.double() + 0.5 * torch.randn(shape, generator=g).to(device, torch.float64)
    noise = rand()
    mean_old, std = Torch64.mean(kind, x_t, v_old, t, s)
    sample = (mean_old + std * noise.double()).to(dtype)  # off-policy: v differs from v_old
    v_ref = (v.double() + 0.5 * torch.randn(shape, generator=g).to(device, torch.float64)).to(dtype)
    assert x_t.is_contiguous() != transposed and v.is_contiguous() != transposed
    return dict(x_t=x_t, v=v, t=t, s=s, noise=noise, sample=sample, v_ref=v_ref, reduce=reduce, patch_size=patch)


def assert_matches64(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, what: str = ""):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}")


def normwise_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


def assert_no_worse(kernel, eager, expected, what):
    """Liger-style: the kernel's error against float64 is at most the eager code's (plus float32 rounding)."""
    e_k, e_e = normwise_error(kernel, expected), normwise_error(eager, expected)
    assert e_k <= e_e + 1e-6, f"{what}: kernel error {e_k:.3g} > eager error {e_e:.3g}"


# ----------------------------------------------------------------------------------------------------
# sde_step_with_logprob


def reference_step64(kind, inp, convention, **params):
    mean, std = Torch64.mean(kind, inp["x_t"], inp["v"], inp["t"], inp["s"], **params)
    sample = mean + std * inp["noise"].double()
    if kind == "ode":
        shape = sde_lp_shape(inp)
        return sample, torch.zeros(shape, dtype=torch.float64)
    return sample, Torch64.log_prob(sample, mean, std, convention, inp["reduce"], inp["patch_size"])


def sde_lp_shape(inp):
    x = inp["x_t"]
    if inp["reduce"] == "tokens":
        p = inp["patch_size"]
        return (x.shape[0], (x.shape[2] // p) * (x.shape[3] // p))
    return (x.shape[0],)


def run_step(kind, inp, convention, backend, **params):
    with torch.no_grad():
        return sde_step_with_logprob(
            kind, inp["x_t"], inp["v"], inp["t"], inp["s"], inp["noise"], convention=convention,
            reduce=inp["reduce"], patch_size=inp["patch_size"], backend=backend, **params,
        )  # fmt: skip


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS, ids=DEVICE_BACKEND_IDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("convention", ["gaussian", "cps"])
@pytest.mark.parametrize("kind", KINDS + ["ode"])
def test_step_matches_float64(kind, convention, case, device, backend):
    inp = make_inputs(kind, case, device)
    sample, log_prob = run_step(kind, inp, convention, backend)
    ref_sample, ref_lp = reference_step64(kind, inp, convention)
    assert sample.dtype == torch.float32 and log_prob.dtype == torch.float32
    assert sample.shape == inp["x_t"].shape and log_prob.shape == ref_lp.shape
    assert_matches64(sample.cpu(), ref_sample.cpu(), what="sample")
    if kind == "ode":
        assert torch.equal(log_prob, torch.zeros_like(log_prob))
    else:
        assert_matches64(log_prob.cpu(), ref_lp.cpu(), what="log_prob")


@pytest.mark.parametrize("device,backend", FUSED_BACKENDS, ids=FUSED_BACKEND_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["mean_prime", "tokens_p2"])
@pytest.mark.parametrize("kind", KINDS)
def test_step_low_precision_no_worse_than_eager(kind, case, dtype, device, backend):
    inp = make_inputs(kind, case, device, dtype)
    sample, log_prob = run_step(kind, inp, "gaussian", backend)
    eager_sample, eager_lp = run_step(kind, inp, "gaussian", "torch")
    ref_sample, ref_lp = reference_step64(kind, inp, "gaussian")
    assert sample.dtype == torch.float32 and log_prob.dtype == torch.float32
    assert_no_worse(sample, eager_sample, ref_sample, "sample")
    assert_no_worse(log_prob, eager_lp, ref_lp, "log_prob")


# ----------------------------------------------------------------------------------------------------
# sde_logprob (forward and gradients)


def reference_logprob64(kind, inp, convention, with_kl, **params):
    v = inp["v"].double().requires_grad_()
    v_ref = inp["v_ref"].double().requires_grad_() if with_kl else None
    mean, std = Torch64.mean(kind, inp["x_t"], v, inp["t"], inp["s"], **params)
    lp = Torch64.log_prob(inp["sample"], mean, std, convention, inp["reduce"], inp["patch_size"])
    kl = None
    if with_kl:
        mean_ref, _ = Torch64.mean(kind, inp["x_t"], v_ref, inp["t"], inp["s"], **params)
        kl = Torch64.kl(kind, mean, mean_ref, inp["t"], inp["s"], **params)
    return lp, kl, v, v_ref


def upstream(lp, kl, seed=1):
    """A loss whose gradient is different for every sample and token (so a broadcasting bug shows)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(lp.shape, generator=g).to(lp.device, lp.dtype)
    loss = (w * lp).sum()
    if kl is not None:
        loss = loss + (torch.randn(kl.shape, generator=g).to(kl.device, kl.dtype) * kl).sum()
    return loss


def run_logprob(kind, inp, convention, backend, with_kl, **params):
    v = inp["v"].detach().clone().requires_grad_()  # clone() keeps a transposed view's strides
    v_ref = inp["v_ref"].detach().clone().requires_grad_() if with_kl else None
    lp, kl = sde_logprob(
        kind, inp["x_t"], v, inp["t"], inp["s"], inp["sample"], v_ref, convention=convention,
        reduce=inp["reduce"], patch_size=inp["patch_size"], backend=backend, **params,
    )  # fmt: skip
    upstream(lp, kl).backward()
    return lp.detach(), None if kl is None else kl.detach(), v.grad, None if v_ref is None else v_ref.grad


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS, ids=DEVICE_BACKEND_IDS)
@pytest.mark.parametrize("with_kl", [False, True], ids=["lp", "lp_kl"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("convention", ["gaussian", "cps"])
@pytest.mark.parametrize("kind", KINDS)
def test_logprob_matches_float64(kind, convention, case, with_kl, device, backend):
    inp = make_inputs(kind, case, device)
    lp, kl, grad_v, grad_v_ref = run_logprob(kind, inp, convention, backend, with_kl)
    ref_lp, ref_kl, v64, v_ref64 = reference_logprob64(kind, inp, convention, with_kl)
    upstream(ref_lp, ref_kl).backward()
    assert lp.dtype == torch.float32 and lp.shape == ref_lp.shape
    assert_matches64(lp.cpu(), ref_lp.detach().cpu(), what="log_prob")
    assert grad_v.shape == inp["v"].shape and grad_v.dtype == inp["v"].dtype
    assert_matches64(grad_v.cpu(), v64.grad.cpu(), what="grad_v")
    if with_kl:
        assert kl.dtype == torch.float32 and kl.shape == (inp["x_t"].shape[0],)
        assert_matches64(kl.cpu(), ref_kl.detach().cpu(), what="kl")
        assert_matches64(grad_v_ref.cpu(), v_ref64.grad.cpu(), what="grad_v_ref")
    else:
        assert kl is None


@pytest.mark.parametrize("device,backend", FUSED_BACKENDS, ids=FUSED_BACKEND_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["mean_prime", "tokens_p2"])
@pytest.mark.parametrize("kind", KINDS)
def test_logprob_low_precision_no_worse_than_eager(kind, case, dtype, device, backend):
    inp = make_inputs(kind, case, device, dtype)
    lp, kl, grad_v, grad_v_ref = run_logprob(kind, inp, "gaussian", backend, True)
    e_lp, e_kl, e_grad_v, e_grad_v_ref = run_logprob(kind, inp, "gaussian", "torch", True)
    ref_lp, ref_kl, v64, v_ref64 = reference_logprob64(kind, inp, "gaussian", True)
    upstream(ref_lp, ref_kl).backward()
    assert grad_v.dtype == dtype and grad_v_ref.dtype == dtype
    assert_no_worse(lp, e_lp, ref_lp.detach(), "log_prob")
    assert_no_worse(kl, e_kl, ref_kl.detach(), "kl")
    assert_no_worse(grad_v, e_grad_v, v64.grad, "grad_v")
    assert_no_worse(grad_v_ref, e_grad_v_ref, v_ref64.grad, "grad_v_ref")


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS, ids=DEVICE_BACKEND_IDS)
def test_logprob_mixed_dtypes(device, backend):
    """The trainer's case: stored x_t and sample in float32, v and v_ref from a bf16 model."""
    inp = make_inputs("ddim", "tokens_p2", device)
    inp["v"], inp["v_ref"] = inp["v"].bfloat16(), inp["v_ref"].bfloat16()
    lp, kl, grad_v, grad_v_ref = run_logprob("ddim", inp, "gaussian", backend, True)
    e_lp, e_kl, e_grad_v, e_grad_v_ref = run_logprob("ddim", inp, "gaussian", "torch", True)
    ref_lp, ref_kl, v64, v_ref64 = reference_logprob64("ddim", inp, "gaussian", True)
    upstream(ref_lp, ref_kl).backward()
    assert grad_v.dtype == torch.bfloat16
    assert_matches64(lp, ref_lp.detach(), what="log_prob")
    assert_matches64(kl, ref_kl.detach(), what="kl")
    if backend != "torch":  # the torch backend is the eager code these gradients are measured against
        assert_no_worse(grad_v, e_grad_v, v64.grad, "grad_v")
        assert_no_worse(grad_v_ref, e_grad_v_ref, v_ref64.grad, "grad_v_ref")


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS, ids=DEVICE_BACKEND_IDS)
def test_gradient_of_kl_alone_and_of_log_prob_alone(device, backend):
    """Only one output in the loss: the other's gradient is absent (None), not garbage."""
    inp = make_inputs("flow_sde", "mean_prime", device)
    for use in ("lp", "kl"):
        v = inp["v"].clone().requires_grad_()
        lp, kl = sde_logprob("flow_sde", inp["x_t"], v, inp["t"], inp["s"], inp["sample"], inp["v_ref"],
                             backend=backend)  # fmt: skip
        (lp if use == "lp" else kl).sum().backward()
        v64 = inp["v"].double().requires_grad_()
        mean, std = Torch64.mean("flow_sde", inp["x_t"], v64, inp["t"], inp["s"])
        mean_ref, _ = Torch64.mean("flow_sde", inp["x_t"], inp["v_ref"], inp["t"], inp["s"])
        ref = Torch64.log_prob(inp["sample"], mean, std, "gaussian", "mean", None) if use == "lp" else Torch64.kl(
            "flow_sde", mean, mean_ref, inp["t"], inp["s"]
        )
        ref.sum().backward()
        assert_matches64(v.grad.cpu(), v64.grad.cpu(), what=f"grad_v ({use} only)")


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS, ids=DEVICE_BACKEND_IDS)
@pytest.mark.parametrize("update", ["no_grad", "grad", "grad_kl"])
@pytest.mark.parametrize("convention", ["gaussian", "cps"])
@pytest.mark.parametrize("case", ["mean_prime", "sum_multiblock", "tokens_p2"])
@pytest.mark.parametrize("kind", KINDS)
def test_on_policy_log_prob_is_bitwise_the_rollouts(kind, case, convention, update, device, backend):
    """The training side recomputes the rollout's log-prob exactly, as the update calls it (with a
    gradient, and with the KL to the reference when optim.beta > 0): the PPO ratio starts at 1."""
    inp = make_inputs(kind, case, device)
    sample, lp_old = run_step(kind, inp, convention, backend)
    v = inp["v"].detach().clone().requires_grad_(update != "no_grad")
    v_ref = inp["v_ref"] if update == "grad_kl" else None
    with torch.set_grad_enabled(update != "no_grad"):
        lp_new, _ = sde_logprob(kind, inp["x_t"], v, inp["t"], inp["s"], sample, v_ref, convention=convention,
                                reduce=inp["reduce"], patch_size=inp["patch_size"], backend=backend)  # fmt: skip
    assert torch.equal(lp_new.detach(), lp_old)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS, ids=DEVICE_BACKEND_IDS)
def test_deterministic(device, backend):
    inp = make_inputs("ddim", "sum_multiblock", device)
    first = run_logprob("ddim", inp, "gaussian", backend, True)
    second = run_logprob("ddim", inp, "gaussian", backend, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_no_grad_forward_equals_grad_forward():
    """With or without autograd, the forward is the same numbers (cpp saves residuals only with grad)."""
    inp = make_inputs("cps", "tokens_p2")
    for backend in ("cpp", "triton"):
        with torch.no_grad():
            lp0, kl0 = sde_logprob("cps", inp["x_t"], inp["v"], inp["t"], inp["s"], inp["sample"], inp["v_ref"],
                                   reduce="tokens", patch_size=2, backend=backend)  # fmt: skip
        lp1, kl1, _, _ = run_logprob("cps", inp, "gaussian", backend, True)
        assert torch.equal(lp0, lp1) and torch.equal(kl0, kl1)


# ----------------------------------------------------------------------------------------------------
# errors, dispatch, torch.compile


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_errors_name_the_problem(backend):
    inp = make_inputs("ddim", "mean_prime")
    x, v, smp = inp["x_t"], inp["v"], inp["sample"]
    # ddim at t = 1 has std 0; the step is named by its times, and by its samples for per-sample times
    with pytest.raises(ValueError, match=r"deterministic step \(std = 0 at t = 1 -> s = 0.9\): "):
        sde_logprob("ddim", x, v, 1.0, 0.9, smp, backend=backend)
    with pytest.raises(ValueError, match=r"deterministic step \(std = 0\) at sample 1 of 3 \(t = 1 -> s = 0.9\): "):
        sde_logprob("ddim", x, v, torch.tensor([0.6, 1.0, 0.5]), torch.tensor([0.4, 0.9, 0.3]), smp, backend=backend)
    first = r"\(std = 0\) at samples 0, 2 of 3 \(the first at t = 1 -> s = 0.9\): "
    with pytest.raises(ValueError, match=first), torch.no_grad():
        sde_step_with_logprob("ddim", x, v, torch.tensor([1.0, 0.6, 0.5]), torch.tensor([0.9, 0.4, 0.0]),
                              inp["noise"], backend=backend)  # fmt: skip
    with pytest.raises(ValueError, match="deterministic step"):
        with torch.no_grad():
            sde_step_with_logprob("ddim", x, v, 1.0, 0.9, inp["noise"], backend=backend)
    with pytest.raises(ValueError, match="'ode' step is deterministic"):
        sde_logprob("ode", x, v, 0.5, 0.4, smp, backend=backend)
    # the cps convention's log-prob needs no std, but the KL to the reference divides by it
    for kind, t, s in (("cps", 0.5, 0.0), ("ddim", 1.0, 0.9)):
        with pytest.raises(ValueError, match="KL to the reference of a deterministic step"):
            sde_logprob(kind, x, v, t, s, smp, v_ref=v, convention="cps", backend=backend)
        sde_logprob(kind, x, v, t, s, smp, convention="cps", backend=backend)  # without v_ref: fine
    with pytest.raises(ValueError, match="same shape"):
        sde_logprob("ddim", x, v[:, :2], 0.5, 0.4, smp, backend=backend)
    with pytest.raises(ValueError, match="patch_size"):
        sde_logprob("ddim", x, v, 0.5, 0.4, smp, reduce="tokens", backend=backend)
    with pytest.raises(ValueError, match="not divisible"):
        sde_logprob("ddim", x, v, 0.5, 0.4, smp, reduce="tokens", patch_size=2, backend=backend)
    with pytest.raises(ValueError, match="unknown sampler"):
        sde_logprob("euler", x, v, 0.5, 0.4, smp, backend=backend)
    with pytest.raises(TypeError, match="v must be a torch.Tensor, got list"):
        sde_logprob("ddim", x, v.tolist(), 0.5, 0.4, smp, backend=backend)
    with pytest.raises(TypeError, match="sample must be a torch.Tensor, got NoneType"):
        sde_logprob("ddim", x, v, 0.5, 0.4, None, backend=backend)
    # complex and bool tensors were read as their real part and as 0/1, without a word
    with pytest.raises(TypeError, match=r"^v must hold real numbers .*, got torch.complex64$"):
        sde_logprob("ddim", x, v.to(torch.complex64), 0.5, 0.4, smp, backend=backend)
    with pytest.raises(TypeError, match=r"^noise must hold real numbers .*, got torch.bool$"), torch.no_grad():
        sde_step_with_logprob("ddim", x, v, 0.5, 0.4, inp["noise"] > 0, backend=backend)
    # the C++ kernels take patches of up to 1024: every backend refuses a wider one, not that one alone
    wide = torch.zeros(1, 1, 1026, 1026)
    with pytest.raises(ValueError, match="^patch_size must be at most 1024, the widest the CPU kernels take .*got 1026$"):
        sde_logprob("ddim", wide, wide, 0.5, 0.4, wide, reduce="tokens", patch_size=1026, backend=backend)
    # a step whose std is 0 refuses its Gaussian log-prob first, whether or not a KL is asked for
    with pytest.raises(ValueError, match="log_prob of a deterministic step"):
        sde_logprob("ddim", x, v, 1.0, 0.9, smp, v_ref=v, backend=backend)
    with pytest.raises(TypeError, match="noise must be a torch.Tensor, got ndarray"):
        with torch.no_grad():
            sde_step_with_logprob("ddim", x, v, 0.5, 0.4, inp["noise"].numpy(), backend=backend)
    with pytest.raises(TypeError, match="takes parameters"):
        sde_logprob("ddim", x, v, 0.5, 0.4, smp, noise_level=0.3, backend=backend)
    with pytest.raises(ValueError, match=r"shape \[batch\]"):
        sde_logprob("ddim", x, v, torch.tensor([0.5, 0.6]), 0.4, smp, backend=backend)
    with pytest.raises(RuntimeError, match="w.r.t. v and v_ref only"):
        sde_logprob("ddim", x.clone().requires_grad_(), v, 0.5, 0.4, smp, backend=backend)
    with pytest.raises(RuntimeError, match="no gradient"):
        sde_step_with_logprob("ddim", x, v.clone().requires_grad_(), 0.5, 0.4, inp["noise"], backend=backend)
    # meta tensors hold no times to read and no std to check: named, not "Cannot copy out of meta tensor"
    with pytest.raises(ValueError, match="^x_t, v, sample are on the meta device: the SDE ops read the times' values"):
        sde_logprob("ddim", x.to("meta"), v.to("meta"), 0.5, 0.4, smp.to("meta"), backend=backend)
    with pytest.raises(ValueError, match="^t is on the meta device"), torch.no_grad():
        sde_step_with_logprob("ddim", x, v, torch.full((3,), 0.5, device="meta"), 0.4, inp["noise"], backend=backend)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_a_numpy_integer_patch_size_works_on_every_backend(backend):
    import numpy as np

    inp = make_inputs("ddim", "mean_prime")
    x, v, smp = inp["x_t"], inp["v"], inp["sample"]
    if x.shape[-1] % 2 or x.shape[-2] % 2:
        x, v, smp = (u[..., :2, :2].contiguous() for u in (x, v, smp))
    got = sde_logprob("ddim", x, v, 0.5, 0.4, smp, reduce="tokens", patch_size=np.int64(2), backend=backend)
    want = sde_logprob("ddim", x, v, 0.5, 0.4, smp, reduce="tokens", patch_size=2, backend=backend)
    assert torch.equal(got.log_prob, want.log_prob)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_bad_times_parameters_and_gradients_are_named_on_every_backend(backend):
    """What the kernels cannot give is refused, alike on every backend: times that do not go down
    within [0, 1] (they gave NaN, or finite nonsense, or 'deterministic step'), sampler parameters
    out of range, a patch size that is no whole number, and gradients the fused ops do not carry
    (to the noise, to the times: the torch backend gave them, the kernels silently did not)."""
    inp = make_inputs("ddim", "mean_prime")
    x, v, smp, noise = inp["x_t"], inp["v"], inp["sample"], inp["noise"]
    for kind, t, s, message in [
        ("flow_sde", 0.5, 0.7, "a step goes from t down to s < t, got t = 0.5 and s = 0.7"),
        ("ddim", 0.5, 0.5, "a step goes from t down to s < t"),
        ("ddim", 1.2, 0.9, r"t must lie in \[0, 1\] \(1 is noise, 0 is data\), got t = 1.2$"),  # no "(sample 0)"
        ("ddim", torch.tensor([0.5, 1.2, 0.5]), 0.4, r"got t = 1.2 \(sample 1\)$"),
        ("ddim", 0.5, 0.5, "got t = 0.5 and s = 0.5$"),
        ("ddim", 0.5, -0.1, r"s must lie in \[0, 1\]"),
        ("cps", float("nan"), 0.4, "t holds NaN or inf"),
        ("cps", torch.tensor([0.6, 0.7, float("inf")]), 0.4, "t holds NaN or inf"),
        ("cps", None, 0.4, "t must be a float or a tensor of shape"),
    ]:
        with pytest.raises(ValueError, match=message):
            sde_logprob(kind, x, v, t, s, smp, backend=backend)
        with pytest.raises(ValueError, match=message), torch.no_grad():
            sde_step_with_logprob(kind, x, v, t, s, noise, backend=backend)
    for kind, params, message in [
        ("ddim", {"eta": 1.5}, r"eta must be in \[0, 1\], got 1.5"),
        ("ddim", {"eta": -0.5}, r"eta must be in \[0, 1\], got -0.5"),
        ("ddim", {"eta": float("nan")}, "eta must be in"),
        ("ddim", {"eta": None}, "eta must be a number, got None"),
        ("cps", {"noise_level": 2.0}, r"noise_level must be in \[0, 1\], got 2.0"),
        ("flow_sde", {"noise_level": -0.7}, r"noise_level must be a finite number >= 0, got -0.7"),
        ("flow_sde", {"noise_level": float("inf")}, r"noise_level must be a finite number >= 0, got inf"),
    ]:
        with pytest.raises(ValueError, match=message):
            sde_logprob(kind, x, v, 0.5, 0.4, smp, backend=backend, **params)
    for patch in (2.0, "2", True):
        with pytest.raises(ValueError, match=rf"patch_size.*a whole number >= 1, got {patch!r}"):
            sde_logprob("ddim", x[:, :, :6, :10], v[:, :, :6, :10], 0.5, 0.4, smp[:, :, :6, :10],
                        reduce="tokens", patch_size=patch, backend=backend)  # fmt: skip
    with pytest.raises(RuntimeError, match="the rollout op and has no gradient, but noise requires one"):
        sde_step_with_logprob("ddim", x, v, 0.5, 0.4, noise.clone().requires_grad_(), backend=backend)
    with pytest.raises(RuntimeError, match="has no gradient, but x_t and v require one"):
        sde_step_with_logprob("ddim", x.clone().requires_grad_(), v.clone().requires_grad_(), 0.5, 0.4, noise,
                              backend=backend)  # fmt: skip
    with pytest.raises(RuntimeError, match="w.r.t. v and v_ref only, but t requires grad; .* the times t, s are stored"):
        sde_logprob("ddim", x, v.clone().requires_grad_(), torch.full((3,), 0.5, requires_grad=True), 0.4, smp,
                    backend=backend)  # fmt: skip
    with pytest.raises(RuntimeError, match="w.r.t. v and v_ref only, but sample requires grad"):
        sde_logprob("ddim", x, v, 0.5, 0.4, smp.clone().requires_grad_(), backend=backend)


@pytest.mark.parametrize("backend", ["cpp", "triton"])  # the torch backend builds no table
def test_a_rollout_under_inference_mode_leaves_training_at_the_same_times_working(backend):
    """The fused backends' coefficient table is cached by times: one first built under
    torch.inference_mode() (a rollout there) must not be an inference tensor, which a later training
    call at the same times could not save for backward."""
    dispatch._cached_table.cache_clear()
    inp = make_inputs("ddim", "mean_prime")
    x, v, noise = inp["x_t"], inp["v"], inp["noise"]
    t, s = 0.7173, 0.5123  # times no other test uses: this call builds the table
    with torch.inference_mode():
        sample, _ = sde_step_with_logprob("ddim", x, v, t, s, noise, backend=backend)
    sample = sample.clone()
    v = v.clone().requires_grad_()
    log_prob, _ = sde_logprob("ddim", x, v, t, s, sample, backend=backend)
    log_prob.sum().backward()
    expected = torch.autograd.grad(sde_logprob("ddim", x, v, t, s, sample, backend="torch").log_prob.sum(), v)[0]
    torch.testing.assert_close(v.grad, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_the_kernels_refuse_a_second_derivative(backend):
    """The kernels' backward is not differentiable: asking for a second derivative is an error (it was
    a silent zero), while the torch backend gives it."""
    inp = make_inputs("ddim", "mean_prime")
    v = inp["v"].clone().requires_grad_()
    lp, _ = sde_logprob("ddim", inp["x_t"], v, inp["t"], inp["s"], inp["sample"], backend=backend)
    with pytest.raises(RuntimeError, match="the fused sde_logprob has no second derivative"):
        (grad,) = torch.autograd.grad(lp.sum(), v, create_graph=True)
        grad.pow(2).sum().backward()
    lp, _ = sde_logprob("ddim", inp["x_t"], v, inp["t"], inp["s"], inp["sample"], backend="torch")
    (grad,) = torch.autograd.grad(lp.sum(), v, create_graph=True)
    (second,) = torch.autograd.grad(grad.pow(2).sum(), v)
    assert second.abs().sum() > 0


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf - inf
def test_one_value_per_sample_and_infinite_velocities_match_the_reference(backend):
    """[B] inputs (one value per sample) give [B] log-probs as the kernels always did: the reference
    averaged over the batch. An ode step with an infinite velocity gives what the reference gives
    (the kernels multiplied the velocity by std = 0 as its noise: NaN). A sample with no elements
    is an error."""
    g = torch.Generator().manual_seed(4)
    x, v, smp, v_ref = (torch.randn(5, generator=g) for _ in range(4))
    for torch_out, kernel_out in zip(sde_logprob("ddim", x, v, 0.5, 0.4, smp, v_ref, backend="torch"),
                                     sde_logprob("ddim", x, v, 0.5, 0.4, smp, v_ref, backend=backend)):  # fmt: skip
        assert torch_out.shape == kernel_out.shape == (5,)
        assert_matches64(kernel_out, torch_out.double(), what="[B] input")
    inp = make_inputs("ddim", "mean_prime")
    v = inp["v"].clone()
    v[1, 2, 3, 4] = float("inf")
    with torch.no_grad():
        ref = sde_step_with_logprob("ode", inp["x_t"], v, 0.5, 0.4, backend="torch")
        out = sde_step_with_logprob("ode", inp["x_t"], v, 0.5, 0.4, backend=backend)
    assert out.sample[1, 2, 3, 4] == ref.sample[1, 2, 3, 4] == float("-inf")
    assert torch.equal(out.sample.isnan(), ref.sample.isnan()) and not out.sample.isnan().any()
    empty = torch.zeros(3, 0, 4, 4)
    with pytest.raises(ValueError, match=r"x_t has no elements per sample: shape \(3, 0, 4, 4\)"):
        sde_logprob("ddim", empty, empty, 0.5, 0.4, empty, backend=backend)


def test_sampler_parameters_reach_the_kernels():
    inp = make_inputs("ddim", "mean_prime")
    for kind, params in (("ddim", {"eta": 0.5}), ("cps", {"noise_level": 0.4}), ("flow_sde", {"noise_level": 0.9})):
        ref, _ = Torch64.mean(kind, inp["x_t"], inp["v"], inp["t"], inp["s"], **params)
        for backend in ("torch", "cpp", "triton"):
            with torch.no_grad():
                out, _ = sde_step_with_logprob(kind, inp["x_t"], inp["v"], inp["t"], inp["s"],
                                               torch.zeros_like(inp["x_t"]), backend=backend, **params)  # fmt: skip
            assert_matches64(out, ref, what=f"{kind} {params} {backend}")


def test_noise_drawn_from_generator_like_the_reference():
    inp = make_inputs("cps", "mean_prime")
    outs = []
    for backend in ("torch", "cpp", "triton"):
        with torch.no_grad():
            outs.append(sde_step_with_logprob("cps", inp["x_t"], inp["v"], 0.6, 0.5, None,
                                              generator=torch.Generator().manual_seed(3), backend=backend))  # fmt: skip
    for sample, lp in outs[1:]:
        assert_matches64(sample, outs[0].sample.double(), what="sample")
        assert_matches64(lp, outs[0].log_prob.double(), what="log_prob")


def test_select_backend(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert select_backend("cpu") == ("cpp" if cpp_backend.AVAILABLE else "torch")
    assert select_backend("cpu", "triton") == "triton"
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert select_backend("cpu") == "torch"
    # backend= wins over the environment
    assert select_backend("cpu", "cpp") == ("cpp" if cpp_backend.AVAILABLE else "torch")
    assert select_backend("cpu", "triton") == "triton"
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda_magic")
    with pytest.raises(ValueError, match="STEPFAST_KERNELS"):
        select_backend("cpu")
    monkeypatch.delenv(dispatch.ENV_VAR)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        select_backend("cpu", "numba")
    with pytest.raises(ValueError, match="runs on CPU tensors"):
        select_backend("cuda", "cpp")
    # the defaults by device (no GPU needed to choose): triton on CUDA when it imports, else torch
    monkeypatch.setattr(dispatch, "_triton_import_error", lambda: None)
    assert select_backend("cuda") == "triton" and select_backend("meta") == "torch"
    monkeypatch.setattr(dispatch, "_triton_import_error", lambda: "No module named 'triton'")
    dispatch._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match=r"triton is not importable \(No module named 'triton'\); the SDE ops on CUDA"):
        assert select_backend("cuda") == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert select_backend("cuda") == "torch"


def test_the_readmes_kernel_example_runs_and_prints_what_it_says(capsys):
    """The code block under "Fused kernels" in docs/kernels.md, run as it stands; its last line's
    comment is what it prints."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "kernels.md").read_text()
    code = re.search(r"## Fused kernels\n\n```python\n(.*?)```", doc, re.S).group(1)
    exec(compile(code, "docs/kernels.md (Fused kernels)", "exec"), {})
    expected = code.strip().splitlines()[-1].split("#")[-1].strip()
    if not cpp_backend.AVAILABLE:
        expected = expected.replace("cpp", "torch", 1)
    assert capsys.readouterr().out.strip() == expected


def test_env_var_forces_the_backend(monkeypatch):
    inp = make_inputs("ddim", "mean_prime")
    seen = []
    monkeypatch.setattr(dispatch.reference, "sde_logprob", lambda *a, **k: seen.append("torch") or (None, None))
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    sde_logprob("ddim", inp["x_t"], inp["v"], inp["t"], inp["s"], inp["sample"])
    assert seen == ["torch"]


def test_cpp_backend_falls_back_to_torch_once_when_not_built(monkeypatch):
    monkeypatch.setattr(cpp_backend, "AVAILABLE", False)
    monkeypatch.setattr(cpp_backend, "REASON", "ImportError: test")
    dispatch._warn_once.cache_clear()
    inp = make_inputs("ddim", "mean_prime")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            lp, _ = sde_logprob("ddim", inp["x_t"], inp["v"], inp["t"], inp["s"], inp["sample"], backend="cpp")
    assert sum("not available" in str(w.message) for w in caught) == 1
    ref, _ = sde_logprob("ddim", inp["x_t"], inp["v"], inp["t"], inp["s"], inp["sample"], backend="torch")
    assert torch.equal(lp, ref)
    dispatch._warn_once.cache_clear()


def test_package_names_are_the_ops_after_every_backend_ran():
    """kernels/sde_logprob.py is also the name of a function of the package: the function must win."""
    import stepfast.kernels as kernels

    inp = make_inputs("ddim", "mean_prime")
    for backend in ("torch", "cpp", "triton"):
        sde_logprob("ddim", inp["x_t"], inp["v"], inp["t"], inp["s"], inp["sample"], backend=backend)
    assert kernels.sde_logprob is sde_logprob and kernels.sde_step_with_logprob is sde_step_with_logprob


def test_top_level_kernels_import_registers_nothing():
    """From the repository root, `import kernels` finds this folder first (transformers imports the
    Hugging Face kernels package by that name): that must not register the torch.library ops a second
    time, and must give transformers the Hugging Face package where it is installed (transformers 5
    requires it: its activations module imports names from it) and no look-alike where it is not."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, warnings\n"
        "warnings.simplefilter('error')\n"
        "import stepfast.kernels\n"
        "import kernels\n"
        "assert kernels is not stepfast.kernels and not hasattr(kernels, 'sde_logprob')\n"
        "for name in ('sde_logprob', 'dispatch'):\n"  # the Triton op module, the ops registered again
        "    try:\n"
        "        exec(f'from kernels import {name}')\n"
        "    except ImportError:\n"
        "        pass\n"
        "    else:\n"
        "        raise AssertionError(name)\n"
        "import importlib.metadata, transformers.activations, transformers.utils.import_utils as u\n"
        "installed = bool(importlib.metadata.distributions(name='kernels'))\n"
        "assert u.is_kernels_available() == installed, installed\n"
        "print('ok')"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def _import_kernels_from_the_root(*path: str, flags: tuple[str, ...] = ()) -> list[str]:
    """What `import kernels` gives with the repository root first on sys.path, then `path`: its
    file (or "empty") and its MARK."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = (f"import sys; sys.path[:0] = {[str(root), *path]!r}; import kernels; "
            "print(kernels.__file__ if kernels.__path__ else 'empty'); print(getattr(kernels, 'MARK', '-'))")  # fmt: skip
    out = subprocess.run([sys.executable, *flags, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


def test_the_kernels_folder_stands_aside_for_another_package_named_kernels(tmp_path):
    """Under the name `kernels` the folder loads the package of that name from the rest of sys.path
    in its place (before, transformers' import of the Hugging Face one failed from the repository
    root: "cannot import name 'CUDAProperties' from 'kernels'", and no pipeline loaded there)."""
    other = tmp_path / "kernels"
    other.mkdir()
    (other / "__init__.py").write_text("MARK = 'the other package'\n")
    assert _import_kernels_from_the_root(str(tmp_path)) == [str(other / "__init__.py"), "the other package"]
    # no other package named kernels (-S: no site-packages): the folder's empty package
    assert _import_kernels_from_the_root(flags=("-S",)) == ["empty", "-"]


def test_import_needs_no_gpu():
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from stepfast.kernels import sde_step_with_logprob, sde_logprob\n"
        "x = torch.randn(2, 3, 4, 4)\n"
        "sde_logprob('ddim', x, x, 0.5, 0.4, x, backend='triton')\n"
        "from stepfast.kernels import sde_logprob as again\n"
        "assert again is sde_logprob and callable(again)\n"
        "print('ok')"
    )
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_backward_twice_with_retain_graph(backend):
    """The cpp backward turns its saved residuals into the gradient in place; a second backward through
    the same graph (retain_graph=True) must still be right."""
    inp = make_inputs("ddim", "tokens_p2")
    v, v_ref = inp["v"].clone().requires_grad_(), inp["v_ref"].clone().requires_grad_()
    lp, kl = sde_logprob("ddim", inp["x_t"], v, inp["t"], inp["s"], inp["sample"], v_ref, reduce="tokens",
                         patch_size=2, backend=backend)  # fmt: skip
    loss = upstream(lp, kl)
    loss.backward(retain_graph=True)
    first = (v.grad.clone(), v_ref.grad.clone())
    loss.backward()
    assert torch.equal(v.grad, 2 * first[0]) and torch.equal(v_ref.grad, 2 * first[1])  # g + g = 2g exactly


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_a_second_backward_after_an_input_changed_in_place_is_an_error_or_the_same(backend):
    """The cpp backward spends its saved residuals on the first gradient, and a second backward
    (retain_graph=True) recomputes them from the inputs: with `sample` changed in place in between (a
    rollout buffer reused) it gave another gradient without a word. Now it is an error naming the
    input, as autograd's for Triton's saved inputs; the torch backend saved what it needs and gives
    the same gradient again."""
    inp = make_inputs("ddim", "tokens_p2")
    sample = inp["sample"].clone()
    v = inp["v"].clone().requires_grad_()
    lp, kl = sde_logprob("ddim", inp["x_t"], v, inp["t"], inp["s"], sample, inp["v_ref"], reduce="tokens",
                         patch_size=2, backend=backend)  # fmt: skip
    loss = upstream(lp, kl)
    first = torch.autograd.grad(loss, v, retain_graph=True)[0]
    sample.add_(1.0)
    if backend == "torch":
        assert torch.equal(torch.autograd.grad(loss, v)[0], first)
        return
    named = "^sample of stepfast's sde_logprob was modified by an inplace operation after its forward"
    with pytest.raises(RuntimeError, match=named if backend == "cpp" else "modified by an inplace operation"):
        torch.autograd.grad(loss, v)


@pytest.mark.skipif(not cpp_backend.AVAILABLE, reason="stepfast._C not built")
def test_cpp_ops_pass_opcheck():
    """Schema, fake (meta) kernels and the registered autograd formula, as torch.compile needs them."""
    inp = make_inputs("flow_sde", "tokens_p2")
    from stepfast.kernels.coefficients import step_coefficients

    x, smp = inp["x_t"], inp["sample"]
    coef = step_coefficients("flow_sde", inp["t"], inp["s"], 3, x[0].numel(), 5 * 4, "gaussian", "tokens", x.device)
    # bf16 velocities: the backward is the functional op. With float32 velocities the eager backward
    # turns the op's residual outputs into the gradients in place (they are the op's workspace, never
    # returned by stepfast.kernels), which opcheck's eager-vs-AOT comparison of outputs sees as a
    # difference; that case runs the other checks, and test_cpp_op_under_torch_compile compares it.
    for dtype, utils in ((torch.bfloat16, None), (torch.float32, ("test_schema", "test_autograd_registration",
                                                                  "test_faketensor"))):  # fmt: skip
        v = inp["v"].to(dtype).requires_grad_()
        vr = inp["v_ref"].to(dtype).requires_grad_()
        kw = {} if utils is None else {"test_utils": utils}
        for patch in (0, 2):
            torch.library.opcheck(torch.ops.stepfast.sde_logprob.default, (x, v, smp, vr, coef, patch, True), **kw)
            torch.library.opcheck(torch.ops.stepfast.sde_logprob.default, (x, v, smp, None, coef, patch, True), **kw)
    for patch in (0, 2):
        torch.library.opcheck(torch.ops.stepfast.sde_step.default, (x, inp["v"], inp["noise"], coef, patch, True))
        _, _, res, dv = torch.ops.stepfast.sde_logprob(x, inp["v"], smp, inp["v_ref"], coef, patch, True)
        g_lp = torch.randn(3, 35) if patch else torch.randn(3)
        args = (res, dv, coef, g_lp, torch.randn(3), patch, True)
        torch.library.opcheck(torch.ops.stepfast.sde_logprob_backward_.default, args)


@pytest.mark.skipif(not cpp_backend.AVAILABLE, reason="stepfast._C not built")
def test_cpp_op_under_torch_compile():
    inp = make_inputs("ddim", "tokens_p2")
    w_lp, w_kl = torch.randn(3, 35), torch.randn(3)

    def loss(v, v_ref):
        lp, kl = sde_logprob("ddim", inp["x_t"], v, inp["t"], inp["s"], inp["sample"], v_ref, reduce="tokens",
                             patch_size=2, backend="cpp")  # fmt: skip
        return (w_lp * lp).sum() + (w_kl * kl).sum()

    grads = []
    for fn in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        v, v_ref = inp["v"].clone().requires_grad_(), inp["v_ref"].clone().requires_grad_()
        fn(v, v_ref).backward()
        grads.append((v.grad, v_ref.grad))
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_the_kernels_backward_runs_under_activation_checkpointing(backend, reentrant):
    """Checkpointing recomputes its forward under enable_grad inside the backward pass: the kernels'
    refusal of a second derivative must not fire there (only for create_graph=True)."""
    inp = make_inputs("ddim", "mean_prime")
    weight = torch.randn(inp["v"].shape[1:])

    def loss(v):
        lp, _ = sde_logprob("ddim", inp["x_t"], v * weight, inp["t"], inp["s"], inp["sample"], backend=backend)
        return lp.sum()

    grads = []
    for checkpointed in (False, True):
        v = inp["v"].clone().requires_grad_()
        out = torch.utils.checkpoint.checkpoint(loss, v, use_reentrant=reentrant) if checkpointed else loss(v)
        out.backward()
        grads.append(v.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("convention", ["cps", "gaussian"])
def test_the_torch_backend_compiles_whole_with_its_checks(convention):
    """The checks that read values (the times, a std or a KL sigma of 0) are skipped while compiling
    (the fused paths' table is built on the host), so a whole-graph compile of the torch backend
    works, with the Gaussian log-prob and the KL too."""
    inp = make_inputs("cps", "mean_prime")

    def loss(v):
        lp, kl = sde_logprob("cps", inp["x_t"], v, inp["t"], inp["s"], inp["sample"], v_ref=inp["v"] * 0.9,
                             convention=convention, backend="torch")  # fmt: skip
        return lp.sum() + kl.sum()

    grads = []
    for fn in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        v = inp["v"].clone().requires_grad_()
        fn(v).backward()
        grads.append(v.grad)
    torch.testing.assert_close(grads[1], grads[0])


def _ptxas_available() -> bool:
    """ptxas as triton finds it: its NVIDIA backend's bin/, TRITON_PTXAS_PATH or the PATH."""
    import os
    import shutil
    from pathlib import Path

    import triton

    shipped = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return shipped.is_file() or bool(os.environ.get("TRITON_PTXAS_PATH")) or shutil.which("ptxas") is not None


@pytest.mark.skipif(not _ptxas_available(), reason="triton's NVIDIA backend (ptxas) is not installed")
@pytest.mark.parametrize("case", ["mean_prime", "tokens_p3_transposed"])
def test_triton_kernels_compile_for_nvidia_gpus(monkeypatch, case):
    """The compiled Triton path, which the interpreter never takes: every launch the host code makes
    for a rollout step and a training log-prob with KL and its backward (float32 and bfloat16 inputs)
    is compiled to a cubin for sm_80 and sm_90 with the launch's own arguments, constants and options
    (no GPU needed: triton's ptxas). A kernel the compiler rejects fails here, not on the first GPU."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launches = []

    class Recorder:  # what `launcher(kernel, device)[grid](*args, **kwargs)` would have run
        def __init__(self, kernel, device):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

    for module in ("sde_step", "sde_logprob"):
        monkeypatch.setattr(importlib.import_module(f"stepfast.kernels.{module}"), "launcher", Recorder)
    pointer = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
    for dtype in (torch.float32, torch.bfloat16):
        inp = make_inputs("ddim", case)
        x, v, noise = (inp[k].to(dtype) for k in ("x_t", "v", "noise"))
        kw = {"reduce": inp["reduce"], "patch_size": inp["patch_size"], "backend": "triton"}
        sample, _ = sde_step_with_logprob("ddim", x, v, inp["t"], inp["s"], noise, **kw)
        v, v_ref = v.clone().requires_grad_(), inp["v_ref"].to(dtype).requires_grad_()
        lp, kl = sde_logprob("ddim", x, v, inp["t"], inp["s"], sample, v_ref, **kw)
        (lp.sum() + kl.sum()).backward()
    names = sorted({kernel.fn.__name__ for kernel, _, _ in launches})
    assert names == ["_sde_logprob_bwd_kernel", "_sde_logprob_fwd_kernel", "_sde_step_fwd_kernel"]
    for kernel, args, kwargs in launches:
        kwargs = dict(kwargs)
        options = {k: kwargs.pop(k) for k in ("num_warps", "enable_fp_fusion")}
        values = dict(zip([p.name for p in kernel.params], args), **kwargs)
        signature, constants = {}, {}
        for i, param in enumerate(kernel.params):
            value = values[param.name]
            if param.is_constexpr:
                signature[param.name], constants[(i,)] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = pointer[value.dtype]
            elif value is None:  # an unused pointer (no KL, no v_ref gradient)
                signature[param.name] = "*fp32"
            else:
                signature[param.name] = "i32" if abs(value) < 2**31 else "i64"
        for arch in (80, 90):
            compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", arch, 32),
                                      options=options)  # fmt: skip
            assert compiled.asm["cubin"], f"{kernel.fn.__name__} gave no cubin for sm_{arch}"


def test_every_triton_launch_runs_with_its_tensors_gpu_current(monkeypatch):
    """Triton launches on the current CUDA device and stream, not on the device of the tensors it is
    given: each host wrapper launches inside `on_device` of its input's device, checked here for every
    launch (on CPU tensors, whose device it records: which GPU it makes current needs two GPUs to see),
    and `on_device` of a GPU is that GPU's `torch.cuda.device`."""
    import importlib

    from stepfast.kernels.sde_step import on_device

    current, launched = [None], []

    @contextlib.contextmanager
    def recording(device):
        current[0] = device
        try:
            yield
        finally:
            current[0] = None

    class Recorder:
        def __init__(self, kernel, device):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((self.kernel.fn.__name__, current[0]))

    for module in ("sde_step", "sde_logprob"):
        monkeypatch.setattr(importlib.import_module(f"stepfast.kernels.{module}"), "launcher", Recorder)
        monkeypatch.setattr(importlib.import_module(f"stepfast.kernels.{module}"), "on_device", recording)
    inp = make_inputs("ddim", "mean_prime")
    kw = {"reduce": inp["reduce"], "patch_size": inp["patch_size"], "backend": "triton"}
    sample, _ = sde_step_with_logprob("ddim", inp["x_t"], inp["v"], inp["t"], inp["s"], inp["noise"], **kw)
    v, v_ref = inp["v"].clone().requires_grad_(), inp["v_ref"].clone().requires_grad_()
    lp, kl = sde_logprob("ddim", inp["x_t"], v, inp["t"], inp["s"], sample, v_ref, **kw)
    (lp.sum() + kl.sum()).backward()
    assert sorted(launched) == [(name, inp["x_t"].device) for name in
                                ("_sde_logprob_bwd_kernel", "_sde_logprob_fwd_kernel", "_sde_step_fwd_kernel")]
    gpu = on_device(torch.device("cuda", 1))  # made without touching CUDA; entered, it makes GPU 1 current
    assert isinstance(gpu, torch.cuda.device) and gpu.idx == 1
    assert isinstance(on_device(torch.device("cpu")), contextlib.nullcontext)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_times_as_lists_and_arrays_on_every_backend(backend):
    """t and s as a list, a numpy array or a tensor give the same numbers on every backend, to the
    bit (a form converted through float64 first would round differently), and a [B, 1] tensor is
    refused by every one of them alike."""
    inp = make_inputs("ddim", "mean_prime")
    x, v, noise = inp["x_t"], inp["v"], inp["noise"]
    b = x.shape[0]
    t, s = torch.linspace(0.9, 0.7, b), torch.linspace(0.8, 0.6, b)
    expected = sde_step_with_logprob("ddim", x, v, t, s, noise, backend=backend)
    torch.testing.assert_close(expected, sde_step_with_logprob("ddim", x, v, t, s, noise, backend="torch"),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    expected_lp, _ = sde_logprob("ddim", x, v, t, s, expected[0], backend=backend)
    for form in (lambda u: u.tolist(), lambda u: u.numpy()):
        out = sde_step_with_logprob("ddim", x, v, form(t), form(s), noise, backend=backend)
        assert all(torch.equal(a, e) for a, e in zip(out, expected))
        lp, _ = sde_logprob("ddim", x, v, form(t), form(s), out[0], backend=backend)
        assert torch.equal(lp, expected_lp)
    with pytest.raises(ValueError, match=r"shape \[batch\]"):
        sde_step_with_logprob("ddim", x, v, t[:, None], s[:, None], noise, backend=backend)


@pytest.mark.skipif(not cpp_backend.AVAILABLE, reason="stepfast._C not built")
@pytest.mark.skipif(not cpp_backend.AVAILABLE, reason="stepfast._C not built")
def test_cpp_refuses_a_patch_wider_than_its_row_piece():
    """A patch above 1024 elements would leave the C++ kernels' row pieces empty (an endless loop):
    the op itself refuses it, called directly (the dispatcher refuses it first, on every backend)."""
    from stepfast.kernels.coefficients import step_coefficients

    x = torch.zeros(1, 1, 1025, 1025)
    coef = step_coefficients("ddim", 0.8, 0.7, 1, x[0].numel(), 1025**2, "gaussian", "tokens", x.device)
    with pytest.raises(RuntimeError, match="patch_size 1025 is above 1024"):
        torch.ops.stepfast.sde_step(x, x, x, coef, 1025, True)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
@pytest.mark.parametrize("kind, params", [("ddim", {"eta": 0.5}), ("cps", {"noise_level": 0.4}),
                                          ("flow_sde", {"noise_level": 0.9})])  # fmt: skip
def test_sampler_parameters_reach_every_output_against_float64(kind, params, backend):
    """eta and noise_level other than the defaults, on the training op (log-prob, KL, both gradients)
    and the rollout op (sample with real noise, its log-prob), against the float64 reference with the
    same parameters: an op that dropped them would still agree with itself, rollout and update alike."""
    inp = make_inputs(kind, "tokens_p2")
    got = run_logprob(kind, inp, "gaussian", backend, True, **params)
    ref_lp, ref_kl, v64, v_ref64 = reference_logprob64(kind, inp, "gaussian", True, **params)
    upstream(ref_lp, ref_kl).backward()
    for g, want, what in zip(got, (ref_lp, ref_kl, v64.grad, v_ref64.grad), ("log_prob", "kl", "grad_v", "grad_v_ref")):
        assert_matches64(g, want.detach(), what=what)
    sample, step_lp = run_step(kind, inp, "gaussian", backend, **params)
    ref_sample, ref_step_lp = reference_step64(kind, inp, "gaussian", **params)
    assert_matches64(sample, ref_sample, what="sample")
    assert_matches64(step_lp, ref_step_lp, what="step log_prob")


@pytest.mark.skipif(not cpp_backend.AVAILABLE, reason="stepfast._C not built")
@pytest.mark.parametrize("reduce, patch", [("mean", None), ("tokens", 2)])
def test_cpp_threads_give_the_same_bits_as_one_thread(reduce, patch):
    """From 131,072 elements a call the C++ kernels share the work among OpenMP threads (the other
    tests' shapes stay on one): with two threads every output and gradient is bitwise what one thread
    gives, and matches the float64 reference."""
    g = torch.Generator().manual_seed(0)
    shape = (2, 16, 64, 72)  # 147,456 elements
    x, v, noise, v_ref = (torch.randn(shape, generator=g) for _ in range(4))
    inp = {"x_t": x, "v": v, "noise": noise, "v_ref": v_ref, "t": torch.tensor([0.9, 0.6]),
           "s": torch.tensor([0.8, 0.45]), "reduce": reduce, "patch_size": patch}  # fmt: skip
    threads, results = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            inp["sample"], step_lp = run_step("ddim", inp, "gaussian", "cpp")
            results.append([inp["sample"], step_lp, *run_logprob("ddim", inp, "gaussian", "cpp", True)])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)
    ref_lp, ref_kl, v64, v_ref64 = reference_logprob64("ddim", inp, "gaussian", True)
    upstream(ref_lp, ref_kl).backward()
    wanted = (ref_lp, ref_kl, v64.grad, v_ref64.grad)
    for got, want, what in zip(results[1][2:], wanted, ("log_prob", "kl", "grad_v", "grad_v_ref")):
        assert_matches64(got, want.detach(), what=what)


def _lanes_sum(sq, chunk=1024, lanes=32):
    """csrc/sde_common.h's per-sample sum, in numpy float32: each chunk of 1024 elements in 32 lanes
    (lane k adds the elements k mod 32 in order), the lanes folded pairwise, the chunks added in
    float64 in order."""
    import numpy as np

    total = 0.0
    for c0 in range(0, sq.size, chunk):
        part = sq[c0 : c0 + chunk]
        lane = np.zeros(lanes, dtype=np.float32)
        for r0 in range(0, part.size, lanes):
            row = part[r0 : r0 + lanes]
            lane[: row.size] = lane[: row.size] + row  # float32 + float32, rounded per element
        w = lanes // 2
        while w:
            lane[:w] = lane[:w] + lane[w : 2 * w]
            w //= 2
        total += float(lane[0])
    return total


@pytest.mark.skipif(not cpp_backend.AVAILABLE, reason="stepfast._C not built")
def test_cpp_sums_run_in_the_documented_order_bit_for_bit():
    """The C++ ops sum a sample's squares in a fixed order (32 lanes a chunk, folded pairwise, chunks
    in float64): the order is the source's, not the vector width's, so the AVX2 and baseline builds
    give the same bits and the step op's log-prob is the log-prob op's. A numpy float32 emulation of
    that order gives every log-prob and KL bit for bit, on a size with a partial chunk and a partial
    row of lanes (2,101 elements a sample)."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    shape = (3, 11, 191)
    x, v, z, v_ref = (torch.randn(shape, generator=g) for _ in range(4))
    coef = torch.rand(3, 8, generator=g) + 0.1  # ca, cb, std, lp_scale, lp_const, kl_scale, glp, gkl
    sample, step_lp = torch.ops.stepfast.sde_step(x, v, z, coef, 0, True)
    lp, kl, _, _ = torch.ops.stepfast.sde_logprob(x, v, sample, v_ref, coef, 0, False)
    f32 = np.float32
    for b in range(3):
        ca, cb, sd, scale, const, kl_scale = (f32(c) for c in coef[b, :6].tolist())
        xb, vb, zb, sb, rb = (t[b].reshape(-1).numpy() for t in (x, v, z, sample, v_ref))
        mean = ca * xb + cb * vb  # float32 products, then a float32 sum: no fused multiply-add
        assert np.array_equal(sb, mean + sd * zb)
        d = sb - mean
        want_lp = f32(float(scale) * _lanes_sum(d * d) + float(const))
        dv = vb - rb
        want_kl = f32(float(kl_scale) * _lanes_sum(dv * dv))
        assert step_lp[b].item() == want_lp and lp[b].item() == want_lp, (b, step_lp[b].item(), lp[b].item(), want_lp)
        assert kl[b].item() == want_kl, (b, kl[b].item(), want_kl)


def test_the_benchmarks_flow_grpo_baseline_computes_what_the_kernels_compute():
    """benchmarks/test_bench_kernels.py times the kernels against Flow-GRPO's eager code
    (tests/flow_grpo_baseline.py): it must be the same step, log-prob, KL and gradient, or the
    comparison would time different work. Interior times only (the baseline divides by 1 - t)."""
    from flow_grpo_baseline import flow_grpo_logprob, flow_grpo_step_with_logprob

    inp = make_inputs("flow_sde", "mean_prime")
    t = torch.linspace(0.9, 0.5, inp["x_t"].shape[0])
    inp = {**inp, "t": t, "s": t - 0.15}
    sample, lp = flow_grpo_step_with_logprob(inp["x_t"], inp["v"], inp["t"], inp["s"], inp["noise"])
    ref_sample, ref_lp = reference_step64("flow_sde", inp, "gaussian")
    assert_matches64(sample, ref_sample, what="sample")
    assert_matches64(lp, ref_lp, what="step log_prob")
    v = inp["v"].clone().requires_grad_()
    lp, kl = flow_grpo_logprob(inp["x_t"], v, inp["t"], inp["s"], inp["sample"], inp["v_ref"])
    ref_lp, ref_kl, v64, _ = reference_logprob64("flow_sde", inp, "gaussian", True)
    assert_matches64(lp.detach(), ref_lp.detach(), what="log_prob")
    assert_matches64(kl.detach(), ref_kl.detach(), what="kl")
    upstream(lp, None).backward()
    upstream(ref_lp, None).backward()
    assert_matches64(v.grad, v64.grad, what="grad_v")


@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16], ids=["v_fp32", "v_bf16"])
@pytest.mark.parametrize("patch", [None, 2], ids=["mean", "tokens"])
def test_the_bandwidth_benchmarks_wrapper_calls_compute_the_ops(v_dtype, patch):
    """The HBM bandwidth benchmark times the Triton host wrappers on precomputed coefficients, past
    the dispatcher: its cases compute what the public ops compute (here in the Triton interpreter on
    an odd shape; on CUDA the benchmark checks them before timing)."""
    from kernel_wrapper_cases import check_wrapper_case, wrapper_cases

    for name, (fn, _, expected) in wrapper_cases((3, 5, 6, 10), "cpu", v_dtype, patch).items():
        check_wrapper_case(name, fn, expected)
