"""Fused kernels for the SDE step and its log-probability (installed as stepfast.kernels).

    sde_step_with_logprob(kind, x_t, v, t, s, noise, ...) -> (sample, log_prob)     rollout, no grad
    sde_logprob(kind, x_t, v, t, s, sample, v_ref=None, ...) -> (log_prob, kl)       training, grad to v

Each reproduces `stepfast.sde` (and `stepfast.loss.kl_to_reference`) in one pass over memory; the
backend (triton on CUDA, C++ on CPU, torch as reference and fallback) is chosen by `select_backend`,
forced per process with STEPFAST_KERNELS=torch|cpp|triton or per call with backend=.
"""

# From the repository root this folder is also importable as a top-level `kernels`, the name of the
# Hugging Face kernels package, and transformers imports `kernels` to probe for it. Under that name
# the package stays empty: it registers nothing (the torch.library ops are registered once, by
# stepfast.kernels) and transformers concludes, rightly, that the Hugging Face package is absent.
# Its submodules cannot be imported under it either (`from kernels import sde_logprob` would bind the
# Triton op module, and `kernels.dispatch` would register the ops a second time): import
# stepfast.kernels.
if __name__ != "stepfast.kernels":
    __path__ = []
else:
    # The Triton op modules are named after the ops (sde_step.py, sde_logprob.py). Importing a
    # submodule binds its name on this package, so they are imported before the functions of the same
    # name, which then stay what `stepfast.kernels.sde_logprob` means. Without triton there is no such
    # backend (see select_backend).
    try:
        from . import sde_logprob as _sde_logprob_ops  # noqa: F401
        from . import sde_step as _sde_step_ops  # noqa: F401
    except ImportError:
        pass

    from .dispatch import (
        BACKENDS,
        ENV_VAR,
        LogProbAndKL,
        StepWithLogProb,
        sde_logprob,
        sde_step_with_logprob,
        select_backend,
    )

    __all__ = [
        "BACKENDS",
        "ENV_VAR",
        "LogProbAndKL",
        "StepWithLogProb",
        "sde_logprob",
        "sde_step_with_logprob",
        "select_backend",
    ]
