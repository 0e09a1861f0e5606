"""Top-level service operations: ``restart``, ``stop``, ``service_status``.

Used by the CLI (``ddtree-ops restart/stop/status``), ``deploy --restart`` and the
benchmark runner. Each call works on ONE host over an open transport and either
returns a frozen result or raises a :class:`ServiceError` subclass whose message names
the host, the phase and the log tail; fan-out over hosts is the caller's business.

Restart = stop what we launched last time -> prove the port is free (connect test from
the host, waiting with a deadline, never launching into SGLang's 30 s "Port is already
in use" failure) -> launch -> wait until the NEW process serves -> a speculative smoke
(``smoke.py``: real decodes, greedy and sampled, alone and batched) -> ready. A
CUDA-graph capture failure, or a crash or hang of the first decodes with decode graphs
on, relaunches eager once and is remembered. A DDTREE restart with a tuned policy
(``tune --deploy``, remembered like a fallback: :func:`with_tree_policy`) is ready only once
``/server_info`` says that policy is the one the server follows.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import PurePosixPath
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from ddtree_ops.errors import (
    ConfigError,
    DdtreeOpsError,
    DriftError,
    Interrupted,
    NotDeployed,
    PortBusy,
    ReadinessTimeout,
    RemoteFileError,
    ServerCrashed,
    ServiceError,
)
from ddtree_ops.inventory_types import Host
from ddtree_ops.service import manager
from ddtree_ops.service.fallback import (
    EAGER_FROM_ENV,
    RuntimeBudgets,
    capture_failure,
    failed_capture_budget,
    fallback_key,
    initial_cuda_graph,
    plan_runtime_budgets,
    probed_gpu_arch,
    runtime_capture_failures,
)
from ddtree_ops.service.launch import LaunchSpec, RunConfig, build_launch_spec, probe_address
from ddtree_ops.service.logphases import LogEvent, Phase, PhaseEvent, PhaseTracker
from ddtree_ops.service.manager import Launched, LeasePass, LogPosition, ProcessManager, ServiceManager, StopResult
from ddtree_ops.service.observed import ServerView, mismatch, observe_server
from ddtree_ops.service.readiness import (
    DeadlinePolicy,
    LoadWindow,
    WaitOutcome,
    WaitReason,
    judge,
    policy_mismatch,
    served_cuda_graph,
    wait_loop,
)
from ddtree_ops.service.smoke import SmokeFailure, SmokeResult, SmokeSpec, crash_line, judge_smoke
from ddtree_ops.service.systemd import SystemdManager, exit_detail, launch_markers
from ddtree_ops.state import PolicyRecord, StateStore
from ddtree_ops.transport.base import Transport

if TYPE_CHECKING:
    from ddtree_ops.probe import HostFacts

PhaseCallback = Callable[[PhaseEvent], None]
TAIL_LINES = 12


def manager_for(transport: Transport, host: Host) -> ServiceManager:
    """The manager that runs ``host``'s server (``ddtree.server.manager``): ddtree-ops's own
    process manager, or the host's systemd through the operator's unit."""
    if host.ddtree.server.manager == "systemd":
        return SystemdManager(transport, host)
    return ProcessManager(transport, host)


@dataclass(frozen=True)
class RestartResult:
    """A server that was proven to be the one we launched and to answer generation.

    ``load_s`` (launch -> the server answers: what is learned for the next deadline),
    ``ready_s`` (launch -> the smoke passed) and ``phase_durations`` (``smoke`` among
    them) describe the final launch; ``attempts`` counts launches, so an eager fallback
    shows as 2. ``smoke`` is the speculative smoke's verdict (None when skipped).
    """

    host: str
    pid: int
    argv: tuple[str, ...]
    cuda_graph: bool
    fallback_reason: str | None
    phase_durations: Mapping[Phase, float]
    ready_s: float
    load_s: float
    deadline_s: float
    deadline_source: str
    attempts: int
    launch_command: str
    log_path: str
    ready_at: float
    ready_line_ts: float | None
    stopped: StopResult | None = None
    smoke: SmokeResult | None = None  # None: skipped (--no-smoke)
    run: str = ""  # RunConfig.describe() of what was launched: the table's tree column
    # The final launch, for the command's closing observation (never in --json: its env is
    # the inventory's, tokens included).
    spec: LaunchSpec | None = field(default=None, repr=False, compare=False, metadata={"json": False})

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (``dataclasses.asdict`` cannot copy the read-only mapping)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "spec"}
        out["argv"] = list(self.argv)
        out["phase_durations"] = {str(k): v for k, v in self.phase_durations.items()}
        out["stopped"] = asdict(self.stopped) if self.stopped is not None else None
        out["smoke"] = asdict(self.smoke) if self.smoke is not None else None  # failure: a StrEnum, JSON as its value
        return out


@dataclass(frozen=True)
class ServiceStatus:
    host: str
    running: bool
    pid: int | None
    argv: tuple[str, ...]
    started_at: float | None
    port_open: bool
    serving_ours: bool | None
    health: int | str | None
    cuda_graph: bool | None
    run: str | None
    log_tail: tuple[str, ...] = ()
    manager: str = "process"
    unit: UnitState | None = None


@dataclass(frozen=True)
class UnitState:
    """A systemd host's unit as ``service-status`` and ``doctor`` show it: its state,
    how often systemd restarted it, whether our drop-in is in effect, and whether it
    comes back after a reboot (``enabled``)."""

    name: str
    active: str
    sub: str
    main_pid: int | None
    restarts: int | None
    dropin_in_effect: bool
    enabled: str
    result: str

    @classmethod
    def of(cls, name: str | None, props: Mapping[str, Any], ours: bool) -> UnitState:
        pid = str(props.get("MainPID") or "0")
        restarts = str(props.get("NRestarts") or "")
        return cls(
            name=name or "?", active=str(props.get("ActiveState") or "?"), sub=str(props.get("SubState") or "?"),
            main_pid=int(pid) if pid.isdigit() and pid != "0" else None,
            restarts=int(restarts) if restarts.isdigit() else None, dropin_in_effect=ours,
            enabled=str(props.get("UnitFileState") or "?"), result=str(props.get("Result") or "?"),
        )

    def describe(self) -> str:
        restarts = f", {self.restarts} restart(s) by systemd" if self.restarts else ""
        dropin = "our drop-in" if self.dropin_in_effect else "its own ExecStart"
        return f"{self.name} {self.active} ({self.sub}){restarts}, {dropin}, {self.enabled}"


@dataclass
class _Attempt:
    """Mutable bookkeeping of one launch while the wait loop runs."""

    spec: LaunchSpec
    launched: Launched
    tracker: PhaseTracker
    offset: LogPosition = 0
    alive: bool = True
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    last_poll: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchFacts:
    """What a launch needs to know about the host beyond the inventory.

    ``sglang_version``: the SGLang installed there, which the launch flags are built for
    (None: unknown, the newest flags). ``gpu_arch``: the probed ``sm_XY`` that keys an
    eager-fallback record (None: the inventory's ``gpu`` stands in).
    """

    sglang_version: str | None = None
    gpu_arch: str | None = None
    # SGLang there has the DDTree plugin registered (None: unknown).
    ddtree_plugin: bool | None = None

    @classmethod
    def from_probe(cls, facts: HostFacts) -> LaunchFacts:
        return cls(facts.sglang_version, probed_gpu_arch(gpu.compute_cap for gpu in facts.gpus), facts.ddtree_plugin)


@dataclass(frozen=True)
class RestartRequest:
    """One host's restart: what to launch there, and how long each step may take.

    ``timeout`` overrides the load-aware deadline (``policy``) of each launch and bounds
    the port wait;
    ``retry_cuda_graph`` tries CUDA graphs where a fallback is recorded; ``stop_grace_s``
    is SIGTERM -> SIGKILL for the old process; ``port_wait_s`` how long a port held by a
    process we did not launch is waited for; ``poll_interval_s`` the readiness poll period;
    ``smoke`` the requests that prove the server decodes before it is called ready (None
    skips them: ``--no-smoke``); ``lease`` how a sweep's lease on the host is treated (the
    default: refused while another sweep holds the host; a sweep passes its own token,
    ``--force`` overrides); ``tree_policy`` the tuned DDTREE policy ``run`` launches with
    (its ``adaptive_config``), which the server must report active before it is ready;
    ``keep_on_failure`` leaves a launch that did not become ready (timed out, or the wait
    cancelled) running for inspection instead of stopping it. ``runtime_note``: why a
    launch holding several budgets lists some in ``ddtree.eager_budgets`` (the recorded
    fallbacks, :func:`~ddtree_ops.service.fallback.plan_runtime_budgets`): the result's
    ``fallback_reason`` when the launch serves with graphs.
    """

    host: Host
    run: RunConfig
    facts: LaunchFacts = field(default_factory=LaunchFacts)
    timeout: float | None = None
    retry_cuda_graph: bool = False
    policy: DeadlinePolicy = field(default_factory=DeadlinePolicy)
    stop_grace_s: float = 30.0
    port_wait_s: float = 120.0
    poll_interval_s: float = 0.5
    smoke: SmokeSpec | None = field(default_factory=SmokeSpec)
    lease: LeasePass = field(default_factory=LeasePass)
    tree_policy: PolicyRecord | None = None
    keep_on_failure: bool = False
    runtime_note: str | None = None


# What a restart decodes before it says ready unless told otherwise (``--no-smoke``: None).
DEFAULT_SMOKE = SmokeSpec()


def launch_facts(transport: Transport, host: Host, facts: HostFacts | None = None) -> LaunchFacts:
    """What a launch on ``host`` must know: the probe's SGLang version and GPU architecture
    (``facts`` when the caller probed already, else one probe now); the version alone,
    from the package metadata, where the probe found none."""
    if facts is None:
        from ddtree_ops.probe import probe_host

        facts = probe_host(transport, host)
    probed = LaunchFacts.from_probe(facts)
    if probed.sglang_version is None:
        return replace(probed, sglang_version=manager.sglang_version(transport, host))
    return probed


def prepare_restart(
    transport: Transport,
    host: Host,
    run: RunConfig,
    *,
    machine: Host | None = None,
    facts: HostFacts | None = None,
    lease: LeasePass | None = None,
    timeout: float | None = None,
    retry_cuda_graph: bool = False,
    stop_grace_s: float = 30.0,
    smoke: SmokeSpec | None = DEFAULT_SMOKE,
    tree_policy: PolicyRecord | None = None,
    keep_on_failure: bool = False,
    state: StateStore | None = None,
    refresh_policy: bool = True,
    deployed_later: bool = False,
) -> RestartRequest:
    """The one restart policy of ``restart``, ``deploy --restart`` and a sweep: the request
    to launch ``run`` on ``host``, keyed for eager fallbacks on the probed GPU architecture
    (:func:`launch_facts`), so that a fallback one of them recorded is honoured by the others.

    A GPU slot (``host.slot``) of ``machine`` is refused (ServiceError) while a server
    launched on the machine as one server still runs: it holds every GPU. ``lease`` is how
    a sweep's lease on the host is treated (None: refused while another sweep holds it).
    ``tree_policy``: the tuned policy deployed on the machine (``StateStore.policy_for``),
    applied to a DDTREE ``run`` by :func:`with_tree_policy`; a sweep passes none, since a
    policy would change the tree of the cell it measures. A policy's launch notes the
    budgets its file serves eager (``ddtree.eager_budgets``, written by ``tune`` from the
    recorded fallbacks in ``state``) as the restart's ``runtime_note``; where the fallbacks
    recorded since ask for another set, the file is rewritten with it (and its launch budget
    moved off an eager one) and its record updated, before anything is stopped
    (``refresh_policy``; ``tune`` passes False: it wrote the file from the same records, and
    its rollback expects the file it placed). ``deployed_later``: the command deploys the
    DDTree plugin before this launch (a rollout's check of ``deploy --restart``), so its
    absence now is no refusal.
    """
    if host.slot is not None and machine is not None:
        pid = whole_host_server(transport, machine)
        if pid is not None:
            raise ServiceError(
                f"a server launched on {machine.name} as one server, not in a GPU slot, still runs (pid {pid}, "
                f"run dir {machine.ddtree.run_dir}) and holds every GPU; 'ddtree-ops stop {machine.name}' stops it",
                host=host.name,
            )
    launch = launch_facts(transport, host, facts)
    if run.algorithm == "DDTREE" and not deployed_later:
        refuse_undeployed(host, launch)
    run, applied = with_tree_policy(transport, host, run, tree_policy)
    note = None
    if applied is not None and run.budget is not None:
        state = state if state is not None else StateStore()
        key = fallback_key(host, run, arch=launch.gpu_arch, sglang_version=launch.sglang_version)
        planned = plan_runtime_budgets(state, key, applied.budgets, retry_cuda_graph=retry_cuda_graph)
        listed = tuple(sorted(int(b) for b in applied.document.get("eager_budgets") or ()))
        if listed != planned.eager_budgets and refresh_policy:
            run, applied = _refresh_policy(transport, host, run, applied, planned, state)
            listed = planned.eager_budgets
        if listed and listed == planned.eager_budgets:
            note = planned.note
        elif listed:
            note = f"eager_budgets {list(listed)} listed in {applied.path} (the other budgets keep their graphs)"
    return RestartRequest(
        host, run, launch, timeout=timeout, retry_cuda_graph=retry_cuda_graph,
        stop_grace_s=stop_grace_s, smoke=smoke, lease=lease if lease is not None else LeasePass(),
        tree_policy=applied, keep_on_failure=keep_on_failure, runtime_note=note,
    )


def _refresh_policy(
    transport: Transport, host: Host, run: RunConfig, record: PolicyRecord, planned: RuntimeBudgets,
    state: StateStore,
) -> tuple[RunConfig, PolicyRecord]:
    """The policy file rewritten with ``planned``'s eager budgets (same policy, same path),
    and its local record with it, so that the sha256 check of the next restart holds."""
    from ddtree_ops.patching.placed import place_file

    document = dict(record.document)
    document.pop("eager_budgets", None)
    if planned.eager_budgets:
        document["eager_budgets"] = list(planned.eager_budgets)
    text = json.dumps({"ddtree": document}, indent=2) + "\n"
    placed = place_file(transport, host, text.encode(), name=PurePosixPath(record.path).name)
    updated = replace(record, path=placed.path, sha256=placed.sha256, config=text, budget=planned.launch_budget,
                      recorded_at=time.time())
    state.record_policy(updated)
    return replace(run, budget=planned.launch_budget, adaptive_config=updated.path), updated


def refuse_undeployed(host: Host, facts: LaunchFacts) -> None:
    """NotDeployed where SGLang on ``host`` would not know DDTREE: its plugin is not there
    (the probe says so), or the server's ``SGLANG_PLUGINS`` whitelist leaves it out. SGLang
    itself would refuse only after the old server is stopped (``Unknown speculative
    algorithm name: DDTREE``); this says it first, with the remedy."""
    deploy = f"`ddtree-ops deploy {host.machine}` installs it"
    if facts.ddtree_plugin is False:
        raise NotDeployed(
            f"DDTREE needs the DDTree bundle, which is not deployed on {host.machine} (its SGLang has no ddtree "
            f"plugin); {deploy}", host=host.name,
        )
    allowed = {p.strip() for p in host.ddtree.server.env.get("SGLANG_PLUGINS", "").split(",") if p.strip()}
    if allowed and "ddtree" not in allowed:
        raise NotDeployed(
            # Not the value: everything in the inventory's env is kept off the terminal.
            "DDTREE needs the ddtree plugin, which the server's SGLANG_PLUGINS (inventory env) leaves out; "
            "add ddtree there", host=host.name,
        )


def with_tree_policy(
    transport: Transport, host: Host, run: RunConfig, record: PolicyRecord | None
) -> tuple[RunConfig, PolicyRecord | None]:
    """``run`` launched with the tuned policy ``record`` where it applies, and the record
    the readiness check then holds the server to (None where it does not apply).

    It applies to DDTREE only (an AR or DFLASH restart keeps the record for later). The
    launch state defaults to the record's; one given must be a state of the policy (the
    server refuses a launch outside its set). Before anything is stopped, the host's copy
    of the file must be the one ``tune`` wrote: a changed or missing file would fail the
    launch after the old server is gone, or serve a policy nobody chose (DriftError).
    """
    if record is None or run.algorithm != "DDTREE":
        return run, None
    where = f"the tuned DDTREE policy deployed on {host.machine} ({record.path})"
    undo = f"`ddtree-ops tune LEDGER --deploy {host.machine}` writes it again; restart --no-policy launches without it"
    if run.adaptive_config is not None:
        raise ConfigError(f"{where} and adaptive_config {run.adaptive_config} both given; choose one", host=host.name)
    budget = run.budget if run.budget is not None else record.budget
    topk = run.topk if run.topk is not None else record.topk
    if budget not in record.budgets or topk > record.topk_max:
        raise ConfigError(
            f"{where} has no state budget={budget} topk={topk} (budgets {list(record.budgets)}, top-k up to "
            f"{record.topk_max}): restart at one of them (without --budget/--topk: budget={record.budget} "
            f"topk={record.topk}), or with --no-policy to launch without it",
            host=host.name,
        )
    try:
        content = transport.read_bytes(record.path)
    except RemoteFileError as exc:
        raise DriftError(f"{where} cannot be read ({exc.message}); {undo}", host=host.name) from exc
    if hashlib.sha256(content).hexdigest() != record.sha256:
        raise DriftError(f"{where} changed on the host since tune wrote it; {undo}", host=host.name)
    return replace(run, budget=budget, topk=topk, adaptive_config=record.path), record


@dataclass(frozen=True)
class _Ended:
    """A launch whose wait ended other than READY: what its error message says."""

    host: str
    pid: int
    phase: Phase
    outcome: WaitOutcome
    tail: str
    capture_failure: str
    deadline_s: float
    deadline_source: str
    # For a launch that was still alive: whether it was stopped (see _Failure.stop_server).
    stopped: bool = True
    # How a systemd unit's main process ended (``Result=exit-code, status=1``); "" otherwise.
    exit: str = ""
    unit: str | None = None

    @property
    def server(self) -> str:
        """What became of the launched server, for a failure that may keep it."""
        if self.stopped:
            return f"server stopped (pid {self.pid}; --keep-on-failure keeps it)"
        return f"server left running (pid {self.pid}, --keep-on-failure) — `ddtree-ops stop {self.host}` stops it"


@dataclass(frozen=True)
class _Failure:
    # "always": our process must not be left to be benchmarked; "unless-kept": a launch
    # that did not become ready (too slow, or the wait cancelled) is stopped, so that no
    # half-loaded server holds the GPUs, unless the operator keeps it to look at it
    # (RestartRequest.keep_on_failure); "never": it is gone, or out of reach.
    stop_server: Literal["always", "unless-kept", "never"]
    error: Callable[[_Ended], DdtreeOpsError]


def _crashed_in_capture(e: _Ended) -> DdtreeOpsError:
    return ServerCrashed(f"{e.capture_failure} (CUDA graphs forced on); log tail: {e.tail}", host=e.host)


def _died(e: _Ended) -> DdtreeOpsError:
    if e.unit is not None:
        # systemd may start it again (Restart=): it was stopped, not left to crash-loop.
        return ServerCrashed(
            f"unit {e.unit} exited during {e.phase} after {e.outcome.elapsed_s:.1f}s ({e.exit or 'Result=?'}); "
            f"unit stopped; journal: {e.tail}", host=e.host,
        )
    return ServerCrashed(
        f"server exited during {e.phase} after {e.outcome.elapsed_s:.1f}s; log tail: {e.tail}", host=e.host
    )


def _misconfigured(e: _Ended) -> DdtreeOpsError:
    # Our process, serving something else: stopped, never left to be benchmarked.
    return ServiceError(f"{e.outcome.detail}; stopped it", host=e.host)


def _port_in_use(e: _Ended) -> DdtreeOpsError:
    return PortBusy(f"server reports its port is already in use; log tail: {e.tail}", host=e.host)


def _cancelled(e: _Ended) -> DdtreeOpsError:
    return Interrupted(f"wait cancelled during {e.phase} after {e.outcome.elapsed_s:.1f}s; {e.server}", host=e.host)


def _unreachable(e: _Ended) -> DdtreeOpsError:
    return ServiceError(
        f"lost contact while waiting for readiness ({e.outcome.detail}); server pid {e.pid} state unknown", host=e.host
    )


def _timed_out(e: _Ended) -> DdtreeOpsError:
    if e.outcome.elapsed_s > e.deadline_s + 1.0:  # waited past the deadline while the load progressed
        waited = (f"not ready after {e.outcome.elapsed_s:.0f}s (the {e.deadline_source} deadline of "
                  f"{e.deadline_s:.0f}s, extended while the log showed progress, up to its cap)")
    else:
        waited = f"not ready after {e.deadline_s:.0f}s ({e.deadline_source} deadline)"
    return ReadinessTimeout(
        f"{waited}, stuck in phase {e.phase} ({e.outcome.detail}); {e.server}; log tail: {e.tail}", host=e.host
    )


def _stalled(e: _Ended) -> DdtreeOpsError:
    return ReadinessTimeout(
        f"gave up after {e.outcome.elapsed_s:.0f}s in phase {e.phase}: the server's log stopped moving "
        f"({e.outcome.detail}); {e.server}; log tail: {e.tail}",
        host=e.host,
    )


# Every way a launch's wait can end other than READY. CAPTURE_FAILED relaunches eager
# instead where the run allows it (``cuda_graph: auto``), so this entry is only for
# CUDA graphs forced on.
_FAILURES: Mapping[WaitReason, _Failure] = MappingProxyType({
    WaitReason.CAPTURE_FAILED: _Failure("always", _crashed_in_capture),
    WaitReason.DIED: _Failure("never", _died),
    WaitReason.MISCONFIGURED: _Failure("always", _misconfigured),
    WaitReason.PORT_IN_USE: _Failure("always", _port_in_use),
    WaitReason.CANCELLED: _Failure("unless-kept", _cancelled),
    WaitReason.UNREACHABLE: _Failure("never", _unreachable),
    WaitReason.TIMEOUT: _Failure("unless-kept", _timed_out),
    WaitReason.STALLED: _Failure("unless-kept", _stalled),
})


def restart(
    transport: Transport,
    request: RestartRequest,
    *,
    state: StateStore | None = None,
    on_phase: PhaseCallback | None = None,
    cancel: threading.Event | None = None,
) -> RestartResult:
    """Restart the SGLang server of ``request.host`` with ``request.run`` and wait until it
    provably serves.

    Raises ReadinessTimeout / ServerCrashed / PortBusy / Interrupted (on ``cancel``).
    A host with GPU slots is refused (ConfigError): its servers are its slots
    (``host.slot_hosts()``), and one server on every GPU would block them all.
    """
    host, run, version = request.host, request.run, request.facts.sglang_version
    if host.ddtree.server.slots and host.slot is None:
        names = ", ".join(slot.name for slot in host.slot_hosts())
        raise ConfigError(
            f"{host.name} has GPU slots (ddtree.server.slots): restart each slot ({names}), not the host as one server",
            host=host.name,
        )
    stop_grace_s, port_wait_s = request.stop_grace_s, request.port_wait_s
    if request.timeout is not None:  # the operator's --timeout bounds every wait, the port's too
        port_wait_s = min(port_wait_s, float(request.timeout))
    began = time.time()
    state = state if state is not None else StateStore()
    emit = on_phase or (lambda _e: None)
    svc = manager_for(transport, host)
    key = fallback_key(host, run, arch=request.facts.gpu_arch, sglang_version=version)
    cuda_graph, fallback_reason = initial_cuda_graph(run, state, key, retry_cuda_graph=request.retry_cuda_graph)
    model = host.ddtree.server.model_path or ""
    learned = state.learned_load_s(host.name, model)
    if request.timeout is not None:
        window = LoadWindow.fixed(float(request.timeout))
    else:
        window = request.policy.window(host.ddtree.server.expected_load_s, learned)
    deadline_s, deadline_source = window.deadline_s, window.source
    # Build the first spec before touching the host: bad config fails with nothing stopped
    # (a DDTREE launch the bundle would refuse on this GPU included: launch.ddtree_launch_refusal).
    checks = _launch_checks(request)
    spec = build_launch_spec(host, run, version, cuda_graph=cuda_graph, **checks)
    svc.preflight()  # a unit that cannot be driven: refused with nothing stopped

    # Long enough for the worst case of this restart. A killed client's lock is taken over
    # by the next restart from the same controller at once; from elsewhere it expires.
    lock_ttl_s = 2 * (window.longest_s + port_wait_s + stop_grace_s) + 120

    def took_over(t: manager.LockTakeover) -> None:
        age = f", held {t.age_s:.0f}s" if t.age_s is not None else ""
        emit(PhaseEvent(host.name, Phase.LOCK_TAKEN_OVER, 0.0, note=f"restart lock of dead {t.holder}{age} taken over"))

    with manager.restart_lock(transport, host, ttl_s=lock_ttl_s, on_takeover=took_over, lease=request.lease):
        emit(PhaseEvent(host.name, Phase.STOPPING, 0.0))
        stopped = svc.stop(grace_s=stop_grace_s)
        _wait_port_free(transport, host, port_wait_s=port_wait_s, cancel=cancel, emit=emit)

        attempt_no = 0
        pending_fallback: str | None = None

        def may_fall_back() -> bool:
            """A graph launch the run lets fall back (``cuda_graph: auto``)."""
            return run.cuda_graph == "auto" and spec.cuda_graph

        def relaunch_eager(reason: str, elapsed_s: float) -> LaunchSpec:
            """Say why, wait for the failed server's port, and give the eager spec."""
            emit(PhaseEvent(host.name, Phase.FALLBACK_EAGER, elapsed_s, attempt=attempt_no, note=reason))
            eager = build_launch_spec(host, run, version, cuda_graph=False, **checks)
            _wait_port_free(transport, host, port_wait_s=port_wait_s, cancel=cancel, emit=emit)
            return eager

        def relaunch_states_eager(budget: int, reason: str, elapsed_s: float) -> LaunchSpec:
            """The same launch with CUDA graphs, its runtime budgets from ``budget`` up served
            eager (the bundle's EAGER_FROM_ENV, whoever wrote the state file): the failure
            named that budget, and capture failures grow with the verify width."""
            emit(PhaseEvent(host.name, Phase.FALLBACK_EAGER, elapsed_s, attempt=attempt_no, note=reason))
            graphs = build_launch_spec(host, run, version, cuda_graph=True, **checks)
            _wait_port_free(transport, host, port_wait_s=port_wait_s, cancel=cancel, emit=emit)
            return replace(graphs, env=MappingProxyType({**graphs.env, EAGER_FROM_ENV: str(budget)}))

        eager_from: int | None = None  # runtime budgets from here up relaunched eager

        while True:
            attempt_no += 1
            launched = svc.start(spec)
            note = "CUDA graphs" if spec.cuda_graph else "eager"
            emit(PhaseEvent(host.name, Phase.STARTING, 0.0, attempt=attempt_no, note=note))
            outcome, attempt = wait_ready(
                transport, host, spec, launched, window=window, attempt_no=attempt_no,
                on_phase=emit, cancel=cancel, poll_interval_s=request.poll_interval_s,
            )
            durations = attempt.tracker.finish(outcome.elapsed_s)
            if outcome.reason is WaitReason.READY:
                load_s = time.time() - launched.started_at
                state.record_load_time(host.name, model, load_s)
                smoke = None
                if request.smoke is not None:
                    smoke = _smoke(transport, host, run, attempt, request.smoke, outcome.elapsed_s, emit)
                    durations[Phase.SMOKE] = smoke.seconds
                    if not smoke.passed:
                        reason = _smoke_failure_reason(transport, host, attempt, smoke)
                        svc.stop(grace_s=stop_grace_s)
                        if smoke.failure is not None and smoke.failure.decode_broke and may_fall_back():
                            # Remembered once eager serves: a crash that eager repeats is
                            # not the graphs' doing (e.g. a sampled request the build cannot serve).
                            pending_fallback = fallback_reason = reason
                            spec = relaunch_eager(reason, outcome.elapsed_s + smoke.seconds)
                            continue
                        raise _smoke_error(host.name, spec, smoke, reason, _tail_text(attempt))
                if request.tree_policy is not None:
                    _check_tree_policy(transport, host, attempt, request.tree_policy, stop_grace_s)
                ready_at = time.time()
                ready_s = ready_at - launched.started_at
                state.record_load_time(host.name, model, load_s, restart_s=ready_at - began)
                if pending_fallback is not None:
                    state.record_fallback(key, pending_fallback)
                if spec.cuda_graph and request.retry_cuda_graph:
                    state.clear_fallback(key)
                info = attempt.last_poll.get("server_info") or {}
                if spec.cuda_graph and run.adaptive_config is not None:
                    # A runtime state whose capture failed is served eager by the bundle; it
                    # is remembered at its own budget, so that the next launch holding it
                    # lists it in eager_budgets instead of attempting the capture again.
                    for budget, why in runtime_capture_failures(info):
                        state.record_fallback(
                            replace(key, budget=budget),
                            f"runtime state budget {budget}: verify graph did not capture ({why})",
                        )
                if spec.cuda_graph and fallback_reason is None:
                    fallback_reason = request.runtime_note
                note = "serving" if smoke is None else f"serving; smoke {smoke.detail}"
                smoke_s = smoke.seconds if smoke is not None else 0.0
                emit(PhaseEvent(host.name, Phase.READY, outcome.elapsed_s + smoke_s, attempt=attempt_no, note=note))
                served = served_cuda_graph(info)
                return RestartResult(
                    host=host.name,
                    pid=launched.pid,
                    argv=spec.argv,
                    # Graphs only where both asked for and resolved: SGLang runs eager
                    # by itself on a device without them.
                    cuda_graph=spec.cuda_graph and served is not False,
                    fallback_reason=fallback_reason,
                    phase_durations=MappingProxyType(durations),
                    ready_s=ready_s,
                    load_s=load_s,
                    deadline_s=deadline_s,
                    deadline_source=deadline_source,
                    attempts=attempt_no,
                    launch_command=spec.launch_command,
                    log_path=launched.log_path,
                    ready_at=ready_at,
                    ready_line_ts=attempt.tracker.ready_line_ts,
                    stopped=stopped,
                    smoke=smoke,
                    run=run.describe(),
                    spec=spec,
                )
            failure = _FAILURES[outcome.reason]
            stop = failure.stop_server == "always" or (
                failure.stop_server == "unless-kept" and not request.keep_on_failure
            ) or (outcome.reason is WaitReason.DIED and svc.revives_exited_server)
            ended = _Ended(
                host=host.name,
                pid=launched.pid,
                phase=attempt.tracker.phase,
                outcome=outcome,
                tail=_tail_text(attempt),
                capture_failure=capture_failure(attempt.tracker, alive=attempt.alive) or outcome.detail,
                deadline_s=deadline_s,
                deadline_source=deadline_source,
                stopped=stop,
                exit=exit_detail(attempt.last_poll.get("unit")),
                unit=svc.unit if isinstance(svc, SystemdManager) else None,
            )
            if stop:
                svc.stop(grace_s=stop_grace_s)
            if outcome.reason is WaitReason.CAPTURE_FAILED and may_fall_back():
                # Keyed on the budget that failed: a runtime state's capture that left the
                # CUDA context unusable (or, under TP, failed on any rank) ends the whole
                # start, but names its own budget, as does a death while capturing it.
                failed = failed_capture_budget(ended.capture_failure) if run.adaptive_config is not None else None
                state.record_fallback(key if failed is None else replace(key, budget=failed), ended.capture_failure)
                fallback_reason = ended.capture_failure
                if failed is not None and failed != run.budget and (eager_from is None or failed < eager_from):
                    # Only that state and the wider ones eager; the others keep their graphs.
                    # (A failure at or above a budget already relaunched eager means the switch
                    # was not honoured: the whole server goes eager below.)
                    eager_from = failed
                    fallback_reason = (f"runtime budgets >= {failed} served eager (the other budgets keep their "
                                       f"CUDA graphs): {ended.capture_failure}")
                    spec = relaunch_states_eager(failed, fallback_reason, outcome.elapsed_s)
                    continue
                spec = relaunch_eager(fallback_reason, outcome.elapsed_s)
                continue
            raise failure.error(ended)


def first_launch(request: RestartRequest, state: StateStore | None = None) -> LaunchSpec:
    """The launch a restart of ``request`` makes first: CUDA graphs, or eager where a
    fallback is recorded for its key (what :func:`restart` builds before touching the host)."""
    state = state if state is not None else StateStore()
    run, version = request.run, request.facts.sglang_version
    key = fallback_key(request.host, run, arch=request.facts.gpu_arch, sglang_version=version)
    cuda_graph, _ = initial_cuda_graph(run, state, key, retry_cuda_graph=request.retry_cuda_graph)
    return build_launch_spec(request.host, run, version, cuda_graph=cuda_graph, **_launch_checks(request))


def _launch_checks(request: RestartRequest) -> dict[str, Any]:
    """What :func:`build_launch_spec` checks a DDTREE launch against: the probed GPU
    architecture and, for a tuned policy, the largest top-k its states serve."""
    policy = request.tree_policy
    return {"gpu_arch": request.facts.gpu_arch, "topk_max": policy.topk_max if policy is not None else None}


@dataclass(frozen=True)
class Unchanged:
    """A server left as it was: observed serving exactly the launch a restart would make,
    ready (its smoke at the request's settings decoded). ``view`` is that observation."""

    host: str
    view: ServerView
    spec: LaunchSpec = field(repr=False, metadata={"json": False})

    @property
    def pid(self) -> int | None:
        return self.view.pid

    def describe(self) -> str:
        return f"unchanged: already serving {self.view.served() or self.spec.run.describe()} (pid {self.view.pid})"


ServerOutcome = RestartResult | Unchanged


def converge(
    transport: Transport,
    request: RestartRequest,
    *,
    state: StateStore | None = None,
    on_phase: PhaseCallback | None = None,
    cancel: threading.Event | None = None,
) -> ServerOutcome:
    """``request``'s launch on its host, restarting only what does not already serve it.

    The server there is observed first (:func:`~ddtree_ops.service.observed.observe_server`,
    with the request's smoke): one that serves exactly the launch a restart would make (its
    flags, environment and tree, the tuned policy it must follow), ready, is left running
    (:class:`Unchanged`); anything else (no server, not ready, another configuration, a
    failed smoke) is restarted. This is what a re-run after a failure, Ctrl-C or ``kill -9``
    needs: a host whose patch is already in place is still looked at."""
    if request.host.ddtree.server.slots and request.host.slot is None:
        return restart(transport, request, state=state, on_phase=on_phase, cancel=cancel)  # refused there
    spec = first_launch(request, state)
    svc = manager_for(transport, request.host)
    view = observe_server(svc, smoke=request.smoke)
    policy = request.tree_policy.policy if request.tree_policy is not None else None
    if mismatch(view, spec, policy=policy) is None:
        return Unchanged(request.host.name, view, spec)
    return restart(transport, request, state=state, on_phase=on_phase, cancel=cancel)


def _smoke(
    transport: Transport,
    host: Host,
    run: RunConfig,
    attempt: _Attempt,
    smoke: SmokeSpec,
    elapsed_s: float,
    emit: PhaseCallback,
) -> SmokeResult:
    """Run the speculative smoke against the server that just answered."""
    rounds = smoke.rounds()
    requests = sum(len(r) for r in rounds)
    emit(PhaseEvent(host.name, Phase.SMOKE, elapsed_s, attempt=attempt.tracker.attempt,
                    note=f"{requests} requests, {len(smoke.samplings)} sampling setting(s)"))
    answer = manager_for(transport, host).smoke(attempt.launched, rounds, request_timeout=smoke.request_timeout_s)
    return judge_smoke(answer, smoke, speculative=run.algorithm != "AR")


def _check_tree_policy(
    transport: Transport, host: Host, attempt: _Attempt, record: PolicyRecord, stop_grace_s: float
) -> None:
    """After the smoke (its decodes ran under the policy): one more poll, and the server
    must say it follows ``record``'s policy; else it is stopped, never left to serve
    another tree than the one tuned."""
    svc = manager_for(transport, host)
    try:
        data = svc.poll(attempt.launched, attempt.offset)
    except DdtreeOpsError as exc:
        problem: str | None = f"could not read /server_info: {exc}"
    else:
        attempt.offset = data.get("offset", attempt.offset)
        attempt.tail.extend(ln for ln in str(data.get("log", "")).splitlines() if ln.strip())
        problem = policy_mismatch(data.get("server_info") or {}, record.policy)
    if problem is None:
        return
    svc.stop(grace_s=stop_grace_s)
    raise ServiceError(
        f"the tuned DDTREE policy ({record.path}) is not active: {problem}; stopped it; "
        f"log tail: {_tail_text(attempt)}",
        host=host.name,
    )


def _smoke_failure_reason(transport: Transport, host: Host, attempt: _Attempt, smoke: SmokeResult) -> str:
    """What the fallback record and the error say: the log's own error line when the
    server crashed (read once more: it wrote it while dying), else the smoke's detail."""
    line = None
    if smoke.failure is SmokeFailure.CRASHED:
        try:
            data = manager_for(transport, host).poll(attempt.launched, attempt.offset)
        except DdtreeOpsError:
            data = {}
        lines = [ln for ln in str(data.get("log", "")).splitlines() if ln.strip()]
        attempt.tail.extend(lines)
        line = crash_line(lines)
    return f"first decode {smoke.failure or SmokeFailure.FAILED}: {line or smoke.detail}"


def _smoke_error(host: str, spec: LaunchSpec, smoke: SmokeResult, reason: str, tail: str) -> DdtreeOpsError:
    mode = "with decode CUDA graphs on" if spec.cuda_graph else "in eager mode"
    message = f"speculative smoke failed {mode}: {reason}; stopped it; log tail: {tail}"
    if smoke.failure is SmokeFailure.CRASHED:
        return ServerCrashed(message, host=host)
    return ServiceError(message, host=host)


def wait_ready(
    transport: Transport,
    host: Host,
    spec: LaunchSpec,
    launched: Launched,
    *,
    window: LoadWindow,
    attempt_no: int = 1,
    on_phase: PhaseCallback | None = None,
    on_poll: Callable[[dict[str, Any], str], None] | None = None,
    cancel: threading.Event | None = None,
    poll_interval_s: float = 0.5,
) -> tuple[WaitOutcome, _Attempt]:
    """Wait until ``launched`` provably serves, dies, fails capture, stalls, or the
    deadline passes (a load-aware ``window``: past its deadline while the log still moves).

    Progress is new output in the server's log: SGLang writes its loading (weight shards,
    the KV pool, each captured batch) as it goes, and a hung process writes nothing.
    ``on_poll(poll, detail)`` sees every probe answer with the loop's reading of it.
    """
    attempt = _Attempt(spec=spec, launched=launched, tracker=PhaseTracker(host.name, attempt=attempt_no))
    emit = on_phase or (lambda _e: None)
    progressed = [0.0]  # the launch is the first progress
    extended = [False]

    def step(elapsed: float) -> tuple[WaitReason | None, str]:
        before = attempt.offset
        decision, detail = _step(transport, host, attempt, elapsed, emit)
        if attempt.offset != before:
            progressed[0] = elapsed
        if window.stall_s is not None and elapsed >= window.deadline_s and not extended[0] and decision is None:
            extended[0] = True
            emit(PhaseEvent(host.name, attempt.tracker.phase, elapsed, attempt=attempt_no,
                            note=f"past the {window.deadline_s:.0f}s deadline, still loading: waiting while the log "
                                 f"moves (silent {window.stall_s:.0f}s fails), up to {window.cap_s or 0:.0f}s"))
        if on_poll is not None:
            on_poll(attempt.last_poll, detail)
        return decision, detail

    outcome = wait_loop(
        step, deadline_s=window.deadline_s, interval_s=poll_interval_s, cancel=cancel,
        progressed_at=(lambda: progressed[0]) if window.stall_s is not None else None,
        stall_s=window.stall_s, cap_s=window.cap_s,
    )
    return outcome, attempt


def _step(
    transport: Transport, host: Host, attempt: _Attempt, elapsed: float, emit: PhaseCallback
) -> tuple[WaitReason | None, str]:
    """One poll: read new log lines, advance phases, judge. Never raises (a failed poll
    is reported as UNREACHABLE and counted by the wait loop)."""
    try:
        data = manager_for(transport, host).poll(attempt.launched, attempt.offset)
    except DdtreeOpsError as exc:
        attempt.last_poll = {}
        return WaitReason.UNREACHABLE, str(exc)
    attempt.last_poll = data
    attempt.offset = data.get("offset", attempt.offset)
    lines = [ln for ln in str(data.get("log", "")).splitlines() if ln.strip()]
    attempt.tail.extend(lines)
    for event in attempt.tracker.feed(lines, elapsed):
        emit(event)
    attempt.alive = bool(data.get("alive"))
    if attempt.spec.cuda_graph and capture_failure(attempt.tracker, alive=attempt.alive):
        return WaitReason.CAPTURE_FAILED, "CUDA-graph capture failed"
    if attempt.tracker.has(LogEvent.PORT_IN_USE):
        return WaitReason.PORT_IN_USE, attempt.tracker.first_line(LogEvent.PORT_IN_USE) or ""
    if not attempt.alive:
        return WaitReason.DIED, "process exited"
    if attempt.tracker.has(LogEvent.CRASHED):
        # SGLang's parent may linger a moment after a child failed; the next poll sees it gone.
        return None, attempt.tracker.first_line(LogEvent.CRASHED) or "crashed"
    verdict = judge(data, attempt.spec, attempt.launched.started_at)
    if verdict.ok:
        return WaitReason.READY, verdict.detail
    if verdict.misconfigured:
        return WaitReason.MISCONFIGURED, verdict.detail
    return None, verdict.detail


def _wait_port_free(
    transport: Transport,
    host: Host,
    *,
    port_wait_s: float,
    cancel: threading.Event | None,
    emit: PhaseCallback,
) -> None:
    reported = False

    def step(elapsed: float) -> tuple[WaitReason | None, str]:
        nonlocal reported
        try:
            busy = manager_for(transport, host).port_open()
        except DdtreeOpsError as exc:
            return WaitReason.UNREACHABLE, str(exc)
        if not busy:
            return WaitReason.READY, "port free"
        if not reported:
            note = (f"port {host.ddtree.server.port} busy (held by a process we did not launch); "
                    f"waiting up to {port_wait_s:.0f}s")
            emit(PhaseEvent(host.name, Phase.WAITING_FOR_PORT, elapsed, note=note))
            reported = True
        return None, f"port {host.ddtree.server.port} still in use"

    outcome = wait_loop(step, deadline_s=port_wait_s, interval_s=0.25, cancel=cancel)
    if outcome.reason is WaitReason.READY:  # the port is free
        return
    if outcome.reason is WaitReason.CANCELLED:
        raise Interrupted(
            f"cancelled while waiting for port {host.ddtree.server.port} to be free; nothing launched", host=host.name
        )
    if outcome.reason is WaitReason.UNREACHABLE:
        raise ServiceError(f"lost contact while waiting for the port: {outcome.detail}", host=host.name)
    raise PortBusy(
        f"port {host.ddtree.server.port} still in use after {port_wait_s:.0f}s by a process we did not launch; "
        "nothing launched",
        host=host.name,
    )


def _tail_text(attempt: _Attempt) -> str:
    lines = list(attempt.tail)[-6:]
    return " | ".join(ln.strip() for ln in lines) if lines else "(log empty)"


def stop(transport: Transport, host: Host, *, grace_s: float = 30.0, lease: LeasePass | None = None) -> StopResult:
    """Stop the server we launched on ``host`` (SIGTERM to its group, SIGKILL after ``grace_s``).

    Refused at once (LeaseHeld) while a sweep other than ``lease.token``'s holds the host,
    unless ``lease.force``; ``lease`` None means :class:`LeasePass()`.
    """
    result = manager_for(transport, host).stop(grace_s=grace_s, lease=lease if lease is not None else LeasePass())
    if result.was_running and not result.exited:
        raise ServiceError(f"pid {result.pid} survived SIGKILL", host=host.name)
    return result


def service_status(transport: Transport, host: Host, *, log_lines: int = 5) -> ServiceStatus:
    """Is our server running, is it the one on the port, does it answer generation; under
    systemd also the unit's state, its restarts and whether our drop-in is in effect."""
    svc = manager_for(transport, host)
    data = svc.status(lines=log_lines)
    # While a sweep's launch runs, it is the one described (its own record); the host's
    # launch record stays what a later restart repeats.
    swept = data.get("sweep") if isinstance(data.get("sweep"), dict) else None
    rec = swept or data.get("record") or {}
    unit = data.get("unit") if isinstance(data.get("unit"), dict) else None
    ours = (bool(data.get("dropin_in_effect")) or swept is not None) if unit is not None else True
    run = rec.get("run") if ours else ("the unit's own ExecStart" if unit is not None else None)
    return ServiceStatus(
        host=host.name,
        running=bool(data.get("alive")),
        pid=data.get("pid", rec.get("pid")),
        # Under systemd the record describes the unit's process only while our drop-in runs it.
        argv=tuple(rec.get("argv") or ()) if ours else (),
        started_at=rec.get("started_at"),
        port_open=bool(data.get("port_open")),
        serving_ours=data.get("listener_ours"),
        health=data.get("health"),
        cuda_graph=rec.get("cuda_graph") if ours else None,
        run=f"{run} (a sweep's launch)" if swept is not None and run else run,
        log_tail=tuple(data.get("log_tail") or ()),
        manager=svc.kind,
        unit=UnitState.of(host.ddtree.server.unit, unit, ours) if unit is not None else None,
    )


@dataclass(frozen=True)
class PreviousServer:
    """What ran on a host before a change (its launch record), to put back on failure.

    ``operator``: a systemd unit on its operator's own ExecStart (no drop-in of ours)."""

    host: str
    running: bool
    pid: int | None = None
    argv: tuple[str, ...] = ()
    launch_command: str | None = None
    cuda_graph: bool = True
    run: str | None = None  # RunConfig.describe() of its launch
    operator: bool = False

    def describe(self) -> str:
        if not self.running:
            return "no server"
        return "the unit's own ExecStart" if self.operator else (self.run or "a server")


def remember_server(transport: Transport, host: Host) -> PreviousServer:
    """The server we launched on ``host`` last (under systemd: what the unit runs, our
    drop-in's launch or its operator's), and whether it still runs."""
    data = manager_for(transport, host).status(lines=0)
    rec = data.get("record") or {}
    # A sweep's server running there is not the host's launch: that one does not run then.
    running = bool(data.get("alive")) and not isinstance(data.get("sweep"), dict)
    if isinstance(data.get("unit"), dict) and not data.get("dropin_in_effect"):
        return PreviousServer(host=host.name, running=running, pid=data.get("pid"), operator=True)
    pid = data.get("pid", rec.get("pid"))
    return PreviousServer(
        host=host.name,
        running=running,
        pid=pid if isinstance(pid, int) else None,
        argv=tuple(str(a) for a in rec.get("argv") or ()),
        launch_command=rec.get("launch_command") if isinstance(rec.get("launch_command"), str) else None,
        cuda_graph=rec.get("cuda_graph") is not False,
        run=rec.get("run") if isinstance(rec.get("run"), str) else None,
    )


def restore_server(
    transport: Transport,
    host: Host,
    previous: PreviousServer,
    *,
    state: StateStore | None = None,
    lease: LeasePass | None = None,
    stop_grace_s: float = 30.0,
    port_wait_s: float = 120.0,
    poll_interval_s: float = 0.5,
) -> str:
    """Put ``host`` back to ``previous``: stop what runs now, and relaunch the previous server
    with its recorded argv (its env is the inventory's, as at its launch) until it serves
    again, proven like any launch (identity, startup time, its tree). Not a restart with a
    fresh argv: the one that ran is the one that comes back, whatever flags built it. Under
    systemd the previous drop-in is written back (or ours removed, for a unit that ran its
    operator's ExecStart) and the unit started only if it ran before.

    Returns what was done, one phrase; raises ServiceError when it could not be done. No
    cancel event: a rollback is what an interrupted change needs to finish. ``lease``: the
    change's own pass (a sweep's lease it overrode with ``--force`` must not block its undo).
    """
    state = state if state is not None else StateStore()
    svc = manager_for(transport, host)
    model = host.ddtree.server.model_path or ""
    learned = state.learned_load_s(host.name, model)
    window = DeadlinePolicy().window(host.ddtree.server.expected_load_s, learned)
    # Our previous launch comes back from its record (a running one must have a usable one);
    # a unit's own ExecStart, or nothing ever launched, needs none.
    spec = _previous_spec(host, previous) if not previous.operator and (previous.running or previous.argv) else None
    lock_ttl_s = 2 * (window.longest_s + port_wait_s + stop_grace_s) + 120
    with manager.restart_lock(transport, host, ttl_s=lock_ttl_s, command="rollback", lease=lease):
        svc.stop(grace_s=stop_grace_s)
        if not previous.running:
            if isinstance(svc, SystemdManager):
                svc.configure(None if previous.operator else spec)
                return "unit stopped, its previous configuration back (it did not run before)"
            return "stopped (no server ran before)"
        _wait_port_free(transport, host, port_wait_s=port_wait_s, cancel=None, emit=lambda _e: None)
        if previous.operator:
            assert isinstance(svc, SystemdManager)  # only a unit has an operator's ExecStart
            launched = svc.start_operator()
            spec = operator_spec(host, launched_argv(svc))
        else:
            assert spec is not None
            launched = svc.start(spec)
        outcome, attempt = wait_ready(transport, host, spec, launched, window=window, poll_interval_s=poll_interval_s)
        if outcome.reason is not WaitReason.READY:
            raise ServiceError(
                f"relaunching the previous server ({previous.describe()}) ended {outcome.reason}: {outcome.detail}; "
                f"log tail: {_tail_text(attempt)}",
                host=host.name,
            )
    return f"relaunched the previous server ({previous.describe()}, pid {launched.pid})"


def launched_argv(svc: ServiceManager) -> tuple[str, ...]:
    """The argv the server just launched runs with, from its launch record."""
    rec = svc.status(lines=0).get("record") or {}
    return tuple(str(a) for a in rec.get("argv") or ())


def operator_spec(host: Host, argv: tuple[str, ...]) -> LaunchSpec:
    """What readiness holds a unit's own ExecStart to: its argv as the process has it, the
    flags after the launcher (``-m sglang.launch_server``, ``sglang serve``) as its
    ``launch_command``, the speculative configuration read back from them."""
    markers = {"sglang.launch_server", *launch_markers(host)}
    cut = next((i + 1 for i, w in enumerate(argv) if (w in markers and i > 0 and argv[i - 1] == "-m")
                or (w == "serve" and i > 0 and argv[i - 1].endswith("sglang"))), len(argv))
    server = host.ddtree.server
    server_args = argv[cut:]
    return LaunchSpec(
        host=host.name, argv=argv, server_args=server_args, env=MappingProxyType(dict(server.env)), port=server.port,
        probe_host=probe_address(server.bind_host), cuda_graph=True, model=server.model_path or "",
        run=_run_of(server_args),
    )


def rollback_unit(
    transport: Transport, host: Host, *, restart: bool, state: StateStore | None = None, lease: LeasePass | None = None,
    stop_grace_s: float = 30.0, poll_interval_s: float = 0.5,
) -> str:
    """``rollback --restart`` of a systemd host: our drop-in removed, and with ``restart``
    the unit restarted on its operator's own ExecStart and proven to serve. The process
    manager has no operator's launch to go back to: its server is left as it is."""
    svc = manager_for(transport, host)
    if not isinstance(svc, SystemdManager):
        return "server left as it is (the process manager has no launch of the operator's to go back to)"
    previous = PreviousServer(host=host.name, running=restart, operator=True)
    return restore_server(transport, host, previous, state=state, lease=lease, stop_grace_s=stop_grace_s,
                          poll_interval_s=poll_interval_s)


def last_run(transport: Transport, host: Host) -> RunConfig:
    """What ``host`` launched last through ddtree-ops, as a run configuration to launch again
    (``restart`` without ``--algorithm``): its algorithm, tree and runtime-state file, read back
    from the launch record. ConfigError where there is none to repeat: nothing recorded, or a
    systemd unit on its operator's own ExecStart."""
    previous = remember_server(transport, host)
    if previous.operator:
        raise ConfigError(
            f"{host.ddtree.server.unit} runs its own ExecStart, not a launch of ddtree-ops: give --algorithm (AR, "
            f"DFLASH or DDTREE) to launch one, or `systemctl restart {host.ddtree.server.unit}` on the host",
            host=host.name,
        )
    if not previous.argv:
        raise ConfigError("no launch of ddtree-ops recorded here to repeat: give --algorithm (AR, DFLASH or DDTREE)",
                          host=host.name)
    return _previous_spec(host, previous).run


def _previous_spec(host: Host, previous: PreviousServer) -> LaunchSpec:
    """The launch spec of a recorded launch: its argv as it was; the flags readiness compares
    with ``launch_command`` are the argv's tail that the record names as such."""
    argv = previous.argv
    cut = next((k for k in range(len(argv)) if " ".join(argv[k:]) == previous.launch_command), None)
    if not argv or cut is None:
        raise ServiceError(
            "cannot relaunch the previous server: its launch record has no argv and launch command", host=host.name
        )
    server = host.ddtree.server
    server_args = argv[cut:]
    return LaunchSpec(
        host=host.name, argv=argv, server_args=server_args, env=MappingProxyType(dict(server.env)), port=server.port,
        probe_host=probe_address(server.bind_host), cuda_graph=previous.cuda_graph, model=server.model_path or "",
        run=_run_of(server_args),
    )


def _run_of(server_args: tuple[str, ...]) -> RunConfig:
    """The speculative configuration a recorded launch asked for, read back from its flags
    (for readiness's tree check); AR where the flags do not say one we build."""
    flags = dict(zip(server_args, server_args[1:], strict=False))
    algorithm = flags.get("--speculative-algorithm", "AR")
    try:
        tokens = int(flags["--speculative-num-draft-tokens"]) if "--speculative-num-draft-tokens" in flags else None
        if algorithm == "DDTREE":
            topk = int(flags["--speculative-eagle-topk"]) if "--speculative-eagle-topk" in flags else None
            return RunConfig("DDTREE", budget=None if tokens is None else tokens - 1, topk=topk,
                             adaptive_config=flags.get("--speculative-adaptive-config"))
        if algorithm == "DFLASH":
            return RunConfig("DFLASH", budget=tokens)
    except (ValueError, ConfigError):
        pass
    return RunConfig("AR")


def whole_host_server(transport: Transport, machine: Host) -> int | None:
    """The pid of a server launched on ``machine`` as one server, not in a GPU slot (its
    own run_dir's launch record), if it still runs; else None.

    Such a server was launched before the host's inventory gained slots (or by a command
    that does not know slots): it holds every GPU and maybe a slot's port, so a slot must
    not launch next to it, and stopping the whole host must stop it too."""
    if machine.ddtree.server.manager == "systemd":
        return None  # a unit per slot (the template's instances); the machine runs none of its own
    data = manager_for(transport, machine).status(lines=0)
    pid = (data.get("record") or {}).get("pid")
    return int(pid) if data.get("alive") and pid is not None else None


__all__ = [
    "DEFAULT_SMOKE",
    "LaunchFacts",
    "ServerOutcome",
    "Unchanged",
    "converge",
    "first_launch",
    "PreviousServer",
    "RestartRequest",
    "RestartResult",
    "RunConfig",
    "ServiceStatus",
    "StopResult",
    "UnitState",
    "launch_facts",
    "last_run",
    "launched_argv",
    "manager_for",
    "operator_spec",
    "prepare_restart",
    "remember_server",
    "restart",
    "restore_server",
    "rollback_unit",
    "service_status",
    "stop",
    "whole_host_server",
    "with_tree_policy",
]
