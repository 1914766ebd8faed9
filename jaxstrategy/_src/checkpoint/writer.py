"""The right to save into a checkpoint directory, and a failed save as one clear error.

`DirectoryWriter` is what a `Checkpointer` holds to save: the directory's lock (`lock.py`), taken
for each save, and the translation of a failed write (a full disk, a read-only filesystem) into
one `OSError` naming the directory and the cause, with orbax's tracebacks kept out of the log.
docs/internals.md ("Failed writes") says why.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from jaxstrategy._src.checkpoint.lock import DirectoryLock, acquire_for_job
from jaxstrategy._src.core import orbax_compat
from jaxstrategy._src.core.errors import caller_stacklevel

# Tensorstore reports the OS error behind a failed read or write like this.
_TENSORSTORE_ERRNO = re.compile(r"os_error_code='(\d+)'")
_ADVICE_BY_ERRNO = {
    errno.ENOSPC: "Free space there, or save to another directory.",
    errno.EDQUOT: "Free space within your quota there, or save to another directory.",
    errno.EFBIG: "The file size limit (ulimit -f) stopped the write: raise it, or save elsewhere.",
    errno.EROFS: "That filesystem is mounted read-only: save to a writable directory.",
    errno.EACCES: "This user may not write there: change its permissions, or save elsewhere.",
    errno.EPERM: "This user may not write there: change its permissions, or save elsewhere.",
    errno.ENOTDIR: "A file stands where a directory is expected: move it, or save elsewhere.",
}
_DEFAULT_ADVICE = "Check that the directory is on a writable filesystem with free space."

# The directories whose failures orbax's logger keeps quiet, by how many writers hold each.
_quiet_directories: Counter[str] = Counter()
_quiet_lock = threading.Lock()


class _OrbaxFailureFilter(logging.Filter):
    """Drops absl error records that name a path inside a directory in `_quiet_directories`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not _quiet_directories:
            return True
        text = _record_text(record)
        with _quiet_lock:
            prefixes = [directory + os.sep for directory in _quiet_directories]
        return not any(prefix in text for prefix in prefixes)


def _record_text(record: logging.LogRecord) -> str:
    try:
        parts = [record.getMessage()]
    except Exception:  # A malformed record: judge it by its format string.
        parts = [str(record.msg)]
    error = record.exc_info[1] if record.exc_info else None
    seen = set()
    while error is not None and id(error) not in seen:  # The whole chain names the paths.
        seen.add(id(error))
        parts.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(parts)


_filter_installed = False


def _install_log_filter() -> None:
    """Filter orbax's logger from now on (once per process)."""
    global _filter_installed
    with _quiet_lock:
        if not _filter_installed:
            orbax_compat.logger().addFilter(_OrbaxFailureFilter())
            _filter_installed = True


def _quiet_logs(directory: str) -> None:
    with _quiet_lock:
        _quiet_directories[directory] += 1


def _unquiet_logs(directory: str) -> None:
    with _quiet_lock:
        _quiet_directories[directory] -= 1
        if not _quiet_directories[directory]:
            del _quiet_directories[directory]


class DirectoryWriter:
    """This process's part in saving into one checkpoint directory: its lock, and its failures.

    Args:
      directory: the checkpoint directory, absolute.
    """

    def __init__(self, directory: Path):
        _install_log_filter()
        self._directory = directory
        self._holding = _Holding(str(directory))
        # Releases what is held when the writer is garbage collected, or at exit; it refers to
        # `_holding`, not to the writer, which it would keep alive.
        self._finalizer = weakref.finalize(self, self._holding.close)

    def hold(self, caller: str) -> bool:
        """Lock the directory for this process's job, unless held already; return whether taken now.

        Raises:
          CheckpointLockedError: another writer holds it.
          OSError: the lock file cannot be written (a read-only or full filesystem, say).
        """
        if self._holding.holds:
            return False
        try:
            lock, previous = acquire_for_job(self._directory, caller)
        except OSError as error:
            raise _translated(error, f"{caller}: cannot lock {self._directory} to save there") from error
        self._holding.take(lock)
        if previous is not None:
            warnings.warn(
                f"{caller}: took over the lock of {self._directory} from {previous.describe()}, "
                "which ended without releasing it (it crashed or was killed); the unfinished saves "
                "it left are removed.",
                UserWarning,
                stacklevel=caller_stacklevel(),
            )
        return True

    def before_save(self) -> None:
        """Remove unfinished saves, which only the lock's holder may; call with no save in flight."""
        if self._holding.lock is not None:
            remove_unfinished(self._directory)

    @contextlib.contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """Turn a failed write inside into an OSError naming `what` failed and why.

        Args:
          what: what is being written, such as "Checkpointer.save(): could not write step 3 to /ckpt".
        """
        try:
            yield
        except Exception as error:
            if self._holding.lock is not None:
                remove_unfinished(self._directory)  # What the failed save wrote takes space.
            translated = as_os_error(error, what)
            if translated is None:
                raise
            raise translated from error

    def release(self) -> None:
        """Let the next writer in. Safe to call when not holding the lock."""
        self._holding.release()

    def close(self) -> None:
        """Release the lock, and let orbax log failures about the directory again."""
        self._finalizer()


class _Holding:
    """What a DirectoryWriter holds, apart from it, for its finalizer."""

    def __init__(self, directory: str):
        self.directory = directory
        self.lock: DirectoryLock | None = None
        self.holds = False  # Also on the processes of a job other than 0, which hold no lock.
        self.quiet = False

    def take(self, lock: DirectoryLock | None) -> None:
        self.lock, self.holds = lock, True
        if not self.quiet:
            _quiet_logs(self.directory)
            self.quiet = True

    def release(self) -> None:
        lock, self.lock, self.holds = self.lock, None, False
        if lock is not None:
            lock.release()

    def close(self) -> None:
        self.release()
        if self.quiet:
            _unquiet_logs(self.directory)
            self.quiet = False


def _translated(error: OSError, what: str) -> OSError:
    return as_os_error(error, what) or error


def os_errno(error: BaseException) -> int | None:
    """The OS error code behind `error`, from its chain of causes or tensorstore's text."""
    seen = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno:
            return current.errno
        found = _TENSORSTORE_ERRNO.search(str(current))
        if found:
            return int(found.group(1))
        current = current.__cause__ or current.__context__
    return None


def as_os_error(error: BaseException, what: str) -> OSError | None:
    """An OSError saying that `what` failed, and why; None if no OS error caused `error`.

    Args:
      error: the failure, as orbax or the OS raised it.
      what: what failed, naming the call and the directory, such as
        "Checkpointer.save(): could not write step 3 to /ckpt".
    """
    code = os_errno(error)
    if code is None:
        return None
    cause = f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
    advice = _ADVICE_BY_ERRNO.get(code, _DEFAULT_ADVICE)
    return OSError(code, f"{what}: {cause}. {advice} (The error: {error})")


def remove_unfinished(directory: Path) -> list[str]:
    """Delete the temporary directories of unfinished saves in `directory`; return their names.

    Best effort: on a read-only filesystem they stay, and a later save of the same step names them.
    """
    try:
        unfinished = orbax_compat.UNFINISHED_STEP
        entries = [entry for entry in directory.iterdir() if unfinished.fullmatch(entry.name)]
    except OSError:
        return []
    removed = []
    for entry in sorted(entries):
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:
            continue
        removed.append(entry.name)
    return removed
