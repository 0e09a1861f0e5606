"""Readable value placeholders in ``--help``.

Typer 0.29 prints its own type labels after an option (``<int range>``, ``<list[Path]>``,
``<str>``): Python annotations, not what to type. Click's convention (``PATH``, ``N``,
``SECONDS``, ``TEXT``) is what an operator reads in every other tool's help, so every option
and argument that takes a value and has no metavar of its own gets one here, from its type
and name, once the click command tree is built. Choices keep typer's ``<a|b>`` list: that
one already says what to type.
"""

from __future__ import annotations

from typing import Any

# Typer's label (without the angle brackets) -> the placeholder shown instead.
_BY_LABEL = {
    "int": "N",
    "int range": "N",
    "float": "NUMBER",
    "float range": "NUMBER",
    "path": "PATH",
    "list[Path]": "PATH",
    "list[float]": "NUMBER",
    "list[int]": "N",
    "str": "TEXT",
    "list[str]": "TEXT",
}


# Typed as Any: typer >= 0.20 builds on its own vendored click, older releases on click
# itself; both have the attributes read here (params, metavar, opts, commands).
def placeholder(param: Any, ctx: Any) -> str | None:
    """The metavar ``param`` should show, or None to keep what it shows now."""
    if param.metavar is not None or getattr(param, "is_flag", False) or getattr(param, "count", False):
        return None
    if param.param_type_name == "argument":
        # Click's convention: an argument is named in capitals, in usage and help alike.
        return (param.name or "").upper() or None
    display = getattr(param, "display_type", None)
    label = display(ctx) if callable(display) else param.type.name
    label = label.removeprefix("<").removesuffix(">")
    shown = _BY_LABEL.get(label)
    if shown in {"NUMBER", "N"} and _is_seconds(param):
        return "SECONDS"
    return shown


def _no_type(ctx: Any) -> None:
    return None


def _is_seconds(param: Any) -> bool:
    names = [o.lstrip("-") for o in getattr(param, "opts", [])]
    return any("timeout" in n or n in {"grace", "lock-wait"} or n.endswith(("-s", "seconds")) for n in names)


def apply(command: Any, parent: Any = None) -> None:
    """Give every value-taking parameter under ``command`` a readable metavar, in place."""
    ctx = command.context_class(command, parent=parent)
    for param in command.params:
        shown = placeholder(param, ctx)
        if shown is not None:
            param.metavar = shown
        if param.param_type_name == "argument":
            # An argument's help row is its name (TARGET, LEDGERS...), which already says
            # what to type; typer would add "<str>" / "<list[Path]>" after it.
            param.display_type_rich = _no_type
    for sub in getattr(command, "commands", {}).values():
        apply(sub, ctx)
