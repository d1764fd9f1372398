"""Fused rollout step: sample = mean + std noise and its log-probability, one pass over memory (Triton).

    mean = ca x_t + cb v        sample = mean + std noise        log_prob = lp_scale S + lp_const

S = sum (sample - mean)^2 per sample (reduce mean/sum) or per DiT patch (tokens); the per-sample
coefficients come from `kernels/coefficients.py`. Inputs are loaded in their storage dtype and all
math is float32; the sample is stored in float32. Each program writes the partial sum of its block to a
buffer that torch sums: no atomics, deterministic. The residual is formed as (sample - mean) from the
rounded float32 sample, exactly as `sde_logprob` forms it from the stored sample, and both kernels share
the same blocking, so the rollout's log-prob and the training side's recomputed one agree bit for bit.

On a CPU tensor the kernel runs in the Triton interpreter (see `launcher`), whatever TRITON_INTERPRET says.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
import triton
import triton.language as tl

from .coefficients import CA, CB, LP_CONST, LP_SCALE, NUM_COEFS, STD

# Column indices of the coefficient table, as compile-time constants for the kernels.
_CA = tl.constexpr(CA)
_CB = tl.constexpr(CB)
_STD = tl.constexpr(STD)
_NUM_COEFS = tl.constexpr(NUM_COEFS)

# tl.sum is itself a @triton.jit function, which the interpreter can only run when TRITON_INTERPRET=1
# was set before triton was imported. tl.reduce with triton's own sum combiner is the same reduction
# when compiled and a numpy sum when interpreted, whatever the import order.
_add = getattr(tl.standard, "_sum_combine", None)
if _add is None:  # a triton without it: the same sum (slower only in the interpreter)

    @triton.jit
    def _add(a, b):
        return a + b


# Elements per program for the per-sample reduction; tile budget of the per-patch reduction.
BLOCK = 2048
TILE = 2048
# Launch options of every kernel here. No FMA contraction: fused or not, which multiply-add the
# compiler fuses could differ between the step kernel and the log-prob kernel, and with it the last
# bit of the residual; unfused, both compute mean, sample and residual in the same IEEE float32
# order (as the C++ backend, built with -ffp-contract=off), so the rollout's log-prob and the
# recomputed one agree bit for bit. Memory-bound kernels: the lost FMAs cost nothing measurable.
LAUNCH = dict(num_warps=8, enable_fp_fusion=False)


@triton.jit
def _token_tile(pid, b, N, H, W, C, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_Q: tl.constexpr):  # fmt: skip
    """Program `pid`'s tile of sample `b` for the per-patch reduction: [rows (c, r), patches of one
    patch row, columns inside a patch], the last two contiguous in memory; the program covers patch
    row hp and a block of patch columns wp. Returns the element offsets and mask of the tile, and the
    index of each of its patches (hp * Wp + wp) with their mask. Shared by the step and the log-prob
    kernels, whose bit-for-bit agreement needs the same tiles."""
    Wp = W // P
    n_wblk = (Wp + BLOCK_T - 1) // BLOCK_T
    hp = pid // n_wblk
    wp = (pid % n_wblk) * BLOCK_T + tl.arange(0, BLOCK_T)
    rr = tl.arange(0, BLOCK_R)
    q = tl.arange(0, BLOCK_Q)
    c = rr // P
    r = rr % P
    row_off = c * (H * W) + (hp * P + r) * W  # [BLOCK_R]
    col_off = wp[:, None] * P + q[None, :]  # [BLOCK_T, BLOCK_Q]
    offs = b * N + row_off[:, None, None] + col_off[None, :, :]
    mask = (rr < C * P)[:, None, None] & ((wp[:, None] < Wp) & (q[None, :] < P))[None, :, :]
    return offs, mask, hp * Wp + wp, wp < Wp


@triton.jit
def _sde_step_fwd_kernel(
    x_ptr,
    v_ptr,
    z_ptr,
    coef_ptr,
    sample_ptr,
    partial_ptr,
    N,
    n_prog,
    H,
    W,
    C,
    TOKENS: tl.constexpr,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    ca = tl.load(coef_ptr + b * _NUM_COEFS + _CA)
    cb = tl.load(coef_ptr + b * _NUM_COEFS + _CB)
    sd = tl.load(coef_ptr + b * _NUM_COEFS + _STD)
    if TOKENS:
        offs, mask, patch, patch_mask = _token_tile(pid, b, N, H, W, C, P, BLOCK_R, BLOCK_T, BLOCK_Q)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = ca * x + cb * v
        sample = mean + sd * z
        tl.store(sample_ptr + offs, sample, mask=mask)
        d = sample - mean  # exactly 0 where masked
        per_patch = tl.reduce(tl.reduce(d * d, 2, _add), 0, _add)  # [BLOCK_T]
        tl.store(partial_ptr + b * n_prog + patch, per_patch, mask=patch_mask)
    else:
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        mask = idx < N
        offs = b * N + idx
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = ca * x + cb * v
        sample = mean + sd * z
        tl.store(sample_ptr + offs, sample, mask=mask)
        d = sample - mean  # exactly 0 where masked
        tl.store(partial_ptr + b * n_prog + pid, tl.reduce(d * d, 0, _add))


def tile_config(x: torch.Tensor, patch_size: int | None) -> dict:
    """Grid and block sizes shared by the step and log-prob kernels (same blocking, same sums)."""
    b = x.shape[0]
    n = x[0].numel() if b else 0
    if not patch_size:
        n_prog = max(triton.cdiv(n, BLOCK), 1)
        return dict(grid=(n_prog, b), n_prog=n_prog, H=1, W=1, C=1, TOKENS=False, P=1, BLOCK=BLOCK,
                    BLOCK_R=1, BLOCK_T=1, BLOCK_Q=1)
    _, c, h, w = x.shape
    p = patch_size
    block_r = triton.next_power_of_2(c * p)
    block_q = triton.next_power_of_2(p)
    block_t = max(1, min(triton.next_power_of_2(w // p), TILE // (block_r * block_q)))
    n_wblk = triton.cdiv(w // p, block_t)
    return dict(grid=((h // p) * n_wblk, b), n_prog=(h // p) * (w // p), H=h, W=w, C=c, TOKENS=True, P=p,
                BLOCK=1, BLOCK_R=block_r, BLOCK_T=block_t, BLOCK_Q=block_q)


@functools.lru_cache(maxsize=None)
def _interpreted(kernel):
    """`kernel` run by the interpreter. The device functions it calls from this package (such as
    `_token_tile`) are @triton.jit functions too, which only a compiled kernel can call: the
    interpreted kernel runs with globals in which they are interpreted as well."""
    from triton.runtime.interpreter import InterpretedFunction

    fn = kernel.fn
    helpers = {name: InterpretedFunction(value.fn) for name, value in fn.__globals__.items()
               if name in fn.__code__.co_names and isinstance(value, triton.JITFunction)
               and value.fn.__module__.startswith(__package__)}  # fmt: skip
    if helpers:  # the interpreter runs its rewrite of the kernel in the kernel's globals
        fn = types.FunctionType(fn.__code__, {**fn.__globals__, **helpers}, fn.__name__, fn.__defaults__,
                                fn.__closure__)  # fmt: skip
    return InterpretedFunction(fn)


def launcher(kernel, device: torch.device):
    """The kernel compiled for a GPU, or run by the Triton interpreter for CPU tensors.

    triton.jit picks the interpreter only when TRITON_INTERPRET=1 is set before the kernel module is
    imported; building the interpreted kernel here instead lets CPU and GPU calls share one process
    whatever the import order.
    """
    if device.type == "cpu" and not hasattr(kernel, "rewrite"):
        return _interpreted(kernel)
    return kernel


def on_device(device: torch.device):
    """The context a launch runs in: Triton launches on the current CUDA device and its stream, not
    on the device of the tensors it is given, so a launch on another GPU's tensors than the current
    one makes that GPU current for it (nothing to do on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def sde_step_fwd(
    x_t: torch.Tensor, v: torch.Tensor, noise: torch.Tensor, coef: torch.Tensor, patch_size: int | None, with_logprob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host wrapper: (sample float32, log_prob float32 [B] or [B, L]) from contiguous inputs and the
    [B, NUM_COEFS] coefficient table."""
    x_t, v, noise = x_t.contiguous(), v.contiguous(), noise.contiguous()
    cfg = tile_config(x_t, patch_size)
    b, n = x_t.shape[0], x_t[0].numel() if x_t.shape[0] else 0
    sample = torch.empty(x_t.shape, dtype=torch.float32, device=x_t.device)
    # every slot is written by exactly one program (no memset launch); nothing to write when empty
    partial = (torch.empty if b and n else torch.zeros)((b, cfg["n_prog"]), dtype=torch.float32, device=x_t.device)
    if b and n:
        grid = cfg.pop("grid")
        n_prog = cfg.pop("n_prog")
        with on_device(x_t.device):
            launcher(_sde_step_fwd_kernel, x_t.device)[grid](
                x_t, v, noise, coef, sample, partial, n, n_prog, **cfg, **LAUNCH
            )
    if not with_logprob:
        shape = (b, partial.shape[1]) if patch_size else (b,)
        return sample, torch.zeros(shape, dtype=torch.float32, device=x_t.device)
    return sample, finish_log_prob(partial, coef, patch_size)


def finish_log_prob(partial: torch.Tensor, coef: torch.Tensor, patch_size: int | None) -> torch.Tensor:
    """log_prob = lp_scale S + lp_const from the per-program partial sums (per patch: already S)."""
    s = partial if patch_size else partial.sum(dim=1)
    scale, const = coef[:, LP_SCALE], coef[:, LP_CONST]
    if patch_size:
        return s * scale[:, None] + const[:, None]
    return s * scale + const
