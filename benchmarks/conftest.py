"""Shared by the benchmarks, which `make bench` runs in one process."""

import machine  # noqa: F401  (first: it sets OMP_WAIT_POLICY before torch loads libgomp)
import sys
from pathlib import Path

import pytest
import torch

# the baselines the benchmarks time against live with the tests that check them (tests/)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A benchmark that pins torch to one thread leaves the next one its own thread count."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
