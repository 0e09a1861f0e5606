"""Per data set and category: accept length and speedup over AR, from the rows' ``categories``.

A DDTree speedup is a property of what is sent (code and math accept long paths, chat
does not), so a mixed workload's cell figure hides what each kind of traffic gets. Each
ledger row carries its requests broken down by ``dataset/category``
(:class:`~ddtree_ops.bench.metrics.GroupMetrics`); here they become one row per
(machine, run, cell, category): the median accept length and per-user tok/s over the
cell's ok repeats, and the speedup over the same machine's AR cell of the same run for that
category under the same conditions, in the same CUDA-graph mode where the AR cell ran in
both. Runs are those of the tidy table (:mod:`.runs`; one, pooled, with ``--pool-runs``).

Only the lines that carry a breakdown are parsed (a byte search skips the rest), so a
ledger written before it costs a scan, not a JSON parse per row. Bad lines are the main
loader's to report (:mod:`.loading`); here they are skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from ddtree_ops.report.aggregation import CELL_KEYS, CONDITION_KEYS, TIDY_DTYPES, GroupBy, as_dtype, machine_column
from ddtree_ops.report.loading import ok_rows_with

#: The per-category table's columns and dtypes, in order (``report --csv-categories``).
CATEGORY_DTYPES: dict[str, str] = {
    # The cell as the tidy table types it, then the category's figures.
    **{name: TIDY_DTYPES[name] for name in ("machine", "run", *CELL_KEYS, "workload_name")},
    "category": "object",
    "n": "Int64",
    "requests": "Int64",
    "accept_length_median": "float64",
    "user_tok_s_median": "float64",
    "speedup_vs_ar": "float64",
}
_ROW_KEYS = ("host", "gpu_name", "workload_name", *CELL_KEYS)
_MARKER = b'"categories": [{'


def _records(files: Sequence[Path], run_of: Mapping[str, str | None] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for row in ok_rows_with(files, _MARKER):
        if not isinstance(row.get("categories"), list):
            continue
        rid = "" if row.get("run_id") is None else str(row["run_id"])  # as report.runs reads it
        if run_of is not None and rid not in run_of:  # a run left out (--run)
            continue
        base = {k: row.get(k) for k in _ROW_KEYS} | {"run": None if run_of is None else run_of[rid]}
        for group in row["categories"]:
            if isinstance(group, dict) and isinstance(group.get("group"), str):
                out.append(base | {"category": group["group"], "requests": group.get("requests"),
                                   "accept_length": group.get("accept_length"), "user_tok_s": group.get("user_tok_s")})
    return out


def category_table(
    files: Sequence[Path], *, by: GroupBy = "gpu", run_of: Mapping[str, str | None] | None = None
) -> pd.DataFrame:
    """One row per (machine, run, cell, category) of the ledgers ``files`` (empty: no
    breakdowns). ``run_of``: each run_id's run as the tidy table holds it
    (:meth:`~.loading.LoadedLedgers.run_of`; a run_id not in it: skipped); None: one run."""
    records = _records([Path(f) for f in files], run_of)
    if not records:
        return pd.DataFrame({name: pd.Series(dtype=dtype) for name, dtype in CATEGORY_DTYPES.items()})
    frame = pd.DataFrame.from_records(records)
    frame = frame.assign(machine=machine_column(frame, by).astype(object))
    keys = ["machine", "run", *CELL_KEYS, "category"]
    for col in ("accept_length", "user_tok_s", "requests"):
        frame[col] = pd.to_numeric(frame[col], errors="coerce")
    grouped = frame.groupby(keys, dropna=False, sort=True)
    table = grouped.agg(
        workload_name=("workload_name", "first"),
        n=("category", "size"),
        requests=("requests", "sum"),
        accept_length_median=("accept_length", "median"),
        user_tok_s_median=("user_tok_s", "median"),
    ).reset_index()
    table["speedup_vs_ar"] = speedup_vs_ar(table)
    return pd.DataFrame({name: as_dtype(table[name], dtype) for name, dtype in CATEGORY_DTYPES.items()})


def speedup_vs_ar(table: pd.DataFrame) -> pd.Series:
    """Per-user tok/s over the AR cell's for the same machine, run, conditions and category:
    the AR cell in the same CUDA-graph mode where there is one, else the other mode's."""
    match = ["machine", "run", *CONDITION_KEYS, "category"]
    ar = table[table["algorithm"] == "AR"][[*match, "cuda_graph", "user_tok_s_median"]]
    same = table.merge(ar, on=[*match, "cuda_graph"], how="left", suffixes=("", "_ar"))["user_tok_s_median_ar"]
    # Any mode: graph mode first (sorted last, kept by "last").
    either = ar.sort_values("cuda_graph").drop_duplicates(match, keep="last").drop(columns="cuda_graph")
    other = table.merge(either, on=match, how="left", suffixes=("", "_ar"))["user_tok_s_median_ar"]
    base = same.where(same.notna(), other)
    return (table["user_tok_s_median"] / base).astype(float).set_axis(table.index)


__all__ = ["CATEGORY_DTYPES", "category_table", "speedup_vs_ar"]
