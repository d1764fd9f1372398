"""The entry points of the fused ops and the choice of backend behind them.

Backends, all computing the same numbers (tests/test_kernels.py checks each against a float64 reference):
    triton: kernels/sde_step.py, kernels/sde_logprob.py (on CPU tensors: the Triton interpreter, for tests)
    cpp:    csrc/ (CPU, OpenMP), registered as torch.ops.stepfast.*
    torch:  kernels/reference.py, plain autograd code on top of stepfast.sde
Default: triton on CUDA, cpp on CPU, torch elsewhere. STEPFAST_KERNELS=torch|cpp|triton forces one for
the whole process, and `backend=` forces one for a call (it wins over the environment variable). A cpp
backend that was not built falls back to torch with a one-time warning.
"""

from __future__ import annotations

import functools
import numbers
import os
import warnings
from typing import NamedTuple

import torch

from stepfast import sde

from . import cpp, reference
from .coefficients import as_time_tensor, check_times, step_coefficients

BACKENDS = ("torch", "cpp", "triton")
ENV_VAR = "STEPFAST_KERNELS"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_PATCH_SIZE = 1024  # a row piece of csrc/'s tokens kernels (kChunk elements) holds whole patches


class StepWithLogProb(NamedTuple):
    """A rollout step: the next state (float32) and the step's log-probability (float32 [B] or [B, L])."""

    sample: torch.Tensor
    log_prob: torch.Tensor


class LogProbAndKL(NamedTuple):
    """The training-side log-probability (float32 [B] or [B, L]) and the KL to the reference (float32 [B],
    None without v_ref)."""

    log_prob: torch.Tensor
    kl: torch.Tensor | None


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def select_backend(device: torch.device | str, backend: str | None = None) -> str:
    """The backend that runs an op on `device`: `backend` if given, else $STEPFAST_KERNELS, else the
    default for the device (triton on CUDA, cpp on CPU, torch elsewhere)."""
    device = torch.device(device)
    choice = backend or os.environ.get(ENV_VAR) or None
    if choice is not None and choice not in BACKENDS:
        source = "backend=" if backend else f"${ENV_VAR}"
        raise ValueError(f"unknown kernel backend {choice!r} (from {source}): expected one of {', '.join(BACKENDS)}")
    if choice is None:
        if device.type == "cuda":
            if _triton_import_error() is None:
                return "triton"
            _warn_once(
                f"stepfast: triton is not importable ({_triton_import_error()}); the SDE ops on CUDA run as the "
                "unfused torch reference. Install triton for the fused kernels"
            )
            return "torch"
        if device.type == "cpu":
            choice = "cpp"
        else:
            return "torch"
    if choice == "cpp":
        if device.type != "cpu":
            raise ValueError(f"the cpp kernel backend runs on CPU tensors, got tensors on {device}")
        if not cpp.AVAILABLE:
            _warn_once(
                f"stepfast: the C++ kernels (stepfast._C) are not available ({cpp.REASON}); using the torch "
                "backend. Build them with `pip install --no-build-isolation -e .`"
            )
            return "torch"
    if choice == "triton":
        if _triton_import_error() is not None:
            raise ImportError(f"the triton kernel backend needs triton: {_triton_import_error()}")
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"the triton kernel backend runs on CUDA (or, interpreted, CPU) tensors, got {device}")
    return choice


def _check(kind: str, x_t: torch.Tensor, others: dict, convention: str, reduce: str, patch_size, times=()) -> None:
    if kind not in sde.SAMPLERS:
        raise ValueError(f"unknown sampler {kind!r}: expected one of {', '.join(sde.SAMPLERS)}")
    if convention not in sde.LOGPROB_CONVENTIONS:
        raise ValueError(f"unknown log-prob convention {convention!r}: expected one of {sde.LOGPROB_CONVENTIONS}")
    if reduce not in sde.REDUCTIONS:
        raise ValueError(f"unknown reduction {reduce!r}: expected one of {sde.REDUCTIONS}")
    for name, tensor in {"x_t": x_t, **others}.items():
        optional = name in ("noise", "v_ref")  # drawn when None; no KL when None
        if not isinstance(tensor, torch.Tensor) and not (optional and tensor is None):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if isinstance(tensor, torch.Tensor) and (tensor.is_complex() or tensor.dtype == torch.bool):
            raise TypeError(f"{name} must hold real numbers (float32, bfloat16 or float16; float64 and integers are "
                            f"computed as float32), got {tensor.dtype}")  # fmt: skip
    named = {"x_t": x_t, **others, **dict(zip(("t", "s"), times))}
    meta = [name for name, u in named.items() if isinstance(u, torch.Tensor) and u.is_meta]
    if meta:
        raise ValueError(f"{', '.join(meta)} {'is' if len(meta) == 1 else 'are'} on the meta device: the SDE ops read "
                         "the times' values and check each step's std, which a meta tensor does not hold; call them "
                         "with tensors that hold data (torch.compile traces them without reading values)")  # fmt: skip
    if x_t.dim() < 1:
        raise ValueError("x_t needs a batch dimension")
    if x_t.shape[0] and not x_t[0].numel():
        raise ValueError(f"x_t has no elements per sample: shape {tuple(x_t.shape)}")
    for name, tensor in others.items():
        if tensor is None:
            continue
        if tensor.shape != x_t.shape:
            raise ValueError(f"x_t and {name} must have the same shape, got {tuple(x_t.shape)} and {tuple(tensor.shape)}")
        if tensor.device != x_t.device:
            raise ValueError(f"x_t and {name} must be on the same device, got {x_t.device} and {tensor.device}")
    if reduce == "tokens":
        if isinstance(patch_size, bool) or not isinstance(patch_size, numbers.Integral) or patch_size < 1:
            raise ValueError(f"reduce='tokens' needs patch_size, the DiT's patch size (2 for SD3): a whole number "
                             f">= 1, got {patch_size!r}")  # fmt: skip
        if patch_size > MAX_PATCH_SIZE:
            raise ValueError(f"patch_size must be at most {MAX_PATCH_SIZE}, the widest the CPU kernels take (SD3's "
                             f"is 2), got {patch_size}")  # fmt: skip
        if x_t.dim() != 4:
            raise ValueError(f"reduce='tokens' needs [B, C, H, W] latents, got shape {tuple(x_t.shape)}")
        if x_t.shape[2] % patch_size or x_t.shape[3] % patch_size:
            raise ValueError(f"latent size {x_t.shape[2]}x{x_t.shape[3]} is not divisible by patch_size {patch_size}")


def _requires_grad(x) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


def _coefficients(kind, x_t, t, s, convention, reduce, patch_size, check_std, params,
                  check_kl=False) -> torch.Tensor:
    """The per-sample coefficient table (kernels/coefficients.py) on x_t's device."""
    params = sde.sampler_params(kind, params)  # validated as stepfast.sde validates them; floats, hashable
    b = x_t.shape[0]
    numel = x_t[0].numel() if b else 0
    reduced = max(x_t.shape[1] * patch_size**2 if reduce == "tokens" else numel, 1)
    layout = (b, numel, reduced, convention, reduce)
    if torch.compiler.is_compiling():  # traced as torch ops; the std and time checks read values: skipped
        return step_coefficients(kind, t, s, *layout, x_t.device, check_std=False, check=False, **params)
    # The table is a function of the times' values. A trainer calls the ops with the same few (t, s)
    # over and over, and building the table takes ~25 small torch ops, more than the op itself: it is
    # built on the host and cached on x_t's device. Times on a GPU are read back first: one small copy
    # and sync, against ~25 kernel launches and a sync for the std check when built there: on an H200
    # that made the fused step at (24, 16, 64, 64) 0.69 ms against Flow-GRPO's eager 0.44 ms. Pass
    # host times (a float or a CPU tensor) to avoid even the sync, as the trainer does.
    t, s = (u.cpu() if isinstance(u, torch.Tensor) else u for u in (t, s))
    key = tuple(sorted(params.items()))
    return _cached_table(kind, _time_key(t, "t"), _time_key(s, "s"), layout, check_std, key, x_t.device, check_kl)


def _time_key(t, name: str) -> tuple:
    """A hashable key of the times (a number, or a tensor, list or array of them, kept in its shape so
    that every backend checks the same shape)."""
    if isinstance(t, (int, float)):
        return ("float", float(t))
    t = as_time_tensor(t, name)
    return ("tensor", t.dtype, tuple(t.shape), tuple(t.reshape(-1).tolist()))


@functools.lru_cache(maxsize=256)
def _cached_table(kind, t_key, s_key, layout, check_std, params, device, check_kl=False) -> torch.Tensor:
    def value(key):
        if key[0] == "float":
            return key[1]
        _, dtype, shape, values = key
        return torch.tensor(values, dtype=dtype).reshape(shape)

    # a normal tensor even when the first call came under torch.inference_mode(): an inference tensor
    # in the cache could not be saved for backward by a later training call at the same times
    with torch.inference_mode(False):
        table = step_coefficients(
            kind, value(t_key), value(s_key), *layout, torch.device("cpu"), check_std=check_std, check_kl=check_kl,
            **dict(params),
        )
        return table.to(device)


def _kernel_input(x: torch.Tensor | None) -> torch.Tensor | None:
    """Contiguous, in a dtype the kernels load (float32, bfloat16, float16; anything else as float32)."""
    if x is None:
        return None
    if x.dtype not in _KERNEL_DTYPES:
        x = x.float()
    return x.contiguous()


def sde_step_with_logprob(
    kind: str,
    x_t: torch.Tensor,
    v: torch.Tensor,
    t,
    s,
    noise: torch.Tensor | None = None,
    convention: str = "gaussian",
    reduce: str = "mean",
    patch_size: int | None = None,
    *,
    generator: torch.Generator | None = None,
    backend: str | None = None,
    **params,
) -> StepWithLogProb:
    """One rollout step t -> s of sampler `kind` and its log-probability, in one pass over memory.

    The same numbers as `stepfast.sde.step` then `stepfast.sde.log_prob(sample, mean, std, convention,
    reduce, patch_size)`; t and s are floats or [B] tensors with 1 >= t > s >= 0 (an error otherwise,
    on every backend); inputs float32, bfloat16 or float16; math and outputs float32. `noise` ~ N(0, I)
    of the shape of x_t (drawn with `generator` when None).

    `ode` is deterministic: its sample is the Euler step and its log-prob is zeros (the convention of
    `stepfast.rollout.Trajectory`: a deterministic step carries no log-probability). A `gaussian`
    log-prob of another step with std = 0 is an error, as in `stepfast.sde.log_prob`.

    This is the rollout op: it has no gradient. Call it under torch.no_grad(); the training side is
    `sde_logprob`. `params`: the sampler's, `eta` for ddim (default 1), `noise_level` for flow_sde and
    cps (default 0.7); `backend`: "torch", "cpp" or "triton" instead of the device's default.
    """
    _check(kind, x_t, {"v": v, "noise": noise}, convention, reduce, patch_size, (t, s))
    patch_size = int(patch_size) if reduce == "tokens" else patch_size  # a numpy integer works too
    asked = [n for n, u in {"x_t": x_t, "v": v, "noise": noise, "t": t, "s": s}.items() if _requires_grad(u)]
    if torch.is_grad_enabled() and asked:
        raise RuntimeError(
            f"sde_step_with_logprob is the rollout op and has no gradient, but {' and '.join(asked)} "
            f"require{'s' if len(asked) == 1 else ''} one: call it under torch.no_grad() (sde_logprob is the "
            "differentiable training-side op)"
        )
    name = select_backend(x_t.device, backend)
    if name == "torch":
        if not torch.compiler.is_compiling():  # it reads the times' values
            check_times(t, s)
        out = reference.sde_step_with_logprob(
            kind, x_t, v, t, s, noise, convention, reduce, patch_size, generator=generator, **params
        )
        return StepWithLogProb(*out)
    deterministic = kind == "ode"
    coef = _coefficients(kind, x_t, t, s, convention, reduce, patch_size, not deterministic, params)
    if deterministic:
        noise = torch.zeros_like(x_t, dtype=torch.float32)  # multiplied by std = 0 (v could hold an inf)
    elif noise is None:
        noise = torch.randn(x_t.shape, generator=generator, device=x_t.device, dtype=torch.float32)
    x_t, v, noise = _kernel_input(x_t), _kernel_input(v), _kernel_input(noise)
    patch = patch_size if reduce == "tokens" else None
    if name == "cpp":
        return StepWithLogProb(*cpp.sde_step(x_t, v, noise, coef, patch, not deterministic))
    from .sde_step import sde_step_fwd

    return StepWithLogProb(*sde_step_fwd(x_t, v, noise, coef, patch, not deterministic))


def sde_logprob(
    kind: str,
    x_t: torch.Tensor,
    v: torch.Tensor,
    t,
    s,
    sample: torch.Tensor,
    v_ref: torch.Tensor | None = None,
    convention: str = "gaussian",
    reduce: str = "mean",
    patch_size: int | None = None,
    *,
    backend: str | None = None,
    **params,
) -> LogProbAndKL:
    """Log-probability of the stored `sample` under the step t -> s from (x_t, v), and the KL to the
    reference policy whose velocity is v_ref, differentiable w.r.t. v (and v_ref).

        log_prob = stepfast.sde.log_prob(sample, mean(v), std, convention, reduce, patch_size)
        kl       = stepfast.loss.kl_to_reference(mean(v), mean(v_ref), stepfast.sde.kl_sigma(kind, t, s))

    with mean(v) the mean of `stepfast.sde.step`. kl is per sample [B], None when v_ref is None. x_t and
    sample are stored rollout tensors: gradients flow to v and v_ref only (a gradient asked for x_t or
    sample is an error). An `ode` step has no log-probability: an error. `params` and `backend` as
    for `sde_step_with_logprob`.
    """
    _check(kind, x_t, {"v": v, "sample": sample, "v_ref": v_ref}, convention, reduce, patch_size, (t, s))
    patch_size = int(patch_size) if reduce == "tokens" else patch_size  # a numpy integer works too
    if kind == "ode":
        raise ValueError("an 'ode' step is deterministic: it has no log-probability and no KL (see sde.degenerate_steps)")
    grad = torch.is_grad_enabled()
    asked = [n for n, u in {"x_t": x_t, "sample": sample, "t": t, "s": s}.items() if _requires_grad(u)]
    if grad and asked:
        raise RuntimeError(
            f"sde_logprob is differentiable w.r.t. v and v_ref only, but {' and '.join(asked)} "
            f"require{'s' if len(asked) == 1 else ''} grad; x_t, sample and the times t, s are stored rollout "
            "values: detach them"
        )
    name = select_backend(x_t.device, backend)
    if name == "torch":
        if not torch.compiler.is_compiling():  # it reads the times' values
            check_times(t, s)
        return LogProbAndKL(
            *reference.sde_logprob(kind, x_t, v, t, s, sample, v_ref, convention, reduce, patch_size, **params)
        )
    coef = _coefficients(kind, x_t, t, s, convention, reduce, patch_size, True, params, check_kl=v_ref is not None)
    x_t, v, sample, v_ref = (_kernel_input(x) for x in (x_t, v, sample, v_ref))
    patch = patch_size if reduce == "tokens" else None
    needs_grad = grad and (v.requires_grad or (v_ref is not None and v_ref.requires_grad))
    if name == "cpp":
        return LogProbAndKL(*cpp.sde_logprob(x_t, v, sample, v_ref, coef, patch, needs_grad))
    from .sde_logprob import SdeLogprobFunction, sde_logprob_fwd

    if not needs_grad:
        return LogProbAndKL(*sde_logprob_fwd(x_t, v, sample, v_ref, coef, patch))
    log_prob, kl = SdeLogprobFunction.apply(x_t, v, sample, v_ref, coef, patch)
    return LogProbAndKL(log_prob, kl if v_ref is not None else None)
