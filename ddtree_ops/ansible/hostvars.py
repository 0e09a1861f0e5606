"""A task's host as the CLI would have it: its ``ddtree:`` variable, as Ansible resolved it.

The collection's tasks read the same ``ddtree:`` mapping the CLI reads from an inventory
(python, run_dir, gpu, server: port, model, command, manager, unit, env, slots, ...), checked
by the same schema and built into the same frozen :class:`~ddtree_ops.inventory_types.Host`,
so that both tools launch, find and observe the same server. Ansible has already evaluated
its templates, decrypted its vault values and applied its precedence (extra vars, play vars,
``set_fact``) by then: that is Ansible's to do inside a playbook.

One difference is Ansible's and is documented: Ansible replaces a dict variable whole (its
default ``hash_behaviour``), so a host's ``ddtree:`` replaces its group's; ddtree-ops' own
inventory loader merges them key by key.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddtree_ops.errors import InventoryError
from ddtree_ops.inventory.build import LOCAL_CONNECTIONS, build_settings, check_manager, check_slot_count, check_slots
from ddtree_ops.inventory.schema import check_ddtree
from ddtree_ops.inventory_types import Host


def host_from_vars(name: str, ddtree: Any, *, connection: str | None = None, base_dir: str | None = None) -> Host:
    """The host ``name`` from its resolved ``ddtree`` variable (None: the defaults);
    ``connection`` its ``ansible_connection``; ``base_dir`` what a local host's relative
    paths are relative to (its inventory's directory, as for the CLI). InventoryError, one
    line naming the host and key, for a value the CLI would refuse too."""

    def at(keypath: str) -> str:
        return f"host {name}: variable {keypath}"

    raw: Mapping[str, Any] = {}
    if ddtree is not None:
        if not isinstance(ddtree, Mapping):
            raise InventoryError(f"{at('ddtree')}: expected a mapping, got {type(ddtree).__name__}")
        check_ddtree(dict(ddtree), at)
        check_slot_count(ddtree, at)
        raw = ddtree
    local = connection in LOCAL_CONNECTIONS
    settings = build_settings(raw, Path(base_dir or "."), local=local)
    if settings.server.slots:
        check_slots(settings.server, at)
    check_manager(settings.server, at)
    return Host(name=name, connection="local" if local else "ssh", ddtree=settings, source="ansible")


__all__ = ["host_from_vars"]
