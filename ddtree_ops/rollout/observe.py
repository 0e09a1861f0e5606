"""One observation of a host: its bundle files, and what each of its servers does now.

design.md §10: what ddtree-ops reports about a host is what it observed there at the end of
the command, not the steps it took. A :class:`HostSnapshot` holds the patch engine's view
(one gather: the applied record and each bundle file's hash against the bundle) and a
:class:`~ddtree_ops.service.observed.ServerView` per server place (the machine, or each of
its GPU slots); every command that changes hosts takes one of each target at its end, shows
it, and takes its exit code from it (:meth:`~ddtree_ops.rollout.executor.HostChange.verify`).

An observation never raises: what could not be observed is said in the snapshot
(``error``), and a host that cannot be observed is not called converged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddtree_ops.errors import DdtreeOpsError
from ddtree_ops.inventory_types import Host
from ddtree_ops.patching.bundle import Bundle
from ddtree_ops.patching.status import HostPatchStatus, host_status
from ddtree_ops.service import lifecycle
from ddtree_ops.service.observed import OBSERVE_SMOKE, ServerView, observe_server
from ddtree_ops.service.smoke import SmokeSpec
from ddtree_ops.transport.base import Transport


@dataclass(frozen=True)
class BundleView:
    """The patch engine's view of a host: the bundle its record names and how many of the
    observed files are in each state (``patched``, ``original``, ``drifted``, ``missing``)."""

    name: str | None
    version: str | None
    identity: str | None
    states: Mapping[str, int]
    consistent: bool
    journal: bool

    @classmethod
    def of(cls, status: HostPatchStatus) -> BundleView:
        counts: dict[str, int] = {}
        for f in status.files:
            counts[f.state] = counts.get(f.state, 0) + 1
        return cls(status.bundle_name, status.bundle_version, status.bundle_identity, counts, status.consistent,
                   bool(status.journal))

    def applied(self, bundle: Bundle) -> bool:
        """``bundle`` is recorded and every one of its files holds the patched content."""
        return self.identity == bundle.identity and self.consistent and not self.journal and \
            set(self.states) <= {"patched"}

    @property
    def original(self) -> bool:
        """Nothing applied, and every file observed is the original."""
        return self.identity is None and self.consistent and not self.journal and set(self.states) <= {"original"}

    def describe(self) -> str:
        files = ", ".join(f"{n} {k}" for k, n in sorted(self.states.items())) or "no files"
        journal = "; an unfinished run's journal" if self.journal else ""
        if self.name is None:
            return f"no bundle ({files}){journal}"
        return f"{self.name} {self.version} {(self.identity or '')[:12]} ({files}){journal}"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "identity": self.identity, "files": dict(self.states),
                "consistent": self.consistent, "journal": self.journal, "summary": self.describe()}


@dataclass(frozen=True)
class HostSnapshot:
    """A host as observed: its bundle (None where not asked for or not observed) and each
    server's view. ``error``: why the bundle could not be observed."""

    host: str
    bundle: BundleView | None
    servers: tuple[ServerView, ...]
    error: str | None = None

    def server(self, name: str) -> ServerView | None:
        return next((s for s in self.servers if s.host == name), None)

    def lines(self) -> list[str]:
        """``host: bundle ...`` and ``server: serving ...`` phrases for the terminal."""
        out = []
        if self.error is not None:
            out.append(f"{self.host}: bundle not observed: {self.error}")
        elif self.bundle is not None:
            out.append(f"{self.host}: bundle {self.bundle.describe()}")
        out += [f"{s.host}: {s.describe()}" for s in self.servers]
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "bundle": self.bundle.as_dict() if self.bundle is not None else None,
                "error": self.error, "servers": [s.as_dict() for s in self.servers]}


def observe_host(
    transport: Transport, host: Host, *, bundle: Bundle | None = None, patch: bool = True,
    smoke: SmokeSpec | None = OBSERVE_SMOKE,
) -> HostSnapshot:
    """``host`` (a machine) now: its patch status against ``bundle`` (``patch`` False: not
    looked at) and every server place of it. Never raises."""
    view: BundleView | None = None
    error = None
    if patch:
        try:
            view = BundleView.of(host_status(transport, host, bundle=bundle))
        except DdtreeOpsError as exc:
            error = exc.message
    servers = tuple(observe_place(transport, server, smoke=smoke) for server in host.slot_hosts())
    return HostSnapshot(host.name, view, servers, error)


def observe_place(transport: Transport, server: Host, *, smoke: SmokeSpec | None = OBSERVE_SMOKE) -> ServerView:
    """One server place now; what could not be observed is said, never raised."""
    svc = lifecycle.manager_for(transport, server)
    try:
        return observe_server(svc, smoke=smoke)
    except DdtreeOpsError as exc:
        return ServerView(host=server.name, manager=svc.kind, running=False, pid=None, port_open=False,
                          listener_ours=None, health=None, info=None, error=exc.message)


def unobserved(host: Host, reason: str) -> HostSnapshot:
    """The snapshot of a host that could not be reached at all."""
    return HostSnapshot(host.name, None, tuple(
        ServerView(host=s.name, manager=s.ddtree.server.manager, running=False, pid=None, port_open=False,
                   listener_ours=None, health=None, info=None, error=reason) for s in host.slot_hosts()), reason)


__all__ = ["BundleView", "HostSnapshot", "observe_host", "observe_place", "unobserved"]
