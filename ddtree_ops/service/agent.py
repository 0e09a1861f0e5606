"""The service agent on a host: its program, one round trip to it, and what it answers.

The remote half is :mod:`._agent` (the run dir: launch record, restart lock, sweep lease;
the HTTP probes and the smoke; the process manager's own launches), plus, on a host run
by systemd, :mod:`._unit_agent` in front of it (the unit's actions). Either is sent on
stdin to the host's Python with the action and a JSON payload
(:mod:`~ddtree_ops.transport.hostprogram`), so no inventory or user value is ever part of
shell text, and the server's ``env`` (tokens) never reaches a command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree_ops import lockholder
from ddtree_ops.errors import LeaseHeld, ServiceError
from ddtree_ops.inventory_types import Host
from ddtree_ops.service.launch import probe_address
from ddtree_ops.transport.base import Transport
from ddtree_ops.transport.hostprogram import run_program

_HERE = Path(__file__).parent
AGENT_SOURCE = (_HERE / "_agent.py").read_text()
_UNIT_TEXT = (_HERE / "_unit_agent.py").read_text()
# The unit agent's own part (from its marker on), then the agent: one program whose
# ``main`` knows both sets of actions (``_unit_agent``'s docstring).
UNIT_AGENT_SOURCE = _UNIT_TEXT[_UNIT_TEXT.index("# HOST PROGRAM"):] + "\n" + AGENT_SOURCE
LEASE_FILE = "sweep.lease"
LOCK_FILE = "restart.lock"

# Where the server's log can be read from next: a byte offset into the process manager's
# log file, or a journal cursor (systemd); whatever the last answer said.
LogPosition = int | str


@dataclass(frozen=True)
class Launched:
    """What the agent recorded about a fresh launch: the process (``pid`` with its kernel
    start time, against pid reuse), when, and where its log is. Under systemd ``unit`` is the
    unit and ``invocation`` its InvocationID (the journal's key for this run of it)."""

    pid: int
    pstart: str | None
    started_at: float
    log_path: str
    unit: str | None = None
    invocation: str | None = None


@dataclass(frozen=True)
class StopResult:
    host: str
    was_running: bool
    pid: int | None
    signal: str | None
    waited_s: float
    exited: bool


def call_agent(
    transport: Transport, host: Host, action: str, payload: dict[str, Any], *, timeout: float = 60.0,
    source: str = AGENT_SOURCE,
) -> dict[str, Any]:
    """One round trip to the remote agent (its payload, the server's ``env`` included, on
    stdin: :mod:`~ddtree_ops.transport.hostprogram`). Raises TransportError / ServiceError."""
    run = run_program(transport, host.python, source, {"action": action, "args": payload}, timeout=timeout)
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


def holder_of(held: dict[str, Any]) -> dict[str, Any]:
    holder = held.get("holder")
    return holder if isinstance(holder, dict) else {}


# What a restart or stop refused by a lease can do about it.
FORCE_HINT = "restart/stop --force overrides it"


def lease_refusal(host: Host, held: dict[str, Any], now: object, *, hint: str = FORCE_HINT) -> str:
    """One line naming the sweep that holds the host, its controller, pid and age, and
    ``hint``: what the refused command can do about it."""
    holder = holder_of(held)
    taken = held.get("taken_at")
    age = (f" for {lockholder.format_age(now - taken)}"
           if isinstance(taken, (int, float)) and isinstance(now, (int, float)) else "")
    sweep = f"sweep {holder.get('sweep', '?')} (run {holder.get('run_id', '?')})"
    why = lockholder.holder_state(holder) if holder else "recorded without holder details, so it cannot be checked"
    stale = "" if why == "still running" else f"; delete {host.ddtree.run_dir}/{LEASE_FILE} if no sweep runs there"
    return f"the host is held by {sweep}: {lockholder.describe_holder(holder)}{age}, {why}; {hint}{stale}"


def dead_lease(held: dict[str, Any]) -> str | None:
    """The token of ``held`` when its holder provably no longer runs, else None."""
    holder = held.get("holder")
    token = held.get("token")
    if isinstance(holder, dict) and isinstance(token, str) and lockholder.holder_is_dead(holder, run_id=token):
        return token
    return None


def lease_checked(
    transport: Transport, host: Host, action: str, payload: dict[str, Any], lease: LeasePass | None, *,
    timeout: float = 60.0, source: str = AGENT_SOURCE,
) -> dict[str, Any]:
    """``call_agent`` for an action the host's sweep lease may forbid: a dead holder's lease
    is cleared and the call repeated; a live one raises :class:`LeaseHeld` at once."""
    if lease is None:
        return call_agent(transport, host, action, payload, timeout=timeout, source=source)
    data = call_agent(transport, host, action, payload | {"lease": lease.payload()}, timeout=timeout, source=source)
    held = data.get("leased")
    if isinstance(held, dict) and (dead := dead_lease(held)) is not None:
        data = call_agent(transport, host, action, payload | {"lease": lease.payload(clear=dead)}, timeout=timeout,
                          source=source)
        held = data.get("leased")
    if isinstance(held, dict):
        raise LeaseHeld(lease_refusal(host, held, data.get("now")), host=host.name)
    return data


__all__ = [
    "AGENT_SOURCE",
    "LEASE_FILE",
    "LOCK_FILE",
    "UNIT_AGENT_SOURCE",
    "LeasePass",
    "Launched",
    "LogPosition",
    "StopResult",
    "base_payload",
    "call_agent",
    "dead_lease",
    "holder_of",
    "lease_checked",
    "lease_refusal",
]
