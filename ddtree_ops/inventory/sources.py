"""Inventory sources -> one :class:`RawInventory` (groups, hosts, the vars written in them).

A source is a YAML file, an INI file or a directory of those, read the way Ansible's
``yaml`` and ``ini`` inventory plugins and its directory walk read them:

- ``.yml`` / ``.yaml`` / ``.json`` files are YAML inventories; a file without extension
  is YAML when it parses to a mapping, INI otherwise; any other extension is INI;
- a directory loads its entries in name order, recursively, skipping hidden names,
  ``group_vars``, ``host_vars``, ``vars_plugins`` and Ansible's ignored extensions
  (``.pyc .pyo .swp .bak ~ .rpm .md .txt .rst .orig .cfg .retry``);
- several sources build one inventory: a host or group named in two sources is one
  host or group; a variable set in a later source replaces the earlier value (Ansible's
  rule), ``ddtree:`` merged key by key.

What cannot be honoured is refused, naming the file: a YAML file with a ``plugin:`` key
(a dynamic inventory plugin's config), an executable script (``#!``), a vault-encrypted
file, a TOML inventory. Within one file a host or group given two different values for
one variable is an error (which one Ansible keeps depends on line order, not intent),
and so is a mapping key written twice.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ddtree_ops.errors import InventoryError
from ddtree_ops.fsutil import read_regular_text
from ddtree_ops.inventory.ranges import RangeError, expand_pattern
from ddtree_ops.inventory.schema import check_vars, group_name_problem
from ddtree_ops.inventory.values import Origin, Unsafe, Vaulted, did_you_mean, kind
from ddtree_ops.yamlfile import UniqueKeyLoader, safe_load_unique

GROUP_KEYS = ("hosts", "vars", "children")
YAML_EXTENSIONS = ("", ".yml", ".yaml", ".json")
# Ansible's IGNORED_ALWAYS + INVENTORY_IGNORE_EXTS defaults (REJECT_EXTS + .orig .cfg .retry).
_IGNORED = re.compile(
    r"^\.|^host_vars$|^group_vars$|^vars_plugins$|"
    + "|".join(
        re.escape(ext) + "$"
        for ext in (".pyc", ".pyo", ".swp", ".bak", "~", ".rpm", ".md", ".txt", ".rst", ".orig", ".cfg", ".retry")
    )
)
_INI_SECTION = re.compile(r"^\[([^:\]\s]+)(?::(\w+))?\]\s*(?:\#.*)?$")
_INI_GROUPNAME = re.compile(r"^([^:\]\s]+)\s*(?:\#.*)?$")
VAULT_HEADER = "$ANSIBLE_VAULT"
EXPORT_HINT = "save a static copy with: ansible-inventory -i SOURCE --list --yaml --export > static.yml"


# --------------------------------------------------------------------------- values


class AnsibleYamlLoader(UniqueKeyLoader):
    """Our duplicate-refusing loader plus Ansible's two tags: ``!vault`` and ``!unsafe``."""


def _vault(loader: yaml.SafeLoader, node: yaml.Node) -> Vaulted:
    return Vaulted(str(loader.construct_scalar(node)))  # type: ignore[arg-type]


def _unsafe(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.ScalarNode):
        return Unsafe(loader.construct_scalar(node))
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_mapping(node, deep=True)  # type: ignore[arg-type]


AnsibleYamlLoader.add_constructor("!vault", _vault)
AnsibleYamlLoader.add_constructor("!unsafe", _unsafe)


def read_text(path: Path, what: str = "inventory") -> str:
    """A file's text; a vault-encrypted file is refused (we cannot decrypt it)."""
    try:
        text = read_regular_text(path)
    except FileNotFoundError:
        raise InventoryError(f"{what} file not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise InventoryError(f"{path}: not a UTF-8 text file (byte {exc.start}): an {what} is YAML or INI") from None
    except OSError as exc:
        raise InventoryError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    # A UTF-8 byte-order mark (what some Windows editors write first) is an encoding
    # artifact, not text: PyYAML skips it, and an INI file would otherwise begin with an
    # invisible "\ufeff[group]" host.
    text = text.removeprefix("\ufeff")
    if text.lstrip().startswith(VAULT_HEADER):
        raise InventoryError(
            f"{path}: vault-encrypted file ({VAULT_HEADER} header): ddtree-ops does not decrypt vault; "
            f"keep the variables ddtree-ops reads in a plain file"
        )
    return text


def parse_yaml(text: str, path: Path) -> Any:
    """YAML with Ansible's tags; a duplicate key or a syntax error names file:line."""
    try:
        return safe_load_unique(text, source=str(path), error=InventoryError, loader=AnsibleYamlLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = exc.problem or exc.context or "invalid YAML"
        raise InventoryError(f"{where}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as exc:
        raise InventoryError(f"{path}: YAML error: {exc}") from None


# --------------------------------------------------------------------------- the model


@dataclass
class Vars:
    """Variables set on one host or group, with where each was written."""

    values: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, Origin] = field(default_factory=dict)
    # (file, dotted leaf) -> (value, origin): what this file already said, for conflicts.
    seen: dict[tuple[str, str], tuple[Any, Origin]] = field(default_factory=dict)


@dataclass
class GroupData:
    name: str
    vars: Vars = field(default_factory=Vars)
    parents: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    priority: int = 1  # Ansible's default ansible_group_priority


@dataclass
class HostData:
    name: str
    origin: Origin  # where it was first defined
    vars: Vars = field(default_factory=Vars)
    groups: list[str] = field(default_factory=list)  # direct groups, in order met


@dataclass
class RawInventory:
    """Every source parsed into Ansible's data model, before variables are resolved."""

    groups: dict[str, GroupData] = field(default_factory=dict)
    hosts: dict[str, HostData] = field(default_factory=dict)
    sources: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.add_group("all")
        self.add_group("ungrouped")

    def add_group(self, name: str) -> GroupData:
        if name not in self.groups:
            self.groups[name] = GroupData(name)
        return self.groups[name]

    def add_child(self, parent: str, child: str, origin: Origin) -> None:
        if child == "all" or parent == child or parent in self.descendants(child):
            raise InventoryError(f"{origin.at(child)}: group {child!r} under {parent!r} would contain itself")
        p, c = self.add_group(parent), self.add_group(child)
        if child not in p.children:
            p.children.append(child)
        if parent not in c.parents:
            c.parents.append(parent)

    def add_host(self, name: str, group: str | None, origin: Origin) -> HostData:
        host = self.hosts.get(name)
        if host is None:
            host = self.hosts[name] = HostData(name, origin)
        if group is not None:
            g = self.add_group(group)
            if name not in g.hosts:
                g.hosts.append(name)
            if group not in host.groups:
                host.groups.append(group)
        return host

    def set_group_var(self, group: str, key: str, value: Any, origin: Origin) -> None:
        g = self.add_group(group)
        if key == "ansible_group_priority":
            try:
                if isinstance(value, bool):
                    raise ValueError
                g.priority = int(value)
            except (TypeError, ValueError):
                raise InventoryError(f"{origin.at(key)}: expected an integer, got {value!r}") from None
            return
        set_var(g.vars, key, value, origin, owner=f"group {group!r}")

    def set_host_var(self, host: str, key: str, value: Any, origin: Origin) -> None:
        set_var(self.hosts[host].vars, key, value, origin, owner=f"host {host!r}")

    def ancestors(self, name: str) -> set[str]:
        return self._closure(name, lambda g: g.parents)

    def descendants(self, name: str) -> set[str]:
        return self._closure(name, lambda g: g.children)

    def _closure(self, name: str, edges: Callable[[GroupData], list[str]]) -> set[str]:
        out: set[str] = set()
        todo = list(edges(self.groups[name])) if name in self.groups else []
        while todo:
            g = todo.pop()
            if g not in out:
                out.add(g)
                todo.extend(edges(self.groups[g]))
        return out

    def reconcile(self) -> None:
        """Ansible's reconcile_inventory: top groups go under ``all``; a host in no
        group but ``all`` is in ``ungrouped``, and only such a host."""
        for name, g in self.groups.items():
            if name != "all" and not g.parents:
                self.add_child("all", name, Origin("(inventory)"))
        ungrouped = self.groups["ungrouped"]
        for host in self.hosts.values():
            real = [g for g in host.groups if g not in ("all", "ungrouped")]
            if real:
                if "ungrouped" in host.groups:
                    host.groups.remove("ungrouped")
                    ungrouped.hosts.remove(host.name)
            elif "ungrouped" not in host.groups:
                host.groups.append("ungrouped")
                ungrouped.hosts.append(host.name)


def set_var(target: Vars, key: str, value: Any, origin: Origin, *, owner: str) -> None:
    """Set one variable. Same file, other value -> error; a later file wins (Ansible)."""
    if key == "ddtree":
        check_vars({key: value}, origin)
    for leaf, leaf_value in leaves({key: value}):
        slot = (origin.file, leaf)
        if slot in target.seen and target.seen[slot][0] != leaf_value:
            before, where = target.seen[slot]
            raise InventoryError(
                f"{origin.file}: {owner} is defined twice with different {leaf}: "
                f"{before!r} at {_where(where)}, {leaf_value!r} at {_where(origin)}"
            )
        target.seen.setdefault(slot, (leaf_value, origin))
    merge_var(target.values, key, value)
    target.origins[key] = origin


def _where(origin: Origin) -> str:
    return f"line {origin.line}" if origin.line is not None else (origin.where or origin.file)


def merge_var(into: dict[str, Any], key: str, value: Any) -> None:
    """``ddtree:`` merges key by key (documented); every other variable is replaced whole."""
    if key == "ddtree" and isinstance(value, dict) and isinstance(into.get(key), dict):
        into[key] = deep_merge(into[key], value)
    else:
        into[key] = value


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def leaves(vars_: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``ddtree:`` is merged key by key, so it is compared leaf by leaf; other vars whole."""
    out: list[tuple[str, Any]] = []
    for key, value in vars_.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and (prefix or key == "ddtree"):
            out.extend(leaves(value, f"{dotted}."))
        else:
            out.append((dotted, value))
    return out


# --------------------------------------------------------------------------- sources


DEFAULT_DIRECTORY = Path("inventories")
ENV_VAR = "DDTREE_OPS_INVENTORY"


def default_sources(environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> list[Path]:
    """The sources when no ``-i`` is given: ``$DDTREE_OPS_INVENTORY`` (``os.pathsep``-separated),
    else ``inventories/`` as one directory source — every YAML and INI file in it, whatever
    its extension (``.yml`` included), read the way Ansible reads ``-i inventories/``."""
    env = (os.environ if environ is None else environ).get(ENV_VAR)
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    directory = (cwd or Path()) / DEFAULT_DIRECTORY
    return [directory] if directory.is_dir() else []


def load_sources(paths: list[Path]) -> RawInventory:
    """Parse every source, in order, into one :class:`RawInventory`."""
    inv = RawInventory(sources=list(paths))
    for path in paths:
        if path.is_dir():
            for file in _walk(path):
                _parse_file(inv, file)
        elif not path.exists():
            raise InventoryError(f"inventory file not found: {path}")
        else:
            _parse_file(inv, path)
    inv.reconcile()
    return inv


def _walk(directory: Path) -> Iterator[Path]:
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise InventoryError(f"cannot list inventory directory {directory}: {exc}") from None
    for name in names:
        if _IGNORED.search(name):
            continue
        full = directory / name
        if full.is_dir():
            yield from _walk(full)
        else:
            yield full


def _parse_file(inv: RawInventory, path: Path) -> None:
    text = read_text(path)
    if text.startswith("#!"):
        raise InventoryError(
            f"{path}: an executable inventory script (dynamic inventory) is not run by ddtree-ops; {EXPORT_HINT}"
        )
    ext = path.suffix
    if ext == ".toml":
        raise InventoryError(f"{path}: TOML inventories are not supported; write it as YAML or INI")
    if ext and ext in YAML_EXTENSIONS:
        _parse_yaml_inventory(inv, parse_yaml(text, path), path)
    elif not ext and isinstance(data := _yaml_or_none(text, path), dict) and data:
        _parse_yaml_inventory(inv, data, path)
    else:
        _parse_ini(inv, text, path)


def _yaml_or_none(text: str, path: Path) -> Any:
    """A file without extension may be YAML or INI: its YAML data, or None if it is not
    YAML. A duplicate key is still an error (the file is YAML, written wrongly)."""
    try:
        return safe_load_unique(text, source=str(path), error=InventoryError, loader=AnsibleYamlLoader)
    except yaml.YAMLError:
        return None


# --------------------------------------------------------------------------- YAML


def _parse_yaml_inventory(inv: RawInventory, data: Any, path: Path) -> None:
    if not isinstance(data, dict) or not data:
        raise InventoryError(f"{path}: expected a mapping of groups at the top level (e.g. 'all:'), got {kind(data)}")
    if data.get("plugin"):
        raise InventoryError(
            f"{path}: plugin: {data['plugin']!r} is a dynamic inventory plugin's config, which ddtree-ops "
            f"does not run; {EXPORT_HINT}"
        )
    for name, body in data.items():
        _yaml_group(inv, _name(name, path, str(name)), body, path, str(name), ())


def _name(value: Any, path: Path, keypath: str) -> str:
    if not isinstance(value, str) or not value:
        raise InventoryError(f"{path}: {keypath}: a group or host name must be a string, got {value!r}")
    return value


def _yaml_group(inv: RawInventory, name: str, body: Any, path: Path, keypath: str, lineage: tuple[str, ...]) -> None:
    if name in lineage:
        raise InventoryError(f"{path}: {keypath}: group {name!r} contains itself")
    problem = group_name_problem(name)
    if problem:
        raise InventoryError(f"{path}: {keypath}: group name {name!r}: {problem}")
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise InventoryError(
            f"{path}: {keypath}: a group must be a mapping of {'/'.join(GROUP_KEYS)}, got {kind(body)}"
        )
    inv.add_group(name)
    for key in body:
        if key not in GROUP_KEYS:
            raise InventoryError(f"{path}: {keypath}.{key}: unknown group key{did_you_mean(str(key), GROUP_KEYS)}")
    for section, value in body.items():
        where = f"{keypath}.{section}"
        if isinstance(value, str):
            value = {value: None}  # Ansible: `hosts: web1` is `hosts: {web1: }`
        if value is None:
            continue
        if not isinstance(value, dict):
            raise InventoryError(f"{path}: {where}: expected a mapping, got {kind(value)}")
        if section == "vars":
            origin = Origin(str(path), where)
            for var, var_value in value.items():
                inv.set_group_var(name, _var_name(var, origin), var_value, origin)
        elif section == "children":
            for child, child_body in value.items():
                child_name = _name(child, path, f"{where}.{child}")
                _yaml_group(inv, child_name, child_body, path, f"{where}.{child_name}", (*lineage, name))
                inv.add_child(name, child_name, Origin(str(path), where))
        else:
            for pattern, host_vars in value.items():
                hpath = f"{where}.{pattern}"
                names, port = _expand(_name(pattern, path, hpath), Origin(str(path), where))
                if host_vars is None:
                    host_vars = {}
                if not isinstance(host_vars, dict):
                    raise InventoryError(f"{path}: {hpath}: host vars must be a mapping, got {kind(host_vars)}")
                origin = Origin(str(path), hpath)
                for host in names:
                    inv.add_host(host, name, origin)
                    if port is not None:
                        inv.set_host_var(host, "ansible_port", port, origin)
                    for var, var_value in host_vars.items():
                        inv.set_host_var(host, _var_name(var, origin), var_value, origin)


def _var_name(key: Any, origin: Origin) -> str:
    if not isinstance(key, str):
        raise InventoryError(f"{origin.at(str(key))}: a variable name must be a string, got {key!r}")
    return key


def _expand(pattern: str, origin: Origin) -> tuple[list[str], int | None]:
    problem = host_name_problem(pattern)
    if problem:
        raise InventoryError(f"{origin.here()}: host name {pattern!r}: {problem}")
    try:
        return expand_pattern(pattern)
    except RangeError as exc:
        raise InventoryError(f"{origin.at(pattern)}: {exc}") from None


def host_name_problem(pattern: str) -> str | None:
    """Why a host pattern cannot name a host here, or None. Ansible takes these names, but
    the command line could not address such a host (``host/0`` is a GPU slot, ``a,b`` two
    targets), and a control or invisible character would reach the terminal and the
    remote commands as part of a name nobody can read."""
    if not pattern.isprintable():
        return "a host name has no control or invisible characters"
    if "/" in pattern:
        return "'/' is not allowed in a host name: on the command line host/0 names GPU slot 0 of host"
    if "," in pattern:
        return "',' is not allowed in a host name: on the command line it separates targets"
    return None


# --------------------------------------------------------------------------- INI


def _parse_ini(inv: RawInventory, text: str, path: Path) -> None:
    """Ansible's ini plugin: sections ``[g]``, ``[g:vars]``, ``[g:children]``; host lines
    ``pattern key=value ...``; every value through ``ast.literal_eval`` (a string when that
    fails), as ansible-core 2.19 does for host lines and ``:vars`` sections alike."""
    file = str(path)
    declared = set(inv.groups)  # groups that exist before this file
    pending_vars: dict[str, int] = {}
    pending_children: list[tuple[str, str, int]] = []
    group, state = "ungrouped", "hosts"
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        origin = Origin(file, line=number)
        section = _INI_SECTION.match(line)
        if section:
            group, state = section.group(1), section.group(2) or "hosts"
            problem = group_name_problem(group)
            if problem:
                raise InventoryError(f"{file}:{number}: group name {group!r}: {problem}")
            if state not in ("hosts", "children", "vars"):
                raise InventoryError(f"{file}:{number}: section [{group}:{state}] has unknown type {state!r}")
            if state == "vars":
                if group not in declared:
                    pending_vars.setdefault(group, number)
            else:
                declared.add(group)
            inv.add_group(group)
            continue
        if line.startswith("[") and line.endswith("]"):
            raise InventoryError(f"{file}:{number}: invalid section {line!r} (no spaces allowed inside [...])")
        if state == "hosts":
            _ini_host_line(inv, line, group, origin)
        elif state == "vars":
            if "=" not in line:
                raise InventoryError(f"{file}:{number}: expected key=value in [{group}:vars], got {line!r}")
            key, value = (part.strip() for part in line.split("=", 1))
            inv.set_group_var(group, key, ini_value(value), origin)
        else:
            named = _INI_GROUPNAME.match(line)
            if not named:
                raise InventoryError(f"{file}:{number}: expected a group name in [{group}:children], got {line!r}")
            pending_children.append((group, named.group(1), number))
    for parent, child, number in pending_children:
        if child not in declared:
            raise InventoryError(f"{file}:{number}: [{parent}:children] includes undefined group {child!r}")
        inv.add_child(parent, child, Origin(file, line=number))
    for g, number in pending_vars.items():
        if g not in declared:
            raise InventoryError(f"{file}:{number}: section [{g}:vars] is for undefined group {g!r}")


def _ini_host_line(inv: RawInventory, line: str, group: str, origin: Origin) -> None:
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError as exc:
        raise InventoryError(f"{origin.file}:{origin.line}: cannot parse host line {line!r}: {exc}") from None
    if not tokens:
        return
    names, port = _expand(tokens[0], origin)
    if any(name.strip() == "---" for name in names):
        raise InventoryError(f"{origin.file}:{origin.line}: '---' looks like YAML; name the file .yml")
    variables: dict[str, Any] = {}
    for token in tokens[1:]:
        if "=" not in token:
            raise InventoryError(f"{origin.file}:{origin.line}: expected key=value host variable, got {token!r}")
        key, value = token.split("=", 1)
        if key in variables:
            # Ansible keeps the last one silently; which one was meant is not ours to guess.
            raise InventoryError(f"{origin.file}:{origin.line}: {key} is written twice on this host line")
        variables[key] = ini_value(value)
    for name in names:
        inv.add_host(name, group, origin)
        if port is not None:
            inv.set_host_var(name, "ansible_port", port, origin)
        for key, value in variables.items():
            inv.set_host_var(name, key, value, origin)


def ini_value(text: str) -> Any:
    """Ansible's ``_parse_value``: a Python literal when ``ast.literal_eval`` reads one
    (``2222`` -> int, ``True`` -> bool, ``[1, 2]`` -> list), the text otherwise."""
    value: Any = text
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        value = text
    return _ini_coerce(value)


def _ini_coerce(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="surrogateescape")
    if isinstance(value, (list, tuple, set)):
        return [_ini_coerce(v) for v in value]
    if isinstance(value, dict):
        return {_ini_coerce(k): _ini_coerce(v) for k, v in value.items()}
    if value is ...:
        return "..."
    if isinstance(value, complex):
        return str(value)
    return value
