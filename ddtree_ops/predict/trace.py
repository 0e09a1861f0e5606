"""The DDTree tree trace: its one definition in the toolkit, and the loader that validates it.

With the trace on (``POST /set_internal_state`` with :func:`trace_switch`'s server args;
off: ``{"ddtree_trace": 0}``) every verify round of a DDTree
server verifies the union of the grid's best-first trees (per top-k K, the builder's tree at
the largest grid budget for K, united by token path), and each response carries
``meta_info["ddtree_trace"]``::

    {"version": 2, "grid": [[b, k], ...], "block": draft block size,
     "sampling": {"temperature", "top_k", "top_p", "min_p"}, "truncated": bool,
     "rounds": [{"prefix": committed length at the round's start, "root": root token id,
                 "draft_ids": D x Kmax ints, "draft_logp": D x Kmax floats (rows by
                 descending log-prob, as the builder saw them),
                 "parent": [n] parent of verified nodes 1..n (0 = the root),
                 "token": [n], "p": [n] target probability of the node's token at its
                 parent under the request's sampling (T = 0: 1.0 for the argmax, else 0.0),
                 "argmax": [n] 0/1, "accepted": nodes the verifier accepted}, ...]}

A recorded round commits one token (the first of the accepted path, or the bonus): a
request's rounds sit at consecutive positions, their roots spell its output, and the
trace holds the draft at every position (version 2; version 1 committed whole paths).

The bench client writes one such object per line (``.ndjson``, not ``.jsonl``: the report
reads every ``*.jsonl`` under a folder as a ledger) beside the ledger. :func:`load_trace_file`
refuses a bad file in one line naming the file, the line and the round.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ddtree_ops.errors import ConfigError
from ddtree_ops.fsutil import read_named_text
from ddtree_ops.limits import MAX_DDTREE_BUDGET, MAX_DDTREE_TOPK

TRACE_VERSION = 2
#: Suffix of a trace file (one request's trace per line).
TRACE_SUFFIX = ".ndjson"
# Draft log-probs are floats on the device: a row may be out of order by rounding only.
_ORDER_SLACK = 1e-4
_P_SLACK = 1e-5


class TraceProblem(ValueError):
    """Why one trace object is not a valid trace (the loader adds file and line)."""


@dataclass(frozen=True)
class TraceSampling:
    temperature: float
    top_k: int
    top_p: float
    min_p: float


@dataclass(frozen=True)
class TraceRound:
    """One verify round: the draft table and the verified (union) tree's verdicts."""

    prefix: int
    root: int
    draft_ids: tuple[tuple[int, ...], ...]
    draft_logp: tuple[tuple[float, ...], ...]
    parent: tuple[int, ...]
    token: tuple[int, ...]
    p: tuple[float, ...]
    argmax: tuple[int, ...]
    accepted: int

    @property
    def nodes(self) -> int:
        """Verified non-root nodes."""
        return len(self.token)

    @cached_property
    def children(self) -> dict[tuple[int, int], int]:
        """(parent index, token) -> node index (1-based; 0 is the root): nodes by token path."""
        return {(par, tok): i + 1 for i, (par, tok) in enumerate(zip(self.parent, self.token, strict=True))}

    @cached_property
    def reach(self) -> tuple[float, ...]:
        """P(the walk reaches node i), i = 0..n: the product of ``p`` along its path."""
        out = [1.0]
        for par, prob in zip(self.parent, self.p, strict=True):
            out.append(out[par] * prob)
        return tuple(out)


@dataclass(frozen=True)
class RequestTrace:
    """One request's trace (``meta_info["ddtree_trace"]``)."""

    grid: tuple[tuple[int, int], ...]
    block: int
    sampling: TraceSampling
    truncated: bool
    rounds: tuple[TraceRound, ...]
    version: int = TRACE_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)


def _int(value: Any, what: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise TraceProblem(f"{what} must be an integer {bound}, got {value!r}")
    return value


def _num(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceProblem(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise TraceProblem(f"{what} must be a list, got {type(value).__name__}")
    return value


def parse_grid(raw: Any, what: str = "grid") -> tuple[tuple[int, int], ...]:
    """``[[budget, topk], ...]``, each a tree the bundle serves; no duplicates."""
    items = _list(raw, what)
    if not items:
        raise TraceProblem(f"{what} is empty")
    grid: list[tuple[int, int]] = []
    for i, pair in enumerate(items):
        if not isinstance(pair, list) or len(pair) != 2:
            raise TraceProblem(f"{what}[{i}] must be [budget, topk], got {pair!r}")
        grid.append((_int(pair[0], f"{what}[{i}] budget", 1, MAX_DDTREE_BUDGET),
                     _int(pair[1], f"{what}[{i}] topk", 1, MAX_DDTREE_TOPK)))
    if len(set(grid)) != len(grid):
        raise TraceProblem(f"{what} lists a tree twice")
    return tuple(grid)


def _round(raw: Any, block: int, kmax: int) -> TraceRound:
    if not isinstance(raw, Mapping):
        raise TraceProblem("must be an object")
    missing = [k for k in ("prefix", "root", "draft_ids", "draft_logp", "parent", "token", "p", "argmax", "accepted")
               if k not in raw]
    if missing:
        raise TraceProblem(f"missing {', '.join(missing)}")
    ids_rows = _list(raw["draft_ids"], "draft_ids")
    lp_rows = _list(raw["draft_logp"], "draft_logp")
    if not ids_rows or len(ids_rows) != len(lp_rows) or len(ids_rows) > block - 1:
        raise TraceProblem(f"draft_ids and draft_logp must have the same 1..{block - 1} rows (block {block}), "
                           f"got {len(ids_rows)} and {len(lp_rows)}")
    ids: list[tuple[int, ...]] = []
    lps: list[tuple[float, ...]] = []
    for d, (irow, lrow) in enumerate(zip(ids_rows, lp_rows, strict=True)):
        irow, lrow = _list(irow, f"draft_ids[{d}]"), _list(lrow, f"draft_logp[{d}]")
        if len(irow) != len(lrow) or len(irow) < kmax:
            raise TraceProblem(f"draft row {d} must hold the same >= {kmax} (the grid's largest top-k) ids and "
                               f"log-probs, got {len(irow)} and {len(lrow)}")
        ids.append(tuple(_int(t, f"draft_ids[{d}]", 0) for t in irow))
        row = tuple(_num(v, f"draft_logp[{d}]") for v in lrow)
        if any(v > _ORDER_SLACK for v in row) or any(b > a + _ORDER_SLACK for a, b in zip(row, row[1:], strict=False)):
            raise TraceProblem(f"draft_logp[{d}] must be log-probs (<= 0) by descending value")
        lps.append(row)
    parent = [_int(v, "parent", 0) for v in _list(raw["parent"], "parent")]
    token = [_int(v, "token", 0) for v in _list(raw["token"], "token")]
    p = [_num(v, "p") for v in _list(raw["p"], "p")]
    argmax = [_int(v, "argmax", 0, 1) for v in _list(raw["argmax"], "argmax")]
    n = len(parent)
    if not len(token) == len(p) == len(argmax) == n:
        raise TraceProblem(f"parent, token, p and argmax must have one entry per node, got {n}, {len(token)}, "
                           f"{len(p)}, {len(argmax)}")
    seen: set[tuple[int, int]] = set()
    for i, par in enumerate(parent):
        if par > i:  # node i + 1's parent must come before it
            raise TraceProblem(f"node {i + 1}'s parent {par} does not come before it")
        if (par, token[i]) in seen:
            raise TraceProblem(f"node {i + 1} repeats token {token[i]} under parent {par}")
        seen.add((par, token[i]))
    if any(not -_P_SLACK <= v <= 1 + _P_SLACK for v in p):
        raise TraceProblem("p must be probabilities in [0, 1]")
    return TraceRound(
        prefix=_int(raw["prefix"], "prefix", 0), root=_int(raw["root"], "root", 0), draft_ids=tuple(ids),
        draft_logp=tuple(lps), parent=tuple(parent), token=tuple(token),
        p=tuple(min(1.0, max(0.0, v)) for v in p), argmax=tuple(argmax),
        accepted=_int(raw["accepted"], "accepted", 0, n),
    )


def parse_trace(raw: Any) -> RequestTrace:
    """One ``meta_info["ddtree_trace"]`` object as a :class:`RequestTrace`; raises
    :class:`TraceProblem` (its message starts ``round N:`` for a bad round)."""
    if not isinstance(raw, Mapping):
        raise TraceProblem("a trace must be a JSON object")
    if raw.get("version") != TRACE_VERSION:
        raise TraceProblem(f"version {raw.get('version')!r} is not {TRACE_VERSION}")
    grid = parse_grid(raw.get("grid"))
    block = _int(raw.get("block"), "block", 2)
    sampling = raw.get("sampling")
    if not isinstance(sampling, Mapping):
        raise TraceProblem("sampling must be an object {temperature, top_k, top_p, min_p}")
    samp = TraceSampling(
        temperature=_num(sampling.get("temperature"), "sampling.temperature"),
        top_k=int(_num(sampling.get("top_k", -1), "sampling.top_k")),
        top_p=_num(sampling.get("top_p", 1.0), "sampling.top_p"),
        min_p=_num(sampling.get("min_p", 0.0), "sampling.min_p"),
    )
    truncated = raw.get("truncated")
    if not isinstance(truncated, bool):
        raise TraceProblem("truncated must be true or false")
    kmax = max(k for _, k in grid)
    rounds: list[TraceRound] = []
    for i, rnd in enumerate(_list(raw.get("rounds"), "rounds")):
        try:
            rounds.append(_round(rnd, block, kmax))
        except TraceProblem as exc:
            raise TraceProblem(f"round {i}: {exc}") from None
    known = {"version", "grid", "block", "sampling", "truncated", "rounds"}
    return RequestTrace(grid=grid, block=block, sampling=samp, truncated=truncated, rounds=tuple(rounds),
                        extra={k: v for k, v in raw.items() if k not in known})


def parse_trace_lines(lines: Iterable[str], *, source: str) -> list[RequestTrace]:
    """Every line's trace; ConfigError ``source:line: round N: why`` at the first bad one."""
    out: list[RequestTrace] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{source}:{lineno}: not valid JSON: {exc}"[:300]) from None
        try:
            out.append(parse_trace(obj))
        except TraceProblem as exc:
            raise ConfigError(f"{source}:{lineno}: {exc}") from None
    return out


def load_trace_file(path: Path | str) -> list[RequestTrace]:
    """A trace file (one request's trace per line), validated; ConfigError naming the
    file, line and round of the first bad entry, or an empty or unreadable file."""
    path = Path(path)
    text = read_named_text(path, ConfigError, what="trace file", form="JSON lines")
    traces = parse_trace_lines(text.splitlines(), source=str(path))
    if not traces:
        raise ConfigError(f"{path}: holds no trace (one request's meta_info.ddtree_trace per line)")
    return traces


def _tree_nodes(topk: int, depth: int, cap: int) -> int:
    total, level = 0, 1
    for _ in range(depth):
        level *= topk
        total += level
        if total >= cap:
            return cap
    return total


def union_bound(grid: Iterable[tuple[int, int]], block: int) -> int:
    """The most non-root nodes the union of ``grid``'s best-first trees can hold: per top-k
    its largest budget (at most the nodes a k-ary tree of its depth min(block - 1, b) has),
    summed, at most the widest product tree's. A traced round verifies the union in the
    smallest runtime state at least this big (the bundle's ``ddtree_trace.union_bound``,
    held equal by a test), so a trace run's grid must fit the launch's largest budget."""
    largest: dict[int, int] = {}
    for budget, topk in grid:
        largest[topk] = max(budget, largest.get(topk, 0))
    total = sum(_tree_nodes(k, min(block - 1, b), b) for k, b in largest.items())
    return _tree_nodes(max(largest), min(block - 1, max(largest.values())), total)


#: The ``/set_internal_state`` key that turns the trace on (1) and off (0).
TRACE_KEY = "ddtree_trace"


def trace_switch(grid: Iterable[tuple[int, int]], *, max_rounds: int | None = None) -> dict[str, int]:
    """The ``server_args`` of ``/set_internal_state`` that turn the trace on for ``grid``:
    SGLang 0.5.23 takes numbers only there (``SetInternalStateReq``), so the grid is one key
    per tree, ``{"ddtree_trace": 1, "ddtree_trace_grid_<budget>x<topk>": 1, ...,
    "ddtree_trace_max_rounds": n}`` (the bundle's ``ddtree_trace.trace_request``; a test
    holds the two equal). :data:`TRACE_OFF` turns it off."""
    out = {TRACE_KEY: 1}
    out.update({f"{TRACE_KEY}_grid_{int(b)}x{int(k)}": 1 for b, k in grid})
    if max_rounds is not None:
        out[f"{TRACE_KEY}_max_rounds"] = int(max_rounds)
    return out


TRACE_OFF: Mapping[str, int] = {TRACE_KEY: 0}


def trace_line(obj: Mapping[str, Any]) -> str:
    """One trace as a line of a trace file (compact JSON and its newline)."""
    return json.dumps(obj, separators=(",", ":")) + "\n"


def union_grid(traces: Sequence[RequestTrace]) -> tuple[tuple[int, int], ...]:
    """The grid every trace of ``traces`` was verified for (they must agree)."""
    grids = {t.grid for t in traces}
    if len(grids) != 1:
        raise ConfigError(f"traces of {len(grids)} different grids cannot predict one sweep")
    return next(iter(grids))


__all__ = [
    "TRACE_KEY",
    "TRACE_OFF",
    "TRACE_SUFFIX",
    "TRACE_VERSION",
    "RequestTrace",
    "TraceProblem",
    "TraceRound",
    "TraceSampling",
    "load_trace_file",
    "parse_grid",
    "parse_trace",
    "parse_trace_lines",
    "trace_line",
    "trace_switch",
    "union_bound",
    "union_grid",
]
