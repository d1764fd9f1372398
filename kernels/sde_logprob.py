"""Fused training-side log-prob of a stored sample, and the KL to the reference, with its gradient (Triton).

Forward, one pass over x_t, v, sample (and v_ref):

    d = sample - (ca x_t + cb v)       log_prob = lp_scale S + lp_const,  S = sum d^2 (per sample or patch)
    dv = v - v_ref                     kl       = kl_scale sum dv^2        (= stepfast.loss's KL: the x_t terms
                                                                            of the two means cancel exactly)

Backward, one more pass that recomputes d (nothing but the inputs is saved):

    grad_v     = g_lp glp d + g_kl gkl dv        (g_lp per sample, or per patch for reduce='tokens')
    grad_v_ref = -g_kl gkl dv

with the per-sample coefficients of `kernels/coefficients.py`. Loads in the storage dtype, float32 math,
per-program partial sums summed in torch (no atomics). The blocking is the one of `sde_step`, so the
log-prob of an on-policy sample equals the rollout's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .coefficients import CA, CB, GKL, GLP, KL_SCALE, NUM_COEFS, SECOND_DERIVATIVE
from .sde_step import BLOCK, LAUNCH, _add, _token_tile, finish_log_prob, launcher, on_device, tile_config

_CA = tl.constexpr(CA)
_CB = tl.constexpr(CB)
_GLP = tl.constexpr(GLP)
_GKL = tl.constexpr(GKL)
_NUM_COEFS = tl.constexpr(NUM_COEFS)


@triton.jit
def _sde_logprob_fwd_kernel(
    x_ptr,
    v_ptr,
    s_ptr,
    vr_ptr,
    coef_ptr,
    partial_ptr,
    partial_kl_ptr,
    N,
    n_prog,
    n_kl,
    H,
    W,
    C,
    HAS_KL: tl.constexpr,
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
    if TOKENS:  # the tiles of _sde_step_fwd_kernel
        offs, mask, patch, patch_mask = _token_tile(pid, b, N, H, W, C, P, BLOCK_R, BLOCK_T, BLOCK_Q)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        d = s - (ca * x + cb * v)
        per_patch = tl.reduce(tl.reduce(d * d, 2, _add), 0, _add)
        tl.store(partial_ptr + b * n_prog + patch, per_patch, mask=patch_mask)
        if HAS_KL:
            vr = tl.load(vr_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dv = v - vr
            tl.store(partial_kl_ptr + b * n_kl + pid, tl.reduce(tl.reduce(tl.reduce(dv * dv, 2, _add), 1, _add), 0, _add))
    else:
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        mask = idx < N
        offs = b * N + idx
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        d = s - (ca * x + cb * v)
        tl.store(partial_ptr + b * n_prog + pid, tl.reduce(d * d, 0, _add))
        if HAS_KL:
            vr = tl.load(vr_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dv = v - vr
            tl.store(partial_kl_ptr + b * n_kl + pid, tl.reduce(dv * dv, 0, _add))


@triton.jit
def _sde_logprob_bwd_kernel(
    x_ptr,
    v_ptr,
    s_ptr,
    vr_ptr,
    coef_ptr,
    glp_ptr,
    gkl_ptr,
    gv_ptr,
    gvr_ptr,
    N,
    H,
    W,
    HAS_LP: tl.constexpr,
    HAS_KL: tl.constexpr,
    VR_GRAD: tl.constexpr,
    TOKENS: tl.constexpr,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # elementwise over the flattened sample: contiguous, whatever the reduction of the forward
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < N
    offs = b * N + idx
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.full([BLOCK], 0.0, tl.float32)
    if HAS_LP:
        ca = tl.load(coef_ptr + b * _NUM_COEFS + _CA)
        cb = tl.load(coef_ptr + b * _NUM_COEFS + _CB)
        glp = tl.load(coef_ptr + b * _NUM_COEFS + _GLP)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        d = s - (ca * x + cb * v)
        if TOKENS:
            hw = idx % (H * W)
            tok = (hw // W // P) * (W // P) + (hw % W) // P
            alpha = tl.load(glp_ptr + b * ((H // P) * (W // P)) + tok, mask=mask, other=0.0) * glp
        else:
            alpha = tl.load(glp_ptr + b) * glp
        g += alpha * d
    if HAS_KL:
        beta = tl.load(gkl_ptr + b) * tl.load(coef_ptr + b * _NUM_COEFS + _GKL)
        vr = tl.load(vr_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        kd = beta * (v - vr)
        g += kd
        if VR_GRAD:
            tl.store(gvr_ptr + offs, (-kd).to(gvr_ptr.dtype.element_ty), mask=mask)
    tl.store(gv_ptr + offs, g.to(gv_ptr.dtype.element_ty), mask=mask)


def sde_logprob_fwd(
    x_t: torch.Tensor,
    v: torch.Tensor,
    sample: torch.Tensor,
    v_ref: torch.Tensor | None,
    coef: torch.Tensor,
    patch_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Host wrapper of the forward: (log_prob float32 [B] or [B, L], kl float32 [B] or None)."""
    cfg = tile_config(x_t, patch_size)
    b, n = x_t.shape[0], x_t[0].numel() if x_t.shape[0] else 0
    grid, n_prog = cfg.pop("grid"), cfg.pop("n_prog")
    has_kl = v_ref is not None
    alloc = torch.empty if b and n else torch.zeros  # every slot is written by exactly one program
    partial = alloc((b, n_prog), dtype=torch.float32, device=x_t.device)
    partial_kl = alloc((b, grid[0] if has_kl else 0), dtype=torch.float32, device=x_t.device)
    if b and n:
        with on_device(x_t.device):
            launcher(_sde_logprob_fwd_kernel, x_t.device)[grid](
                x_t, v, sample, v_ref if has_kl else x_t, coef, partial, partial_kl,
                n, n_prog, partial_kl.shape[1], **cfg, HAS_KL=has_kl, **LAUNCH,
            )  # fmt: skip
    log_prob = finish_log_prob(partial, coef, patch_size)
    kl = partial_kl.sum(dim=1) * coef[:, KL_SCALE] if has_kl else None
    return log_prob, kl


def sde_logprob_bwd(
    x_t: torch.Tensor,
    v: torch.Tensor,
    sample: torch.Tensor,
    v_ref: torch.Tensor | None,
    coef: torch.Tensor,
    patch_size: int | None,
    grad_log_prob: torch.Tensor | None,
    grad_kl: torch.Tensor | None,
    v_ref_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Host wrapper of the backward: (grad_v in v's dtype, grad_v_ref in v_ref's dtype or None)."""
    b, n = x_t.shape[0], x_t[0].numel() if x_t.shape[0] else 0
    has_lp, has_kl = grad_log_prob is not None, grad_kl is not None and v_ref is not None
    vr_grad = has_kl and v_ref_grad
    # The interpreter rounds float32 -> bfloat16 by truncation: on CPU store float32 and let torch round.
    interpret = x_t.device.type == "cpu"
    gv = torch.empty(v.shape, dtype=torch.float32 if interpret else v.dtype, device=v.device)
    gvr = torch.empty(v.shape, dtype=torch.float32 if interpret else v_ref.dtype, device=v.device) if vr_grad else None
    if b and n:
        h, w = (x_t.shape[2], x_t.shape[3]) if patch_size else (1, 1)
        glp = grad_log_prob.float().contiguous() if has_lp else coef
        gkl = grad_kl.float().contiguous() if has_kl else coef
        with on_device(x_t.device):
            launcher(_sde_logprob_bwd_kernel, x_t.device)[(triton.cdiv(n, BLOCK), b)](
                x_t, v, sample, v_ref if has_kl else v, coef, glp, gkl, gv, gvr if vr_grad else gv,
                n, h, w, HAS_LP=has_lp, HAS_KL=has_kl, VR_GRAD=vr_grad, TOKENS=bool(patch_size),
                P=patch_size or 1, BLOCK=BLOCK, **LAUNCH,
            )  # fmt: skip
    else:
        gv.zero_()
        if vr_grad:
            gvr.zero_()
    if interpret:
        gv = gv.to(v.dtype)
        gvr = gvr.to(v_ref.dtype) if vr_grad else None
    return gv, gvr


class SdeLogprobFunction(torch.autograd.Function):
    """log_prob (and kl) of a stored sample, differentiable w.r.t. v and v_ref; backward recomputes."""

    @staticmethod
    def forward(ctx, x_t, v, sample, v_ref, coef, patch_size):
        log_prob, kl = sde_logprob_fwd(x_t, v, sample, v_ref, coef, patch_size)
        ctx.save_for_backward(x_t, v, sample, v_ref, coef)
        ctx.patch_size = patch_size
        ctx.set_materialize_grads(False)
        if kl is None:
            kl = torch.empty(0, dtype=torch.float32, device=x_t.device)
            ctx.mark_non_differentiable(kl)
        return log_prob, kl

    @staticmethod
    def backward(ctx, grad_log_prob, grad_kl):
        if torch.is_grad_enabled():  # backward(create_graph=True): the kernels give no second derivative
            raise RuntimeError(SECOND_DERIVATIVE)
        x_t, v, sample, v_ref, coef = ctx.saved_tensors
        if v_ref is None:
            grad_kl = None
        grad_v, grad_v_ref = sde_logprob_bwd(
            x_t, v, sample, v_ref, coef, ctx.patch_size, grad_log_prob, grad_kl, ctx.needs_input_grad[3]
        )
        return None, grad_v, None, grad_v_ref, None, None
