"""Checks on the folders a command will write, made before any work that their failure would waste,
and files written whole."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import time
import weakref
from pathlib import Path
from typing import Callable


def path_argument(value: str) -> str:
    """An argparse type for a path: an empty one (a shell variable unset in a script) would mean the
    current folder, and write or read there."""
    import argparse

    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?)")
    return value


_CANNOT_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EBADF}


def _fsync(path: Path) -> None:
    if os.name == "nt" and path.is_dir():  # Windows opens no folder to flush; its renames are journaled
        return
    # Windows flushes only what it may write; elsewhere a read-only descriptor flushes the file
    fd = os.open(path, os.O_RDWR if os.name == "nt" else os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # a filesystem that cannot sync (a folder, or any file on some FUSE mounts) has nothing this can
        # do: not a reason to stop a run; an I/O error (EIO, ENOSPC) is
        if exc.errno not in _CANNOT_SYNC:
            raise
    finally:
        os.close(fd)


def sync_folder(path: str | Path) -> None:
    """Flush a folder's own entries to disk (the names created, renamed or removed in it), not its
    files: what makes a rename into it survive a power loss."""
    _fsync(Path(path))


def sync(path: str | Path) -> None:
    """Flush `path` to disk: a file, or a folder with every file and folder under it (files first).
    A rename that marks something written (write then rename) must follow this, or a power loss can
    leave the new name on files the disk never received."""
    path = Path(path)
    if not path.is_dir():
        _fsync(path)
        return
    for root, _, files in os.walk(path, topdown=False):
        for name in files:
            _fsync(Path(root, name))
        _fsync(Path(root))


def write_atomically(path: str | Path, write: Callable[[Path], object]) -> None:
    """write(tmp) into `path`'s sibling `<name>.tmp`, flushed to disk, then renamed over `path`: an
    interrupted write or a power loss leaves the file it would replace (or none), never a truncated
    one, and no `.tmp` beside it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        sync(tmp)
        tmp.replace(path)  # refused where `path` is a folder: the .tmp goes too
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to see
            tmp.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


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


ANOTHER = "another process"  # the holder's name where no exclusive lock's process can be read


class RunLock:
    """An exclusive lock (flock) on the output_dir folder itself, held by the first rank of a run
    while it writes there, so that a second run started in the same folder (a second `make train`,
    the same command in another terminal) is refused instead of writing over the first. The lock
    is the folder's, not a file's: taking it, or looking whether another run holds it, writes
    nothing in the folder. The kernel drops it when the process ends, however it ends (SIGKILL
    too), so nothing stale is ever in the way. On a file system without flock it is not held and
    nothing is refused, as before there was a lock.

    A look (`holder`) takes a shared lock for an instant: looks never conflict with each other, so
    the ranks of one run looking together all find the folder free, and a look still sees a run's
    exclusive lock. `take` waits up to `wait` seconds for looks in flight to end, not for a run.

    A child forked without exec (a `fork` DataLoader worker, say) closes its copy of the descriptor
    as it starts, so the lock ends with the run that took it, not with its longest-lived child."""

    _held: weakref.WeakSet[RunLock] = weakref.WeakSet()

    def __init__(self, out: str | Path, wait: float = 2.0):
        self.out = Path(out)
        self.wait = wait
        self._fd: int | None = None

    def take(self) -> str | None:
        """Create the folder if need be and lock it: None once held (or where it cannot be held),
        else who holds it, as a line for the refusal: a run's pid and command at once, or, where
        only looks held it for all of `wait` (or /proc/locks cannot be read), 'another process'."""
        if self._fd is not None:
            return None
        self.out.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.wait
        while (fd := _lock(self.out, exclusive=True)) == ANOTHER and time.monotonic() < deadline:
            time.sleep(0.01)  # a look in flight holds a shared lock for an instant; a run holds on
        if isinstance(fd, str):
            return fd
        self._fd = fd
        RunLock._held.add(self)
        return None

    def release(self) -> None:
        if self._fd is not None and self._fd >= 0:
            os.close(self._fd)  # closing the folder drops its lock
        self._fd = None
        RunLock._held.discard(self)

    @staticmethod
    def _forget_in_child() -> None:
        """After a fork, in the child: release the inherited locks, which closes their descriptors
        without unlocking. The flock belongs to the open file, which the parent still holds open;
        closing a copy leaves it locked, while LOCK_UN here would unlock it under the parent's feet."""
        for lock in list(RunLock._held):
            lock.release()

    @staticmethod
    def holder(out: str | Path) -> str | None:
        """Who holds the lock of `out` now (a line), or None: a look that writes nothing."""
        try:
            fd = _lock(Path(out), exclusive=False)
        except (FileNotFoundError, NotADirectoryError):  # no folder, no run writing there
            return None
        if isinstance(fd, str):
            return fd
        if fd >= 0:
            os.close(fd)
        return None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=RunLock._forget_in_child)


def _lock(folder: Path, exclusive: bool) -> int | str:
    """An open descriptor of `folder` holding its flock, exclusive or shared (-1 where flock is
    unsupported or the folder cannot be opened to lock), or who holds an exclusive one already."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform
        return -1
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except PermissionError:  # a folder that can be written in but not listed: nothing to lock it with
        return -1
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _flock_holder(os.fstat(fd))
        os.close(fd)
        return holder
    except OSError:  # a file system without flock (some network mounts): nothing to refuse with
        os.close(fd)
        return -1
    return fd


_PROC_LOCKS = Path("/proc/locks")


def _flock_holder(st: os.stat_result) -> str:
    """The process holding the exclusive flock on the file of `st`, from Linux's /proc/locks
    ('pid N: its command line'), or 'another process' where that cannot be read."""
    try:
        lines = _PROC_LOCKS.read_text().splitlines()
    except OSError:
        return ANOTHER
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    same_inode = []  # (pid, exact device)
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; a waiter's line carries "->", a look's READ
        if len(fields) >= 6 and fields[1] == "FLOCK" and "->" not in fields and fields[3] == "WRITE":
            dev, _, inode = fields[5].rpartition(":")
            if inode == str(st.st_ino):
                same_inode.append((fields[4], dev == device))
    # On overlayfs and btrfs subvolumes /proc/locks may give another device than stat does: there,
    # the holder is the process with the folder open.
    pid = next((pid for pid, exact in same_inode if exact), None) or next(
        (pid for pid, _ in same_inode if _has_open(pid, st)), None)
    if pid is None:
        return ANOTHER
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        command = " ".join(argv.decode(errors="replace").split())
    except OSError:
        command = ""
    if len(command) > 200:
        command = command[:197] + "..."
    return f"pid {pid}" + (f": {command}" if command else "")


def _has_open(pid: str, st: os.stat_result) -> bool:
    """Whether process `pid` holds a descriptor of the file of `st` (False where it cannot be read)."""
    try:
        entries = list(os.scandir(f"/proc/{pid}/fd"))
    except OSError:
        return False
    for entry in entries:
        try:
            other = os.stat(entry.path)
        except OSError:  # closed since, or not ours to read
            continue
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False
