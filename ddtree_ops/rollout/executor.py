"""Carrying out a rollout: batch by batch, the canary gated, failures put back.

A command describes its per-host change as a :class:`HostChange` (what to remember before,
the change itself, how to put a host back) and this module runs it over the plan's batches
(:mod:`.plan`): every host of a batch in parallel, the next batch only once the whole batch
is done, the rollout stopped when more hosts failed than ``max_fail`` allows (a canary that
fails always stops it). Hosts of batches never started are reported as not reached: their
patch, configuration and server are as they were.

On a canary the gate (:mod:`.gate`) runs around the change: its server answers the gate's
prompts before (the target alone is launched first where nothing serves), the change is
applied, the server answers again, and a failed verdict puts the canary back (the change's
own undo: patch and launch configuration, the previous server relaunched) before the error
is raised. ``rollback_on_failure`` puts back any host whose change fails.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ddtree_ops.errors import DdtreeOpsError
from ddtree_ops.fleet import FleetResult, run_interruptible
from ddtree_ops.inventory_types import Host
from ddtree_ops.rollout.gate import (
    GateAnswer,
    GateSpec,
    GateVerdict,
    answers,
    has_logprobs,
    judge_gate,
    rejects_canary,
)
from ddtree_ops.rollout.observe import HostSnapshot, observe_host, unobserved
from ddtree_ops.rollout.plan import RolloutPlan
from ddtree_ops.service import lifecycle
from ddtree_ops.service.launch import RunConfig
from ddtree_ops.service.manager import Launched
from ddtree_ops.transport.base import Transport

T = TypeVar("T")
B = TypeVar("B")


class HostChange(ABC, Generic[T, B]):
    """One host's part of a rolling change: ``remember`` what runs there (``B``), ``apply``
    the change (its result ``T``), ``undo`` it from what was remembered."""

    #: what the changed servers serve (the gate checks acceptance only where it speculates)
    run: RunConfig

    @abstractmethod
    def remember(self, transport: Transport, host: Host) -> B:
        """What ``undo`` needs to put ``host`` back (read before anything changes)."""

    @abstractmethod
    def apply(self, transport: Transport, host: Host, cancel: threading.Event) -> T:
        """The change on ``host``; raises a DdtreeOpsError naming the host when it fails."""

    @abstractmethod
    def undo(self, transport: Transport, host: Host, before: B) -> str:
        """Put ``host`` back to ``before``; one phrase saying what was done (never raises:
        what could not be done is said)."""

    @abstractmethod
    def gate_error(self, message: str, host: str) -> DdtreeOpsError:
        """The error a failed gate raises (its class carries the command's exit code)."""

    def describe(self) -> str:
        """What a changed host runs now, for the rollout's summary."""
        return self.run.describe()

    def check(self, transport: Transport, host: Host) -> None:
        """Refuse ``host`` (raise) for what can be known without changing anything; run on
        every target before the first batch. By default: each server's manager (a systemd
        unit not found, masked, not an SGLang launch, no root login)."""
        for server in host.slot_hosts():
            lifecycle.manager_for(transport, server).preflight()

    def observe(self, transport: Transport, host: Host) -> HostSnapshot:
        """``host`` as it is now (by default its servers only), for the closing observation."""
        return observe_host(transport, host, patch=False)

    def verify(self, host: Host, snapshot: HostSnapshot, value: T) -> DdtreeOpsError | None:
        """What the observed ``snapshot`` contradicts of ``value``, the change's own report of
        ``host`` (None: the host is observed as the change left it)."""
        return None


@dataclass(frozen=True)
class RolloutEvent:
    """A batch starting (``done`` False) or ending, for the live board and the batch log."""

    batch: int
    batches: int
    hosts: tuple[str, ...]
    canary: bool
    done: bool = False
    failed: tuple[str, ...] = ()


@dataclass(frozen=True)
class RolloutResult(Generic[T]):
    """Every reached host's value or error (``results``), the gate's verdict per canary
    server, the batches as run, the hosts never reached, and why the rollout stopped."""

    plan: RolloutPlan
    results: FleetResult[T]
    gates: Mapping[str, GateVerdict] = field(default_factory=dict)
    baseline_notes: Mapping[str, str] = field(default_factory=dict)
    not_reached: tuple[str, ...] = ()
    stopped: str | None = None
    described: str = ""
    rolled_back: tuple[str, ...] = ()
    # Every target as observed at the end of the command (not reached ones too).
    observed: Mapping[str, HostSnapshot] = field(default_factory=dict)
    # Targets whose check refused them before the first batch (the rollout then changed nothing).
    refused: tuple[str, ...] = ()

    def batch_log(self) -> list[str]:
        """The batches in the order they ran (those not started marked so)."""
        out = []
        for i, batch in enumerate(self.plan.batches, 1):
            label = " (canary)" if self.plan.canary and i == 1 else ""
            refused = [h for h in batch if h in self.refused]
            if all(h in self.not_reached or h in self.refused for h in batch):
                state = "not started" + (f" ({', '.join(refused)} refused by its checks)" if refused else "")
            else:
                failed = [h for h in batch if h in self.results.failed]
                state = f"{len(failed)} failed" if failed else "done"
            out.append(f"batch {i}{label}: {', '.join(batch)} — {state}")
        return out

    def summary(self) -> list[str]:
        """Which hosts are on what, after the rollout: a host is named on the new
        configuration only when it was observed there at the end."""
        updated = list(self.results.succeeded)
        failed = [h for h in self.results.failed if h not in self.rolled_back and h not in self.refused]
        out = []
        if self.refused:
            out.append(f"refused before any change ({', '.join(self.refused)}): no host was changed")
        if updated:
            out.append(f"on the new configuration ({self.described}): {', '.join(updated)}")
        if self.rolled_back:
            out.append(f"put back to what they ran before: {', '.join(self.rolled_back)}")
        if failed:
            out.append(f"failed, left as the error says: {', '.join(failed)}")
        if self.not_reached:
            out.append(f"not reached, on their old patch, configuration and server: {', '.join(self.not_reached)}")
        if self.stopped:
            out.append(f"rollout stopped: {self.stopped}")
        return out


def _server_of(transport: Transport, host: Host) -> Launched | None:
    """The server ``host`` runs now, as a handle the gate's requests can check for life;
    None when none answers."""
    status = lifecycle.manager_for(transport, host).status(lines=0)
    pid = status.get("pid", (status.get("record") or {}).get("pid"))
    if not status.get("alive") or status.get("health") != 200 or not isinstance(pid, int):
        return None
    return Launched(pid=pid, pstart=None, started_at=0.0, log_path="")


def ask(
    transport: Transport, host: Host, spec: GateSpec, temperature: float, *, logprobs: bool = True
) -> tuple[GateAnswer, ...]:
    """The gate's prompts, at ``temperature``, to the server ``host`` runs now (from the
    host itself, like every probe); at T = 0 with the target's log-probabilities unless
    ``logprobs`` is False."""
    server = _server_of(transport, host)
    if server is None:
        reason = "no server answers"
        return tuple(GateAnswer(p.id, None, None, 0, 0, reason) for p in spec.prompts)
    reply = lifecycle.manager_for(transport, host).smoke(
        server, [spec.round(temperature, logprobs=logprobs)], request_timeout=spec.request_timeout_s,
        keep_tokens=True)
    return answers(reply, spec)


@dataclass
class _Baseline:
    answers: dict[str, tuple[GateAnswer, ...]]
    note: str = ""


def capture_baseline(
    transport: Transport, host: Host, spec: GateSpec, *, cancel: threading.Event
) -> _Baseline:
    """Each server's greedy answers before the change, with the target's log-probabilities;
    where none serves, the target alone (AR) is launched first to give them (the launch is
    then what runs before). A server that refuses the log-probabilities (0.5.23's UNO aborts
    such a request) is asked again without them, and one that answers without them is kept
    so: its tokens still compare, but no divergence from them can be shown to be a tie."""
    out: dict[str, tuple[GateAnswer, ...]] = {}
    launched: list[str] = []
    notes: list[str] = []
    for server in host.slot_hosts():
        if _server_of(transport, server) is None:
            request = lifecycle.prepare_restart(transport, server, RunConfig("AR"), smoke=None)
            lifecycle.restart(transport, request, cancel=cancel)
            launched.append(server.name)
        got = ask(transport, server, spec, 0.0)
        if not any(a.ok for a in got):
            plain = ask(transport, server, spec, 0.0, logprobs=False)
            if any(a.ok for a in plain):
                notes.append(f"{server.name} refused the gate's request for log-probabilities ({got[0].error}) and "
                             f"answered without: every greedy divergence from it fails the gate")
                got = plain
        elif not has_logprobs(got):
            notes.append(f"{server.name} returned no log-probabilities: every greedy divergence from it fails the gate")
        out[server.name] = got
    if launched:
        notes.insert(0, f"no server answered on {', '.join(launched)}: launched the target alone (AR) for the "
                        f"baseline")
    return _Baseline(out, "; ".join(notes))


def check_gate(
    transport: Transport, host: Host, spec: GateSpec, baseline: _Baseline, *, speculative: bool
) -> dict[str, GateVerdict]:
    """Each server's verdict after the change: asked the same requests as before it (with
    log-probabilities where the baseline gave them), so that their speeds compare."""
    out: dict[str, GateVerdict] = {}
    for server in host.slot_hosts():
        logprobs = has_logprobs(baseline.answers[server.name])
        after = {t: ask(transport, server, spec, t, logprobs=logprobs) for t in spec.temperatures}
        out[server.name] = judge_gate(spec, baseline.answers[server.name], after, speculative=speculative)
    return out


def run_rollout(
    plan: RolloutPlan,
    hosts: Mapping[str, Host],
    change: HostChange[T, B],
    *,
    connect: Callable[[Host], AbstractContextManager[Transport]],
    gate: GateSpec | None = None,
    rollback_on_failure: bool = False,
    max_parallel: int = 8,
    cancel: threading.Event | None = None,
    on_event: Callable[[RolloutEvent], None] | None = None,
    observe: bool = True,
) -> RolloutResult[T]:
    """The plan's batches in order (module docstring); never raises for a host's failure:
    it is that host's value in ``results``."""
    cancel = cancel if cancel is not None else threading.Event()
    emit = on_event or (lambda _e: None)
    gates: dict[str, GateVerdict] = {}
    notes: dict[str, str] = {}
    rolled_back: list[str] = []
    lock = threading.Lock()
    speculative = change.run.algorithm != "AR"

    def one(host: Host) -> T:
        gated = gate is not None and host.name in plan.canary
        with connect(host) as t:
            before = change.remember(t, host) if gated or rollback_on_failure else None
            baseline = None
            try:
                # A gated canary that fails before its gate (its baseline's launch, its change: a
                # crash while loading, a hung load, a refused start) is a rejected canary: the
                # change's gate error (its exit code), the original cause kept in its message.
                stage = "its baseline (the server before the change)"
                try:
                    if gated:
                        assert gate is not None
                        baseline = capture_baseline(t, host, gate, cancel=cancel)
                        if baseline.note:
                            notes[host.name] = baseline.note
                    stage = "the change"
                    value = change.apply(t, host, cancel)
                except DdtreeOpsError as exc:
                    if gated and rejects_canary(exc):
                        cause = exc.message if exc.host in (None, host.name) else str(exc)  # a slot names itself
                        raise change.gate_error(f"canary {host.name} rejected before its gate, {stage} failed: "
                                                f"{cause}", host.name) from exc
                    raise
                if gated:
                    assert gate is not None and baseline is not None
                    verdicts = check_gate(t, host, gate, baseline, speculative=speculative)
                    with lock:
                        gates.update(verdicts)
                    failed = [f"{name}: {v.describe()}" for name, v in verdicts.items() if not v.passed]
                    if failed:
                        raise change.gate_error(f"canary {'; '.join(failed)}", host.name)
                return value
            except DdtreeOpsError as exc:
                if before is not None:
                    undone = change.undo(t, host, before)
                    with lock:
                        rolled_back.append(host.name)
                    exc.message = f"{exc.message}; {undone}"
                raise

    values: dict[str, T | BaseException] = {}
    not_reached: list[str] = []
    stopped: str | None = None

    def checked(host: Host) -> None:
        with connect(host) as t:
            change.check(t, host)

    # Everything that can be known without a change, on every target, before batch 1: a
    # host that would be refused later must not leave the others changed and the fleet split.
    checks = run_interruptible([hosts[name] for name in plan.hosts], checked, max_parallel=max_parallel,
                               cancel=cancel)
    refused = tuple(name for name in plan.hosts if name in checks.failed)
    if cancel.is_set():
        stopped = "interrupted (Ctrl-C) before any change"
    elif len(refused) > plan.max_fail:
        stopped = f"refused before any change: {len(refused)} host(s) failed their checks, more than " \
                  f"--max-fail {plan.max_fail} allows"
    elif set(refused) & set(plan.canary):
        stopped = "refused before any change: the canary failed its checks"
    values.update({name: checks.failed[name] for name in refused})
    for index, batch in enumerate(plan.batches, 1):
        batch = tuple(h for h in batch if h not in refused)
        if not batch:
            continue
        is_canary = bool(plan.canary) and index == 1
        if stopped is not None:
            not_reached += batch
            continue
        emit(RolloutEvent(index, len(plan.batches), batch, is_canary))
        result = run_interruptible([hosts[name] for name in batch], one, max_parallel=max_parallel, cancel=cancel)
        values.update(dict(result))
        failed = tuple(result.failed)
        emit(RolloutEvent(index, len(plan.batches), batch, is_canary, done=True, failed=failed))
        total_failed = sum(isinstance(v, BaseException) for v in values.values())
        rest = index < len(plan.batches)
        if cancel.is_set() and rest:
            stopped = "interrupted (Ctrl-C)"
        elif is_canary and failed and rest:
            stopped = f"the canary {', '.join(failed)} failed"
        elif total_failed > plan.max_fail and rest:
            stopped = f"{total_failed} host(s) failed, more than --max-fail {plan.max_fail} allows"
    observed = observe_all(plan, hosts, change, values, connect=connect, max_parallel=max_parallel) \
        if observe else {}
    return RolloutResult(
        plan=plan, results=FleetResult({n: values[n] for n in plan.hosts if n in values}), gates=gates,
        baseline_notes=notes, not_reached=tuple(not_reached), stopped=stopped, described=change.describe(),
        rolled_back=tuple(h for h in plan.hosts if h in rolled_back), observed=observed,
        refused=refused if stopped is not None and refused else (),
    )


def observe_all(
    plan: RolloutPlan, hosts: Mapping[str, Host], change: HostChange[T, B], values: dict[str, T | BaseException], *,
    connect: Callable[[Host], AbstractContextManager[Transport]], max_parallel: int,
) -> dict[str, HostSnapshot]:
    """Every target observed now (in parallel; never cancelled: this is what the command
    reports), and each host the change reported done judged against it: a contradiction
    replaces its value in ``values`` with the error :meth:`HostChange.verify` names."""

    def one(host: Host) -> HostSnapshot:
        try:
            with connect(host) as t:
                return change.observe(t, host)
        except DdtreeOpsError as exc:
            return unobserved(host, exc.message)

    # Its own cancel event, never looked at: a Ctrl-C here waits for the observation it interrupts.
    snapshots = run_interruptible([hosts[name] for name in plan.hosts], one, max_parallel=max_parallel,
                                  cancel=threading.Event())
    out: dict[str, HostSnapshot] = {}
    for name in plan.hosts:
        snap = snapshots.succeeded.get(name)
        if snap is None:
            failure = snapshots.failed.get(name)
            snap = unobserved(hosts[name], f"{type(failure).__name__}: {failure}")
        out[name] = snap
        value = values.get(name)
        if name in values and not isinstance(value, BaseException):
            problem = change.verify(hosts[name], snap, value)  # type: ignore[arg-type]
            if problem is not None:
                values[name] = problem
    return out


def hosts_by_name(hosts: Sequence[Host]) -> dict[str, Host]:
    return {h.name: h for h in hosts}


__all__ = [
    "HostChange",
    "RolloutEvent",
    "RolloutResult",
    "ask",
    "capture_baseline",
    "check_gate",
    "hosts_by_name",
    "run_rollout",
]
