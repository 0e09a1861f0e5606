"""The benchmark ledger: one flat JSON object per (host, cell, repeat), one per line.

The ledger is the only hand-off between ``bench`` (which appends) and ``report`` (which
reads), and it outlives both: rows written today are read by next month's report. So:

* rows are **flat** (``ttft_ms_p99``, ``workload_num_prompts``), because pandas turns a
  flat JSON line into typed columns directly, while nested objects would need
  ``json_normalize`` (per-row Python, far too slow for a million rows);
* the values that are naturally not scalars stay as they are: ``server_argv`` (a list
  of strings), ``readiness_s`` (phase name -> seconds), ``categories`` (one record per data set
  / category) and ``output_hashes`` (one per request);
* every row carries ``schema_version``; a reader refuses (and reports) rows of a version
  it does not know instead of silently misreading them;
* appending is one ``write`` of one complete line, flushed and fsynced, so a crash loses
  at most the line being written — and a truncated last line is reported by
  :func:`read_ledger`, never fatal, and never glued to the next appended row
  (``bench --resume`` cuts it off first: :func:`heal_truncated_tail`);
* every row carries its sweep's hash, so ``--resume`` can refuse another sweep's ledger.

The field list, units and meaning are documented in ``results/README.md``; the constants
below are the single source of truth the README is checked against.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from ddtree_ops.errors import BenchError, ConfigError
from ddtree_ops.fsutil import IS_LINK, NOT_REGULAR, check_output_file, open_append, open_regular, write_problem
from ddtree_ops.limits import MAX_CONCURRENCY, MAX_DDTREE_TOPK, MAX_DFLASH_DRAFT_TOKENS, is_int_in, tree_problem

SCHEMA_VERSION = 1

Algorithm = Literal["AR", "DFLASH", "DDTREE"]
ALGORITHMS: tuple[str, ...] = ("AR", "DFLASH", "DDTREE")
STATUSES: tuple[str, ...] = ("ok", "failed")
#: A row's ``source``: what it is. Null reads as measured (rows written before it).
SOURCES: tuple[str, ...] = ("measured", "predicted", "probe")

#: Latency distributions recorded per row, each as ``<name>_<stat>`` in milliseconds.
LATENCY_METRICS: tuple[str, ...] = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
LATENCY_STATS: tuple[str, ...] = ("mean", "median", "p90", "p99")


@dataclass(frozen=True)
class LedgerRow:
    """One ledger line. Build it, then ``append_row(path, row)`` (or pass a plain dict).

    Optional provenance (GPU, bundle, versions) is ``None`` when it could not be
    learned; metrics are ``None`` on a row whose cell failed before measuring anything.
    """

    # identity and provenance
    run_id: str
    sweep: str
    # sha256 of the sweep's parsed content (``sweep.sweep_hash``): ``--resume`` refuses a
    # ledger holding another sweep's rows. Optional: rows written before it lack it.
    sweep_hash: str | None = field(default=None, kw_only=True)
    started_at: str  # ISO 8601 UTC, e.g. 2026-05-01T12:00:00Z
    finished_at: str
    host: str
    # The GPU slot that served the row (``ddtree.server.slots``; index on its host) and
    # its GPUs (CUDA_VISIBLE_DEVICES); None on a host with one server and in older rows.
    slot: int | None = field(default=None, kw_only=True)
    gpu_indices: list[int] | None = field(default=None, kw_only=True)
    gpu_name: str | None
    gpu_arch: str | None  # e.g. "sm_120"
    gpu_count: int | None
    driver: str | None
    sglang_version: str | None  # what the serving process reports (/server_info.version)
    # The SGLang package installed on the host, when known; differs from sglang_version
    # only when the served process is not that package (e.g. the simulator). Optional,
    # so rows of writers that predate it stay valid; keyword-only, to sit beside
    # sglang_version in ledger order.
    sglang_installed_version: str | None = field(default=None, kw_only=True)
    bundle_name: str | None
    bundle_hash: str | None
    # server configuration
    server_argv: list[str]
    algorithm: str  # one of ALGORITHMS
    # DDTREE node budget; DFLASH: its draft tokens (the verify window), None for the drafter's
    # own block; None for AR.
    budget: int | None
    topk: int | None  # DDTREE per-position top-k; None for AR and DFLASH
    cuda_graph: bool
    fallback_reason: str | None
    # The server launch that served the row: ``launch_argv_hash`` is sha256 of its argv
    # (the same launch command, the same hash; 16 hex), ``launch_id`` that plus the process
    # (one per launch, so rows of two launches of one command stay apart). Optional, like
    # the other late fields: older rows lack them.
    launch_argv_hash: str | None = field(default=None, kw_only=True)
    launch_id: str | None = field(default=None, kw_only=True)
    # True: the row's tree (budget, top-k) was switched live on a server launched with
    # runtime states, and proven through /server_info before measuring; False: the server
    # was launched at this tree (or is AR / DFLASH). None where no server served the row.
    tree_switched: bool | None = field(default=None, kw_only=True)
    # The tree as the serving DDTree plugin resolved it (``/server_info.ddtree``); None for
    # AR and DFLASH, and where the server does not say. Optional, like
    # sglang_installed_version, so older rows stay valid.
    verify_attention_backend: str | None = field(default=None, kw_only=True)
    verify_cuda_graph: bool | None = field(default=None, kw_only=True)
    # The graph ceiling of the DDTree state that served the row: the largest batch its
    # verify graph replays (``/server_info``'s ``cuda_graph_max_bs``); rounds of more
    # requests ran eager. None for eager rows, AR and DFLASH, and where the server does
    # not say. Optional: older rows lack it.
    cuda_graph_max_bs: int | None = field(default=None, kw_only=True)
    draft_block_size: int | None = field(default=None, kw_only=True)
    tree_sampler: str | None = field(default=None, kw_only=True)
    # The restart's speculative smoke (real decodes before "ready"): "passed" or
    # "skipped" (--no-smoke); None where no server was started. Optional: older rows lack it.
    smoke: str | None = field(default=None, kw_only=True)
    smoke_s: float | None = field(default=None, kw_only=True)
    readiness_s: dict[str, float]
    # Which client measured: "host" (on the GPU host, next to the server) or "local" (the
    # operator's machine). Optional: rows written before it lack it.
    client: str | None = field(default=None, kw_only=True)
    # workload and sampling
    workload_hash: str
    workload_name: str
    # How the prompts reached the model: "chat-template" (the served model's own chat
    # template: the OpenAI chat route, or /generate with the ids /v1/tokenize rendered),
    # "text" (completion prompts sent as is), or "chat-template+text". Optional: older
    # rows lack it (they sent chat prompts to /generate as a plain transcript).
    workload_prompt_format: str | None = field(default=None, kw_only=True)
    workload_num_prompts: int
    workload_max_new_tokens: int
    workload_ignore_eos: bool
    workload_seed: int | None
    temperature: float
    top_p: float
    top_k: int  # -1 = disabled (SGLang's convention)
    concurrency: int
    request_rate: float | None  # requests/s (Poisson); None = closed loop
    repeat: int  # 0-based
    # outcome
    status: str  # "ok" | "failed"
    error: str | None
    # metrics
    completed: int | None = None
    failed: int | None = None
    duration_s: float | None = None
    output_tok_s: float | None = None
    request_s: float | None = None
    total_input_tokens: int | None = None
    total_output_tokens: int | None = None
    ttft_ms_mean: float | None = None
    ttft_ms_median: float | None = None
    ttft_ms_p90: float | None = None
    ttft_ms_p99: float | None = None
    itl_ms_mean: float | None = None
    itl_ms_median: float | None = None
    itl_ms_p90: float | None = None
    itl_ms_p99: float | None = None
    tpot_ms_mean: float | None = None
    tpot_ms_median: float | None = None
    tpot_ms_p90: float | None = None
    tpot_ms_p99: float | None = None
    e2e_ms_mean: float | None = None
    e2e_ms_median: float | None = None
    e2e_ms_p90: float | None = None
    e2e_ms_p99: float | None = None
    accept_length: float | None = None  # sum(completion tokens) / sum(verify_ct)
    verify_ct: int | None = None
    # How far the client could observe the stream's timing: the fraction of chunks after
    # each request's first that it read together with the chunk before (their gaps were
    # not seen: ITLs of zero), and whether that exceeds metrics.CLIENT_BOUND_FRAC, where
    # the row's ITL and TTFT statistics measure the client rather than the server. None in
    # failed rows and in rows written before these fields.
    client_coalesced_frac: float | None = None
    client_bound: bool | None = None
    # Per data set / category of the cell's prompts (``gsm8k``, ``math500/Algebra``, the
    # project's ``code``...), one record each: {group, requests, completed, output_tokens,
    # verify_ct, accept_length, user_tok_s, tpot_ms_median} (metrics.GroupMetrics). A list
    # of records of one shape, not a mapping, so that a columnar reader takes it as is.
    # None in failed rows and in rows written before it.
    categories: list[dict[str, Any]] | None = None
    # Each request's output hash (RequestResult.output_hash), in the workload's prompt
    # order (None for a failed request): at T = 0 a DDTree cell's must equal the AR cell's
    # for the same prompts, or the verify is lossy. None where the server sent no outputs.
    output_hashes: list[str | None] | None = None
    # What the row is (issue 43): "measured" (a cell measured, as every row before it; null
    # in older rows reads the same), "predicted" (a DDTree cell predicted from a trace run
    # and round-time probes, never measured: its accept_length and output_tok_s are the
    # prediction, naive ones beside them) or "probe" (a round-time probe at the row's
    # concurrency and budget: round_ms, overhead_ms). Only measured rows are cells to the
    # report's rankings and to tune.
    source: str | None = None
    round_ms: float | None = None
    overhead_ms: float | None = None
    predicted_accept_naive: float | None = None
    predicted_tok_s_naive: float | None = None
    schema_version: int = field(default=SCHEMA_VERSION)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Every field of a row, in ledger order (schema_version first).
FIELDS: tuple[str, ...] = ("schema_version",) + tuple(
    f.name for f in fields(LedgerRow) if f.name != "schema_version"
)
#: The latency statistics of a row, as :meth:`~ddtree_ops.bench.metrics.CellMetrics.flat`
#: names them (``ttft_ms_p99``...): the one list the runner copies and the report reads.
LATENCY_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(LedgerRow) if f.name.startswith(("ttft_ms_", "itl_ms_", "tpot_ms_", "e2e_ms_"))
)
#: Fields a row must carry (the metrics default to None).
REQUIRED: tuple[str, ...] = tuple(
    f.name for f in fields(LedgerRow) if f.default is MISSING and f.default_factory is MISSING
)

#: Columns that identify a cell's server + workload configuration (used by --resume and
#: by the report to pool repeats). ``cuda_graph`` is deliberately absent: it is an
#: outcome (eager fallback), not something the sweep asks for.
KEY_FIELDS: tuple[str, ...] = (
    "host",
    "algorithm",
    "budget",
    "topk",
    "temperature",
    "top_p",
    "top_k",
    "concurrency",
    "request_rate",
    "workload_hash",
    "repeat",
)


#: Integers a float64 holds exactly: a count beyond it is not one anybody measured.
_EXACT = 2**53
#: The integer fields readers compute with (null aside, which each reader handles), and
#: the values each may take: a cell's axes what a sweep can ask for (:mod:`ddtree_ops.limits`;
#: a DFLASH ``budget`` is its chain, up to the drafter's block), the counts what a float64
#: column holds exactly. Outside them a value is garbage that would fail downstream: a
#: ``concurrency`` of 1e30 the report's integer cast, a budget of -4 the policy ``tune``
#: writes from it.
INT_BOUNDS: Mapping[str, tuple[int, int]] = MappingProxyType({
    "budget": (1, MAX_DFLASH_DRAFT_TOKENS),
    "topk": (1, MAX_DDTREE_TOPK),
    "concurrency": (1, MAX_CONCURRENCY),
    "top_k": (-1, _EXACT),
    "repeat": (0, _EXACT),
    "failed": (0, _EXACT),
    "gpu_count": (0, _EXACT),
    "cuda_graph_max_bs": (1, _EXACT),
})


def field_problem(row: Mapping[str, Any]) -> str | None:
    """Why ``row``'s numbers cannot be a measurement, or None: an integer field outside
    :data:`INT_BOUNDS` (or not an integer at all), or a DDTREE row without a tree the
    server serves. Every reader of rows checks this once, where it reads them (the
    report's loader; ``encode_row`` for the writer), so no consumer meets such a value."""
    bad = [
        f"{name}={value!r} (expected an integer in {low}..{high})"
        for name, (low, high) in INT_BOUNDS.items()
        if (value := row.get(name)) is not None and not is_int_in(value, low, high)
    ]
    if bad:
        return f"out of range: {', '.join(bad)}"
    if row.get("algorithm") == "DDTREE" and (problem := tree_problem(row.get("budget"), row.get("topk"))):
        return f"not a DDTREE tree: {problem}"
    return None


#: The fields readers rely on, by type: the report reads them as its columns, ``--resume``
#: keys cells on them and the canary gate reads its floors from them. A row holding anything
#: else there is a bad line for every reader (:func:`row_problem`), never a traceback further
#: down nor a value that decides something it cannot mean.
TEXT_FIELDS: tuple[str, ...] = (
    "run_id", "sweep", "host", "gpu_name", "gpu_arch", "algorithm", "fallback_reason", "workload_hash",
    "workload_name", "workload_prompt_format", "status",
    # Which launch served a row (null: none did) and why a row failed: rows no server
    # measured are not cells (report.build.split_unmeasured).
    "launch_id", "error",
    # What a row is (issue 43): null or "measured"; "predicted" and "probe" rows are kept
    # apart by the report, never ranked with measured ones.
    "source",
    # Which run a row is of and when it began (report.runs: runs are never pooled silently).
    "sweep_hash", "started_at",
)
INT_FIELDS: tuple[str, ...] = ("schema_version", "budget", "topk", "top_k", "concurrency", "repeat", "failed",
                               "gpu_count", "cuda_graph_max_bs")
#: Per-row metrics whose per-cell median the report shows: NaN or infinity in one would turn
#: a cell's median or score into NaN.
MEDIAN_FIELDS: tuple[str, ...] = (
    "output_tok_s",
    "accept_length",
    "ttft_ms_median",
    "ttft_ms_p99",
    "itl_ms_median",
    "itl_ms_p99",
    "tpot_ms_median",
    "e2e_ms_median",
)
FLOAT_FIELDS: tuple[str, ...] = ("temperature", "top_p", "request_rate", *MEDIAN_FIELDS, "round_ms", "overhead_ms",
                                 "predicted_accept_naive", "predicted_tok_s_naive")
#: A row lacking any of these cannot be placed in a cell.
NEEDED_FIELDS: tuple[str, ...] = ("host", "algorithm", "status", "cuda_graph", "temperature", "concurrency")
#: An acceptance length is tokens per verify step: at most the verify window (a tree's budget,
#: a chain's draft tokens; the largest there is where a row names none) plus the bonus token,
#: plus one for the prefill's token on a short output. Beyond it, or below 0, a row is no
#: measurement, and as the canary gate's floor it would make a gate that never (or always) passes.
ACCEPT_SLACK = 2


def _non_finite(row: Mapping[str, Any]) -> str | None:
    bad = [f"{name}={value}" for name in MEDIAN_FIELDS
           if isinstance(value := row.get(name), float) and not math.isfinite(value)]
    return f"non-finite metric(s): {', '.join(bad)}" if bad else None


def _not_a_number(row: Mapping[str, Any]) -> str | None:
    # Coerced to NaN, a ``budget: "x"`` would put every such row in one cell, where they read
    # as copies of each other instead of bad lines.
    bad = [f"{name}={value!r}" for name in INT_FIELDS + FLOAT_FIELDS
           if (value := row.get(name)) is not None and (isinstance(value, bool) or not isinstance(value, (int, float)))]
    return f"not a number: {', '.join(bad)}" if bad else None


def _not_a_string(row: Mapping[str, Any]) -> str | None:
    # A ``run_id: ["x"]`` cannot name a run, nor a ``host: {...}`` a host (nor be told from a copy).
    bad = [f"{name}={value!r}"[:80] for name in TEXT_FIELDS
           if (value := row.get(name)) is not None and not isinstance(value, str)]
    return f"not a string: {', '.join(bad)}" if bad else None


def _accept_out_of_range(row: Mapping[str, Any]) -> str | None:
    accept = row.get("accept_length")
    if accept is None:
        return None
    budget = row.get("budget")
    high = (int(budget) if isinstance(budget, (int, float)) else MAX_DFLASH_DRAFT_TOKENS) + ACCEPT_SLACK
    if 0 <= accept <= high:
        return None
    return f"out of range: accept_length={accept!r} (expected 0..{high}: tokens per verify step)"


def row_problem(row: Mapping[str, Any]) -> str | None:
    """Why a parsed current-schema ``row`` is a bad line for every reader, or None: a field
    readers need missing, a number or text that is not one, a NaN/inf metric, an integer out
    of bounds or a DDTREE row without a tree (:func:`field_problem`), an acceptance length
    no verify step can give (:data:`ACCEPT_SLACK`). Checked where rows are read, once
    (:func:`parse_lines`, shared by :func:`read_ledger` and the report's loader)."""
    missing = [name for name in NEEDED_FIELDS if row.get(name) is None]
    if missing:
        return f"missing field(s): {', '.join(missing)}"
    return (_not_a_number(row) or _not_a_string(row) or _non_finite(row) or field_problem(row)
            or _accept_out_of_range(row))


@dataclass(frozen=True)
class LedgerRead:
    """What :func:`read_ledger` found: valid rows and (1-based line number, reason) pairs.
    ``refused``: the current-schema rows among the bad lines (the row check refused them):
    no cell and no floor, yet they still say whose ledger this is (their sweep, client)."""

    rows: list[dict[str, Any]]
    bad_lines: list[tuple[int, str]]
    refused: list[dict[str, Any]] = field(default_factory=list)


def validate_row(row: Mapping[str, Any]) -> str | None:
    """Why ``row`` is not a valid current-schema ledger row, or None when it is.

    Cheap structural checks only (the writer's contract), so that a typo in a field name
    fails when the row is written, not months later when a report misses a column.
    """
    version = row.get("schema_version")
    if version != SCHEMA_VERSION:
        return f"schema_version {version!r} is not {SCHEMA_VERSION}"
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        return f"missing field(s): {', '.join(missing)}"
    unknown = sorted(set(row) - set(FIELDS))
    if unknown:
        return f"unknown field(s): {', '.join(unknown)}"
    if row["algorithm"] not in ALGORITHMS:
        return f"algorithm {row['algorithm']!r} is not one of {', '.join(ALGORITHMS)}"
    if row["status"] not in STATUSES:
        return f"status {row['status']!r} is not one of {', '.join(STATUSES)}"
    if not isinstance(row["cuda_graph"], bool):
        return "cuda_graph must be true or false"
    if not isinstance(row["server_argv"], list):
        return "server_argv must be a list of strings"
    if row.get("source") is not None and row["source"] not in SOURCES:
        return f"source {row['source']!r} is not one of {', '.join(SOURCES)}"
    categories = row.get("categories")
    if categories is not None and (
        not isinstance(categories, list)
        or not all(isinstance(c, dict) and isinstance(c.get("group"), str) for c in categories)
    ):
        return "categories must be a list of {group, ...} records"
    return field_problem(row)


# One lock per ledger file: hosts run in threads and share one ledger.
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock_for(path: Path) -> threading.Lock:
    key = os.path.abspath(path)
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _json_default(value: Any) -> Any:
    # Tuples and numpy scalars reach here from callers; encode them as plain JSON.
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def encode_row(row: Mapping[str, Any] | LedgerRow) -> bytes:
    """One ledger line (with its newline) for ``row``, validated; BenchError if invalid."""
    data = row.to_dict() if isinstance(row, LedgerRow) else dict(row)
    data.setdefault("schema_version", SCHEMA_VERSION)
    for name in FIELDS:
        if name not in REQUIRED:
            data.setdefault(name, None)
    problem = validate_row(data)
    if problem:
        raise BenchError(f"ledger row for host {data.get('host')!r}: {problem}")
    ordered = {name: data[name] for name in FIELDS}
    for name, value in ordered.items():
        # NaN/inf are not JSON; a metric that could not be computed is null.
        if isinstance(value, float) and not math.isfinite(value):
            ordered[name] = None
    text = json.dumps(ordered, default=_json_default, ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8") + b"\n"


def append_row(path: Path | str, row: Mapping[str, Any] | LedgerRow) -> None:
    """Append one row to the ledger at ``path`` (created with its parents), flushed+fsynced.

    If the file ends in a partial line (a writer died mid-line), a newline is written
    first so that the partial line stays one reportable bad line instead of corrupting
    this row too.
    """
    append_line(path, encode_row(row))


def append_line(path: Path | str, line: bytes) -> None:
    """:func:`append_row`'s write of one encoded row (:func:`encode_row`): BenchError when
    the ledger cannot take it (the disk filled), which no later row can change either."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _lock_for(path):
            # Never through a symbolic link, never to a FIFO (checked before the sweep too:
            # check_writable; this holds if the name changed since).
            fd = open_append(path)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    line = b"\n" + line
                # One write of the whole line: O_APPEND keeps concurrent appenders apart.
                written = os.write(fd, line)
                while written < len(line):
                    written += os.write(fd, line[written:])
                os.fsync(fd)
            except OSError:
                # A line only partly written (the disk filled) is cut off again, so that the
                # rows before it stay a clean ledger; best effort: the reader reports it anyway.
                try:
                    os.ftruncate(fd, size)
                except OSError:
                    pass
                raise
            finally:
                os.close(fd)
    except OSError as exc:
        # Said as it is (the disk filled, mid-sweep): the rows before this one are kept.
        raise BenchError(f"{path}: cannot append to the ledger: {write_problem(exc)}; the rows before this one "
                         f"are in it, fsynced") from None


def check_writable(path: Path | str) -> None:
    """ConfigError naming ``path`` unless a ledger can be appended there.

    Run before any host is touched, so that a typo in ``--out`` fails in a second instead
    of after an hour of measurements that could not be written. An existing file must be
    appendable (opened for append, nothing written); a new one needs its nearest existing
    ancestor to be a writable directory (``append_row`` creates the missing ones). A symbolic
    link at ``path`` is refused, dangling or not: a ledger is appended to, so the file the link
    names (which may be anything) would be the one changed.
    """
    path = Path(path)
    try:
        check_output_file(path)
    except OSError as exc:
        if exc.strerror == IS_LINK:
            raise ConfigError(f"{path}: {IS_LINK}: give the ledger's own path as --out") from None
    if path.is_dir():
        raise ConfigError(f"{path}: cannot write the ledger there: it is a directory")
    if path.exists():
        try:
            # Opened for append without writing; a FIFO is refused rather than waited on.
            os.close(open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW))
        except OSError as exc:
            if exc.strerror == NOT_REGULAR:
                raise ConfigError(f"{path}: is not a regular file: a ledger is one (give another --out)") from None
            raise ConfigError(f"{path}: cannot append to the ledger: {exc.strerror or exc}") from None
        return
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{path}: cannot create the ledger: {ancestor} is not a directory")
    # Try it rather than ask os.access: root passes every access check, yet cannot create
    # anything under /proc or on a read-only mount. A probe file where the ledger goes, or a
    # probe directory where its first missing parent goes, removed at once.
    try:
        if ancestor == path.parent:
            fd, probe = tempfile.mkstemp(dir=ancestor, prefix=f".{path.name}.", suffix=".probe")
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(dir=ancestor, prefix=".ledger-dir.", suffix=".probe"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot create the ledger in {ancestor}: {exc.strerror or exc}") from None


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def check_ledger_of(path: Path | str, *, sweep: str, sweep_hash: str) -> None:
    """ConfigError unless the file at ``path`` is empty, absent, or a ledger of this sweep
    (named ``sweep``, hashed ``sweep_hash``): ``bench`` appends only to its own ledger.

    A ledger's first line is a row (the writer's first write is one whole line), and every
    row in it is of one sweep. So a file whose first line is no row (``/etc/passwd``, a
    prompt file, a CSV) is not a ledger, nor one holding another sweep's rows or JSON that
    is no row; a later line that is not JSON at all (a line a crash cut) is tolerated, as
    the report counts it. A row is this sweep's by its name or its hash: a sweep edited
    under the same name appends a new run, which the report shows apart, and so does one
    renamed; ``--resume`` wants the same hash too (:func:`check_same_sweep`). Reads the file
    once, parsing only lines that do not carry the sweep's name where the writer puts it,
    so a large ledger costs a scan.
    """
    path = Path(path)
    marker = b'"sweep": ' + json.dumps(sweep, ensure_ascii=False).encode() + b","
    fix = "pass another --out"
    try:
        fh = os.fdopen(open_regular(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the ledger: {exc.strerror or exc}") from None
    with fh:
        seen_row = False
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            if seen_row and marker in raw:
                continue
            obj = _json_object(raw)
            if obj is None and seen_row:
                continue  # not JSON: a line a writer stopped in, counted by the report
            if obj is None or "schema_version" not in obj or "sweep" not in obj:
                what = "not JSON" if obj is None else "a JSON object that is no ledger row"
                raise ConfigError(f"{path}: is not a ledger (line {lineno}: {what}); bench appends only to a "
                                  f"ledger of this sweep: {fix}")
            seen_row = True
            other, other_hash = obj["sweep"], obj.get("sweep_hash")
            if other != sweep and other_hash != sweep_hash:
                hashed = f" ({other_hash[:12]})" if isinstance(other_hash, str) and other_hash else ""
                raise ConfigError(f"{path}: holds rows of sweep {str(other)[:80]!r}{hashed} (line {lineno}), this is "
                                  f"sweep {sweep!r} ({sweep_hash[:12]}); bench appends only to a ledger of this "
                                  f"sweep: {fix}")


#: Bytes one row takes in a ledger, about (a row of 4 prompts is 3.0-3.3 KB), and per prompt
#: of its workload (each one's output hash and category): what :func:`check_room` asks for.
ROW_BYTES = 3300
ROW_BYTES_PER_PROMPT = 24


def check_room(path: Path | str, rows: int, *, num_prompts: int) -> None:
    """ConfigError when the file system the ledger goes to has less room than ``rows`` rows
    of ``num_prompts`` prompts take: said before any host is touched rather than after an
    hour of measurements (a disk that fills later stops the sweep then, its rows kept)."""
    path = Path(path)
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    try:
        st = os.statvfs(ancestor)
    except OSError:
        return  # not every file system answers; the writes will say it
    free = st.f_bavail * st.f_frsize
    need = rows * (ROW_BYTES + ROW_BYTES_PER_PROMPT * num_prompts)
    if free < need:
        raise ConfigError(f"{path}: the disk is nearly full: {free:,} bytes free in {ancestor}, the sweep's "
                          f"{rows:,} row(s) need about {need:,}; free some space or pass another --out")


# What a cell is, as far as a row tells: the fields a sweep edit changes.
_CELL_FIELDS = ("algorithm", "budget", "topk", "temperature", "top_p", "top_k", "concurrency", "request_rate")


# Values that mean "not set" (sampling off, no request rate), left out of a cell's text.
_UNSET = {"top_p": (1.0,), "top_k": (-1, 0), "request_rate": (float("inf"),)}


def _cell_text(cell: tuple[Any, ...]) -> str:
    return " ".join(f"{k}={v}" for k, v in zip(_CELL_FIELDS, cell, strict=True)
                    if v is not None and v not in _UNSET.get(k, ()))


def sweep_change(rows: Iterable[Mapping[str, Any]], planned: Iterable[Mapping[str, Any]]) -> str:
    """What differs between the ledger's rows and this run's planned key fields
    (``RowMaker.key_fields``), as far as the rows can tell: cells only one of them has,
    and a workload (prompts, tokens) that changed; '' when the rows cannot tell."""
    have = {tuple(r.get(k) for k in _CELL_FIELDS) for r in rows}
    want = {tuple(p.get(k) for k in _CELL_FIELDS) for p in planned}
    parts = []
    for label, cells in (("cells only in the ledger", have - want), ("cells only in this sweep", want - have)):
        if cells:
            shown = sorted(cells, key=str)
            parts.append(f"{label}: {'; '.join(_cell_text(c) for c in shown[:3])}"
                         + (f" (+{len(shown) - 3} more)" if len(shown) > 3 else ""))
    old_work = {r.get("workload_hash") for r in rows} - {None}
    new_work = {p.get("workload_hash") for p in planned}
    if old_work and old_work != new_work:
        parts.append("the workload changed (prompts, their number or max_new_tokens)")
    return "; ".join(parts)


def check_same_sweep(
    rows: Iterable[Mapping[str, Any]], *, sweep: str, sweep_hash: str, path: Path | str,
    planned: Iterable[Mapping[str, Any]] = (),
) -> None:
    """ConfigError unless every row that carries a sweep hash carries ``sweep_hash``.

    ``--resume`` continues one sweep; resuming onto another sweep's ledger would mix two
    designs under one ledger and skip cells by keys that mean something else. Rows without
    a hash (written before the field existed) are not held against it. The refusal says
    what changed, as far as the rows tell (``planned``: this run's key fields).
    """
    rows = list(rows)
    for row in rows:
        other = row.get("sweep_hash")
        if isinstance(other, str) and other and other != sweep_hash:
            # What changed, from the rows a reader can use (a refused row's cell may be garbage).
            changed = sweep_change([r for r in rows if r.get("sweep_hash") == other and row_problem(r) is None],
                                   planned)
            raise ConfigError(
                f"{path}: --resume refused: the ledger holds sweep {row.get('sweep')!r} ({str(other)[:12]}), "
                f"this is sweep {sweep!r} ({sweep_hash[:12]})" + (f"; changed: {changed}" if changed else "")
                + "; pass another --out"
            )


def check_same_client(rows: Iterable[Mapping[str, Any]], modes: Mapping[str, str], *, path: Path | str) -> None:
    """ConfigError when a host's rows were measured by another client than ``modes`` says
    this run would use (``host`` or ``local``): a resumed cell must be comparable with its
    repeats, and the two clients differ by the network and the client's own CPU. Rows
    without ``client`` (older writers) are not held against it."""
    for row in rows:
        want, got = modes.get(str(row.get("host"))), row.get("client")
        if want is not None and isinstance(got, str) and got and got != want:
            raise ConfigError(
                f"{path}: --resume refused: host {row.get('host')!r} was measured with client {got!r}, this run "
                f"would use {want!r}; set `client: {got}` in the sweep, or pass another --out"
            )


def heal_truncated_tail(path: Path | str) -> int:
    """Cut a truncated last line (no newline, not valid JSON) off the ledger; bytes removed.

    Such a line is what a writer killed mid-write leaves. ``append_row`` alone would start
    a new line after it, keeping it as a bad line in the middle of the ledger for good;
    ``--resume`` calls this first, so the row is measured again and the file stays clean.
    The file is truncated to the end of its last complete line, under the writer's lock.
    A last line that parses (a complete row whose newline is missing) is kept.
    """
    path = Path(path)
    with _lock_for(path):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise BenchError(f"{path}: cannot open the ledger: {exc.strerror or exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if not size or os.pread(fd, 1, size - 1) == b"\n":
                return 0
            start = size
            while start > 0:
                block_start = max(0, start - 65536)
                block = os.pread(fd, start - block_start, block_start)
                newline = block.rfind(b"\n")
                if newline >= 0:
                    start = block_start + newline + 1
                    break
                start = block_start
            tail = os.pread(fd, size - start, start)
            try:
                json.loads(tail)
                return 0
            except (ValueError, UnicodeDecodeError):
                pass
            os.ftruncate(fd, start)
            os.fsync(fd)
            return size - start
        except OSError as exc:
            raise BenchError(f"{path}: cannot repair the ledger's last line: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)


def parse_lines(lines: Iterable[bytes], *, first_lineno: int = 1, at_eof: bool = True) -> LedgerRead:
    """Parse ledger lines; bad ones become (lineno, reason): not JSON, not an object, another
    schema version, or a row no reader can use (:func:`row_problem`). Shared by both readers.

    ``at_eof`` says whether the last line given is the file's last line: only there is a
    line without its newline a crash artefact ("truncated") rather than plain garbage.
    """
    rows: list[dict[str, Any]] = []
    bad: list[tuple[int, str]] = []
    refused: list[dict[str, Any]] = []
    buffered = list(lines)
    for offset, raw in enumerate(buffered):
        lineno = first_lineno + offset
        if not raw.strip():
            continue
        is_last = at_eof and offset == len(buffered) - 1
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            if is_last and not raw.endswith(b"\n"):
                bad.append((lineno, "truncated last line (a writer stopped mid-line)"))
            else:
                bad.append((lineno, f"not valid JSON: {exc}"[:200]))
            continue
        if not isinstance(obj, dict):
            bad.append((lineno, "not a JSON object"))
            continue
        version = obj.get("schema_version")
        if version != SCHEMA_VERSION:
            bad.append((lineno, f"unsupported schema_version {version!r} (this reader knows {SCHEMA_VERSION})"))
            continue
        if reason := row_problem(obj):
            bad.append((lineno, reason))
            refused.append(obj)
            continue
        rows.append(obj)
    return LedgerRead(rows=rows, bad_lines=bad, refused=refused)


def read_ledger(path: Path | str) -> LedgerRead:
    """Every valid row of one ledger plus its bad lines (the report's own row check:
    ``--resume`` and the canary gate's floors skip what the report skips, and count it). A
    missing file reads as empty; a FIFO or device is refused, never waited on.

    Rows are returned as parsed (fields absent from older writers are simply absent);
    the report fills gaps with nulls.
    """
    path = Path(path)
    try:
        with os.fdopen(open_regular(path), "rb") as fh:
            return parse_lines(fh)
    except FileNotFoundError:
        return LedgerRead(rows=[], bad_lines=[])
    except OSError as exc:
        if exc.strerror == NOT_REGULAR:
            raise ConfigError(f"{path}: is not a regular file: a ledger is one") from None
        raise BenchError(f"{path}: cannot read the ledger: {exc.strerror or exc}") from None


def _norm(value: Any) -> str:
    # 0 and 0.0 (and 1 and 1.0) must give the same key: JSON round trips and YAML sweeps
    # do not agree on int vs float.
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        as_float = float(value)
        if math.isnan(as_float):
            return "-"
        return repr(as_float)
    return str(value)


def row_key(row: Mapping[str, Any]) -> str:
    """Identity of a (host, configuration, workload, repeat) for ``--resume``.

    Works on a ledger row and on a planned cell alike (anything holding
    :data:`KEY_FIELDS`; missing ones count as null).
    """
    return "|".join(f"{name}={_norm(row.get(name))}" for name in KEY_FIELDS)


def is_measured(row: Mapping[str, Any]) -> bool:
    """Whether ``row`` is a measurement (not a prediction or a probe; older rows are)."""
    return row.get("source") in (None, "measured")


def completed_keys(rows: Sequence[Mapping[str, Any]], *, include_failed: bool = False) -> set[str]:
    """Keys of rows ``--resume`` may skip. Failed rows are retried unless asked otherwise;
    a predicted cell or a probe completes no cell."""
    return {row_key(r) for r in rows if (include_failed or r.get("status") == "ok") and is_measured(r)}
