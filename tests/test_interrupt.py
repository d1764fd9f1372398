"""Ctrl-C while a command is still importing torch, diffusers and DeepSpeed (seconds, where a user
who started the wrong command presses it): one line and exit status 130, not a traceback from inside
an import. The Ctrl-C is sent by an import hook as the command's first heavy import begins."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# runs the command as `python stepfast/train.py ...` or `python -m stepfast.X ...` run it, after a
# hook that sends this process a SIGINT when `module` is first looked for (or, for "parse_args", as
# the command reads its arguments)
HOOKED = textwrap.dedent("""
    import argparse, importlib.abc, os, runpy, signal, sys

    module, command = sys.argv[1], sys.argv[2]
    parse_known_args = argparse.ArgumentParser.parse_known_args  # what every parse_*args calls
    sent = []

    def ctrl_c_then_parse(self, *args, **kwargs):
        if module == "parse_args" and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return parse_known_args(self, *args, **kwargs)

    argparse.ArgumentParser.parse_known_args = ctrl_c_then_parse

    class CtrlC(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == module:
                sys.meta_path.remove(self)
                os.kill(os.getpid(), signal.SIGINT)
            return None

    sys.meta_path.insert(0, CtrlC())
    sys.argv = sys.argv[2:]
    if command.endswith(".py"):
        runpy.run_path(command, run_name="__main__")
    else:
        runpy.run_module(command, run_name="__main__", alter_sys=True)
""")

COMMANDS = [  # (command, its first heavy import, the prefix of its messages)
    ("stepfast/train.py", "torch", "stepfast"),
    ("stepfast.evaluate", "torch", "python -m stepfast.evaluate"),
    ("stepfast.pretrain", "numpy", "python -m stepfast.pretrain"),
    ("stepfast.report", "numpy", "python -m stepfast.report"),
    ("stepfast.reward_server", "numpy", "stepfast reward server"),
    ("stepfast.value_check", "numpy", "python -m stepfast.value_check"),
]


def interrupted_at(module: str, command: str, rank: str | None = None, ignored: bool = False):
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    if rank is not None:
        env["RANK"] = rank
    # `ignored`: started with SIGINT ignored, as a shell script's `cmd &` starts it
    before = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None
    return subprocess.run([sys.executable, "-c", HOOKED, module, command, "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, preexec_fn=before)  # fmt: skip


@pytest.mark.parametrize("command, module, prefix", COMMANDS)
def test_ctrl_c_among_a_commands_imports_is_one_line(command, module, prefix):
    proc = interrupted_at(module, command)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr == f"\n{prefix}: interrupted while starting\n"
    assert proc.stdout == ""  # stopped before --help was read


def test_under_a_launcher_the_first_rank_says_it():
    """Every rank of a launcher gets the Ctrl-C: the others exit as quietly."""
    first, second = (interrupted_at("torch", "stepfast/train.py", rank) for rank in ("0", "1"))
    assert (first.returncode, first.stderr) == (130, "\nstepfast: interrupted while starting\n")
    assert (second.returncode, second.stderr) == (130, "")


def test_after_its_imports_a_command_handles_ctrl_c_itself():
    """The quiet exit holds only while importing: a Ctrl-C as the command reads its arguments is a
    KeyboardInterrupt again, which the command turns into its own message."""
    proc = interrupted_at("parse_args", "stepfast.evaluate")
    assert proc.returncode == 130
    assert proc.stderr == "\npython -m stepfast.evaluate: interrupted (the results are written at the end)\n"


@pytest.mark.parametrize("module", ["torch", "parse_args"])
def test_a_command_started_with_ctrl_c_ignored_keeps_ignoring_it(module):
    """A script's `reward_server &` (or trainer) is started with SIGINT ignored, so that a Ctrl-C
    meant for the script's foreground command leaves it running: it must not install a handler."""
    proc = interrupted_at(module, "stepfast/train.py", ignored=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert "deepspeed stepfast/train.py" in proc.stdout  # it went on to print its help
