"""What the benchmarks print about the machine they ran on, and the one setting they give it.

OpenMP workers that spin between parallel regions (libgomp's default) lose their share of a core
that another process wants, and every parallel region then waits a scheduler slice (~8 ms on the
2-core benchmark machine) for them: timings measure the neighbours, not the code. Sleeping workers
(OMP_WAIT_POLICY=PASSIVE) wake within microseconds. libgomp reads the variable when torch loads it,
so conftest.py imports this module before torch; a value set in the environment is kept.
"""

import os
import platform
import sys

#: Whether the caller's environment set OMP_WAIT_POLICY (else these benchmarks set it).
OMP_POLICY_FROM_CALLER = "OMP_WAIT_POLICY" in os.environ
#: Whether OMP_WAIT_POLICY reached libgomp: set before torch was loaded, or by the caller's environment.
OMP_POLICY_IN_EFFECT = "torch" not in sys.modules or OMP_POLICY_FROM_CALLER
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def setting(name: str, default: int, minimum: int = 1) -> int:
    """A whole-number size from the environment ($STEPFAST_BENCH_*), or `default`: the session stops
    naming it when it is no whole number >= `minimum`, before any work (rather than a median of
    nothing after minutes of runs)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        import pytest

        pytest.exit(f"${name} must be a whole number >= {minimum}, got {raw!r}", returncode=4)
    return value


def run_environment() -> dict[str, str]:
    """The environment for a training run that a benchmark starts: the caller's, without the wait
    policy these benchmarks set for themselves, so that the run is timed as `make train` runs."""
    env = dict(os.environ)
    if not OMP_POLICY_FROM_CALLER:
        env.pop("OMP_WAIT_POLICY", None)
    return env


def omp_policy() -> str:
    """OMP_WAIT_POLICY as the benchmark tables print it."""
    late = "" if OMP_POLICY_IN_EFFECT else " requested too late: torch was loaded first"
    return f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}{late}"


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
