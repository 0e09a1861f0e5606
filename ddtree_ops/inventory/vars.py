"""``group_vars/`` and ``host_vars/`` beside each source, and Ansible's variable precedence.

Files (Ansible's ``host_group_vars`` plugin): for a source ``SRC`` the base is SRC's
directory (a directory source is its own base); for an entity NAME the first of
``NAME``, ``NAME.yml``, ``NAME.yaml``, ``NAME.json`` that exists is used — a directory is
read whole, recursively, in name order (hidden names, ``*~`` and other extensions are
skipped). Later files win over earlier ones.

Precedence for one host, lowest first (ansible-core's ``VARIABLE_PRECEDENCE`` default
and ``VariableManager.get_vars``):

1. ``all``'s vars written in the inventory sources;
2. the host's other groups' inventory vars (each group and all its ancestors), sorted
   by depth (longest path from ``all``), then ``ansible_group_priority`` (default 1),
   then name;
3. ``group_vars/all`` of every source, in source order;
4. ``group_vars/<group>`` of every source, source by source, groups in the order of 2;
5. the host's own vars in the inventory sources (a later source wins);
6. ``host_vars/<host>`` of every source, in source order.

Each layer replaces a variable whole, except ``ddtree:`` which merges key by key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree_ops.errors import InventoryError
from ddtree_ops.inventory.schema import check_vars
from ddtree_ops.inventory.sources import (
    YAML_EXTENSIONS,
    HostData,
    RawInventory,
    leaves,
    merge_var,
    parse_yaml,
    read_text,
)
from ddtree_ops.inventory.values import Origin, kind

Layer = tuple[Mapping[str, Any], Mapping[str, Origin]]


@dataclass(frozen=True)
class Resolved:
    """A host's variables after precedence, and where each winning value was written.

    ``ddtree_origins``: ``ddtree:`` merges key by key, so its keys may come from several
    files; for each dotted key (``ddtree.server.slots``, and every key above and below
    it) the file of the last layer that wrote it, for errors found on the merged value.
    """

    values: Mapping[str, Any]
    origins: Mapping[str, Origin]
    ddtree_origins: Mapping[str, Origin] = field(default_factory=dict)


class VarFiles:
    """The group_vars/host_vars files beside the sources, loaded once each."""

    def __init__(self, sources: Sequence[Path]) -> None:
        self._bases = [Path(os.path.realpath(s if s.is_dir() else s.parent)) for s in sources]
        self._cache: dict[Path, Layer | None] = {}

    def layers(self, subdir: str, names: Sequence[str]) -> list[Layer]:
        """Source by source, entity by entity (Ansible's order)."""
        out: list[Layer] = []
        for base in self._bases:
            folder = base / subdir
            if not folder.is_dir():
                continue
            for name in names:
                if name.startswith(os.sep):
                    continue
                for file in find_vars_files(folder, name):
                    layer = self._load(file)
                    if layer is not None:
                        out.append(layer)
        return out

    def _load(self, file: Path) -> Layer | None:
        if file not in self._cache:
            data = parse_yaml(read_text(file, "vars"), file)
            if data is None or data == {}:
                self._cache[file] = None
            elif not isinstance(data, dict):
                raise InventoryError(f"{file}: expected a mapping of variables, got {kind(data)}")
            else:
                origin = Origin(str(file))
                for key in data:
                    if not isinstance(key, str):
                        raise InventoryError(f"{origin.at(str(key))}: a variable name must be a string")
                check_vars(data, origin)
                self._cache[file] = (data, dict.fromkeys(data, origin))
        return self._cache[file]


def find_vars_files(folder: Path, name: str) -> list[Path]:
    """Ansible's ``DataLoader.find_vars_files``: the first of NAME, NAME.yml, NAME.yaml,
    NAME.json that exists; a directory contributes all its files."""
    for ext in YAML_EXTENSIONS:
        full = folder / f"{name}{ext}"
        if full.exists():
            return _dir_files(full) if full.is_dir() else [full]
    return []


def _dir_files(folder: Path) -> list[Path]:
    found: list[Path] = []
    for name in sorted(os.listdir(folder)):
        if name.startswith(".") or name.endswith("~"):
            continue
        ext = os.path.splitext(name)[1]
        full = folder / name
        if full.is_dir() and not ext:
            found.extend(_dir_files(full))
        elif full.is_file() and (not ext or ext in YAML_EXTENSIONS):
            found.append(full)
    return found


def depths(raw: RawInventory) -> dict[str, int]:
    """Each group's depth: the longest path from ``all`` (Ansible's ``Group.depth``)."""
    memo: dict[str, int] = {"all": 0}

    def depth(name: str) -> int:
        if name not in memo:
            parents = raw.groups[name].parents or ["all"]
            memo[name] = max(depth(p) for p in parents) + 1
        return memo[name]

    for name in raw.groups:
        depth(name)
    return memo


def host_groups(raw: RawInventory, host: HostData, depth: Mapping[str, int]) -> list[str]:
    """The host's groups and their ancestors, without ``all``, in precedence order."""
    names: set[str] = set()
    for g in host.groups:
        names.add(g)
        names |= raw.ancestors(g)
    names.discard("all")
    return sorted(names, key=lambda g: (depth[g], raw.groups[g].priority, g))


def resolve(raw: RawInventory, host: HostData, groups: Sequence[str], files: VarFiles) -> Resolved:
    """Merge the six layers of the module docstring for one host."""
    layers: list[Layer] = [(raw.groups["all"].vars.values, raw.groups["all"].vars.origins)]
    layers += [(raw.groups[g].vars.values, raw.groups[g].vars.origins) for g in groups]
    layers += files.layers("group_vars", ["all"])
    layers += files.layers("group_vars", groups)
    layers.append((host.vars.values, host.vars.origins))
    layers += files.layers("host_vars", [host.name])
    values: dict[str, Any] = {}
    origins: dict[str, Origin] = {}
    ddtree_origins: dict[str, Origin] = {}
    for layer_values, layer_origins in layers:
        for key, value in layer_values.items():
            merge_var(values, key, value)
            origins[key] = layer_origins[key]
            if key == "ddtree" and isinstance(value, dict):
                for leaf, _ in leaves({key: value}):
                    parts = leaf.split(".")
                    for depth in range(1, len(parts) + 1):
                        ddtree_origins[".".join(parts[:depth])] = layer_origins[key]
    return Resolved(values=values, origins=origins, ddtree_origins=ddtree_origins)
