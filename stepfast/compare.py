"""Compare training configurations over seeds, everything else equal: `python -m stepfast.compare SPEC`.

SPEC is a YAML file (see `benchmarks/compare/`):

    name: credit                # results go to benchmarks/results/compare-<name>/
    metric: score               # the eval metric of the curves: score | strict
    seeds: [0, 1, 2]
    common: "iterations=60"     # overrides every run gets (train.py's command line)
    runs:                       # name: overrides; the first is the baseline
      stepwise: ""
      flow_grpo: "credit=flow_grpo"
    claims:                     # optional: what to decide, each run against the first it names
      - {claim: "stepwise beats flow_grpo", runs: [stepwise, flow_grpo]}

Each run is `train.py` as `make train` starts it (one rank per GPU, or two CPU ranks), in
`<results>/runs/<name>-seed<S>/`. A run that finished is skipped, one that stopped is resumed from
its checkpoint (resume=auto), so the command can be stopped and started again at any time; runs go
seed by seed, so that a partial comparison holds every configuration for the seeds it has. A
finished run keeps its metrics, evaluations and config, not its checkpoints. The summary
(results.md, results.json, curves.png) is rewritten after every run: mean ± standard error over
seeds of the eval metric against iteration and against training seconds (evaluations not counted),
a table, and each claim's verdict: a difference within two standard errors is "not separable".
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from stepfast.report import eval_iteration

ROOT = Path(__file__).resolve().parent.parent
TRAIN = Path(__file__).resolve().parent / "train.py"


@dataclass
class Spec:
    name: str
    runs: dict[str, list[str]]
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    metric: str = "score"
    common: list[str] = field(default_factory=list)
    claims: list[dict] = field(default_factory=list)


def _words(value, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"{where}: expected a string of overrides or a list of strings, got {value!r}")


def read_spec(path: Path) -> Spec:
    """The comparison in `path`, checked: every error names the key that holds it."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read the comparison: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping with name and runs")
    unknown = set(raw) - {"name", "runs", "seeds", "metric", "common", "claims"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)} (name, runs, seeds, metric, common, claims)")
    name = raw.get("name")
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"{path}: name: expected a folder name, got {name!r}")
    runs = raw.get("runs")
    if not isinstance(runs, dict) or not runs:
        raise ValueError(f"{path}: runs: expected a mapping of run names to overrides")
    seeds = raw.get("seeds", [0, 1, 2])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ValueError(f"{path}: seeds: expected a list of whole numbers, got {seeds!r}")
    metric = raw.get("metric", "score")
    if metric not in ("score", "strict"):
        raise ValueError(f"{path}: metric: expected score or strict, got {metric!r}")
    spec = Spec(name, {str(k): _words(v, f"{path}: runs.{k}") for k, v in runs.items()}, seeds, metric,
                _words(raw.get("common"), f"{path}: common"), raw.get("claims") or [])
    for i, claim in enumerate(spec.claims):
        pair = claim.get("runs") if isinstance(claim, dict) else None
        if not (isinstance(pair, list) and len(pair) == 2 and all(r in spec.runs for r in pair)):
            raise ValueError(f"{path}: claims[{i}]: expected {{claim: text, runs: [A, B]}} naming two of "
                             f"{list(spec.runs)}, got {claim!r}")
    return spec


def run_dir(out: Path, run: str, seed: int) -> Path:
    return out / "runs" / f"{run}-seed{seed}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(args: list[str], ranks: int) -> tuple[list[str], dict[str, str]]:
    """train.py with `args`, as `make train` starts it: DeepSpeed's launcher for several ranks (on
    a free port, so that another run on the host does not clash), plain Python for one."""
    env = dict(os.environ)
    cuda = _cuda_devices()
    if not cuda:
        env.setdefault("DS_ACCELERATOR", "cpu")
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
    if ranks == 1:
        return [sys.executable, str(TRAIN), *args], env
    deepspeed = Path(sys.executable).with_name("deepspeed")
    launcher = [str(deepspeed)] if deepspeed.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]
    return [*launcher, "--num_gpus", str(ranks), "--master_port", str(_free_port()), str(TRAIN), *args], env


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def train_one(spec: Spec, out: Path, run: str, seed: int, ranks: int) -> float:
    """Train (or finish) one run; returns its wall-clock seconds. A failure raises with the log's tail."""
    folder = run_dir(out, run, seed)
    folder.mkdir(parents=True, exist_ok=True)
    args = [*spec.common, *spec.runs[run], f"seed={seed}", f"output_dir={folder}", "resume=auto",
            "log.tensorboard=false", "log.report=false"]
    cmd, env = launch_command(args, ranks)
    start = time.perf_counter()
    with open(folder / "train.log", "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    seconds = time.perf_counter() - start
    if code != 0:
        tail = (folder / "train.log").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{run} seed {seed} failed (exit {code}); {folder / 'train.log'} ends:\n  "
                           + "\n  ".join(tail))
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)  # the curves need none; each is megabytes
    (folder / "done.json").write_text(json.dumps({"command": cmd, "seconds": seconds}, indent=1))
    return seconds


# -------------------------------------------------------------------------------------------------
# Reading and summarising


def read_curve(folder: Path, metric: str) -> dict | None:
    """One finished run's eval curve: iterations, training seconds at each (cumulative
    time/iteration, evaluations excluded) and the metric; None while unfinished."""
    if not (folder / "done.json").exists():
        return None
    with open(folder / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    elapsed, clock = {0: 0.0}, 0.0
    for row in rows:
        clock += float(row["time/iteration"])
        elapsed[int(row["iteration"])] = clock
    last = int(rows[-1]["iteration"])
    points = []
    for path in folder.glob("eval_*.json"):
        it = eval_iteration(path.stem[len("eval_"):], last)
        if it is not None:  # not one a resume set aside (eval_after-before-41.json)
            points.append((it, json.loads(path.read_text())["overall"][metric]))
    points.sort()
    return {"iterations": [p[0] for p in points], "seconds": [elapsed[p[0]] for p in points],
            "values": [p[1] for p in points], "s_per_it": clock / max(1, len(rows))}


def mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else float("nan")
    return mean, se


def at_seconds(curve: dict, seconds: float) -> float:
    """The metric of a curve at `seconds` of training, linear between evaluations."""
    xs, ys = curve["seconds"], curve["values"]
    if seconds >= xs[-1]:
        return ys[-1]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= seconds <= x1:
            return y0 + (y1 - y0) * (seconds - x0) / (x1 - x0) if x1 > x0 else y1
    return ys[0]


def first_reaching(xs: list[float], ys: list[float], target: float) -> float | None:
    """The first x at which a curve reaches `target`, linear between points; None if it never does."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y1 >= target:
            return x0 if y0 >= target else x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    return xs[0] if ys and ys[0] >= target else None


def verdict(a: tuple[float, float], b: tuple[float, float]) -> str:
    diff, se = a[0] - b[0], math.hypot(a[1], b[1])
    if not math.isfinite(se):
        return f"{diff:+.3f} (one seed: no standard error)"
    if abs(diff) <= 2 * se:
        return f"{diff:+.3f} ± {se:.3f}: not separable"
    return f"{diff:+.3f} ± {se:.3f}: {'confirmed' if diff > 0 else 'refuted'}"


def claim_name(claim: dict) -> str:
    return claim.get("claim") or "{} beats {}".format(*claim["runs"])


def summarise(spec: Spec, out: Path) -> dict:
    """Every finished run's curve, per configuration the mean ± se over seeds, and the claims."""
    curves = {run: {s: c for s in spec.seeds if (c := read_curve(run_dir(out, run, s), spec.metric))}
              for run in spec.runs}  # fmt: skip
    summary: dict = {"metric": spec.metric, "runs": {}, "claims": []}
    for run, by_seed in curves.items():
        if not by_seed:
            continue
        cs = list(by_seed.values())
        iters = cs[0]["iterations"]
        if any(c["iterations"] != iters for c in cs):
            raise ValueError(f"{run}: its seeds were evaluated at different iterations")
        summary["runs"][run] = {
            "seeds": list(by_seed),
            "iterations": iters,
            "seconds": [mean_se([c["seconds"][i] for c in cs])[0] for i in range(len(iters))],
            "values": [mean_se([c["values"][i] for c in cs]) for i in range(len(iters))],
            "gain": mean_se([c["values"][-1] - c["values"][0] for c in cs]),
            "s_per_it": mean_se([c["s_per_it"] for c in cs]),
            "curves": by_seed,
        }
    done = summary["runs"]
    if done:  # equal wall-clock: the shortest configuration's training time
        budget = min(r["seconds"][-1] for r in done.values())
        summary["equal_seconds"] = budget
        for r in done.values():
            r["at_equal_seconds"] = mean_se([at_seconds(c, budget) for c in r["curves"].values()])
        base = done.get(next(iter(spec.runs)))
        for r in done.values():
            r["to_baseline"] = None if base is None else first_reaching(
                r["seconds"], [v[0] for v in r["values"]], base["values"][-1][0])
    for claim in spec.claims:
        a, b = claim["runs"]
        if a in done and b in done:
            summary["claims"].append({
                "claim": claim_name(claim), "runs": [a, b],
                "per_iteration": verdict(done[a]["gain"], done[b]["gain"]),
                "per_second": verdict(done[a]["at_equal_seconds"], done[b]["at_equal_seconds"]),
            })
    return summary


def _pm(value: tuple[float, float], signed: bool = False) -> str:
    """mean ± se, or the mean alone for one seed."""
    mean = f"{value[0]:+.3f}" if signed else f"{value[0]:.3f}"
    return mean if math.isnan(value[1]) else f"{mean} ± {value[1]:.3f}"


def markdown(spec: Spec, summary: dict, command: str, host: str) -> str:
    runs = summary["runs"]
    lines = [f"# Comparison `{spec.name}`", "", f"`{command}`", "", host, "",
             f"Eval metric: overall {summary['metric']}, mean ± standard error over training seeds; "
             f"seconds are training time (evaluations not counted). Common overrides: "
             f"`{shlex.join(spec.common) or '(none)'}`.", ""]
    if not runs:
        return "\n".join(lines + ["No run has finished yet."]) + "\n"
    baseline = next(iter(spec.runs))
    iters = sorted({i for r in runs.values() for i in r["iterations"]})
    head = ["run", "overrides", "seeds", *(f"it {i}" for i in iters), "gain", "s/it",
            f"at {summary['equal_seconds']:.0f} s", "s to baseline"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in runs.items():
        at = dict(zip(r["iterations"], r["values"]))
        cells = [name, f"`{shlex.join(spec.runs[name]) or '(default)'}`", str(len(r["seeds"])),
                 *(_pm(at[i]) if i in at else "" for i in iters),
                 _pm(r["gain"], signed=True), f"{r['s_per_it'][0]:.2f}", _pm(r["at_equal_seconds"]),
                 "(baseline not run)" if baseline not in runs
                 else "not reached" if r["to_baseline"] is None else f"{r['to_baseline']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Baseline: `{baseline}`; 's to baseline': training seconds until the mean "
              "curve first reaches the baseline's final value.", "", "![curves](curves.png)", ""]
    if summary["claims"]:
        lines += ["| claim | per iteration (final gain, A - B) | at equal training time (A - B) |",
                  "|---|---|---|"]
        lines += [f"| {c['claim']} (`{c['runs'][0]}` vs `{c['runs'][1]}`) | {c['per_iteration']} | "
                  f"{c['per_second']} |" for c in summary["claims"]]
        lines += ["", "A difference within two standard errors is not separable at this scale."]
    decided = {c["claim"] for c in summary["claims"]}
    if waiting := [name for c in spec.claims if (name := claim_name(c)) not in decided]:
        lines += ["", "Waiting for runs: " + "; ".join(waiting) + "."]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for n, (name, r) in enumerate(summary["runs"].items()):
        mean = [v[0] for v in r["values"]]
        se = [0.0 if math.isnan(v[1]) else v[1] for v in r["values"]]
        for ax, x in zip(axes, (r["iterations"], r["seconds"])):
            seeds = len(r["seeds"])
            label = f"{name} ({seeds} seed{'s' if seeds > 1 else ''})"
            ax.plot(x, mean, "o-", color=f"C{n}", label=label, markersize=3)
            ax.fill_between(x, [m - s for m, s in zip(mean, se)], [m + s for m, s in zip(mean, se)],
                            color=f"C{n}", alpha=0.2)
    axes[0].set_xlabel("iteration")
    axes[1].set_xlabel("training seconds (evaluations not counted)")
    axes[0].set_ylabel(f"eval overall {summary['metric']} (mean ± se over seeds)")
    axes[0].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def host_line() -> str:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:
            return "unknown"

    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"Written at commit {git('rev-parse', '--short', 'HEAD')}{dirty}; {time.strftime('%Y-%m-%d')}; "
            f"{os.cpu_count()} cores of {cpu}.")


def write_summary(spec: Spec, out: Path, command: str) -> dict:
    summary = summarise(spec, out)
    host = host_line()
    (out / "results.md").write_text(markdown(spec, summary, command, host))
    (out / "results.json").write_text(json.dumps({"command": command, "host": host, **summary}, indent=1))
    if summary["runs"]:
        plot(summary, out / "curves.png")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepfast.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path, help="the comparison's YAML file (e.g. benchmarks/compare/credit.yaml)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: "
                        "benchmarks/results/compare-<name>)")
    parser.add_argument("--ranks", type=int, default=None, help="ranks per run (default: one per GPU, or 2 CPU ranks)")
    parser.add_argument("--only", default=None, help="comma-separated runs to train (the summary reads all)")
    parser.add_argument("--summarise", action="store_true", help="train nothing: rewrite the summary")
    args = parser.parse_args(argv)
    try:
        spec = read_spec(args.spec)
    except ValueError as exc:
        parser.error(str(exc))
    only = args.only.split(",") if args.only else list(spec.runs)
    if unknown := [r for r in only if r not in spec.runs]:
        parser.error(f"--only: no run named {unknown[0]!r} in {args.spec} (runs: {', '.join(spec.runs)})")
    out = args.out or ROOT / "benchmarks" / "results" / f"compare-{spec.name}"
    out.mkdir(parents=True, exist_ok=True)
    # the command that makes these results (--only and --summarise choose what to run, not what they are)
    out_args = ["--out", str(args.out)] if args.out else []
    command = shlex.join(["python", "-m", "stepfast.compare", str(args.spec), *out_args])
    ranks = args.ranks or _cuda_devices() or 2
    plan = [(run, seed) for seed in spec.seeds for run in only]
    todo = [(run, seed) for run, seed in plan if not (run_dir(out, run, seed) / "done.json").exists()]
    print(f"compare {spec.name}: {len(plan)} runs, {len(plan) - len(todo)} finished, {len(todo)} to train; "
          f"results in {out}", flush=True)
    if not args.summarise:
        took: list[float] = []
        for n, (run, seed) in enumerate(todo, 1):
            left = f", about {sum(took) / len(took) * (len(todo) - n + 1) / 60:.0f} min left" if took else ""
            print(f"[{n}/{len(todo)}] {run} seed {seed} ({run_dir(out, run, seed) / 'train.log'}{left})", flush=True)
            try:
                seconds = train_one(spec, out, run, seed, ranks)
            except KeyboardInterrupt:
                print("compare: stopped; run the same command again to go on", file=sys.stderr)
                return 130
            except RuntimeError as exc:
                print(f"compare: {exc}", file=sys.stderr)
                write_summary(spec, out, command)
                return 1
            took.append(seconds)
            curve = read_curve(run_dir(out, run, seed), spec.metric)
            print(f"    {seconds:.0f} s; {spec.metric} {curve['values'][0]:.3f} -> {curve['values'][-1]:.3f}",
                  flush=True)
            write_summary(spec, out, command)
    summary = write_summary(spec, out, command)
    for claim in summary["claims"]:
        print(f"{claim['claim']}: per iteration {claim['per_iteration']}; per second {claim['per_second']}")
    print(f"compare: {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
