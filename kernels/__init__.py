"""Fused kernels for the SDE step and its log-probability (installed as stepfast.kernels).

    sde_step_with_logprob(kind, x_t, v, t, s, noise, ...) -> (sample, log_prob)     rollout, no grad
    sde_logprob(kind, x_t, v, t, s, sample, v_ref=None, ...) -> (log_prob, kl)       training, grad to v

Each reproduces `stepfast.sde` (and `stepfast.loss.kl_to_reference`) in one pass over memory; the
backend (triton on CUDA, C++ on CPU, torch as reference and fallback) is chosen by `select_backend`,
forced per process with STEPFAST_KERNELS=torch|cpp|triton or per call with backend=.
"""

# From the repository root (`python -m ...` or pytest there, or a script that puts the root on sys.path)
# this folder is also importable as a top-level `kernels`, the name of the Hugging Face kernels
# package, which transformers imports by that name when it is installed (transformers 5 requires it).
# Under that name this folder stands aside: the import loads the Hugging Face package from the rest of
# sys.path in its place, or, where none is installed, an empty package, which registers nothing (the
# torch.library ops are registered once, by stepfast.kernels) and from which transformers concludes,
# rightly, that the Hugging Face package is absent. This folder's submodules are never imported under
# that name (`kernels.dispatch` would register the ops a second time): import stepfast.kernels.
if __name__ != "stepfast.kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    __path__ = []
    if __name__ == "kernels":  # only the top-level name is another package's (`<parent>.kernels` stays empty)
        _here = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
        _elsewhere = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _here]
        _spec = _machinery.PathFinder.find_spec(__name__, _elsewhere)
        if _spec is not None and _spec.loader is not None:
            # the import statement returns what sys.modules holds once this body has run
            _sys.modules[__name__] = _util.module_from_spec(_spec)
            _spec.loader.exec_module(_sys.modules[__name__])
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
