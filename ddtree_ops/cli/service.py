"""`ddtree-ops restart / stop / logs / service-status`: the service lifecycle on the command line.

All decisions live in :mod:`ddtree_ops.service.lifecycle`; this module selects hosts,
runs them in parallel, shows live phases per host, renders results and picks the exit
code. Ctrl-C during a wait sets a cancel event that every host's wait loop checks, so
each host stops waiting cleanly and reports the state it was left in.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Optional, TypeVar

import typer
from rich.live import Live
from rich.table import Table

from ddtree_ops.cli.main import AppContext, app
from ddtree_ops.errors import ConfigError, DdtreeOpsError, FleetError, Interrupted
from ddtree_ops.inventory_types import Host
from ddtree_ops.service import lifecycle, manager
from ddtree_ops.service.launch import RunConfig
from ddtree_ops.service.logphases import PhaseEvent
from ddtree_ops.state import StateStore
from ddtree_ops.transport import open_transport

T = TypeVar("T")


def _hosts(obj: AppContext, target: str) -> list[Host]:
    from ddtree_ops.inventory import load_inventory

    if not obj.inventory:
        raise ConfigError("no inventory: pass -i FILE or set DDTREE_OPS_INVENTORY")
    return load_inventory(obj.inventory).resolve(target)


def _fan_out(hosts: Sequence[Host], fn: Callable[[Host], T], *, max_parallel: int) -> dict[str, T | BaseException]:
    """``fleet.run_on_hosts`` where available; the same contract with a thread pool otherwise."""
    try:
        from ddtree_ops.fleet import run_on_hosts
    except ModuleNotFoundError:
        run_on_hosts = None
    if run_on_hosts is not None:
        return dict(run_on_hosts(hosts, fn, max_parallel=max_parallel))

    def guarded(h: Host) -> T | BaseException:
        try:
            return fn(h)
        except Exception as exc:  # one host's failure is its row, never lost
            return exc

    with ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(hosts)))) as pool:
        results = list(pool.map(guarded, hosts))
    return {h.name: r for h, r in zip(hosts, results)}


def _run_interruptible(
    hosts: Sequence[Host], fn: Callable[[Host], T], *, max_parallel: int, cancel: threading.Event
) -> dict[str, T | BaseException]:
    """Fan out in a worker thread so Ctrl-C reaches us; on Ctrl-C set ``cancel`` and
    wait for every host to report how it was left."""
    box: dict[str, dict[str, T | BaseException]] = {}
    done = threading.Event()

    def work() -> None:
        try:
            box["r"] = _fan_out(hosts, fn, max_parallel=max_parallel)
        finally:
            done.set()

    # An Event rather than Thread.join: a join interrupted by Ctrl-C can leave the thread
    # looking finished while it still runs (CPython issue 90882).
    threading.Thread(target=work, daemon=True).start()
    while not done.is_set():
        try:
            done.wait(0.2)
        except KeyboardInterrupt:
            cancel.set()
    return box["r"]


def _facts(transport: Any, host: Host) -> Any:
    """The probe's HostFacts (version + GPUs) if that module exists, else the version alone."""
    try:
        from ddtree_ops.probe import probe_host
    except ModuleNotFoundError:
        return manager.sglang_version(transport, host)
    facts = probe_host(transport, host)
    if getattr(facts, "sglang_version", None) is None:
        return manager.sglang_version(transport, host)
    return facts


def _print_json(obj: AppContext, results: dict[str, Any]) -> None:
    obj.console.print_json(json.dumps({
        n: ({"ok": False, "error": _error_text(r)} if isinstance(r, BaseException) else {"ok": True, **asdict(r)})
        for n, r in results.items()
    }, default=str))


def _error_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, DdtreeOpsError) else f"{type(exc).__name__}: {exc}"


@dataclass
class _Live:
    """Per-host phase board, fed from worker threads, rendered by rich.Live."""

    hosts: Sequence[str]

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.start = {h: time.monotonic() for h in self.hosts}
        self.rows: dict[str, dict[str, str]] = {h: {"phase": "queued", "note": "", "attempt": "1"} for h in self.hosts}

    def on_phase(self, event: PhaseEvent) -> None:
        with self.lock:
            if event.phase == "stopping":
                self.start[event.host] = time.monotonic()
            row = self.rows[event.host]
            row["phase"] = event.phase
            row["attempt"] = str(event.attempt)
            if event.note:
                row["note"] = event.note

    def done(self, host: str, text: str) -> None:
        with self.lock:
            self.rows[host]["phase"] = text

    def __rich__(self) -> Table:
        table = Table(title="restart", expand=False)
        for col in ("host", "phase", "elapsed", "try", "note"):
            table.add_column(col)
        with self.lock:
            for h in self.hosts:
                row = self.rows[h]
                elapsed = time.monotonic() - self.start[h]
                table.add_row(h, row["phase"], f"{elapsed:5.1f}s", row["attempt"], row["note"][:80])
        return table


@app.command()
def restart(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="Host, group, comma list, or 'all'."),
    algorithm: str = typer.Option("AR", "--algorithm", help="AR, DFLASH or DDTREE."),
    budget: Optional[int] = typer.Option(None, "--budget", min=1, help="DDTree node budget (DFLASH: draft tokens)."),
    topk: Optional[int] = typer.Option(None, "--topk", min=1, help="DDTree top-k."),
    eager: bool = typer.Option(False, "--eager", help="Launch without CUDA graphs."),
    retry_cuda_graph: bool = typer.Option(False, "--retry-cuda-graph", help="Try CUDA graphs even where a fallback is recorded."),
    timeout: Optional[float] = typer.Option(None, "--timeout", min=1, help="Readiness deadline per launch (default: load-aware)."),
    extra_arg: Optional[list[str]] = typer.Option(None, "--extra-arg", help="Extra server argument (repeatable; one argv entry each)."),
    grace: float = typer.Option(30.0, "--grace", min=0, help="Seconds between SIGTERM and SIGKILL for the old process."),
) -> None:
    """Restart SGLang and wait until the NEW process serves (eager fallback on capture failure)."""
    obj: AppContext = ctx.obj
    run = RunConfig(
        algorithm=algorithm.upper(),  # type: ignore[arg-type]
        budget=budget,
        topk=topk,
        cuda_graph="off" if eager else "auto",
        extra_args=tuple(extra_arg or ()),
    )
    hosts = _hosts(obj, target)
    state = StateStore()
    cancel = threading.Event()
    board = _Live([h.name for h in hosts])

    def one(host: Host) -> lifecycle.RestartResult:
        with open_transport(host, host_key_policy=obj.host_key_policy) as t:
            facts = _facts(t, host)
            try:
                result = lifecycle.restart(
                    t, host, facts, run, state=state, timeout=timeout, retry_cuda_graph=retry_cuda_graph,
                    on_phase=board.on_phase, cancel=cancel, stop_grace_s=grace,
                )
            except BaseException as exc:
                board.done(host.name, "interrupted" if isinstance(exc, Interrupted) else "failed")
                raise exc
            board.done(host.name, "ready")
            return result

    if obj.json:
        results = _run_interruptible(hosts, one, max_parallel=obj.max_parallel, cancel=cancel)
    else:
        with Live(board, console=obj.console, refresh_per_second=4, transient=False):
            results = _run_interruptible(hosts, one, max_parallel=obj.max_parallel, cancel=cancel)
    _render_restart(obj, results)
    _finish(results, cancel)


def _render_restart(obj: AppContext, results: dict[str, Any]) -> None:
    if obj.json:
        out: dict[str, Any] = {}
        for name, r in results.items():
            if isinstance(r, BaseException):
                out[name] = {"ok": False, "error": _error_text(r)}
            else:
                out[name] = {"ok": True, **r.as_dict()}
        obj.console.print_json(json.dumps(out, default=str))
        return
    table = Table(title="restart results")
    for col in ("host", "result", "pid", "cuda graphs", "ready", "deadline", "detail"):
        table.add_column(col, overflow="fold")
    for name, r in results.items():
        if isinstance(r, BaseException):
            table.add_row(name, "[red]failed[/]", "", "", "", "", _error_text(r))
            continue
        graphs = "[green]on[/]" if r.cuda_graph else "[yellow]off (eager)[/]"
        why = f"eager: {r.fallback_reason}" if r.fallback_reason else ""
        table.add_row(
            name, "[green]ready[/]", str(r.pid), graphs, f"{r.ready_s:.1f}s",
            f"{r.deadline_s:.0f}s ({r.deadline_source})", why,
        )
    obj.console.print(table)
    for name, r in results.items():
        if not isinstance(r, BaseException) and r.attempts > 1 and not r.cuda_graph:
            obj.console.print(f"[bold yellow]{name}: CUDA-graph capture failed; now serving in EAGER mode[/] — {r.fallback_reason}")


def _finish(results: dict[str, Any], cancel: threading.Event) -> None:
    failed = [n for n, r in results.items() if isinstance(r, BaseException)]
    if cancel.is_set():
        raise Interrupted("interrupted; each host's state is shown above")
    if failed:
        raise FleetError(f"{len(failed)} of {len(results)} hosts failed: {', '.join(failed)}")


@app.command()
def stop(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="Host, group, comma list, or 'all'."),
    grace: float = typer.Option(30.0, "--grace", min=0, help="Seconds between SIGTERM and SIGKILL."),
) -> None:
    """Stop the SGLang server ddtree-ops launched (SIGTERM to its process group, SIGKILL after --grace)."""
    obj: AppContext = ctx.obj
    hosts = _hosts(obj, target)

    def one(host: Host) -> manager.StopResult:
        with open_transport(host, host_key_policy=obj.host_key_policy) as t:
            return lifecycle.stop(t, host, grace_s=grace)

    results = _fan_out(hosts, one, max_parallel=obj.max_parallel)
    if obj.json:
        _print_json(obj, results)
    else:
        table = Table(title="stop")
        for col in ("host", "result", "pid", "signal", "waited"):
            table.add_column(col, overflow="fold")
        for n, r in results.items():
            if isinstance(r, BaseException):
                table.add_row(n, "[red]failed[/]", "", "", _error_text(r))
            elif not r.was_running:
                table.add_row(n, "not running", str(r.pid or ""), "", "")
            else:
                table.add_row(n, "[green]stopped[/]", str(r.pid), r.signal or "", f"{r.waited_s:.1f}s")
        obj.console.print(table)
    _finish(results, threading.Event())


@app.command("service-status")
def service_status_cmd(
    ctx: typer.Context,
    target: str = typer.Argument("all", help="Host, group, comma list, or 'all'."),
) -> None:
    """Is the server we launched running, does it hold the port, does it answer generation?"""
    obj: AppContext = ctx.obj
    hosts = _hosts(obj, target)

    def one(host: Host) -> lifecycle.ServiceStatus:
        with open_transport(host, host_key_policy=obj.host_key_policy) as t:
            return lifecycle.service_status(t, host)

    results = _fan_out(hosts, one, max_parallel=obj.max_parallel)
    if obj.json:
        _print_json(obj, results)
    else:
        table = Table(title="service")
        for col in ("host", "running", "pid", "run", "cuda graphs", "ready", "detail"):
            table.add_column(col, overflow="fold")
        for n, r in results.items():
            if isinstance(r, BaseException):
                table.add_row(n, "[red]?[/]", "", "", "", "", _error_text(r))
                continue
            ready = "yes" if r.health == 200 and r.serving_ours is not False else ("stale" if r.health == 200 else "no")
            graphs = "" if r.cuda_graph is None else ("on" if r.cuda_graph else "off")
            table.add_row(n, "yes" if r.running else "no", str(r.pid or ""), r.run or "", graphs, ready,
                          (r.log_tail[-1] if r.log_tail else "")[:100])
        obj.console.print(table)
    _finish(results, threading.Event())


@app.command()
def logs(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="Host, group, comma list, or 'all'."),
    lines: int = typer.Option(50, "--lines", "-n", min=0, help="Lines from the end of each log."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until Ctrl-C."),
) -> None:
    """Show the server log of each host (the file the process manager writes in run_dir)."""
    obj: AppContext = ctx.obj
    hosts = _hosts(obj, target)
    prefix = len(hosts) > 1
    transports = {h.name: open_transport(h, host_key_policy=obj.host_key_policy) for h in hosts}
    offsets: dict[str, int] = {}
    failed: list[str] = []
    try:
        for h in hosts:
            try:
                data = manager.read_logs(transports[h.name], h, lines=lines)
            except DdtreeOpsError as exc:
                obj.console.print(f"[red]{_error_text(exc)}[/]", highlight=False)
                failed.append(h.name)
                continue
            offsets[h.name] = int(data.get("offset", 0))
            if not data.get("exists"):
                obj.console.print(f"[dim]{h.name}: no server log yet in {h.ddtree.run_dir}[/]", highlight=False)
            _print_lines(obj, h.name, data.get("lines") or [], prefix)
        while follow and offsets:
            try:
                time.sleep(0.5)
                for h in hosts:
                    if h.name not in offsets:
                        continue
                    data = manager.read_logs(transports[h.name], h, offset=offsets[h.name])
                    offsets[h.name] = int(data.get("offset", offsets[h.name]))
                    _print_lines(obj, h.name, data.get("lines") or [], prefix)
            except KeyboardInterrupt:
                break
    finally:
        for t in transports.values():
            t.close()
    if failed:
        raise FleetError(f"{len(failed)} of {len(hosts)} hosts failed: {', '.join(failed)}")


def _print_lines(obj: AppContext, host: str, lines: Sequence[str], prefix: bool) -> None:
    for line in lines:
        text = f"{host} | {line}" if prefix else line
        obj.console.print(text, markup=False, highlight=False, soft_wrap=True)
