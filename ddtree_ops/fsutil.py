"""Durable local file replacement, shared by the local transport and the local state file.

A reader must see either the old file or the new one, never a torn write, and the rename
must survive a crash: temp file in the same directory, fsync, rename, fsync the directory.
Raises ``OSError``; callers translate it into the error of their own layer.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
