"""Ansible-compatible YAML inventories -> frozen :class:`Host` objects.

The format is Ansible's YAML inventory (``all:`` / ``children:`` / ``hosts:`` / ``vars:``)
so that a fleet already described for Ansible loads as is: Ansible variables we do not
use are ignored. We read the connection variables (``ansible_host``, ``ansible_port``,
``ansible_user``, ``ansible_ssh_private_key_file``, ``ansible_connection``) and our own
settings under one key, ``ddtree:``, which is validated strictly — a typo there would
otherwise silently launch a server with default settings. Every error names the file
and the key path (and, for unknown keys, the closest valid one).

Precedence follows Ansible: ``all`` vars < outer group vars < inner group vars < host
vars; groups at the same depth apply in name order. The ``ddtree:`` mapping is merged
key by key (so a group can set ``server.port`` and a host only ``server.model_path``);
other variables are replaced whole. Group vars apply to the hosts of the file they are
written in: loading ``ct200.yaml`` and ``local.yaml`` together must not let one file's
``all: vars:`` leak into the other's hosts.

Nothing is overridden silently: a mapping key written twice is an error (file:line and
the key), and so is a host listed under two groups of a file with two different values
for one variable, or defined in two files that resolve it differently (both files and
the key). A host in several groups, or files, that agree stays one host in all of them.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from ddtree_ops.errors import InventoryError, TargetError
from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.yamlfile import safe_load_unique

GROUP_KEYS = ("hosts", "vars", "children")
SSH_CONNECTIONS = ("ssh", "paramiko", "smart")

# Schema of `ddtree:`: key -> expected kind. Nested mappings are dicts of the same form.
_SERVER_SCHEMA: dict[str, str] = {
    "model_path": "str",
    "draft_model_path": "str",
    "port": "port",
    "bind_host": "str",
    "extra_args": "str_list",
    "env": "str_map",
    "expected_load_s": "positive_number",
    "command": "str",
    "manager": "manager",
}
_DDTREE_SCHEMA: dict[str, Any] = {
    "python": "str",
    "gpu": "optional_str",
    "run_dir": "str",
    "known_hosts": "optional_str",
    "server": _SERVER_SCHEMA,
}


@dataclass(frozen=True)
class Inventory:
    """Every host of the loaded files, and which groups hold them (in file order)."""

    hosts: Mapping[str, Host]
    groups: Mapping[str, tuple[str, ...]]
    sources: tuple[Path, ...] = field(default=())

    def resolve(self, target: str) -> list[Host]:
        """``all``, a group, a host, or a comma list of those -> hosts, in inventory order, once each."""
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
            else:
                raise TargetError(self._unknown_target_message(item))
        if not wanted:
            raise TargetError(f"empty target {target!r}; " + self._known())
        return [host for name, host in self.hosts.items() if name in wanted]

    def _known(self) -> str:
        groups = ", ".join(sorted(g for g in self.groups if g != "all")) or "(none)"
        return f"known groups: all, {groups}; hosts: {', '.join(self.hosts) or '(none)'}"

    def _unknown_target_message(self, item: str) -> str:
        close = difflib.get_close_matches(item, [*self.groups, *self.hosts], n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown target {item!r}{hint}; {self._known()}"


def load_inventory(paths: Sequence[Path], *, ssh_config: Path | None = None) -> Inventory:
    """Load and merge inventory files. Raises :class:`InventoryError` naming file and key.

    ``ssh_config`` (default ``~/.ssh/config``) is consulted for hosts without
    ``ansible_host``: such a host must be an alias there, otherwise nothing could reach it.
    """
    if not paths:
        raise InventoryError(
            "no inventory given: pass -i PATH or set DDTREE_OPS_INVENTORY (no inventories/*.yaml here)"
        )
    aliases = _SshAliases(ssh_config if ssh_config is not None else Path("~/.ssh/config").expanduser())
    hosts: dict[str, Host] = {}
    groups: dict[str, list[str]] = {}
    for path in paths:
        for host, host_groups in _load_file(Path(path), aliases):
            if host.name in hosts:
                first = hosts[host.name]
                _check_same_host(first, host)
                host = replace(first, groups=(*first.groups, *(g for g in host.groups if g not in first.groups)))
            hosts[host.name] = host
            for group in host_groups:
                members = groups.setdefault(group, [])
                if host.name not in members:
                    members.append(host.name)
    frozen_groups = MappingProxyType({g: tuple(m) for g, m in groups.items()})
    return Inventory(hosts=MappingProxyType(hosts), groups=frozen_groups, sources=tuple(Path(p) for p in paths))


# --------------------------------------------------------------------------- file level


@dataclass
class _HostEntry:
    """A host as collected while walking one file: its raw vars per occurrence and its groups."""

    vars_layers: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    groups: set[str] = field(default_factory=set)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InventoryError(f"inventory file not found: {path}") from None
    except IsADirectoryError:
        raise InventoryError(f"inventory path is a directory, not a YAML file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(f"cannot read inventory {path}: {exc}") from None
    try:
        return safe_load_unique(text, source=str(path), error=InventoryError)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = exc.problem or exc.context or "invalid YAML"
        raise InventoryError(f"{where}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as exc:
        raise InventoryError(f"{path}: YAML error: {exc}") from None


def _load_file(path: Path, aliases: _SshAliases) -> list[tuple[Host, tuple[str, ...]]]:
    data = _read_yaml(path)
    if not isinstance(data, dict) or not data:
        raise InventoryError(f"{path}: expected a mapping of groups at the top level (e.g. 'all:'), got {_kind(data)}")
    group_vars: dict[str, dict[str, Any]] = {}
    depth: dict[str, int] = {}
    entries: dict[str, _HostEntry] = {}

    def walk(name: str, body: Any, keypath: str, level: int, parents: tuple[str, ...]) -> None:
        if name in parents:
            raise InventoryError(f"{path}: {keypath}: group {name!r} contains itself")
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise InventoryError(
                f"{path}: {keypath}: a group must be a mapping of {'/'.join(GROUP_KEYS)}, got {_kind(body)}"
            )
        for key in body:
            if key not in GROUP_KEYS:
                raise InventoryError(f"{path}: {keypath}.{key}: unknown group key{_did_you_mean(str(key), GROUP_KEYS)}")
        depth[name] = max(depth.get(name, 0), level)
        lineage = (*parents, name)
        gvars = body.get("vars")
        if gvars is not None:
            if not isinstance(gvars, dict):
                raise InventoryError(f"{path}: {keypath}.vars: expected a mapping, got {_kind(gvars)}")
            _check_ddtree(gvars, path, f"{keypath}.vars")
            group_vars.setdefault(name, {}).update(gvars)
        hosts = body.get("hosts")
        if hosts is not None:
            if not isinstance(hosts, dict):
                raise InventoryError(f"{path}: {keypath}.hosts: expected a mapping of host names, got {_kind(hosts)}")
            for hname, hvars in hosts.items():
                hpath = f"{keypath}.hosts.{hname}"
                if hvars is None:
                    hvars = {}
                if not isinstance(hvars, dict):
                    raise InventoryError(f"{path}: {hpath}: host vars must be a mapping, got {_kind(hvars)}")
                _check_ddtree(hvars, path, hpath)
                entry = entries.setdefault(str(hname), _HostEntry())
                entry.vars_layers.append((hpath, hvars))
                entry.groups.update(lineage)
        children = body.get("children")
        if children is not None:
            if not isinstance(children, dict):
                raise InventoryError(f"{path}: {keypath}.children: expected a mapping of groups, got {_kind(children)}")
            for cname, cbody in children.items():
                walk(str(cname), cbody, f"{keypath}.children.{cname}", level + 1, lineage)

    for top, body in data.items():
        walk(str(top), body, str(top), 0 if top == "all" else 1, () if top == "all" else ("all",))

    result = []
    for hname, entry in entries.items():
        _check_layers_agree(hname, entry.vars_layers, path)
        entry.groups.add("all")
        ordered = sorted(entry.groups, key=lambda g: (depth.get(g, 0), g != "all", g))
        merged: dict[str, Any] = {}
        for g in ordered:
            _merge_vars(merged, group_vars.get(g, {}))
        for _, hvars in entry.vars_layers:
            _merge_vars(merged, hvars)
        member_of = tuple(g for g in ordered if g != "all")
        host = _build_host(hname, merged, path, entry.vars_layers[0][0], aliases, groups=member_of)
        result.append((host, member_of))
    return result


def _check_same_host(first: Host, again: Host) -> None:
    """A host in two files is one host only if both resolve to the same settings.

    Ansible lets a host sit in several groups, and in several inventory files; but two
    files that disagree on where or how to reach it (or how to launch its server) have
    no single right answer, and the later file must not win silently.
    """
    names = {
        "connection": "ansible_connection",
        "address": "ansible_host",
        "port": "ansible_port",
        "user": "ansible_user",
        "key_file": "ansible_ssh_private_key_file",
    }
    for f in fields(Host):
        if f.name in ("name", "groups", "source"):
            continue
        ours, theirs = getattr(again, f.name), getattr(first, f.name)
        if ours == theirs:
            continue
        key, ours, theirs = _first_difference(f.name, ours, theirs)
        raise InventoryError(
            f"{again.source}: host {again.name!r} is already defined in {first.source} with another "
            f"{names.get(key, key)}: {ours!r} here, {theirs!r} there"
        )


def _first_difference(key: str, ours: Any, theirs: Any) -> tuple[str, Any, Any]:
    """Descend into the settings dataclasses to the first field whose values differ."""
    if type(ours) is type(theirs) and hasattr(ours, "__dataclass_fields__"):
        for f in fields(ours):
            a, b = getattr(ours, f.name), getattr(theirs, f.name)
            if a != b:
                return _first_difference(f"{key}.{f.name}", a, b)
    return key, ours, theirs


def _check_layers_agree(name: str, layers: Sequence[tuple[str, Mapping[str, Any]]], path: Path) -> None:
    """A host listed under several groups of one file may carry vars in each, but not two
    different values for one variable: which would win depends on group order, not intent."""
    seen: dict[str, tuple[str, Any]] = {}
    for keypath, hvars in layers:
        for key, value in _leaves(hvars):
            if key in seen and seen[key][1] != value:
                where, before = seen[key]
                raise InventoryError(
                    f"{path}: host {name!r} is defined twice with different {key}: "
                    f"{before!r} at {where}, {value!r} at {keypath}"
                )
            seen.setdefault(key, (keypath, value))


def _leaves(vars_: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``ddtree:`` is merged key by key, so compare it leaf by leaf; other vars whole."""
    out: list[tuple[str, Any]] = []
    for key, value in vars_.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and (prefix or key == "ddtree"):
            out.extend(_leaves(value, f"{dotted}."))
        else:
            out.append((dotted, value))
    return out


def _merge_vars(into: dict[str, Any], layer: Mapping[str, Any]) -> None:
    for key, value in layer.items():
        if key == "ddtree" and isinstance(value, dict) and isinstance(into.get(key), dict):
            into[key] = _deep_merge(into[key], value)
        else:
            into[key] = value


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# --------------------------------------------------------------------------- validation


def _check_ddtree(vars_: Mapping[str, Any], path: Path, keypath: str) -> None:
    """Validate a `ddtree:` mapping where it is written, so errors point at that place."""
    if "ddtree" not in vars_:
        return
    value = vars_["ddtree"]
    if value is None:
        return
    _check_mapping(value, _DDTREE_SCHEMA, path, f"{keypath}.ddtree")


def _check_mapping(value: Any, schema: Mapping[str, Any], path: Path, keypath: str) -> None:
    if not isinstance(value, dict):
        raise InventoryError(f"{path}: {keypath}: expected a mapping, got {value!r}")
    for key, item in value.items():
        where = f"{keypath}.{key}"
        if key not in schema:
            raise InventoryError(f"{path}: {where}: unknown key{_did_you_mean(str(key), list(schema))}")
        kind = schema[key]
        if isinstance(kind, dict):
            _check_mapping(item, kind, path, where)
        else:
            problem = _type_problem(kind, item)
            if problem:
                raise InventoryError(f"{path}: {where}: {problem}, got {item!r}")


def _type_problem(kind: str, value: Any) -> str | None:
    """Why ``value`` does not fit ``kind``, or None. bool is rejected where numbers are
    expected: YAML turns `yes`/`on` into booleans, which are never a port or a duration."""
    if kind == "str":
        return None if isinstance(value, str) and value else "expected a non-empty string"
    if kind == "optional_str":
        return None if value is None or (isinstance(value, str) and value) else "expected a string"
    if kind == "port":
        ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535
        return None if ok else "expected a port number (integer 1-65535)"
    if kind == "positive_number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        return None if ok else "expected a positive number of seconds"
    if kind == "str_list":
        ok = isinstance(value, list) and all(
            isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value
        )
        return None if ok else "expected a list of strings"
    if kind == "str_map":
        ok = isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, (str, int, float)) and not isinstance(v, bool)
            for k, v in value.items()
        )
        return None if ok else "expected a mapping of NAME: value (strings or numbers)"
    if kind == "manager":
        return None if value == "process" else "expected 'process' (the only manager supported)"
    raise AssertionError(f"unknown schema kind {kind}")


def _build_host(
    name: str, merged: Mapping[str, Any], path: Path, keypath: str, aliases: _SshAliases, *, groups: tuple[str, ...]
) -> Host:
    def conn_var(*names: str) -> Any:
        for n in names:
            if merged.get(n) is not None:
                return merged[n]
        return None

    connection_raw = conn_var("ansible_connection") or "ssh"
    if connection_raw == "local":
        connection = "local"
    elif connection_raw in SSH_CONNECTIONS:
        connection = "ssh"
    else:
        raise InventoryError(
            f"{path}: {keypath}.ansible_connection: {connection_raw!r} is not supported (use 'ssh' or 'local')"
        )
    address = conn_var("ansible_host", "ansible_ssh_host")
    port = conn_var("ansible_port", "ansible_ssh_port")
    user = conn_var("ansible_user", "ansible_ssh_user")
    key_file = conn_var("ansible_ssh_private_key_file", "ansible_private_key_file")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        raise InventoryError(f"{path}: {keypath}.ansible_port: expected a port number (integer 1-65535), got {port!r}")
    for var, value in (("ansible_host", address), ("ansible_user", user), ("ansible_ssh_private_key_file", key_file)):
        if value is not None and not isinstance(value, str):
            raise InventoryError(f"{path}: {keypath}.{var}: expected a string, got {value!r}")
    if connection == "ssh" and address is None and not aliases.has_alias(name):
        raise InventoryError(
            f"{path}: host {name!r} has no ansible_host and {aliases.path} has no 'Host {name}' entry; "
            f"set ansible_host or add an ssh_config alias"
        )
    base_dir = path.resolve().parent
    settings = _build_settings(merged.get("ddtree") or {}, base_dir, local=connection == "local")
    return Host(
        name=name,
        connection=connection,  # type: ignore[arg-type]  # narrowed to the Literal above
        address=address,
        port=port,
        user=user,
        key_file=key_file,
        groups=groups,
        ddtree=settings,
        source=str(path),
    )


def _build_settings(raw: Mapping[str, Any], base_dir: Path, *, local: bool) -> DdtreeSettings:
    defaults = DdtreeSettings()
    server_raw: Mapping[str, Any] = raw.get("server") or {}
    sdef = ServerSettings()
    server = ServerSettings(
        model_path=server_raw.get("model_path", sdef.model_path),
        draft_model_path=server_raw.get("draft_model_path", sdef.draft_model_path),
        port=server_raw.get("port", sdef.port),
        bind_host=server_raw.get("bind_host", sdef.bind_host),
        extra_args=tuple(str(a) for a in server_raw.get("extra_args", sdef.extra_args)),
        env=MappingProxyType({k: str(v) for k, v in (server_raw.get("env") or {}).items()}),
        expected_load_s=float(server_raw.get("expected_load_s", sdef.expected_load_s)),
        command=server_raw.get("command", sdef.command),
        manager=server_raw.get("manager", sdef.manager),
    )
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


def _against(base_dir: Path, value: str) -> str:
    if value.startswith("~") or os.path.isabs(value):
        return value
    return os.path.normpath(base_dir / value)


class _SshAliases:
    """Which host names ~/.ssh/config knows (a non-wildcard-only `Host` pattern matches)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._patterns: list[str] | None = None

    def has_alias(self, name: str) -> bool:
        if self._patterns is None:
            self._patterns = self._read()
        return any(fnmatch.fnmatchcase(name, pat) for pat in self._patterns if pat.strip("*?") or pat == name)

    def _read(self) -> list[str]:
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return []
        patterns: list[str] = []
        for line in text.splitlines():
            parts = line.strip().split(None, 1)
            if len(parts) == 2 and parts[0].lower() == "host":
                patterns.extend(p for p in parts[1].replace("=", " ").split() if not p.startswith("!"))
        return patterns


def _did_you_mean(key: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    listing = ", ".join(valid)
    return f" (did you mean {close[0]!r}?; valid keys: {listing})" if close else f" (valid keys: {listing})"


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    names: dict[type, str] = {dict: "a mapping", list: "a list", str: "a string"}
    return names.get(type(value), type(value).__name__)
