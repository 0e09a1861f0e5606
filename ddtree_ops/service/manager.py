"""Process manager (``manager: process``) over the Transport.

The remote half is :mod:`._agent`, sent on stdin to the host's Python with the action
and a JSON payload as argv entries, so no inventory or user value is ever part of shell
text. Files live in the host's ``run_dir``: ``server.log`` (stdout+stderr, previous run
kept as ``server.log.prev``) and ``launch.json`` (pid, kernel start time against pid
reuse, argv, argv hash, launch time).

A systemd manager is deliberately absent: it could not be tested honestly here (no
systemd in the test machines), and an untested restart path is worse than none.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree_ops import lockholder
from ddtree_ops.errors import DdtreeOpsError, LeaseHeld, PortBusy, ServiceError
from ddtree_ops.inventory_types import Host
from ddtree_ops.service.launch import LaunchSpec, probe_address
from ddtree_ops.transport.base import Transport
from ddtree_ops.transport.hostprogram import run_program

AGENT_SOURCE = (Path(__file__).with_name("_agent.py")).read_text()
LOG_FILE = "server.log"
LOCK_FILE = "restart.lock"
LEASE_FILE = "sweep.lease"


@dataclass(frozen=True)
class Launched:
    """What the agent recorded about a fresh launch."""

    pid: int
    pstart: str | None
    started_at: float
    log_path: str


@dataclass(frozen=True)
class StopResult:
    host: str
    was_running: bool
    pid: int | None
    signal: str | None
    waited_s: float
    exited: bool


def call_agent(
    transport: Transport, host: Host, action: str, payload: dict[str, Any], *, timeout: float = 60.0
) -> dict[str, Any]:
    """One round trip to the remote agent (its payload, the server's ``env`` included, on
    stdin: :mod:`~ddtree_ops.transport.hostprogram`). Raises TransportError / ServiceError."""
    run = run_program(transport, host.python, AGENT_SOURCE, {"action": action, "args": payload}, timeout=timeout)
    data = run.reply
    if data is None:
        result = run.result
        raise ServiceError(
            f"service agent ({action}) with {host.python} gave no answer (exit code {result.returncode}): "
            f"{result.stderr.strip()[-400:] or result.stdout.strip()[-200:]!s}",
            host=host.name,
        )
    if data.get("error") == "agent":
        raise ServiceError(f"service agent ({action}) error: {data.get('detail')}", host=host.name)
    return data


def base_payload(host: Host) -> dict[str, Any]:
    server = host.ddtree.server
    return {"run_dir": host.ddtree.run_dir, "port": server.port, "probe_host": probe_address(server.bind_host)}


def port_open(transport: Transport, host: Host) -> bool:
    """Connect test from the host itself (the port is usually bound to its loopback)."""
    return bool(call_agent(transport, host, "portcheck", base_payload(host), timeout=30)["port_open"])


def start(transport: Transport, host: Host, spec: LaunchSpec, *, check_port: bool = True) -> Launched:
    """Launch ``spec`` in a new session. Refuses if our last process lives or the port is taken.

    ``check_port=False`` launches next to whatever holds the port: that is the race real
    deployments hit when a restart does not wait, and the readiness tests recreate it.
    """
    payload = base_payload(host) | {
        "check_port": check_port,
        "argv": list(spec.argv),
        "env": dict(spec.env),
        "argv_hash": spec.argv_hash,
        "launch_command": spec.launch_command,
        "cuda_graph": spec.cuda_graph,
        "run": spec.run.describe(),
    }
    data = call_agent(transport, host, "start", payload, timeout=60)
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
        pid=int(data["pid"]), pstart=data.get("pstart"), started_at=float(data["started_at"]), log_path=str(data["log"])
    )


def stop(transport: Transport, host: Host, *, grace_s: float = 30.0, lease: LeasePass | None = None) -> StopResult:
    """SIGTERM the process group we launched, wait ``grace_s``, then SIGKILL it.

    ``lease``: how a sweep's lease on the host is treated (:class:`LeasePass`); None
    checks none, for a caller that holds the restart lock (which checked it).
    """
    payload = base_payload(host) | {"grace_s": grace_s}
    data = _lease_checked(transport, host, "stop", payload, lease, timeout=grace_s + 60)
    return StopResult(
        host=host.name,
        was_running=bool(data.get("was_running")),
        pid=data.get("pid"),
        signal=data.get("signal"),
        waited_s=float(data.get("waited_s", 0.0)),
        exited=bool(data.get("exited", True)),
    )


def poll(
    transport: Transport, host: Host, launched: Launched, offset: int, *, http_timeout: float = 5.0
) -> dict[str, Any]:
    payload = base_payload(host) | {
        "pid": launched.pid,
        "pstart": launched.pstart,
        "offset": offset,
        "http_timeout": http_timeout,
    }
    return call_agent(transport, host, "poll", payload, timeout=http_timeout * 2 + 30)


def smoke(
    transport: Transport, host: Host, launched: Launched, rounds: list[list[dict[str, Any]]], *, request_timeout: float
) -> dict[str, Any]:
    """Send the smoke's request rounds from the host itself (one round trip); the answer
    is judged by :func:`ddtree_ops.service.smoke.judge_smoke`."""
    payload = base_payload(host) | {
        "pid": launched.pid,
        "pstart": launched.pstart,
        "rounds": rounds,
        "request_timeout": request_timeout,
    }
    return call_agent(transport, host, "smoke", payload, timeout=len(rounds) * (request_timeout + 10) + 30)


def status(transport: Transport, host: Host, *, lines: int = 5) -> dict[str, Any]:
    return call_agent(transport, host, "status", base_payload(host) | {"lines": lines}, timeout=30)


@dataclass(frozen=True)
class LeasePass:
    """How a restart or stop treats a sweep's lease on the host (``run_dir/sweep.lease``).

    ``token``: the caller's own lease (the sweep that holds the host passes); ``force``:
    an operator overriding another's lease (``--force``). Anyone else is refused at once,
    unless the holder is provably dead (:func:`ddtree_ops.lockholder.holder_is_dead`):
    then the lease is removed and the action proceeds.
    """

    token: str | None = None
    force: bool = False

    def payload(self, *, clear: str | None = None) -> dict[str, Any]:
        return {"token": self.token, "force": self.force, "clear": clear}


def _holder_of(held: dict[str, Any]) -> dict[str, Any]:
    holder = held.get("holder")
    return holder if isinstance(holder, dict) else {}


def _lease_refusal(host: Host, held: dict[str, Any], now: object) -> str:
    """One line naming the sweep that holds the host, its controller, pid and age."""
    holder = _holder_of(held)
    taken = held.get("taken_at")
    age = (f" for {lockholder.format_age(now - taken)}"
           if isinstance(taken, (int, float)) and isinstance(now, (int, float)) else "")
    sweep = f"sweep {holder.get('sweep', '?')} (run {holder.get('run_id', '?')})"
    why = lockholder.holder_state(holder) if holder else "recorded without holder details, so it cannot be checked"
    hint = "" if why == "still running" else f"; delete {host.ddtree.run_dir}/{LEASE_FILE} if no sweep runs there"
    return (f"the host is held by {sweep}: {lockholder.describe_holder(holder)}{age}, {why}; "
            f"restart/stop --force overrides it{hint}")


def _dead_lease(held: dict[str, Any]) -> str | None:
    """The token of ``held`` when its holder provably no longer runs, else None."""
    holder = held.get("holder")
    token = held.get("token")
    if isinstance(holder, dict) and isinstance(token, str) and lockholder.holder_is_dead(holder, run_id=token):
        return token
    return None


def _lease_checked(
    transport: Transport, host: Host, action: str, payload: dict[str, Any], lease: LeasePass | None, *,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """``call_agent`` for an action the host's sweep lease may forbid: a dead holder's lease
    is cleared and the call repeated; a live one raises :class:`LeaseHeld` at once."""
    if lease is None:
        return call_agent(transport, host, action, payload, timeout=timeout)
    data = call_agent(transport, host, action, payload | {"lease": lease.payload()}, timeout=timeout)
    held = data.get("leased")
    if isinstance(held, dict) and (dead := _dead_lease(held)) is not None:
        data = call_agent(transport, host, action, payload | {"lease": lease.payload(clear=dead)}, timeout=timeout)
        held = data.get("leased")
    if isinstance(held, dict):
        raise LeaseHeld(_lease_refusal(host, held, data.get("now")), host=host.name)
    return data


def take_lease(transport: Transport, host: Host, *, token: str, holder: dict[str, Any]) -> dict[str, Any] | None:
    """Hold ``host`` for a sweep (``run_dir/sweep.lease``) under ``token``; ``holder`` is a
    :func:`ddtree_ops.lockholder.holder_record` plus ``sweep`` and ``run_id``.

    Another sweep's live lease raises :class:`LeaseHeld` at once (no waiting: its sweep
    may run for hours); a provably dead holder's lease is taken over, and returned.
    """
    payload = base_payload(host) | {"token": token, "holder": holder}
    data = call_agent(transport, host, "lease", payload)
    held = data.get("leased")
    if isinstance(held, dict) and (dead := _dead_lease(held)) is not None:
        data = call_agent(transport, host, "lease", payload | {"take_over": dead})
        if data.get("ok"):
            return held
        held = data.get("leased")
    if isinstance(held, dict):
        raise LeaseHeld(_lease_refusal(host, held, data.get("now")), host=host.name)
    return None


def release_lease(transport: Transport, host: Host, token: str) -> None:
    """Give the host back (only the lease ``token`` took; anything else is left alone)."""
    call_agent(transport, host, "release", base_payload(host) | {"token": token})


def read_lease(transport: Transport, host: Host) -> dict[str, Any] | None:
    """The host's sweep lease record, or None when no sweep holds it."""
    lease = call_agent(transport, host, "leaseinfo", base_payload(host), timeout=30).get("lease")
    return lease if isinstance(lease, dict) else None


def describe_lease(held: dict[str, Any]) -> str:
    """``sweep NAME (run ID), user@controller pid N`` for warnings."""
    holder = _holder_of(held)
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
        data = _lease_checked(transport, host, "lock", payload, lease)
        if not data.get("ok"):
            held = data.get("held") or {}
            holder = held.get("holder")
            if isinstance(holder, dict) and lockholder.holder_is_dead(holder, run_id=held.get("token")):
                # The agent replaces the lock only if it still carries that dead holder's token.
                refused_at = data.get("now")
                data = _lease_checked(transport, host, "lock", payload | {"take_over": held.get("token")}, lease)
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


def sglang_version(transport: Transport, host: Host) -> str | None:
    """The remote SGLang version from package metadata (no import of sglang)."""
    return call_agent(transport, host, "version", {}, timeout=30).get("sglang_version")


def read_logs(transport: Transport, host: Host, *, lines: int = 50, offset: int | None = None) -> dict[str, Any]:
    return call_agent(transport, host, "logs", base_payload(host) | {"lines": lines, "offset": offset}, timeout=30)


__all__ = [
    "LEASE_FILE",
    "Launched",
    "LeasePass",
    "LockTakeover",
    "StopResult",
    "call_agent",
    "describe_lease",
    "poll",
    "port_open",
    "read_lease",
    "read_logs",
    "release_lease",
    "restart_lock",
    "sglang_version",
    "start",
    "status",
    "stop",
    "take_lease",
]
