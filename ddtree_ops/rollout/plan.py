"""Which hosts a rolling change touches, in which order: the pure plan.

A change that restarts servers (``restart``, ``deploy --restart``, ``tune --deploy``,
``rollback --restart``) goes to its targets in **batches**, as Ansible's ``serial`` does: the
next batch starts only once every host of the one before is ready, so with ``--serial 1``
on three hosts two of them serve at every moment of the rollout. ``--canary HOST`` (or
``--canary N``: the first N targets) is a batch of its own, first, and the rest waits for its
gate. ``--max-fail N`` stops the rollout after the batch in which more than N hosts failed
(default 0: the first failure stops it); the hosts of the batches not started keep their old
patch, configuration and server. Without ``--serial`` and ``--canary`` every target is one
batch: every host at once, as before rollouts existed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ddtree_ops.errors import ConfigError
from ddtree_ops.numbers import parse_count, shown

# ASCII digits only (``\d`` reads '٣' as 3: ``--serial ٣`` ran three-host batches), at most
# 18 of them (Python refuses to read 4,301), blanks or tabs around.
_SERIAL = re.compile(r"[ \t]*([0-9]{1,18})[ \t]*(%?)[ \t]*\Z")


@dataclass(frozen=True)
class Serial:
    """``--serial N`` (hosts per batch) or ``--serial P%`` (that share of the targets,
    rounded down, at least one host: Ansible's rule)."""

    size: int | None = None
    percent: int | None = None

    @classmethod
    def parse(cls, text: str) -> Serial:
        match = _SERIAL.match(text)
        if match is None:
            raise ConfigError(f"--serial {shown(text)}: expected a number of hosts (2) or a share of them (25%)")
        value = int(match.group(1))
        if match.group(2):
            if not 1 <= value <= 100:
                raise ConfigError(f"--serial {text!r}: a share must be 1% to 100%")
            return cls(percent=value)
        if value < 1:
            raise ConfigError(f"--serial {text!r}: at least one host per batch")
        return cls(size=value)

    def batch_size(self, total: int) -> int:
        if self.percent is not None:
            return max(1, math.floor(total * self.percent / 100))
        return self.size or total

    def describe(self) -> str:
        return f"{self.percent}%" if self.percent is not None else str(self.size)


def parse_canary(text: str | None, targets: Sequence[str]) -> tuple[str, ...]:
    """``--canary``: a target host (or a comma list of them), or N for the first N targets
    (N in ASCII digits: '²' or '٣' is a name, and no target's)."""
    if text is None:
        return ()
    text = text.strip()
    count = parse_count(text)
    if count is not None and text not in targets:
        if count < 1:
            raise ConfigError(f"--canary {count}: at least one host goes first")
        if count > len(targets):
            raise ConfigError(f"--canary {count}: the first {count} of {len(targets)} target(s) do not exist")
        return tuple(targets[:count])
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in targets]
    if not names or unknown:
        listed = ", ".join(targets[:8]) + (" ..." if len(targets) > 8 else "")
        raise ConfigError(f"--canary {shown(text)}: {shown(unknown[0] if unknown else text)} is not one of the "
                          f"targets ({listed})")
    return tuple(n for n in targets if n in names)


@dataclass(frozen=True)
class RolloutPlan:
    """The batches in order (the canary's first, when there is one)."""

    batches: tuple[tuple[str, ...], ...]
    canary: tuple[str, ...] = ()
    max_fail: int = 0
    serial: Serial | None = None

    @property
    def rolling(self) -> bool:
        """More than one batch: a rollout, with its batch log, rather than all at once."""
        return len(self.batches) > 1 or bool(self.canary)

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(h for batch in self.batches for h in batch)

    def batch_of(self, host: str) -> int:
        """The 1-based batch ``host`` is in."""
        return next(i for i, batch in enumerate(self.batches, 1) if host in batch)

    def lines(self) -> list[str]:
        """``batch 1 (canary): a`` ... for the dry run and the log."""
        out = []
        for i, batch in enumerate(self.batches, 1):
            label = " (canary)" if self.canary and i == 1 else ""
            out.append(f"batch {i}{label}: {', '.join(batch)}")
        return out


def plan_rollout(
    targets: Sequence[str], *, serial: Serial | None = None, canary: Sequence[str] = (), max_fail: int = 0
) -> RolloutPlan:
    """Batches of ``targets`` (in their order): the canary first, then ``serial`` at a time."""
    if max_fail < 0:
        raise ConfigError(f"--max-fail {max_fail}: must be 0 or more")
    rest = [t for t in targets if t not in canary]
    batches: list[tuple[str, ...]] = [tuple(canary)] if canary else []
    if rest:
        size = serial.batch_size(len(rest)) if serial is not None else len(rest)
        batches += [tuple(rest[i:i + size]) for i in range(0, len(rest), size)]
    return RolloutPlan(batches=tuple(batches), canary=tuple(canary), max_fail=max_fail, serial=serial)


__all__ = ["RolloutPlan", "Serial", "parse_canary", "plan_rollout"]
