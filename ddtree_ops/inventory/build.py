"""Resolved variables -> frozen :class:`Host` objects, and the :class:`Inventory` of them.

The connection variables are read as Ansible's connection plugins read them (ssh's
documented ``vars:``; when several names are set the last of the list wins, as in
Ansible's config manager): address ``ansible_host``, ``ansible_ssh_host``; port
``ansible_port``, ``ansible_ssh_port``; user ``ansible_user``, ``ansible_ssh_user``;
key ``ansible_private_key_file``, ``ansible_ssh_private_key_file`` (plus the
``ansible_paramiko_*`` names under the paramiko connection). A port may be a quoted
integer (Ansible's option type is integer). A host with neither address must be an
``~/.ssh/config`` alias: nothing else could reach it.

Templates (``{{ ... }}``) in the values read here — ``ansible_connection``, the connection
variables chosen, ``ddtree:`` — are evaluated on the host's resolved variables
(``templates``), then checked like a value written as it is.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ddtree_ops.errors import InventoryError, TargetError
from ddtree_ops.inventory.schema import UNIT_NAME_MAX, check_ddtree, parse_gpus, refuse_vault
from ddtree_ops.inventory.sources import RawInventory, load_sources
from ddtree_ops.inventory.templates import Budget, HostTemplates
from ddtree_ops.inventory.values import EnvFloat, EnvInt, FromEnv, Origin, env_mask, env_names, shown, unmarked
from ddtree_ops.inventory.vars import Resolved, VarFiles, depths, host_groups, resolve
from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings, SlotSettings, is_template, slot_unit
from ddtree_ops.numbers import parse_count

SSH_CONNECTIONS = ("ssh", "smart", "ansible.builtin.ssh")
PARAMIKO_CONNECTIONS = ("paramiko", "paramiko_ssh", "ansible.builtin.paramiko_ssh")
LOCAL_CONNECTIONS = ("local", "ansible.builtin.local")
# option -> the variables Ansible's ssh connection plugin documents for it, in its order.
_SSH_VARS: dict[str, tuple[str, ...]] = {
    "address": ("ansible_host", "ansible_ssh_host"),
    "port": ("ansible_port", "ansible_ssh_port"),
    "user": ("ansible_user", "ansible_ssh_user"),
    "key_file": ("ansible_private_key_file", "ansible_ssh_private_key_file"),
}
_PARAMIKO_EXTRA = {
    "address": "ansible_paramiko_host",
    "port": "ansible_paramiko_port",
    "user": "ansible_paramiko_user",
    "key_file": "ansible_paramiko_private_key_file",
}


@dataclass(frozen=True)
class Inventory:
    """Every host of the loaded sources, and which groups hold them (in inventory order)."""

    hosts: Mapping[str, Host]
    groups: Mapping[str, tuple[str, ...]]
    sources: tuple[Path, ...] = field(default=())

    def resolve(self, target: str) -> list[Host]:
        """``all``, a group, a host, or a comma list of those -> hosts, in inventory order, once each.

        For the commands that act once per machine (deploy, doctor, rollback: the patch is
        installed once in the host's site-packages): a slot ``host/i`` stands for its host.
        """
        wanted = {host.machine for host in self.resolve_slots(target)}
        return [host for name, host in self.hosts.items() if name in wanted]

    def resolve_slots(self, target: str) -> list[Host]:
        """Like :meth:`resolve`, for the commands that act on servers (restart, stop, logs,
        status): a host or group means every slot of its hosts (:meth:`Host.slot_hosts`),
        ``host/i`` one slot. A host without slots is its own only slot."""
        wanted: set[str] = set()
        for item in (part.strip() for part in target.split(",")):
            if not item:
                continue
            if item == "all":
                wanted.update(self.hosts)
            elif item in self.groups:
                wanted.update(self.groups[item])
            elif item in self.hosts:
                wanted.add(item)
            elif "/" in item and item.rsplit("/", 1)[0] in self.hosts:
                machine, _, index = item.rpartition("/")
                names = [slot.name for slot in self.hosts[machine].slot_hosts() if slot.slot is not None]
                if item not in names:
                    listing = f"its slots are {', '.join(names)}" if names else "it has no ddtree.server.slots"
                    raise TargetError(f"unknown slot {index!r} of host {machine!r}: {listing}")
                wanted.add(item)
            else:
                raise TargetError(self._unknown_target_message(item))
        if not wanted:
            raise TargetError(f"empty target {target!r}; " + self._known())
        return [
            slot
            for name, host in self.hosts.items()
            for slot in host.slot_hosts()
            if name in wanted or slot.name in wanted
        ]

    def _known(self) -> str:
        groups = ", ".join(sorted(g for g in self.groups if g != "all")) or "(none)"
        return f"known groups: all, {groups}; hosts: {', '.join(self.hosts) or '(none)'}"

    def _unknown_target_message(self, item: str) -> str:
        close = difflib.get_close_matches(item, [*self.groups, *self.hosts], n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown target {item!r}{hint}; {self._known()}"


def load_inventory(paths: Sequence[Path]) -> Inventory:
    """Load and merge inventory sources. Raises :class:`InventoryError` naming file and key.

    A host without an address is reached at its inventory name, as Ansible reaches it: the
    SSH transport looks the name up in ``~/.ssh/config`` (an alias's HostName, User, Port,
    ...) and otherwise connects to it as a DNS name.
    """
    if not paths:
        raise InventoryError(
            "no inventory given: pass -i PATH or set DDTREE_OPS_INVENTORY (no inventories/ directory here)"
        )
    sources = [Path(p) for p in paths]
    raw = load_sources(sources)
    files = VarFiles(sources)
    depth = depths(raw)
    hosts: dict[str, Host] = {}
    budget = Budget()  # what the templates of all hosts may spend together
    with budget.capping():
        for data in raw.hosts.values():
            groups = host_groups(raw, data, depth)
            resolved = resolve(raw, data, groups, files)
            hosts[data.name] = build_host(data.name, resolved, data.origin, groups=tuple(groups), budget=budget)
    members = {g: tuple(h for h in raw.hosts if g in hosts[h].groups or g == "all") for g in raw.groups}
    return Inventory(hosts=MappingProxyType(hosts), groups=MappingProxyType(members), sources=tuple(sources))


def resolved_raw(paths: Sequence[Path]) -> tuple[RawInventory, dict[str, Resolved]]:
    """Every host's variables after precedence, unvalidated (for tests and diagnostics)."""
    sources = [Path(p) for p in paths]
    raw = load_sources(sources)
    files, depth = VarFiles(sources), depths(raw)
    return raw, {h.name: resolve(raw, h, host_groups(raw, h, depth), files) for h in raw.hosts.values()}


def connection_vars(values: Mapping[str, Any], connection: str) -> dict[str, str | None]:
    """For each connection option, the variable that sets it (the last set one of its list)."""
    out: dict[str, str | None] = {}
    for option, names in _SSH_VARS.items():
        if connection in PARAMIKO_CONNECTIONS:
            names = (*names, _PARAMIKO_EXTRA[option])
        chosen = None
        for name in names:
            if values.get(name) is not None:
                chosen = name
        out[option] = chosen
    return out


def build_host(name: str, resolved: Resolved, first: Origin, *, groups: tuple[str, ...],
               budget: Budget | None = None) -> Host:
    """The host ``name``: its templates evaluated (under ``budget``), its values checked.
    An error names what a template computed from ``lookup('env')`` by its mask, wherever
    the check that failed put it in its message (as text, in a key's path)."""
    templates = HostTemplates(name, resolved.values, groups, budget=budget)
    try:
        return _build_host(name, resolved, first, groups=groups, templates=templates)
    except InventoryError as exc:
        raise InventoryError(templates.masked(str(exc))) from None


def _build_host(name: str, resolved: Resolved, first: Origin, *, groups: tuple[str, ...],
                templates: HostTemplates) -> Host:
    values, origins = resolved.values, resolved.origins

    def where(var: str) -> str:
        return origins[var].at(var) if var in origins else f"{first.file}: host {name!r}: {var}"

    def ddtree_where(keypath: str) -> str:
        # The file of the last layer that wrote this key, or the nearest key above it.
        candidate = keypath
        while candidate:
            origin = resolved.ddtree_origins.get(candidate)
            if origin is not None:
                return origin.at(keypath)
            candidate = re.sub(r"(\.[^.\[]*|\[\d+\])\Z", "", candidate) if "." in candidate else ""
        return f"{first.file}: host {name!r}: {keypath}"

    def evaluated(var: str) -> Any:
        refuse_vault(values[var], where(var))
        return templates.render_var(var, where)

    connection_raw = values.get("ansible_connection")
    if connection_raw is None:
        connection_raw = "ssh"
    else:
        connection_raw = evaluated("ansible_connection")
    if connection_raw in LOCAL_CONNECTIONS:
        connection = "local"
    elif connection_raw in SSH_CONNECTIONS or connection_raw in PARAMIKO_CONNECTIONS:
        connection = "ssh"
    else:
        raise InventoryError(
            f"{where('ansible_connection')}: {connection_raw!r} is not supported (use 'ssh' or 'local')"
        )
    chosen = connection_vars(values, str(connection_raw))
    picked: dict[str, Any] = {}
    for option, var in chosen.items():
        if var is None:
            picked[option] = None
            continue
        value = evaluated(var)
        if option == "port":
            value = _port(value, where(var))
        elif isinstance(value, (EnvInt, EnvFloat)):  # as text, still read from the environment
            value = FromEnv(str(unmarked(value)), value.names)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # Ansible's string options take numbers as text (`ansible_user: 1000`)
        elif not isinstance(value, str) or not value:
            raise InventoryError(f"{where(var)}: expected a string, got {value!r}")
        picked[option] = value
    ddtree_raw: dict[str, Any] = {}
    if values.get("ddtree") is not None:
        ddtree_raw = templates.render_var("ddtree", ddtree_where)
        check_ddtree(ddtree_raw, ddtree_where)
        check_slot_count(ddtree_raw, ddtree_where)
    # The slot checks compute ports and GPUs from these: if one came from lookup('env'),
    # what they compute is not shown either. Numbers are used plain from here on.
    server_env = env_names(ddtree_raw.get("server"))
    hidden = env_mask(server_env) if server_env else None
    ddtree_raw = unmarked(ddtree_raw)
    # Relative paths in ddtree: are anchored at the file that first defines the host.
    base_dir = Path(first.file).resolve().parent
    settings = build_settings(ddtree_raw, base_dir, local=connection == "local")

    if settings.server.slots:
        check_slots(settings.server, ddtree_where, hidden=hidden)
    check_manager(settings.server, ddtree_where)
    return Host(
        name=name,
        connection=connection,  # type: ignore[arg-type]  # narrowed to the Literal above
        address=picked["address"],
        port=picked["port"],
        user=picked["user"],
        key_file=picked["key_file"],
        groups=groups,
        ddtree=settings,
        source=first.file,
    )


def check_manager(server: ServerSettings, where: Callable[[str], str]) -> None:
    """``manager: systemd`` names the unit it drives; with GPU slots that is a template
    (one instance per slot); a template without slots names no unit. Checked on the merged
    value: a group may set ``manager`` and a host its ``unit``."""
    if server.manager != "systemd":
        if server.unit is not None:
            raise InventoryError(f"{where('ddtree.server.unit')}: only used with manager: systemd (the manager is "
                                 f"{shown(server.manager)})")
        return
    if server.unit is None:
        raise InventoryError(f"{where('ddtree.server.manager')}: manager systemd needs ddtree.server.unit, the "
                             f"service unit that runs SGLang (e.g. sglang.service)")
    if server.slots and not is_template(server.unit):
        raise InventoryError(f"{where('ddtree.server.unit')}: {shown(server.unit)} with GPU slots: give a template "
                             f"such as sglang@.service (slot i runs sglang@i.service)")
    if not server.slots and is_template(server.unit):
        example = "NAME@0.service" if isinstance(server.unit, FromEnv) else server.unit.replace("@.", "@0.")
        raise InventoryError(f"{where('ddtree.server.unit')}: {shown(server.unit)} is a template; name the instance "
                             f"that runs SGLang (e.g. {example}) or give the host GPU slots")
    last = slot_unit(server.unit, len(server.slots) - 1) if server.slots else None
    if last is not None and len(last) > UNIT_NAME_MAX:  # the template fits, its last instance not
        if isinstance(server.unit, FromEnv):  # its instance's name, or length, would show it
            raise InventoryError(f"{where('ddtree.server.unit')}: slot {len(server.slots) - 1}'s instance of "
                                 f"{shown(server.unit)} has more than {UNIT_NAME_MAX} bytes")
        raise InventoryError(f"{where('ddtree.server.unit')}: slot {len(server.slots) - 1} runs {last}: a systemd "
                             f"unit name has at most {UNIT_NAME_MAX} bytes, this one {len(last)}")


def _port(value: Any, where: str) -> int:
    """Ansible's port option is an integer: ``"2222"`` is accepted, ``yes`` or ``abc`` are not."""
    if isinstance(value, str) and parse_count(value.strip()) is not None:  # ASCII digits: '²' is no port
        value = EnvInt(int(value.strip()), value.names) if isinstance(value, FromEnv) else int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise InventoryError(f"{where}: expected a port number (integer 1-65535), got {value!r}")
    return int(value)  # plain: str() of an EnvInt is its mask


def build_settings(raw: Mapping[str, Any], base_dir: Path, *, local: bool) -> DdtreeSettings:
    """The merged ``ddtree:`` mapping (already validated) -> :class:`DdtreeSettings`."""
    defaults = DdtreeSettings()
    server_raw: Mapping[str, Any] = raw.get("server") or {}
    sdef = ServerSettings()
    # str() of a FromEnv would drop what keeps it out of listings; numbers become text.
    env = {k: v if isinstance(v, str) else str(v) for k, v in (server_raw.get("env") or {}).items()}
    server = ServerSettings(
        model_path=server_raw.get("model_path", sdef.model_path),
        draft_model_path=server_raw.get("draft_model_path", sdef.draft_model_path),
        port=server_raw.get("port", sdef.port),
        bind_host=server_raw.get("bind_host", sdef.bind_host),
        extra_args=tuple(server_raw.get("extra_args", sdef.extra_args)),
        env=MappingProxyType(env),
        expected_load_s=float(server_raw.get("expected_load_s", sdef.expected_load_s)),
        command=server_raw.get("command", sdef.command),
        manager=server_raw.get("manager", sdef.manager),
        unit=server_raw.get("unit", sdef.unit),
    )
    if server_raw.get("slots") is not None:
        server = replace(server, slots=build_slots(server_raw["slots"], server.port))
    python = raw.get("python", defaults.python)
    run_dir = raw.get("run_dir", defaults.run_dir)
    known_hosts = raw.get("known_hosts", defaults.known_hosts)
    if local:
        # A local host's paths are on this machine: make them independent of the cwd.
        if "/" in python:
            python = _against(base_dir, python)
        run_dir = _against(base_dir, run_dir)
    if known_hosts is not None:
        known_hosts = _against(base_dir, known_hosts)  # always a file on this machine
    return DdtreeSettings(
        python=python, gpu=raw.get("gpu", defaults.gpu), run_dir=run_dir, known_hosts=known_hosts, server=server
    )


# The flags SGLang reads as its tensor-parallel size (server_args.py: --tensor-parallel-size
# with its aliases); with slots it must equal the slot's GPU count.
TP_FLAGS = ("--tp-size", "--tensor-parallel-size", "--tp")


def build_slots(raw: Any, base_port: int) -> tuple[SlotSettings, ...]:
    """The merged ``slots`` value (its shape already validated where written) -> slots.
    A count gives slot ``i`` GPUs ``i*G .. i*G+G-1``; a slot without a port gets
    ``server.port + i``. Incomplete counts are left to :func:`check_slots` to name."""
    if isinstance(raw, dict):
        count, per = raw.get("count"), raw.get("gpus_per_slot")
        if count is None or per is None:
            return (SlotSettings(gpus=(), port=base_port),)  # refused by check_slots
        return tuple(SlotSettings(gpus=tuple(range(i * per, i * per + per)), port=base_port + i) for i in range(count))
    return tuple(
        SlotSettings(gpus=parse_gpus(item["gpus"])[0], port=item.get("port", base_port + i))
        for i, item in enumerate(raw)
    )


# More GPUs than any one host has (a DGX has 8, the largest nodes 16 or so): a count or a
# size that big is a typo, and would be built before any other check saw it.
MAX_HOST_GPUS = 1024


def check_slot_count(raw: Mapping[str, Any], where: Callable[[str], str]) -> None:
    """``slots: {count: N, gpus_per_slot: G}`` naming more GPUs than a host has is refused
    before the slots are made (``count: 1000000000`` would make a billion)."""
    slots = (raw.get("server") or {}).get("slots")
    if not isinstance(slots, dict):
        return
    count, per = slots.get("count"), slots.get("gpus_per_slot")
    if isinstance(count, int) and isinstance(per, int) and count * per > MAX_HOST_GPUS:
        raise InventoryError(f"{where('ddtree.server.slots')}: {count!r} slots of {per!r} GPU(s) each: more GPUs "
                             f"than a host has (at most {MAX_HOST_GPUS})")


def check_slots(server: ServerSettings, where: Callable[[str], str], *, hidden: str | None = None) -> None:
    """Slots that fit together, or one :class:`InventoryError` naming file and key: each
    slot has GPUs, no GPU is in two slots, no two slots share a port, and a tensor-parallel
    size in ``extra_args`` equals every slot's GPU count. Whether the host has those GPUs
    is known only on the host: ``doctor`` checks it. ``hidden``: the mask of the
    ``lookup('env')`` values among the server's settings, shown instead of every port, GPU
    and size (computed from them, they would show them)."""

    def show(value: object) -> object:
        return value if hidden is None else hidden

    at = where("ddtree.server.slots")
    if any(not slot.gpus for slot in server.slots):
        raise InventoryError(f"{at}: a count needs both count and gpus_per_slot")
    gpu_owner: dict[int, int] = {}
    port_owner: dict[int, int] = {}
    for index, slot in enumerate(server.slots):
        for gpu in slot.gpus:
            if gpu in gpu_owner:
                raise InventoryError(
                    f"{at}: GPU {show(gpu)} is in slot {gpu_owner[gpu]} and slot {index}; slots must not share GPUs"
                )
            gpu_owner[gpu] = index
        if slot.port > 65535:
            raise InventoryError(f"{at}: slot {index}'s port {show(slot.port)} (server.port + {index}) is above 65535")
        if slot.port in port_owner:
            raise InventoryError(
                f"{at}: port {show(slot.port)} is used by slot {port_owner[slot.port]} and slot {index} "
                f"(a slot without a port gets server.port + its index); give each slot its own port"
            )
        port_owner[slot.port] = index
    if "CUDA_VISIBLE_DEVICES" in server.env:
        raise InventoryError(
            f"{where('ddtree.server.env')}: CUDA_VISIBLE_DEVICES is set by each slot from its gpus; "
            f"remove it from env when slots are used"
        )
    tp = tensor_parallel_size(server.extra_args)
    if tp is None:
        return
    flag, value = tp
    for index, slot in enumerate(server.slots):
        if value != str(len(slot.gpus)):
            raise InventoryError(
                f"{where('ddtree.server.extra_args')}: {flag} {show(value)} does not match slot {index}'s "
                f"{show(len(slot.gpus))} GPU(s) ({show(slot.cuda_visible_devices)}) in ddtree.server.slots; "
                f"a slot's server uses exactly its GPUs"
            )


def tensor_parallel_size(args: Sequence[str]) -> tuple[str, str] | None:
    """(flag, value) of the last tensor-parallel flag in ``args`` (argparse: the last wins)."""
    found: tuple[str, str] | None = None
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in TP_FLAGS:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        found = (flag, value)
    return found


def _against(base_dir: Path, value: str) -> str:
    if value.startswith("~") or os.path.isabs(value):
        return value
    return os.path.normpath(base_dir / value)
