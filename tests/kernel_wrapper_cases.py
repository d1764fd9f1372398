"""The Triton host wrappers of the SDE kernels, called as the HBM bandwidth benchmark calls them
(benchmarks/test_bench_kernels.py: coefficients precomputed, no dispatcher), with the torch backend's
outputs to check them against. tests/test_kernels.py checks every case on CPU in the Triton
interpreter; the benchmark checks them on CUDA before it times them."""

from __future__ import annotations

import torch

from stepfast.kernels import sde_logprob, sde_step_with_logprob


def bytes_of(*tensors: torch.Tensor) -> int:
    """Bytes the tensors hold (what a kernel reads or writes of them, once)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def wrapper_cases(shape: tuple[int, ...], device: str, v_dtype: torch.dtype, patch: int | None, seed: int = 0) -> dict:
    """{name: (callable, bytes moved, expected outputs)} for the Triton host wrappers on one shape, with
    coefficients precomputed (so only the kernels and their small finishing sums run). The expected
    outputs are the torch backend's, float32 math on the same inputs: the step's sample and log-prob,
    the forward's log-prob (and KL), the backward's gradients w.r.t. v (and v_ref) for the wrappers'
    output gradients. On CPU tensors the wrappers run in the Triton interpreter."""
    from stepfast.kernels.coefficients import step_coefficients
    from stepfast.kernels.sde_logprob import sde_logprob_bwd, sde_logprob_fwd
    from stepfast.kernels.sde_step import sde_step_fwd

    b, n = shape[0], shape[1] * shape[2] * shape[3]
    g = torch.Generator().manual_seed(seed)

    def rand(dtype=torch.float32):
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    x, z, smp, v, v_ref = rand(), rand(), rand(), rand(v_dtype), rand(v_dtype)
    reduce = "tokens" if patch else "mean"
    reduced = shape[1] * patch * patch if patch else n
    coef = step_coefficients("flow_sde", 0.8, 0.7, b, n, reduced, "gaussian", reduce, torch.device("cpu")).to(device)
    grad_lp = torch.randn((b, n // reduced) if patch else (b,), generator=g).to(device)
    grad_kl = torch.randn(b, generator=g).to(device)
    opts = dict(reduce=reduce, patch_size=patch, backend="torch")

    def step_ref():
        with torch.no_grad():
            return tuple(sde_step_with_logprob("flow_sde", x, v, 0.8, 0.7, z, **opts))

    def logprob_ref(with_kl: bool):
        with torch.no_grad():
            lp, kl = sde_logprob("flow_sde", x, v, 0.8, 0.7, smp, v_ref if with_kl else None, **opts)
        return (lp,) if kl is None else (lp, kl)

    def grad_ref(with_kl: bool):
        vv, vr = v.detach().clone().requires_grad_(), v_ref.detach().clone().requires_grad_()
        lp, kl = sde_logprob("flow_sde", x, vv, 0.8, 0.7, smp, vr if with_kl else None, **opts)
        loss = (lp * grad_lp).sum() + ((kl * grad_kl).sum() if with_kl else 0)
        wrt = (vv, vr) if with_kl else (vv,)
        return torch.autograd.grad(loss, wrt)

    return {
        "step fwd": (lambda: sde_step_fwd(x, v, z, coef, patch, True), bytes_of(x, v, z) + x.numel() * 4, step_ref),
        "logprob fwd": (lambda: sde_logprob_fwd(x, v, smp, None, coef, patch)[:1], bytes_of(x, v, smp),
                        lambda: logprob_ref(False)),
        "logprob+kl fwd": (lambda: sde_logprob_fwd(x, v, smp, v_ref, coef, patch), bytes_of(x, v, smp, v_ref),
                           lambda: logprob_ref(True)),
        "logprob bwd": (lambda: sde_logprob_bwd(x, v, smp, None, coef, patch, grad_lp, None, False)[:1],
                        bytes_of(x, v, smp, v), lambda: grad_ref(False)),
        "logprob+kl bwd": (lambda: sde_logprob_bwd(x, v, smp, v_ref, coef, patch, grad_lp, grad_kl, True),
                           bytes_of(x, v, smp, v_ref, v, v_ref), lambda: grad_ref(True)),
    }  # fmt: skip


def check_wrapper_case(name: str, fn, expected) -> None:
    """The wrapper's outputs equal the torch backend's to 1e-5 of their largest entry (bfloat16
    gradients: to bfloat16's rounding), so that the bandwidth benchmark never quotes a kernel that
    computes the wrong thing. `name` says the case in a failure."""
    got, want = fn(), expected()
    assert len(got) == len(want), f"{name}: {len(got)} outputs, the reference has {len(want)}"
    for i, (a, e) in enumerate(zip(got, want)):
        assert a.shape == e.shape and a.dtype == e.dtype, f"{name} output {i}: {a.dtype} {tuple(a.shape)}, expected {e.dtype} {tuple(e.shape)}"
        a, e = a.double(), e.double()
        rel = 1e-5 if got[i].dtype == torch.float32 else 2.0 ** -7
        err, scale = (a - e).abs().max().item(), e.abs().max().item()
        assert err <= rel * max(scale, 1e-30), f"{name} output {i}: differs from the torch backend by {err:.3g} (largest entry {scale:.3g})"
