"""The systemd manager (``manager: systemd``): the operator's unit runs SGLang, ddtree-ops
drives it through ONE drop-in.

A production GPU host runs SGLang as a unit, which restarts it after a crash and brings it
back after a reboot. ddtree-ops keeps all of that by never rewriting the operator's unit
file: it owns ``/etc/systemd/system/<unit>.d/50-ddtree-ops.conf``, which replaces
``ExecStart=`` with the launch it computes (speculative flags, eager flags, extra args:
:func:`~ddtree_ops.service.launch.build_launch_spec`, as for the process manager) and
points ``EnvironmentFile=`` at ``/etc/ddtree-ops/<unit>.env`` (mode 0600, the inventory's
``env``: never on a command line, never in the drop-in). Then ``systemctl daemon-reload``
and a start. Removing the drop-in (``rollback --restart``) gives the unit its operator's
``ExecStart`` back.

"The new process" is the unit's ``MainPID`` with its kernel start time; its log is the
journal of the unit's ``InvocationID``; everything else readiness proves (health,
``/server_info`` naming our flags and a fresh start, the socket owner, the speculative
smoke) is the same as for the process manager. Refused in one line with nothing changed
(:class:`~ddtree_ops.errors.UnitRefused`): unit not found, masked, a user unit, an
``ExecStart`` that does not launch SGLang, no permission, no systemd.

Pure renderers (:func:`dropin_text`, :func:`exec_start_line`, :func:`environment_file`)
are separate from :class:`SystemdManager`, which carries them out through the agent
(``_unit_agent.py``).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from ddtree_ops.errors import ConfigError, PortBusy, ServiceError, UnitRefused
from ddtree_ops.inventory_types import Host
from ddtree_ops.service.agent import (
    UNIT_AGENT_SOURCE,
    Launched,
    LeasePass,
    LogPosition,
    StopResult,
    call_agent,
    lease_checked,
)
from ddtree_ops.service.launch import LaunchSpec
from ddtree_ops.service.manager import ServiceManager, stop_result, sweep_marker

DROPIN_NAME = "50-ddtree-ops.conf"
UNIT_DIR = "/etc/systemd/system"
ENV_DIR = "/etc/ddtree-ops"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def dropin_path(unit: str) -> str:
    return f"{UNIT_DIR}/{unit}.d/{DROPIN_NAME}"


def env_path(unit: str) -> str:
    return f"{ENV_DIR}/{unit}.env"


def _unit_word(arg: str) -> str:
    """One argv entry as systemd reads a word of ``ExecStart=``: double-quoted, with ``\\``
    and ``"`` escaped, ``%`` (a specifier) doubled, ``$`` (a variable) doubled, and control
    characters C-escaped, so the process gets exactly ``arg``."""
    out: list[str] = []
    for ch in arg:
        if ch in '\\"':
            out.append("\\" + ch)
        elif ch == "%":
            out.append("%%")
        elif ch == "$":
            out.append("$$")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def exec_start_line(argv: Sequence[str]) -> str:
    """``ExecStart=`` for ``argv``, every entry one quoted word."""
    if not argv:
        raise ConfigError("the launch command is empty")
    return "ExecStart=" + " ".join(_unit_word(a) for a in argv)


def _env_value(value: str) -> str:
    """A value as systemd's environment-file parser reads it back unchanged: double-quoted,
    with ``\\``, ``"``, ``$`` and backquote escaped (newlines may stand inside the quotes)."""
    return '"' + re.sub(r'([\\"$`])', r"\\\1", value) + '"'


def environment_file(env: Mapping[str, str], *, host: str | None = None) -> str:
    """The 0600 file ``EnvironmentFile=`` names: ``KEY="value"`` per line."""
    lines = ["# Written by ddtree-ops: the inventory's ddtree.server.env for this unit."]
    for key, value in env.items():
        if not _ENV_NAME.match(key):
            raise ConfigError(f"ddtree.server.env: {key!r} is not an environment variable name", host=host)
        lines.append(f"{key}={_env_value(str(value))}")
    return "\n".join(lines) + "\n"


def dropin_text(argv: Sequence[str], unit: str) -> str:
    """Our drop-in: the computed launch as the unit's only ``ExecStart``, and the env file.
    The agent adds ``WorkingDirectory=`` the host's run dir (only the host can expand it),
    where the process manager runs the server too."""
    return "\n".join([
        "# Written by ddtree-ops. It replaces the unit's ExecStart with the launch ddtree-ops computed;",
        "# the unit file itself is the operator's and is not changed. `ddtree-ops rollback HOST --restart`",
        "# (or removing this file and `systemctl daemon-reload`) goes back to it.",
        "[Service]",
        "ExecStart=",
        exec_start_line(argv),
        f"EnvironmentFile={env_path(unit)}",
        "",
    ])


def launch_markers(host: Host) -> list[str]:
    """Module names (``-m X``) of the inventory's ``server.command``: an operator's unit that
    runs one of them launches SGLang too (a wrapper module, the simulator in tests)."""
    try:
        words = shlex.split(host.ddtree.server.command)
    except ValueError:
        return []
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w == "-m"]


class SystemdManager(ServiceManager):
    """The host's systemd runs the server as ``host.ddtree.server.unit``."""

    kind = "systemd"
    revives_exited_server = True

    def __init__(self, transport: Any, host: Host) -> None:
        super().__init__(transport, host)
        unit = host.ddtree.server.unit
        if not unit:
            raise ConfigError("ddtree.server.unit is not set (manager: systemd drives a unit)", host=host.name)
        self.unit: str = unit

    def call(self, action: str, payload: dict[str, Any], *, timeout: float = 60.0) -> dict[str, Any]:
        data = call_agent(self.transport, self.host, action, payload, timeout=timeout, source=UNIT_AGENT_SOURCE)
        if data.get("error") == "unit":
            raise UnitRefused(f"{data.get('detail')}; nothing changed", host=self.host.name)
        return data

    def payload(self) -> dict[str, Any]:
        return super().payload() | {"unit": self.unit, "markers": launch_markers(self.host)}

    def preflight(self) -> None:
        self.call("unit_check", self.payload(), timeout=60)

    def start(self, spec: LaunchSpec, *, check_port: bool = True) -> Launched:
        payload = self.payload() | {
            "check_port": check_port,
            "dropin": dropin_text(spec.argv, self.unit),
            "env_file": environment_file(spec.env, host=self.host.name),
            "env_keys": sorted(spec.env),
            "argv": list(spec.argv),
            "argv_hash": spec.argv_hash,
            "launch_command": spec.launch_command,
            "cuda_graph": spec.cuda_graph,
            "run": spec.run.describe(),
            # A sweep's launch runs from a runtime drop-in; ours in /etc is left as it is.
            "sweep": sweep_marker(),
        }
        return self._launched(self.call("unit_start", payload, timeout=120))

    def start_operator(self) -> Launched:
        """Our drop-in and env file removed, and the unit started on its operator's own
        ``ExecStart`` (what ``rollback --restart`` and a rollout's undo give back)."""
        return self._launched(self.call("unit_start", self.payload() | {"dropin": None}, timeout=120))

    def configure(self, spec: LaunchSpec | None) -> None:
        """Our drop-in for ``spec`` (None: removed), reloaded, the unit left as it is."""
        payload = self.payload() | {"dropin": None}
        if spec is not None:
            payload |= {"dropin": dropin_text(spec.argv, self.unit),
                        "env_file": environment_file(spec.env, host=self.host.name)}
        data = self.call("unit_configure", payload, timeout=120)
        if data.get("error"):
            raise ServiceError(f"{self.unit}: {data.get('detail')}", host=self.host.name)

    def _launched(self, data: dict[str, Any]) -> Launched:
        host, err = self.host, data.get("error")
        if err == "running":
            raise ServiceError(f"{self.unit} is still running (main pid {data.get('pid')}); stop it first",
                               host=host.name)
        if err == "port_busy":
            raise PortBusy(f"port {host.ddtree.server.port} is in use by another process", host=host.name)
        if err:
            raise ServiceError(f"cannot start {self.unit}: {data.get('detail') or err}", host=host.name)
        return Launched(
            pid=int(data["pid"]), pstart=data.get("pstart"), started_at=float(data["started_at"]),
            log_path=str(data.get("log") or f"journalctl -u {self.unit}"), unit=self.unit,
            invocation=data.get("invocation"),
        )

    def stop(self, *, grace_s: float = 30.0, lease: LeasePass | None = None) -> StopResult:
        payload = self.payload() | {"grace_s": grace_s}
        data = lease_checked(self.transport, self.host, "unit_stop", payload, lease, timeout=grace_s + 90,
                             source=UNIT_AGENT_SOURCE)
        return stop_result(self.host, data)

    def poll(self, launched: Launched, position: LogPosition, *, http_timeout: float = 5.0) -> dict[str, Any]:
        payload = self.payload() | {
            "pid": launched.pid,
            "pstart": launched.pstart,
            "invocation": launched.invocation,
            "offset": position or "",
            "http_timeout": http_timeout,
        }
        return self.call("unit_poll", payload, timeout=http_timeout * 2 + 30)

    def status(self, *, lines: int = 5) -> dict[str, Any]:
        return self.call("unit_status", self.payload() | {"lines": lines}, timeout=30)

    def read_logs(self, *, lines: int = 50, position: LogPosition | None = None) -> dict[str, Any]:
        return self.call("unit_logs", self.payload() | {"lines": lines, "offset": position or None}, timeout=30)


def exit_detail(unit_props: Mapping[str, Any] | None) -> str:
    """``Result=exit-code, status=1`` from a poll's ``unit`` properties ('' when none)."""
    if not unit_props:
        return ""
    parts = [f"Result={unit_props.get('Result') or '?'}"]
    status = unit_props.get("ExecMainStatus")
    if status not in (None, "", "0"):
        parts.append(f"status={status}")
    if unit_props.get("NRestarts") not in (None, "", "0"):
        parts.append(f"NRestarts={unit_props.get('NRestarts')}")
    return ", ".join(parts)


__all__ = [
    "DROPIN_NAME",
    "ENV_DIR",
    "SystemdManager",
    "dropin_path",
    "dropin_text",
    "env_path",
    "environment_file",
    "exec_start_line",
    "exit_detail",
    "launch_markers",
]
