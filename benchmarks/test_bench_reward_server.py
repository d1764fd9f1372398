"""Batched scoring throughput of the `shapes` reward through the reward server vs in-process.

The server path pays for PNG encoding, base64 and JSON, loopback HTTP and PNG decoding on top of the
same reward call; this prints images/s of each (median over rounds, with 20th/80th percentiles) and
their ratio, measured side by side in one run on one machine.

    make bench            # or: python -m pytest benchmarks/test_bench_reward_server.py --benchmark-enable -s
"""

import os
import platform
import threading
import time

import numpy as np
import pytest

from stepfast import rewards
from stepfast.data.shapeeval import load_metadata, render_batch
from stepfast.reward_server import RewardServer

BATCH = 64
SIZE = 128
ROUNDS = 7


def throughputs(fns: dict, rounds: int = ROUNDS) -> dict[str, tuple[float, float, float]]:
    """Images/s of each fn() over `rounds` timed calls after one warm-up each, the calls interleaved
    (a, b, a, b, ...) so that a change in the shared machine's load falls on both: {name: (median,
    p20, p80)}."""
    for fn in fns.values():
        fn()
    rates = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            began = time.perf_counter()
            fn()
            rates[name].append(BATCH / (time.perf_counter() - began))
    return {name: (float(np.median(r)), float(np.percentile(r, 20)), float(np.percentile(r, 80)))
            for name, r in rates.items()}  # fmt: skip


@pytest.fixture(scope="module")
def batch():
    metas = (load_metadata("train") * 2)[:BATCH]
    return render_batch(metas, size=SIZE, seed=0), [m["prompt"] for m in metas]


def test_reward_server_throughput_vs_in_process(benchmark, batch):
    images, prompts = batch
    local = rewards.load("shapes")
    server = RewardServer({"shapes": rewards.load("shapes")}, "127.0.0.1", 0, batch_size=BATCH)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        remote = rewards.load("remote", url=server.url, rewards=["shapes"], batch_size=BATCH, retries=0, timeout=60)
        expected = local.score(images, prompts)["score"]
        assert (remote.score(images, prompts)["score"] == expected).all()

        measured = throughputs({"in-process": lambda: local.score(images, prompts),
                                "reward server": lambda: remote.score(images, prompts)})  # fmt: skip
        in_process, served = measured["in-process"], measured["reward server"]
        benchmark.pedantic(remote.score, args=(images, prompts), rounds=3, iterations=1)
    finally:
        server.shutdown()
        server.server_close()

    print(f"\nshapes reward, batch {BATCH} of {SIZE}x{SIZE} images, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    for name, (median, p20, p80) in (("in-process", in_process), ("reward server", served)):
        print(f"  {name:14s} {median:9.1f} images/s  (p20 {p20:.1f}, p80 {p80:.1f})")
    print(f"  server / in-process throughput: {served[0] / in_process[0]:.2f}x")
