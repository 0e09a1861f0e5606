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

import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree_ops import lockholder
from ddtree_ops.errors import DdtreeOpsError, PortBusy, ServiceError
from ddtree_ops.inventory_types import Host
from ddtree_ops.service.launch import LaunchSpec, probe_address
from ddtree_ops.transport.base import Script, Transport

AGENT_SOURCE = (Path(__file__).with_name("_agent.py")).read_text()
LOG_FILE = "server.log"
LOCK_FILE = "restart.lock"


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
    """One round trip to the remote agent. Raises TransportError / ServiceError."""
    script = Script(argv=(host.python, "-", action, json.dumps(payload)), source=AGENT_SOURCE)
    result = transport.run(script, timeout=timeout)
    if result.returncode != 0:
        raise ServiceError(
            f"service agent ({action}) failed with exit code {result.returncode} using {host.python}: "
            f"{result.stderr.strip()[-400:]}",
            host=host.name,
        )
    try:
        data = json.loads(result.stdout)
    except json.JSONDecodeError as exc:
        raise ServiceError(
            f"service agent ({action}) answered non-JSON: {result.stdout[:200]!r}", host=host.name
        ) from exc
    if not isinstance(data, dict):
        raise ServiceError(f"service agent ({action}) answered {type(data).__name__}", host=host.name)
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


def stop(transport: Transport, host: Host, *, grace_s: float = 30.0) -> StopResult:
    """SIGTERM the process group we launched, wait ``grace_s``, then SIGKILL it."""
    data = call_agent(transport, host, "stop", base_payload(host) | {"grace_s": grace_s}, timeout=grace_s + 60)
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
) -> Iterator[None]:
    """Hold the host's restart lock (``run_dir/restart.lock``) for the body.

    Two operators (or a benchmark and a person) restarting one host at once would stop
    each other's fresh process; the lock turns that into one clear refusal. The lock
    records its holder (:func:`ddtree_ops.lockholder.holder_record`). A holder that is
    provably dead (it ran on this controller and its process is gone) is taken over at
    once, so a SIGKILLed ``restart`` or ``bench`` does not block the next one; any
    other holder blocks until the lock expires after ``ttl_s``.
    """
    token = uuid.uuid4().hex
    payload = base_payload(host) | {
        "token": token, "holder": lockholder.holder_record(token, command), "ttl_s": ttl_s,
    }
    with lockholder.active_run(token):
        data = call_agent(transport, host, "lock", payload)
        if not data.get("ok"):
            held = data.get("held") or {}
            holder = held.get("holder")
            if isinstance(holder, dict) and lockholder.holder_is_dead(holder, run_id=held.get("token")):
                # The agent replaces the lock only if it still carries that dead holder's token.
                refused_at = data.get("now")
                data = call_agent(transport, host, "lock", payload | {"take_over": held.get("token")})
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
    "Launched",
    "LockTakeover",
    "StopResult",
    "call_agent",
    "poll",
    "port_open",
    "read_logs",
    "restart_lock",
    "sglang_version",
    "start",
    "status",
    "stop",
]
