"""Which of a group's measured candidates wins (issue 56 item 2). Pure: no I/O, no clock.

A predicted plan measures the top N predicted trees of each (sampling, concurrency) group.
One measurement each cannot tell them apart: on a busy machine one measurement of the best
tree came out 41-43 % below the same tree's full-grid figure and another tree was chosen,
18 % below the best. So the candidates are measured in interleaved passes (every candidate
of every undecided group once per pass, each pass a repeat), and after each pass a group is
judged from the median and the MAD (median absolute deviation) of each candidate's
repeats, as vLLM's speculative-K tuner (``benchmarks/sweep/tune_speculative_k.py``) judges
its candidates:

* a candidate's noise is 1.4826 x its MAD (the MAD scaled to a normal law's standard
  deviation);
* a candidate stays in contention while the best median is ahead of its median by no more
  than the two candidates' noise together; the others are out (not measured again);
* a group is **decided** once every candidate still in contention lies within
  :data:`TIE` (1 %) of the best median: those are one tie, and the smallest tree of the
  tie wins (a smaller tree verifies less: the same speed for less GPU work), as the vLLM
  tuner gives the smaller K every candidate within its relative tolerance;
* a group not decided after :func:`repeats_cap` passes stays **undecided**: the best
  median wins (the smallest tree within 1 % of it), and the verdict says by how much it
  led the runner-up and what the noise was.

Nothing is judged before every candidate has :func:`repeats_floor` repeats (at least 2: a
single value has no spread). A failed measurement counts as a pass taken, not a value.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Tree = tuple[int, int]  # (budget, top-k)

#: Candidates within this fraction of the best median are a tie (the smallest tree wins).
TIE = 0.01
#: Repeats every candidate gets before a group is judged (more where the sweep asks more).
MIN_REPEATS = 2
#: Passes after which a group not yet decided stays undecided (more where the sweep's
#: repeats ask more).
MAX_REPEATS = 6
#: Scales a MAD to the standard deviation of a normal law.
MAD_TO_SD = 1.4826


def repeats_floor(sweep_repeats: int) -> int:
    """Repeats of every candidate before judging: the sweep's, at least :data:`MIN_REPEATS`."""
    return max(MIN_REPEATS, sweep_repeats)


def repeats_cap(sweep_repeats: int, most: int = MAX_REPEATS) -> int:
    """Most passes over a group: ``most`` (the sweep's ``predict.max_repeats``,
    :data:`MAX_REPEATS` by default), at least the floor."""
    return max(most, repeats_floor(sweep_repeats))


@dataclass(frozen=True)
class Candidate:
    """One candidate tree of a group: its measured tok/s, one value per ok repeat, and the
    repeats taken (failed ones included)."""

    tree: Tree
    values: tuple[float, ...]
    taken: int

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else 0.0

    @property
    def noise(self) -> float:
        """1.4826 x the MAD of the values: a standard deviation, robust to one outlier."""
        if len(self.values) < 2:
            return 0.0
        m = self.median
        return MAD_TO_SD * statistics.median(abs(v - m) for v in self.values)


@dataclass(frozen=True)
class Verdict:
    """A group's state after a pass. ``winner``: the tree chosen so far (None: no candidate
    measured ok). ``contenders``: the trees still in contention (what the next pass
    measures while ``more``). ``decided``: the winner is ahead of every other candidate by
    more than their noise, or tied with the rest within 1 %. ``runner_up``: the best
    candidate outside the winner's tie; ``gap`` how far the best median led it and ``noise``
    the two candidates' noise together, both as fractions of the best median. ``more``:
    measure another pass (not decided, cap not reached)."""

    winner: Tree | None
    contenders: tuple[Tree, ...]
    decided: bool
    more: bool
    runner_up: Tree | None = None
    gap: float | None = None
    noise: float | None = None
    tie: tuple[Tree, ...] = ()
    repeats: int = 0

    @property
    def why(self) -> str:
        if self.winner is None:
            return "no candidate measured ok"
        if not self.decided:
            return "undecided"
        if len(self.contenders) > 1:
            return "tie"
        return "ahead"


def judge(candidates: Sequence[Candidate], *, floor: int, cap: int, tie: float = TIE) -> Verdict:
    """The verdict on one group after its last pass (see the module docstring)."""
    measured = [c for c in candidates if c.values]
    taken = max((c.taken for c in candidates), default=0)
    if not measured:
        return Verdict(None, tuple(c.tree for c in candidates), decided=False,
                       more=taken < cap and bool(candidates), repeats=taken)
    if any(c.taken < floor for c in candidates) and taken < cap:
        best = max(measured, key=lambda c: (c.median, [-x for x in c.tree]))
        return Verdict(best.tree, tuple(c.tree for c in candidates), decided=False, more=True, repeats=taken)
    best = max(measured, key=lambda c: (c.median, [-x for x in c.tree]))
    top = best.median
    tied = [c for c in measured if c.median >= (1.0 - tie) * top]
    contenders = [c for c in measured if c in tied or top - c.median <= best.noise + c.noise]
    winner = min(tied, key=lambda c: c.tree)
    rest = [c for c in measured if c not in tied]
    runner = max(rest, key=lambda c: c.median) if rest else None
    gap = (top - runner.median) / top if runner is not None and top > 0 else None
    noise = (best.noise + runner.noise) / top if runner is not None and top > 0 else None
    decided = len(contenders) == len(tied)
    return Verdict(winner.tree, tuple(sorted(c.tree for c in contenders)), decided=decided,
                   more=not decided and taken < cap, runner_up=runner.tree if runner else None, gap=gap, noise=noise,
                   tie=tuple(sorted(c.tree for c in tied)), repeats=taken)


__all__ = ["MAD_TO_SD", "MAX_REPEATS", "MIN_REPEATS", "TIE", "Candidate", "Tree", "Verdict", "judge", "repeats_cap",
           "repeats_floor"]
