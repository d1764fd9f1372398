"""Set before torch loads (libgomp reads it then): OpenMP workers sleep between parallel regions
instead of spinning. With one pytest-xdist worker per core, each running torch on every core, the
spinning workers of one take the cores the other needs, and each parallel region waits a scheduler
slice for them (see benchmarks/machine.py). Numbers do not change; a value set by the caller is kept."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
