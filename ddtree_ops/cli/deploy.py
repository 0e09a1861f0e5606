"""`ddtree-ops deploy / status / rollback`: the patch engine on the command line.

Every host is worked on in parallel (``--max-parallel``, ``--serial``) and reported on
its own row; one failing host never hides the others, and the exit code is non-zero if
any host failed. All decisions live in :mod:`ddtree_ops.patching`; this module only
selects hosts, renders, and picks the exit code.
"""

from __future__ import annotations

import difflib
import posixpath
import threading
import time
from collections.abc import Iterable
from dataclasses import replace as replace_dc
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.text import Text

from ddtree_ops.cli.common import (
    WIDE_HELP,
    TableColumn,
    error_text,
    failure_row,
    fitted_table,
    graph_mode,
    load_hosts,
    print_table,
    raise_if_failed,
    set_json_data,
    transport_for,
)
from ddtree_ops.cli.main import AppContext, app
from ddtree_ops.cli.rollout import (
    RolloutArgs,
    raise_if_rollout_failed,
    refuse_without_undo,
    render_rollout,
    rollout_lines,
    rollout_options,
    run_with_rollout,
    say_baseline_cost,
)
from ddtree_ops.errors import ConfigError, DdtreeOpsError
from ddtree_ops.fleet import FleetResult, run_interruptible, run_on_hosts
from ddtree_ops.inventory_types import Host
from ddtree_ops.patching.bundle import Bundle, load_bundle
from ddtree_ops.patching.executor import HostOutcome, RunOptions, deploy
from ddtree_ops.patching.gather import RemoteState
from ddtree_ops.patching.overlay import load_overlay
from ddtree_ops.patching.plan import HostPlan
from ddtree_ops.patching.status import HostPatchStatus, host_status
from ddtree_ops.rollout.changes import DeployChange, Deployed, RollbackChange, RolledBack, ServerRestarter
from ddtree_ops.rollout.executor import RolloutResult
from ddtree_ops.service.launch import RunConfig
from ddtree_ops.service.lifecycle import service_status
from ddtree_ops.shipped import DEFAULT_BUNDLE
from ddtree_ops.state import StateStore
from ddtree_ops.transport.base import Transport

# The tree `deploy --restart` launches when neither the flags nor a tuned policy give one.
RESTART_BUDGET = 16
RESTART_TOPK = 4


# Imported by other command modules; the real helpers live in cli/common.py and fleet.py.
_hosts = load_hosts


_BUNDLE_DEFAULT = "default: the ddtree_temperature bundle shipped with ddtree-ops"
_BUNDLE_HELP = f"Bundle directory ({_BUNDLE_DEFAULT})."


def _parallel(obj: AppContext, max_parallel: int | None) -> int:
    return max_parallel or obj.max_parallel


def _fmt_time(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _plan_json(plan: HostPlan) -> dict[str, Any]:
    return {
        "operation": plan.operation,
        "outcome": plan.outcome,
        "bundle": plan.bundle_name,
        "identity": plan.bundle_identity,
        "package_version": plan.package_version,
        "reason": plan.reason,
        "notes": list(plan.notes),
        "files": [
            {"path": a.path, "action": a.kind, "current_sha256": a.current_sha256, "new_sha256": a.new_sha256,
             "reason": a.reason}
            for a in plan.actions
        ],
    }


def _outcome_json(o: HostOutcome) -> dict[str, Any]:
    return {"host": o.host, "ok": True, "outcome": o.outcome.value, "message": o.message, "recovered": o.recovered,
            "txn": o.txn, "plan": _plan_json(o.plan)}


def _render_outcomes(
    obj: AppContext, title: str, results: FleetResult[Any], *, show_files: bool, wide: bool = False,
    rollout: RolloutResult[Any] | None = None,
) -> None:
    """Render per-host results (a table, or the --json data: one row per host). A rollout
    adds each host's batch and gate, a row per host it did not reach, and each host as
    observed at the end. A value is a deploy's Deployed or a rollback's RolledBack (its
    servers said under the table)."""
    failed, succeeded = results.failed, results.succeeded
    outcomes = {n: v.outcome if isinstance(v, (RolledBack, Deployed)) else v for n, v in succeeded.items()}
    observed = rollout.observed if rollout is not None else {}
    # A rollout, or a change refused before any host changed: each host's batch, and a row
    # for every host not reached.
    rolling = rollout is not None and (rollout.plan.rolling or bool(rollout.not_reached))
    if obj.json:
        rows_json: list[dict[str, Any]] = []
        for n in results:
            row = failure_row(n, failed[n]) if n in failed else _outcome_json(outcomes[n])
            value = succeeded.get(n)
            if isinstance(value, (RolledBack, Deployed)):
                row["servers"] = list(value.servers)
            if isinstance(value, Deployed):
                row["result"] = value.label
            if rolling and rollout is not None:
                row["rollout"] = _rollout_row(rollout, n)
            if n in observed:
                row["observed"] = observed[n].as_dict()
            rows_json.append(row)
        if rolling and rollout is not None:
            rows_json += [{"host": n, "ok": False, "outcome": "not-reached", "message": _NOT_REACHED,
                           "rollout": _rollout_row(rollout, n),
                           **({"observed": observed[n].as_dict()} if n in observed else {})}
                          for n in rollout.not_reached]
        set_json_data(obj, rows_json)
        return
    # Fitted tables: words wrap at spaces, a path is never cut (two dist-info files would
    # read alike), what does not fit is dropped and the caption says so.
    rows: list[list[str | Text]] = []
    for name in results:
        batch = [str(rollout.plan.batch_of(name))] if rolling and rollout is not None else []
        if name in failed:
            rows.append([Text(name, style="bold"), *batch, Text("failed", style="red"), "", error_text(failed[name])])
            continue
        r = outcomes[name]
        value = succeeded[name]
        label = value.label if isinstance(value, Deployed) else r.outcome.label
        bundle = f"{r.plan.bundle_name or '-'} {(r.plan.bundle_identity or '')[:12]}".strip()
        rows.append([Text(name, style="bold"), *batch, Text(label, style=r.outcome.style), bundle, r.message])
    if rolling and rollout is not None:
        rows += [[Text(n, style="bold"), str(rollout.plan.batch_of(n)), Text("not reached", style="yellow"), "",
                  _NOT_REACHED] for n in rollout.not_reached]
    columns = (TableColumn("host"), *([TableColumn("batch", "right")] if rolling else []), TableColumn("result"),
               TableColumn("bundle", wrap=True), TableColumn("detail", wrap=True))
    print_table(obj.console, fitted_table(columns, rows, width=obj.console.width, wide=wide, title=title))
    for value in succeeded.values():
        if isinstance(value, (RolledBack, Deployed)):
            for line in value.servers:  # each names its server
                obj.console.print(line, markup=False, highlight=False, soft_wrap=True)
    if show_files:
        file_columns = (TableColumn("path"), TableColumn("action"), TableColumn("now", drop=2),
                        TableColumn("after", drop=3), TableColumn("why", drop=1, wrap=True))
        for name, r in outcomes.items():
            if not r.plan.actions:
                continue
            files: list[list[str | Text]] = [
                [a.path, a.kind, (a.current_sha256 or "absent")[:12], (a.new_sha256 or "absent")[:12], a.reason]
                for a in r.plan.actions
            ]
            print_table(obj.console, fitted_table(file_columns, files, width=obj.console.width, wide=wide,
                                                  title=f"{name}: files"))


_NOT_REACHED = "not reached: the rollout stopped before its batch; its patch, configuration and server are as before"


def _rollout_row(rollout: RolloutResult[Any], host: str) -> dict[str, Any]:
    gates = {n: v.as_dict() for n, v in rollout.gates.items() if n == host or n.split("/")[0] == host}
    return {"batch": rollout.plan.batch_of(host), "canary": host in rollout.plan.canary, "gates": gates,
            "rolled_back": host in rollout.rolled_back, "stopped": rollout.stopped}


def _diffs(obj: AppContext, host: Host, rs: RemoteState, bundle: Bundle, plan: HostPlan) -> list[str]:
    """Unified diffs of each file the plan changes: a replaced file against the remote
    original (one read per file), an added one against nothing (``/dev/null``, as git
    shows a new file), so that a bundle of new files does not show an empty diff.

    A patch ``patch -p1 -d SITE_PACKAGES`` (or ``git apply``) applies: each path is relative
    to the host's site-packages (``sglang/...``, the plugin's dist-info beside it), under
    ``HOST/`` on the old side and ``bundle/`` on the new, and a last line without its
    newline is marked as diff marks it (difflib does not: the next header would run on)."""
    out: list[str] = []
    if rs.package_dir is None:
        return out
    contents = {f.path: f.content for f in bundle.files}
    package = posixpath.basename(rs.package_dir.rstrip("/"))
    with transport_for(obj, host) as t:
        for a in plan.actions:
            if a.path not in contents or a.kind == "patched":
                continue
            rel = posixpath.normpath(posixpath.join(package, a.path))
            new = contents[a.path].decode("utf-8", "replace").splitlines(keepends=True)
            if a.current_sha256 is None:
                out.append(_unified(difflib.unified_diff([], new, "/dev/null", f"bundle/{rel}")))
                continue
            old = t.read_bytes(f"{rs.package_dir}/{a.path}").decode("utf-8", "replace").splitlines(keepends=True)
            out.append(_unified(difflib.unified_diff(old, new, f"{host.name}/{rel}", f"bundle/{rel}")))
    return out


def _unified(lines: Iterable[str]) -> str:
    """difflib's lines as a patch: a line without its newline (a file's last) ends with one
    and ``\\ No newline at end of file``, as diff(1) writes it."""
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def _print_diff(obj: AppContext, text: str) -> None:
    """A diff as it is: piped or redirected, byte for byte (a patch that applies: rich would
    wrap its long lines at 80 columns, each continuation without its ``+``); on a terminal,
    unwrapped too (the terminal folds a long line; its control characters shown escaped)."""
    file = obj.console.file
    if obj.console.is_terminal or getattr(file, "isatty", lambda: False)():
        obj.console.print(text, markup=False, highlight=False, end="", no_wrap=True, overflow="ignore", crop=False)
    else:
        obj.console.file.write(text)
        obj.console.file.flush()


@app.command("deploy")
@rollout_options()
def deploy_cmd(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="Host, group, comma list, or 'all'."),
    bundle_dir: Path | None = typer.Argument(None, help=_BUNDLE_HELP),
    bundle_opt: Path | None = typer.Option(
        None, "--bundle", help="The bundle directory as an option, as status and selftest take it."
    ),
    from_dir: Path | None = typer.Option(
        None, "--from", help="Overlay mode: local directory to copy over the package."
    ),
    to_dir: str | None = typer.Option(None, "--to", help="Overlay mode: package subdirectory, e.g. srt/speculative."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the plan; change nothing."),
    diff: bool = typer.Option(
        False, "--diff", help="Show unified diffs of replaced files vs the remote originals (implies --dry-run)."
    ),
    force: bool = typer.Option(False, "--force", help="Back up drifted files and overwrite them."),
    force_version: bool = typer.Option(
        False, "--force-version", help="Deploy to a package version the bundle was not made for."
    ),
    replace: bool = typer.Option(
        False, "--replace", help="Deploy over another applied bundle (its files this one does not patch are restored)."
    ),
    break_lock: bool = typer.Option(False, "--break-lock", help="Take over a lock held by another controller."),
    lock_wait: float = typer.Option(0.0, "--lock-wait", min=0.0, help="Seconds to wait for a busy host lock."),
    max_parallel: int | None = typer.Option(
        None, "--max-parallel", min=1, help="Hosts at once (default: global option)."
    ),
    wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
    restart: bool = typer.Option(False, "--restart", help="Restart the SGLang service after a successful apply."),
    budget: int | None = typer.Option(
        None, "--budget", min=1,
        help=f"DDTree budget for --restart (default {RESTART_BUDGET}, or a tuned policy's launch state).",
    ),
    topk: int | None = typer.Option(
        None, "--topk", min=1, help=f"DDTree top-k for --restart (default {RESTART_TOPK}, or the policy's)."
    ),
    rollout_args: RolloutArgs = RolloutArgs(),
) -> None:
    """Deploy a patch bundle (or a local overlay) into each host's SGLang site-packages.
    With --restart, --serial rolls the hosts in batches and --canary gates the rest on the first."""
    obj: AppContext = ctx.obj
    if bundle_dir is not None and bundle_opt is not None and bundle_dir != bundle_opt:
        raise ConfigError(f"two bundles: {bundle_dir} and --bundle {bundle_opt}; give one")
    bundle_dir = bundle_dir if bundle_dir is not None else bundle_opt
    if (from_dir is None) != (to_dir is None):
        raise ConfigError("--from and --to go together (overlay mode)")
    if from_dir is not None and bundle_dir is not None:
        raise ConfigError("give either a bundle directory or --from/--to, not both")
    args = rollout_args
    if (args.canary is not None or args.rollback_on_failure) and not restart:
        raise ConfigError("--canary and --rollback-on-failure judge restarted servers: add --restart")
    cancel = threading.Event()
    hosts = load_hosts(obj, target)
    plan = args.plan([h.name for h in hosts])
    opts = RunOptions(force=force, force_version=force_version, replace=replace, dry_run=dry_run or diff,
                      break_lock=break_lock, lock_wait_s=lock_wait)
    overlay = load_overlay(from_dir, to_dir) if from_dir is not None and to_dir is not None else None
    if overlay is not None and (args.canary is not None or args.rollback_on_failure):
        raise ConfigError("--canary and --rollback-on-failure put a bundle back; overlay mode (--from/--to) has none")
    bundle = None if overlay is not None else load_bundle(bundle_dir or DEFAULT_BUNDLE)
    restarter = _restarter(budget, topk) if restart else None
    gate = args.gate(plan, hosts, restarter.run) if restarter is not None else None
    diffs: dict[str, list[str]] = {}

    def after(t: Transport, h: Host, out: HostOutcome) -> None:
        if diff and out.state is not None:
            b = bundle if bundle is not None else overlay.bundle_for(out.state)  # type: ignore[union-attr]
            diffs[h.name] = _diffs(obj, h, out.state, b, out.plan)

    if overlay is not None:
        def one(h: Host) -> Deployed:
            with transport_for(obj, h) as t:
                out = deploy(t, h, overlay.factory, opts, paths=overlay.paths, cancel=cancel)
                after(t, h, out)
                if restarter is not None and out.outcome == "applied" and not cancel.is_set():
                    for server in h.slot_hosts():
                        restarter.restart(t, server, cancel)
                return Deployed(out)

        results = run_interruptible(hosts, one, max_parallel=max_parallel or obj.max_parallel, cancel=cancel)
        rollout = None
    else:
        assert bundle is not None
        change = DeployChange(bundle, opts, None if opts.dry_run else restarter, after=after)
        rollout = run_with_rollout(obj, hosts, change, plan, gate=gate, rollback_on_failure=args.rollback_on_failure,
                                   cancel=cancel, max_parallel=max_parallel, observe=not opts.dry_run)
        results = rollout.results
    title = "deploy (dry run)" if opts.dry_run else "deploy"
    if bundle is not None:
        title += f": {bundle.name} {bundle.version} {bundle.short_identity}"
    _render_outcomes(obj, title, results, show_files=opts.dry_run or obj.verbose > 0, wide=wide, rollout=rollout)
    if opts.dry_run and not obj.json:
        for line in rollout_lines(plan, gate):
            obj.console.print(line, markup=False, highlight=False, soft_wrap=True)
        if gate is not None:
            say_baseline_cost(obj, [h for h in hosts if h.name in plan.canary])
    if diff and not obj.json:
        for texts in diffs.values():
            for text in texts:
                _print_diff(obj, text)
    if rollout is not None and not opts.dry_run:
        render_rollout(obj, rollout)
    # A dry run exits as the run would: a plan the run refuses fails that host (exit 4).
    what = "deploy (dry run)" if opts.dry_run else "deploy"

    def refusal(value: Deployed) -> BaseException | None:
        return HostOutcome.refusal(value.outcome)

    if rollout is not None:
        raise_if_rollout_failed(what, rollout, cancel=cancel, failure=refusal)
    raise_if_failed(what, results, failure=refusal, cancel=cancel)


def _restarter(budget: int | None, topk: int | None) -> ServerRestarter:
    """The restart of ``deploy --restart``: a tuned policy on the machine is kept, as by
    `restart` (its launch state, unless the operator named a tree); without one, the
    defaults. Its run config is checked before any host is touched."""
    named = RunConfig(algorithm="DDTREE", budget=budget, topk=topk)
    run = replace_dc(named, budget=RESTART_BUDGET if budget is None else budget,
                     topk=RESTART_TOPK if topk is None else topk)
    return ServerRestarter(run, state=StateStore(), with_policy=named)


@app.command("rollback")
@rollout_options(gated=False)
def rollback_cmd(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="Host, group, comma list, or 'all'."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would be restored."),
    force: bool = typer.Option(
        False, "--force", help="Restore originals even over drifted files (drifted content is backed up)."
    ),
    break_lock: bool = typer.Option(False, "--break-lock", help="Take over a lock held by another controller."),
    lock_wait: float = typer.Option(0.0, "--lock-wait", min=0.0, help="Seconds to wait for a busy host lock."),
    max_parallel: int | None = typer.Option(
        None, "--max-parallel", min=1, help="Hosts at once (default: global option)."
    ),
    wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
    restart: bool = typer.Option(
        False, "--restart",
        help="Then restart each server without DDTree: a systemd unit on its operator's own ExecStart (our drop-in "
        "is removed either way), a server ddtree-ops runs as the target alone (AR).",
    ),
    rollout_args: RolloutArgs = RolloutArgs(),
) -> None:
    """Restore the original files on each host and clear the applied-bundle record; on a systemd
    host also remove ddtree-ops's drop-in (--restart: and restart the unit on its own ExecStart)."""
    obj: AppContext = ctx.obj
    hosts = load_hosts(obj, target)
    args = rollout_args
    refuse_without_undo(args, "rollback")
    plan = args.plan([h.name for h in hosts])
    opts = RunOptions(force=force, dry_run=dry_run, break_lock=break_lock, lock_wait_s=lock_wait)
    cancel = threading.Event()
    restarter = ServerRestarter(RunConfig("AR")) if restart and not dry_run else None
    change = RollbackChange(opts, restarter)
    rollout = run_with_rollout(obj, hosts, change, plan, gate=None, rollback_on_failure=False, cancel=cancel,
                               max_parallel=max_parallel, observe=not dry_run)
    _render_outcomes(
        obj, "rollback (dry run)" if dry_run else "rollback", rollout.results,
        show_files=dry_run or obj.verbose > 0, wide=wide, rollout=rollout,
    )
    if dry_run and not obj.json:
        for line in rollout_lines(plan, None):
            obj.console.print(line, markup=False, highlight=False, soft_wrap=True)
    else:
        render_rollout(obj, rollout)

    def refusal(value: RolledBack) -> BaseException | None:
        return HostOutcome.refusal(value.outcome)

    raise_if_rollout_failed("rollback (dry run)" if dry_run else "rollback", rollout, cancel=cancel,
                            failure=refusal)


def _service_json(svc: Any) -> dict[str, Any]:
    if isinstance(svc, BaseException):
        return {"ok": False, "error": error_text(svc)}
    return {
        "ok": True,
        "running": svc.running,
        "pid": svc.pid,
        "argv": list(svc.argv),
        "started_at": svc.started_at,
        "port_open": svc.port_open,
        "serving_ours": svc.serving_ours,
        "health": svc.health,
        "cuda_graph": svc.cuda_graph,
    }


def _places_text(host: str, places: dict[str, Any]) -> str:
    """The server column: the host's server, or each GPU slot's named (``sim-ct200/0: ...``)."""
    if list(places) == [host]:
        return _service_text(places[host])
    return "; ".join(f"{escape(place)}: {_service_text(svc)}" for place, svc in places.items())


def _service_text(svc: Any) -> str:
    """One cell: is the server we launched running, ready, on CUDA graphs?"""
    if isinstance(svc, BaseException):
        return f"[red]{escape(error_text(svc))}[/]"
    if not svc.running:
        return "stopped" + (" (port held by another process)" if svc.port_open else "")
    ready = "ready" if svc.health == 200 and svc.serving_ours else f"not ready (health {svc.health})"
    return f"pid {svc.pid}, {ready}, {graph_mode(svc.cuda_graph)}"


@app.command("status")
def status_cmd(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="Host, group, comma list, or 'all'."),
    bundle_dir: Path | None = typer.Option(
        None, "--bundle", help=f"Also classify this bundle's files ({_BUNDLE_DEFAULT})."
    ),
    max_parallel: int | None = typer.Option(
        None, "--max-parallel", min=1, help="Hosts at once (default: global option)."
    ),
    wide: bool = typer.Option(
        False, "--wide", help=WIDE_HELP
    ),
) -> None:
    """Per host: SGLang version, applied bundle, per-file state, leftover journal or lock."""
    obj: AppContext = ctx.obj
    hosts = load_hosts(obj, target)
    if bundle_dir is None and (DEFAULT_BUNDLE / "patch.yaml").is_file():
        bundle_dir = DEFAULT_BUNDLE
    bundle = load_bundle(bundle_dir) if bundle_dir is not None else None

    def one(h: Host) -> tuple[HostPatchStatus, Any]:
        with transport_for(obj, h) as t:
            patch = host_status(t, h, bundle=bundle)
            # The service section must never hide the patch section: its failure is shown
            # in its own column. One per server place: a host with GPU slots runs a server on
            # each slot's port, and its own port is slot 0's ("held by another process").
            places: dict[str, Any] = {}
            for place in h.slot_hosts():
                try:
                    places[place.name] = service_status(t, place, log_lines=0)
                except DdtreeOpsError as exc:
                    places[place.name] = exc
            return patch, places

    both = run_on_hosts(hosts, one, max_parallel=_parallel(obj, max_parallel))
    results = both.map(lambda r: r[0])
    services = {n: r[1] for n, r in both.succeeded.items()}
    failed, succeeded = results.failed, results.succeeded
    if obj.json:
        set_json_data(
            obj,
            [
                failure_row(n, failed[n])
                if n in failed
                else {"ok": True, **succeeded[n].to_json(),
                      # The first place's, as before slots; "servers": every place's.
                      "service": _service_json(next(iter(services[n].values()))),
                      "servers": [{"place": place, **_service_json(svc)} for place, svc in services[n].items()]}
                for n in results
            ],
        )
    else:
        # Words wrap at spaces and never break; what does not fit is dropped, and the caption
        # says which (--wide shows every column).
        columns = (
            TableColumn("host"), TableColumn("sglang", drop=3), TableColumn("bundle", wrap=True),
            TableColumn("applied", drop=2, wrap=True), TableColumn("files", wrap=True),
            TableColumn("leftovers", drop=1, wrap=True), TableColumn("server", wrap=True),
        )
        rows: list[list[str | Text]] = []
        for n in results:
            if n in failed:
                rows.append([n, "", "", "", Text("failed", style="red"), error_text(failed[n]), ""])
                continue
            r = succeeded[n]
            bundle_txt = escape(
                f"{r.bundle_name} {r.bundle_version} {(r.bundle_identity or '')[:12]}" if r.bundle_name else "-"
            )
            applied = escape(f"{_fmt_time(r.applied_at)} by {r.applied_by}") if r.bundle_name else "-"
            counts: dict[str, int] = {}
            for f in r.files:
                counts[f.state] = counts.get(f.state, 0) + 1
            files_txt = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "-"
            if r.outside_change is not None:
                # Named, not just coloured: deploy refuses this host until --force or rollback.
                outside = escape(r.outside_change.describe())
                files_txt = f"[bold yellow]changed outside ddtree-ops: {outside}[/] ({files_txt})"
            elif any(f.state in ("drifted", "missing") for f in r.files) or (r.bundle_name and not r.consistent):
                # A recorded bundle whose files are not all patched was changed outside ddtree-ops.
                files_txt = f"[yellow]{files_txt}[/]"
            left = []
            if r.journal:
                left.append(f"journal {str(r.journal.get('txn', '?'))[:12]} ({r.journal.get('phase', '?')})")
            if r.lock:
                left.append(
                    f"lock by {r.lock.get('user', '?')}@{r.lock.get('controller', '?')} pid {r.lock.get('pid', '?')}"
                )
            if r.state_error:
                left.append(f"state unreadable: {r.state_error}")
            version = escape(r.package_version) if r.package_version else "[red]not installed[/]"
            rows.append([n, Text.from_markup(version), Text.from_markup(bundle_txt), Text.from_markup(applied),
                         Text.from_markup(files_txt), "; ".join(left) or "-",
                         Text.from_markup(_places_text(n, services[n]))])
        print_table(obj.console, fitted_table(columns, rows, width=obj.console.width, wide=wide,
                                              title="patch and service status"))
        # The reason of a failed host, whatever columns the terminal dropped.
        for n, exc in failed.items():
            obj.console.print(Text(f"{n} ({type(exc).__name__}): {error_text(exc)}", style="red"))
        if obj.verbose:
            for n, r in results.succeeded.items():
                for f in r.files:
                    obj.console.print(
                        f"  {n} {f.path}: {f.state} {(f.sha256 or 'absent')[:12]}", markup=False, highlight=False
                    )
    raise_if_failed("status", results)
