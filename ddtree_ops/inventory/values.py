"""Values as read from inventory files: where each was written, and Ansible's tagged kinds."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Vaulted:
    """A ``!vault`` value: ciphertext we cannot (and must not pretend to) read."""

    ciphertext: str


class Unsafe(str):
    """A ``!unsafe`` string: Ansible never templates it, so ``{{`` in it is literal text."""


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
        return f"<value of lookup('env', {', '.join(repr(n) for n in self.names)})>"


def printable(text: str) -> str:
    """``text`` as it is when it prints as itself, else quoted with its escapes (a newline
    in an argument must not split a one-line error)."""
    return text if text.isprintable() else repr(text)


def shown(value: object) -> str:
    """``value`` as text for a listing: a :class:`FromEnv` value by where it came from."""
    return repr(value) if isinstance(value, FromEnv) else str(value)


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


def did_you_mean(key: str, valid: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    listing = ", ".join(valid)
    return f" (did you mean {close[0]!r}?; valid keys: {listing})" if close else f" (valid keys: {listing})"


def kind(value: Any) -> str:
    if value is None:
        return "nothing"
    names: dict[type, str] = {dict: "a mapping", list: "a list", str: "a string"}
    return names.get(type(value), type(value).__name__)
