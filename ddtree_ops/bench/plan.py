"""Sweep spec -> ordered cells, grouped so that each server configuration starts once.

Pure: no I/O, no clock. A *cell* is one server configuration (algorithm, budget, top-k)
with one sampling setting and one concurrency. Only the server configuration needs a
restart; temperature, top-p/top-k and concurrency are request parameters and run on the
live server, so cells are grouped by server configuration and the groups are ordered to
restart as rarely as possible (the configuration already running on a host goes first).
Baselines run on every host with the same sampling grid and workload as the DDTree
cells, so every DDTree row has a comparable baseline row.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ddtree_ops.bench.sweep import GRID_DEFAULTS, SweepSpec

_ALGO_ORDER = {"autoregressive": 0, "dflash": 1, "ddtree": 2}


@dataclass(frozen=True, order=True)
class ServerConfig:
    """What the server is launched with. ``budget``/``topk`` are None unless DDTree."""

    algorithm: str
    budget: int | None = None
    topk: int | None = None

    @property
    def key(self) -> str:
        if self.algorithm == "ddtree":
            return f"ddtree-b{self.budget}-k{self.topk}"
        return self.algorithm

    def sort_key(self) -> tuple[int, int, int]:
        return (_ALGO_ORDER[self.algorithm], self.budget or 0, self.topk or 0)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1

    @property
    def key(self) -> str:
        return f"t{self.temperature:g}-p{self.top_p:g}-k{self.top_k}"

    def as_params(self) -> dict[str, float | int]:
        """SGLang ``sampling_params`` entries (top_k -1 = disabled, as SGLang spells it)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


@dataclass(frozen=True)
class Cell:
    server: ServerConfig
    sampling: Sampling
    concurrency: int
    baseline: bool = False

    @property
    def key(self) -> str:
        """Stable identity of the cell; the ledger and ``--resume`` match on it."""
        return f"{self.server.key}|{self.sampling.key}|c{self.concurrency}"


@dataclass(frozen=True)
class ServerGroup:
    """Cells that share one server launch."""

    server: ServerConfig
    cells: tuple[Cell, ...]


@dataclass(frozen=True)
class SweepPlan:
    groups: tuple[ServerGroup, ...]
    repeats: int
    warmup: int

    @property
    def cells(self) -> tuple[Cell, ...]:
        return tuple(c for g in self.groups for c in g.cells)

    @property
    def restarts(self) -> int:
        return len(self.groups)

    @property
    def runs(self) -> int:
        """Rows this plan writes per host (cells x repeats)."""
        return len(self.cells) * self.repeats


def _server_of(values: Mapping[str, Any]) -> ServerConfig:
    algo = values["algorithm"]
    if algo == "ddtree":
        return ServerConfig("ddtree", int(values["budget"]), int(values["topk"]))
    return ServerConfig(algo)


def _cell_of(values: Mapping[str, Any], *, baseline: bool = False) -> Cell:
    return Cell(
        server=_server_of(values),
        sampling=Sampling(float(values["temperature"]), float(values["top_p"]), int(values["top_k"])),
        concurrency=int(values["concurrency"]),
        baseline=baseline,
    )


def _excluded(values: Mapping[str, Any], rules: tuple[Mapping[str, tuple[Any, ...]], ...]) -> bool:
    for rule in rules:
        # budget/topk mean nothing to non-DDTree cells, so such a rule never excludes them.
        if values["algorithm"] != "ddtree" and ({"budget", "topk"} & set(rule)):
            continue
        if all(values[axis] in allowed for axis, allowed in rule.items()):
            return True
    return False


def expand_cells(spec: SweepSpec) -> list[Cell]:
    """Grid product minus ``exclude`` plus ``include`` plus baselines; no duplicates."""
    axes = list(GRID_DEFAULTS)
    cells: dict[str, Cell] = {}
    for combo in itertools.product(*(spec.grid[a] for a in axes)):
        values = dict(zip(axes, combo, strict=True))
        if _excluded(values, spec.exclude):
            continue
        cell = _cell_of(values)
        cells.setdefault(cell.key, cell)
    for extra in spec.include:
        values = {a: spec.grid[a][0] for a in axes} | dict(extra)
        cell = _cell_of(values)
        cells.setdefault(cell.key, cell)
    sampling_axes = ("temperature", "top_p", "top_k", "concurrency")
    for base in spec.baselines:
        for combo in itertools.product(*(spec.grid[a] for a in sampling_axes)):
            values = dict(zip(sampling_axes, combo, strict=True)) | {"algorithm": base, "budget": None, "topk": None}
            if _excluded(values, spec.exclude):
                continue
            cell = _cell_of(values, baseline=True)
            # A grid cell with the same key is replaced, so it is marked as the baseline it is.
            cells[cell.key] = cell
    return list(cells.values())


def plan_sweep(
    spec: SweepSpec,
    *,
    current: ServerConfig | None = None,
    done: Collection[str] = (),
) -> SweepPlan:
    """Group cells by server configuration and order them: the configuration already running
    (``current``) first, then baselines, then DDTree by budget and top-k. ``done`` holds cell
    keys already complete (``--resume``); they are left out and so are groups left empty."""
    by_server: dict[ServerConfig, list[Cell]] = {}
    for cell in expand_cells(spec):
        if cell.key in done:
            continue
        by_server.setdefault(cell.server, []).append(cell)
    order = sorted(by_server, key=lambda s: (s != current, s.sort_key()))
    groups = tuple(
        ServerGroup(
            server=s,
            cells=tuple(
                sorted(
                    by_server[s],
                    key=lambda c: (c.sampling.temperature, c.sampling.top_p, c.sampling.top_k, c.concurrency),
                )
            ),
        )
        for s in order
    )
    return SweepPlan(groups=groups, repeats=spec.repeats, warmup=spec.warmup)


def cell_seconds(
    cell: Cell, *, num_prompts: int, max_new_tokens: int, warmup: int, s_per_step: float = 0.02
) -> float:
    """Rough measuring time of one run of ``cell``: ``ceil(num_prompts / concurrency)``
    waves of ``max_new_tokens`` decode steps, plus a warmup wave when there is one."""
    waves = math.ceil(num_prompts / cell.concurrency) + (1 if warmup else 0)
    return waves * max_new_tokens * s_per_step


def estimate_seconds(
    plan: SweepPlan,
    *,
    load_s: float,
    num_prompts: int,
    max_new_tokens: int,
    s_per_step: float = 0.02,
) -> float:
    """Rough wall time for one host with one server: every restart costs ``load_s``
    (learned per host, see the state file) and every run :func:`cell_seconds`. An estimate
    for planning, not a promise: speculation makes steps emit several tokens, which only
    shortens it."""
    total = plan.restarts * load_s
    for cell in plan.cells:
        total += plan.repeats * cell_seconds(
            cell, num_prompts=num_prompts, max_new_tokens=max_new_tokens, warmup=plan.warmup, s_per_step=s_per_step
        )
    return total
