"""Helpers every command uses: resolve the target to hosts, render per-host results, and
the one ``--json`` envelope.

The per-host summary is the one place that turns a :class:`~ddtree_ops.fleet.FleetResult`
into output: a rich table for people, or the command's ``--json`` data for scripts. It
returns whether any host failed; the command then raises :class:`FleetError` (carrying
the result) so the exit code says so, after every host was shown.

Under ``--json`` a command never writes to stdout itself: it hands its payload to
:func:`set_json_data`, and the entry point writes exactly one document, the envelope
(:func:`write_envelope`), when the command has ended — with ``ok: false``, the stable
error codes and the exit code when it failed, the payload included either way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.cells import cell_len
from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ddtree_ops.cli.terminal import WordText, err_console, escape_text, longest_piece
from ddtree_ops.errors import ConfigError, DdtreeOpsError, FleetError, Interrupted, InventoryError, error_code
from ddtree_ops.fleet import FleetResult
from ddtree_ops.inventory import Inventory, load_inventory
from ddtree_ops.inventory.values import FromEnv
from ddtree_ops.inventory_types import Host
from ddtree_ops.transport import RoundTripCounter, Transport, open_transport

Column = tuple[str, Callable[[Any], object]]
# A value that carries its own failure (doctor's facts of an unreachable host) -> that error.
Judge = Callable[[Any], "BaseException | None"]
SCHEMA_VERSION = 1


def printable(text: str, *, limit: int | None = None) -> str:
    """``text`` for a terminal: control characters (an ANSI escape in a prompt or a host
    name) shown as ``\\x1b``-style escapes, never sent raw; whitespace runs as one space;
    cut at ``limit`` characters with an ellipsis."""
    out = " ".join(text.split())
    out = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in out)
    if limit is not None and len(out) > limit:
        out = out[: limit - 1] + "…"
    return out


def check_output_path(option: str, path: Path | None, *, directory: bool = False) -> None:
    """Refuse an output path whose parent directory does not exist, before any work.

    A typo in ``--csv /tmp/reprots/x.csv`` must not create a directory tree somewhere
    (nor only fail after minutes of work): the parent must already be a directory. With
    ``directory=True`` the path itself is a folder we may create (``--plots DIR``), so it
    must not be an existing file.
    """
    if path is None:
        return
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ConfigError(f"{option} {path}: directory {parent} {what}")
    if directory and path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path}: exists and is not a directory")
    if not directory and path.is_dir():
        raise ConfigError(f"{option} {path}: is a directory, expected a file name")
    if not directory:
        from ddtree_ops.fsutil import check_regular

        try:  # a FIFO would block the command, after all its work, until something reads it
            check_regular(path)
        except OSError:
            raise ConfigError(f"{option} {path}: is not a regular file; give a file name") from None


def load_inventory_for(ctx_obj: Any) -> Inventory:
    """The inventory named by the global ``-i`` options (or their defaults). A path that
    ``$DDTREE_OPS_INVENTORY`` names and that does not exist is said naming the variable:
    nobody typed it on this command line."""
    paths = list(ctx_obj.inventory)
    if getattr(ctx_obj, "inventory_from_env", False):
        from ddtree_ops.cli.pathargs import path_problem

        # -i is checked by its parser (cli/pathargs.py); the variable's paths here, where an
        # overlong one would make exists() raise.
        for p in paths:
            if why := path_problem(str(p)):
                raise InventoryError(f"$DDTREE_OPS_INVENTORY: {why} (set it to inventory files or directories, "
                                     f"{os.pathsep}-separated, or pass -i)")
        missing = [p for p in paths if not Path(p).exists()]
        if missing:
            raise InventoryError(f"$DDTREE_OPS_INVENTORY names {missing[0]}, which does not exist (set it to "
                                 f"inventory files or directories, {os.pathsep}-separated, or pass -i)")
    return load_inventory(paths)


def load_hosts(ctx_obj: Any, target: str) -> list[Host]:
    """``target`` (group, host, ``all`` or a comma list) -> hosts; raises ConfigError subclasses.
    Once per machine: a GPU slot ``host/i`` stands for its host."""
    return load_inventory_for(ctx_obj).resolve(target)


def load_slot_hosts(ctx_obj: Any, target: str) -> list[Host]:
    """``target`` -> one host per server: every GPU slot of each host named (a host
    without slots is one), or the one slot ``host/i`` names (Inventory.resolve_slots)."""
    return load_inventory_for(ctx_obj).resolve_slots(target)


def transport_for(ctx_obj: Any, host: Host, *, counter: RoundTripCounter | None = None) -> Transport:
    """A transport honouring the global ``--host-key-policy``; what it records is said on stderr."""
    return open_transport(host, host_key_policy=ctx_obj.host_key_policy, counter=counter, on_notice=say_notice)


def say_notice(text: str) -> None:
    """One line on stderr for what is not an error but must be said (where accept-new wrote a key)."""
    err_console.print(text, style="yellow", markup=False, highlight=False, soft_wrap=True)


def error_text(exc: BaseException) -> str:
    """One line for a host's failure: our errors speak for themselves, others get their type."""
    if isinstance(exc, DdtreeOpsError):
        text = exc.message or str(exc)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def to_jsonable(value: Any) -> Any:
    """Dataclasses, mappings (incl. MappingProxyType), tuples and Paths -> JSON types (for
    output: an inventory value read by lookup('env') is shown by where it came from)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # A field marked ``metadata={"json": False}`` never leaves the process (a launch
        # spec's env holds the inventory's tokens).
        # One marked ``metadata={"secret": True}`` (a mapping) shows its keys, never its values.
        return {f.name: (secret_mapping(getattr(value, f.name)) if f.metadata.get("secret")
                         else to_jsonable(getattr(value, f.name)))
                for f in dataclasses.fields(value) if f.metadata.get("json", True)}
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, FromEnv):
        return repr(value)  # read by an inventory's lookup('env'): a secret for all we know, never shown
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


# What a secret mapping's values are shown as (`hosts -v`, `hosts --json`).
NOT_SHOWN = "<not shown>"


def secret_mapping(values: Mapping[str, Any]) -> dict[str, str]:
    """A mapping of secrets as listings show it: every key, no value (one read by an
    inventory's lookup('env') by where it came from, as everywhere)."""
    return {str(k): repr(v) if isinstance(v, FromEnv) else NOT_SHOWN for k, v in values.items()}


def emit_json(data: Any) -> None:
    """Machine-readable output goes to stdout untouched by rich (no wrapping, no markup)."""
    sys.stdout.write(json.dumps(to_jsonable(data), indent=2) + "\n")
    sys.stdout.flush()


def set_json_data(ctx_obj: Any, data: Any) -> None:
    """The command's ``--json`` payload (the envelope's ``data``). Written by the entry
    point once the command ends, so a command that renders and then fails still prints
    exactly one document."""
    ctx_obj.data = to_jsonable(data)
    ctx_obj.has_data = True


def exit_code_of(error: BaseException) -> int:
    """The documented exit code for ``error`` (README: "Exit codes")."""
    if isinstance(error, DdtreeOpsError):
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return Interrupted.exit_code
    return 1


def error_entries(error: BaseException) -> list[dict[str, Any]]:
    """The envelope's ``errors``: the error itself, then each failed host's (fan-outs)."""
    entries = [{"code": error_code(error), "message": error_text(error), "host": getattr(error, "host", None)}]
    for host, exc in getattr(error, "failures", {}).items():
        entries.append({"code": error_code(exc), "message": error_text(exc), "host": host})
    return entries


def envelope(command: str | None, *, data: Any = None, error: BaseException | None = None) -> dict[str, Any]:
    """The one ``--json`` document of every command, success or failure (README: "JSON output")."""
    return {
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "ok": error is None,
        "exit_code": 0 if error is None else exit_code_of(error),
        "data": to_jsonable(data),
        "errors": [] if error is None else error_entries(error),
    }


def write_envelope(command: str | None, *, data: Any = None, error: BaseException | None = None) -> None:
    """Write :func:`envelope` to stdout: the only writer of ``--json`` output."""
    emit_json(envelope(command, data=data, error=error))


def failure_row(host: str, exc: BaseException) -> dict[str, Any]:
    """A failed host's row in a fan-out's ``--json`` data."""
    return {"host": host, "ok": False, "error": error_text(exc), "error_type": type(exc).__name__}


def fleet_json(title: str, results: FleetResult[Any], failures: Mapping[str, BaseException]) -> dict[str, Any]:
    """A fan-out's ``--json`` data: ``{title, ok, hosts: [{host, ok, error, result | error_type}]}``."""
    failed = results.failed
    rows = []
    for name, value in results.items():
        if name in failed:
            rows.append(failure_row(name, failed[name]))
            continue
        failure = failures.get(name)
        error = None if failure is None else error_text(failure)
        rows.append({"host": name, "ok": failure is None, "error": error, "result": to_jsonable(value)})
    return {"title": title, "ok": not failures, "hosts": rows}


def render_host_results(
    ctx_obj: Any,
    title: str,
    results: FleetResult[Any],
    columns: Sequence[Column],
    *,
    failure: Judge | None = None,
) -> bool:
    """Show every host's outcome; return True if any host failed.

    A host failed when its value is an exception, or when ``failure(value)`` returns an
    error (for results that carry their own error, like doctor's facts). ``columns`` are
    ``(header, getter)`` pairs applied to successful values.
    """
    failures = results.failures(failure)
    reasons = {name: error_text(exc) for name, exc in failures.items()}
    if getattr(ctx_obj, "json", False):
        set_json_data(ctx_obj, fleet_json(title, results, failures))
        return bool(failures)

    # Many columns do not fit a terminal: then one row per (host, column) instead.
    long = len(columns) > 3
    table = Table(title=escape(title), title_justify="left", show_lines=long)
    table.add_column("host", style="bold", no_wrap=True)
    table.add_column("status", no_wrap=True)
    if long:
        table.add_column("details", overflow="fold")
    else:
        for header, _ in columns:
            table.add_column(header, overflow="fold")
    for name, value in results.items():
        reason = reasons.get(name)
        failed_call = name in results.failed
        status = (
            Text(f"FAILED ({type(value).__name__})" if failed_call else "FAILED", style="bold red")
            if reason
            else Text("ok", style="green")
        )
        cells = [] if failed_call else [_cell(getter(value)) for _, getter in columns]
        if long:
            grid = Table.grid(padding=(0, 1))
            grid.add_column(style="dim", no_wrap=True)
            grid.add_column(overflow="fold")
            for (header, _), cell in zip(columns, cells, strict=False):  # no cells when the call failed
                grid.add_row(header, cell)
            if reason:
                grid.add_row(Text("error", style="red"), WordText(reason, style="red"))
            table.add_row(_cell(name), status, grid)
        else:
            if failed_call:
                cells = [WordText(reason or "", style="red")] + [Text("")] * (len(columns) - 1)
            table.add_row(_cell(name), status, *cells[: len(columns)])
            if reason and not failed_call and columns:
                table.add_row("", "", WordText(reason, style="red"), *[""] * (len(columns) - 1))
    console = ctx_obj.console
    console.print(table)
    if failures:
        console.print(
            Text(f"{len(failures)} of {len(results)} host(s) failed: {', '.join(failures)}", style="bold red")
        )
    return bool(failures)


def _cell(value: object) -> Text:
    # A host's data (a path, a log line) is never markup; its words stay whole (WordText).
    if isinstance(value, Text):
        return WordText.of(escape_text(value))
    if value is None:
        return Text("-", style="dim")
    return WordText.of(escape_text(Text(str(value))))


def raise_if_failed(
    what: str, results: FleetResult[Any], *, failure: Judge | None = None, cancel: threading.Event | None = None
) -> None:
    """After rendering: exit non-zero (FleetError, carrying the result) when some host failed;
    exit 130 (Interrupted) when Ctrl-C or SIGTERM cut the run short."""
    if cancel is not None and cancel.is_set():
        raise Interrupted("interrupted; each host's state is shown above", failures=results.failed)
    failures = results.failures(failure)
    if failures:
        raise FleetError(
            f"{what} failed on {len(failures)} of {len(results)} host(s): {', '.join(failures)}",
            result=results,
            failures=failures,
        )


# --------------------------------------------------------------------------- graph mode

# One name for each CUDA-graph mode in every table and line (restart, status,
# service-status, selftest, tune, report), under a column headed "mode": a server ran with
# its CUDA graphs captured, or eager (without them: a failed capture fell back, or --eager).
GRAPHS = "graphs"
EAGER = "eager"


def graph_mode(cuda_graph: bool | None) -> str:
    """``graphs``, ``eager``, or ``unknown`` (the server did not say)."""
    return "unknown" if cuda_graph is None else GRAPHS if cuda_graph else EAGER


# --------------------------------------------------------------------------- tables that fit

# Every command's --wide, in one wording.
WIDE_HELP = "Every table column, however wide (default: what fits the terminal)."


@dataclasses.dataclass(frozen=True)
class TableColumn:
    """One column of a table that must fit the terminal.

    ``drop`` ranks what goes when the table is too wide (0: never; higher: sooner);
    ``wrap`` lets the column's cells wrap at spaces (free text: a server key, an error)
    where every other column keeps each value on one line.
    """

    header: str
    justify: JustifyMethod = "left"
    drop: int = 0
    wrap: bool = False


def _has_spread(repeats: int | None) -> bool:
    """One repeat has no spread to show (a '± 0.0' would claim one)."""
    return repeats is not None and repeats >= 2


def with_spread(value: str, mad: str, repeats: int | None) -> str:
    """'value ± MAD' over repeats, the value alone where there is no spread."""
    return f"{value} ± {mad}" if _has_spread(repeats) else value


def tok_s_column(repeats: Iterable[int | None]) -> TableColumn:
    """The throughput column: 'tok/s ± MAD' where some row has repeats to spread over."""
    return TableColumn("tok/s ± MAD" if any(map(_has_spread, repeats)) else "tok/s", "right")


def fitted_table(
    columns: Sequence[TableColumn],
    rows: Sequence[Sequence[str | Text]],
    *,
    width: int,
    wide: bool = False,
    title: str | None = None,
    caption: str | None = None,
    sized_by: Sequence[Sequence[str | Text]] | None = None,
) -> Table:
    """A table no wider than ``width`` without cutting a value: the columns with the
    highest ``drop`` go first (the caption names them and ``--wide``), headers wrap at
    spaces, ``wrap`` columns wrap their text. Every row is kept. ``wide``: every column at
    its full width, however wide that is (print it with :func:`print_table`).
    ``sized_by``: the rows that set the widths and the columns kept (default ``rows``), so
    that tables shown one after another (one per host) have the same columns."""
    # Measured as shown: a control character in data is printed as its escape (cli.terminal).
    # Each cell a WordText: a word breaks only after a "/" or "," (never "si│m-ct200").
    texts = [[WordText.of(escape_text(c if isinstance(c, Text) else Text(str(c)))) for c in row] for row in rows]
    sizing = texts if sized_by is None else [
        [WordText.of(escape_text(c if isinstance(c, Text) else Text(str(c)))) for c in r] for r in sized_by
    ]

    def longest(i: int) -> int:
        return max((_text_width(row[i]) for row in sizing), default=0)

    full = [max(len(col.header), longest(i)) for i, col in enumerate(columns)]
    # A wrapped column needs its longest word, and at least 12 cells where it has them.
    need = [
        max(_longest_word(col.header), _wrapped_need(longest(i), sizing, i) if col.wrap else longest(i))
        for i, col in enumerate(columns)
    ]
    keep = list(range(len(columns)))
    if wide:
        need = full
    else:
        while _table_width(need, keep) > width and any(columns[i].drop for i in keep):
            worst = max((i for i in keep if columns[i].drop), key=lambda i: (columns[i].drop, i))
            keep.remove(worst)
    widths = {i: need[i] for i in keep}
    fits = wide or _table_width(need, keep) <= width
    if fits and not wide:
        spare = width - _table_width(need, keep)
        # Room left: first whole wrapped texts, then whole headers (fewer header lines).
        for grow in (lambda i: longest(i) if columns[i].wrap else 0, lambda i: full[i]):
            for i in keep:
                more = min(spare, max(0, grow(i) - widths[i]))
                widths[i] += more
                spare -= more
    hidden = [columns[i].header for i in range(len(columns)) if i not in keep]
    # Each note one sentence: a caption that does not end one gets its full stop, so the
    # next note never runs into it ("... smoke Hidden to fit").
    notes = [caption if caption.rstrip().endswith((".", ")", ":")) else caption.rstrip() + "."] if caption else []
    if hidden:
        notes.append(f"Hidden to fit {width} columns: {', '.join(hidden)} (--wide shows every column).")
    table = Table(
        title=WordText(title) if title else None,
        title_justify="left",
        caption=WordText(" ".join(notes)) if notes else None,
        caption_justify="left",
        width=_table_width([widths[i] for i in keep], range(len(keep))) if wide else None,
    )
    for i in keep:
        col = columns[i]
        table.add_column(
            Text(col.header),
            justify=col.justify,
            width=widths[i] if fits else None,  # >= every value's width: only headers wrap
            overflow="fold",
        )
    for row in texts:
        table.add_row(*(row[i] for i in keep))
    return table


def print_table(console: Console, table: Table) -> None:
    """Print a :func:`fitted_table`; a ``--wide`` one is not cut at the terminal's edge."""
    console.print(table, crop=table.width is None)


def _table_width(widths: Sequence[int], keep: Iterable[int]) -> int:
    """The printed width of a rich table with the default box: 1 + per column 3 + content."""
    kept = list(keep)
    return 1 + sum(widths[i] + 3 for i in kept)


def _text_width(text: Text) -> int:
    return max((cell_len(line) for line in text.plain.splitlines()), default=0)


def _longest_word(text: str) -> int:
    return max((cell_len(w) for w in text.split()), default=0)


def _wrapped_need(longest: int, rows: Sequence[Sequence[Text]], i: int) -> int:
    return min(longest, max(12, _longest_word_in(rows, i)))


def _longest_word_in(rows: Sequence[Sequence[Text]], i: int) -> int:
    # What a wrapped cell cannot go below: its widest piece (a path breaks after a "/").
    return max((longest_piece(row[i].plain) for row in rows), default=0)
