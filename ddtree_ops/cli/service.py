"""`ddtree-ops restart / stop / logs / service-status`: the service lifecycle on the command line.

All decisions live in :mod:`ddtree_ops.service.lifecycle`; this module selects hosts
(one per server: a host with GPU slots is one host per slot, ``host/i``), runs them in
parallel, shows live phases per host, renders results and picks the exit code. Ctrl-C
during a wait sets a cancel event that every host's wait loop checks, so each host stops
waiting cleanly and reports the state it was left in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ddtree_ops.cli.common import (
    WIDE_HELP,
    TableColumn,
    error_text,
    fitted_table,
    fleet_json,
    graph_mode,
    load_inventory_for,
    load_slot_hosts,
    print_table,
    raise_if_failed,
    render_host_results,
    set_json_data,
    transport_for,
)
from ddtree_ops.cli.main import AppContext, app, err_console
from ddtree_ops.cli.rollout import (
    RolloutArgs,
    gate_cell,
    raise_if_rollout_failed,
    render_rollout,
    rollout_json,
    rollout_options,
    run_with_rollout,
)
from ddtree_ops.errors import ConfigError, DdtreeOpsError, FleetError, ServiceError
from ddtree_ops.fleet import FleetResult, run_on_hosts
from ddtree_ops.inventory_types import Host
from ddtree_ops.rollout.changes import RestartChange, RestartSettings, ServerRestarter
from ddtree_ops.rollout.executor import RolloutEvent, RolloutResult
from ddtree_ops.rollout.observe import observe_place
from ddtree_ops.rollout.plan import RolloutPlan
from ddtree_ops.service import lifecycle, manager
from ddtree_ops.service.launch import RunConfig, parse_algorithm
from ddtree_ops.service.logphases import Phase, PhaseEvent
from ddtree_ops.service.smoke import SmokeSampling, SmokeSpec
from ddtree_ops.state import StateStore

T = TypeVar("T")
# These commands act on servers, so a host means each of its GPU slots (one row each).
_TARGET_HELP = "Host (every GPU slot of it), one slot HOST/I, group, comma list, or 'all'."


def _lease_pass(transport: Any, host: Host, *, force: bool) -> manager.LeasePass:
    """Without --force: refused while a sweep holds the host. With it: overridden, and the
    override said on stderr, because that sweep's rows on this host are now disturbed."""
    if force:
        held = manager.read_lease(transport, host)
        if held is not None:
            err_console.print(
                f"warning: {host.name}: --force overrides the lease of {manager.describe_lease(held)}; "
                "its measurements on this host are disturbed",
                style="yellow", markup=False, highlight=False, soft_wrap=True,
            )
    return manager.LeasePass(force=force)


def _slots_and_machines(obj: AppContext, target: str) -> tuple[list[Host], dict[str, Host]]:
    """The target's servers (one host per slot), and the inventory host of each machine
    that has slots (what a slot is a slot of)."""
    inventory = load_inventory_for(obj)
    hosts = inventory.resolve_slots(target)
    return hosts, {h.machine: inventory.hosts[h.machine] for h in hosts if h.slot is not None}


@dataclass
class _Live:
    """Per-host phase board, fed from worker threads, rendered by rich.Live. In a rollout
    each host shows its batch, and the title the batch that runs."""

    hosts: Sequence[str]
    batches: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.start = {h: time.monotonic() for h in self.hosts}
        self.rows: dict[str, dict[str, str]] = {h: {"phase": "queued", "note": "", "attempt": "1"} for h in self.hosts}
        self.title = "restart"

    def on_phase(self, event: PhaseEvent) -> None:
        with self.lock:
            if event.phase is Phase.STOPPING:
                self.start[event.host] = time.monotonic()
            row = self.rows[event.host]
            row["phase"] = event.phase.markup
            row["attempt"] = str(event.attempt)
            if event.note:
                row["note"] = event.note

    def on_batch(self, event: RolloutEvent) -> None:
        """A batch starts (its hosts' clocks with it) or ends (its failed hosts marked)."""
        servers = [h for h in self.hosts if (self.batches or {}).get(h) == event.batch]
        with self.lock:
            label = " (canary)" if event.canary else ""
            self.title = f"{self.title.split(':')[0]}: batch {event.batch}/{event.batches}{label}"
            for h in servers:
                if not event.done:
                    self.start[h] = time.monotonic()
                    self.rows[h]["phase"] = "starting"
                elif h in event.failed or h.split("/")[0] in event.failed:
                    self.rows[h]["phase"] = "[red]failed[/]"

    def done(self, host: str, text: str) -> None:
        with self.lock:
            self.rows[host]["phase"] = text

    def __rich__(self) -> Table:
        table = Table(title=self.title, expand=False)
        columns = ("host", "batch", "phase", "elapsed", "try", "note") if self.batches else \
            ("host", "phase", "elapsed", "try", "note")
        for col in columns:
            table.add_column(col)
        with self.lock:
            for h in self.hosts:
                row = self.rows[h]
                elapsed = time.monotonic() - self.start[h]
                cells = [escape(h), row["phase"], f"{elapsed:5.1f}s", row["attempt"], escape(row["note"][:80])]
                if self.batches:
                    cells.insert(1, str(self.batches.get(h, "")))
                table.add_row(*cells)
        return table


def server_batches(plan: RolloutPlan, hosts: Sequence[Host]) -> dict[str, int] | None:
    """Each server's batch (a slot's is its machine's), or None when it is no rollout."""
    if not plan.rolling:
        return None
    return {s.name: plan.batch_of(h.name) for h in hosts for s in h.slot_hosts()}


@app.command()
@rollout_options()
def restart(
    ctx: typer.Context,
    target: str = typer.Argument(..., help=_TARGET_HELP),
    algorithm: str | None = typer.Option(
        None, "--algorithm",
        help="AR, DFLASH or DDTREE (the sweep's autoregressive, dflash, ddtree work too). Default: what each server "
        "launched last through ddtree-ops (refused where there is none).",
    ),
    budget: int | None = typer.Option(
        None,
        "--budget",
        min=1,
        help="DDTree node budget, launched as --speculative-num-draft-tokens BUDGET+1 (DFLASH: the draft tokens). "
        "With a tuned policy on the host: its launch state by default.",
    ),
    topk: int | None = typer.Option(None, "--topk", min=1, help="DDTree top-k (--speculative-eagle-topk)."),
    no_policy: bool = typer.Option(
        False, "--no-policy",
        help="DDTREE: launch without the policy `tune --deploy` put on the host, and forget it "
        "(by default every DDTREE restart launches with it).",
    ),
    eager: bool = typer.Option(False, "--eager", help="Launch without CUDA graphs."),
    retry_cuda_graph: bool = typer.Option(
        False, "--retry-cuda-graph", help="Try CUDA graphs even where a fallback is recorded."
    ),
    timeout: float | None = typer.Option(
        None, "--timeout", min=1,
        help="A fixed readiness deadline per launch, in seconds. Default: load-aware: twice the learned (else the "
        "inventory's expected) load time, at least 60 s, extended while the server's log shows progress (up to 4x), "
        "and given up early when the log is silent for max(120 s, half the load time).",
    ),
    extra_arg: list[str] | None = typer.Option(
        None, "--extra-arg", help="Extra server argument (repeatable; one argv entry each)."
    ),
    grace: float = typer.Option(
        30.0, "--grace", min=0, help="Seconds between SIGTERM and SIGKILL for the old process."
    ),
    no_smoke: bool = typer.Option(
        False, "--no-smoke", help="Ready as soon as the server answers: skip the speculative smoke (real decodes)."
    ),
    smoke_temperature: list[float] | None = typer.Option(
        None, "--smoke-temperature", min=0.0,
        help="Also smoke-test at this temperature (repeatable; greedy always runs). Use the sweep's settings.",
    ),
    force: bool = typer.Option(
        False, "--force", help="Restart even while a sweep holds the host (its lease); says so on stderr."
    ),
    keep_on_failure: bool = typer.Option(
        False, "--keep-on-failure",
        help="Leave a server that did not become ready (deadline passed, or Ctrl-C) running to inspect it; "
        "by default it is stopped, and the error says which.",
    ),
    wide: bool = typer.Option(
        False, "--wide", help=WIDE_HELP
    ),
    rollout_args: RolloutArgs = RolloutArgs(),
) -> None:
    """Restart SGLang and wait until the NEW process serves: it answers, and a short
    speculative smoke (greedy and sampled, alone and batched) decodes without crashing.
    Eager fallback when CUDA-graph capture or the first decodes fail with graphs on. A host
    given a tuned DDTREE policy (`tune --deploy`) keeps it: a DDTREE restart launches with
    it and is ready once the server follows it (--no-policy drops it). --serial rolls the
    servers in batches, --canary gates the rest on the first."""
    obj: AppContext = ctx.obj
    if no_smoke and smoke_temperature:
        raise ConfigError("--smoke-temperature and --no-smoke contradict each other")
    smoke = None if no_smoke else SmokeSpec.for_samplings(SmokeSampling.of(t) for t in smoke_temperature or ())
    args = rollout_args
    if algorithm is None:
        named = [flag for flag, given in (("--budget", budget), ("--topk", topk), ("--eager", eager or None),
                                          ("--extra-arg", extra_arg or None), ("--canary", args.canary))
                 if given is not None]
        if named:
            raise ConfigError(f"{named[0]} changes what is launched: give --algorithm (AR, DFLASH or DDTREE); "
                              "without it each server launches again what it launched last")
    run = RunConfig(
        algorithm=parse_algorithm(algorithm or "AR"),
        budget=budget,
        topk=topk,
        cuda_graph="off" if eager else "auto",
        extra_args=tuple(extra_arg or ()),
    )
    hosts, machines = _slots_and_machines(obj, target)
    plan = args.plan([h.name for h in hosts])
    gate = args.gate(plan, hosts, run)
    state = StateStore()
    cancel = threading.Event()
    board = _Live([h.name for h in hosts], server_batches(plan, hosts))
    plain = not obj.console.is_terminal  # no live board to show a wait: say it on stderr

    def on_phase(event: PhaseEvent) -> None:
        board.on_phase(event)
        if plain and event.phase is Phase.WAITING_FOR_PORT:
            err_console.print(f"{event.host}: {event.note}", markup=False, highlight=False, soft_wrap=True)

    restarter = ServerRestarter(
        run, RestartSettings(timeout=timeout, retry_cuda_graph=retry_cuda_graph, stop_grace_s=grace, smoke=smoke,
                             keep_on_failure=keep_on_failure, use_policy=not no_policy),
        state=state, machines=machines, lease=lambda t, h: _lease_pass(t, h, force=force), on_phase=on_phase,
        repeat_last=algorithm is None,
    )
    result = run_with_rollout(obj, hosts, RestartChange(restarter), plan, gate=gate,
                              rollback_on_failure=args.rollback_on_failure, cancel=cancel, board=board)
    _render_restart(obj, result.results, wide=wide, gates=result)
    render_rollout(obj, result)
    raise_if_rollout_failed("restart", result, cancel=cancel)


# The restart summary's times, each named by what it spans (RestartResult).
_TIMES_CAPTION = (
    "load: launch → the server answers (capture included) · capture: the CUDA-graph capture within "
    "load · smoke: after load · total: launch → ready (the last launch): load, then smoke"
)


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}s"


def _render_restart(
    obj: AppContext, results: FleetResult[lifecycle.RestartResult], *, wide: bool = False,
    gates: RolloutResult[Any] | None = None,
) -> None:
    """One table, one row per host, its times in named columns (the live board's running
    clock is gone by then: it was transient); in a rollout its batch, and a canary's gate."""
    if obj.json:
        render_host_results(obj, "restart", results, [])
        if gates is not None and isinstance(obj.data, dict):
            obj.data["rollout"] = rollout_json(gates)
        return
    columns: tuple[TableColumn, ...] = (
        TableColumn("host", wrap=True), TableColumn("status"), TableColumn("pid", "right", drop=2),
        TableColumn("run", wrap=True), TableColumn("mode"), TableColumn("load", "right"),
        # Part of load: what goes first when the run column needs the room (80 columns).
        TableColumn("capture", "right", drop=1),
        TableColumn("smoke", "right"), TableColumn("total", "right", wrap=True),
        TableColumn("deadline", wrap=True, drop=1),
    )
    rolling = gates is not None and gates.plan.rolling
    if rolling:
        columns = (*columns[:2], TableColumn("batch", "right"), *columns[2:], TableColumn("gate", wrap=True, drop=1))
    rows: list[list[str | Text]] = []
    for name, value in results.items():
        if isinstance(value, BaseException):
            rows.append([name, Text("FAILED", style="bold red"), *[""] * 8])
        else:
            r = value
            launches = f" ({r.attempts} launches)" if r.attempts > 1 else ""
            rows.append([
                name, Text("ok", style="green"), str(r.pid), r.run.replace("budget=", "b=").replace("topk=", "k="),
                graph_mode(r.cuda_graph),
                _seconds(r.load_s), _seconds(r.phase_durations.get(Phase.CAPTURING)),
                "skipped" if r.smoke is None else _seconds(r.smoke.seconds), f"{r.ready_s:.1f}s{launches}",
                f"{r.deadline_s:.0f}s ({r.deadline_source})",
            ])
        if rolling and gates is not None:
            rows[-1][2:2] = [str(gates.plan.batch_of(name))]
            rows[-1][len(columns) - 1:] = [gate_cell(gates, name)]
    if rolling and gates is not None:
        for name in gates.not_reached:
            rows.append([name, Text("not reached", style="yellow"), str(gates.plan.batch_of(name)),
                         *[""] * (len(columns) - 3)])
    print_table(obj.console, fitted_table(columns, rows, width=obj.console.width, wide=wide, title="restart",
                                          caption=_TIMES_CAPTION))
    for name, exc in results.failed.items():
        obj.console.print(Text(f"{name} ({type(exc).__name__}): {error_text(exc)}", style="red"))
    if results.failed:
        obj.console.print(
            Text(f"{len(results.failed)} of {len(results)} host(s) failed: {', '.join(results.failed)}",
                 style="bold red")
        )
    for name, r in results.succeeded.items():
        if r.attempts > 1 and not r.cuda_graph:
            # The reason names what failed ("CUDA-graph capture failed: ...", "first decode
            # crashed: ..."): said once.
            reason = escape(r.fallback_reason or "CUDA graphs failed")
            obj.console.print(f"[bold yellow]{escape(name)}: now serving in EAGER mode[/] — {reason}", highlight=False)


def _finish(what: str, results: FleetResult[Any], cancel: threading.Event | None = None) -> None:
    raise_if_failed(what, results, cancel=cancel)


@app.command()
def stop(
    ctx: typer.Context,
    target: str = typer.Argument(..., help=_TARGET_HELP),
    grace: float = typer.Option(30.0, "--grace", min=0, help="Seconds between SIGTERM and SIGKILL."),
    force: bool = typer.Option(
        False, "--force", help="Stop even while a sweep holds the host (its lease); says so on stderr."
    ),
) -> None:
    """Stop the SGLang server (SIGTERM to the process group ddtree-ops launched, or `systemctl stop`
    of a systemd host's unit; SIGKILL after --grace).
    A host with GPU slots: each slot's server, and a server launched on it as one server
    before it had slots (shown only if there was one)."""
    obj: AppContext = ctx.obj
    hosts, machines = _slots_and_machines(obj, target)
    names = {h.name for h in hosts}
    whole = [m for m in machines.values() if all(s.name in names for s in m.slot_hosts())]
    observed: dict[str, str] = {}

    def one(host: Host) -> manager.StopResult:
        with transport_for(obj, host) as t:
            result = lifecycle.stop(t, host, grace_s=grace, lease=_lease_pass(t, host, force=force))
            if host.name in names:
                # What is reported is what the host shows afterwards: a unit that systemd
                # started again, or a server that outlived the stop, fails the host.
                view = observe_place(t, host, smoke=None)
                observed[host.name] = view.describe()
                if view.running or view.error is not None:
                    raise ServiceError(f"observed after the stop: {view.describe()}", host=host.name)
            return result

    results = run_on_hosts([*hosts, *whole], one, max_parallel=obj.max_parallel)
    extra = {m.name for m in whole}
    results = FleetResult({
        name: value for name, value in results.items()
        if not (name in extra and isinstance(value, manager.StopResult) and not value.was_running)
    })
    columns = [
        ("result", lambda r: ("stopped" if r.exited else "still running") if r.was_running else "not running"),
        ("pid", lambda r: r.pid),
        ("signal", lambda r: r.signal),
        ("waited", lambda r: f"{r.waited_s:.1f}s"),
        ("observed", lambda r: observed.get(r.host)),
    ]
    render_host_results(obj, "stop", results, columns)
    _finish("stop", results)


@app.command("service-status")
def service_status_cmd(
    ctx: typer.Context,
    target: str = typer.Argument("all", help=_TARGET_HELP),
) -> None:
    """Is the server running, does it hold the port, does it answer generation? On a systemd
    host also the unit: its state, how often systemd restarted it, whether our drop-in is in
    effect and whether it is enabled (comes back after a reboot)."""
    obj: AppContext = ctx.obj
    hosts = load_slot_hosts(obj, target)

    def one(host: Host) -> lifecycle.ServiceStatus:
        with transport_for(obj, host) as t:
            return lifecycle.service_status(t, host)

    def ready(r: lifecycle.ServiceStatus) -> str:
        if r.health != 200:
            return "no"
        return "stale (port held by another process)" if r.serving_ours is False else "yes"

    results = run_on_hosts(hosts, one, max_parallel=obj.max_parallel)
    columns = [
        ("running", lambda r: "yes" if r.running else "no"),
        ("pid", lambda r: r.pid),
        ("unit", lambda r: r.unit.describe() if r.unit is not None else None),
        ("run", lambda r: r.run),
        ("mode", lambda r: None if r.cuda_graph is None else graph_mode(r.cuda_graph)),
        ("ready", ready),
        ("log", lambda r: r.log_tail[-1] if r.log_tail else None),
    ]
    render_host_results(obj, "service", results, columns)
    _finish("service-status", results)


@app.command()
def logs(
    ctx: typer.Context,
    target: str = typer.Argument(..., help=_TARGET_HELP),
    lines: int = typer.Option(50, "--lines", "-n", min=0, help="Lines from the end of each log."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until Ctrl-C."),
) -> None:
    """Show the server log of each host: the file the process manager writes in run_dir, or
    on a systemd host `journalctl -u UNIT` since the last restart."""
    obj: AppContext = ctx.obj
    if follow and obj.json:
        raise ConfigError("--follow streams text; it cannot be combined with --json")
    hosts = load_slot_hosts(obj, target)
    prefix = len(hosts) > 1
    transports = {h.name: transport_for(obj, h) for h in hosts}
    offsets: dict[str, manager.LogPosition] = {}
    values: dict[str, Any] = {}
    try:
        for h in hosts:
            try:
                data = lifecycle.manager_for(transports[h.name], h).read_logs(lines=lines)
            except DdtreeOpsError as exc:
                values[h.name] = exc
                if not obj.json:
                    obj.console.print(f"[red]{escape(error_text(exc))}[/]", highlight=False)
                continue
            values[h.name] = {"exists": bool(data.get("exists")), "lines": list(data.get("lines") or [])}
            offsets[h.name] = data.get("offset", 0)
            if obj.json:
                continue
            if not data.get("exists"):
                missing = escape(f"{h.name}: no server log yet in {h.ddtree.run_dir}")
                obj.console.print(f"[dim]{missing}[/]", highlight=False)
            _print_lines(obj, h.name, data.get("lines") or [], prefix)
        while follow and offsets:
            try:
                time.sleep(0.5)
                for h in hosts:
                    if h.name not in offsets:
                        continue
                    data = lifecycle.manager_for(transports[h.name], h).read_logs(position=offsets[h.name])
                    offsets[h.name] = data.get("offset", offsets[h.name])
                    _print_lines(obj, h.name, data.get("lines") or [], prefix)
            except KeyboardInterrupt:
                break
    finally:
        for t in transports.values():
            t.close()
    results = FleetResult(values)
    if obj.json:
        set_json_data(obj, fleet_json("logs", results, results.failed))
    if not results.ok:
        failed = list(results.failed)
        raise FleetError(f"{len(failed)} of {len(hosts)} hosts failed: {', '.join(failed)}", result=results)


def _print_lines(obj: AppContext, host: str, lines: Sequence[str], prefix: bool) -> None:
    for line in lines:
        text = f"{host} | {line}" if prefix else line
        obj.console.print(text, markup=False, highlight=False, soft_wrap=True)
