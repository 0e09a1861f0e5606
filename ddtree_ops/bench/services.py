"""The sweep runner's seam to the lower layers: the host calls it makes, typed.

:class:`Services` is what the runner calls; :class:`LiveServices` is the one real
implementation (transport, probe, patch status, lifecycle, lease). A test that needs to
count or delay calls wraps it (a subclass); none fakes a server. mypy checks every call
and every field the runner reads from the results.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ddtree_ops.inventory_types import Host
from ddtree_ops.transport.base import Transport

if TYPE_CHECKING:
    from ddtree_ops.patching.status import HostPatchStatus
    from ddtree_ops.probe import HostFacts
    from ddtree_ops.service.lifecycle import PreviousServer, RestartRequest, RestartResult, ServiceStatus
    from ddtree_ops.service.manager import LeasePass, StopResult


class Services(Protocol):
    def open_transport(self, host: Host) -> Transport: ...

    def probe(self, transport: Transport, host: Host) -> HostFacts: ...

    def patch_status(self, transport: Transport, host: Host) -> HostPatchStatus: ...

    def restart(
        self, transport: Transport, request: RestartRequest, *, cancel: threading.Event | None = None
    ) -> RestartResult: ...

    def stop(self, transport: Transport, host: Host, *, lease: LeasePass) -> StopResult: ...

    def status(self, transport: Transport, host: Host) -> ServiceStatus: ...

    def take_lease(
        self, transport: Transport, host: Host, *, token: str, holder: dict[str, Any]
    ) -> dict[str, Any] | None:
        """None when taken fresh; the dead holder's record when taken over."""
        ...

    def release_lease(self, transport: Transport, host: Host, token: str) -> None: ...

    def put_run_file(self, transport: Transport, host: Host, name: str, content: bytes) -> str: ...

    def remember(self, transport: Transport, host: Host) -> PreviousServer:
        """What serves on ``host`` now (its launch record, running or not): what a sweep puts back."""
        ...

    def put_back(self, transport: Transport, host: Host, previous: PreviousServer, *, lease: LeasePass) -> str:
        """``host`` relaunched as ``previous`` (or stopped where it did not run), proven ready."""
        ...

    def note_lease(self, transport: Transport, host: Host, token: str, note: dict[str, Any]) -> bool: ...

    def read_lease(self, transport: Transport, host: Host) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class LiveServices:
    """The real thing; ``host_key_policy`` as the CLI's ``--host-key-policy``."""

    host_key_policy: str = "strict"
    on_notice: Callable[[str], None] | None = None

    def open_transport(self, host: Host) -> Transport:
        from ddtree_ops.transport import open_transport

        return open_transport(host, host_key_policy=self.host_key_policy, on_notice=self.on_notice)

    def probe(self, transport: Transport, host: Host) -> HostFacts:
        from ddtree_ops.probe import probe_host

        return probe_host(transport, host)

    def patch_status(self, transport: Transport, host: Host) -> HostPatchStatus:
        from ddtree_ops.patching.status import host_status

        return host_status(transport, host)

    def restart(
        self, transport: Transport, request: RestartRequest, *, cancel: threading.Event | None = None
    ) -> RestartResult:
        from ddtree_ops.service import lifecycle

        return lifecycle.restart(transport, request, cancel=cancel)

    def stop(self, transport: Transport, host: Host, *, lease: LeasePass) -> StopResult:
        from ddtree_ops.service import lifecycle

        return lifecycle.stop(transport, host, lease=lease)

    def status(self, transport: Transport, host: Host) -> ServiceStatus:
        from ddtree_ops.service import lifecycle

        return lifecycle.service_status(transport, host)

    def take_lease(
        self, transport: Transport, host: Host, *, token: str, holder: dict[str, Any]
    ) -> dict[str, Any] | None:
        from ddtree_ops.service import manager

        return manager.take_lease(transport, host, token=token, holder=holder)

    def release_lease(self, transport: Transport, host: Host, token: str) -> None:
        from ddtree_ops.service import manager

        manager.release_lease(transport, host, token)

    def put_run_file(self, transport: Transport, host: Host, name: str, content: bytes) -> str:
        from ddtree_ops.service import manager

        return manager.put_run_file(transport, host, name, content)

    def remember(self, transport: Transport, host: Host) -> PreviousServer:
        from ddtree_ops.service import lifecycle

        return lifecycle.remember_server(transport, host)

    def put_back(self, transport: Transport, host: Host, previous: PreviousServer, *, lease: LeasePass) -> str:
        from ddtree_ops.service import lifecycle

        # The rollouts' own undo: the recorded argv relaunched, with every readiness proof.
        return lifecycle.restore_server(transport, host, previous, lease=lease)

    def note_lease(self, transport: Transport, host: Host, token: str, note: dict[str, Any]) -> bool:
        from ddtree_ops.service import manager

        return manager.note_lease(transport, host, token, note)

    def read_lease(self, transport: Transport, host: Host) -> dict[str, Any] | None:
        from ddtree_ops.service import manager

        return manager.read_lease(transport, host)


def default_services(*, host_key_policy: str = "strict", on_notice: Callable[[str], None] | None = None) -> Services:
    return LiveServices(host_key_policy, on_notice)


__all__ = ["LiveServices", "Services", "default_services"]
