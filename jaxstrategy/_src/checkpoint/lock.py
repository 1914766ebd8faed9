"""One writer per checkpoint directory: a lock that a second, independent writer is refused.

Two writers saving into one directory race inside orbax and lose saves, so a save first locks
`<directory>/.jaxstrategy.lock` (`fcntl.flock`, which the kernel releases when its holder exits)
and holds it until the save is on disk; in a job, process 0 locks for every process.
docs/internals.md ("One writer per directory") says why each part is as it is.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
import weakref
from pathlib import Path
from typing import Any

import jax

from jaxstrategy._src.cluster.coordination import KeyValueStore, new_namespace
from jaxstrategy._src.core.errors import JaxStrategyError

LOCK_FILE = ".jaxstrategy.lock"
# How long the other processes of a job wait for process 0 to take the lock.
AGREEMENT_TIMEOUT_S = 300


class CheckpointLockedError(JaxStrategyError, RuntimeError):
    """Another writer's save into the checkpoint directory is in flight: another process's, or
    another `Checkpointer`'s."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a lock, as its file records it."""

    host: str
    pid: int
    since: str

    @classmethod
    def this_process(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), time.strftime("%Y-%m-%d %H:%M:%S %z"))

    def describe(self) -> str:
        return f"process {self.pid} on host {self.host!r} (holding it since {self.since})"

    def is_this_process(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid()

    def is_dead_here(self) -> bool:
        """Whether it ran on this host and has ended."""
        return self.host == socket.gethostname() and not _pid_alive(self.pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # Another user's process.
    return True


class DirectoryLock:
    """The held lock of one directory; `release()` lets the next writer in. Safe to call twice."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd
        _held_locks.add(self)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _held_locks.discard(self)
        try:
            if _same_file(fd, self.path):
                # While still locked, so a writer that opened the file meanwhile sees it is gone.
                self.path.unlink()
        except OSError:
            pass  # Gone, or unwritable now: the lock is released with the descriptor all the same.
        os.close(fd)

    def forget(self) -> None:
        """Close the descriptor without unlocking: in a forked child, whose parent holds the lock."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


# The locks this process holds, which forked children forget.
_held_locks: weakref.WeakSet[DirectoryLock] = weakref.WeakSet()


def _forget_in_child() -> None:
    for lock in list(_held_locks):
        lock.forget()
    _held_locks.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def acquire(directory: Path, caller: str) -> tuple[DirectoryLock, Holder | None]:
    """Lock `directory` for this process; return the lock, and the holder it took over from.

    The holder taken over from is one that ended without releasing the lock (crashed or killed):
    None when the lock was free.

    Raises:
      CheckpointLockedError: another writer holds it.
      OSError: the lock file cannot be created (a read-only or full filesystem, say).
    """
    path = directory / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _await_holder(fd)
            os.close(fd)
            raise CheckpointLockedError(_locked_message(directory, path, holder, caller)) from None
        except OSError:
            os.close(fd)
            raise
        if not _same_file(fd, path):
            os.close(fd)  # Released and deleted while we waited for it: take the new file.
            continue
        previous = _read_holder(fd)
        _write_holder(fd, Holder.this_process())
        return DirectoryLock(path, fd), previous


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _read_holder(fd: int) -> Holder | None:
    """The holder the lock file records; None when it is empty (released cleanly) or unreadable."""
    try:
        text = os.pread(fd, 4096, 0).decode()
        if not text:
            return None
        fields = json.loads(text)
        return Holder(str(fields["host"]), int(fields["pid"]), str(fields["since"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _await_holder(fd: int) -> Holder | None:
    """The holder of a lock just taken by another, which records itself right after locking."""
    deadline = time.monotonic() + 0.5
    while (holder := _read_holder(fd)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return holder


def _write_holder(fd: int, holder: Holder) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(dataclasses.asdict(holder)).encode(), 0)


def _locked_message(directory: Path, path: Path, holder: Holder | None, caller: str) -> str:
    head = f"{caller}: cannot save into {directory}: another writer's save there is in flight ({path})"
    if holder is None:
        who = "; its writer is not recorded"
    elif holder.is_this_process():
        return (
            f"{head}: another Checkpointer of this process, whose save is on disk once it waits "
            "(wait(), its next save(), restore() or close()). Save through one Checkpointer per "
            "directory, or wait() for the other's save first."
        )
    elif holder.is_dead_here():
        who = (
            f": {holder.describe()}, which has ended, but a process it started still holds the "
            f"lock; find it with `fuser {path}` and stop it"
        )
    else:
        who = f": {holder.describe()}"
    return (
        f"{head}{who}. Two independent writers in one directory lose each other's saves (to "
        "each other's max_to_keep, or to one step number). Stop that writer, or save to another "
        "directory."
    )


# --- a job of several processes ----------------------------------------------------------------


def acquire_for_job(directory: Path, caller: str) -> tuple[DirectoryLock | None, Holder | None]:
    """`acquire` once per job: process 0 locks, and every process gets its outcome.

    Returns (None, None) on the processes other than 0, which hold nothing.

    Raises:
      CheckpointLockedError, OSError: as `acquire`, on every process of the job.
      TimeoutError: process 0 did not report within `AGREEMENT_TIMEOUT_S`.
    """
    if jax.process_count() == 1:
        return acquire(directory, caller)
    store = KeyValueStore()
    # The same on every process, which all save in the same order.
    key = new_namespace("checkpoint_lock")
    if jax.process_index() == 0:
        try:
            result = acquire(directory, caller)
        except Exception as error:
            store.set(key, json.dumps(_failure_to_share(error)))
            raise
        store.set(key, json.dumps({}))
        return result
    reply = store.get_within(key, AGREEMENT_TIMEOUT_S * 1000)
    if reply is None:
        raise TimeoutError(
            f"{caller}: process {jax.process_index()} waited {AGREEMENT_TIMEOUT_S} s for process 0 "
            f"to lock {directory} for the job, in vain. Every process of the job must save, in "
            "the same order."
        )
    # The last process to read the outcome deletes it: a save per key would otherwise pile up in
    # the coordinator for the whole job.
    if store.increment(f"{key}/read", 1) == jax.process_count() - 1:
        store.delete(key)
    outcome = json.loads(reply)
    if outcome:
        raise _error_from_shared(outcome)
    return None, None


def _failure_to_share(error: Exception) -> dict[str, Any]:
    """Process 0's failure to lock, as the other processes raise it again."""
    kind = "other"
    if isinstance(error, CheckpointLockedError):
        kind = "locked"
    elif isinstance(error, OSError):
        kind = "os"
    return {"kind": kind, "errno": getattr(error, "errno", None), "message": f"process 0: {error}"}


def _error_from_shared(outcome: dict[str, Any]) -> Exception:
    """The error to raise for process 0's failure to lock, as `_failure_to_share` shared it."""
    if outcome["kind"] == "locked":
        return CheckpointLockedError(outcome["message"])
    if outcome["kind"] == "os":
        return OSError(outcome["errno"] or errno.EIO, outcome["message"])
    return RuntimeError(outcome["message"])
