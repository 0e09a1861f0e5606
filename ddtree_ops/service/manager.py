"""The service managers' interface, and the process manager (``manager: process``).

A host's SGLang server is run either by ddtree-ops itself (:class:`ProcessManager`: the
agent launches it in a session of its own and keeps a launch record) or by the host's
systemd (:class:`ddtree_ops.service.systemd.SystemdManager`: a unit the operator owns,
driven through one drop-in). Both answer the same :class:`ServiceManager` calls, so
readiness, the smoke, eager fallbacks, sweeps and rollouts do not know which one runs the
server; ``lifecycle.manager_for`` picks it from the inventory.

The process manager's files live in the host's ``run_dir``: ``server.log``
(stdout+stderr, previous run kept as ``server.log.prev``) and ``launch.json`` (pid, kernel
start time against pid reuse, argv, argv hash, launch time). The restart lock and the
sweep lease live there too, for either manager.

A bench sweep's launches (made inside :func:`sweep_launch`) never replace the host's own
launch: the process manager records them in ``sweep-launch.json`` and systemd runs them
from a runtime drop-in under ``/run``, so ``launch.json`` and our ``/etc`` drop-in keep
what a bare ``restart`` repeats and what the sweep puts back. Such a launch's record (and
drop-in) lasts as long as its process: a stop, or a launch that is not a sweep's, ends it.
"""

from __future__ import annotations

import base64
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar

from ddtree_ops import lockholder
from ddtree_ops.errors import DdtreeOpsError, LeaseHeld, PortBusy, ServiceError
from ddtree_ops.inventory_types import Host
from ddtree_ops.service.agent import (
    LEASE_FILE,
    LOCK_FILE,
    Launched,
    LeasePass,
    LogPosition,
    StopResult,
    base_payload,
    call_agent,
    dead_lease,
    holder_of,
    lease_checked,
    lease_refusal,
)
from ddtree_ops.service.launch import LaunchSpec
from ddtree_ops.transport.base import Transport

LOG_FILE = "server.log"

# The sweep whose launches this thread makes (see the module docstring). A context rather
# than a field of every restart request: ``lifecycle.restart`` builds its manager from the
# host, and only a sweep's own restarts may launch this way.
_SWEEP_LAUNCH: ContextVar[dict[str, Any] | None] = ContextVar("ddtree_ops_sweep_launch", default=None)


@contextmanager
def sweep_launch(sweep: dict[str, Any]) -> Iterator[None]:
    """Launches made in the body are a sweep's (``sweep``: its name, run id and lease token,
    kept in their record): recorded apart from the host's own launch."""
    reset = _SWEEP_LAUNCH.set(dict(sweep))
    try:
        yield
    finally:
        _SWEEP_LAUNCH.reset(reset)


def sweep_marker() -> dict[str, Any] | None:
    """The sweep whose launch a manager's ``start`` makes now, or None (the host's own)."""
    return _SWEEP_LAUNCH.get()


class ServiceManager(ABC):
    """One host's (or GPU slot's) server under one kind of manager.

    Every call is one round trip to the host's agent and either answers or raises a
    :class:`~ddtree_ops.errors.ServiceError` (or a TransportError). ``poll``, ``status`` and
    ``read_logs`` answer the agent's dicts, read by the readiness loop and the CLI.
    """

    kind: ClassVar[str]
    # systemd may start the server again after it exits (the unit's Restart=): a launch that
    # failed must then be stopped, not left to crash-loop with a configuration that failed.
    revives_exited_server: ClassVar[bool] = False

    def __init__(self, transport: Transport, host: Host) -> None:
        self.transport = transport
        self.host = host

    def call(self, action: str, payload: dict[str, Any], *, timeout: float = 60.0) -> dict[str, Any]:
        return call_agent(self.transport, self.host, action, payload, timeout=timeout)

    def payload(self) -> dict[str, Any]:
        return base_payload(self.host)

    def preflight(self) -> None:
        """Refuse, before anything on the host changes, what this manager cannot do there
        (the process manager can always launch: nothing to check)."""
        return None

    @abstractmethod
    def start(self, spec: LaunchSpec, *, check_port: bool = True) -> Launched:
        """Launch ``spec``. Refuses if our last server lives or the port is taken.

        ``check_port=False`` launches next to whatever holds the port: that is the race real
        deployments hit when a restart does not wait, and the readiness tests recreate it."""

    @abstractmethod
    def stop(self, *, grace_s: float = 30.0, lease: LeasePass | None = None) -> StopResult:
        """Stop the server (SIGTERM, SIGKILL after ``grace_s``). ``lease``: how a sweep's
        lease on the host is treated (:class:`LeasePass`); None checks none, for a caller
        that holds the restart lock (which checked it)."""

    @abstractmethod
    def poll(self, launched: Launched, position: LogPosition, *, http_timeout: float = 5.0) -> dict[str, Any]:
        """Everything readiness needs in one round trip: alive, new log lines from
        ``position`` (and the next position), port, socket owner, health, server_info."""

    @abstractmethod
    def status(self, *, lines: int = 5) -> dict[str, Any]:
        """The launch record, whether it runs, the port, health and the log's tail."""

    @abstractmethod
    def read_logs(self, *, lines: int = 50, position: LogPosition | None = None) -> dict[str, Any]:
        """The log's last ``lines`` (``position`` None), or what came after ``position``."""

    def smoke(
        self, launched: Launched, rounds: list[list[dict[str, Any]]], *, request_timeout: float,
        keep_tokens: bool = False,
    ) -> dict[str, Any]:
        """Send the smoke's request rounds from the host itself (one round trip); the answer
        is judged by :func:`ddtree_ops.service.smoke.judge_smoke`. ``keep_tokens``: each
        answer also carries the generated ``output_ids`` and ``text`` (a rollout's gate)."""
        payload = self.payload() | {
            "pid": launched.pid,
            "pstart": launched.pstart,
            "rounds": rounds,
            "request_timeout": request_timeout,
            "keep_tokens": keep_tokens,
        }
        return self.call("smoke", payload, timeout=len(rounds) * (request_timeout + 10) + 30)

    def port_open(self) -> bool:
        """Connect test from the host itself (the port is usually bound to its loopback)."""
        return bool(call_agent(self.transport, self.host, "portcheck", self.payload(), timeout=30)["port_open"])


class ProcessManager(ServiceManager):
    """ddtree-ops runs the server: launched by the agent in a new session, stopped by
    signalling that session's process group."""

    kind = "process"

    def start(self, spec: LaunchSpec, *, check_port: bool = True) -> Launched:
        host = self.host
        payload = self.payload() | {
            "check_port": check_port,
            "argv": list(spec.argv),
            "env": dict(spec.env),
            "argv_hash": spec.argv_hash,
            "launch_command": spec.launch_command,
            "cuda_graph": spec.cuda_graph,
            "run": spec.run.describe(),
            "sweep": sweep_marker(),
        }
        data = self.call("start", payload, timeout=60)
        err = data.get("error")
        if err == "running":
            raise ServiceError(
                f"a server we launched is still running (pid {data.get('pid')}); stop it first", host=host.name
            )
        if err == "port_busy":
            raise PortBusy(f"port {host.ddtree.server.port} is in use by another process", host=host.name)
        if err == "exec":
            raise ServiceError(f"cannot start the server: {data.get('detail')}", host=host.name)
        if err:
            raise ServiceError(f"cannot start the server: {err}", host=host.name)
        return Launched(
            pid=int(data["pid"]), pstart=data.get("pstart"), started_at=float(data["started_at"]),
            log_path=str(data["log"]),
        )

    def stop(self, *, grace_s: float = 30.0, lease: LeasePass | None = None) -> StopResult:
        payload = self.payload() | {"grace_s": grace_s}
        data = lease_checked(self.transport, self.host, "stop", payload, lease, timeout=grace_s + 60)
        return stop_result(self.host, data)

    def poll(self, launched: Launched, position: LogPosition, *, http_timeout: float = 5.0) -> dict[str, Any]:
        payload = self.payload() | {
            "pid": launched.pid,
            "pstart": launched.pstart,
            "offset": position,
            "http_timeout": http_timeout,
        }
        return self.call("poll", payload, timeout=http_timeout * 2 + 30)

    def status(self, *, lines: int = 5) -> dict[str, Any]:
        return self.call("status", self.payload() | {"lines": lines}, timeout=30)

    def read_logs(self, *, lines: int = 50, position: LogPosition | None = None) -> dict[str, Any]:
        return self.call("logs", self.payload() | {"lines": lines, "offset": position}, timeout=30)


def stop_result(host: Host, data: dict[str, Any]) -> StopResult:
    return StopResult(
        host=host.name,
        was_running=bool(data.get("was_running")),
        pid=data.get("pid"),
        signal=data.get("signal"),
        waited_s=float(data.get("waited_s", 0.0)),
        exited=bool(data.get("exited", True)),
    )


def take_lease(transport: Transport, host: Host, *, token: str, holder: dict[str, Any]) -> dict[str, Any] | None:
    """Hold ``host`` for a sweep (``run_dir/sweep.lease``) under ``token``; ``holder`` is a
    :func:`ddtree_ops.lockholder.holder_record` plus ``sweep`` and ``run_id``.

    Another sweep's live lease raises :class:`LeaseHeld` at once (no waiting: its sweep
    may run for hours); a provably dead holder's lease is taken over, and returned.
    """
    payload = base_payload(host) | {"token": token, "holder": holder}
    data = call_agent(transport, host, "lease", payload)
    held = data.get("leased")
    if isinstance(held, dict) and (dead := dead_lease(held)) is not None:
        data = call_agent(transport, host, "lease", payload | {"take_over": dead})
        if data.get("ok"):
            return held
        held = data.get("leased")
    if isinstance(held, dict):
        # A sweep cannot override another's lease (no --force): its rows there wait.
        hint = "this sweep's rows on it fail now; `bench --resume` runs them once that sweep has ended"
        raise LeaseHeld(lease_refusal(host, held, data.get("now"), hint=hint), host=host.name)
    return None


def release_lease(transport: Transport, host: Host, token: str) -> None:
    """Give the host back (only the lease ``token`` took; anything else is left alone)."""
    call_agent(transport, host, "release", base_payload(host) | {"token": token})


def note_lease(transport: Transport, host: Host, token: str, note: dict[str, Any]) -> bool:
    """Keep ``note`` in the lease ``token`` holds (``note`` key of the lease record): what a
    sweep that takes a dead holder's lease over needs to know (what served before it). False
    where ``token`` no longer holds the lease."""
    payload = base_payload(host) | {"token": token, "note": note}
    return bool(call_agent(transport, host, "leasenote", payload, timeout=30).get("ok"))


def read_lease(transport: Transport, host: Host) -> dict[str, Any] | None:
    """The host's sweep lease record, or None when no sweep holds it."""
    lease = call_agent(transport, host, "leaseinfo", base_payload(host), timeout=30).get("lease")
    return lease if isinstance(lease, dict) else None


def describe_lease(held: dict[str, Any]) -> str:
    """``sweep NAME (run ID), user@controller pid N`` for warnings."""
    holder = holder_of(held)
    return (f"sweep {holder.get('sweep', '?')} (run {holder.get('run_id', '?')}), "
            f"{lockholder.describe_holder(holder)}")


@dataclass(frozen=True)
class LockTakeover:
    """A restart lock left by a provably dead holder, which this restart took over."""

    host: str
    holder: str
    age_s: float | None


def _lock_refusal(host: Host, held: dict[str, Any], now: float | None) -> str:
    """One line naming the holder, its pid, how long it has held the lock and why it still counts."""
    holder = held.get("holder")
    path = f"{host.ddtree.run_dir}/{LOCK_FILE}"
    taken, expires = held.get("taken_at"), held.get("expires_at")
    # Both times are the host's clock, so the age does not depend on ours.
    age = f" for {lockholder.format_age(now - taken)}" if isinstance(taken, (int, float)) and now else ""
    left = (f"; it expires in {lockholder.format_age(expires - now)}"
            if isinstance(expires, (int, float)) and now else "")
    if isinstance(holder, dict):
        who = f"{lockholder.describe_holder(holder)} ({holder.get('command', 'restart')})"
        why = lockholder.holder_state(holder)
    else:  # a lock written by an older ddtree-ops: only an owner string
        who = str(held.get("owner", "an unknown holder"))
        why = "recorded without holder details, so it cannot be checked"
    hint = "" if why == "still running" else f", or delete {path} if no restart runs there"
    return f"another restart is in progress on this host: lock held by {who}{age}, {why}{left}{hint}"


@contextmanager
def restart_lock(
    transport: Transport,
    host: Host,
    *,
    ttl_s: float,
    command: str = "restart",
    on_takeover: Callable[[LockTakeover], None] | None = None,
    lease: LeasePass | None = None,
) -> Iterator[None]:
    """Hold the host's restart lock (``run_dir/restart.lock``) for the body.

    Two operators (or a benchmark and a person) restarting one host at once would stop
    each other's fresh process; the lock turns that into one clear refusal. The lock
    records its holder (:func:`ddtree_ops.lockholder.holder_record`). A holder that is
    provably dead (it ran on this controller and its process is gone) is taken over at
    once, so a SIGKILLed ``restart`` or ``bench`` does not block the next one; any
    other holder blocks until the lock expires after ``ttl_s``.

    A sweep's lease on the host (``lease``, default :class:`LeasePass()`: none of ours)
    is checked in the same step: held by another sweep, the lock is refused at once
    (:class:`LeaseHeld`).
    """
    lease = lease if lease is not None else LeasePass()
    token = uuid.uuid4().hex
    payload = base_payload(host) | {
        "token": token, "holder": lockholder.holder_record(token, command), "ttl_s": ttl_s,
    }
    with lockholder.active_run(token):
        data = lease_checked(transport, host, "lock", payload, lease)
        if not data.get("ok"):
            held = data.get("held") or {}
            holder = held.get("holder")
            if isinstance(holder, dict) and lockholder.holder_is_dead(holder, run_id=held.get("token")):
                # The agent replaces the lock only if it still carries that dead holder's token.
                refused_at = data.get("now")
                data = lease_checked(transport, host, "lock", payload | {"take_over": held.get("token")}, lease)
                if data.get("ok") and on_takeover is not None:
                    taken = held.get("taken_at")
                    age = (
                        refused_at - taken
                        if isinstance(taken, (int, float)) and isinstance(refused_at, (int, float))
                        else None
                    )
                    on_takeover(LockTakeover(host.name, lockholder.describe_holder(holder), age))
            if not data.get("ok"):
                raise ServiceError(_lock_refusal(host, data.get("held") or {}, data.get("now")), host=host.name)
        try:
            yield
        finally:
            try:
                call_agent(transport, host, "unlock", base_payload(host) | {"token": token})
            except DdtreeOpsError:
                pass  # the lock expires by itself; the restart's own outcome matters more


def put_run_file(transport: Transport, host: Host, name: str, content: bytes) -> str:
    """``content`` as ``run_dir/name`` on the host (atomic), through the agent's stdin rather
    than SFTP; returns its absolute path there."""
    payload = base_payload(host) | {"name": name, "content": base64.b64encode(content).decode()}
    return str(call_agent(transport, host, "putfile", payload, timeout=60)["path"])


def sglang_version(transport: Transport, host: Host) -> str | None:
    """The remote SGLang version from package metadata (no import of sglang)."""
    return call_agent(transport, host, "version", {}, timeout=30).get("sglang_version")


__all__ = [
    "LEASE_FILE",
    "LOCK_FILE",
    "LOG_FILE",
    "Launched",
    "LeasePass",
    "LockTakeover",
    "LogPosition",
    "ProcessManager",
    "ServiceManager",
    "StopResult",
    "call_agent",
    "describe_lease",
    "note_lease",
    "put_run_file",
    "read_lease",
    "release_lease",
    "restart_lock",
    "sglang_version",
    "stop_result",
    "sweep_launch",
    "sweep_marker",
    "take_lease",
]
