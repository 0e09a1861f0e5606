"""Local files: durable replacement (the local transport, the state file) and reading a
config file that must be a regular file.

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


def read_regular_text(path: Path) -> str:
    """``path``'s UTF-8 text, refusing anything but a regular file.

    A FIFO given as ``-i`` or ``--sweep`` would otherwise block the command forever, and a
    device would be read without end: the file is opened non-blocking (a FIFO opens at
    once) and checked on the open descriptor before a byte is read. Raises
    ``FileNotFoundError``, ``IsADirectoryError``, ``OSError(EINVAL)`` for other non-regular
    files, and ``UnicodeDecodeError``.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as fh:
            fd = -1
            data = fh.read()
    finally:
        if fd >= 0:
            os.close(fd)
    return data.decode("utf-8")


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
