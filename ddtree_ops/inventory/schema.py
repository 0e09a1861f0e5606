"""The strict schema of our ``ddtree:`` key, and the values we refuse to use.

``ddtree:`` is ours, so it is validated where it is written (inventory, group_vars or
host_vars file): a typo there would otherwise silently launch a server with default
settings. Every error names the file and the key path (and, for an unknown key, the
closest valid one).

A value Ansible would template (``{{ ... }}``) is checked once it is evaluated, on the
host's merged ``ddtree:`` (``build``), where the error names the file that wrote the key.
A value Ansible would decrypt (``!vault``) is refused: taken literally it would launch
with ciphertext as a path. ``!unsafe`` strings are literal in Ansible too, so they are
used as written.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from ddtree_ops.errors import InventoryError
from ddtree_ops.inventory.templates import has_template
from ddtree_ops.inventory.values import FromEnv, Origin, Vaulted, did_you_mean, printable
from ddtree_ops.limits import MAX_LOAD_S, is_seconds

# A key path (``ddtree.server.port``) -> ``FILE: path`` or ``FILE:LINE: path``, for errors.
At = Callable[[str], str]

MANAGERS = ("process", "systemd")
# A unit name as systemd.unit(5) writes one (systemd's unit_name_is_valid): these characters
# ("\\" starts an escape such as \x2d), at most 255 bytes (UNIT_NAME_MAX is 256 with the
# NUL), a known type after the last ".", a non-empty name before "@" and the type. Stricter,
# on purpose: no leading "-" (systemd allows "-.mount"; a service so named would be an option
# to systemctl and journalctl: "-Hroot@host.service" is `systemctl -H root@host`), "@" once
# (a template sglang@.service, an instance sglang@0.service), and a service: ddtree-ops
# drives the unit that runs SGLang.
UNIT_NAME_MAX = 255
UNIT_TYPES = ("service", "socket", "device", "mount", "automount", "swap", "target", "path", "timer", "slice", "scope")
_UNIT_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789:_.\\-@")

_SERVER_SCHEMA: dict[str, str] = {
    "model_path": "str",
    "draft_model_path": "str",
    "port": "port",
    "bind_host": "str",
    "extra_args": "extra_args",
    "env": "env",
    "expected_load_s": "load_seconds",
    "command": "str",
    "manager": "manager",
    "unit": "unit",
    "slots": "slots",
}
DDTREE_SCHEMA: dict[str, Any] = {
    "python": "str",
    "gpu": "optional_str",
    "run_dir": "str",
    "known_hosts": "optional_str",
    "server": _SERVER_SCHEMA,
}


def refuse_vault(value: Any, where: str) -> None:
    """Raise if ``value`` (or anything inside it) is a vault value."""
    if isinstance(value, Vaulted):
        raise InventoryError(
            f"{where}: a vault-encrypted value (!vault) cannot be used: ddtree-ops does not decrypt vault; "
            f"write the plain value"
        )
    if isinstance(value, list):
        for item in value:
            refuse_vault(item, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            refuse_vault(item, f"{where}.{key}")


def check_vars(vars_: Mapping[str, Any], origin: Origin) -> None:
    """Validate a ``ddtree:`` mapping where it is written, so errors point at that place.
    A key whose value holds a template is checked once evaluated (:func:`check_ddtree`)."""
    value = vars_.get("ddtree")
    if value is None:
        return
    _check_mapping(value, DDTREE_SCHEMA, origin.at, "ddtree", evaluated=False)


def check_ddtree(value: Any, at: At) -> None:
    """Validate a host's merged ``ddtree:`` after its templates were evaluated."""
    _check_mapping(value, DDTREE_SCHEMA, at, "ddtree", evaluated=True)


def _check_mapping(value: Any, schema: Mapping[str, Any], at: At, keypath: str, *, evaluated: bool) -> None:
    refuse_vault(value, at(keypath))
    if not evaluated and has_template(value) and not isinstance(value, dict):
        return
    if not isinstance(value, dict):
        raise InventoryError(f"{at(keypath)}: expected a mapping, got {value!r}")
    for key, item in value.items():
        where = f"{keypath}.{key}"
        if key not in schema:
            raise InventoryError(f"{at(where)}: unknown key{did_you_mean(key, list(schema))}")
        kind = schema[key]
        if isinstance(kind, dict):
            _check_mapping(item, kind, at, where, evaluated=evaluated)
        elif not evaluated and has_template(item):
            continue
        elif kind == "slots":
            _check_slots(item, at, where)
        elif kind == "env":
            _check_env(item, at, where)
        elif kind == "extra_args":
            _check_extra_args(item, at, where)
        else:
            problem = type_problem(kind, item)
            if problem:
                raise InventoryError(f"{at(where)}: {problem}, got {item!r}")


# What a shell (and systemd's EnvironmentFile) takes as a variable name: `A B`, `1X` or
# `A=B` would be refused on the host, or set some other variable, after the old server stopped.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _check_env(value: Any, at: At, keypath: str) -> None:
    if not isinstance(value, dict):
        raise InventoryError(f"{at(keypath)}: expected a mapping of NAME: value, got {value!r}")
    for name, item in value.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise InventoryError(f"{at(keypath)}: {name!r} is not an environment variable name (letters, "
                                 f"digits and _, not starting with a digit)")
        if not isinstance(item, (str, int, float)) or isinstance(item, bool):
            raise InventoryError(f"{at(f'{keypath}.{name}')}: expected a string or a number, got {item!r}")


def _check_extra_args(value: Any, at: At, keypath: str) -> None:
    # Strings only: YAML reads `[--tp-size, 8]` as a number, which would reach the server as
    # the text Python prints for it (`1e3` as 1000.0); a quoted "8" is what is meant.
    if not isinstance(value, list) or not all(isinstance(arg, str) for arg in value):
        raise InventoryError(f"{at(keypath)}: expected a list of strings (quote numbers: \"8\"), got {value!r}")
    for arg in value:
        problem = owned_flag_problem(arg)
        if problem:
            raise InventoryError(f"{at(keypath)}: {printable(arg)}: {problem}")


# The flags ddtree-ops launches every server with (service/launch.py), each with what sets
# it instead. An extra arg repeating one would win (argparse keeps the last), so the server
# would listen elsewhere, or serve another model or tree, than the one readiness waits for
# and the ledger and fallback records name. Here, below the service layer, because the
# inventory checks its extra_args where they are written.
OWNED_FLAGS: dict[str, str] = {
    "--model-path": "ddtree.server.model_path",
    "--host": "ddtree.server.bind_host",
    "--port": "ddtree.server.port",
    "--speculative-algorithm": "restart --algorithm",
    "--speculative-draft-model-path": "ddtree.server.draft_model_path",
    "--speculative-num-draft-tokens": "restart --budget",
    "--speculative-eagle-topk": "restart --topk",
    "--speculative-adaptive-config": "tune --deploy",
    "--cuda-graph-backend-decode": "restart --eager",
    "--cuda-graph-backend-prefill": "restart --eager",
    "--disable-cuda-graph": "restart --eager",
}
# SGLang 0.5.23's other names for them (server_args: `aliases=`).
_OWNED_ALIASES = {"--model": "--model-path", "--speculative-draft-model": "--speculative-draft-model-path"}
# SGLang flags of their own that begin like an owned flag: argparse takes an exact name
# before an abbreviation. (0.5.23's parser has only this one besides the aliases.)
_OWN_FLAGS_NOT_OWNED = ("--speculative-adaptive",)


def owned_flag_problem(arg: str) -> str | None:
    """Why ``arg`` may not be an extra server argument, or None: it sets a flag ddtree-ops
    sets itself — by name, as ``--flag=value``, by an alias, or abbreviated (SGLang's
    argparse reads ``--por 1`` as ``--port 1``)."""
    flag = arg.partition("=")[0] if arg.startswith("--") else ""
    if len(flag) <= 2 or flag in _OWN_FLAGS_NOT_OWNED:
        return None
    if flag in OWNED_FLAGS:
        return f"ddtree-ops sets {flag} itself (use {OWNED_FLAGS[flag]})"
    # An alias is itself the beginning of its flag, so an abbreviated alias is one of the flag.
    owned = _OWNED_ALIASES.get(flag) or next((f for f in OWNED_FLAGS if f.startswith(flag)), None)
    if owned is None:
        return None
    return f"SGLang reads it as {owned}, which ddtree-ops sets itself (use {OWNED_FLAGS[owned]})"


SLOT_COUNT_KEYS = ("count", "gpus_per_slot")
SLOT_ITEM_KEYS = ("gpus", "port")
_SLOTS_SHAPE = "expected {count: N, gpus_per_slot: G} or a list of {gpus: \"0,1\", port: N}"


def _check_slots(value: Any, at: At, keypath: str) -> None:
    """The shape of ``server.slots`` where it is written. Whether the slots fit together
    (overlapping GPUs, ports, a --tp-size) is checked on the merged value, in ``build``:
    a group may set ``count`` and a host ``gpus_per_slot``."""
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{keypath}.{key}"
            if key not in SLOT_COUNT_KEYS:
                raise InventoryError(f"{at(where)}: unknown key{did_you_mean(str(key), SLOT_COUNT_KEYS)}")
            if isinstance(item, bool) or not isinstance(item, int) or item < 1:
                raise InventoryError(f"{at(where)}: expected a positive integer, got {item!r}")
        return
    if not isinstance(value, list) or not value:
        raise InventoryError(f"{at(keypath)}: {_SLOTS_SHAPE}, got {value!r}")
    for index, item in enumerate(value):
        where = f"{keypath}[{index}]"
        if not isinstance(item, dict):
            raise InventoryError(f"{at(where)}: expected a mapping {{gpus: \"0,1\", port: N}}, got {item!r}")
        for key, field_value in item.items():
            if key not in SLOT_ITEM_KEYS:
                raise InventoryError(
                    f"{at(f'{where}.{key}')}: unknown key{did_you_mean(str(key), SLOT_ITEM_KEYS)}"
                )
            problem = type_problem("port", field_value) if key == "port" else parse_gpus(field_value)[1]
            if problem:
                raise InventoryError(f"{at(f'{where}.{key}')}: {problem}, got {field_value!r}")
        if "gpus" not in item:
            raise InventoryError(f"{at(f'{where}.gpus')}: missing; every slot names its GPUs (e.g. \"0,1\")")


def parse_gpus(value: Any) -> tuple[tuple[int, ...], str | None]:
    """``"0,1"`` (as CUDA_VISIBLE_DEVICES is written) or a single index -> the indices, or
    why not. A repeated index is refused: CUDA would silently stop reading the list there."""
    problem = 'expected GPU indices like "0,1" (non-negative integers, comma-separated, each once)'
    if isinstance(value, int) and not isinstance(value, bool):
        return ((value,), None) if value >= 0 else ((), problem)
    if not isinstance(value, str):
        return (), problem
    parts = [part.strip() for part in value.split(",")]
    if not all(part.isascii() and part.isdigit() for part in parts):
        return (), problem
    gpus = tuple(int(part) for part in parts)
    return (gpus, None) if len(set(gpus)) == len(gpus) else ((), problem)


def type_problem(kind: str, value: Any) -> str | None:
    """Why ``value`` does not fit ``kind``, or None. bool is rejected where numbers are
    expected: YAML turns `yes`/`on` into booleans, which are never a port or a duration."""
    if kind == "str":
        return None if isinstance(value, str) and value else "expected a non-empty string"
    if kind == "optional_str":
        return None if value is None or (isinstance(value, str) and value) else "expected a string"
    if kind == "port":
        ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535
        return None if ok else "expected a port number (integer 1-65535)"
    if kind == "load_seconds":
        # Finite: YAML's `.inf` would make every readiness deadline never come; and no more
        # than a day, the state file's bound on a learned load time (86401 s is no load).
        ok = is_seconds(value)
        return None if ok else f"expected a load time in seconds, more than 0 and at most {MAX_LOAD_S:.0f} (a day)"
    if kind == "manager":
        ok = value in MANAGERS
        return None if ok else "expected 'process' (ddtree-ops runs the server) or 'systemd' (a unit does)"
    if kind == "unit":
        return unit_problem(value)
    raise AssertionError(f"unknown schema kind {kind}")


def unit_problem(value: Any) -> str | None:
    """Why ``value`` is not a service unit's name as systemd writes one (see UNIT_NAME_MAX),
    or None. Of a name read by ``lookup('env')`` neither a character nor the length is told."""
    if not isinstance(value, str) or not value:
        return "expected a systemd service unit name such as sglang.service or sglang@.service"
    secret = isinstance(value, FromEnv)
    bad = next((c for c in value if c not in _UNIT_CHARS), None)
    if bad is not None:
        return "a unit name has letters, digits and : _ . - \\ @ only" + ("" if secret else f", not {bad!r}")
    if len(value) > UNIT_NAME_MAX:
        told = "" if secret else f", this one {len(value)}"
        return f"a systemd unit name has at most {UNIT_NAME_MAX} bytes{told}"
    if value.startswith("-"):
        return "a unit name starting with '-' would be an option to systemctl and journalctl"
    name, dot, suffix = value.rpartition(".")
    if not dot or suffix not in UNIT_TYPES:
        return "expected a unit type after the last '.', as in sglang.service"
    if suffix != "service":
        return f"that is a {suffix} unit: ddtree-ops drives the service that runs SGLang, as sglang.service"
    if not name or name.startswith("@"):
        return "expected a name before '@' and '.service', as in sglang.service or sglang@.service"
    if name.count("@") > 1:
        return "'@' once at most: a template is sglang@.service, its instance sglang@0.service"
    return None


def group_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a group here, or None. Ansible takes it, but on the command
    line ``a,b`` is two targets, and a control character would reach the terminal."""
    if not name.isprintable():
        return "a group name has no control or invisible characters"
    if "," in name:
        return "',' is not allowed in a group name: on the command line it separates targets"
    return None
