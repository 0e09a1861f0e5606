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
