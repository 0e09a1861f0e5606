"""The changes a rollout carries out, one per command that restarts servers.

* :class:`RestartChange` (``restart``): one server relaunched with a run configuration; put
  back by relaunching what ran before from its launch record (under systemd: its drop-in,
  or the operator's own ExecStart).
* :class:`DeployChange` (``deploy [--restart]``): one machine's patch applied, then each of
  its servers restarted; put back by rolling the patch back (when this run applied it) and
  relaunching each server's previous launch.
* :class:`PolicyChange` (``tune --deploy``): a tuned policy placed and served; put back by
  the previous file, servers and local record (:func:`ddtree_ops.tuning.undo_policy`).
* :class:`RollbackChange` (``rollback [--restart]``): the patch rolled back, our launch
  configuration dropped (a systemd unit's drop-in removed), and with ``--restart`` each
  server relaunched without DDTree: the unit's own ExecStart, or the target alone (AR) under
  the process manager. Going back is its purpose, so it has no undo of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ddtree_ops.errors import (
    CanaryFailed,
    CanaryRejected,
    DdtreeOpsError,
    LeaseHeld,
    PatchError,
    ServiceError,
    recorded_error,
)
from ddtree_ops.inventory_types import Host
from ddtree_ops.patching.bundle import Bundle
from ddtree_ops.patching.executor import HostOutcome, RunOptions, RunOutcome, deploy, rollback
from ddtree_ops.probe import probe_host
from ddtree_ops.report.policy import Policy
from ddtree_ops.rollout.executor import HostChange
from ddtree_ops.rollout.observe import HostSnapshot, observe_host
from ddtree_ops.service import lifecycle
from ddtree_ops.service.agent import base_payload, call_agent, dead_lease, lease_refusal
from ddtree_ops.service.launch import LaunchSpec, RunConfig
from ddtree_ops.service.logphases import PhaseEvent
from ddtree_ops.service.manager import LeasePass
from ddtree_ops.service.observed import OBSERVE_SMOKE, mismatch
from ddtree_ops.service.smoke import SmokeSpec
from ddtree_ops.service.systemd import SystemdManager
from ddtree_ops.state import PolicyRecord, StateStore
from ddtree_ops.transport.base import Transport
from ddtree_ops.tuning import DeployedPolicy, PolicyUndo, deploy_policy, machine_type_of, policy_of, undo_policy

PhaseCallback = Callable[[PhaseEvent], None]
LeaseFor = Callable[[Transport, Host], LeasePass]


def _no_lease(_t: Transport, _h: Host) -> LeasePass:
    return LeasePass()


def _ignore(_e: PhaseEvent) -> None:
    return None


@dataclass(frozen=True)
class RestartSettings:
    """How each server is restarted (the options of ``restart`` and friends)."""

    timeout: float | None = None
    retry_cuda_graph: bool = False
    stop_grace_s: float = 30.0
    smoke: SmokeSpec | None = lifecycle.DEFAULT_SMOKE
    keep_on_failure: bool = False
    # False: launch DDTREE without the machine's tuned policy, and forget it (--no-policy).
    use_policy: bool = True


@dataclass
class ServerRestarter:
    """The one restart policy of every change that restarts a server, with the command's
    settings, its lease pass and its live board. It remembers what each server it restarted
    (or left running, having observed it serving exactly that) was asked to serve, for the
    command's closing observation (:meth:`verify`)."""

    run: RunConfig
    settings: RestartSettings = field(default_factory=RestartSettings)
    state: StateStore = field(default_factory=StateStore)
    machines: Mapping[str, Host] = field(default_factory=dict)
    lease: LeaseFor = _no_lease
    on_phase: PhaseCallback = _ignore
    # What a machine with a tuned policy launches instead of ``run``: the tree the operator
    # named, None where the policy's launch state decides (``deploy --restart``, whose ``run``
    # carries its default tree for machines without a policy).
    with_policy: RunConfig | None = None
    # ``restart`` without ``--algorithm``: each server launches again what it launched last
    # (``lifecycle.last_run``); ``run`` only describes it.
    repeat_last: bool = False

    def __post_init__(self) -> None:
        # Every server's restart reads the state file (its policy, fallbacks, load times):
        # a bad record must be one refusal now, before any host is touched, not a failure
        # of each host once the rollout has begun.
        self.state.check()
        self._wanted: dict[str, tuple[LaunchSpec, Mapping[str, Mapping[str, int]] | None]] = {}
        self._lock = threading.Lock()

    def request(self, transport: Transport, server: Host, run: RunConfig | None = None, *,
                refresh_policy: bool = True, deployed_later: bool = False) -> lifecycle.RestartRequest:
        """What a restart of ``server`` launches, with this command's settings."""
        s = self.settings
        tree_policy = self.state.policy_for(server.machine) if s.use_policy else None
        if run is None and self.repeat_last:
            run = lifecycle.last_run(transport, server)
            if tree_policy is not None and run.adaptive_config == tree_policy.path:
                run = replace(run, adaptive_config=None)  # the policy is launched with again below
        if run is None:
            run = self.with_policy if tree_policy is not None and self.with_policy is not None else self.run
        return lifecycle.prepare_restart(
            transport, server, run, machine=self.machines.get(server.machine), lease=self.lease(transport, server),
            timeout=s.timeout, retry_cuda_graph=s.retry_cuda_graph, stop_grace_s=s.stop_grace_s, smoke=s.smoke,
            tree_policy=tree_policy, keep_on_failure=s.keep_on_failure, state=self.state,
            refresh_policy=refresh_policy, deployed_later=deployed_later,
        )

    def restart(self, transport: Transport, server: Host, cancel: threading.Event,
                run: RunConfig | None = None, *, converge: bool = False) -> lifecycle.ServerOutcome:
        """``server`` restarted with this command's launch; with ``converge``, only where it
        does not already serve exactly that launch, ready (``lifecycle.converge``)."""
        request = self.request(transport, server, run)
        act = lifecycle.converge if converge else lifecycle.restart
        result = act(transport, request, state=self.state, on_phase=self.on_phase, cancel=cancel)
        if not self.settings.use_policy and request.run.algorithm == "DDTREE":
            self.state.forget_policy(server.machine)
        spec = result.spec
        if spec is not None:
            with self._lock:
                self._wanted[server.name] = (spec, request.tree_policy.policy if request.tree_policy else None)
        return result

    def check(self, transport: Transport, server: Host, run: RunConfig | None = None, *,
              deployed_later: bool = False) -> None:
        """Everything a restart of ``server`` would refuse, found without changing anything:
        the manager (a unit not found, masked, not an SGLang launch, no root), another
        sweep's lease, the launch itself (flags, tuned policy, the plugin a DDTREE launch
        needs, unless this command deploys it first: ``deployed_later``)."""
        lifecycle.manager_for(transport, server).preflight()
        check_lease(transport, server, self.lease(transport, server))
        request = self.request(transport, server, run, refresh_policy=False, deployed_later=deployed_later)
        lifecycle.first_launch(request, self.state)

    def verify(self, snapshot: HostSnapshot, servers: Sequence[Host]) -> str | None:
        """Why the servers this command restarted (or left, serving it) do not, as observed
        now, serve what they were asked to, ready; None when every one does."""
        problems = []
        for server in servers:
            with self._lock:
                wanted = self._wanted.get(server.name)
            view = snapshot.server(server.name)
            if wanted is None or view is None:
                continue
            problem = mismatch(view, wanted[0], policy=wanted[1])
            if problem is not None:
                problems.append(f"{server.name}: {problem}")
        return "; ".join(problems) or None

    def put_back(self, transport: Transport, servers: Sequence[Host],
                 before: Mapping[str, lifecycle.PreviousServer]) -> list[str]:
        """Each server relaunched as it ran before (phrases; a failure said, never raised)."""
        done = []
        for server in servers:
            try:
                if lifecycle.remember_server(transport, server) == before[server.name]:
                    done.append(f"{server.name} untouched")
                    continue
                what = lifecycle.restore_server(transport, server, before[server.name], state=self.state,
                                                lease=self.lease(transport, server),
                                                stop_grace_s=self.settings.stop_grace_s)
                done.append(f"{server.name} {what}")
            except DdtreeOpsError as exc:
                done.append(f"{server.name} NOT put back: {exc.message}")
        return done


def check_lease(transport: Transport, server: Host, lease: LeasePass) -> None:
    """LeaseHeld where a live sweep other than ``lease``'s holds ``server`` (``--force``
    passes; a provably dead holder's lease is the restart's to clear)."""
    if lease.force:
        return
    answer = call_agent(transport, server, "leaseinfo", base_payload(server), timeout=30)
    held = answer.get("lease")
    if not isinstance(held, dict) or (lease.token is not None and held.get("token") == lease.token) \
            or dead_lease(held):
        return
    raise LeaseHeld(lease_refusal(server, held, answer.get("now")), host=server.name)


def _rolled_back(done: Sequence[str]) -> str:
    failed = [d for d in done if "NOT put back" in d]
    return ("rollback incomplete: " if failed else "rolled back: ") + ", ".join(done)


class RestartChange(HostChange[lifecycle.RestartResult, lifecycle.PreviousServer]):
    """``restart``: one server (a host, or one GPU slot of it)."""

    def __init__(self, restarter: ServerRestarter) -> None:
        self.restarter = restarter
        self.run = restarter.run

    def check(self, transport: Transport, host: Host) -> None:
        self.restarter.check(transport, host)

    def remember(self, transport: Transport, host: Host) -> lifecycle.PreviousServer:
        return lifecycle.remember_server(transport, host)

    def apply(self, transport: Transport, host: Host, cancel: threading.Event) -> lifecycle.RestartResult:
        result = self.restarter.restart(transport, host, cancel)
        assert isinstance(result, lifecycle.RestartResult)  # a restart, never converged
        return result

    def undo(self, transport: Transport, host: Host, before: lifecycle.PreviousServer) -> str:
        return _rolled_back(self.restarter.put_back(transport, [host], {host.name: before}))

    def verify(self, host: Host, snapshot: HostSnapshot, value: lifecycle.RestartResult) -> DdtreeOpsError | None:
        problem = self.restarter.verify(snapshot, host.slot_hosts())
        return None if problem is None else ServiceError(f"observed after the restart: {problem}", host=host.name)

    def gate_error(self, message: str, host: str) -> DdtreeOpsError:
        return CanaryFailed(message, host=host)


@dataclass(frozen=True)
class DeployBefore:
    servers: Mapping[str, lifecycle.PreviousServer]


@dataclass(frozen=True)
class Deployed:
    """``deploy``'s result on one machine: the patch's outcome and, with ``--restart``, what
    became of each server (restarted, or left running: observed serving exactly the launch)."""

    outcome: HostOutcome
    servers: tuple[str, ...] = ()
    # With --restart on a host whose files were in place: whether a server was restarted
    # (False: every one was observed serving the launch already); None without a restart.
    restarted: bool | None = None

    @property
    def label(self) -> str:
        """The host's result in one word: the patch's outcome, or for files already in place
        with --restart, ``restarted`` or ``unchanged``."""
        if self.outcome.outcome == RunOutcome.NOOP and self.restarted is not None:
            return "restarted" if self.restarted else "unchanged"
        return self.outcome.outcome.label


class DeployChange(HostChange[Deployed, DeployBefore]):
    """``deploy``: the bundle into one machine, then (``restarter`` set) each of its servers
    restarted where the patch was applied, and where it was in place already, restarted only
    when it does not serve the asked-for launch, ready (a re-run after a failure converges)."""

    def __init__(self, bundle: Bundle, opts: RunOptions, restarter: ServerRestarter | None,
                 *, after: Callable[[Transport, Host, HostOutcome], None] | None = None) -> None:
        self.bundle, self.opts, self.restarter, self.after = bundle, opts, restarter, after
        self.run = restarter.run if restarter is not None else RunConfig("AR")
        self.outcomes: dict[str, HostOutcome] = {}
        self._lock = threading.Lock()

    def describe(self) -> str:
        tree = f" + {self.run.describe()}" if self.restarter is not None else ""
        return f"{self.bundle.name} {self.bundle.version}{tree}"

    def check(self, transport: Transport, host: Host) -> None:
        """The bundle's plan (base hashes, version, drift, another bundle: what the deploy
        itself would refuse), then each server's restart as :meth:`ServerRestarter.check`
        finds it (its unit, lease and launch; the plugin is what this deploy brings)."""
        if not self.opts.dry_run:
            planned = deploy(transport, host, self.bundle, replace(self.opts, dry_run=True))
            refusal = planned.refusal()
            if refusal is not None:
                raise refusal
        if self.restarter is None:
            return
        for server in host.slot_hosts():
            self.restarter.check(transport, server, deployed_later=True)

    def remember(self, transport: Transport, host: Host) -> DeployBefore:
        return DeployBefore({s.name: lifecycle.remember_server(transport, s) for s in host.slot_hosts()})

    def apply(self, transport: Transport, host: Host, cancel: threading.Event) -> Deployed:
        out = deploy(transport, host, self.bundle, self.opts, cancel=cancel)
        with self._lock:
            self.outcomes[host.name] = out
        if self.after is not None:
            self.after(transport, host, out)
        servers: list[str] = []
        restarted: bool | None = None
        applied = out.outcome == RunOutcome.APPLIED
        if self.restarter is not None and out.outcome in (RunOutcome.APPLIED, RunOutcome.NOOP) \
                and not cancel.is_set():
            restarted = False
            try:
                for server in host.slot_hosts():
                    # New files need a new process; files in place already need one only
                    # where the server does not serve this launch (stopped, failed, another tree).
                    result = self.restarter.restart(transport, server, cancel, converge=not applied)
                    restarted = restarted or not isinstance(result, lifecycle.Unchanged)
                    servers.append(f"{server.name}: {_server_phrase(result)}")
            except DdtreeOpsError as exc:
                # The files are in place and recorded; only the restart needs another go.
                exc.message = f"patch {'applied' if applied else 'in place'}, but the restart failed: {exc.message}"
                raise
        return Deployed(out, tuple(servers), restarted)

    def observe(self, transport: Transport, host: Host) -> HostSnapshot:
        # Without --restart the servers are not ours to judge: their state, no smoke.
        smoke = OBSERVE_SMOKE if self.restarter is not None else None
        return observe_host(transport, host, bundle=self.bundle, smoke=smoke)

    def verify(self, host: Host, snapshot: HostSnapshot, value: Deployed) -> DdtreeOpsError | None:
        if self.opts.dry_run:
            return None
        if snapshot.bundle is None or not snapshot.bundle.applied(self.bundle):
            seen = snapshot.error or (snapshot.bundle.describe() if snapshot.bundle is not None else "not observed")
            return PatchError(f"observed after the deploy: the bundle is not in place ({seen})", host=host.name)
        if self.restarter is None:
            return None
        problem = self.restarter.verify(snapshot, host.slot_hosts())
        return None if problem is None else ServiceError(f"observed after the deploy: {problem}", host=host.name)

    def undo(self, transport: Transport, host: Host, before: DeployBefore) -> str:
        done: list[str] = []
        out = self.outcomes.get(host.name)
        if out is not None and out.outcome == RunOutcome.APPLIED:
            try:
                rollback(transport, host, RunOptions())
                previous = out.state.applied if out.state is not None else None
                done.append("patch rolled back to the originals" + (
                    f" (the bundle applied before, {previous.name} {previous.version}, is not kept by "
                    f"ddtree-ops: deploy it again)" if previous is not None and previous.identity
                    != self.bundle.identity else ""))
            except DdtreeOpsError as exc:
                done.append(f"patch NOT put back: {exc.message}")
        else:
            done.append("patch unchanged")
        if self.restarter is not None:
            done += self.restarter.put_back(transport, host.slot_hosts(), before.servers)
        return _rolled_back(done)

    def gate_error(self, message: str, host: str) -> DdtreeOpsError:
        return CanaryRejected(message, host=host)


def _server_phrase(result: lifecycle.ServerOutcome) -> str:
    if isinstance(result, lifecycle.Unchanged):
        return result.describe()
    graphs = "" if result.cuda_graph else ", eager"
    return f"restarted ({result.run}{graphs}, pid {result.pid})"


@dataclass(frozen=True)
class PolicyBefore:
    """The machine's policy record and each server's launch before the change (before a
    canary's baseline launch too: what ran before the rollout is what comes back)."""

    record: PolicyRecord | None
    servers: Mapping[str, lifecycle.PreviousServer]


class PolicyChange(HostChange[DeployedPolicy, PolicyBefore]):
    """``tune --deploy``: one machine's tuned policy placed and served by every server."""

    def __init__(self, policies: Sequence[Policy], host_machines: Mapping[str, str], restarter: ServerRestarter,
                 *, launch: RunConfig) -> None:
        self.policies, self.host_machines, self.restarter = policies, host_machines, restarter
        self.run = launch
        self.placed: dict[str, PolicyUndo] = {}
        self._lock = threading.Lock()

    def describe(self) -> str:
        return "the tuned DDTREE policy"

    def check(self, transport: Transport, host: Host) -> None:
        """The policy for the host's machine type (the ledger's word, else its probe's GPU):
        a host the ledger cannot serve is refused before any host changes; then each
        server's unit and lease."""
        facts = None if host.name in self.host_machines else probe_host(transport, host)
        if facts is not None and not facts.reachable:
            raise recorded_error(facts.error_type, facts.error or "unreachable", host=host.name)
        policy_of(machine_type_of(host, self.host_machines, facts), self.policies)
        for server in host.slot_hosts():
            lifecycle.manager_for(transport, server).preflight()
            check_lease(transport, server, self.restarter.lease(transport, server))

    def verify(self, host: Host, snapshot: HostSnapshot, value: DeployedPolicy) -> DdtreeOpsError | None:
        record = self.restarter.state.policy_for(host.machine)
        problems = []
        for result in value.servers:
            view = snapshot.server(result.host)
            if view is None or result.spec is None:
                continue
            problem = mismatch(view, result.spec, policy=record.policy if record is not None else None)
            if problem is not None:
                problems.append(f"{result.host}: {problem}")
        if not problems:
            return None
        return ServiceError(f"observed after the policy's deploy: {'; '.join(problems)}", host=host.name)

    def remember(self, transport: Transport, host: Host) -> PolicyBefore:
        return PolicyBefore(self.restarter.state.policy_for(host.machine),
                            {s.name: lifecycle.remember_server(transport, s) for s in host.slot_hosts()})

    def _placed(self, undo: PolicyUndo) -> None:
        with self._lock:
            self.placed[undo.host] = undo

    def apply(self, transport: Transport, host: Host, cancel: threading.Event) -> DeployedPolicy:
        r, s = self.restarter, self.restarter.settings
        return deploy_policy(
            transport, host, self.policies, self.host_machines, state=r.state, timeout=s.timeout, smoke=s.smoke,
            lease=r.lease(transport, host), stop_grace_s=s.stop_grace_s, on_phase=r.on_phase, cancel=cancel,
            on_placed=self._placed,
        )

    def undo(self, transport: Transport, host: Host, before: PolicyBefore) -> str:
        undo = self.placed.get(host.name)
        if undo is None:
            return "nothing placed"
        try:
            return undo_policy(transport, host, replace(undo, before=before.servers), before.record,
                               state=self.restarter.state,
                               lease=self.restarter.lease(transport, host),
                               stop_grace_s=self.restarter.settings.stop_grace_s)
        except DdtreeOpsError as exc:
            return f"rollback incomplete: {exc.message}"

    def gate_error(self, message: str, host: str) -> DdtreeOpsError:
        return CanaryRejected(message, host=host)


@dataclass(frozen=True)
class RolledBack:
    """``rollback``'s result on one machine: the patch's outcome and, per server, what it
    runs now."""

    outcome: HostOutcome
    servers: tuple[str, ...] = ()


class RollbackChange(HostChange[RolledBack, None]):
    """``rollback [--restart]`` on one machine (module docstring)."""

    def __init__(self, opts: RunOptions, restarter: ServerRestarter | None, *, state: StateStore | None = None) -> None:
        self.opts, self.restarter = opts, restarter
        self.state = restarter.state if restarter is not None else (state or StateStore())
        self.run = RunConfig("AR")

    def describe(self) -> str:
        return "the original SGLang files, without DDTree"

    def check(self, transport: Transport, host: Host) -> None:
        """What the rollback itself would refuse (drifted files without --force, a lock),
        then each server's unit (and, with --restart, its lease)."""
        if not self.opts.dry_run:
            refusal = rollback(transport, host, replace(self.opts, dry_run=True)).refusal()
            if refusal is not None:
                raise refusal
        super().check(transport, host)
        if self.restarter is not None:
            for server in host.slot_hosts():
                check_lease(transport, server, self.restarter.lease(transport, server))

    def remember(self, transport: Transport, host: Host) -> None:
        return None

    def observe(self, transport: Transport, host: Host) -> HostSnapshot:
        return observe_host(transport, host, smoke=OBSERVE_SMOKE if self.restarter is not None else None)

    def verify(self, host: Host, snapshot: HostSnapshot, value: RolledBack) -> DdtreeOpsError | None:
        if self.opts.dry_run:
            return None
        if snapshot.bundle is None or not snapshot.bundle.original:
            seen = snapshot.error or (snapshot.bundle.describe() if snapshot.bundle is not None else "not observed")
            return PatchError(f"observed after the rollback: the original files are not all back ({seen})",
                              host=host.name)
        problems = []
        for server in host.slot_hosts():
            view = snapshot.server(server.name)
            if view is None:
                continue
            if view.unit is not None and view.unit.dropin_in_effect:
                problems.append(f"{server.name}: our drop-in is still in effect")
            elif self.restarter is not None and view.unit is not None and not view.ready:
                problems.append(f"{server.name}: {view.describe()}")
        if self.restarter is not None:
            problem = self.restarter.verify(snapshot, [s for s in host.slot_hosts()
                                                       if s.ddtree.server.manager != "systemd"])
            if problem is not None:
                problems.append(problem)
        if not problems:
            return None
        return ServiceError(f"observed after the rollback: {'; '.join(problems)}", host=host.name)

    def apply(self, transport: Transport, host: Host, cancel: threading.Event) -> RolledBack:
        out = rollback(transport, host, self.opts, cancel=cancel)
        if out.outcome == RunOutcome.ROLLED_BACK:
            # The tuned policy went with the bundle (its file is removed with it): a later
            # DDTREE restart must not launch with it.
            self.state.forget_policy(host.machine)
        if self.opts.dry_run or cancel.is_set():
            return RolledBack(out)
        servers: list[str] = []
        for server in host.slot_hosts():
            svc = lifecycle.manager_for(transport, server)
            if self.restarter is None:
                if isinstance(svc, SystemdManager):
                    svc.configure(None)
                    servers.append(f"{server.name}: drop-in removed (the unit runs its own ExecStart from its "
                                   f"next start)")
                continue
            r = self.restarter
            if isinstance(svc, SystemdManager):
                what = lifecycle.rollback_unit(transport, server, restart=True, state=r.state,
                                               lease=r.lease(transport, server),
                                               stop_grace_s=r.settings.stop_grace_s)
            else:
                # Files already original: the target alone is relaunched only where it does not serve.
                result = r.restart(transport, server, cancel, run=replace(r.run, algorithm="AR"),
                                   converge=out.outcome == RunOutcome.NOOP)
                what = result.describe() if isinstance(result, lifecycle.Unchanged) else \
                    f"relaunched the target alone (AR, pid {result.pid})"
            servers.append(f"{server.name}: {what}")
        return RolledBack(out, tuple(servers))

    def undo(self, transport: Transport, host: Host, before: None) -> str:
        return "nothing to put back (a rollback is the way back)"

    def gate_error(self, message: str, host: str) -> DdtreeOpsError:
        return CanaryFailed(message, host=host)


__all__ = [
    "DeployBefore",
    "DeployChange",
    "Deployed",
    "PolicyBefore",
    "PolicyChange",
    "RestartChange",
    "RestartSettings",
    "RollbackChange",
    "RolledBack",
    "ServerRestarter",
]
