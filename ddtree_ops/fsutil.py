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

Every file a command writes at a path it was given (a ledger, ``--csv``, ``--plots``' files,
``tune --out``'s policies, a sweep's traces) is never written through a symbolic link: the
name is checked before any work (:func:`check_output_file`: a link there is refused, the file
it points to is not ours to change), a whole file is replaced atomically
(:func:`write_atomic_local`, :func:`replace_file`: a temp file beside it, renamed over the
name, so an existing path is never opened for writing), and a file appended to is opened
with ``O_NOFOLLOW`` (:func:`open_append`). A full disk is ``OSError(ENOSPC)`` like any other
(:func:`is_disk_full` tells it apart for the message).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

NOT_REGULAR = "not a regular file"
#: ``strerror`` of the refusal of a symbolic link where a file will be written.
IS_LINK = "is a symbolic link (ddtree-ops never writes through one)"


def _read_umask() -> int:
    # Linux says it in /proc (4.7+); elsewhere os.umask is the only getter and it sets the
    # mask too: read once, at import (the main thread, before any worker creates a file).
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


_UMASK = _read_umask()


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


def check_output_file(path: Path | str) -> None:
    """Refuse ``path`` as the name of a file a command will write (before any work): a
    symbolic link there (``OSError(ELOOP, IS_LINK)``: written through, it would change the
    file it points to, which may be anything), a directory, anything but a regular file.
    A name that does not exist is fine. Only the last component is checked: a folder on
    the way may be a link (the operator's layout)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise OSError(errno.ELOOP, IS_LINK, str(path))
    _refuse_irregular(mode, path)


def open_append(path: Path | str, mode: int = 0o644) -> int:
    """A descriptor appending to the regular file ``path`` (created if missing), never
    through a symbolic link (``O_NOFOLLOW``: ``OSError(ELOOP, IS_LINK)``) and never to a FIFO
    or device (:func:`open_regular`). Readable too: an appender checks the file's last byte."""
    try:
        return open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, IS_LINK, str(path)) from None
        raise


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the file system is full (ENOSPC) or the user's quota spent (EDQUOT)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def write_problem(exc: OSError) -> str:
    """Why a write failed, for a one-line error: ``the disk is full (No space left on
    device)`` said first where it is, since that is what the operator must act on."""
    text = exc.strerror or str(exc)
    return f"the disk is full ({text})" if is_disk_full(exc) else text


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
    # Without a mode: mkstemp's 0600, as this has always written (the state file).
    replace_file(target, lambda fh: fh.write(data), mode=0o600 if mode is None else mode)


def replace_file(target: Path, write: Callable[[BinaryIO], object], *, mode: int | None = None) -> None:
    """Replace ``target`` atomically with what ``write`` writes into the open file it is
    given: a temp file beside ``target``, fsynced, renamed over it (a symbolic link at
    ``target`` is replaced, never written through; a reader sees the old file or the new
    one). On any failure (a full disk included) the temp file is removed and ``target`` is
    as it was. The parent must exist. ``mode``: the file's (default: 0666 less the umask)."""
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        # mkstemp makes 0600; without a mode the file gets what open() would give it (a
        # report is read like any file the user makes).
        os.chmod(tmp_name, mode if mode is not None else 0o666 & ~_UMASK)
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
