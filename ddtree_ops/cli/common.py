"""Helpers every command uses: resolve the target to hosts, render per-host results.

The per-host summary is the one place that turns ``{host: result | exception}`` (from
:func:`ddtree_ops.fleet.run_on_hosts`) into output: a rich table for people, or one JSON
document for scripts (``--json``). It returns whether any host failed; the command then
raises :class:`FleetError` so the exit code says so, after every host was shown.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from ddtree_ops.errors import DdtreeOpsError, FleetError
from ddtree_ops.inventory import Inventory, load_inventory
from ddtree_ops.inventory_types import Host
from ddtree_ops.transport import RoundTripCounter, Transport, open_transport

Column = tuple[str, Callable[[Any], object]]


def load_inventory_for(ctx_obj: Any) -> Inventory:
    """The inventory named by the global ``-i`` options (or their defaults)."""
    return load_inventory(list(ctx_obj.inventory))


def load_hosts(ctx_obj: Any, target: str) -> list[Host]:
    """``target`` (group, host, ``all`` or a comma list) -> hosts; raises ConfigError subclasses."""
    return load_inventory_for(ctx_obj).resolve(target)


def transport_for(ctx_obj: Any, host: Host, *, counter: RoundTripCounter | None = None) -> Transport:
    """A transport honouring the global ``--host-key-policy``."""
    return open_transport(host, host_key_policy=ctx_obj.host_key_policy, counter=counter)


def error_text(exc: BaseException) -> str:
    """One line for a host's failure: our errors speak for themselves, others get their type."""
    if isinstance(exc, DdtreeOpsError):
        text = exc.message or str(exc)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def to_jsonable(value: Any) -> Any:
    """Dataclasses, mappings (incl. MappingProxyType), tuples and Paths -> JSON types."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def emit_json(data: Any) -> None:
    """Machine-readable output goes to stdout untouched by rich (no wrapping, no markup)."""
    sys.stdout.write(json.dumps(to_jsonable(data), indent=2) + "\n")
    sys.stdout.flush()


def render_host_results(
    ctx_obj: Any,
    title: str,
    results: Mapping[str, Any],
    columns: Sequence[Column],
    *,
    failure: Callable[[Any], str | None] | None = None,
) -> bool:
    """Show every host's outcome; return True if any host failed.

    A host failed when its value is an exception, or when ``failure(value)`` returns a
    reason (for results that carry their own error, like doctor's facts). ``columns`` are
    ``(header, getter)`` pairs applied to successful values.
    """
    reasons: dict[str, str | None] = {}
    for name, value in results.items():
        if isinstance(value, BaseException):
            reasons[name] = error_text(value)
        else:
            reasons[name] = failure(value) if failure is not None else None
    any_failed = any(r is not None for r in reasons.values())

    if getattr(ctx_obj, "json", False):
        rows = []
        for name, value in results.items():
            row: dict[str, Any] = {"host": name, "ok": reasons[name] is None, "error": reasons[name]}
            if isinstance(value, BaseException):
                row["error_type"] = type(value).__name__
            else:
                row["result"] = to_jsonable(value)
            rows.append(row)
        emit_json({"title": title, "ok": not any_failed, "hosts": rows})
        return any_failed

    # Many columns do not fit a terminal: then one row per (host, column) instead.
    long = len(columns) > 3
    table = Table(title=title, title_justify="left", show_lines=long)
    table.add_column("host", style="bold", no_wrap=True)
    table.add_column("status", no_wrap=True)
    if long:
        table.add_column("details", overflow="fold")
    else:
        for header, _ in columns:
            table.add_column(header, overflow="fold")
    for name, value in results.items():
        reason = reasons[name]
        failed_call = isinstance(value, BaseException)
        status = Text(f"FAILED ({type(value).__name__})" if failed_call else "FAILED", style="bold red") if reason else Text("ok", style="green")
        cells = [] if failed_call else [_cell(getter(value)) for _, getter in columns]
        if long:
            grid = Table.grid(padding=(0, 1))
            grid.add_column(style="dim", no_wrap=True)
            grid.add_column(overflow="fold")
            for (header, _), cell in zip(columns, cells):
                grid.add_row(header, cell)
            if reason:
                grid.add_row(Text("error", style="red"), Text(reason, style="red"))
            table.add_row(name, status, grid)
        else:
            if failed_call:
                cells = [Text(reason or "", style="red")] + [""] * (len(columns) - 1)
            table.add_row(name, status, *cells[: len(columns)])
            if reason and not failed_call and columns:
                table.add_row("", "", Text(reason, style="red"), *[""] * (len(columns) - 1))
    console = ctx_obj.console
    console.print(table)
    failed = [n for n, r in reasons.items() if r is not None]
    if failed:
        console.print(Text(f"{len(failed)} of {len(results)} host(s) failed: {', '.join(failed)}", style="bold red"))
    return any_failed


def _cell(value: object) -> Text | str:
    if isinstance(value, Text):
        return value
    if value is None:
        return Text("-", style="dim")
    return str(value)


def raise_if_failed(
    what: str, results: Mapping[str, Any], *, failure: Callable[[Any], str | None] | None = None
) -> None:
    """After rendering: exit non-zero (FleetError) when some host failed."""
    failed = [
        name
        for name, value in results.items()
        if isinstance(value, BaseException) or (failure is not None and failure(value) is not None)
    ]
    if failed:
        raise FleetError(f"{what} failed on {len(failed)} of {len(results)} host(s): {', '.join(failed)}")
