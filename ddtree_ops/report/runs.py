"""Which benchmark run each ledger row belongs to, so that two runs are never read as repeats.

The same cell measured in two runs (another day, another driver, another load on the box;
on this project's 2-core machine one cell's back-to-back repeats scatter 0.8 %, the same
cell half an hour apart 7 %) is two measurements under two sets of conditions, not one
cell with a wide spread: pooled, a sound pick's MAD swells and it loses to a worse one.
So the report keys cells by run (:mod:`.aggregation`) unless ``--pool-runs`` asks for the
pooling, like vLLM's ``benchmarks/sweep`` and AIPerf keep each run's results apart.

A **run** is one ``bench`` invocation (its ``run_id``) and the ``bench --resume``
invocations that continued it. ``--resume`` gives its rows a run_id of their own (a retried
failed row and the failure it retries must both stay: the loader drops a second row with
one run_id, key and repeat as a copy), so the link is made here: within one ledger, an
invocation of the same sweep (``sweep_hash``, else ``sweep``) that measured none of the
(host, cell, repeat) keys the run already has an ``ok`` row for continues that run — what
``--resume`` does: it skips exactly those. One that measured any of them again is a new
run (a plain ``bench`` appended to the same ledger starts over at repeat 0). A run is named
by its first invocation's run_id; :attr:`Run.started_at` is its first row's start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ddtree_ops.bench.ledger import KEY_FIELDS


@dataclass(frozen=True)
class Run:
    """One run of the ledgers read: its invocations, when it started, what it measured."""

    run: str  # its first invocation's run_id: the run's identity in tables and --json
    started_at: str | None  # the earliest started_at of its rows (ISO 8601 UTC)
    run_ids: tuple[str, ...]  # its invocations: the first, then each --resume that continued it
    sweep: str | None
    files: tuple[str, ...]
    hosts: tuple[str, ...]
    rows: int  # its rows, measured or failed (predicted rows and probes not counted)

    @property
    def label(self) -> str:
        """``run <id> (<started>)``: how tables and refusals name it."""
        return f"run {self.run} ({self.started_at})" if self.started_at else f"run {self.run}"

    def describe(self) -> str:
        """One line for the list of runs: the label, its sweep, rows, hosts and resumes."""
        resumed = len(self.run_ids) - 1
        parts = [self.label, f"sweep {self.sweep}" if self.sweep else "", f"{self.rows} row(s)",
                 f"hosts {', '.join(self.hosts)}", f"resumed {resumed}x ({', '.join(self.run_ids[1:])})" if resumed
                 else "", f"in {', '.join(self.files)}"]
        return "; ".join(p for p in parts if p)

    def as_json(self) -> dict[str, object]:
        return {"run": self.run, "started_at": self.started_at, "run_ids": list(self.run_ids), "sweep": self.sweep,
                "files": list(self.files), "hosts": list(self.hosts), "rows": self.rows}


#: What a null run_id (a hand-made ledger) reads as: one run of its own per ledger chain.
NO_RUN_ID = ""


@dataclass
class _Chain:
    """A run being followed through one ledger: its first invocation and its ok keys so far."""

    head: int
    ok_keys: set[int]


def run_column(frame: pd.DataFrame, owner: np.ndarray) -> np.ndarray:
    """Each row's run: its first invocation's run_id (an object array in row order).
    ``owner``: each row's ledger, an index (rows in file order)."""
    if frame.empty:
        return np.empty(0, dtype=object)
    # Integer codes throughout: a million rows' run_ids are never turned into Python strings.
    codes, names = _invocations(frame)
    # (ledger, invocation) pairs in order of first appearance: the invocations per ledger.
    pairs = owner.astype(np.int64) * len(names) + codes
    _, first = np.unique(pairs, return_index=True)
    first.sort()
    head: dict[int, int] = {}  # invocation -> the invocation its run began with
    for file_index in dict.fromkeys(owner[first].tolist()):
        invocations = codes[first[owner[first] == file_index]].tolist()
        if len(invocations) == 1:
            head.setdefault(invocations[0], invocations[0])
        else:
            _link(frame, codes, np.flatnonzero(owner == file_index), invocations, head)
    run_names = np.array([names[head[i]] for i in range(len(names))], dtype=object)
    return run_names[codes]


def _invocations(frame: pd.DataFrame) -> tuple[np.ndarray, list[str]]:
    """Each row's invocation as a code, and the invocations' run_ids (a null one reads as
    :data:`NO_RUN_ID`), in order of first appearance."""
    codes, uniques = pd.factorize(frame["run_id"], use_na_sentinel=False)
    names = [NO_RUN_ID if value is None or pd.isna(value) else str(value) for value in uniques]
    return codes.astype(np.int64), names


def _link(frame: pd.DataFrame, codes: np.ndarray, rows: np.ndarray, invocations: list[int],
          head: dict[int, int]) -> None:
    """Decide, for the invocations of one ledger (its ``rows``; ``invocations`` in order of
    first appearance), which continue a run (``head``). One seen in an earlier ledger (a
    copy) keeps the run it got there."""
    part = frame[["source", "status", "sweep_hash", "sweep", *KEY_FIELDS]]
    part = part if len(rows) == len(frame) else part.iloc[rows]
    source = part["source"]
    measured = (source.isna() | (source == "measured")).to_numpy(dtype=bool)
    # The --resume key of each row, hashed (64 bits: a collision would take billions of keys).
    keys = pd.util.hash_pandas_object(part[list(KEY_FIELDS)], index=False).to_numpy()
    ok = (part["status"] == "ok").to_numpy(dtype=bool) & measured
    # Rows per invocation as index runs of one stable sort, not a pass over every row each.
    mine_codes = codes[rows]
    order = np.argsort(mine_codes, kind="stable")
    sorted_codes = mine_codes[order]
    chains: dict[object, _Chain] = {}
    for invocation in invocations:
        mine = order[np.searchsorted(sorted_codes, invocation):np.searchsorted(sorted_codes, invocation, "right")]
        first = part.iloc[int(mine[0])]
        sweep_id = first["sweep_hash"] if isinstance(first["sweep_hash"], str) else first["sweep"]
        measured_keys = set(keys[mine][measured[mine]].tolist())
        ok_keys = set(keys[mine][ok[mine]].tolist())
        chain = chains.get(sweep_id)
        if invocation in head:  # decided in an earlier ledger
            if chain is not None and chain.head == head[invocation]:
                chain.ok_keys |= ok_keys
            else:
                chains[sweep_id] = _Chain(head[invocation], ok_keys)
        elif chain is not None and measured_keys.isdisjoint(chain.ok_keys):
            head[invocation] = chain.head  # a --resume: it measured only what the run lacked
            chain.ok_keys |= ok_keys
        else:
            head[invocation] = invocation
            chains[sweep_id] = _Chain(invocation, ok_keys)


def summarize_runs(frame: pd.DataFrame, owner: np.ndarray, files: Sequence[str]) -> tuple[Run, ...]:
    """The runs of ``frame`` (its ``run`` column, :func:`run_column`), oldest first.
    ``owner``: each row's index in ``files``."""
    if frame.empty:
        return ()
    invocation, names = _invocations(frame)
    run_codes, runs = pd.factorize(frame["run"])
    order = np.argsort(run_codes, kind="stable")
    sorted_codes = run_codes[order]
    source = frame["source"]
    counted = (source.isna() | (source == "measured")).to_numpy(dtype=bool)
    out: list[Run] = []
    for code, run in enumerate(runs):
        rows = order[np.searchsorted(sorted_codes, code):np.searchsorted(sorted_codes, code, "right")]
        started = frame["started_at"].iloc[rows].dropna()
        sweeps = frame["sweep"].iloc[rows].dropna()
        out.append(Run(
            run=str(run),
            started_at=str(started.min()) if len(started) else None,
            run_ids=tuple(names[i] for i in pd.unique(invocation[rows])),
            sweep=str(sweeps.iloc[0]) if len(sweeps) else None,
            files=tuple(str(files[i]) for i in pd.unique(owner[rows])),
            hosts=tuple(sorted(str(h) for h in frame["host"].iloc[rows].dropna().unique())),
            rows=int(counted[rows].sum()),
        ))
    # Oldest first; a run without a start time last, then by id: the order runs are listed in.
    return tuple(sorted(out, key=lambda r: (r.started_at is None, r.started_at or "", r.run)))


__all__ = ["NO_RUN_ID", "Run", "run_column", "summarize_runs"]
