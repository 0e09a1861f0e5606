"""Values as read from inventory files: where each was written, and Ansible's tagged kinds."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Vaulted:
    """A ``!vault`` value: ciphertext we cannot (and must not pretend to) read."""

    ciphertext: str


class Unsafe(str):
    """A ``!unsafe`` string: Ansible never templates it, so ``{{`` in it is literal text."""


def env_mask(names: Sequence[str]) -> str:
    """What is shown instead of a value computed from ``lookup('env', NAME)``."""
    return f"<value of lookup('env', {', '.join(repr(n) for n in names)})>"


class FromEnv(str):
    """A string (partly) read from the environment by a template's ``lookup('env', NAME)``:
    a secret for all we know (a token, a password). It is used as it is, but its ``repr``,
    which every error message and the CLI's listings show, names the variables instead.
    """

    names: tuple[str, ...]

    def __new__(cls, value: str, names: tuple[str, ...] = ()) -> FromEnv:
        out = super().__new__(cls, value)
        out.names = names
        return out

    def __repr__(self) -> str:
        return env_mask(self.names)


class EnvInt(int):
    """A whole number a template computed from ``lookup('env', NAME)`` (``|int`` of a PIN):
    a secret like :class:`FromEnv`, checked as the number it is. Its ``repr`` and ``str``
    (``int`` prints through ``repr``), so every error message, name the variables. Only the
    checks see it: a built host holds a plain ``int`` (:func:`unmarked`)."""

    names: tuple[str, ...]

    def __new__(cls, value: int, names: tuple[str, ...] = ()) -> EnvInt:
        out = super().__new__(cls, value)
        out.names = names
        return out

    def __repr__(self) -> str:
        return env_mask(self.names)


class EnvFloat(float):
    """:class:`EnvInt` for a number with a fraction (``expected_load_s``)."""

    names: tuple[str, ...]

    def __new__(cls, value: float, names: tuple[str, ...] = ()) -> EnvFloat:
        out = super().__new__(cls, value)
        out.names = names
        return out

    def __repr__(self) -> str:
        return env_mask(self.names)


@dataclass(frozen=True, repr=False)
class EnvFlag:
    """A boolean a template computed from ``lookup('env', NAME)`` (``bool`` has no
    subclasses). No value read from an inventory is a boolean, so it is only ever refused,
    and shown by name."""

    value: bool
    names: tuple[str, ...]

    def __repr__(self) -> str:
        return env_mask(self.names)

    __str__ = __repr__


ENV_MARKED = (FromEnv, EnvInt, EnvFloat, EnvFlag)


def env_names(value: Any) -> tuple[str, ...]:
    """The variables ``lookup('env')`` read for anything in ``value`` (keys included; each
    list or mapping looked at once: YAML's aliases may put one in many places)."""
    names: set[str] = set()
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, ENV_MARKED):
            names.update(item.names)
        if isinstance(item, (dict, list, tuple)) and id(item) not in seen:
            seen.add(id(item))
            stack.extend([*item, *item.values()] if isinstance(item, dict) else item)
    return tuple(sorted(names))


def unmarked(value: Any, _memo: dict[int, Any] | None = None) -> Any:
    """``value`` with the numbers and flags of :data:`ENV_MARKED` made plain again, for
    use (a port is written into commands: ``str()`` of an :class:`EnvInt` is its mask).
    :class:`FromEnv` strings stay: their ``str`` is the value. A list or mapping in several
    places is made once."""
    if isinstance(value, EnvFlag):
        return value.value
    if isinstance(value, EnvInt):
        return int(value)
    if isinstance(value, EnvFloat):
        return float(value)
    if not isinstance(value, (dict, list)):
        return value
    memo = {} if _memo is None else _memo
    if id(value) not in memo:
        if isinstance(value, dict):
            mapping: dict[Any, Any] = {}
            memo[id(value)] = mapping
            mapping.update((key, unmarked(item, memo)) for key, item in value.items())
        else:
            items: list[Any] = []
            memo[id(value)] = items
            items.extend(unmarked(item, memo) for item in value)
    return memo[id(value)]


def printable(text: str) -> str:
    """``text`` as it is when it prints as itself, else quoted with its escapes (a newline
    in an argument must not split a one-line error); a :class:`FromEnv` one by its mask."""
    if isinstance(text, FromEnv):
        return repr(text)
    return text if text.isprintable() else repr(text)


def shown(value: object) -> str:
    """``value`` as text for a listing: a value read by ``lookup('env')`` by where it came from."""
    return repr(value) if isinstance(value, ENV_MARKED) else str(value)


@dataclass(frozen=True)
class Origin:
    """Where a value was written: a file and, for YAML, the key path or, for INI, the line."""

    file: str
    where: str = ""
    line: int | None = None

    def here(self) -> str:
        """``FILE:LINE`` (INI), ``FILE: path`` (YAML) or ``FILE``: the place itself, for what
        is wrong with the entry written there rather than with one of its keys."""
        if self.line is not None:
            return f"{self.file}:{self.line}"
        return f"{self.file}: {self.where}" if self.where else self.file

    def at(self, key: str) -> str:
        """``FILE: path.key`` (YAML), ``FILE:LINE: key`` (INI) or ``FILE: key`` (vars files)."""
        if self.line is not None:
            return f"{self.file}:{self.line}: {key}"
        if self.where:
            return f"{self.file}: {self.where}.{key}"
        return f"{self.file}: {key}"


# --------------------------------------------------------------------------- wording


def did_you_mean(key: object, valid: tuple[str, ...] | list[str]) -> str:
    listing = ", ".join(valid)
    if isinstance(key, FromEnv):  # how close a secret comes to a valid key is not shown either
        return f" (valid keys: {listing})"
    close = difflib.get_close_matches(str(key), list(valid), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?; valid keys: {listing})" if close else f" (valid keys: {listing})"


def kind(value: Any) -> str:
    if value is None:
        return "nothing"
    names: dict[type, str] = {dict: "a mapping", list: "a list", str: "a string"}
    return names.get(type(value), type(value).__name__)
