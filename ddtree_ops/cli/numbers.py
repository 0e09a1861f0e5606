"""Every number option and argument of every command reads ASCII digits only.

Typer converts an ``int`` or ``float`` parameter with pydantic (older typer: with click's
``INT`` / ``FLOAT``), which take ``'1_0'`` as 10, ``' 3'`` as 3, ``'1.0'`` as the integer 1,
and ``inf`` / ``nan`` / ``1e400`` as floats: a gate temperature of ``inf`` restarted a canary
that could only fail. :func:`apply` puts :mod:`ddtree_ops.numbers`' check in front of the
conversion of each such parameter once the command tree is built (one place for all of
them, as :mod:`ddtree_ops.cli.metavars` gives them their placeholders): a value that is not
a number as written is refused as any bad option value is, by the parser (exit 2, the option
named, the ``--json`` envelope), before any command runs. Ranges stay the options' own
(``min=`` / ``max=``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, get_args, get_origin

import typer

from ddtree_ops.numbers import float_problem, int_problem

# Older typer hands click its own types; their names say which number.
_CLICK_TYPES: dict[str, type] = {"integer": int, "integer range": int, "float": float, "float range": float}


def number_kind(param: Any) -> type | None:
    """``int`` or ``float`` for a parameter a person types a number into (a list of them
    too), else None. A counted flag (``-vv``) is no number typed by hand."""
    if getattr(param, "count", False):
        return None
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is None:
        return _CLICK_TYPES.get(getattr(getattr(param, "type", None), "name", ""))
    annotation = descriptor.annotation
    if get_origin(annotation) in (list, tuple):
        items = {a for a in get_args(annotation) if a is not Ellipsis}
        annotation = items.pop() if len(items) == 1 else None
    return annotation if annotation in (int, float) else None


def apply(command: Any) -> None:
    """Check every number parameter under ``command`` before it is converted, in place."""
    for param in command.params:
        kind = number_kind(param)
        if kind is not None:
            param.process_value = _checked(param, param.process_value, int_problem if kind is int else float_problem)
    for sub in getattr(command, "commands", {}).values():
        apply(sub)


def _checked(param: Any, process: Callable[[Any, Any], Any], problem: Callable[[str], str | None]) -> Any:
    @functools.wraps(process)
    def process_value(ctx: Any, value: Any) -> Any:
        # Text only: a default (8, None) or a counted value is not something typed.
        for item in value if isinstance(value, (list, tuple)) else (value,):
            why = problem(item) if isinstance(item, str) else None
            if why:
                raise typer.BadParameter(why, ctx=ctx, param=param)
        return process(ctx, value)

    return process_value


__all__ = ["apply", "number_kind"]
