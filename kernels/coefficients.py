"""Per-sample coefficients that reduce every sampler step to one affine map, for the fused kernels.

Every sampler in `stepfast.sde` has a mean that is linear in the velocity,

    mean = ca x_t + cb v

with per-sample scalars ca, cb (derived from `stepfast.sde.step`):

    ode:       ca = 1                        cb = s - t
    flow_sde:  k = sig^2 / (2 t)             (sig = `flow_sde_sigma`)
               ca = 1 + (s - t) k            cb = (s - t) (1 + k (1 - t))
    cps, ddim: c = sqrt(max(s^2 - std^2, 0)) (x0_hat = x - t v, x1_hat = x + (1 - t) v)
               ca = (1 - s) + c              cb = c (1 - t) - (1 - s) t

so a kernel needs, per sample, a handful of scalars and one pass over x_t, v and the noise (or the
stored sample). With d = sample - mean and the sum S = sum d^2 over the reduced elements (all C, H, W
for `mean`/`sum`; the C x p x p elements of one DiT patch for `tokens`):

    log_prob = lp_scale S + lp_const
        gaussian: lp_scale = -w / (2 std^2)   lp_const = -(log std + log sqrt(2 pi)) w n
        cps:      lp_scale = -w               lp_const = 0
    with n the number of reduced elements and w = 1 / n (mean, tokens) or 1 (sum).

    kl = kl_scale sum (v - v_ref)^2,   kl_scale = cb^2 / (2 sig_kl^2 N)
        (mean - mean_ref = cb (v - v_ref): the x_t terms cancel exactly, so the kernels never form
        two means and subtract them; sig_kl = `stepfast.sde.kl_sigma`, N = numel per sample)

and the gradients w.r.t. each element of v:

    d log_prob / d v = glp d,          glp = -2 lp_scale cb
    d kl / d v       = gkl (v - v_ref), gkl = 2 kl_scale         (and -gkl (v - v_ref) for v_ref)

The scalars are computed in float64 from the float32 times (the times are rounded to float32 first,
as `stepfast.sde` does) and handed to the kernels in float32; all per-element math is float32.
"""

from __future__ import annotations

import math

import torch

from stepfast import sde

# Column order of the coefficient table [B, NUM_COEFS] (float32) that every backend reads.
CA, CB, STD, LP_SCALE, LP_CONST, KL_SCALE, GLP, GKL = range(8)
NUM_COEFS = 8

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def as_time_tensor(t, name: str, **options) -> torch.Tensor:
    """torch.as_tensor(t, **options), or a ValueError naming the time `name` when t is not numbers."""
    try:
        return torch.as_tensor(t, **options)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name} must be a float or a tensor of shape [batch], got {t!r} ({exc})") from None


def times(t, batch: int, device: torch.device, name: str = "times") -> torch.Tensor:
    """A time (float, 0-dim or [B] tensor) as float32 [B], exactly as `stepfast.sde` rounds it."""
    t = as_time_tensor(t, name, dtype=torch.float32, device=device)
    if t.dim() == 0:
        t = t.expand(batch)
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must be a float or a tensor of shape [batch] = [{batch}], got shape {tuple(t.shape)}")
    return t


def _host_times(t, name: str) -> torch.Tensor:
    # rounded to float32 first, as every backend computes with them (`times`, stepfast.sde)
    return as_time_tensor(t, name, dtype=torch.float32).cpu().double().reshape(-1)


def check_times(t, s) -> None:
    """A ValueError naming the times unless every step goes down, 1 >= t > s >= 0, in finite numbers
    (t = 1 is noise, 0 is data). Reads the values: on a GPU, one sync."""
    t, s = (_host_times(u, name) for u, name in ((t, "t"), (s, "s")))

    def first(bad: torch.Tensor, u: torch.Tensor) -> str:
        i = int(bad.nonzero()[0])
        return f"{float(u[i]):.6g}" + (f" (sample {i})" if u.numel() > 1 else "")

    for name, u in (("t", t), ("s", s)):
        if not bool(torch.isfinite(u).all()):
            raise ValueError(f"{name} holds NaN or inf: {name} = {first(~torch.isfinite(u), u)}")
        if bool(((u < 0) | (u > 1)).any()):
            bad = first((u < 0) | (u > 1), u)
            raise ValueError(f"{name} must lie in [0, 1] (1 is noise, 0 is data), got {name} = {bad}")
    try:
        t, s = torch.broadcast_tensors(t, s)
    except RuntimeError:
        return  # their shapes are named where the times are used
    if bool((s >= t).any()):
        i = int((s >= t).nonzero()[0])
        where = f" (sample {i})" if t.numel() > 1 else ""
        raise ValueError(f"a step goes from t down to s < t, got t = {float(t[i]):.6g} and s = "
                         f"{float(s[i]):.6g}{where}")  # fmt: skip


#: The fused ops' backward is not differentiable (backward with create_graph=True through them).
SECOND_DERIVATIVE = (
    "the fused sde_logprob has no second derivative (a backward with create_graph=True through it): use "
    "the torch backend (backend='torch' or STEPFAST_KERNELS=torch) for higher-order gradients"
)


def step_coefficients(
    kind: str,
    t,
    s,
    batch: int,
    numel: int,
    reduced: int,
    convention: str,
    reduce: str,
    device: torch.device,
    check_std: bool = True,
    check: bool = True,
    check_kl: bool = False,
    **params,
) -> torch.Tensor:
    """The [batch, NUM_COEFS] float32 table of the step t -> s (see the module docstring).

    numel: elements per sample (N); reduced: elements per log-prob entry (N for mean/sum, C p^2 for
    tokens). With check_std, a `gaussian` log-prob of a step with std <= 0 is an error, as in
    `stepfast.sde.log_prob`; with check, times that do not go down within [0, 1] (`check_times`);
    with check_kl, a KL to the reference of such a step, whatever the convention (its sigma is 0).
    """
    if kind not in sde.SAMPLERS:
        raise ValueError(f"unknown sampler {kind!r}: expected one of {', '.join(sde.SAMPLERS)}")
    p = sde.sampler_params(kind, params)  # validates the parameter names exactly as sde.step does
    t64 = times(t, batch, device, "t").double()
    s64 = times(s, batch, device, "s").double()
    if check:
        check_times(t, s)  # as given: a single time is not named by a sample
    std = sde.step_std(kind, t64, s64, **params).double().expand(batch)
    if kind == "ode":
        ca, cb = torch.ones_like(t64), s64 - t64
        sig_kl = std
    elif kind == "flow_sde":
        sig = sde.flow_sde_sigma(t64, s64, p["noise_level"])
        k = sig**2 / (2 * t64)
        ca = 1 + (s64 - t64) * k
        cb = (s64 - t64) * (1 + k * (1 - t64))
        sig_kl = sig
    else:
        c = torch.sqrt(torch.clamp(s64**2 - std**2, min=0.0))
        ca = (1 - s64) + c
        cb = c * (1 - t64) - (1 - s64) * t64
        sig_kl = std
    w = 1.0 if reduce == "sum" else 1.0 / reduced
    if convention == "gaussian":
        if check_std and bool((std <= 0).any()):
            raise ValueError(sde.deterministic_step_error(std, t64, s64))
        lp_scale = -w / (2 * std**2)
        lp_const = -(torch.log(std) + _LOG_SQRT_2PI) * (w * reduced)
    else:
        lp_scale = torch.full_like(t64, -w)
        lp_const = torch.zeros_like(t64)
    if check_kl and bool((sig_kl <= 0).any()):  # after the log-prob's check, in the torch backend's order
        raise ValueError(sde.KL_OF_A_DETERMINISTIC_STEP)
    kl_scale = cb**2 / (2 * sig_kl**2 * numel)
    table = torch.stack(
        [ca, cb, std, lp_scale, lp_const, kl_scale, -2 * lp_scale * cb, 2 * kl_scale], dim=1
    )
    return table.to(torch.float32).contiguous()
