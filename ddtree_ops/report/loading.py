"""Ledger files -> one pandas frame of the columns the report reads, and the bad lines.

Loading is the costly part of a report (ledgers grow to millions of rows, ~1.7 KB each):
the file is memory-mapped and cut into blocks of whole lines, each parsed in place by
pyarrow's JSON reader (its threads use every core) with an explicit schema of only the
columns the report needs. A block pyarrow refuses — a bad line, an old schema version,
anything that is not exactly one object per line — is split in halves and retried, down
to a small slice that is re-read line by line with the ledger's own parser, so bad lines
are counted with their line numbers, never fatal, and a row reads the same on either
path. Without pyarrow every block takes the line-by-line path (correct, slower).

Two kinds of row are not counted as measured: a row with a non-finite metric (NaN or
infinity in a column the report reads: one such value would turn a cell's median or
score into NaN) is a bad line with its file and line number; and a row read twice —
the same ``run_id``, cell identity and repeat (:data:`DUPLICATE_KEYS`), e.g. a ledger
copied next to itself — is counted once, and the copies are reported per ledger.

Every row carries its run (:mod:`.runs`): the ``run`` column of the frame, the run's first
invocation's run_id, with a ``bench --resume`` that continued a run counted in it; the
runs read are :attr:`LoadedLedgers.runs`.

Every row is checked here once (:func:`ddtree_ops.bench.ledger.row_problem`, the check
``--resume`` and the canary gate's floors read rows with too), whichever path read it and for
every consumer (the tidy table, ``tune``'s policies, the per-category and lossless
tables that re-read raw lines): a number of the wrong type, an integer outside what a
sweep can ask for (``concurrency: 1e30``, ``budget: -4``), a DDTREE row without a tree,
are bad lines with their file and line number, never a traceback further down.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ddtree_ops.bench.ledger import (
    ACCEPT_SLACK,
    FLOAT_FIELDS,
    INT_BOUNDS,
    INT_FIELDS,
    KEY_FIELDS,
    MEDIAN_FIELDS,
    NEEDED_FIELDS,
    SCHEMA_VERSION,
    TEXT_FIELDS,
    parse_lines,
    row_problem,
)
from ddtree_ops.errors import ConfigError
from ddtree_ops.fsutil import NOT_REGULAR, open_regular
from ddtree_ops.limits import MAX_DDTREE_BUDGET, MAX_DFLASH_DRAFT_TOKENS
from ddtree_ops.report.runs import Run, run_column, summarize_runs

# The columns by type, and the row check, are the ledger's (every reader of rows shares them).
_STR_COLS = TEXT_FIELDS
_INT_COLS = INT_FIELDS
#: Per-row metrics whose per-cell median the tidy table reports.
MEDIAN_COLS: tuple[str, ...] = MEDIAN_FIELDS
_FLOAT_COLS = FLOAT_FIELDS
#: One row per measurement: a second row with these values is a copy, counted once (a
#: cell's prediction and its measurement in one run are two rows: ``source`` tells them apart).
DUPLICATE_KEYS: tuple[str, ...] = ("run_id", "source", *KEY_FIELDS)
# client_bound: null (rows before it, failed rows) reads as False.
_BOOL_COLS = ("cuda_graph", "client_bound", "workload_ignore_eos")
#: Ledger columns the report reads; everything else in a row is skipped while parsing
#: (each column read costs parse time on every row, so only what aggregation uses).
LOAD_COLUMNS: tuple[str, ...] = _STR_COLS + _INT_COLS + _FLOAT_COLS + _BOOL_COLS
#: The frame's columns: the ledger's (LOAD_COLUMNS), then each row's run (report.runs).
FRAME_COLUMNS: tuple[str, ...] = (*LOAD_COLUMNS, "run")
#: A row lacking any of these cannot be placed in a cell: it is a bad line.
_NEEDED = NEEDED_FIELDS

#: Bytes handed to one pyarrow call: large enough that its worker threads stay busy,
#: small enough that a refused block is cheap to split and re-read.
_BLOCK_BYTES = 64 << 20
#: pyarrow's own unit of parallel parsing inside one call.
_ARROW_CHUNK_BYTES = 4 << 20
#: A refused slice smaller than this goes line by line instead of being split again.
_CAREFUL_BYTES = 1 << 20
#: Bytes per slice when counting newlines (see _count_newlines).
_COUNT_BYTES = 1 << 20


@dataclass(frozen=True)
class LoadedLedgers:
    """All valid rows of the ledgers read (``LOAD_COLUMNS``), and what was skipped."""

    frame: pd.DataFrame
    files: tuple[Path, ...]
    bad_lines: tuple[tuple[str, int, str], ...]  # (file, 1-based line, reason)
    # (file, rows of it dropped as copies of a row read before), in file order
    duplicates: tuple[tuple[str, int], ...] = ()
    # The predicted cells and round-time probes (``source`` predicted / probe, issue 43), kept
    # out of ``frame`` so that no measured ranking or table ever holds one; None: none read.
    predicted: pd.DataFrame | None = None
    # The runs read (report.runs), oldest first; each row's is the frame's ``run`` column.
    runs: tuple[Run, ...] = ()
    # True: ``--pool-runs``: every row's ``run`` is None, so the runs' cells are pooled.
    pooled: bool = False

    @property
    def duplicate_rows(self) -> int:
        return sum(n for _, n in self.duplicates)

    def run_of(self) -> dict[str, str | None]:
        """run_id -> its run as the frame's ``run`` column holds it (None when pooled), for the
        tables that re-read raw lines (lossless, per category); a run_id not in it is of a
        run left out (``--run``): its rows are not read."""
        return {rid: None if self.pooled else run.run for run in self.runs for rid in run.run_ids}

    def only_runs(self, wanted: Sequence[str]) -> LoadedLedgers:
        """These ledgers with only the runs ``wanted`` names (a run's id or the run_id of any of
        its invocations: a resume's id names its run); ConfigError naming a run not read."""
        kept: list[Run] = []
        for name in wanted:
            run = next((r for r in self.runs if name in r.run_ids), None)
            if run is None:
                known = ", ".join(r.label for r in self.runs[:5]) or "none"
                more = f" and {len(self.runs) - 5} more (`report --json` lists them)" if len(self.runs) > 5 else ""
                raise ConfigError(f"--run {name}: no such run in these ledgers (runs: {known}{more})")
            if run not in kept:
                kept.append(run)
        names = [r.run for r in kept]
        predicted = self.predicted
        if predicted is not None:
            predicted = predicted.loc[predicted["run"].isin(names)].reset_index(drop=True)
            predicted = predicted if len(predicted) else None
        frame = self.frame.loc[self.frame["run"].isin(names)].reset_index(drop=True)
        return replace(self, frame=frame, predicted=predicted, runs=tuple(r for r in self.runs if r in kept))

    def pool_runs(self) -> LoadedLedgers:
        """These ledgers with every row's ``run`` None: the runs' cells pooled (``--pool-runs``)."""
        predicted = None if self.predicted is None else self.predicted.assign(run=None)
        return replace(self, frame=self.frame.assign(run=None), predicted=predicted, pooled=True)


def ok_rows_with(files: Sequence[Path], marker: bytes) -> Iterator[dict[str, Any]]:
    """The ``ok`` rows of ``files`` whose line holds ``marker`` (e.g. ``b'"categories": [{'``),
    parsed: for the list-valued fields the columnar loader does not read. A byte search
    skips every other line unparsed; bad lines are :func:`load_ledgers`' to report."""
    for path in files:
        with os.fdopen(open_regular(path), "rb") as f:
            # One C-speed search first: a ledger without the field (written before it, or
            # a million rows of the scale benchmark) costs a scan, not a loop over lines.
            try:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    if mm.find(marker) < 0:
                        continue
            except ValueError:  # an empty file cannot be mapped
                continue
            for line in f:
                if marker not in line:
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                # The loader's verdict too: a row it reports as bad is no row here either.
                if isinstance(row, dict) and row.get("status") == "ok" and row_problem(row) is None:
                    yield row


def find_ledgers(paths: Sequence[Path | str], *, default_dir: Path = Path("results")) -> list[Path]:
    """Ledger files named or found under the given paths (``**/*.jsonl`` for folders).

    With no paths, every ledger under ``results/``. A named path that does not exist is
    a ConfigError (a typo must not produce an empty report that looks like no data).
    """
    found: list[Path] = []
    for raw in paths or [default_dir]:
        path = Path(raw)
        if path.is_dir():
            found.extend(sorted(path.rglob("*.jsonl")))
        elif path.is_file():
            found.append(path)
        elif path.exists():
            raise ConfigError(f"{path}: is not a regular file: a ledger is one")
        elif paths:
            raise ConfigError(f"{path}: no such ledger file or folder")
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
        [(name, pa.string()) for name in _STR_COLS]
        + [(name, pa.float64()) for name in _INT_COLS + _FLOAT_COLS]
        + [(name, pa.bool_()) for name in _BOOL_COLS]
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
    if any(table.column(name).null_count for name in _NEEDED):
        return None
    # NaN/inf metrics are refused line by line (with their line numbers) by the careful path.
    if any(pc.any(pc.invert(pc.is_finite(table.column(name)))).as_py() for name in MEDIAN_COLS):
        return None
    # So are integers out of bounds or fractional, and DDTREE rows without a tree
    # (ledger.field_problem, the careful path's check, column by column).
    for name, (low, high) in INT_BOUNDS.items():
        column = table.column(name)
        if column.null_count == len(column):
            continue
        lo_hi = pc.min_max(column).as_py()
        if lo_hi["min"] < low or lo_hi["max"] > high or pc.any(pc.not_equal(pc.floor(column), column)).as_py():
            return None
    ddtree = pc.equal(table.column("algorithm"), "DDTREE")
    for name, high in (("budget", MAX_DDTREE_BUDGET), ("topk", INT_BOUNDS["topk"][1])):
        column = table.column(name)
        if pc.any(pc.and_kleene(ddtree, pc.or_kleene(pc.is_null(column), pc.greater(column, high)))).as_py():
            return None
    # An acceptance length no verify step gives (ledger.row_problem's bound, per row).
    accept = table.column("accept_length")
    if accept.null_count < len(accept):
        high = pc.add(pc.fill_null(table.column("budget"), float(MAX_DFLASH_DRAFT_TOKENS)), float(ACCEPT_SLACK))
        if pc.any(pc.or_(pc.less(accept, 0.0), pc.greater(accept, high))).as_py():
            return None
    return table


def _careful_block(
    lines: list[bytes], *, name: str, first_lineno: int, at_eof: bool, bad: list[tuple[str, int, str]]
) -> pd.DataFrame:
    # parse_lines checks every row (ledger.row_problem): what it returns is kept.
    read = parse_lines(lines, first_lineno=first_lineno, at_eof=at_eof)
    bad.extend((name, n, reason) for n, reason in read.bad_lines)
    kept = [{column: row.get(column) for column in LOAD_COLUMNS} for row in read.rows]
    return pd.DataFrame.from_records(kept, columns=list(LOAD_COLUMNS))


def _coerce(frame: pd.DataFrame) -> pd.DataFrame:
    """One dtype per column whichever path produced the rows (numbers as float64 so
    that null budgets/top-ks group and merge like any other value)."""
    out: dict[str, pd.Series] = {}
    for name in _STR_COLS:
        col = frame[name]
        # Arrow-backed strings stay as they are (converting a million to objects costs
        # seconds); mixed or all-null columns become plain objects.
        arrow_strings = pd.api.types.is_string_dtype(col) and col.dtype != object
        out[name] = col if arrow_strings else col.astype(object).where(col.notna(), None)
    for name in _INT_COLS + _FLOAT_COLS:
        col = frame[name]
        out[name] = col if col.dtype == np.float64 else pd.to_numeric(col, errors="coerce").astype("float64")
    for name in _BOOL_COLS:
        col = frame[name]
        out[name] = col if col.dtype == bool else col.astype(bool)
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
            with os.fdopen(open_regular(self.path), "rb") as fh:
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
            if exc.strerror == NOT_REGULAR:  # a FIFO named *.jsonl in a ledger folder
                raise ConfigError(f"{self.path}: is not a regular file: a ledger is one") from None
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
        total += int(np.count_nonzero(np.frombuffer(mm, dtype=np.uint8, count=n, offset=lo) == ord("\n")))
    return total


def load_ledgers(paths: Sequence[Path | str], *, use_arrow: bool | None = None) -> LoadedLedgers:
    """Read ledgers into one frame of :data:`LOAD_COLUMNS`. Bad lines are collected.

    ``use_arrow=False`` forces the line-by-line parser (tests compare both paths).
    """
    files = find_ledgers(paths)
    arrow = _arrow() if use_arrow is not False else None
    parts: list[Any] = []
    bad: list[tuple[str, int, str]] = []
    rows_per_file: list[int] = []
    for path in files:
        reader = _LedgerFile(path, arrow, bad)
        reader.read()
        parts.extend(reader.parts)
        rows_per_file.append(sum(part.num_rows if not isinstance(part, pd.DataFrame) else len(part)
                                 for part in reader.parts))
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
        # A careful-path frame of only bad lines is empty with object columns, which would
        # turn concat's float columns into objects: leave empties out (keep one if all are).
        frame = _coerce(pd.concat([part for part in frames if len(part)] or frames[:1], ignore_index=True))
    else:
        frame = _coerce(pd.DataFrame(columns=list(LOAD_COLUMNS)))
    # Runs are told apart before copies are dropped (a copied ledger holds its run's invocations
    # in their order too), and summed up after (a copy is no row of its run).
    owner = np.repeat(np.arange(len(files)), rows_per_file)
    frame = frame.assign(run=pd.Series(run_column(frame, owner), index=frame.index, dtype=object), _ledger=owner)
    frame, duplicates = _drop_duplicates(frame, files, rows_per_file)
    runs = summarize_runs(frame, frame["_ledger"].to_numpy(), [str(f) for f in files])
    frame = frame.drop(columns="_ledger")
    bad.sort(key=lambda item: (item[0], item[1]))  # by file, then line number
    source = frame["source"]
    other = source.notna() & (source != "measured")
    predicted = None
    if other.any():
        predicted = frame.loc[other].reset_index(drop=True)
        frame = frame.loc[~other].reset_index(drop=True)
    return LoadedLedgers(frame=frame, files=tuple(files), bad_lines=tuple(bad), duplicates=duplicates,
                         predicted=predicted, runs=runs)


def _drop_duplicates(
    frame: pd.DataFrame, files: Sequence[Path], rows_per_file: Sequence[int]
) -> tuple[pd.DataFrame, tuple[tuple[str, int], ...]]:
    """``frame`` without the second and later copies of a row (:data:`DUPLICATE_KEYS`), and
    how many copies each ledger held. The first copy (file order) stays."""
    if len(frame) < 2:
        return frame, ()
    copies = frame.duplicated(subset=list(DUPLICATE_KEYS), keep="first").to_numpy()
    if not copies.any():
        return frame, ()
    # Rows are in file order, so row i belongs to the file whose row range holds it.
    owner = np.repeat(np.arange(len(files)), rows_per_file)
    per_file = np.bincount(owner[copies], minlength=len(files))
    duplicates = tuple((str(path), int(n)) for path, n in zip(files, per_file, strict=True) if n)
    return frame.loc[~copies].reset_index(drop=True), duplicates
