"""Checks on the folders a command will write, made before any work that their failure would waste,
and files written whole."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Callable


def write_atomically(path: str | Path, write: Callable[[Path], object]) -> None:
    """write(tmp) into `path`'s sibling `<name>.tmp`, then renamed over `path`: an interrupted write
    leaves the file it would replace (or none), never a truncated one, and no `.tmp` beside it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to see
            tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)


#: The name of the folder `check_creatable_dir` creates and removes at once to see that it can.
PROBE_PREFIX = ".stepfast-probe-"


def check_creatable_dir(path: str | Path, holds: str = "") -> Path:
    """`path` as a Path when it is a directory that can be written in, or does not exist yet and its
    nearest existing parent is one; else a ValueError that names the path and what is wrong.
    `holds`: what the folder would receive, said when `path` is a file."""
    path = Path(path)
    try:
        if path.exists():
            if not path.is_dir():
                raise ValueError(f"{path} is a file, not a directory" + (f" (it would receive {holds})" if holds else ""))
            existing = path
        else:
            existing = next(p for p in path.absolute().parents if p.exists())
            if not existing.is_dir():
                raise ValueError(f"cannot create {path}: {existing} is a file, not a directory")
    except OSError as exc:  # exists() itself fails under a folder that may not be searched
        raise ValueError(f"cannot check {path} (can a folder above it be searched?): {exc.strerror or exc}") from None
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write in {existing}: permission denied")
    try:  # the permission bits are not the whole story (read-only mounts, /proc, root): try it
        os.rmdir(tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=existing))
    except OSError as exc:
        raise ValueError(f"cannot create a folder in {existing} (mkdir: {exc.strerror or exc})") from None
    return path
