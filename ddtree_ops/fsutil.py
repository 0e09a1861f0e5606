"""Local files: durable replacement (the local transport, the state file), and opening a
file that must be a regular file.

Every local file a command reads or writes by a name the operator gave (an inventory, a
sweep, a ledger, a CSV, the state file, a file the local transport reads) goes through
:func:`open_regular` or, for a name checked before any work, :func:`check_regular`: a
FIFO there would block the command forever (opening it for reading waits for a writer,
for writing waits for a reader), and a device would be read without end.

A reader must see either the old file or the new one, never a torn write, and the rename
must survive a crash: temp file in the same directory, fsync, rename, fsync the directory.
Raises ``OSError``; callers translate it into the error of their own layer.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

NOT_REGULAR = "not a regular file"


def _refuse_irregular(mode: int, path: Path | str) -> None:
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, NOT_REGULAR, str(path))


def open_regular(path: Path | str, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
    """A descriptor of ``path`` opened with ``flags``, refusing anything but a regular file.

    The file is opened non-blocking (a FIFO then opens at once, or fails with ENXIO when
    opened for writing with no reader) and checked on the open descriptor before a byte
    moves, so there is no window between a check and the open; the descriptor is then
    made blocking again. Raises ``FileNotFoundError`` (without ``O_CREAT``),
    ``IsADirectoryError``, and ``OSError(EINVAL, "not a regular file")`` for anything else
    that is not a regular file.
    """
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO opened for writing, nobody reading it
            raise OSError(errno.EINVAL, NOT_REGULAR, str(path)) from None
        raise
    try:
        _refuse_irregular(os.fstat(fd).st_mode, path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular(path: Path | str) -> None:
    """Refuse ``path`` unless it is a regular file or does not exist: for a name that will be
    written later (``--csv``, a ledger), checked before any work so that nothing is half done
    when it is refused. Raises like :func:`open_regular`."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    _refuse_irregular(mode, path)


def read_regular_text(path: Path) -> str:
    """``path``'s UTF-8 text, refusing anything but a regular file (:func:`open_regular`).
    Raises ``FileNotFoundError``, ``IsADirectoryError``, ``OSError(EINVAL)`` for other
    non-regular files, and ``UnicodeDecodeError``."""
    with os.fdopen(open_regular(path), "rb") as fh:
        data = fh.read()
    return data.decode("utf-8")


def read_named_text(path: Path, error: type[Exception], *, what: str, form: str) -> str:
    """:func:`read_regular_text` for a file the user named: every failure is one ``error``
    naming the file (``what``: "sweep file"; ``form``: what such a file holds, "YAML")."""
    try:
        return read_regular_text(path)
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not a UTF-8 text file (byte {exc.start}): a {what} is {form}") from None
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None


def write_atomic_local(target: Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace ``target`` with ``data`` atomically (parents created as needed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp_name, mode)
        os.replace(tmp_name, target)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except OSError:
            pass
        raise
    fsync_dir(target.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable; not every filesystem allows opening a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
