"""Loaded ledger rows -> the tidy table: one row per (machine, run, cell), repeats pooled.

A cell is one benchmarked configuration (:data:`CELL_KEYS`); a machine is a host or a
GPU type (:data:`GroupBy`); a run is the rows' ``run`` (:mod:`.runs`): the same cell of two
runs is two tidy rows, each with its own baselines, unless the rows' runs were pooled
(``--pool-runs``: every row's run None). Each tidy row holds the median and MAD of output tok/s over
the cell's ``ok`` repeats, the robust ``score`` that ranks cells, latency medians, and
the speedup over the same machine's AR and DFlash cells. Its columns and dtypes
(:data:`TIDY_DTYPES`) are the CSV contract.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd

from ddtree_ops.errors import ConfigError
from ddtree_ops.report.loading import MEDIAN_COLS

GroupBy = Literal["host", "gpu"]

#: 1.4826·MAD estimates the standard deviation of normally distributed noise.
MAD_TO_SIGMA = 1.4826

#: The conditions a cell ran under (sampling, load, workload): a baseline must match
#: these (and the machine) to be compared against.
CONDITION_KEYS: tuple[str, ...] = ("temperature", "top_p", "top_k", "concurrency", "request_rate", "workload_hash")
#: What identifies a cell on a machine (besides the machine itself).
CELL_KEYS: tuple[str, ...] = ("algorithm", "budget", "topk", "cuda_graph", *CONDITION_KEYS)

#: Tidy table columns and dtypes, in order — the CSV contract (tested).
TIDY_DTYPES: dict[str, str] = {
    "machine": "object",
    # The run that measured the cell (report.runs: its first invocation's run_id); None
    # where runs were pooled (--pool-runs).
    "run": "object",
    "hosts": "object",
    "gpu_name": "object",
    "gpu_arch": "object",
    # GPUs of the server that measured the cell (its slot's, on a host with GPU slots).
    "gpu_count": "Int64",
    "algorithm": "object",
    "budget": "Int64",
    "topk": "Int64",
    "cuda_graph": "bool",
    "temperature": "float64",
    "top_p": "float64",
    "top_k": "Int64",
    "concurrency": "Int64",
    "request_rate": "float64",
    "workload_hash": "object",
    "workload_name": "object",
    # How the prompts reached the model (ledger workload_prompt_format; None in rows before it).
    "workload_prompt_format": "object",
    # ignore_eos on chat prompts: every answer forced to max_new_tokens, past where the
    # model would stop, which a chat workload never does in production (flagged in best).
    "ignore_eos_on_chat": "bool",
    "n": "Int64",
    "n_failed_rows": "Int64",
    "failed_requests": "Int64",
    # Repeats whose ITL/TTFT the client could not observe (ledger client_bound): their
    # latency columns are the client's; tok/s still holds.
    "n_client_bound": "Int64",
    "output_tok_s_median": "float64",
    "output_tok_s_mad": "float64",
    "output_tok_s_min": "float64",
    "output_tok_s_max": "float64",
    "score": "float64",
    "accept_length_median": "float64",
    "ttft_ms_median": "float64",
    "ttft_ms_p99": "float64",
    "itl_ms_median": "float64",
    "itl_ms_p99": "float64",
    "tpot_ms_median": "float64",
    "e2e_ms_median": "float64",
    "speedup_vs_ar": "float64",
    # T = 0 only: prompts whose outputs were compared with the AR cell's, and the share
    # equal (report/lossless.py; NA for AR, other temperatures, and rows without hashes).
    "t0_prompts": "Int64",
    "t0_match_frac": "float64",
    "ar_cuda_graph": "boolean",
    "speedup_vs_dflash": "float64",
    "dflash_cuda_graph": "boolean",
    # Draft tokens of the DFLASH cell that speedup_vs_dflash divides by: for a DDTree cell,
    # the chain of its verify width (root + budget, capped at the drafter's block); NA
    # where only the drafter's own block was measured (ledgers before per-width baselines).
    "dflash_width": "Int64",
    "modes_mixed": "bool",
    "fallback_reason": "object",
    # The graph ceiling of the state that measured the cell (ledger cuda_graph_max_bs), and
    # whether its concurrency is above it: its larger rounds ran eager, so its tok/s is
    # partly an eager number although the cell counts as a CUDA-graph one.
    "cuda_graph_max_bs": "Int64",
    "above_graph_ceiling": "bool",
}

#: The finest grouping: every coarser machine grouping is a function of these keys.
_FINE_KEYS: tuple[str, ...] = ("host", "gpu_name", "run", *CELL_KEYS)
#: Descriptive columns a cell takes from its first row that has a value (file order).
_FIRST_COLS: tuple[str, ...] = (
    "gpu_name", "gpu_arch", "gpu_count", "workload_name", "workload_prompt_format", "workload_ignore_eos",
    "fallback_reason", "cuda_graph_max_bs",
)


def machine_column(frame: pd.DataFrame, by: GroupBy) -> pd.Series:
    """Each row's machine: its host, or (``gpu``) its GPU name, else its host."""
    if by == "host":
        return frame["host"]
    if by == "gpu":
        return frame["gpu_name"].where(frame["gpu_name"].notna(), frame["host"])
    raise ConfigError(f"--group-by must be 'host' or 'gpu', not {by!r}")


def aggregate(frame: pd.DataFrame, *, by: GroupBy = "host") -> pd.DataFrame:
    """One tidy row per (machine, cell), repeats pooled over ``ok`` rows.

    ``by="host"`` gives the per-host table; ``by="gpu"`` pools hosts of one GPU type.
    Failed rows still create their cell (n=0) so that refusals can name them.
    """
    return aggregate_levels(frame, (by,))[by]


@dataclass(frozen=True)
class _FineGroups:
    """The rows grouped once at the finest level (:data:`_FINE_KEYS`): what every machine
    grouping is derived from, so that no grouping has to group the rows again."""

    frame: pd.DataFrame  # the loaded rows
    keys: pd.DataFrame  # the _FINE_KEYS of each fine group, by group id
    failed_rows: np.ndarray  # number of failed rows per fine group
    # Per _FIRST_COLS column: row position of each fine group's first non-null value
    # (len(frame) where it has none).
    first_positions: dict[str, np.ndarray]
    ok_group: np.ndarray  # fine group id of each ok row
    ok_values: pd.DataFrame  # "failed", "client_bound" and MEDIAN_COLS of the ok rows, renumbered from 0


def aggregate_levels(frame: pd.DataFrame, levels: Sequence[GroupBy]) -> dict[GroupBy, pd.DataFrame]:
    """:func:`aggregate` for several machine groupings, sharing the costly row grouping.

    Rows are grouped once at the finest level (host, GPU name, cell); each requested
    grouping is then a mapping of those few thousand groups, so the per-row work left per
    level is a handful of integer-keyed reductions. Medians are order statistics and
    cannot be pooled from per-host medians: they are still taken over the rows.
    """
    for by in levels:
        if by not in ("host", "gpu"):
            raise ConfigError(f"--group-by must be 'host' or 'gpu', not {by!r}")
    if frame.empty:
        empty = {name: pd.Series(dtype=dtype) for name, dtype in TIDY_DTYPES.items()}
        return {by: pd.DataFrame(empty) for by in levels}
    if "run" not in frame:  # rows that name no run (a frame built by hand) are one run
        frame = frame.assign(run=None)
    fine = _group_finely(frame)
    return {by: _aggregate_level(fine, by) for by in levels}


def _group_finely(frame: pd.DataFrame) -> _FineGroups:
    group_of_row = frame.groupby(list(_FINE_KEYS), dropna=False, sort=False).ngroup().to_numpy()
    n_groups = int(group_of_row.max()) + 1
    positions = np.arange(len(frame))
    first_rows = _first_position(positions, group_of_row, n_groups)
    # Row position of each fine group's first non-null value, per column; a coarser
    # group's first() is then the smallest of its fine groups' positions. A column
    # without nulls shares the groups' first rows (saves a sort of every row).
    first_positions = {}
    for column in _FIRST_COLS:
        valid = frame[column].notna().to_numpy()
        first_positions[column] = (
            first_rows
            if valid.all()
            else _first_position(positions[valid], group_of_row[valid], n_groups, missing=len(frame))
        )
    failed = (frame["status"] != "ok").to_numpy()
    ok = ~failed
    return _FineGroups(
        frame=frame,
        keys=frame.iloc[first_rows][list(_FINE_KEYS)].reset_index(drop=True),
        failed_rows=np.bincount(group_of_row, weights=failed, minlength=n_groups),
        first_positions=first_positions,
        ok_group=group_of_row[ok],
        ok_values=frame.loc[ok, ["failed", "client_bound", *MEDIAN_COLS]].reset_index(drop=True),
    )


def _first_position(positions: np.ndarray, group_ids: np.ndarray, n_groups: int, *, missing: int = -1) -> np.ndarray:
    """Smallest of increasing ``positions`` per group id (``missing`` where none)."""
    # Callers pass increasing positions, so each id's first occurrence is its minimum.
    out = np.full(n_groups, missing, dtype=np.int64)
    ids, first = np.unique(group_ids, return_index=True)
    out[ids] = positions[first]
    return out


def _aggregate_level(fine: _FineGroups, by: GroupBy) -> pd.DataFrame:
    keys = ["machine", "run", *CELL_KEYS]
    fine_keys = fine.keys.assign(machine=machine_column(fine.keys, by))
    # Same sorted, NA-keeping grouping as over the rows: the distinct key tuples are the same.
    cell_of_group = fine_keys.groupby(keys, dropna=False, sort=True).ngroup().to_numpy()
    n_cells = int(cell_of_group.max()) + 1
    first_groups = _first_position(np.arange(len(fine_keys)), cell_of_group, n_cells)
    cells = fine_keys.iloc[first_groups][keys].reset_index(drop=True)

    # Host lists from the few thousand fine groups, in plain Python: a pandas per-group
    # lambda costs more than the join itself.
    pairs = sorted(set(zip(cell_of_group.tolist(), fine_keys["host"].tolist(), strict=True)))
    hosts = [""] * n_cells
    for cell, members in itertools.groupby(pairs, key=operator.itemgetter(0)):
        hosts[cell] = ",".join(host for _, host in members)
    cells["hosts"] = hosts
    n_rows = len(fine.frame)
    for column in _FIRST_COLS:
        positions = pd.Series(fine.first_positions[column]).groupby(cell_of_group).min().to_numpy()
        found = positions < n_rows
        values = np.full(n_cells, None, dtype=object)
        values[found] = fine.frame[column].iloc[positions[found]].to_numpy(dtype=object)
        cells[column] = values
    cells["n_failed_rows"] = np.bincount(cell_of_group, weights=fine.failed_rows, minlength=n_cells)

    cell_of_ok_row = cell_of_group[fine.ok_group]
    ok_by_cell = fine.ok_values.groupby(cell_of_ok_row, sort=True)
    # A cell whose rows all failed has no ok rows: reindexing gives it NaN, not a gap.
    every_cell = range(n_cells)
    medians = ok_by_cell[list(MEDIAN_COLS)].median().reindex(every_cell)
    throughput = fine.ok_values["output_tok_s"]
    deviation = (throughput - medians["output_tok_s"].to_numpy()[cell_of_ok_row]).abs()
    cells["n"] = np.bincount(cell_of_ok_row, minlength=n_cells)
    cells["failed_requests"] = ok_by_cell["failed"].sum(min_count=1).reindex(every_cell).fillna(0).to_numpy()
    cells["n_client_bound"] = ok_by_cell["client_bound"].sum().reindex(every_cell).fillna(0).to_numpy()
    cells["output_tok_s_median"] = medians["output_tok_s"].to_numpy()
    cells["output_tok_s_mad"] = deviation.groupby(cell_of_ok_row).median().reindex(every_cell).to_numpy()
    cells["output_tok_s_min"] = ok_by_cell["output_tok_s"].min().reindex(every_cell).to_numpy()
    cells["output_tok_s_max"] = ok_by_cell["output_tok_s"].max().reindex(every_cell).to_numpy()
    cells["accept_length_median"] = medians["accept_length"].to_numpy()
    for column in MEDIAN_COLS[2:]:  # latency columns keep their names
        cells[column] = medians[column].to_numpy()
    cells["score"] = cells["output_tok_s_median"] - MAD_TO_SIGMA * cells["output_tok_s_mad"]
    chat = cells["workload_prompt_format"].astype("string").str.contains("chat-template", regex=False)
    forced = cells["workload_ignore_eos"].fillna(False).astype(bool)
    cells["ignore_eos_on_chat"] = chat.fillna(False).astype(bool) & forced
    ceiling = pd.to_numeric(cells["cuda_graph_max_bs"], errors="coerce").astype("float64")
    above = pd.to_numeric(cells["concurrency"], errors="coerce").astype("float64") > ceiling  # NaN: False
    cells["above_graph_ceiling"] = (cells["cuda_graph"].astype(bool) & above).to_numpy(dtype=bool)

    cells = _add_speedups(cells.reset_index(drop=True))
    cells["t0_prompts"] = pd.NA  # filled from the rows' output hashes (build_report)
    cells["t0_match_frac"] = float("nan")
    return _typed(cells, TIDY_DTYPES)


def _add_speedups(cells: pd.DataFrame) -> pd.DataFrame:
    """Speedup vs the machine's AR and DFLASH cells of the same run under the same
    sampling/workload (a baseline of another run ran under other conditions).

    A baseline in the same CUDA-graph mode is used when there is one; otherwise the
    other mode's, and ``modes_mixed`` says so (eager never silently meets graph). The
    DFLASH baseline of a DDTree cell is the chain of its verify width (:func:`_baseline_tok_s`).
    """
    match_keys = ["machine", "run", *CONDITION_KEYS]
    mode_keys = [*match_keys, "cuda_graph"]
    flipped = cells[match_keys].assign(cuda_graph=~cells["cuda_graph"].astype(bool))
    mixed = pd.Series(False, index=cells.index)
    for algo, prefix in (("AR", "ar"), ("DFLASH", "dflash")):
        baselines = cells.loc[cells["algorithm"] == algo, [*mode_keys, "budget", "output_tok_s_median"]]
        same_mode, same_width = _baseline_tok_s(cells, cells[mode_keys], baselines, mode_keys)
        other_mode, other_width = _baseline_tok_s(cells, flipped, baselines, mode_keys)
        use_other = same_mode.isna() & other_mode.notna()
        baseline = same_mode.where(~use_other, other_mode)
        if algo == "DFLASH":
            cells["dflash_width"] = same_width.where(~use_other, other_width).where(baseline.notna())
        cells[f"speedup_vs_{prefix}"] = cells["output_tok_s_median"] / baseline
        mode = cells["cuda_graph"].astype("boolean").where(~use_other, ~cells["cuda_graph"].astype(bool))
        # pandas-stubs does not accept pd.NA as where()'s `other`; pandas does (a nullable-boolean NA).
        cells[f"{prefix}_cuda_graph"] = mode.where(baseline.notna(), pd.NA)  # type: ignore[call-overload]
        mixed |= use_other & (cells["algorithm"] != algo)
    cells["modes_mixed"] = mixed
    return cells


def _baseline_tok_s(
    cells: pd.DataFrame, keys: pd.DataFrame, baselines: pd.DataFrame, on: list[str]
) -> tuple[pd.Series, pd.Series]:
    """Per cell, the tok/s of the baseline row matching ``keys`` on ``on``, and that row's
    budget (for DFLASH, its draft tokens; NA for the drafter's own block).

    Among several (DFlash chains of several widths), a DDTree cell of budget B takes the
    longest chain that verifies no more than it does (root + B tokens; a sweep caps the
    chain at the drafter's block), else the drafter's own block; a DFlash cell takes
    itself; any other takes the drafter's own block, else the longest chain.
    """
    algorithm, budget = cells["algorithm"], pd.to_numeric(cells["budget"], errors="coerce")
    wanted = (budget + 1).where(algorithm == "DDTREE", budget.where(algorithm == "DFLASH"))
    pairs = keys.assign(_cell=np.arange(len(cells)), _wanted=wanted.to_numpy()).merge(
        baselines.rename(columns={"budget": "_width"}), on=on, how="inner")
    width, wanted_width = pd.to_numeric(pairs["_width"], errors="coerce"), pairs["_wanted"]
    fits = width.isna() | wanted_width.isna() | (width <= wanted_width)
    # The drafter's own block ranks above every chain for a cell that wants no width, below
    # every fitting chain for one that does.
    rank = width.where(width.notna(), np.where(wanted_width.isna(), np.inf, -1.0))
    chosen = pairs.assign(_rank=rank)[fits]
    chosen = chosen.sort_values("_rank", kind="stable").drop_duplicates("_cell", keep="last").set_index("_cell")
    picked = chosen.reindex(np.arange(len(cells)))
    tok_s = pd.Series(pd.to_numeric(picked["output_tok_s_median"], errors="coerce").to_numpy(), index=cells.index)
    widths = pd.Series(pd.to_numeric(picked["_width"], errors="coerce").round().to_numpy(), index=cells.index)
    return tok_s.astype("float64"), widths.astype("Int64")


def _typed(frame: pd.DataFrame, dtypes: dict[str, str]) -> pd.DataFrame:
    """``frame``'s columns in ``dtypes``' order, each converted by :func:`as_dtype`."""
    return pd.DataFrame({name: as_dtype(frame[name], dtype) for name, dtype in dtypes.items()}).reset_index(drop=True)


def as_dtype(column: pd.Series, dtype: str) -> pd.Series:
    """``column`` as ``dtype``, missing values as NA (``Int64``) or None (``object``).

    Whole numbers arrive as float64 (the loader parses every number as float64), hence
    the rounding before the cast.
    """
    if dtype == "Int64":
        return pd.to_numeric(column, errors="coerce").round().astype("Int64")
    if dtype == "object":
        return column.astype(object).where(column.notna(), None)
    return column.astype(pd.api.types.pandas_dtype(dtype))  # what astype does with a dtype name
