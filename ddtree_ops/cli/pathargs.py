"""Every path option and argument of every command names a file this system can name.

A name longer than the file system allows (``--csv`` with 5,000 characters, a path past
``PATH_MAX``) is no file that exists or can be made: ``Path.exists()`` and ``os.stat`` raise
``OSError(ENAMETOOLONG)`` on it, which the command checks that look for an existing file
(the inventory, a bundle, a ledger, an output that must not be a link) let through as a
traceback. :func:`apply` puts the check in front of the conversion of each ``Path``
parameter once the command tree is built, as :mod:`ddtree_ops.cli.numbers` does for the
numbers: refused by the parser (exit 2, the option named, the ``--json`` envelope) before
any command runs, the value itself not echoed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import typer

# What Linux file systems allow (ext4, xfs, tmpfs); asked of the root's where it answers.
_NAME_MAX, _PATH_MAX = 255, 4096


def _limits() -> tuple[int, int]:
    try:
        return os.pathconf("/", "PC_NAME_MAX"), os.pathconf("/", "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):
        return _NAME_MAX, _PATH_MAX


def path_problem(text: str) -> str | None:
    """Why ``text`` cannot name a file on this system, or None."""
    raw = os.fsencode(text)  # the bytes the system is given (an undecodable argv byte is one)
    name_max, path_max = _limits()
    if len(raw) >= path_max:
        return f"the path is {len(raw):,} bytes long; a path here holds fewer than {path_max:,}"
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > name_max:
        return f"a name in the path is {len(longest):,} bytes long; a file name here holds at most {name_max}"
    return None


def is_path(param: Any) -> bool:
    """Whether ``param`` is read as a ``Path`` (a list of them too)."""
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is None:  # older typer: click's own type
        return getattr(getattr(param, "type", None), "name", "") == "path"
    annotation = descriptor.annotation
    return annotation is Path or Path in get_args(annotation)


def apply(command: Any) -> None:
    """Check every path parameter under ``command`` before it is converted, in place."""
    for param in command.params:
        if is_path(param):
            param.process_value = _checked(param, param.process_value)
    for sub in getattr(command, "commands", {}).values():
        apply(sub)


def _checked(param: Any, process: Callable[[Any, Any], Any]) -> Any:
    @functools.wraps(process)
    def process_value(ctx: Any, value: Any) -> Any:
        for item in value if isinstance(value, (list, tuple)) else (value,):
            why = path_problem(item) if isinstance(item, str) else None
            if why:
                raise typer.BadParameter(why, ctx=ctx, param=param)
        return process(ctx, value)

    return process_value


__all__ = ["apply", "is_path", "path_problem"]
