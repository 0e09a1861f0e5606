"""Lossless in the field: at T = 0 every DDTree and DFlash cell's outputs against AR's.

Greedy speculative decoding must produce exactly the target's own greedy output, so at
temperature 0 each request's output hash (the ledger's ``output_hashes``, in prompt
order) must equal the AR cell's for the same prompt on the same machine under the same
conditions (workload, concurrency, request rate) in the same run (:mod:`.runs`). A verify path that loses the tree mask
or mis-samples shows up in the first sweep's report, not in production.

Per cell: ``t0_prompts`` (prompts compared: both outputs present) and ``t0_match_frac``
(the share that are equal), from each cell's first ok repeat and the AR cell in the same
CUDA-graph mode where there is one. AR cells are the reference: NA. Only the lines that
carry hashes are parsed (a byte search skips the rest).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from ddtree_ops.report.aggregation import CELL_KEYS, CONDITION_KEYS, TIDY_DTYPES, GroupBy, as_dtype
from ddtree_ops.report.loading import ok_rows_with

MATCH_COLUMNS: tuple[str, ...] = ("t0_prompts", "t0_match_frac")
_MARKER = b'"output_hashes": ["'
_KEYS = ("machine", "run", *CELL_KEYS)


def _hash_rows(files: Sequence[Path], run_of: Mapping[str, str | None] | None) -> list[dict[str, Any]]:
    """The T = 0 ok rows that carry output hashes: their keys, run, repeat and hashes only.
    ``run_of``: run_id -> the row's run (a run_id not in it: a run left out, its rows
    skipped); None: every row of one run."""
    keep = ("host", "gpu_name", "repeat", "output_hashes", *CELL_KEYS)
    out = []
    for row in ok_rows_with(files, _MARKER):
        if row.get("temperature") != 0 or not isinstance(row.get("output_hashes"), list):
            continue
        rid = "" if row.get("run_id") is None else str(row["run_id"])  # as report.runs reads it
        if run_of is not None and rid not in run_of:
            continue
        out.append({k: row.get(k) for k in keep} | {"run": None if run_of is None else run_of[rid]})
    return out


def _first_repeats(rows: Sequence[dict[str, Any]], by: GroupBy) -> dict[tuple[Any, ...], tuple[int, list[Any]]]:
    """(machine, run, cell) -> (repeat, hashes) of its lowest ok repeat at T = 0."""
    found: dict[tuple[Any, ...], tuple[int, list[Any]]] = {}
    for row in rows:
        machine = row.get("host") if by == "host" else (row.get("gpu_name") or row.get("host"))
        key = (machine, row["run"], *(row.get(k) for k in CELL_KEYS))
        repeat = row["repeat"] if isinstance(row.get("repeat"), int) else 0
        if key not in found or repeat < found[key][0]:
            found[key] = (repeat, row["output_hashes"])
    return found


def _compare(a: list[Any], b: list[Any]) -> tuple[int, int]:
    pairs = [(x, y) for x, y in zip(a, b, strict=False) if x is not None and y is not None]
    return len(pairs), sum(x == y for x, y in pairs)


def output_matches(
    files: Sequence[Path], *, by: Sequence[GroupBy] = ("gpu",), run_of: Mapping[str, str | None] | None = None
) -> dict[GroupBy, pd.DataFrame]:
    """Per machine grouping, one row per non-AR (machine, run, cell) at T = 0 that has an AR
    reference in its run (the ledgers are read once for every grouping). ``run_of``: each
    run_id's run as the tidy table holds it (:meth:`~.loading.LoadedLedgers.run_of`)."""
    rows = _hash_rows(files, run_of)
    return {level: _matches(rows, level) for level in by}


def _matches(rows: Sequence[dict[str, Any]], by: GroupBy) -> pd.DataFrame:
    cells = _first_repeats(rows, by)
    ar: dict[tuple[Any, ...], dict[bool, list[Any]]] = {}
    for key, (_, hashes) in cells.items():
        cell = dict(zip(_KEYS, key, strict=True))
        if cell["algorithm"] == "AR":
            ar.setdefault((cell["machine"], cell["run"], *(cell[k] for k in CONDITION_KEYS)), {})[
                bool(cell["cuda_graph"])] = hashes
    records = []
    for key, (_, hashes) in cells.items():
        cell = dict(zip(_KEYS, key, strict=True))
        refs = ar.get((cell["machine"], cell["run"], *(cell[k] for k in CONDITION_KEYS)))
        if cell["algorithm"] == "AR" or not refs:
            continue
        ref = refs.get(bool(cell["cuda_graph"]), refs.get(not bool(cell["cuda_graph"])))
        assert ref is not None
        compared, equal = _compare(hashes, ref)
        records.append(cell | {"t0_prompts": compared, "t0_match_frac": equal / compared if compared else None})
    columns = [*_KEYS, *MATCH_COLUMNS]
    frame = pd.DataFrame.from_records(records, columns=columns)
    return pd.DataFrame({name: as_dtype(frame[name], TIDY_DTYPES[name]) for name in columns})


def attach(tidy: pd.DataFrame, matches: pd.DataFrame) -> pd.DataFrame:
    """``tidy`` with its cells' :data:`MATCH_COLUMNS` filled from ``matches``."""
    if matches.empty or tidy.empty:
        return tidy
    keys = list(_KEYS)
    merged = tidy.drop(columns=list(MATCH_COLUMNS)).merge(matches, on=keys, how="left")
    return merged[list(tidy.columns)].astype({c: tidy[c].dtype for c in MATCH_COLUMNS})


__all__ = ["MATCH_COLUMNS", "attach", "output_matches"]
