"""The C++ (CPU) backend: the ops of csrc/ as torch.ops.stepfast.*, with their fake (meta) kernels and
the autograd formula of sde_logprob, so they run eagerly, under autograd and under torch.compile.

    sde_step(x_t, v, noise, coef, patch_size, with_logprob) -> (sample, log_prob)
    sde_logprob(x_t, v, sample, v_ref?, coef, patch_size, save_residuals) -> (log_prob, kl, residual, dv)
    sde_logprob_backward(residual, dv, coef, grad_log_prob?, grad_kl?, ...) -> (grad_v, grad_v_ref)
    sde_logprob_backward_(residual!, dv!, coef, grad_log_prob?, grad_kl?, ...)     the same, in place

`coef` is the table of kernels/coefficients.py. The forward saves the float32 residuals (sample - mean,
v - v_ref) when a gradient is needed; the backward is one pass over them. In eager mode with float32
velocities the backward turns the residuals into the gradients in place (no allocation, one read and
one write per element: ~1.6x faster than writing a new tensor at (24, 16, 64, 64) on the 2-core CPU);
the residuals are workspace that stepfast.kernels never returns.

csrc/ is built into stepfast._C by setup.py (`pip install --no-build-isolation -e .`). When it is
missing, AVAILABLE is False and REASON says why; the dispatcher then falls back to the torch backend.
"""

from __future__ import annotations

import torch

from stepfast import sde

from .coefficients import SECOND_DERIVATIVE

try:
    import stepfast._C  # noqa: F401  (loading the library registers torch.ops.stepfast.*)

    AVAILABLE, REASON = True, ""
except ImportError as exc:  # not built, or built against another torch
    AVAILABLE, REASON = False, f"{type(exc).__name__}: {exc}"


def _log_prob_shape(x: torch.Tensor, patch_size: int) -> tuple[int, ...]:
    """The op's log-prob shape: per patch when patch_size (the ops' 0 is none), else per sample."""
    return sde.log_prob_shape(x, "tokens" if patch_size else "mean", patch_size)


if AVAILABLE:

    @torch.library.register_fake("stepfast::sde_step")
    def _sde_step_fake(x_t, v, noise, coef, patch_size, with_logprob):
        f32 = dict(dtype=torch.float32, device=x_t.device)
        return torch.empty(x_t.shape, **f32), torch.empty(_log_prob_shape(x_t, patch_size), **f32)

    @torch.library.register_fake("stepfast::sde_logprob")
    def _sde_logprob_fake(x_t, v, sample, v_ref, coef, patch_size, save_residuals):
        f32 = dict(dtype=torch.float32, device=x_t.device)
        kl = torch.empty((x_t.shape[0],) if v_ref is not None else (0,), **f32)
        res = torch.empty(x_t.shape if save_residuals else (0,), **f32)
        dv = torch.empty(x_t.shape if save_residuals and v_ref is not None else (0,), **f32)
        return torch.empty(_log_prob_shape(x_t, patch_size), **f32), kl, res, dv

    @torch.library.register_fake("stepfast::sde_logprob_backward")
    def _sde_logprob_backward_fake(residual, dv, coef, grad_log_prob, grad_kl, patch_size, v_dtype, v_ref_dtype):
        grad_v = torch.empty(residual.shape, dtype=v_dtype, device=residual.device)
        if grad_kl is not None and v_ref_dtype is not None:
            return grad_v, torch.empty(residual.shape, dtype=v_ref_dtype, device=residual.device)
        return grad_v, torch.empty((0,), dtype=torch.float32, device=residual.device)

    @torch.library.register_fake("stepfast::sde_logprob_backward_")
    def _sde_logprob_backward_inplace_fake(residual, dv, coef, grad_log_prob, grad_kl, patch_size, v_ref_grad):
        return None

    def _setup_context(ctx, inputs, output):
        x_t, v, sample, v_ref, coef, patch_size, save_residuals = inputs
        _, _, residual, dv = output
        ctx.save_for_backward(residual, dv, coef)
        # For a second backward through this node (retain_graph=True): the first one turned the saved
        # residuals into the gradients in place, so the second recomputes them from the inputs, kept as
        # references here (not saved tensors, so that the first backward does not need them unchanged).
        ctx.inputs = (x_t, v, sample, v_ref, coef)
        ctx.versions = tuple(u._version if u is not None else None for u in ctx.inputs)  # checked then
        ctx.consumed = False
        ctx.mark_non_differentiable(residual, dv)
        ctx.set_materialize_grads(False)  # no zero gradients of the residuals' size
        ctx.patch_size = patch_size
        ctx.saved_residuals = save_residuals
        ctx.v_dtype = v.dtype
        ctx.v_ref_dtype = v_ref.dtype if v_ref is not None else None

    def _backward(ctx, grad_log_prob, grad_kl, grad_residual, grad_dv):
        if torch.is_grad_enabled():  # backward(create_graph=True): the kernels give no second derivative
            raise RuntimeError(SECOND_DERIVATIVE)
        if not ctx.saved_residuals:
            raise RuntimeError(
                "stepfast::sde_logprob was called with save_residuals=False but its gradient is needed: "
                "call it through stepfast.kernels.sde_logprob, which saves them when v requires grad"
            )
        if ctx.v_ref_dtype is None:
            grad_kl = None
        want_vr = ctx.v_ref_dtype is not None and ctx.needs_input_grad[3] and grad_kl is not None
        if ctx.consumed:  # a second backward through this node: the residuals are the first gradients
            _check_unchanged(ctx)
            x_t, v, sample, v_ref, coef = ctx.inputs
            with torch.no_grad():
                _, _, residual, dv = torch.ops.stepfast.sde_logprob(x_t, v, sample, v_ref, coef, ctx.patch_size, True)
        else:
            residual, dv, coef = ctx.saved_tensors
        # In place (no allocation, one read and one write per element) for float32 gradients, in eager
        # mode; traced code (torch.compile: fake or functional tensors) takes the functional op.
        in_place = (
            not ctx.consumed
            and type(residual) is torch.Tensor
            and ctx.v_dtype == torch.float32
            and (not want_vr or ctx.v_ref_dtype == torch.float32)
        )
        if in_place:
            ctx.consumed = True
            torch.ops.stepfast.sde_logprob_backward_(residual, dv, coef, grad_log_prob, grad_kl, ctx.patch_size, want_vr)
            grad_v, grad_v_ref = residual, dv
        else:
            grad_v, grad_v_ref = torch.ops.stepfast.sde_logprob_backward(
                residual, dv, coef, grad_log_prob, grad_kl, ctx.patch_size, ctx.v_dtype,
                ctx.v_ref_dtype if want_vr else None,
            )  # fmt: skip
        return (
            None,
            grad_v if ctx.needs_input_grad[1] else None,
            None,
            grad_v_ref if want_vr else None,
            None,
            None,
            None,
        )

    torch.library.register_autograd("stepfast::sde_logprob", _backward, setup_context=_setup_context)

    def _check_unchanged(ctx) -> None:
        """The inputs a second backward recomputes the residuals from are those of the forward: one
        changed in place since (a rollout buffer reused) would give other gradients without a word;
        an error, as autograd gives for a saved tensor changed so."""
        names = ("x_t", "v", "sample", "v_ref", "coef")
        changed = [name for name, u, version in zip(names, ctx.inputs, ctx.versions)
                   if u is not None and u._version != version]  # fmt: skip
        if changed:
            raise RuntimeError(
                f"{' and '.join(changed)} of stepfast's sde_logprob {'was' if len(changed) == 1 else 'were'} modified "
                "by an inplace operation after its forward: a second backward through it (retain_graph=True) "
                "recomputes from its inputs, which must be as they were; clone them before changing them"
            )


def sde_step(x_t, v, noise, coef, patch_size: int | None, with_logprob: bool):
    return torch.ops.stepfast.sde_step(x_t, v, noise, coef, patch_size or 0, with_logprob)


def sde_logprob(x_t, v, sample, v_ref, coef, patch_size: int | None, save_residuals: bool):
    log_prob, kl, _, _ = torch.ops.stepfast.sde_logprob(x_t, v, sample, v_ref, coef, patch_size or 0, save_residuals)
    return log_prob, kl if v_ref is not None else None
