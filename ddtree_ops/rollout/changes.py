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

from ddtree_ops.errors import CanaryFailed, CanaryRejected, DdtreeOpsError
from ddtree_ops.inventory_types import Host
from ddtree_ops.patching.bundle import Bundle
from ddtree_ops.patching.executor import HostOutcome, RunOptions, RunOutcome, deploy, rollback
from ddtree_ops.report.policy import Policy
from ddtree_ops.rollout.executor import HostChange
from ddtree_ops.service import lifecycle
from ddtree_ops.service.launch import RunConfig
from ddtree_ops.service.logphases import PhaseEvent
from ddtree_ops.service.manager import LeasePass
from ddtree_ops.service.smoke import SmokeSpec
from ddtree_ops.service.systemd import SystemdManager
from ddtree_ops.state import PolicyRecord, StateStore
from ddtree_ops.transport.base import Transport
from ddtree_ops.tuning import DeployedPolicy, PolicyUndo, deploy_policy, undo_policy

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
    settings, its lease pass and its live board."""

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

    def restart(self, transport: Transport, server: Host, cancel: threading.Event,
                run: RunConfig | None = None) -> lifecycle.RestartResult:
        s = self.settings
        tree_policy = self.state.policy_for(server.machine) if s.use_policy else None
        if run is None and self.repeat_last:
            run = lifecycle.last_run(transport, server)
            if tree_policy is not None and run.adaptive_config == tree_policy.path:
                run = replace(run, adaptive_config=None)  # the policy is launched with again below
        if run is None:
            run = self.with_policy if tree_policy is not None and self.with_policy is not None else self.run
        request = lifecycle.prepare_restart(
            transport, server, run, machine=self.machines.get(server.machine), lease=self.lease(transport, server),
            timeout=s.timeout, retry_cuda_graph=s.retry_cuda_graph, stop_grace_s=s.stop_grace_s, smoke=s.smoke,
            tree_policy=tree_policy, keep_on_failure=s.keep_on_failure,
        )
        result = lifecycle.restart(transport, request, state=self.state, on_phase=self.on_phase, cancel=cancel)
        if not s.use_policy and run.algorithm == "DDTREE":
            self.state.forget_policy(server.machine)
        return result

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


def _rolled_back(done: Sequence[str]) -> str:
    failed = [d for d in done if "NOT put back" in d]
    return ("rollback incomplete: " if failed else "rolled back: ") + ", ".join(done)


class RestartChange(HostChange[lifecycle.RestartResult, lifecycle.PreviousServer]):
    """``restart``: one server (a host, or one GPU slot of it)."""

    def __init__(self, restarter: ServerRestarter) -> None:
        self.restarter = restarter
        self.run = restarter.run

    def remember(self, transport: Transport, host: Host) -> lifecycle.PreviousServer:
        return lifecycle.remember_server(transport, host)

    def apply(self, transport: Transport, host: Host, cancel: threading.Event) -> lifecycle.RestartResult:
        return self.restarter.restart(transport, host, cancel)

    def undo(self, transport: Transport, host: Host, before: lifecycle.PreviousServer) -> str:
        return _rolled_back(self.restarter.put_back(transport, [host], {host.name: before}))

    def gate_error(self, message: str, host: str) -> DdtreeOpsError:
        return CanaryFailed(message, host=host)


@dataclass(frozen=True)
class DeployBefore:
    servers: Mapping[str, lifecycle.PreviousServer]


class DeployChange(HostChange[HostOutcome, DeployBefore]):
    """``deploy``: the bundle into one machine, then (``restarter`` set) each of its servers
    restarted; the restart only where the patch was applied (a no-op deploy keeps them)."""

    def __init__(self, bundle: Bundle, opts: RunOptions, restarter: ServerRestarter | None,
                 *, after: Callable[[Transport, Host, HostOutcome], None] | None = None) -> None:
        self.bundle, self.opts, self.restarter, self.after = bundle, opts, restarter, after
        self.run = restarter.run if restarter is not None else RunConfig("AR")
        self.outcomes: dict[str, HostOutcome] = {}
        self._lock = threading.Lock()

    def describe(self) -> str:
        tree = f" + {self.run.describe()}" if self.restarter is not None else ""
        return f"{self.bundle.name} {self.bundle.version}{tree}"

    def remember(self, transport: Transport, host: Host) -> DeployBefore:
        return DeployBefore({s.name: lifecycle.remember_server(transport, s) for s in host.slot_hosts()})

    def apply(self, transport: Transport, host: Host, cancel: threading.Event) -> HostOutcome:
        out = deploy(transport, host, self.bundle, self.opts, cancel=cancel)
        with self._lock:
            self.outcomes[host.name] = out
        if self.after is not None:
            self.after(transport, host, out)
        if self.restarter is not None and out.outcome == RunOutcome.APPLIED and not cancel.is_set():
            try:
                for server in host.slot_hosts():
                    self.restarter.restart(transport, server, cancel)
            except DdtreeOpsError as exc:
                # The files are in place and recorded; only the restart needs another go.
                exc.message = f"patch applied, but the restart failed: {exc.message}"
                raise
        return out

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

    def remember(self, transport: Transport, host: Host) -> None:
        return None

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
                result = r.restart(transport, server, cancel, run=replace(r.run, algorithm="AR"))
                what = f"relaunched the target alone (AR, pid {result.pid})"
            servers.append(f"{server.name}: {what}")
        return RolledBack(out, tuple(servers))

    def undo(self, transport: Transport, host: Host, before: None) -> str:
        return "nothing to put back (a rollback is the way back)"

    def gate_error(self, message: str, host: str) -> DdtreeOpsError:
        return CanaryFailed(message, host=host)


__all__ = [
    "DeployBefore",
    "DeployChange",
    "PolicyBefore",
    "PolicyChange",
    "RestartChange",
    "RestartSettings",
    "RollbackChange",
    "RolledBack",
    "ServerRestarter",
]
