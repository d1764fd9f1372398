"""The output-folder check that the trainer, evaluate and pretrain make before any work."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stepfast.files import RunLock, check_creatable_dir, write_atomically


def test_a_directory_or_a_path_under_one_is_accepted(tmp_path):
    assert check_creatable_dir(tmp_path) == tmp_path
    assert check_creatable_dir(str(tmp_path / "a" / "b")) == tmp_path / "a" / "b"


def test_a_file_on_the_way_is_named(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'f'} is a file, not a directory$"):
        check_creatable_dir(tmp_path / "f")
    with pytest.raises(ValueError, match=f"^cannot create {tmp_path / 'f' / 'a' / 'b'}: {tmp_path / 'f'} is a file"):
        check_creatable_dir(tmp_path / "f" / "a" / "b")


def test_a_folder_without_write_permission_is_named(tmp_path, monkeypatch):
    # os.access, not chmod: the test may run as root, which may write anywhere
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) != os.fspath(tmp_path))
    with pytest.raises(ValueError, match=f"cannot write in {tmp_path}: permission denied"):
        check_creatable_dir(tmp_path / "new")
    with pytest.raises(ValueError, match=f"cannot write in {tmp_path}: permission denied"):
        check_creatable_dir(tmp_path)


def test_a_folder_that_cannot_be_searched_is_named(tmp_path, monkeypatch):
    def exists(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "exists", exists)
    message = f"cannot check {tmp_path / 'run'} (can a folder above it be searched?): Permission denied"
    with pytest.raises(ValueError, match=re.escape(message)):
        check_creatable_dir(tmp_path / "run")


def test_an_interrupted_write_leaves_the_file_it_would_replace(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("iteration,reward\n1,0.5\n")

    def dies_half_way(tmp):
        with tmp.open("w") as f:
            f.write("iteration,rew")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(path, dies_half_way)
    assert path.read_text() == "iteration,reward\n1,0.5\n" and not (tmp_path / "metrics.csv.tmp").exists()
    write_atomically(path, lambda tmp: tmp.write_text("iteration,reward\n"))
    assert path.read_text() == "iteration,reward\n" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]


def test_a_write_over_a_folder_fails_and_leaves_no_tmp(tmp_path):
    folder = tmp_path / "out.json"
    folder.mkdir()
    with pytest.raises(IsADirectoryError):
        write_atomically(folder, lambda tmp: tmp.write_text("{}"))
    assert folder.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names the synced files through /proc")
def test_a_file_written_whole_is_on_disk_before_its_rename_and_the_rename_after(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, Path.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(os.readlink(f"/proc/self/fd/{fd}")) or fsync(fd))
    monkeypatch.setattr(Path, "replace", lambda self, target: events.append("replace") or replace(self, target))
    write_atomically(tmp_path / "eval.json", lambda tmp: tmp.write_text("{}"))
    assert events == [str(tmp_path / "eval.json.tmp"), "replace", str(tmp_path)]


def test_a_filesystem_that_cannot_sync_does_not_stop_a_write_but_an_io_error_does(tmp_path, monkeypatch):
    def fsync(code):
        def fail(fd):
            raise OSError(code, os.strerror(code))

        return fail

    monkeypatch.setattr(os, "fsync", fsync(errno.EINVAL))  # a FUSE mount without fsync
    write_atomically(tmp_path / "a.json", lambda tmp: tmp.write_text("{}"))
    assert (tmp_path / "a.json").read_text() == "{}"
    monkeypatch.setattr(os, "fsync", fsync(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        write_atomically(tmp_path / "b.json", lambda tmp: tmp.write_text("{}"))
    assert not (tmp_path / "b.json").exists() and not (tmp_path / "b.json.tmp").exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_whose_permission_bits_allow_writing_but_which_refuses_it_is_named():
    """/proc passes os.access for root, yet nothing can be created in it: found out at the check, not
    once the work is done and its results are to be written."""
    if not os.access("/proc", os.W_OK):
        pytest.skip("the permission bits refuse it already")
    with pytest.raises(ValueError, match=r"cannot create a folder in /proc \(mkdir: "):
        check_creatable_dir("/proc/stepfast-out")


# --- the output_dir lock -------------------------------------------------------------------------


def _look_in_flight(folder: Path) -> int:
    """A descriptor of `folder` holding a shared flock, as RunLock.holder does for an instant."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    return fd


def test_a_look_at_the_lock_does_not_see_another_look_but_sees_a_run(tmp_path):
    """The ranks of one run look before the process group, together: one rank's look must not be
    another run to the next, while a run's lock is seen by every look."""
    fd = _look_in_flight(tmp_path)
    try:
        assert RunLock.holder(tmp_path) is None
    finally:
        os.close(fd)
    run = RunLock(tmp_path)
    assert run.take() is None
    try:
        assert RunLock.holder(tmp_path).startswith(f"pid {os.getpid()}: ")
        assert run.take() is None  # taken twice by the same run: still its one lock
    finally:
        run.release()
    assert RunLock.holder(tmp_path) is None


def test_taking_the_lock_waits_for_a_look_in_flight_but_not_for_ever(tmp_path):
    fd = _look_in_flight(tmp_path)
    timer = threading.Timer(0.3, os.close, (fd,))
    timer.start()
    try:
        run = RunLock(tmp_path)
        assert run.take() is None  # the look ends within the wait
        run.release()
    finally:
        timer.cancel()
        timer.join()
    fd = _look_in_flight(tmp_path)
    try:  # a shared lock held longer than the wait is refused, as 'another process' (no run's pid)
        assert RunLock(tmp_path, wait=0.2).take() == "another process"
    finally:
        os.close(fd)


def test_a_run_holding_the_lock_is_named_at_once_not_after_the_wait(tmp_path):
    run = RunLock(tmp_path)
    assert run.take() is None
    try:
        began = time.monotonic()
        assert RunLock(tmp_path, wait=60).take().startswith(f"pid {os.getpid()}: ")
        assert time.monotonic() - began < 30  # not the 60 s a look in flight could be waited for
    finally:
        run.release()


def test_looks_from_two_processes_at_once_never_refuse_each_other(tmp_path):
    """What two ranks of one run do in check_before_start; an exclusive look refused some of them.
    Both look for the same half second, from the same moment, however busy the machine is."""
    start = time.time() + 3  # both started and imported by then
    look = (f"import time\n"
            f"from stepfast.files import RunLock\n"
            f"time.sleep(max(0, {start} - time.time()))\n"
            f"seen, looks = [], 0\n"
            f"while time.time() < {start} + 0.5:\n"
            f"    looks += 1\n"
            f"    if h := RunLock.holder({str(tmp_path)!r}):\n"
            f"        seen.append(h)\n"
            f"print(len(seen), seen[:1], looks > 100)")  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", look], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == ["0 [] True", "0 [] True"], outputs


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_without_exec_neither_keeps_the_lock_nor_drops_the_parents(tmp_path):
    """A run forks a child that outlives it: the folder is free once the run ends. While the run
    lives, a child that starts and ends does not unlock it."""
    script = (f"import os, sys, time\n"
              f"from stepfast.files import RunLock\n"
              f"run = RunLock({str(tmp_path)!r})\n"
              f"assert run.take() is None\n"
              f"if os.fork() == 0:\n"
              f"    os._exit(0)\n"
              f"os.wait()\n"
              f"print(RunLock.holder({str(tmp_path)!r}) is not None, flush=True)\n"
              f"child = os.fork()\n"
              f"if child == 0:\n"
              f"    null = os.open(os.devnull, os.O_WRONLY)\n"
              f"    os.dup2(null, 1), os.dup2(null, 2)\n"  # the test reads the parent's output to its end
              f"    time.sleep(120)\n"
              f"    os._exit(0)\n"
              f"print(child, flush=True)\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    still_held, child = proc.stdout.split()
    try:
        assert still_held == "True"  # the first child's exit left the parent's lock in place
        assert RunLock.holder(tmp_path) is None  # the parent ended; its sleeping child holds nothing
        run = RunLock(tmp_path, wait=0.2)
        assert run.take() is None
        run.release()
    finally:
        os.kill(int(child), 9)


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="no /proc/locks on this platform")
def test_the_holder_is_named_where_proc_locks_gives_another_device_than_stat(tmp_path, monkeypatch):
    """overlayfs and btrfs subvolumes: /proc/locks shows a device number stat does not give. The
    process with the folder open is named; one that only shares its inode number is not."""
    from stepfast import files

    folder = tmp_path / "run"
    run = RunLock(folder)
    assert run.take() is None
    try:
        st = folder.stat()
        ours = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        real = Path("/proc/locks").read_text()
        assert ours in real
        other = f"ff:fe:{st.st_ino}"
        fake = tmp_path / "locks"
        monkeypatch.setattr(files, "_PROC_LOCKS", fake)
        fake.write_text(real.replace(ours, other))
        assert RunLock.holder(folder).startswith(f"pid {os.getpid()}: ")
        fake.write_text(f"1: FLOCK  ADVISORY  WRITE 1 {other} 0 EOF\n" + real.replace(ours, other))
        assert RunLock.holder(folder).startswith(f"pid {os.getpid()}: ")  # pid 1 has no descriptor of it
        fake.write_text(f"1: FLOCK  ADVISORY  WRITE 1 {other} 0 EOF\n")
        assert RunLock.holder(folder) == "another process"
    finally:
        run.release()


def test_a_folder_that_cannot_be_opened_to_lock_is_not_held_and_not_refused(tmp_path, monkeypatch):
    real_open = os.open

    def refuse(path, flags, *args):
        if os.fspath(path) == os.fspath(tmp_path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse)
    assert RunLock.holder(tmp_path) is None
    run = RunLock(tmp_path)
    assert run.take() is None
    run.release()


def test_a_descriptor_table_that_is_full_is_an_error_not_a_folder_left_unlocked(tmp_path, monkeypatch):
    def full(path, flags, *args):
        raise OSError(errno.EMFILE, "Too many open files", os.fspath(path))

    monkeypatch.setattr(os, "open", full)
    with pytest.raises(OSError, match="Too many open files"):
        RunLock(tmp_path).take()
    with pytest.raises(OSError, match="Too many open files"):
        RunLock.holder(tmp_path)
