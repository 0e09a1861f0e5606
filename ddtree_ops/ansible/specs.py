"""The collection's argument specs (Ansible's ``argument_spec`` format), one per task.

The action plugins validate their task's arguments with these before anything is done
(``ActionBase.validate_argument_spec``: types, choices, defaults, unknown options); the
modules' ``DOCUMENTATION`` says the same (a test holds the two equal). Option names follow
the CLI's flags (``--force-version`` is ``force_version``, ``--extra-arg`` ``extra_args``,
``--no-policy`` ``policy: false``, ``--gate-agreement`` ``agreement``, alias
``gate_agreement``). Ranges the CLI's option parser enforces are checked here too
(:func:`check_ranges`), so that a value the CLI refuses is refused by the task, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddtree_ops.errors import ConfigError
from ddtree_ops.rollout.gate import DEFAULT_AGREEMENT, DEFAULT_MIN_SPEED, DEFAULT_TIE_EPSILON, SAMPLED_TEMPERATURE

Spec = dict[str, dict[str, Any]]
ALGORITHMS = ["AR", "DFLASH", "DDTREE"]

BUNDLE: Spec = {
    "state": {"type": "str", "choices": ["present", "absent"], "default": "present"},
    "bundle": {"type": "path"},
    "force": {"type": "bool", "default": False},
    "force_version": {"type": "bool", "default": False},
    "replace": {"type": "bool", "default": False},
    "break_lock": {"type": "bool", "default": False},
    "lock_wait": {"type": "float", "default": 0.0},
}
SERVER: Spec = {
    "state": {"type": "str", "choices": ["started", "restarted", "stopped", "previous"], "default": "started"},
    "algorithm": {"type": "str", "choices": ALGORITHMS, "default": "DDTREE"},
    "budget": {"type": "int"},
    "topk": {"type": "int"},
    "eager": {"type": "bool", "default": False},
    "extra_args": {"type": "list", "elements": "str", "default": []},
    "policy": {"type": "bool", "default": True},
    "retry_cuda_graph": {"type": "bool", "default": False},
    "timeout": {"type": "float"},
    "grace": {"type": "float", "default": 30.0},
    "smoke": {"type": "bool", "default": True},
    "smoke_temperatures": {"type": "list", "elements": "float", "default": []},
    "keep_on_failure": {"type": "bool", "default": False},
    "force": {"type": "bool", "default": False},
    "previous": {"type": "dict"},
}
GATE: Spec = {
    "phase": {"type": "str", "choices": ["baseline", "judge"], "required": True},
    "algorithm": {"type": "str", "choices": ALGORITHMS, "default": "DDTREE"},
    "agreement": {"type": "float", "default": DEFAULT_AGREEMENT, "aliases": ["gate_agreement"]},
    "tie_epsilon": {"type": "float", "default": DEFAULT_TIE_EPSILON, "aliases": ["gate_tie_epsilon"]},
    "min_speed": {"type": "float", "default": DEFAULT_MIN_SPEED, "aliases": ["gate_min_speed"]},
    "accept_floor": {"type": "float", "aliases": ["gate_accept_floor"]},
    "temperature": {"type": "float", "default": SAMPLED_TEMPERATURE, "aliases": ["gate_temperature"]},
    "ledger": {"type": "list", "elements": "path", "default": [], "aliases": ["gate_ledger"]},
}
FACTS: Spec = {
    "bundle": {"type": "path"},
    "smoke": {"type": "bool", "default": True},
}
SPECS: Mapping[str, Spec] = {"bundle": BUNDLE, "server": SERVER, "gate": GATE, "facts": FACTS}

# option -> (low, high, low is included): the CLI's ranges for the same flags (cli/rollout.py,
# cli/service.py, cli/deploy.py). None: unbounded on that side.
RANGES: Mapping[str, Mapping[str, tuple[float | None, float | None, bool]]] = {
    "bundle": {"lock_wait": (0.0, None, True)},
    "server": {"budget": (1, None, True), "topk": (1, None, True), "timeout": (1.0, None, True),
               "grace": (0.0, None, True)},
    "gate": {"agreement": (0.0, 1.0, True), "tie_epsilon": (0.0, 1.0, True), "min_speed": (0.0, 10.0, True),
             "accept_floor": (1.0, None, True), "temperature": (0.0, 2.0, False)},
}


def check_ranges(task: str, args: Mapping[str, Any]) -> None:
    """ConfigError naming the first option outside the range the CLI allows for its flag."""
    for name, (low, high, low_included) in RANGES.get(task, {}).items():
        value = args.get(name)
        if value is None:
            continue
        below = low is not None and (value < low if low_included else value <= low)
        if below or (high is not None and value > high):
            lower = "" if low is None else (f"{'>=' if low_included else '>'} {low:g}")
            upper = "" if high is None else f"<= {high:g}"
            bounds = " and ".join(b for b in (lower, upper) if b)
            raise ConfigError(f"ddtree.ops.{task}: {name} {value!r}: must be {bounds}")
    if task == "server":
        for t in args.get("smoke_temperatures") or ():
            if t < 0:
                raise ConfigError(f"ddtree.ops.server: smoke_temperatures {t!r}: must be >= 0")
        if not args.get("smoke") and args.get("smoke_temperatures"):
            raise ConfigError("ddtree.ops.server: smoke_temperatures and smoke: false contradict each other")
        if args.get("state") == "previous" and not args.get("previous"):
            raise ConfigError("ddtree.ops.server: state previous needs previous (the facts task's ddtree_ops.previous, "
                              "taken before the change)")


__all__ = ["ALGORITHMS", "BUNDLE", "FACTS", "GATE", "RANGES", "SERVER", "SPECS", "check_ranges"]
