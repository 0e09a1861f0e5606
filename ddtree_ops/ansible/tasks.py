"""The collection's four tasks, each the CLI's own code on one host (package docstring).

Every task returns the result an Ansible module returns (a JSON-ready dict: ``changed``,
``failed``, ``msg`` and its own keys); none raises for the host's failure, which is said in
the result with the error's stable ``code`` and the CLI's exit code for it. ``changed`` is
drawn from what was observed, as the CLI's closing observation is (design.md §10):

* :func:`bundle` is ``deploy`` / ``rollback`` on one host: the same plan, journal, guards and
  verify steps, then the host observed again (the bundle must be seen in place, or the
  originals back). Changed only when files changed (or a left-over journal was recovered);
  check mode is ``--dry-run``; diff mode gives each changed file's before and after.
* :func:`server` is ``deploy --restart``'s restart: each server place converged on the
  launch (restarted only where :func:`~ddtree_ops.service.observed.mismatch` says it does
  not serve it, ready), with the readiness wait, the speculative smoke and the eager
  fallback inside the task; or restarted, stopped, or put back to what ran before.
* :func:`gate` is the canary gate, split in two tasks around the change: ``baseline``
  records each server's answers on the host, ``judge`` asks again and fails when the gate
  does.
* :func:`facts` is the host as observed (bundle, each server, its previous launch) as facts.

What the toolkit learns about the host (load times, eager fallbacks) is kept on the host
(:mod:`.hoststate`).
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ddtree_ops.ansible.hoststate import host_state
from ddtree_ops.errors import (
    AuthError,
    ConfigError,
    ConnectError,
    DdtreeOpsError,
    HostKeyError,
    RemoteFileError,
    ServiceError,
)
from ddtree_ops.inventory.values import printable
from ddtree_ops.inventory_types import Host
from ddtree_ops.limits import MAX_DDTREE_BUDGET, MAX_DFLASH_DRAFT_TOKENS
from ddtree_ops.patching.bundle import Bundle, load_bundle
from ddtree_ops.patching.executor import HostOutcome, RunOptions, RunOutcome, deploy, rollback
from ddtree_ops.patching.plan import FileAction, HostPlan
from ddtree_ops.rollout.changes import (
    DeployChange,
    Deployed,
    RestartSettings,
    RollbackChange,
    RolledBack,
    ServerRestarter,
)
from ddtree_ops.rollout.executor import HostChange, capture_baseline, check_gate, run_rollout
from ddtree_ops.rollout.gate import Floor, GateAnswer, GateSpec, GateVerdict, ledger_floors
from ddtree_ops.rollout.observe import HostSnapshot, observe_host, observe_place
from ddtree_ops.rollout.plan import plan_rollout
from ddtree_ops.service import lifecycle
from ddtree_ops.service.launch import CudaGraphMode, RunConfig, parse_algorithm
from ddtree_ops.service.manager import LeasePass
from ddtree_ops.service.observed import OBSERVE_SMOKE, mismatch, observe_server
from ddtree_ops.service.readiness import served_tree
from ddtree_ops.service.smoke import SmokeSampling, SmokeSpec
from ddtree_ops.shipped import DEFAULT_BUNDLE
from ddtree_ops.transport.base import Transport

Result = dict[str, Any]

# The tree ``deploy --restart`` launches where neither the task nor a tuned policy names
# one: the CLI's RESTART_BUDGET / RESTART_TOPK (cli/deploy.py; a test holds them equal).
RESTART_BUDGET = 16
RESTART_TOPK = 4
# What the gate's baseline task leaves on the host for its judge task.
BASELINE_FILE = "gate-baseline.json"
# Unreachable, in Ansible's sense: the host was not talked to (a timed-out command or a
# failed file operation was: those fail the task).
_UNREACHABLE = (ConnectError, AuthError, HostKeyError)


@dataclass(frozen=True)
class TaskContext:
    """One task on one host: its transport, the host, and Ansible's modes."""

    transport: Transport
    host: Host
    check_mode: bool = False
    diff: bool = False
    # Ansible's MAX_FILE_SIZE_FOR_DIFF: a larger file is named in the diff, not shown.
    max_diff_bytes: int = 104448


def one_line(text: str) -> str:
    """A message for Ansible's output: one line, any control character escaped."""
    return printable(" ".join(str(text).split()))


def failure(exc: BaseException, **extra: Any) -> Result:
    """The result of a task that failed on its host: the error's one line, its stable code
    and the exit code the CLI gives it; ``unreachable`` where the host was not reached."""
    if isinstance(exc, DdtreeOpsError):
        # Ansible reports a result that is both failed and unreachable as failed.
        status = "unreachable" if isinstance(exc, _UNREACHABLE) else "failed"
        out: Result = {status: True, "msg": one_line(str(exc)), "error": exc.code, "exit_code": exc.exit_code}
    else:
        out = {"failed": True, "msg": one_line(f"{type(exc).__name__}: {exc}"), "error": "internal", "exit_code": 1}
    out.setdefault("changed", False)
    return {**out, **extra}


def _one_host(ctx: TaskContext, change: HostChange[Any, Any], *, observe: bool) -> tuple[Any, HostSnapshot | None]:
    """``change`` on the task's host as the CLI runs it on each target: its checks first,
    then the change, then (``observe``) the host observed and the change's report judged
    against it. The value, or the exception, and the snapshot."""
    host = ctx.host
    result = run_rollout(plan_rollout([host.name]), {host.name: host}, change, connect=lambda _h: ctx.transport,
                         max_parallel=1, observe=observe)
    value = dict(result.results)[host.name]
    return value, result.observed.get(host.name)


# ---------------------------------------------------------------------------- bundle


def _plan_files(plan: HostPlan) -> list[dict[str, Any]]:
    return [{"path": a.path, "action": a.kind, "current_sha256": a.current_sha256, "new_sha256": a.new_sha256,
             "reason": a.reason} for a in plan.actions]


def _text(data: bytes | None, limit: int) -> str | None:
    """A file's content for the diff; None where it cannot be shown as text."""
    if data is None:
        return ""
    if len(data) > limit or b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _file_diffs(ctx: TaskContext, plan: HostPlan, package_dir: str | None, new: Mapping[str, bytes],
                read_after: Callable[[FileAction], bytes | None]) -> list[dict[str, Any]]:
    """Ansible's diff for each file ``plan`` changes: before (read from the host) and after,
    named as ``deploy --diff`` names them (relative to site-packages)."""
    out: list[dict[str, Any]] = []
    if package_dir is None:
        return out
    package = posixpath.basename(package_dir.rstrip("/"))
    for a in plan.changes:
        rel = posixpath.normpath(posixpath.join(package, a.path))
        before = ctx.transport.read_bytes(f"{package_dir}/{a.path}") if a.current_sha256 is not None else None
        after = new.get(a.path) if a.path in new else read_after(a)
        shown_before = _text(before, ctx.max_diff_bytes)
        shown_after = _text(after, ctx.max_diff_bytes)
        entry: dict[str, Any] = {"before_header": f"{ctx.host.name}/{rel}" if before is not None else "/dev/null",
                                 "after_header": f"{a.kind}/{rel}" if after is not None else "/dev/null"}
        if shown_before is None or shown_after is None:
            entry |= {"before": "", "after": f"{rel}: {a.kind} (binary or larger than {ctx.max_diff_bytes} bytes)\n"}
        else:
            entry |= {"before": shown_before, "after": shown_after}
        out.append(entry)
    return out


def _bundle_keys(b: Bundle) -> dict[str, Any]:
    return {"name": b.name, "version": b.version, "identity": b.identity}


def bundle(ctx: TaskContext, *, state: str = "present", bundle_dir: str | None = None, force: bool = False,
           force_version: bool = False, replace_other: bool = False, break_lock: bool = False,
           lock_wait: float = 0.0) -> Result:
    """``deploy`` (state present) or ``rollback`` (absent) of one host (module docstring)."""
    opts = RunOptions(force=force, force_version=force_version, replace=replace_other, dry_run=ctx.check_mode,
                      break_lock=break_lock, lock_wait_s=lock_wait)
    try:
        if state == "present":
            return _bundle(ctx, load_bundle(Path(bundle_dir) if bundle_dir else DEFAULT_BUNDLE), opts, None)
        # A rollback forgets the machine's tuned policy (its file goes with the bundle).
        with host_state(ctx.transport, ctx.host) as store:
            return _bundle(ctx, None, opts, RollbackChange(opts, None, state=store))
    except DdtreeOpsError as exc:
        return failure(exc)


def _bundle(ctx: TaskContext, b: Bundle | None, opts: RunOptions, rollback_change: RollbackChange | None) -> Result:
    t, host = ctx.transport, ctx.host
    diffs: list[dict[str, Any]] = []
    if ctx.diff:
        # Read before anything changes: a replaced file's previous content is gone after.
        planned = (deploy(t, host, b, replace(opts, dry_run=True)) if b is not None
                   else rollback(t, host, replace(opts, dry_run=True)))
        if planned.outcome is RunOutcome.PLANNED and planned.state is not None:
            new = {f.path: f.content for f in b.files} if b is not None else {}

            def backup(a: FileAction) -> bytes | None:
                return t.read_bytes(a.original_backup) if a.kind == "restore" and a.original_backup else None

            diffs = _file_diffs(ctx, planned.plan, planned.state.package_dir, new, backup)
    dropins_before = _dropins_in_effect(t, host) if b is None and not ctx.check_mode else 0
    change: HostChange[Any, Any]
    if b is not None:
        change = DeployChange(b, opts, None)
    else:
        assert rollback_change is not None
        change = rollback_change
    value, snapshot = _one_host(ctx, change, observe=not ctx.check_mode)
    extra: Result = {"observed": snapshot.as_dict()} if snapshot is not None else {}
    if b is not None:
        extra["bundle"] = _bundle_keys(b)
    if isinstance(value, BaseException):
        return failure(value, **extra)
    assert isinstance(value, (Deployed, RolledBack))
    out: HostOutcome = value.outcome
    refusal = out.refusal()
    if refusal is not None:  # check mode: the run would refuse the host
        return failure(refusal, outcome=out.outcome.value, plan=_plan_files(out.plan), **extra)
    changed = out.outcome in (RunOutcome.APPLIED, RunOutcome.ROLLED_BACK, RunOutcome.PLANNED) \
        or out.recovered is not None
    notes = list(value.servers) if isinstance(value, RolledBack) else []
    if b is None and dropins_before:
        changed = True  # our drop-in taken off a systemd unit, as `rollback` does
    result: Result = {
        "changed": changed, "outcome": out.outcome.value, "msg": one_line(out.message), "txn": out.txn,
        "recovered": out.recovered, "plan": _plan_files(out.plan), "package_version": out.plan.package_version,
        "notes": [one_line(n) for n in (*out.notes, *notes)], **extra,
    }
    if diffs and changed:
        result["diff"] = diffs
    return result


def _dropins_in_effect(t: Transport, host: Host) -> int:
    """How many of ``host``'s systemd servers run our drop-in now (a rollback removes it)."""
    count = 0
    for server in host.slot_hosts():
        if server.ddtree.server.manager == "systemd":
            view = observe_place(t, server, smoke=None)
            count += bool(view.unit is not None and view.unit.dropin_in_effect)
    return count


# ---------------------------------------------------------------------------- server


def run_config(*, algorithm: str, budget: int | None, topk: int | None, eager: bool,
               extra_args: Sequence[str]) -> tuple[RunConfig, RunConfig | None]:
    """What the server task launches, as ``deploy --restart`` decides it for DDTREE (the
    tree named, else a tuned policy's launch state, else budget 16 top-k 4), as ``restart
    --algorithm`` for the others: (the launch without a policy, the one with a policy)."""
    cuda_graph: CudaGraphMode = "off" if eager else "auto"
    named = RunConfig(algorithm=parse_algorithm(algorithm), budget=budget, topk=topk, cuda_graph=cuda_graph,
                      extra_args=tuple(extra_args))
    if named.algorithm != "DDTREE":
        return named, None
    run = replace(named, budget=RESTART_BUDGET if budget is None else budget,
                  topk=RESTART_TOPK if topk is None else topk)
    return run, named


@dataclass(frozen=True)
class ServerDone:
    """What the server task did on one server place, and how it serves now."""

    server: str
    action: str  # restarted, unchanged, stopped, already stopped, put back, untouched
    detail: str
    pid: int | None = None
    cuda_graph: bool | None = None
    fallback_reason: str | None = None
    attempts: int | None = None
    load_s: float | None = None
    ready_s: float | None = None

    @classmethod
    def of(cls, server: str, result: lifecycle.ServerOutcome) -> ServerDone:
        if isinstance(result, lifecycle.Unchanged):
            return cls(server, "unchanged", result.describe(), pid=result.pid)
        graphs = "" if result.cuda_graph else ", eager"
        return cls(server, "restarted", f"restarted ({result.run}{graphs}, pid {result.pid})", pid=result.pid,
                   cuda_graph=result.cuda_graph, fallback_reason=result.fallback_reason, attempts=result.attempts,
                   load_s=result.load_s, ready_s=result.ready_s)

    @property
    def changed(self) -> bool:
        return self.action in ("restarted", "stopped", "put back")


class _Converge(HostChange[tuple[ServerDone, ...], None]):
    """Each server place of the host converged on the launch (or always restarted), with
    the CLI's checks first (unit, lease, the launch built) and its closing judgement."""

    def __init__(self, restarter: ServerRestarter, *, always: bool) -> None:
        self.restarter, self.always, self.run = restarter, always, restarter.run

    def check(self, transport: Transport, host: Host) -> None:
        for server in host.slot_hosts():
            self.restarter.check(transport, server)

    def remember(self, transport: Transport, host: Host) -> None:
        return None

    def apply(self, transport: Transport, host: Host, cancel: threading.Event) -> tuple[ServerDone, ...]:
        return tuple(ServerDone.of(s.name, self.restarter.restart(transport, s, cancel, converge=not self.always))
                     for s in host.slot_hosts())

    def observe(self, transport: Transport, host: Host) -> HostSnapshot:
        return observe_host(transport, host, patch=False, smoke=OBSERVE_SMOKE)

    def verify(self, host: Host, snapshot: HostSnapshot, value: tuple[ServerDone, ...]) -> DdtreeOpsError | None:
        problem = self.restarter.verify(snapshot, host.slot_hosts())
        return None if problem is None else ServiceError(f"observed after the restart: {problem}", host=host.name)

    def undo(self, transport: Transport, host: Host, before: None) -> str:
        return "nothing put back"

    def gate_error(self, message: str, host: str) -> DdtreeOpsError:
        return ServiceError(message, host=host)


def _lease(force: bool) -> Callable[[Transport, Host], LeasePass]:
    def lease(_t: Transport, _h: Host) -> LeasePass:
        return LeasePass(force=force)

    return lease


def server(ctx: TaskContext, *, state: str = "started", algorithm: str = "DDTREE", budget: int | None = None,
           topk: int | None = None, eager: bool = False, extra_args: Sequence[str] = (), policy: bool = True,
           retry_cuda_graph: bool = False, timeout: float | None = None, grace: float = 30.0, smoke: bool = True,
           smoke_temperatures: Sequence[float] = (), keep_on_failure: bool = False, force: bool = False,
           previous: Mapping[str, Any] | None = None) -> Result:
    """The host's servers started (converged), restarted, stopped, or put back (module docstring)."""
    try:
        restarter: Callable[[Any], ServerRestarter] | None = None
        if state in ("started", "restarted"):
            # Built before the host is touched: a launch the CLI would refuse is refused here too.
            run, with_policy = run_config(algorithm=algorithm, budget=budget, topk=topk, eager=eager,
                                          extra_args=extra_args)
            samplings = tuple(SmokeSampling.of(t) for t in smoke_temperatures)
            settings = RestartSettings(timeout=timeout, retry_cuda_graph=retry_cuda_graph, stop_grace_s=grace,
                                       smoke=SmokeSpec.for_samplings(samplings) if smoke else None,
                                       keep_on_failure=keep_on_failure, use_policy=policy)

            def restarter(store: Any) -> ServerRestarter:
                return ServerRestarter(run, settings, state=store, lease=_lease(force),
                                       with_policy=with_policy if policy else None,
                                       machines={ctx.host.name: ctx.host})

        with host_state(ctx.transport, ctx.host) as store:
            if restarter is not None:
                if ctx.check_mode:
                    return _would_start(ctx, restarter(store), always=state == "restarted")
                return _converge(ctx, restarter(store), always=state == "restarted")
            if state == "stopped":
                return _stop(ctx, grace=grace, force=force)
            return _put_back(ctx, previous or {}, store=store, grace=grace, force=force)
    except DdtreeOpsError as exc:
        return failure(exc)


def _converge(ctx: TaskContext, restarter: ServerRestarter, *, always: bool) -> Result:
    value, snapshot = _one_host(ctx, _Converge(restarter, always=always), observe=True)
    extra: Result = {"observed": snapshot.as_dict()} if snapshot is not None else {}
    if isinstance(value, BaseException):
        # A restart that failed still changed the host (the old server was stopped).
        return failure(value, changed=not isinstance(value, ConfigError), **extra)
    done: tuple[ServerDone, ...] = value
    return {"changed": any(d.changed for d in done),
            "msg": one_line("; ".join(f"{d.server}: {d.detail}" for d in done)),
            "servers": [asdict(d) for d in done], "run": restarter.run.describe(), **extra}


def _would_start(ctx: TaskContext, restarter: ServerRestarter, *, always: bool) -> Result:
    """Check mode: what ``started`` would do, from the same checks and the same observation
    and convergence rule, without a change (a launch the real run would refuse fails here too)."""
    t, host = ctx.transport, ctx.host
    would = []
    for server in host.slot_hosts():
        # As the CLI's dry run of ``deploy --restart``: the DDTree plugin is taken to be
        # deployed by the play's bundle task, which check mode did not run either.
        restarter.check(t, server, deployed_later=True)
        request = restarter.request(t, server, refresh_policy=False, deployed_later=True)
        spec = lifecycle.first_launch(request, restarter.state)
        view = observe_server(lifecycle.manager_for(t, server), smoke=request.smoke)
        policy = request.tree_policy.policy if request.tree_policy is not None else None
        why = "restarted on request" if always else mismatch(view, spec, policy=policy)
        would.append({"server": server.name, "action": "would restart" if why else "unchanged",
                      "detail": one_line(why or f"already serving {view.served()} (pid {view.pid})")})
    return {"changed": any(w["action"] != "unchanged" for w in would),
            "msg": one_line("; ".join(f"{w['server']}: {w['action']} ({w['detail']})" for w in would)),
            "servers": would, "run": restarter.run.describe()}


def _stop(ctx: TaskContext, *, grace: float, force: bool) -> Result:
    done = []
    for server in ctx.host.slot_hosts():
        if ctx.check_mode:
            view = observe_place(ctx.transport, server, smoke=None)
            done.append(ServerDone(server.name, "would stop" if view.running else "already stopped", view.describe(),
                                   pid=view.pid))
            continue
        stopped = lifecycle.stop(ctx.transport, server, grace_s=grace, lease=LeasePass(force=force))
        done.append(ServerDone(server.name, "stopped" if stopped.was_running else "already stopped",
                               f"stopped pid {stopped.pid} ({stopped.signal})" if stopped.was_running
                               else "no server ran", pid=stopped.pid))
    return {"changed": any(d.changed or d.action == "would stop" for d in done),
            "msg": one_line("; ".join(f"{d.server}: {d.detail}" for d in done)), "servers": [asdict(d) for d in done]}


def previous_servers(t: Transport, host: Host) -> dict[str, dict[str, Any]]:
    """What runs on each server place now, as the ``previous`` a later ``state: previous``
    puts back (the CLI's remember, before a change)."""
    return {s.name: _jsonable(asdict(lifecycle.remember_server(t, s))) for s in host.slot_hosts()}


def _previous_of(name: str, raw: Any) -> lifecycle.PreviousServer:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"previous: no record for {name} (give the facts task's ddtree_ops.previous, taken before "
                          f"the change)")
    known = {f.name for f in dataclasses.fields(lifecycle.PreviousServer)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"previous.{name}: unknown key {unknown[0]!r}")
    values = dict(raw)
    values["argv"] = tuple(str(a) for a in values.get("argv") or ())
    try:
        return lifecycle.PreviousServer(**values)
    except TypeError as exc:
        raise ConfigError(f"previous.{name}: {exc}") from None


def _put_back(ctx: TaskContext, previous: Mapping[str, Any], *, store: Any, grace: float, force: bool) -> Result:
    """Each server place relaunched as it ran before (``previous``), as the CLI's undo does:
    left alone where what runs now is what ran then."""
    servers = ctx.host.slot_hosts()
    before = {s.name: _previous_of(s.name, previous.get(s.name)) for s in servers}
    if ctx.check_mode:
        same = {s.name: lifecycle.remember_server(ctx.transport, s) == before[s.name] for s in servers}
        return {"changed": not all(same.values()), "servers": [
            {"server": n, "action": "untouched" if ok else "would put back", "detail": before[n].describe()}
            for n, ok in same.items()], "msg": "check mode: nothing put back"}
    restarter = ServerRestarter(RunConfig("AR"), RestartSettings(stop_grace_s=grace), state=store,
                                lease=_lease(force))
    phrases = restarter.put_back(ctx.transport, servers, before)
    failed = [p for p in phrases if "NOT put back" in p]
    changed = any(not p.endswith(" untouched") for p in phrases)
    if failed:
        return {"failed": True, "changed": changed, "msg": one_line("; ".join(failed)), "error": "service",
                "exit_code": ServiceError.exit_code, "servers": phrases}
    return {"changed": changed, "msg": one_line("; ".join(phrases)), "servers": phrases}


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=list))


# ---------------------------------------------------------------------------- gate


def gate_spec(*, agreement: float, tie_epsilon: float, min_speed: float, accept_floor: float | None,
              temperature: float, ledgers: Sequence[str], host: Host, run: RunConfig) -> GateSpec:
    """The canary gate of ``--canary`` with the same options (its floors from
    ``accept_floor``, else from the ledgers' rows of the canary's machine type and tree)."""
    temperatures = (0.0, temperature)
    if accept_floor is not None and run.algorithm == "AR":
        raise ConfigError("ddtree.ops.gate: accept_floor: the change serves AR, which does not speculate: there is no "
                          "acceptance to judge")
    if accept_floor is not None:
        floors = {t: Floor(accept_floor, "accept_floor") for t in temperatures}
    elif ledgers:
        from ddtree_ops.bench.ledger import read_ledger
        from ddtree_ops.report.loading import find_ledgers

        rows = [row for path in find_ledgers([Path(p) for p in ledgers]) for row in read_ledger(path).rows]
        types = [r.get("gpu_name") for r in rows if r.get("host") == host.machine and r.get("status") == "ok"]
        machine_type = types[-1] if types and isinstance(types[-1], str) else None
        floors = ledger_floors(rows, machine_type=machine_type, run=run, temperatures=temperatures)
    else:
        floors = {}
    return GateSpec(agreement=agreement, sampled_temperature=temperature, floors=floors, tie_epsilon=tie_epsilon,
                    min_speed=min_speed)


def _answer_of(raw: Mapping[str, Any]) -> GateAnswer:
    """A recorded GateAnswer, its tuples back (JSON made them lists)."""
    values = dict(raw)
    if values.get("tokens") is not None:
        values["tokens"] = tuple(values["tokens"])
    if values.get("top_logprobs") is not None:
        values["top_logprobs"] = tuple(
            None if row is None else tuple((int(tok), float(lp)) for tok, lp in row) for row in values["top_logprobs"])
    return GateAnswer(**values)


def _unreachable_floor(spec: GateSpec, info: Mapping[str, Any]) -> str | None:
    """Why a floor given (``accept_floor``, a ledger's) can never pass on the server that
    ``info`` (its ``/server_info``) says serves: at or above the largest acceptance length
    its tree reaches (DDTREE budget + 1, DFLASH its draft tokens), as ``--canary`` refuses it."""
    algorithm = info.get("speculative_algorithm")
    if algorithm == "DDTREE":
        tree = served_tree(info)
        budget = tree[0] if tree is not None and tree[0] is not None else MAX_DDTREE_BUDGET
        limit, why = budget + 1.0, f"DDTREE budget {budget}: {budget} nodes and the bonus token"
    elif algorithm == "DFLASH":
        tokens = info.get("speculative_num_draft_tokens")
        tokens = tokens if isinstance(tokens, int) else MAX_DFLASH_DRAFT_TOKENS
        limit, why = float(tokens), f"DFLASH {tokens} draft tokens"
    else:
        return None
    for floor in spec.floors.values():
        if floor.value >= limit:
            return (f"the acceptance floor {floor.describe()} is not below {limit:g}, the largest acceptance length "
                    f"of the tree served ({why}): the gate could never pass")
    return None


def _baseline_path(host: Host) -> str:
    return f"{host.ddtree.run_dir.rstrip('/')}/{BASELINE_FILE}"


def gate(ctx: TaskContext, *, phase: str, spec: GateSpec, algorithm: str = "DDTREE") -> Result:
    """``baseline``: each server's answers before the change, recorded on the host (a
    server is launched alone, AR, where none answers: what the CLI's canary does);
    ``judge``: the same requests again, judged against them; failed when the gate fails."""
    t, host = ctx.transport, ctx.host
    try:
        with host_state(t, host):
            if phase == "baseline":
                # Where nothing answers, the baseline launches the target alone: a change.
                idle = [s.name for s in host.slot_hosts() if not observe_place(t, s, smoke=None).answers]
                if ctx.check_mode:
                    return {"changed": bool(idle), "msg": one_line(
                        f"would launch the target alone (AR) for the baseline on {', '.join(idle)}" if idle
                        else "would record each server's answers")}
                baseline = capture_baseline(t, host, spec, cancel=threading.Event())
                record = {"recorded_at": time.time(), "note": baseline.note,
                          "answers": {n: [asdict(a) for a in answers] for n, answers in baseline.answers.items()}}
                t.write_atomic(_baseline_path(host), json.dumps(_jsonable(record)).encode(), mode=0o600)
                return {"changed": bool(idle), "msg": one_line(baseline.note or "baseline recorded"),
                        "servers": sorted(baseline.answers), "path": _baseline_path(host)}
            return _judge(ctx, spec, speculative=algorithm != "AR")
    except DdtreeOpsError as exc:
        return failure(exc)


def _judge(ctx: TaskContext, spec: GateSpec, *, speculative: bool) -> Result:
    from ddtree_ops.rollout.executor import _Baseline

    t, host = ctx.transport, ctx.host
    if ctx.check_mode:
        # The baseline task recorded nothing in check mode, and nothing was changed to judge.
        return {"changed": False, "msg": "check mode: the gate asks the changed server, so it is not judged"}
    try:
        record = json.loads(t.read_bytes(_baseline_path(host)))
        answers = {name: tuple(_answer_of(a) for a in rows) for name, rows in record["answers"].items()}
    except RemoteFileError as exc:
        raise ConfigError(f"no gate baseline on {host.name} ({exc.message}): run ddtree.ops.gate with phase "
                          f"baseline before the change", host=host.name) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{_baseline_path(host)}: not a gate baseline ({exc}); record it again", host=host.name) \
            from None
    missing = [s.name for s in host.slot_hosts() if s.name not in answers]
    if missing:
        raise ConfigError(f"the gate baseline on {host.name} has no answers of {', '.join(missing)}: record it again",
                          host=host.name)
    for server in host.slot_hosts():
        problem = _unreachable_floor(spec, observe_place(t, server, smoke=None).info or {})
        if problem is not None:
            raise ConfigError(f"ddtree.ops.gate: {problem}", host=server.name)
    verdicts: dict[str, GateVerdict] = check_gate(t, host, spec, _Baseline(answers, str(record.get("note") or "")),
                                                  speculative=speculative)
    result: Result = {"changed": False, "gates": {n: _jsonable(v.as_dict()) for n, v in verdicts.items()},
                      "msg": one_line("; ".join(f"{n}: {v.describe()}" for n, v in verdicts.items()))}
    failed = [f"{n}: {v.describe()}" for n, v in verdicts.items() if not v.passed]
    if failed:
        result |= {"failed": True, "msg": one_line(f"canary {'; '.join(failed)}"), "error": "canary_failed",
                   "exit_code": ServiceError.exit_code}
    return result


# ---------------------------------------------------------------------------- facts


def facts(ctx: TaskContext, *, bundle_dir: str | None = None, smoke: bool = True) -> Result:
    """The host as observed, as ``ansible_facts.ddtree_ops``: its bundle (classified against
    ``bundle_dir``, default the shipped bundle, as ``status`` does), each server place (its
    manager's view, what it serves, ready), the patch status, and each server's launch as
    ``previous`` (what a later ``server: state=previous`` puts back). Not ``ddtree``: Ansible
    sets each fact as a host variable too, and ``ddtree`` is the host's settings."""
    from ddtree_ops.patching.status import host_status

    t, host = ctx.transport, ctx.host
    try:
        b = load_bundle(Path(bundle_dir) if bundle_dir else DEFAULT_BUNDLE)
        snapshot = observe_host(t, host, bundle=b, smoke=OBSERVE_SMOKE if smoke else None)
        status = host_status(t, host, bundle=b).to_json()
        data = {**snapshot.as_dict(), "status": status, "previous": previous_servers(t, host)}
    except DdtreeOpsError as exc:
        return failure(exc)
    return {"changed": False, "ansible_facts": {"ddtree_ops": _jsonable(data)},
            "msg": one_line("; ".join(snapshot.lines()))}


__all__ = ["RESTART_BUDGET", "RESTART_TOPK", "ServerDone", "TaskContext", "bundle", "facts", "failure", "gate",
           "gate_spec", "one_line", "previous_servers", "run_config", "server"]
