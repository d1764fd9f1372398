"""Metrics of a run: one CSV row per iteration, TensorBoard scalars, W&B when installed and asked for.

Only rank 0 writes. On resume, rows past the checkpoint's iteration (written by the run that died
after logging them but before checkpointing) are dropped, so the CSV has each iteration once.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from pathlib import Path

from stepfast.files import sync, write_atomically


class MetricsLogger:
    def __init__(self, output_dir, enabled: bool, tensorboard: bool = True, wandb: bool = False,
                 wandb_project: str = "stepfast", config: dict | None = None, resume_from: int = 0,
                 logged: list[dict] | None = None):  # fmt: skip
        """resume_from: the iteration the run continues after; rows past it are dropped. logged: the
        rows of output_dir's metrics.csv when the caller has read them already (`read_logged`)."""
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.csv"
        self.rows: list[dict] = []
        self.tb = self.wandb = None
        self.wandb_has_until = 0  # the last iteration the W&B run holds from a run stopped past its checkpoint
        if not enabled:
            return
        wandb_module = import_wandb() if wandb else None  # before anything is rewritten
        if logged is None and self.path.exists():
            logged = read_logged(self.path)
        if logged is not None:
            self.rows = [r for r in logged if r["iteration"] <= resume_from]
            past = [int(r["iteration"]) for r in logged if r["iteration"] > resume_from]
            if wandb and past:
                # W&B ignores (with a warning per call) a step it holds already: those iterations
                # trained again go to metrics.csv and TensorBoard, and W&B keeps the stopped run's
                self.wandb_has_until = max(past)
                print(f"stepfast: the W&B run holds iterations {resume_from + 1}-{self.wandb_has_until} of the "
                      "run stopped after them; trained again, they are logged to metrics.csv and TensorBoard, "
                      "not to W&B, which keeps the stopped run's points for them")  # fmt: skip
            self._rewrite()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=resume_from + 1)
        if wandb:
            self.wandb = wandb_module.init(project=wandb_project, config=config, dir=str(output_dir),
                                           id=wandb_run_id(output_dir, wandb_module, resume_from > 0),
                                           resume="allow")  # fmt: skip

    def log(self, iteration: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"iteration": iteration, **values}
        self.rows.append(row)
        if set(row) - set(self.rows[0]) or len(self.rows) == 1:
            self._rewrite()
        else:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=list(self.rows[0])).writerow({k: row.get(k, "") for k in self.rows[0]})
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, iteration)
            self.tb.flush()
        if self.wandb is not None and iteration > self.wandb_has_until:
            self.wandb.log(values, step=iteration)

    def _rewrite(self) -> None:
        fields: list[str] = []
        for r in self.rows:
            fields += [k for k in r if k not in fields]
        fields.sort(key=_column_group)  # stable: first-seen order within a group
        self.path.parent.mkdir(parents=True, exist_ok=True)

        def write(tmp: Path) -> None:
            with tmp.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=fields or ["iteration"])
                w.writeheader()
                for r in self.rows:
                    w.writerow({k: r.get(k, "") for k in fields})

        write_atomically(self.path, write)
        if self.rows and list(self.rows[0]) != fields:
            self.rows[0] = {k: self.rows[0].get(k, "") for k in fields}

    def sync(self) -> None:
        """Flush metrics.csv to disk (before a checkpoint: a power loss then keeps the rows it covers)."""
        if self.enabled and self.path.exists():
            sync(self.path)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def import_wandb():
    """The wandb module; an ImportError saying how to install it."""
    try:
        import wandb
    except ImportError as exc:
        raise ImportError("log.wandb=true, but wandb is not installed: pip install 'stepfast[wandb]'") from exc
    return wandb


WANDB_RUN_ID = "wandb_run_id"


def wandb_run_id(output_dir, wandb_module, resuming: bool) -> str:
    """The W&B run id of the run in output_dir: made and kept in output_dir/wandb_run_id when the run
    starts from its first iteration, read back when it resumes, so that a resumed run logs on in the
    W&B run it began (W&B ignores the points it gets again for iterations it already has)."""
    path = Path(output_dir) / WANDB_RUN_ID
    if resuming and path.is_file():
        run_id = path.read_text().strip()
        if run_id:
            return run_id
    run_id = wandb_module.util.generate_id()
    write_atomically(path, lambda tmp: tmp.write_text(run_id + "\n"))
    return run_id


def read_logged(path, required: tuple[str, ...] = ("iteration",),
                advice: str = "repair it, or move it away to start a new log",
                on_cut: Callable[[int], None] | None = None) -> list[dict]:  # fmt: skip
    """The rows of a metrics.csv as the trainer logged them: numbers, "" where a column was not
    logged that iteration. A last line without its newline is a row whose write was cut short (a
    run killed while logging it) and is left out; `on_cut`, when given, is called with its line
    number. A ValueError naming the file, and the line and column at fault, then `advice` (the
    trainer's), when it cannot be read back (the file is left as it is)."""
    try:
        with open(path, newline="") as f:
            text = f.read()
        lines = text.splitlines(keepends=True)
        if len(lines) > 1 and not text.endswith(("\n", "\r")):
            text = "".join(lines[:-1])  # the trainer writes whole rows: this one was cut off
            if on_cut is not None:
                on_cut(len(lines))
        reader = csv.DictReader(io.StringIO(text, newline=""))
        fields = reader.fieldnames or []
        missing = [k for k in required if k not in fields]
        if fields and missing:
            raise ValueError(f"the header has no {missing} column: {fields[:6]}")
        rows = []
        for row in reader:
            where = f"line {reader.line_num}"
            extra, short = row.pop(None, []), sum(v is None for v in row.values())
            if extra or short:  # DictReader's filling: the trainer writes every cell of a row
                raise ValueError(f"{where}: {len(fields) + len(extra) - short} cells, where the header has {len(fields)}")
            values = {k: _cell(v, f"{where}, column {k!r}") for k, v in row.items()}
            if not isinstance(values.get("iteration"), int):
                raise ValueError(f"{where}: iteration {row.get('iteration')!r} is not an integer")
            rows.append(values)
    except (OSError, UnicodeDecodeError, csv.Error, ValueError) as exc:
        raise ValueError(
            f"{path}: cannot read the metrics logged so far ({exc}); {advice}"
        ) from None
    return rows


def _cell(text: str, where: str):
    """A metrics.csv cell: "" (not logged that iteration) or an int or a float."""
    if text == "":
        return ""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    raise ValueError(f"{where}: {text!r} is not a number")


def write_json(path, data) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2)))


def _column_group(key: str) -> tuple:
    """metrics.csv's columns in groups whatever the iteration that first logged them: the iteration,
    the figures, the prompt categories (by name: an iteration draws only some), the times with their
    sum last."""
    if key == "iteration":
        return (0,)
    if key.startswith("category/"):
        return (2, key)
    if key.startswith("time/"):
        return (3, key == "time/iteration")
    return (1,)
