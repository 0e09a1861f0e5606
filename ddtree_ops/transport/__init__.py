"""Transports: how ddtree-ops reaches a host (SSH via paramiko, or local).

:func:`open_transport` is the one factory the rest of the code calls; it picks the
implementation from the inventory host's ``ansible_connection``.
"""

from __future__ import annotations

from collections.abc import Callable

from ddtree_ops.inventory_types import Host
from ddtree_ops.transport.base import CommandResult, RoundTripCounter, Script, Transport, command_text

__all__ = ["CommandResult", "RoundTripCounter", "Script", "Transport", "command_text", "open_transport"]

HOST_KEY_POLICIES = ("strict", "accept-new")


def open_transport(
    host: Host,
    *,
    host_key_policy: str = "strict",
    connect_timeout: float = 10.0,
    counter: RoundTripCounter | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> Transport:
    """A transport for ``host``. SSH connects lazily, on first use, so opening is cheap
    and a connection failure surfaces as ConnectError/AuthError/HostKeyError from the
    first command (inside the per-host fan-out, where it is reported per host).
    ``on_notice`` hears what is not an error but must be said (where ``accept-new``
    recorded a host key)."""
    if host_key_policy not in HOST_KEY_POLICIES:
        raise ValueError(f"host_key_policy must be one of {HOST_KEY_POLICIES}, not {host_key_policy!r}")
    if host.connection == "local":
        from ddtree_ops.transport.local import LocalTransport

        return LocalTransport(host.name, counter=counter)
    from ddtree_ops.transport.ssh import SSHTransport

    return SSHTransport(
        host, host_key_policy=host_key_policy, connect_timeout=connect_timeout, counter=counter, on_notice=on_notice
    )
