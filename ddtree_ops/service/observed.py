"""What a server is doing now, observed on its host: not what the last command did there.

Every command that changes a host ends by looking at it again and reports that
(design.md §10): Kubernetes controllers and Ansible modules observe, act, observe, and a
"nothing to do" is a conclusion drawn from an observation, never a shortcut. One
:class:`ServerView` per server place (a host, or one GPU slot of it) comes from one round
trip to its manager (the agent's ``status``: launch record and process, under systemd the
unit's state, main pid and whether our drop-in is in effect; the port's owner, health and
``/server_info``), plus, where the server answers, a short speculative smoke (a 200 from
``/health_generate`` is one prefill token and proves no verify path).

:func:`mismatch` is the pure question a convergent command asks before it restarts: does
this server already serve exactly the launch it would make (its flags, its environment, its
tree, its tuned policy), ready? Only then is the server left as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ddtree_ops.inventory_types import Host
from ddtree_ops.service.launch import LaunchSpec
from ddtree_ops.service.readiness import (
    launch_command_matches,
    policy_mismatch,
    served_cuda_graph,
    served_tree,
    tree_mismatch,
)
from ddtree_ops.service.smoke import SmokeResult, SmokeSpec, judge_smoke

if TYPE_CHECKING:
    from ddtree_ops.service.manager import ServiceManager

# The observation's smoke: one greedy request whose tokens past the first are decode (verify)
# rounds. Short, because every changing command ends with it on every server it targets.
OBSERVE_SMOKE = SmokeSpec(max_new_tokens=16, batch=1, request_timeout_s=60.0)


@dataclass(frozen=True)
class UnitView:
    """A systemd unit as its manager showed it: state, main pid, whether our drop-in is in
    effect (else the operator's own ExecStart runs)."""

    name: str
    active: str
    sub: str
    main_pid: int | None
    dropin_in_effect: bool

    def describe(self) -> str:
        runs = "our drop-in" if self.dropin_in_effect else "its own ExecStart"
        return f"{self.name} {self.active} ({self.sub}), {runs}"


@dataclass(frozen=True)
class ServerView:
    """One server place as observed. ``info``: the keys of ``/server_info`` the agent
    reads (None where the server did not answer); ``smoke``: the observation's smoke (None
    where it was not run: nothing answered, or the caller asked for none)."""

    host: str
    manager: str
    running: bool
    pid: int | None
    port_open: bool
    listener_ours: bool | None
    health: int | str | None
    info: Mapping[str, Any] | None
    unit: UnitView | None = None
    # The launch record's argv hash (argv and environment) and RunConfig.describe(): what
    # ddtree-ops launched there last; None for a unit on its operator's own ExecStart.
    record_hash: str | None = None
    record_run: str | None = None
    smoke: SmokeResult | None = None
    # Why the observation could not be made (the host unreachable, the agent failing).
    error: str | None = None
    # The server running is a bench sweep's launch (its own record), not the host's.
    sweep: bool = False

    @property
    def answers(self) -> bool:
        return self.health == 200 and isinstance(self.info, Mapping) and self.info.get("status") == 200

    @property
    def ready(self) -> bool:
        """Running, answering on its own socket, and its smoke decoded (where it ran)."""
        return (self.error is None and self.running and self.answers and self.listener_ours is not False
                and (self.smoke is None or self.smoke.passed))

    @property
    def operator(self) -> bool:
        return self.unit is not None and not self.unit.dropin_in_effect

    def served(self) -> str:
        """What the answering server says it serves (``DDTREE budget=16 topk=4``,
        ``DDTREE policy``, ``AR``, ...); "" where it does not answer."""
        info = self.info if self.answers and self.info is not None else None
        if info is None:
            return ""
        algorithm = info.get("speculative_algorithm") or "AR"
        parts = [str(algorithm)]
        if algorithm == "DDTREE":
            tree = served_tree(info)
            if tree is not None:
                parts += [f"{name}={'?' if value is None else value}"
                          for name, value in zip(("budget", "topk"), tree, strict=True)]
            states = info.get("internal_states")
            live = states[0].get("ddtree") if isinstance(states, list) and states and isinstance(states[0], Mapping) \
                else None
            if isinstance(live, Mapping) and live.get("mode") == "policy":
                parts.append("(tuned policy)")
        elif algorithm == "DFLASH" and isinstance(info.get("speculative_num_draft_tokens"), int):
            parts.append(f"budget={info['speculative_num_draft_tokens']}")
        graphs = served_cuda_graph(info)
        if graphs is False:
            parts.append("eager")
        return " ".join(parts)

    def describe(self) -> str:
        """One phrase: ``DDTREE budget=4 topk=4, pid 812, ready``; ``no server``; ``pid 812,
        not ready (health 503)``."""
        if self.error is not None:
            return f"not observed: {self.error}"
        unit = f"{self.unit.describe()}; " if self.unit is not None else ""
        if not self.running:
            held = " (port held by another process)" if self.port_open else ""
            return f"{unit}no server{held}"
        pid = f"pid {self.pid}" if self.pid is not None else "pid ?"
        if not self.answers:
            return f"{unit}{pid}, not ready (health {self.health})"
        if self.listener_ours is False:
            return f"{unit}{pid}, the port answers from another process"
        served = self.served() + (" (a sweep's launch)" if self.sweep else "")
        if self.smoke is None:
            return f"{unit}{served}, {pid}, answers (no smoke run)"
        if not self.smoke.passed:
            return f"{unit}{served}, {pid}, smoke failed: {self.smoke.detail}"
        return f"{unit}{served}, {pid}, ready"

    def as_dict(self) -> dict[str, Any]:
        return {
            "server": self.host, "manager": self.manager, "running": self.running, "pid": self.pid,
            "ready": self.ready, "serves": self.served() or None, "health": self.health,
            "port_open": self.port_open, "listener_ours": self.listener_ours,
            "unit": asdict(self.unit) if self.unit is not None else None,
            "launch_record": self.record_run, "sweep": self.sweep,
            "smoke": None if self.smoke is None else {"passed": self.smoke.passed, "detail": self.smoke.detail},
            "error": self.error, "summary": self.describe(),
        }


def view_of(host: Host, kind: str, data: Mapping[str, Any], smoke: SmokeResult | None = None) -> ServerView:
    """A view from the manager's ``status`` answer (pure)."""
    # A sweep's server, while one runs, is described by its own record (the host's launch
    # record stays the launch a later restart repeats).
    swept = data.get("sweep") if isinstance(data.get("sweep"), Mapping) else None
    rec = swept or (data.get("record") if isinstance(data.get("record"), Mapping) else {})
    assert isinstance(rec, Mapping)
    unit_props = data.get("unit") if isinstance(data.get("unit"), Mapping) else None
    unit = None
    if unit_props is not None:
        main = str(unit_props.get("MainPID") or "0")
        unit = UnitView(
            name=host.ddtree.server.unit or "?", active=str(unit_props.get("ActiveState") or "?"),
            sub=str(unit_props.get("SubState") or "?"), main_pid=int(main) if main.isdigit() and main != "0" else None,
            dropin_in_effect=bool(data.get("dropin_in_effect")),
        )
    ours = unit is None or unit.dropin_in_effect or swept is not None
    pid = data.get("pid", rec.get("pid"))
    info = data.get("server_info")
    listener = data.get("listener_ours")
    return ServerView(
        host=host.name, manager=kind, running=bool(data.get("alive")),
        pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        port_open=bool(data.get("port_open")), listener_ours=listener if isinstance(listener, bool) else None,
        health=data.get("health"), info=info if isinstance(info, Mapping) else None, unit=unit,
        record_hash=rec.get("argv_hash") if ours and isinstance(rec.get("argv_hash"), str) else None,
        record_run=rec.get("run") if ours and isinstance(rec.get("run"), str) else None,
        smoke=smoke, sweep=swept is not None,
    )


def observe_server(svc: ServiceManager, *, smoke: SmokeSpec | None = OBSERVE_SMOKE) -> ServerView:
    """The server ``svc`` manages, as it is now: one ``status`` round trip, then (where it
    answers and ``smoke`` is given) the smoke, judged as a speculative one where
    ``/server_info`` names a speculative algorithm. Raises what the manager raises (the
    caller decides what an unreachable host means)."""
    from ddtree_ops.service.manager import Launched

    data = svc.status(lines=0)
    view = view_of(svc.host, svc.kind, data)
    if smoke is None or not (view.running and view.answers and view.pid is not None):
        return view
    launched = Launched(pid=view.pid, pstart=None, started_at=0.0, log_path="")
    answer = svc.smoke(launched, smoke.rounds(), request_timeout=smoke.request_timeout_s)
    speculative = bool(view.info and view.info.get("speculative_algorithm"))
    return view_of(svc.host, svc.kind, data, judge_smoke(answer, smoke, speculative=speculative))


def mismatch(
    view: ServerView, spec: LaunchSpec, *, policy: Mapping[str, Mapping[str, int]] | None = None
) -> str | None:
    """Why ``view`` is not a ready server of exactly ``spec`` (its flags, the environment
    and launcher its launch record names, the tree ``/server_info`` resolved, the tuned
    ``policy`` it must follow), or None when it is (pure)."""
    if view.error is not None:
        return f"not observed: {view.error}"
    if not view.running:
        return "no server runs"
    if not view.answers:
        return f"the server does not answer (health {view.health})"
    if view.listener_ours is False:
        return "the port answers from another process"
    if view.smoke is not None and not view.smoke.passed:
        return f"its smoke failed: {view.smoke.detail}"
    info = view.info or {}
    if not launch_command_matches(info.get("launch_command"), spec.server_args):
        return f"it serves {view.served() or 'another launch'} with other flags"
    if view.operator:
        return "the unit runs its operator's own ExecStart"
    if view.sweep:
        return "a bench sweep's launch runs there"
    if view.record_hash is not None and view.record_hash != spec.argv_hash:
        return "it was launched with another launcher or environment"
    wrong = tree_mismatch(info, spec)
    if wrong is not None:
        return wrong
    if policy is not None:
        return policy_mismatch(info, policy)
    return None


__all__ = ["OBSERVE_SMOKE", "ServerView", "UnitView", "mismatch", "observe_server", "view_of"]
