"""Kernel micro-benchmarks: the fused SDE ops against Flow-GRPO's eager code and a copy of the same bytes.

    .venv/bin/python -m pytest benchmarks/test_bench_kernels.py --benchmark-enable -s

For each device (CPU: the C++ backend, float32; CUDA: the Triton backend, with the trainer's dtypes:
float32 states and samples, bfloat16 velocities), shape (24, 16, 64, 64) and (24, 16, 128, 128) and op
    step             sde_step_with_logprob (flow_sde)        vs Flow-GRPO's sde_step_with_logprob
    logprob_fwd      sde_logprob, no grad                    vs Flow-GRPO's log-prob code
    logprob_fwd_bwd  sde_logprob + backward w.r.t. v         vs the same with autograd
three callables are timed: `eager` (tests/flow_grpo_baseline.py, written the way Flow-GRPO writes it: float32
casts, the mean formula, the log-prob per element then a mean over C, H, W, autograd backward),
`fused`, and `copy`: dst.copy_(src) moving the op's minimal bytes (every input read once, every large
output written once), the physical limit. pytest-benchmark records each callable; `test_ratio_table`
times all three side by side (interleaved rounds, one run) and prints medians, 20/80 percentiles and
the ratios. Each case first checks that the fused op's outputs equal the eager code's (to 1e-5 of
their largest entry). Acceptance (C++ backend, CPU, float32, (24, 16, 64, 64), logprob_fwd_bwd): eager / fused
>= 3 and fused / copy <= 2; the table prints both.

On CUDA the GPU tests also print the kernels' achieved HBM bandwidth (bytes / time / peak, peak from
$STEPFAST_HBM_PEAK_BYTES_PER_S, default 4.8e12 for an H200), each case's outputs first checked against
the torch backend (tests/test_kernels.py checks the same cases on CPU, in the Triton
interpreter), and the CUDA-graph estimate engine's speedup over the eager loop on an
SD3.5-Medium-shaped transformer (benchmarks/gpu_check.sh runs them).
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from stepfast.kernels import sde_logprob, sde_step_with_logprob, select_backend
from flow_grpo_baseline import flow_grpo_logprob, flow_grpo_step_with_logprob  # tests/, checked there
from kernel_wrapper_cases import bytes_of, check_wrapper_case, wrapper_cases  # tests/, checked there on CPU
from machine import cpu_name, omp_policy  # OMP_WAIT_POLICY=PASSIVE, set by conftest.py before torch loads

SHAPES = [(24, 16, 64, 64), (24, 16, 128, 128)]
OPS = ["step", "logprob_fwd", "logprob_fwd_bwd"]
IMPLS = ["eager", "fused", "copy"]
CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
ACCEPTANCE = dict(device="cpu", shape=(24, 16, 64, 64), op="logprob_fwd_bwd", min_speedup=3.0, max_vs_copy=2.0)
HBM_PEAK = float(os.environ.get("STEPFAST_HBM_PEAK_BYTES_PER_S", "4.8e12"))


def make_case(device: str, shape: tuple[int, ...], op: str) -> tuple[dict, int]:
    """({impl: callable}, minimal bytes moved) for one op on one shape."""
    g = torch.Generator().manual_seed(0)
    v_dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def rand(dtype=torch.float32):
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    b = shape[0]
    t = torch.full((b,), 0.8, device=device)
    s = torch.full((b,), 0.7, device=device)
    # the fused op takes its times from the host, as the trainer passes them (the time grid lives on
    # the CPU): GPU times would cost it two blocking read-backs per call that training never pays
    t_host, s_host = t.cpu(), s.cpu()
    x, v, other = rand(), rand(v_dtype), rand()  # other: the noise (step) or the stored sample
    grad_lp = torch.full((b,), 1.0 / b, device=device)
    if op == "step":
        nbytes = bytes_of(x, v, other) + x.numel() * 4  # + the float32 sample written

        def eager():
            with torch.no_grad():
                return flow_grpo_step_with_logprob(x, v, t, s, other)

        def fused():
            with torch.no_grad():
                return sde_step_with_logprob("flow_sde", x, v, t_host, s_host, other)

    elif op == "logprob_fwd":
        nbytes = bytes_of(x, v, other)

        def eager():
            with torch.no_grad():
                return flow_grpo_logprob(x, v, t, s, other)

        def fused():
            with torch.no_grad():
                return sde_logprob("flow_sde", x, v, t_host, s_host, other)

    else:
        nbytes = bytes_of(x, v, other) + bytes_of(v)  # + grad_v written

        def eager():
            vg = v.detach().requires_grad_()
            lp, _ = flow_grpo_logprob(x, vg, t, s, other)
            lp.backward(grad_lp)
            return vg.grad

        def fused():
            vg = v.detach().requires_grad_()
            lp, _ = sde_logprob("flow_sde", x, vg, t_host, s_host, other)
            lp.backward(grad_lp)
            return vg.grad

    src = torch.empty(nbytes // 8, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)

    def copy():
        return dst.copy_(src)

    return {"eager": eager, "fused": fused, "copy": copy}, nbytes


def assert_fused_matches_eager(fns: dict, case: str) -> None:
    """What is timed computes the same thing: the fused op's outputs (sample and log-prob, log-prob,
    or grad_v) equal the eager code's to 1e-5 of their largest entry, as tests/test_kernels.py asks
    of every backend against float64 (about 4e-7 measured here on the CPU at both shapes)."""
    eager, fused = fns["eager"](), fns["fused"]()
    pairs = zip(eager, fused) if isinstance(eager, tuple) else [(eager, fused)]
    for i, (want, got) in enumerate((w, g) for w, g in pairs if w is not None):
        want, got = want.double(), got.double()
        assert got.shape == want.shape, f"{case}: output {i} is {tuple(got.shape)}, eager's {tuple(want.shape)}"
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= 1e-5, f"{case}: output {i} of the fused op differs from the eager code's by {err:.2e} of its largest entry"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_side_by_side(fns: dict, device: str, rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of every callable, measured in interleaved rounds (load drifts hit all alike)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    out = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            out[name].append(time.perf_counter() - start)
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def hardware(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"{cpu_name()}, {torch.get_num_threads()} threads, {omp_policy()}, load average " + \
        "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()) + f" (torch {torch.__version__})"


CASE_IDS = [(d, s, o, i) for d in DEVICES for s in SHAPES for o in OPS for i in IMPLS]


@pytest.mark.parametrize(
    "device,shape,op,impl", CASE_IDS, ids=["-".join([d, "x".join(map(str, s)), o, i]) for d, s, o, i in CASE_IDS]
)
def test_bench(benchmark, device, shape, op, impl):
    fns, nbytes = make_case(device, shape, op)
    if impl == "fused":
        assert_fused_matches_eager(fns, f"{device} {shape} {op}")
    fn = fns[impl]
    benchmark.group = f"{device} {'x'.join(map(str, shape))} {op}"
    benchmark.extra_info.update(bytes=nbytes, hardware=hardware(device), backend=select_backend(device))
    if device == "cuda":
        work = fn

        def fn():  # time the work, not just the launch
            work()
            torch.cuda.synchronize()

    benchmark(fn)


@pytest.mark.parametrize("device", DEVICES)
def test_ratio_table(device):
    """Side-by-side medians and ratios of every case on `device`; on CPU, asserts the acceptance ratios."""
    rows, acceptance = [], None
    for shape in SHAPES:
        rounds = 25 if shape[-1] <= 64 else 9
        for op in OPS:
            fns, nbytes = make_case(device, shape, op)
            assert_fused_matches_eager(fns, f"{device} {shape} {op}")
            times = time_side_by_side(fns, device, rounds)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append((shape, op, nbytes, times, med))
            if (device, shape, op) == (ACCEPTANCE["device"], ACCEPTANCE["shape"], ACCEPTANCE["op"]):
                acceptance = med
    lines = [
        "",
        f"Fused SDE ops vs Flow-GRPO eager code vs a copy of the same bytes on {device}: "
        f"median ms [p20, p80], side by side",
        f"  {hardware(device)}; backend {select_backend(device)}",
        f"  {'shape':16} {'op':16} {'MB':>7} {'eager':>22} {'fused':>22} {'copy':>22}"
        f" {'eager/fused':>11} {'fused/copy':>10} {'GB/s fused':>10}",
    ]
    for shape, op, nbytes, times, med in rows:
        cells = [f"{med[k] * 1e3:8.3f} [{_pct(times[k], .2) * 1e3:.2f}, {_pct(times[k], .8) * 1e3:.2f}]" for k in IMPLS]
        lines.append(
            f"  {'x'.join(map(str, shape)):16} {op:16} {nbytes / 1e6:7.1f} "
            + " ".join(f"{c:>22}" for c in cells)
            + f" {med['eager'] / med['fused']:11.2f} {med['fused'] / med['copy']:10.2f} {nbytes / med['fused'] / 1e9:10.1f}"
        )
    if acceptance is None:
        print("\n".join(lines))
        return
    speedup = acceptance["eager"] / acceptance["fused"]
    vs_copy = acceptance["fused"] / acceptance["copy"]
    lines.append(
        f"  ACCEPTANCE {'x'.join(map(str, ACCEPTANCE['shape']))} {ACCEPTANCE['op']} ({select_backend(device)}): "
        f"eager/fused = {speedup:.2f} (>= {ACCEPTANCE['min_speedup']}), "
        f"fused/copy = {vs_copy:.2f} (<= {ACCEPTANCE['max_vs_copy']})"
    )
    print("\n".join(lines))
    assert select_backend("cpu") == "cpp", "the C++ extension is not built: the acceptance is about it"
    assert speedup >= ACCEPTANCE["min_speedup"], f"fused is only {speedup:.2f}x faster than the eager code"
    assert vs_copy <= ACCEPTANCE["max_vs_copy"], f"fused takes {vs_copy:.2f}x a copy of the same bytes"


# ----------------------------------------------------------------------------------------------------
# CUDA only: kernel bandwidth and the CUDA-graph estimate engine


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_kernel_hbm_bandwidth():
    """Achieved HBM bandwidth of the Triton kernels alone (coefficients precomputed; L2 flushed between
    runs by triton.testing.do_bench), as a fraction of $STEPFAST_HBM_PEAK_BYTES_PER_S; each case's
    outputs checked against the torch backend first."""
    from triton.testing import do_bench

    lines = ["", f"Triton ops (host wrappers, coefficients precomputed) on {hardware('cuda')}: "
             f"bytes moved / median time / peak ({HBM_PEAK:.3g} B/s)"]
    for shape in SHAPES + [(24, 16, 256, 256)]:
        for v_dtype in (torch.float32, torch.bfloat16):
            for patch in (None, 2):
                for name, (fn, nbytes, expected) in wrapper_cases(shape, "cuda", v_dtype, patch).items():
                    check_wrapper_case(f"{'x'.join(map(str, shape))} v {str(v_dtype)[6:]} "
                                       f"{'tokens' if patch else 'mean'} {name}", fn, expected)
                    ms = do_bench(fn, warmup=10, rep=40)
                    frac = nbytes / (ms * 1e-3) / HBM_PEAK
                    lines.append(
                        f"  {'x'.join(map(str, shape)):16} v {str(v_dtype)[6:]:8} {'tokens' if patch else 'mean':6} "
                        f"{name:15} {ms * 1e3:8.1f} us {nbytes / 1e6:7.1f} MB "
                        f"{nbytes / (ms * 1e-3) / 1e12:6.2f} TB/s = {frac:5.1%} of peak"
                    )
    print("\n".join(lines))


SD35_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_engine_speedup_sd35_medium():
    """The estimate engine with and without the CUDA graph on an SD3.5-Medium-shaped transformer
    (random weights, bf16, 512 px: 64 x 64 latents), T' = 5 substeps reusing the first velocity."""
    diffusers = pytest.importorskip("diffusers")
    from stepfast.estimates import EstimateEngine

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = diffusers.SD3Transformer2DModel(**SD35_MEDIUM)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    params = sum(p.numel() for p in model.parameters())
    lines = ["", f"CUDA-graph estimate engine, SD3.5-Medium-shaped transformer ({params / 1e9:.2f} B params, bf16)"]
    for m in (2, 8):
        enc = torch.randn(m, 333, 4096, device="cuda", dtype=torch.bfloat16)
        pooled = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)

        def velocity(x, t, enc=enc, pooled=pooled):
            out = model(hidden_states=x.to(torch.bfloat16), encoder_hidden_states=enc, pooled_projections=pooled,
                        timestep=t * 1000, return_dict=False)[0]  # fmt: skip
            return out.float()

        g = torch.Generator(device="cuda").manual_seed(m)
        states = torch.randn(m, 16, 64, 64, device="cuda", generator=g)
        t = torch.rand(m, device="cuda", generator=g) * 0.9 + 0.1
        with torch.no_grad():
            first = velocity(states, t)
        eager = EstimateEngine(velocity, use_cuda_graph=False)
        graph = EstimateEngine(velocity, use_cuda_graph="auto")
        ref = eager(states, t, 5, first)
        out = graph(states, t, 5, first)  # captures
        times = time_side_by_side({"eager": lambda: eager(states, t, 5, first),
                                   "graph": lambda: graph(states, t, 5, first)}, "cuda", rounds=5, warmup=1)  # fmt: skip
        e, c = statistics.median(times["eager"]), statistics.median(times["graph"])
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        how = "CUDA graph" if graph.fallback_reason is None else f"EAGER FALLBACK ({graph.fallback_reason})"
        lines.append(
            f"  M = {m:2d} states x 4 forwards: eager {e * 1e3:8.1f} ms, {how} {c * 1e3:8.1f} ms, "
            f"speedup {e / c:5.2f}x; max |graph - eager| / max |eager| = {err:.2e}"
        )
        assert torch.isfinite(out).all()
        # a speedup of eager over eager, or of a graph that computes something else, is no figure
        assert graph.fallback_reason is None, f"the CUDA graph was not captured: {graph.fallback_reason}"
        assert err <= 1e-2, f"graph and eager differ by {err:.2e} of the largest value (bf16 allows ~4e-3)"
    print("\n".join(lines))
