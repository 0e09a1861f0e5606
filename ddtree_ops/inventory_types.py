"""Typed, frozen host objects that an inventory resolves to.

Kept apart from the loader (:mod:`ddtree_ops.inventory`) so that every other module can
depend on the types without the parsing machinery. Defaults live here, in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal

DEFAULT_SERVER_COMMAND = "{python} -m sglang.launch_server"


def _frozen_env(env: Mapping[str, str] | None = None) -> Mapping[str, str]:
    return MappingProxyType(dict(env or {}))


@dataclass(frozen=True)
class SlotSettings:
    """One GPU slot of a host (``ddtree.server.slots``): its own server on its own GPUs.

    ``gpus`` are physical indices, given to the server as ``CUDA_VISIBLE_DEVICES`` in this
    order; ``port`` is the slot's server port (validated unique across the host's slots).
    """

    gpus: tuple[int, ...]
    port: int

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(g) for g in self.gpus)


@dataclass(frozen=True)
class SlotRef:
    """What a slot host (:meth:`Host.slot_hosts`) is a slot of: the machine's host name,
    the slot's index there and its GPUs. Things that are facts about the machine rather
    than one server (the patched site-packages, a CUDA-graph capture failure of its GPU
    arch) are keyed by ``machine``."""

    machine: str
    index: int
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class ServerSettings:
    """`ddtree: server:` — how the SGLang server on this host is launched."""

    model_path: str | None = None
    draft_model_path: str | None = None
    port: int = 30000
    bind_host: str = "127.0.0.1"
    extra_args: tuple[str, ...] = ()
    # The server's environment: tokens (HF_TOKEN) for all we know. Listings and --json name
    # the variables, never their values (cli/common.py to_jsonable, cli/hosts.py).
    env: Mapping[str, str] = field(default_factory=_frozen_env, metadata={"secret": True})
    expected_load_s: float = 600.0
    command: str = DEFAULT_SERVER_COMMAND
    # Who runs the server: "process" (ddtree-ops, in a session of its own) or "systemd"
    # (the operator's ``unit``, driven through a drop-in: service/systemd.py).
    manager: Literal["process", "systemd"] = "process"
    # manager systemd: the service unit; with slots a template (``sglang@.service``), whose
    # instance per slot is ``sglang@<i>.service``.
    unit: str | None = None
    # Empty: one server that sees every GPU (no CUDA_VISIBLE_DEVICES set), as before slots.
    slots: tuple[SlotSettings, ...] = ()


def is_template(unit: str | None) -> bool:
    """``sglang@.service``: a template, whose instances are ``sglang@<i>.service``."""
    return unit is not None and unit.split(".service")[0].endswith("@")


def slot_unit(unit: str | None, index: int) -> str | None:
    """The unit of GPU slot ``index``: the template's instance ``index``."""
    if unit is None or not is_template(unit):
        return unit
    return unit.replace("@.service", f"@{index}.service")


@dataclass(frozen=True)
class DdtreeSettings:
    """Everything under the inventory's `ddtree:` key, group- and host-level merged."""

    python: str = "python3"
    gpu: str | None = None
    run_dir: str = "~/.ddtree-ops"
    known_hosts: str | None = None
    server: ServerSettings = field(default_factory=ServerSettings)


@dataclass(frozen=True)
class Host:
    """One resolved inventory host. `address` is None for an ssh_config alias or local host.

    `groups`: every group holding it, ancestors included, without `all`, in Ansible's
    precedence order (depth, then ansible_group_priority, then name); `ungrouped` for a
    host in no other group. `source`: the file that first defines it. `slot`: set on the
    hosts :meth:`slot_hosts` makes, None on an inventory host.
    """

    name: str
    connection: Literal["ssh", "local"] = "ssh"
    address: str | None = None
    port: int | None = None
    user: str | None = None
    key_file: str | None = None
    groups: tuple[str, ...] = ()
    ddtree: DdtreeSettings = field(default_factory=DdtreeSettings)
    source: str = ""
    slot: SlotRef | None = None

    @property
    def python(self) -> str:
        return self.ddtree.python

    @property
    def machine(self) -> str:
        """The inventory host this is (a slot host: the host it is a slot of)."""
        return self.slot.machine if self.slot is not None else self.name

    def slot_hosts(self) -> tuple[Host, ...]:
        """One host per GPU slot, each addressed like a host of its own, so that the
        service code (run dir, pid, log, launch record, restart lock, learned load time)
        works per slot unchanged: named ``<name>/<i>``, the slot's port, run dir
        ``<run_dir>/slot-<i>``, ``CUDA_VISIBLE_DEVICES`` set to the slot's GPUs. A host
        without slots (or a slot host) is its own only slot."""
        server = self.ddtree.server
        if self.slot is not None or not server.slots:
            return (self,)
        out: list[Host] = []
        for index, slot in enumerate(server.slots):
            env = _frozen_env({**server.env, "CUDA_VISIBLE_DEVICES": slot.cuda_visible_devices})
            ddtree = replace(
                self.ddtree,
                run_dir=f"{self.ddtree.run_dir.rstrip('/')}/slot-{index}",
                server=replace(server, port=slot.port, env=env, slots=(), unit=slot_unit(server.unit, index)),
            )
            out.append(
                replace(
                    self,
                    name=f"{self.name}/{index}",
                    # An ssh_config alias is looked up by the host's name; the slot's name
                    # is not one, so the machine's name becomes the address it resolves.
                    address=self.address or (self.name if self.connection == "ssh" else None),
                    ddtree=ddtree,
                    slot=SlotRef(machine=self.name, index=index, gpus=slot.gpus),
                )
            )
        return tuple(out)
