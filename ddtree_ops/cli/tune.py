"""`ddtree-ops tune`: a ledger's best tree per machine type and concurrency -> the DDTREE
per-batch-size policy file, written (``--out``) and deployed (``--deploy``).

The choice is :mod:`ddtree_ops.report.policy` (pure), the deployment
:mod:`ddtree_ops.tuning`; this module checks options, renders and picks the exit code.
pandas is imported only when the command runs, like `report`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape
from rich.text import Text

from ddtree_ops.cli.common import (
    WIDE_HELP,
    TableColumn,
    check_output_path,
    error_text,
    fitted_table,
    fleet_json,
    graph_mode,
    load_hosts,
    print_table,
    printable,
    set_json_data,
    tok_s_column,
    transport_for,
    with_spread,
)
from ddtree_ops.cli.main import AppContext, app
from ddtree_ops.cli.rollout import (
    RolloutArgs,
    raise_if_rollout_failed,
    render_rollout,
    rollout_json,
    rollout_lines,
    rollout_options,
    run_with_rollout,
    say_baseline_cost,
)
from ddtree_ops.cli.service import _lease_pass, _Live, server_batches
from ddtree_ops.errors import ConfigError, Interrupted
from ddtree_ops.fleet import FleetResult
from ddtree_ops.inventory_types import Host
from ddtree_ops.rollout.executor import RolloutResult
from ddtree_ops.rollout.gate import GateSpec
from ddtree_ops.rollout.plan import RolloutPlan
from ddtree_ops.service.launch import RunConfig

if TYPE_CHECKING:
    from ddtree_ops.report.policy import Policy, Tuning
    from ddtree_ops.tuning import DeployedPolicy, PolicyFile


@app.command("tune")
@rollout_options()
def tune_command(
    ctx: typer.Context,
    ledgers: list[Path] | None = typer.Argument(
        None, help="Ledger files or folders (default: every *.jsonl under results/)."
    ),
    temperature: float = typer.Option(
        0.0, "--temperature", min=0.0,
        help="The sampling temperature the policy is tuned for: only cells measured at it are compared. "
        "Default 0 (greedy). The file keys trees by batch size only, so it holds one temperature.",
    ),
    machine: list[str] | None = typer.Option(
        None, "--machine", help="Only this machine type, as the report names it (repeatable; default: every one)."
    ),
    min_repeats: int | None = typer.Option(
        None, "--min-repeats",
        help="Refuse cells with fewer ok repeats (default: the repeats each ledger's sweep planned).",
    ),
    pool_runs: bool = typer.Option(
        False, "--pool-runs",
        help="Pool the ledgers' runs: the same cell of two runs becomes one cell. Default: a machine type's cells "
        "of two runs are refused.",
    ),
    run: list[str] | None = typer.Option(
        None, "--run", help="Only this run: its id, or a --resume's run id (repeatable; `report` lists the runs).",
    ),
    out: Path | None = typer.Option(None, "--out", help="Write one policy file per machine type into this folder."),
    deploy: str | None = typer.Option(
        None, "--deploy",
        help="Hosts (group, host, comma list, 'all') to put the policy of their machine type on, and restart with it.",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what --out / --deploy would do; change nothing."),
    timeout: float | None = typer.Option(
        None, "--timeout", min=1, help="--deploy: readiness deadline per launch (default: load-aware)."
    ),
    force: bool = typer.Option(
        False, "--force", help="--deploy: restart even while a sweep holds the host (its lease); says so on stderr."
    ),
    wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
    json_output: bool = typer.Option(False, "--json", help="Machine-readable JSON on stdout."),
    rollout_args: RolloutArgs = RolloutArgs(),
) -> None:
    """Turn a ledger's best DDTree tree per machine type and concurrency into the per-batch-size
    policy file (--speculative-adaptive-config), and deploy it: the file beside the bundle,
    the servers restarted with it, ready once they follow it. Later restarts keep it.

    Trees are compared at one temperature (--temperature, default 0) by output throughput,
    as `report` ranks them; eager and CUDA-graph cells never in one choice (graph cells
    where a machine type has any). No DDTREE rows for a machine type or temperature: exit 2.
    """
    obj: AppContext = ctx.obj
    obj.json = as_json = json_output or obj.json
    check_output_path("--out", out, directory=True)
    if (timeout is not None or force) and deploy is None:
        raise ConfigError("--timeout and --force apply to --deploy only")
    args = rollout_args
    if deploy is None and (args.serial is not None or args.canary is not None or args.rollback_on_failure):
        raise ConfigError("--serial, --canary and --rollback-on-failure apply to --deploy only")
    from ddtree_ops.report.policy import tune_ledgers

    tuning = tune_ledgers(list(ledgers or []), temperature=temperature, machines=machine or (),
                          min_repeats=min_repeats, pool_runs=pool_runs, runs=run or ())
    hosts = load_hosts(obj, deploy) if deploy is not None else []
    plan = args.plan([h.name for h in hosts])
    gate = args.gate(plan, hosts, _canary_launch(tuning, hosts, plan.canary))
    written = _write_policies(tuning, out) if out is not None and not dry_run else []
    payload: dict[str, Any] = {
        "files": [str(f) for f in tuning.files], "rows": tuning.rows, "bad_lines": tuning.bad_lines,
        "temperature": tuning.temperature, "min_repeats": tuning.min_repeats,
        "policies": [_policy_json(p) for p in tuning.policies], "dry_run": dry_run,
        "out": str(out) if out is not None else None, "written": [str(p) for p in written],
        "predicted_only": [dict(c) for c in tuning.predicted_only],
        "runs": [r.as_json() for r in tuning.runs], "pool_runs": tuning.pooled,
    }
    if not as_json:
        _render_policies(obj, tuning, wide=wide)
        if tuning.predicted_only:
            obj.console.print(f"{len(tuning.predicted_only)} DDTree cell(s) were predicted (bench --predict) but not "
                              "measured: tune chooses among measured cells only (report shows them, marked).",
                              markup=False, highlight=False)
        _render_writes(obj, tuning, out, written, dry_run=dry_run)
    if deploy is None:
        if as_json:
            set_json_data(obj, payload)
        elif out is None:
            # The policies above are shown, not kept: say so, and how to keep or use them.
            obj.console.print("Nothing written: --out DIR writes these files, --deploy TARGETS puts each machine "
                              "type's on its hosts and restarts them with it.", markup=False, highlight=False)
        return
    if dry_run:
        deploy_plan = _deploy_plan(tuning, hosts, _planned_files(obj, tuning, hosts))
        payload["deploy"] = deploy_plan
        payload["rollout"] = rollout_lines(plan, gate)
        if as_json:
            set_json_data(obj, payload)
        else:
            _render_plan(obj, deploy_plan, wide=wide)
            for line in rollout_lines(plan, gate):
                obj.console.print(line, markup=False, highlight=False, soft_wrap=True)
            if gate is not None:
                say_baseline_cost(obj, [h for h in hosts if h.name in plan.canary])
        return
    rollout, cancel = _deploy(obj, tuning, hosts, plan, gate, timeout=timeout, force=force,
                              rollback_on_failure=args.rollback_on_failure)
    results = rollout.results
    payload["deploy"] = fleet_json("tune --deploy", results, results.failed) | {"rollout": rollout_json(rollout)}
    if as_json:
        set_json_data(obj, payload)
    else:
        _render_deployed(obj, results, wide=wide)
        render_rollout(obj, rollout)
    if cancel.is_set():
        raise Interrupted("interrupted; each host was rolled back (see above)", failures=results.failed)
    raise_if_rollout_failed("tune --deploy", rollout, cancel=cancel)


def _canary_launch(tuning: Tuning, hosts: list[Host], canary: tuple[str, ...]) -> RunConfig:
    """The tree the canary will serve (its machine type's launch state, where the ledger
    says its type): what its gate's acceptance floor is read for."""
    from ddtree_ops.tuning import planned_target

    for host in hosts:
        if host.name in canary:
            target = planned_target(host, tuning.host_machines)
            policy = tuning.policy_for(target.machine_type) if target.machine_type else None
            if policy is not None:
                return RunConfig("DDTREE", budget=policy.launch.budget, topk=policy.launch.topk)
    return RunConfig("DDTREE")


def _write_policies(tuning: Tuning, out: Path) -> list[Path]:
    from ddtree_ops.fsutil import write_atomic_local, write_problem

    names = [p.file_name for p in tuning.policies]
    if len(set(names)) != len(names):
        raise ConfigError(f"--out {out}: two machine types share a file name ({', '.join(names)})")
    written = []
    for policy in tuning.policies:
        path = out / policy.file_name
        try:
            write_atomic_local(path, policy.render().encode())
        except OSError as exc:
            raise ConfigError(f"--out {out}: cannot write {path.name}: {write_problem(exc)}") from None
        written.append(path)
    return written


def _policy_json(policy: Policy) -> dict[str, Any]:
    return {
        "machine": policy.machine, "temperature": policy.temperature, "cuda_graph": policy.cuda_graph,
        "hosts": list(policy.hosts), "notes": list(policy.notes), "file_name": policy.file_name,
        "sha256": policy.sha256, "launch": {"budget": policy.launch.budget, "topk": policy.launch.topk},
        "run": policy.run,
        "entries": [vars(e) for e in policy.entries], "config": policy.config(),
    }


def _short_machine(name: str) -> str:
    return name.removeprefix("NVIDIA ").replace(" (simulated)", " (sim)")


def _num(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "—" if value is None else f"{value:,.{digits}f}{suffix}"


def _render_policies(obj: AppContext, tuning: Tuning, *, wide: bool) -> None:
    console = obj.console
    console.print(
        f"Read {tuning.rows:,} rows from {len(tuning.files)} ledger(s); DDTREE cells at temperature "
        f"{tuning.temperature:g}, min repeats {tuning.min_repeats}; score = median − 1.4826·MAD of output tok/s, "
        "within 1% the smaller tree.",
        highlight=False,
    )
    if tuning.bad_lines:
        console.print(f"[yellow]Skipped {tuning.bad_lines} bad line(s)[/] (`report` lists them).", highlight=False)
    if tuning.pooled_runs:
        console.print(f"Pooled {len(tuning.runs)} runs as repeats of their cells (--pool-runs): "
                      + "; ".join(printable(r.label) for r in tuning.runs), highlight=False, markup=False)
    labels = {r.run: r.label for r in tuning.runs}
    columns = (
        TableColumn("batch ≥", "right"), TableColumn("tree"),
        tok_s_column(e.n for p in tuning.policies for e in p.entries),
        TableColumn("n", "right", drop=2), TableColumn("accept len", "right", drop=3),
        TableColumn("vs AR", "right", drop=1), TableColumn("runner-up", wrap=True, drop=4),
    )
    for policy in tuning.policies:
        rows: list[list[str | Text]] = [[
            str(e.concurrency), Text(f"b={e.budget} k={e.topk}", style="bold green"),
            with_spread(_num(e.output_tok_s), _num(e.output_tok_s_mad), e.n), str(e.n),
            _num(e.accept_length, 2),
            _num(e.speedup_vs_ar, 2, "x"), e.runner_up or "—",
        ] for e in policy.entries]
        title = (f"Policy — {_short_machine(policy.machine)} (mode {graph_mode(policy.cuda_graph)}; "
                 f"hosts {', '.join(policy.hosts)})")
        print_table(console, fitted_table(columns, rows, width=console.width, wide=wide, title=title))
        for note in [*policy.notes, *(f"batch {e.concurrency}: {e.note}" for e in policy.entries if e.note)]:
            console.print(f"  note: {note}", highlight=False, markup=False)
        console.print(f"  launch state: b={policy.launch.budget} k={policy.launch.topk} (the smallest batch's tree)",
                      highlight=False, markup=False)
        if policy.run is not None and len(tuning.runs) > 1:  # which of the ledgers' runs it comes from
            console.print(f"  from {printable(labels.get(policy.run, f'run {policy.run}'))}", highlight=False,
                          markup=False)
        console.print(f"  {policy.file_name} (sha256 {policy.sha256[:12]}):", highlight=False, markup=False)
        console.print(policy.render().rstrip(), highlight=False, markup=False)


def _render_writes(obj: AppContext, tuning: Tuning, out: Path | None, written: list[Path], *, dry_run: bool) -> None:
    if out is None:
        return
    if dry_run:
        for policy in tuning.policies:
            obj.console.print(f"Would write {out / policy.file_name}", highlight=False, markup=False)
        return
    for path in written:
        obj.console.print(f"Wrote {path}", highlight=False, markup=False)


def _planned_files(obj: AppContext, tuning: Tuning, hosts: list[Host]) -> dict[str, PolicyFile | str]:
    """Per host, the file --deploy would place (probed as the deploy probes it, changing
    nothing: its sha256 is the placed file's, eager budgets included), or why it cannot be said."""
    from concurrent.futures import ThreadPoolExecutor

    from ddtree_ops.errors import DdtreeOpsError
    from ddtree_ops.state import StateStore
    from ddtree_ops.tuning import policy_file

    state = StateStore()

    def one(host: Host) -> PolicyFile | str:
        try:
            with transport_for(obj, host) as transport:
                return policy_file(transport, host, tuning.policies, tuning.host_machines, state=state)
        except DdtreeOpsError as exc:
            return exc.message
    if not hosts:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(hosts)), thread_name_prefix="tune-plan") as pool:
        return dict(zip((h.name for h in hosts), pool.map(one, hosts), strict=True))


def _deploy_plan(tuning: Tuning, hosts: list[Host], files: dict[str, PolicyFile | str]) -> list[dict[str, Any]]:
    """What --deploy would do per host: the ledger's machine type and policy, and the file
    each host would get (``files``: its text's sha256, its eager budgets, the launch state),
    or why not (``problem``)."""
    from ddtree_ops.patching.placed import POLICY_FILE
    from ddtree_ops.tuning import planned_target

    plan: list[dict[str, Any]] = []
    for host in hosts:
        target = planned_target(host, tuning.host_machines)
        planned = files.get(host.name)
        found = planned if not isinstance(planned, str) else None
        policy = found.policy if found is not None else (
            tuning.policy_for(target.machine_type) if target.machine_type else None)
        machine_type = found.policy.machine if found is not None else target.machine_type
        learned = found.learned_from if found is not None else (
            target.learned_from if target.machine_type else "probe at deploy")
        problem = None
        if found is None:
            problem = (planned if isinstance(planned, str) else None) or (
                f"machine type {target.machine_type} has no tuned policy" if policy is None and target.machine_type
                else None)
        launch = ({"budget": found.launch_budget, "topk": found.policy.launch.topk} if found is not None
                  else None if policy is None else {"budget": policy.launch.budget, "topk": policy.launch.topk})
        plan.append({
            "host": host.name,
            "servers": [s.name for s in host.slot_hosts()],
            "machine_type": machine_type,
            "learned_from": learned,
            "file": f"<sys.prefix of {host.python}>/.ddtree-ops/placed/{POLICY_FILE}",
            "policy": policy.file_name if policy is not None else None,
            "policy_map": policy.policy_map() if policy is not None else None,
            "launch": launch,
            # The placed file's own sha256 (what --deploy writes there), and the budgets it
            # lists as eager (the machine's recorded capture failures); null where not known.
            "sha256": found.sha256 if found is not None else None,
            "eager_budgets": list(found.eager_budgets) if found is not None else None,
            "problem": problem,
        })
    return plan


def _render_plan(obj: AppContext, plan: list[dict[str, Any]], *, wide: bool) -> None:
    from ddtree_ops.patching.placed import POLICY_FILE

    columns = (
        TableColumn("host", wrap=True), TableColumn("servers", wrap=True, drop=1),
        TableColumn("machine type", wrap=True), TableColumn("policy (batch ≥: tree)", wrap=True),
        TableColumn("launch", wrap=True),
    )
    rows: list[list[str | Text]] = []
    for p in plan:
        launch = p["launch"]
        machine = f"{_short_machine(p['machine_type'] or '?')} ({p['learned_from']})"
        policy = p["policy_map"]
        tree: str | Text = (
            ", ".join(f"{bs}: b={e['budget']} k={e['topk']}" for bs, e in policy.items()) if policy
            else Text(p["problem"] or "decided by the probe's GPU", style="yellow")
        )
        rows.append([p["host"], ", ".join(p["servers"]), machine, tree,
                     f"b={launch['budget']} k={launch['topk']}" if launch else "—"])
    caption = (f"The file goes to <sys.prefix of the host's python>/.ddtree-ops/placed/{POLICY_FILE}; each server "
               "restarts with --speculative-adaptive-config FILE at the launch state.")
    print_table(obj.console, fitted_table(columns, rows, width=obj.console.width, wide=wide, caption=caption,
                                          title="tune --deploy (dry run): nothing changed"))
    for p in plan:
        if p["sha256"] is None:
            continue
        eager = (f"; eager_budgets {p['eager_budgets']} (recorded capture failures on this machine)"
                 if p["eager_budgets"] else "")
        obj.console.print(f"{p['host']}: the file placed: sha256 {p['sha256'][:12]}{eager}", markup=False,
                          highlight=False, soft_wrap=True)


def _deploy(
    obj: AppContext, tuning: Tuning, hosts: list[Host], plan: RolloutPlan, gate: GateSpec | None, *,
    timeout: float | None, force: bool, rollback_on_failure: bool,
) -> tuple[RolloutResult[DeployedPolicy], threading.Event]:
    from ddtree_ops.rollout.changes import PolicyChange, RestartSettings, ServerRestarter
    from ddtree_ops.service.smoke import SmokeSampling, SmokeSpec
    from ddtree_ops.state import StateStore

    state = StateStore()
    cancel = threading.Event()
    # The smoke decodes at the temperature tuned for as well: the sampled verify path is
    # what the policy will serve at it.
    samplings = [SmokeSampling.of(tuning.temperature)] if tuning.temperature > 0 else []
    smoke = SmokeSpec.for_samplings(samplings)
    board = _Live([s.name for h in hosts for s in h.slot_hosts()], server_batches(plan, hosts))
    restarter = ServerRestarter(
        RunConfig("DDTREE"), RestartSettings(timeout=timeout, smoke=smoke), state=state,
        lease=lambda t, h: _lease_pass(t, h, force=force), on_phase=board.on_phase,
    )
    change = PolicyChange(tuning.policies, tuning.host_machines, restarter,
                          launch=_canary_launch(tuning, hosts, plan.canary))
    rollout = run_with_rollout(obj, hosts, change, plan, gate=gate, rollback_on_failure=rollback_on_failure,
                               cancel=cancel, board=board)
    for name in rollout.results.succeeded:
        for server in next(h for h in hosts if h.name == name).slot_hosts():
            board.done(server.name, "[green]policy active[/]")
    return rollout, cancel


def _render_deployed(obj: AppContext, results: FleetResult[DeployedPolicy], *, wide: bool) -> None:
    """One row per server (a host's GPU slots each have one), then per host its file."""
    columns = (
        TableColumn("server", wrap=True), TableColumn("status"), TableColumn("machine type", wrap=True, drop=2),
        TableColumn("launch"), TableColumn("mode"), TableColumn("pid", "right", drop=1),
        TableColumn("ready", "right"),
    )
    rows: list[list[str | Text]] = []
    for name, value in results.items():
        if isinstance(value, BaseException):
            rows.append([name, Text("FAILED", style="bold red"), "", "", "", "", ""])
            continue
        for r in value.servers:
            rows.append([r.host, Text("policy active", style="green"), _short_machine(value.machine_type),
                         f"b={value.budget} k={value.topk}", graph_mode(r.cuda_graph), str(r.pid),
                         f"{r.ready_s:.1f}s"])
    print_table(obj.console, fitted_table(columns, rows, width=obj.console.width, wide=wide, title="tune --deploy",
                                          caption="ready: launch → the smoke passed and the policy is active."))
    for name, value in results.succeeded.items():
        what = "replaced the previous one" if value.replaced else "new"
        obj.console.print(
            f"{name}: {value.path} ({what}, sha256 {value.sha256[:12]}; machine type from the {value.learned_from})",
            highlight=False, markup=False, soft_wrap=True,
        )
    for name, exc in results.failed.items():
        obj.console.print(Text(f"{name} ({type(exc).__name__}): {error_text(exc)}", style="red"))
    if results.succeeded:
        obj.console.print(
            f"Remembered: later DDTREE restarts of {escape(', '.join(results.succeeded))} launch with the policy "
            "(`restart --no-policy` drops it).", highlight=False,
        )
