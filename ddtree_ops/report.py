"""Ledger -> pandas -> tidy per-cell table, best configurations, comparisons.

The report answers: on this machine, at this temperature and concurrency, which
algorithm/budget/top-k is fastest, by how much over autoregressive decoding and over
plain DFlash, and how sure are we. Everything here is pure pandas on a loaded frame;
the CLI renders, :mod:`ddtree_ops.report_plots` draws.

Loading is the costly part (ledgers grow to millions of rows, ~1.7 KB each): the file
is memory-mapped and cut into blocks of whole lines, each parsed in place by pyarrow's
JSON reader (its threads use every core) with an explicit schema of only the columns the
report needs. A block pyarrow refuses — a bad line, an old schema version, anything that
is not exactly one object per line — is split in halves and retried, down to a small
slice that is re-read line by line with the ledger's own parser, so bad lines are
counted with their line numbers, never fatal, and a row reads the same on either path.
Without pyarrow every block takes the line-by-line path (correct, slower).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd

from ddtree_ops.bench.ledger import SCHEMA_VERSION, parse_lines
from ddtree_ops.errors import ConfigError

GroupBy = Literal["host", "gpu"]

#: 1.4826·MAD estimates the standard deviation of normally distributed noise.
MAD_TO_SIGMA = 1.4826
#: Candidates within this fraction of the best score count as ties (cheapest wins).
TIE_TOLERANCE = 0.01
DEFAULT_MIN_REPEATS = 3

_STR_COLS = ("host", "gpu_name", "gpu_arch", "algorithm", "fallback_reason", "workload_hash", "workload_name", "status")
_INT_COLS = ("schema_version", "budget", "topk", "top_k", "concurrency", "failed")
#: Per-row metrics whose per-cell median the tidy table reports.
_MEDIAN_COLS: tuple[str, ...] = (
    "output_tok_s",
    "accept_length",
    "ttft_ms_median",
    "ttft_ms_p99",
    "itl_ms_median",
    "itl_ms_p99",
    "tpot_ms_median",
    "e2e_ms_median",
)
_FLOAT_COLS = ("temperature", "top_p", "request_rate", *_MEDIAN_COLS)
_BOOL_COLS = ("cuda_graph",)
#: Ledger columns the report reads; everything else in a row is skipped while parsing
#: (each column read costs parse time on every row, so only what aggregation uses).
LOAD_COLUMNS: tuple[str, ...] = _STR_COLS + _INT_COLS + _FLOAT_COLS + _BOOL_COLS
#: A row lacking any of these cannot be placed in a cell: it is a bad line.
_NEEDED = ("host", "algorithm", "status", "cuda_graph", "temperature", "concurrency")

#: What identifies a cell on a machine (besides the machine itself).
CELL_KEYS: tuple[str, ...] = (
    "algorithm",
    "budget",
    "topk",
    "cuda_graph",
    "temperature",
    "top_p",
    "top_k",
    "concurrency",
    "request_rate",
    "workload_hash",
)
#: A baseline must match these (and the machine) to be compared against.
_BASELINE_KEYS: tuple[str, ...] = ("temperature", "top_p", "top_k", "concurrency", "request_rate", "workload_hash")
_ALGO_COST = {"AR": 0, "DFLASH": 1, "DDTREE": 2}

#: Tidy table columns and dtypes, in order — the CSV contract (tested).
TIDY_DTYPES: dict[str, str] = {
    "machine": "object",
    "hosts": "object",
    "gpu_name": "object",
    "gpu_arch": "object",
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
    "n": "Int64",
    "n_failed_rows": "Int64",
    "failed_requests": "Int64",
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
    "ar_cuda_graph": "boolean",
    "speedup_vs_dflash": "float64",
    "dflash_cuda_graph": "boolean",
    "modes_mixed": "bool",
    "fallback_reason": "object",
}

BEST_COLUMNS: tuple[str, ...] = (
    "machine",
    "temperature",
    "top_p",
    "top_k",
    "concurrency",
    "request_rate",
    "workload_name",
    "modes",
    "algorithm",
    "budget",
    "topk",
    "cuda_graph",
    "output_tok_s_median",
    "output_tok_s_mad",
    "score",
    "n",
    "accept_length_median",
    "speedup_vs_ar",
    "speedup_vs_dflash",
    "candidates",
    "refused",
    "runner_up",
    "note",
)

#: Bytes handed to one pyarrow call: large enough that its worker threads stay busy,
#: small enough that a refused block is cheap to split and re-read.
_BLOCK_BYTES = 64 << 20
#: pyarrow's own unit of parallel parsing inside one call.
_ARROW_CHUNK_BYTES = 4 << 20
#: A refused slice smaller than this goes line by line instead of being split again.
_CAREFUL_BYTES = 1 << 20
_COUNT_BYTES = 1 << 20


@dataclass(frozen=True)
class LoadedLedgers:
    """All valid rows of the ledgers read (``LOAD_COLUMNS``), and what was skipped."""

    frame: pd.DataFrame
    files: tuple[Path, ...]
    bad_lines: tuple[tuple[str, int, str], ...]  # (file, 1-based line, reason)


@dataclass(frozen=True)
class BestConfigs:
    """Recommendations, and every cell that was refused with the reason."""

    best: pd.DataFrame
    refusals: pd.DataFrame  # machine, cell, reason


@dataclass(frozen=True)
class Report:
    loaded: LoadedLedgers
    tidy: pd.DataFrame  # per (host, cell)
    grouped: pd.DataFrame  # per (group-by machine, cell): what best configs and plots use
    best: BestConfigs
    group_by: GroupBy


# ---------------------------------------------------------------- loading


def find_ledgers(paths: Sequence[Path | str], *, default_dir: Path = Path("results")) -> list[Path]:
    """Ledger files named or found under the given paths (``**/*.jsonl`` for folders).

    With no paths, every ledger under ``results/``. A named path that does not exist is
    a ConfigError (a typo must not produce an empty report that looks like no data).
    """
    found: list[Path] = []
    for raw in paths or [default_dir]:
        p = Path(raw)
        if p.is_dir():
            found.extend(sorted(p.rglob("*.jsonl")))
        elif p.is_file():
            found.append(p)
        elif paths:
            raise ConfigError(f"{p}: no such ledger file or folder")
    return list(dict.fromkeys(found))


def _arrow() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.json as pj
    except ImportError:
        return None
    return pa, pc, pj


def _arrow_schema(pa: Any) -> Any:
    # Integer fields are parsed as float64 directly: the frame holds them as float64
    # anyway (see _coerce), and a cast afterwards costs a pass over every column. It
    # also reads 16.0 like the careful path does (as 16) instead of refusing the block.
    return pa.schema(
        [(c, pa.string()) for c in _STR_COLS]
        + [(c, pa.float64()) for c in _INT_COLS + _FLOAT_COLS]
        + [(c, pa.bool_()) for c in _BOOL_COLS]
    )


def _fast_block(block: Any, arrow: Any) -> Any | None:
    """Parse a run of complete lines with pyarrow; None when a line needs the careful path.

    ``block`` is a zero-copy view of the file's bytes. The caller must also refuse a
    table whose row count is not the block's line count: pyarrow skips blank lines and
    accepts two objects on one line, where the careful parser skips the first and
    reports the second, so only a one-object-per-line block keeps line numbers and
    verdicts identical on both paths.
    """
    pa, pc, pj = arrow
    try:
        table = pj.read_json(
            pa.BufferReader(pa.py_buffer(block)),
            read_options=pj.ReadOptions(block_size=_ARROW_CHUNK_BYTES),
            parse_options=pj.ParseOptions(explicit_schema=_arrow_schema(pa), unexpected_field_behavior="ignore"),
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    version = table.column("schema_version")
    if version.null_count or not pc.all(pc.equal(version, SCHEMA_VERSION)).as_py():
        return None
    if any(table.column(c).null_count for c in _NEEDED):
        return None
    return table


def _careful_block(
    lines: list[bytes], *, name: str, first_lineno: int, at_eof: bool, bad: list[tuple[str, int, str]]
) -> pd.DataFrame:
    read = parse_lines(lines, first_lineno=first_lineno, at_eof=at_eof)
    bad.extend((name, n, reason) for n, reason in read.bad_lines)
    kept: list[dict[str, Any]] = []
    if read.rows:
        # parse_lines drops blank lines, so recover line numbers for the field check.
        numbers = [first_lineno + i for i, raw in enumerate(lines) if raw.strip()]
        bad_numbers = {n for n, _ in read.bad_lines}
        numbers = [n for n in numbers if n not in bad_numbers]
        for lineno, row in zip(numbers, read.rows):
            missing = [c for c in _NEEDED if row.get(c) is None]
            if missing:
                bad.append((name, lineno, f"missing field(s): {', '.join(missing)}"))
            else:
                kept.append({c: row.get(c) for c in LOAD_COLUMNS})
    return pd.DataFrame.from_records(kept, columns=list(LOAD_COLUMNS))


def _coerce(frame: pd.DataFrame) -> pd.DataFrame:
    """One dtype per column whichever path produced the rows (numbers as float64 so
    that null budgets/top-ks group and merge like any other value)."""
    out: dict[str, pd.Series] = {}
    for c in _STR_COLS:
        col = frame[c]
        # Arrow-backed strings stay as they are (converting a million to objects costs
        # seconds); mixed or all-null columns become plain objects.
        out[c] = col if pd.api.types.is_string_dtype(col) and col.dtype != object else col.astype(object).where(col.notna(), None)
    for c in _INT_COLS + _FLOAT_COLS:
        col = frame[c]
        out[c] = col if col.dtype == np.float64 else pd.to_numeric(col, errors="coerce").astype("float64")
    for c in _BOOL_COLS:
        col = frame[c]
        out[c] = col if col.dtype == bool else col.astype(bool)
    return pd.DataFrame(out, index=frame.index, copy=False)


def _tables_to_frame(tables: list[Any], arrow: Any) -> pd.DataFrame:
    """Fast-path tables -> one pandas frame, in one conversion.

    Per-block frames would cost a second full copy in ``pd.concat``; ``split_blocks``
    skips pandas' consolidation of same-typed columns into one 2-D block (a third copy
    that nothing downstream needs).
    """
    pa = arrow[0]
    table = pa.concat_tables(tables).select(list(LOAD_COLUMNS))
    return table.to_pandas(split_blocks=True, self_destruct=True)


class _LedgerFile:
    """One ledger, read in blocks of whole lines, each parsed by the fastest path that is
    exact for it. Parts keep file order (``first()`` per cell depends on it).

    The file is memory-mapped: pyarrow parses the mapped pages in place (reading into
    fresh buffers cost a copy and a page fault per page of every block), and each block's
    pages are dropped from the mapping once parsed so resident memory stays one block,
    not the whole file.
    """

    def __init__(self, path: Path, arrow: Any, bad: list[tuple[str, int, str]]) -> None:
        self.name = str(path)
        self.path = path
        self.arrow = arrow
        self.bad = bad
        self.parts: list[Any] = []  # pyarrow tables and pandas frames, in file order

    def read(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if not size:
                    return
                mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ)
                try:
                    self._read_mapped(mm, size)
                finally:
                    # A view may outlive a failed parse in a traceback; the map is then
                    # released with the last view instead, and the real error surfaces.
                    with contextlib.suppress(BufferError):
                        mm.close()
        except OSError as exc:
            raise ConfigError(f"{self.path}: cannot read the ledger: {exc.strerror or exc}") from exc

    def _read_mapped(self, mm: mmap.mmap, size: int) -> None:
        lineno, pos = 1, 0
        while pos < size:
            end = min(pos + _BLOCK_BYTES, size)
            if end < size:
                cut = mm.rfind(b"\n", pos, end) + 1
                if cut <= pos:  # one line longer than a block
                    cut = mm.find(b"\n", end) + 1 or size
            else:
                cut = size
            if mm[cut - 1 : cut] != b"\n":
                # the file ends without a newline: only there is a line "truncated"
                tail = mm.rfind(b"\n", pos, cut) + 1 or pos
                if tail > pos:
                    lineno = self._block(mm, pos, tail, lineno)
                self._careful([mm[tail:cut]], lineno, at_eof=True)
                break
            lineno = self._block(mm, pos, cut, lineno)
            if cut - pos >= mmap.PAGESIZE:
                # The parsed pages are not needed again (the tables own their memory);
                # only whole pages before the cut can go, the next block starts there.
                drop = (cut // mmap.PAGESIZE) * mmap.PAGESIZE
                start = (pos // mmap.PAGESIZE) * mmap.PAGESIZE
                if drop > start:
                    mm.madvise(mmap.MADV_DONTNEED, start, drop - start)
            pos = cut

    def _block(self, mm: mmap.mmap, start: int, end: int, lineno: int) -> int:
        """Parse the whole lines in mm[start:end]; returns the next line number."""
        # Parse before counting lines: pyarrow's threads then take the page faults of
        # first touching the block in parallel, and the count runs over resident pages.
        table = _fast_block(memoryview(mm)[start:end], self.arrow) if self.arrow is not None else None
        lines = _count_newlines(mm, start, end)
        self._range(mm, start, end, lines, lineno, table)
        return lineno + lines

    def _range(self, mm: mmap.mmap, start: int, end: int, lines: int, lineno: int, table: Any = None) -> None:
        """Fast path over mm[start:end] (``table``: its parse, when already done); on
        refusal split in two and retry each half, so one bad line costs a few re-parses
        of shrinking halves and a line-by-line pass over a small slice, not the whole
        block."""
        if self.arrow is not None:
            if table is None:
                table = _fast_block(memoryview(mm)[start:end], self.arrow)
            if table is not None and table.num_rows == lines:
                self.parts.append(table)
                return
            if end - start > _CAREFUL_BYTES and lines > 1:
                mid = mm.rfind(b"\n", start, start + (end - start) // 2) + 1
                if mid <= start:
                    mid = mm.find(b"\n", start, end - 1) + 1
                if start < mid < end:
                    head = _count_newlines(mm, start, mid)
                    self._range(mm, start, mid, head, lineno)
                    self._range(mm, mid, end, lines - head, lineno + head)
                    return
        self._careful(mm[start:end].splitlines(keepends=True), lineno, at_eof=False)

    def _careful(self, lines: list[bytes], lineno: int, *, at_eof: bool) -> None:
        self.parts.append(_careful_block(lines, name=self.name, first_lineno=lineno, at_eof=at_eof, bad=self.bad))


def _count_newlines(mm: mmap.mmap, start: int, end: int) -> int:
    # numpy counts in place (slicing the map into bytes would copy every block), in
    # slices so that the comparison's temporary stays small and cache-resident.
    total = 0
    for lo in range(start, end, _COUNT_BYTES):
        n = min(_COUNT_BYTES, end - lo)
        total += int(np.count_nonzero(np.frombuffer(mm, dtype=np.uint8, count=n, offset=lo) == 10))
    return total


def load_ledgers(paths: Sequence[Path | str], *, use_arrow: bool | None = None) -> LoadedLedgers:
    """Read ledgers into one frame of :data:`LOAD_COLUMNS`. Bad lines are collected.

    ``use_arrow=False`` forces the line-by-line parser (tests compare both paths).
    """
    files = find_ledgers(paths)
    arrow = _arrow() if use_arrow is not False else None
    parts: list[Any] = []
    bad: list[tuple[str, int, str]] = []
    for path in files:
        reader = _LedgerFile(path, arrow, bad)
        reader.read()
        parts.extend(reader.parts)
    frames: list[pd.DataFrame] = []
    tables: list[Any] = []
    for part in parts:
        if isinstance(part, pd.DataFrame):
            if tables:
                frames.append(_tables_to_frame(tables, arrow))
                tables = []
            frames.append(part)
        else:
            tables.append(part)
    if tables:
        frames.append(_tables_to_frame(tables, arrow))
    if len(frames) == 1:
        frame = _coerce(frames[0])
    elif frames:
        frame = _coerce(pd.concat([f for f in frames if len(f)] or frames[:1], ignore_index=True))
    else:
        frame = _coerce(pd.DataFrame(columns=list(LOAD_COLUMNS)))
    bad.sort(key=lambda b: (b[0], b[1]))
    return LoadedLedgers(frame=frame, files=tuple(files), bad_lines=tuple(bad))


# ---------------------------------------------------------------- aggregation


def _machine_column(frame: pd.DataFrame, by: GroupBy) -> pd.Series:
    if by == "host":
        return frame["host"]
    if by == "gpu":
        return frame["gpu_name"].where(frame["gpu_name"].notna(), frame["host"])
    raise ConfigError(f"--group-by must be 'host' or 'gpu', not {by!r}")


#: The finest grouping: every coarser machine grouping is a function of these keys.
_FINE_KEYS: tuple[str, ...] = ("host", "gpu_name", *CELL_KEYS)
_FIRST_COLS: tuple[str, ...] = ("gpu_name", "gpu_arch", "workload_name", "fallback_reason")


def aggregate(frame: pd.DataFrame, *, by: GroupBy = "host") -> pd.DataFrame:
    """One tidy row per (machine, cell), repeats pooled over ``ok`` rows.

    ``by="host"`` gives the per-host table; ``by="gpu"`` pools hosts of one GPU type.
    Failed rows still create their cell (n=0) so that refusals can name them.
    """
    return aggregate_levels(frame, (by,))[by]


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
        return {by: pd.DataFrame({c: pd.Series(dtype=t) for c, t in TIDY_DTYPES.items()}) for by in levels}
    fine_gid = frame.groupby(list(_FINE_KEYS), dropna=False, sort=False).ngroup().to_numpy()
    n_fine = int(fine_gid.max()) + 1
    positions = np.arange(len(frame))
    first_rows = _first_position(positions, fine_gid, n_fine)
    fine = frame.iloc[first_rows][list(_FINE_KEYS)].reset_index(drop=True)
    # Row position of each fine group's first non-null value, per column; a coarser
    # group's first() is then the smallest of its fine groups' positions. A column
    # without nulls shares the groups' first rows (saves a sort of every row).
    first_pos = {}
    for c in _FIRST_COLS:
        valid = frame[c].notna().to_numpy()
        first_pos[c] = (
            first_rows if valid.all() else _first_position(positions[valid], fine_gid[valid], n_fine, missing=len(frame))
        )
    failed_rows = (frame["status"] != "ok").to_numpy()
    ok = ~failed_rows
    fine_failed = np.bincount(fine_gid, weights=failed_rows, minlength=n_fine)
    ok_gid = fine_gid[ok]
    ok_vals = frame.loc[ok, ["failed", *_MEDIAN_COLS]].reset_index(drop=True)
    return {
        by: _aggregate_level(frame, fine, fine_gid, fine_failed, first_pos, ok_gid, ok_vals, by) for by in levels
    }


def _first_position(positions: np.ndarray, gid: np.ndarray, n: int, *, missing: int = -1) -> np.ndarray:
    """Smallest of increasing ``positions`` per group id (``missing`` where none)."""
    # Callers pass increasing positions, so each id's first occurrence is its minimum.
    out = np.full(n, missing, dtype=np.int64)
    ids, first = np.unique(gid, return_index=True)
    out[ids] = positions[first]
    return out


def _aggregate_level(
    frame: pd.DataFrame,
    fine: pd.DataFrame,
    fine_gid: np.ndarray,
    fine_failed: np.ndarray,
    first_pos: dict[str, np.ndarray],
    ok_gid: np.ndarray,
    ok_vals: pd.DataFrame,
    by: GroupBy,
) -> pd.DataFrame:
    keys = ["machine", *CELL_KEYS]
    fine = fine.assign(machine=_machine_column(fine, by))
    # Same sorted, NA-keeping grouping as over the rows: the distinct key tuples are the same.
    level_of_fine = fine.groupby(keys, dropna=False, sort=True).ngroup().to_numpy()
    n = int(level_of_fine.max()) + 1
    cells = fine.iloc[_first_position(np.arange(len(fine)), level_of_fine, n)][keys].reset_index(drop=True)

    # Host lists from the few thousand fine groups, in plain Python: a pandas per-group
    # lambda costs more than the join itself.
    pairs = sorted(set(zip(level_of_fine.tolist(), fine["host"].tolist())))
    hosts = [""] * n
    for g_id, members in itertools.groupby(pairs, key=operator.itemgetter(0)):
        hosts[g_id] = ",".join(host for _, host in members)
    cells["hosts"] = hosts
    for c in _FIRST_COLS:
        pos = pd.Series(first_pos[c]).groupby(level_of_fine).min().to_numpy()
        found = pos < len(frame)
        values = np.full(n, None, dtype=object)
        values[found] = frame[c].iloc[pos[found]].to_numpy(dtype=object)
        cells[c] = values
    cells["n_failed_rows"] = np.bincount(level_of_fine, weights=fine_failed, minlength=n)

    gid = level_of_fine[ok_gid]
    g = ok_vals.groupby(gid, sort=True)
    med = g[list(_MEDIAN_COLS)].median().reindex(range(n))
    tok = ok_vals["output_tok_s"]
    dev = (tok - med["output_tok_s"].to_numpy()[gid]).abs()
    cells["n"] = np.bincount(gid, minlength=n)
    cells["failed_requests"] = g["failed"].sum(min_count=1).reindex(range(n)).fillna(0).to_numpy()
    cells["output_tok_s_median"] = med["output_tok_s"].to_numpy()
    cells["output_tok_s_mad"] = dev.groupby(gid).median().reindex(range(n)).to_numpy()
    cells["output_tok_s_min"] = g["output_tok_s"].min().reindex(range(n)).to_numpy()
    cells["output_tok_s_max"] = g["output_tok_s"].max().reindex(range(n)).to_numpy()
    cells["accept_length_median"] = med["accept_length"].to_numpy()
    for c in _MEDIAN_COLS[2:]:  # latency columns keep their names
        cells[c] = med[c].to_numpy()
    cells["score"] = cells["output_tok_s_median"] - MAD_TO_SIGMA * cells["output_tok_s_mad"]

    cells = _add_speedups(cells.reset_index(drop=True))
    return _typed(cells, TIDY_DTYPES)


def _add_speedups(cells: pd.DataFrame) -> pd.DataFrame:
    """Speedup vs the machine's AR and DFLASH cells under the same sampling/workload.

    A baseline in the same CUDA-graph mode is used when there is one; otherwise the
    other mode's, and ``modes_mixed`` says so (eager never silently meets graph).
    """
    bkeys = ["machine", *_BASELINE_KEYS]
    mixed = pd.Series(False, index=cells.index)
    for algo, prefix in (("AR", "ar"), ("DFLASH", "dflash")):
        base = cells.loc[cells["algorithm"] == algo, [*bkeys, "cuda_graph", "output_tok_s_median"]]
        base = base.drop_duplicates([*bkeys, "cuda_graph"])
        same = cells[[*bkeys, "cuda_graph"]].merge(base, on=[*bkeys, "cuda_graph"], how="left")["output_tok_s_median"]
        flipped = cells[bkeys].assign(cuda_graph=~cells["cuda_graph"].astype(bool))
        other = flipped.merge(base, on=[*bkeys, "cuda_graph"], how="left")["output_tok_s_median"]
        same.index = other.index = cells.index
        use_other = same.isna() & other.notna()
        baseline = same.where(~use_other, other)
        cells[f"speedup_vs_{prefix}"] = cells["output_tok_s_median"] / baseline
        mode = cells["cuda_graph"].astype("boolean").where(~use_other, ~cells["cuda_graph"].astype(bool))
        cells[f"{prefix}_cuda_graph"] = mode.where(baseline.notna(), pd.NA)
        mixed |= use_other & (cells["algorithm"] != algo)
    cells["modes_mixed"] = mixed
    return cells


def _typed(frame: pd.DataFrame, dtypes: dict[str, str]) -> pd.DataFrame:
    out = {}
    for c, t in dtypes.items():
        col = frame[c]
        if t == "Int64":
            col = pd.to_numeric(col, errors="coerce").round().astype("Int64")
        elif t == "object":
            col = col.astype(object).where(col.notna(), None)
        else:
            col = col.astype(t)
        out[c] = col
    return pd.DataFrame(out).reset_index(drop=True)


# ---------------------------------------------------------------- best configurations


def describe_cell(row: Any) -> str:
    """Short human label of a cell: ``DDTREE b=16 k=4``, ``DFLASH``, ``AR`` (+ ``eager``)."""
    text = str(row["algorithm"])
    if text == "DDTREE":
        text += f" b={_int_text(row['budget'])} k={_int_text(row['topk'])}"
    if not bool(row["cuda_graph"]):
        text += " eager"
    return text


def _int_text(value: Any) -> str:
    return "?" if value is None or pd.isna(value) else str(int(value))


def best_configs(
    grouped: pd.DataFrame,
    *,
    min_repeats: int = DEFAULT_MIN_REPEATS,
    mix_modes: bool = False,
    tie_tolerance: float = TIE_TOLERANCE,
) -> BestConfigs:
    """Best configuration per (machine, temperature, concurrency[, graph mode]).

    Highest ``score`` (median − 1.4826·MAD of output tok/s); among candidates within
    ``tie_tolerance`` of it the cheapest wins (AR < DFLASH < DDTREE, then smaller budget,
    then smaller top-k): a bigger tree that is not measurably faster is not worth it.
    Cells with failed rows/requests or fewer than ``min_repeats`` repeats are refused.
    Graph and eager cells are ranked separately unless ``mix_modes``.
    """
    gkeys = ["machine", "temperature", "top_p", "top_k", "concurrency", "request_rate", "workload_hash"]
    if not mix_modes:
        gkeys.append("cuda_graph")
    if grouped.empty:
        return BestConfigs(best=pd.DataFrame(columns=list(BEST_COLUMNS)), refusals=_refusal_frame([]))

    reasons = pd.Series("", index=grouped.index)
    reasons = _append_reason(reasons, grouped["n_failed_rows"] > 0, grouped["n_failed_rows"].astype(str) + " failed repeat(s)")
    reasons = _append_reason(
        reasons, grouped["failed_requests"] > 0, grouped["failed_requests"].astype(str) + " failed request(s)"
    )
    reasons = _append_reason(
        reasons, grouped["n"] < min_repeats, "n=" + grouped["n"].astype(str) + f" < min repeats {min_repeats}"
    )
    refused_mask = reasons != ""
    refusals = _refusal_frame(
        [
            (row["machine"], row["temperature"], row["concurrency"], describe_cell(row), reasons[i])
            for i, row in grouped[refused_mask].iterrows()
        ]
    )

    work = grouped.assign(
        _refused=refused_mask,
        _cost=grouped["algorithm"].map(_ALGO_COST).fillna(3),
        _budget=grouped["budget"].astype("float64").fillna(0),
        _topk=grouped["topk"].astype("float64").fillna(0),
        _label=[describe_cell(r) for _, r in grouped.iterrows()],
    )
    gid = work.groupby(gkeys, dropna=False, sort=True).ngroup()
    work["_g"] = gid
    counts = work.groupby("_g").agg(candidates=("_label", "size"), refused=("_refused", "sum"), any_eager=("cuda_graph", lambda s: not s.all()), any_graph=("cuda_graph", "any"))
    eligible = work[~work["_refused"]].copy()
    top = eligible.groupby("_g")["score"].transform("max")
    eligible["_within"] = eligible["score"] >= top - tie_tolerance * top.abs()
    by_score = eligible.sort_values(["_g", "score"], ascending=[True, False])
    best_score = by_score.drop_duplicates("_g").set_index("_g")
    tied = eligible[eligible["_within"]].sort_values(["_g", "_cost", "_budget", "_topk", "score"], ascending=[True, True, True, True, False])
    picked = tied.drop_duplicates("_g").set_index("_g")

    rows: list[dict[str, Any]] = []
    for g, first in work.drop_duplicates("_g").set_index("_g").sort_index().iterrows():
        c = counts.loc[g]
        modes = ("graph+eager" if c["any_graph"] and c["any_eager"] else "graph" if c["any_graph"] else "eager")
        row: dict[str, Any] = {k: first[k] for k in ("machine", "temperature", "top_p", "top_k", "concurrency", "request_rate", "workload_name")}
        row.update(modes=modes, candidates=int(c["candidates"]), refused=int(c["refused"]))
        if g not in picked.index:
            row.update(note=f"no eligible cell: all {int(c['candidates'])} refused (see refusals)")
            rows.append(row)
            continue
        p = picked.loc[g]
        for k in ("algorithm", "budget", "topk", "cuda_graph", "output_tok_s_median", "output_tok_s_mad", "score", "n", "accept_length_median", "speedup_vs_ar", "speedup_vs_dflash"):
            row[k] = p[k]
        notes = []
        top_row = best_score.loc[g]
        if top_row["_label"] != p["_label"]:
            notes.append(f"{top_row['_label']} scored {_pct(top_row['score'], p['score'])} higher (within {tie_tolerance:.0%}): cheaper config kept")
        others = by_score[(by_score["_g"] == g) & (by_score["_label"] != p["_label"])]
        if len(others):
            o = others.iloc[0]
            row["runner_up"] = f"{o['_label']} ({_pct(o['score'], p['score'])})"
        if modes == "graph+eager":
            notes.append("eager and CUDA-graph cells compared (--mix-modes)")
        if bool(p["modes_mixed"]):
            notes.append("speedup against a baseline in the other graph mode")
        row["note"] = "; ".join(notes)
        rows.append(row)
    best = pd.DataFrame(rows).reindex(columns=list(BEST_COLUMNS))
    for c in ("budget", "topk", "top_k", "concurrency", "n", "candidates", "refused"):
        best[c] = pd.to_numeric(best[c], errors="coerce").round().astype("Int64")
    best["cuda_graph"] = best["cuda_graph"].astype("boolean")
    for c in ("runner_up", "note", "algorithm"):
        best[c] = best[c].astype(object).where(best[c].notna(), None)
    return BestConfigs(best=best, refusals=refusals)


def _pct(value: float, ref: float) -> str:
    if not ref or pd.isna(ref) or pd.isna(value):
        return "n/a"
    return f"{(value / ref - 1) * 100:+.1f}%"


def _append_reason(reasons: pd.Series, mask: pd.Series, text: pd.Series | str) -> pd.Series:
    add = text if isinstance(text, pd.Series) else pd.Series(text, index=reasons.index)
    joined = reasons.where(reasons == "", reasons + "; ") + add
    return reasons.where(~mask, joined)


def _refusal_frame(items: list[tuple[Any, ...]]) -> pd.DataFrame:
    return pd.DataFrame(items, columns=["machine", "temperature", "concurrency", "cell", "reason"])


# ---------------------------------------------------------------- compare


COMPARE_KEYS: tuple[str, ...] = ("machine", *(k for k in CELL_KEYS if k != "cuda_graph"))


def compare(base: pd.DataFrame, other: pd.DataFrame, *, sigmas: float = 2.0, floor: float = 0.01) -> pd.DataFrame:
    """Per-cell ratio ``other / base`` of median output tok/s, flagging real changes.

    A change is flagged when ``|Δ| > sigmas·(σ_base + σ_other)`` with σ = 1.4826·MAD —
    the two medians' spread intervals do not overlap — and, when both spreads are zero
    (a single repeat, a deterministic simulator), when it exceeds ``floor`` relative.
    Cells present on one side only are listed with ``only_in``. ``cuda_graph`` is not a
    key: a fallback appearing or disappearing is exactly what a comparison must show.
    """
    cols = [*COMPARE_KEYS, "cuda_graph", "n", "output_tok_s_median", "output_tok_s_mad", "accept_length_median"]
    merged = base[cols].merge(other[cols], on=list(COMPARE_KEYS), how="outer", suffixes=("_a", "_b"), indicator=True)
    a, b = merged["output_tok_s_median_a"], merged["output_tok_s_median_b"]
    spread = sigmas * MAD_TO_SIGMA * (merged["output_tok_s_mad_a"].fillna(0) + merged["output_tok_s_mad_b"].fillna(0))
    threshold = np.maximum(spread, floor * a.abs())
    delta = b - a
    out = merged[list(COMPARE_KEYS)].copy()
    out["cuda_graph_a"] = merged["cuda_graph_a"].astype("boolean")
    out["cuda_graph_b"] = merged["cuda_graph_b"].astype("boolean")
    out["n_a"] = merged["n_a"].astype("Int64")
    out["n_b"] = merged["n_b"].astype("Int64")
    out["output_tok_s_a"] = a
    out["output_tok_s_b"] = b
    out["ratio"] = b / a
    out["threshold"] = threshold
    out["accept_length_a"] = merged["accept_length_median_a"]
    out["accept_length_b"] = merged["accept_length_median_b"]
    out["changed"] = (delta.abs() > threshold).fillna(False).astype(bool)
    out["direction"] = np.where(~out["changed"], "", np.where(delta > 0, "faster", "slower"))
    out["only_in"] = merged["_merge"].map({"left_only": "a", "right_only": "b", "both": ""}).astype(object)
    return out.reset_index(drop=True)


# ---------------------------------------------------------------- whole report


def build_report(
    paths: Sequence[Path | str],
    *,
    group_by: GroupBy = "gpu",
    min_repeats: int = DEFAULT_MIN_REPEATS,
    mix_modes: bool = False,
    use_arrow: bool | None = None,
) -> Report:
    """Load, aggregate per host and per ``group_by`` machine, pick best configs.

    An empty result (no ledger files, or files with no valid row) is a ConfigError that
    says what was looked at, because an empty table would read as "nothing is faster".
    """
    if min_repeats < 1:
        raise ConfigError(f"--min-repeats must be at least 1, not {min_repeats}")
    loaded = load_ledgers(paths, use_arrow=use_arrow)
    if loaded.frame.empty:
        where = ", ".join(str(p) for p in paths) if paths else "results/"
        if not loaded.files:
            raise ConfigError(f"no ledger (*.jsonl) found in {where}; run `ddtree-ops bench --sweep ...` first")
        detail = f" ({len(loaded.bad_lines)} bad line(s), first: {loaded.bad_lines[0][0]}:{loaded.bad_lines[0][1]}: {loaded.bad_lines[0][2]})" if loaded.bad_lines else ""
        raise ConfigError(f"no valid ledger rows in {len(loaded.files)} file(s) under {where}{detail}")
    levels = aggregate_levels(loaded.frame, ("host",) if group_by == "host" else ("host", group_by))
    tidy, grouped = levels["host"], levels[group_by]
    best = best_configs(grouped, min_repeats=min_repeats, mix_modes=mix_modes)
    return Report(loaded=loaded, tidy=tidy, grouped=grouped, best=best, group_by=group_by)


def load_tidy(paths: Sequence[Path | str], *, by: GroupBy = "host") -> pd.DataFrame:
    """Tidy table of other ledgers (for ``--compare``); ConfigError when empty."""
    loaded = load_ledgers(paths)
    if loaded.frame.empty:
        raise ConfigError(f"no valid ledger rows in {', '.join(str(p) for p in paths)}")
    return aggregate(loaded.frame, by=by)
