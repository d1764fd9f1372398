"""Build script for the C++ CPU kernels in csrc/ (metadata lives in pyproject.toml)."""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent


def cpp_extensions():
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
    if not sources:
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:  # pragma: no cover - only on a broken build environment
        raise SystemExit(
            "stepfast builds C++ kernels against torch: install torch first, then "
            "`pip install --no-build-isolation .`"
        ) from exc
    ext = CppExtension(
        name="stepfast._C",
        sources=sources,
        # no FMA contraction: the step op and the log-prob op then round mean and residual identically,
        # so the rollout's log-prob and the recomputed one agree bit for bit (kernels/sde_step.py)
        extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"],
        extra_link_args=["-fopenmp"],
    )
    return [ext], {"build_ext": BuildExtension.with_options(no_python_abi_suffix=False)}


ext_modules, cmdclass = cpp_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
