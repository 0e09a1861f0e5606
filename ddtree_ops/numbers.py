"""Numbers a person types — a flag's value, ``--serial 3``, ``--canary 2``, a ``--budgets``
list, a port in an inventory — read in ASCII digits only.

Python's ``int()`` and ``float()`` read any Unicode decimal digit (``'٣'`` is 3, ``'３'`` is 3)
and underscores (``'1_0'`` is 10); ``str.isdigit()`` is true for ``'²'``, which ``int()``
then refuses with a ValueError. So ``--serial ٣`` ran a three-host batch, and ``--canary ²``
ended in a traceback. Here a number is what it looks like to whoever reads the command
line or the file: ASCII digits, an optional sign, for a float a decimal point and an
exponent; never ``inf`` or ``nan`` (no deadline, budget or floor is infinite), never
surrounding blanks. The CLI's typed options go through the same check
(:mod:`ddtree_ops.cli.numbers`).
"""

from __future__ import annotations

import math
import re

# 18 digits: every count, port and budget fits; Python refuses to read 4,301 digits at all.
_INT = re.compile(r"[+-]?[0-9]{1,18}\Z")
_COUNT = re.compile(r"[0-9]{1,18}\Z")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\Z")
_SHOWN = 40


def parse_int(text: str) -> int | None:
    """``text`` as a whole number (``-2``, ``+3``, ``007``), or None."""
    return int(text) if _INT.match(text) else None


def parse_count(text: str) -> int | None:
    """``text`` as a number of things (digits only: no sign), or None."""
    return int(text) if _COUNT.match(text) else None


def parse_float(text: str) -> float | None:
    """``text`` as a finite number (``0.5``, ``2``, ``1e-3``), or None."""
    if len(text) > 100 or not _FLOAT.match(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def shown(text: str) -> str:
    """``text`` quoted for an error line, cut at 40 characters (a value of megabytes is not
    echoed whole); control characters escaped."""
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "…")


def int_problem(text: str) -> str | None:
    return None if parse_int(text) is not None else f"{shown(text)} is not a whole number in ASCII digits (e.g. 3)"


def float_problem(text: str) -> str | None:
    if parse_float(text) is not None:
        return None
    return f"{shown(text)} is not a finite number in ASCII digits (e.g. 0.5, 2 or 1e-3)"


__all__ = ["float_problem", "int_problem", "parse_count", "parse_float", "parse_int", "shown"]
