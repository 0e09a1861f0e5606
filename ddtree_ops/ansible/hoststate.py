"""The toolkit's learned state for a playbook's host, kept on the host itself.

The CLI keeps what it learns about a host (its model's load time, an eager fallback per
tree budget, a tuned policy's record: :mod:`ddtree_ops.state`) in one file on the operator's
machine, the one place its commands run from. A playbook has no such place: AWX runs it from
a fresh container each time, and several controllers may drive one fleet. So each task reads
the host's copy (``<run_dir>/ansible-state.json``, same format, same checks) into a private
file, works with the same :class:`~ddtree_ops.state.StateStore` on it, and writes it back
when it changed, failed or not (an eager fallback learned by a restart that then failed is
what the next restart needs). Only that host's records are in it. While the task runs,
``$DDTREE_OPS_STATE`` names that file, so that a store the toolkit opens on its own (the
canary's baseline launch) is the host's too: each task runs in a worker process of its own.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ddtree_ops.errors import ConfigError, RemoteFileError
from ddtree_ops.inventory_types import Host
from ddtree_ops.state import STATE_ENV, StateStore
from ddtree_ops.transport.base import Transport

STATE_FILE = "ansible-state.json"


def state_path(machine: Host) -> str:
    """Where ``machine``'s copy lives: beside its launch record, in its run dir."""
    return f"{machine.ddtree.run_dir.rstrip('/')}/{STATE_FILE}"


@contextmanager
def host_state(transport: Transport, machine: Host) -> Iterator[StateStore]:
    """A StateStore holding ``machine``'s records, written back to the host on the way out
    (when it changed). A record the store refuses is one ConfigError naming the host's file."""
    remote = state_path(machine)
    with tempfile.TemporaryDirectory(prefix="ddtree-ops-state-") as folder:
        local = Path(folder) / "state.json"
        try:
            before: bytes | None = transport.read_bytes(remote)
        except RemoteFileError:
            if transport.exists(remote):
                raise
            before = None
        if before is not None:
            local.write_bytes(before)
        store = StateStore(local)
        try:
            store.check()
        except ConfigError as exc:
            raise ConfigError(exc.message.replace(str(local), f"{machine.name}:{remote}"), host=machine.name) from None
        saved = os.environ.get(STATE_ENV)
        os.environ[STATE_ENV] = str(local)
        try:
            yield store
        finally:
            if saved is None:
                os.environ.pop(STATE_ENV, None)
            else:
                os.environ[STATE_ENV] = saved
            after = local.read_bytes() if local.exists() else None
            if after is not None and after != before:
                transport.write_atomic(remote, after, mode=0o600)


__all__ = ["STATE_FILE", "host_state", "state_path"]
