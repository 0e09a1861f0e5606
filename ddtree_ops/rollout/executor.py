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
from ddtree_ops.rollout.gate import GateAnswer, GateSpec, GateVerdict, answers, judge_gate
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

    def batch_log(self) -> list[str]:
        """The batches in the order they ran (those not started marked so)."""
        out = []
        for i, batch in enumerate(self.plan.batches, 1):
            label = " (canary)" if self.plan.canary and i == 1 else ""
            if all(h in self.not_reached for h in batch):
                state = "not started"
            else:
                failed = [h for h in batch if h in self.results.failed]
                state = f"{len(failed)} failed" if failed else "done"
            out.append(f"batch {i}{label}: {', '.join(batch)} — {state}")
        return out

    def summary(self) -> list[str]:
        """Which hosts are on what, after the rollout."""
        updated = list(self.results.succeeded)
        failed = [h for h in self.results.failed if h not in self.rolled_back]
        out = []
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


def ask(transport: Transport, host: Host, spec: GateSpec, temperature: float) -> tuple[GateAnswer, ...]:
    """The gate's prompts, at ``temperature``, to the server ``host`` runs now (from the
    host itself, like every probe)."""
    server = _server_of(transport, host)
    if server is None:
        reason = "no server answers"
        return tuple(GateAnswer(p.id, None, None, 0, 0, reason) for p in spec.prompts)
    reply = lifecycle.manager_for(transport, host).smoke(
        server, [spec.round(temperature)], request_timeout=spec.request_timeout_s, keep_tokens=True)
    return answers(reply, spec)


@dataclass
class _Baseline:
    answers: dict[str, tuple[GateAnswer, ...]]
    note: str = ""


def capture_baseline(
    transport: Transport, host: Host, spec: GateSpec, *, cancel: threading.Event
) -> _Baseline:
    """Each server's greedy answers before the change; where none serves, the target
    alone (AR) is launched first to give them (the launch is then what runs before)."""
    out: dict[str, tuple[GateAnswer, ...]] = {}
    launched: list[str] = []
    for server in host.slot_hosts():
        if _server_of(transport, server) is None:
            request = lifecycle.prepare_restart(transport, server, RunConfig("AR"), smoke=None)
            lifecycle.restart(transport, request, cancel=cancel)
            launched.append(server.name)
        out[server.name] = ask(transport, server, spec, 0.0)
    note = f"no server answered on {', '.join(launched)}: launched the target alone (AR) for the baseline" \
        if launched else ""
    return _Baseline(out, note)


def check_gate(
    transport: Transport, host: Host, spec: GateSpec, baseline: _Baseline, *, speculative: bool
) -> dict[str, GateVerdict]:
    """Each server's verdict after the change."""
    out: dict[str, GateVerdict] = {}
    for server in host.slot_hosts():
        after = {t: ask(transport, server, spec, t) for t in spec.temperatures}
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
                if gated:
                    assert gate is not None
                    baseline = capture_baseline(t, host, gate, cancel=cancel)
                    if baseline.note:
                        notes[host.name] = baseline.note
                value = change.apply(t, host, cancel)
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
    for index, batch in enumerate(plan.batches, 1):
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
    return RolloutResult(
        plan=plan, results=FleetResult({n: values[n] for n in plan.hosts if n in values}), gates=gates,
        baseline_notes=notes, not_reached=tuple(not_reached), stopped=stopped, described=change.describe(),
        rolled_back=tuple(h for h in plan.hosts if h in rolled_back),
    )


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
