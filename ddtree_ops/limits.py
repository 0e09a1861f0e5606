"""The bounds of what a DDTree server serves, and of the numbers read from our own files.

One definition, checked by every writer and reader of a tree or a load time: the CLI's
``restart --budget``, sweep axes, ledger rows read by ``report``/``tune``, the policy
file ``tune`` writes, and the records of the local state file. A value outside them is
refused where it is read, naming its file and key, instead of reaching a server that
refuses it after the old one is stopped (or a pandas cast that raises).

The tree bounds are the DDTree plugin's (``patches/ddtree_temperature/.../
ddtree_registration.py`` ``MAX_DDTREE_BUDGET``: ``--speculative-num-draft-tokens``
2..257); the bundle runs on the host without this package, so it keeps its own copy and
``tests/test_hostile_inputs.py`` checks that the two agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeGuard

#: The DDTree plugin accepts --speculative-num-draft-tokens 2..257, i.e. budgets 1..256.
MAX_DDTREE_BUDGET = 256
#: A tree of at most 256 nodes never uses more than 256 candidates at one position: a
#: larger top-k changes nothing but the cost of the candidate head.
MAX_DDTREE_TOPK = MAX_DDTREE_BUDGET
#: A DFlash chain is at most the drafter's block, which the sweep bounds to a tree's
#: verify width (budget + 1): a ledger's DFLASH ``budget`` (draft tokens) stays below it.
MAX_DFLASH_DRAFT_TOKENS = MAX_DDTREE_BUDGET + 1
#: Requests kept open at once (a sweep's ``concurrency``, a policy's batch size): what one
#: client can hold without running out of file descriptors or a server out of context.
MAX_CONCURRENCY = 4096
#: The longest load or restart the state file may remember: a day. No model loads for
#: longer, and a restart's deadline is a multiple of it: a larger value is garbage that
#: would make a restart wait forever (1e308 s) or a sweep estimate infinity.
MAX_LOAD_S = 24 * 3600.0


def is_int_in(value: Any, low: int, high: int) -> bool:
    """Whether ``value`` (as JSON gave it) is an integer in ``low..high``: an int, or a float
    with an integral value (JSON writers disagree on 16 vs 16.0); never a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return False
    return low <= value <= high


def is_seconds(value: Any, *, high: float = MAX_LOAD_S) -> TypeGuard[int | float]:
    """Whether ``value`` is a positive, finite number of seconds no larger than ``high``."""
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and 0 < value <= high)


def tree_problem(budget: Any, topk: Any) -> str | None:
    """Why (``budget``, ``topk``) is not a DDTree tree the server serves, or None."""
    if not is_int_in(budget, 1, MAX_DDTREE_BUDGET):
        return f"budget {budget!r} is not an integer in 1..{MAX_DDTREE_BUDGET}"
    if not is_int_in(topk, 1, MAX_DDTREE_TOPK):
        return f"top-k {topk!r} is not an integer in 1..{MAX_DDTREE_TOPK}"
    return None


def policy_problem(document: Any) -> str | None:
    """Why ``document`` is not a per-batch-size policy file the DDTree server would load
    (``{"ddtree": {"budgets", "topk_max", "policy"}}``, as ``tune`` writes it), or None.

    The checks are the server's (``ddtree_runtime.parse_runtime_config``) on the keys
    ``tune`` writes, with the bounds above: a policy refused here would be refused by
    the server after its old process was stopped.
    """
    tree = document.get("ddtree") if isinstance(document, Mapping) else None
    if not isinstance(tree, Mapping):
        return "no 'ddtree' object"
    budgets = tree.get("budgets")
    if not isinstance(budgets, list) or not budgets:
        return "ddtree.budgets must be a non-empty list"
    for i, budget in enumerate(budgets):
        if not is_int_in(budget, 1, MAX_DDTREE_BUDGET):
            return f"ddtree.budgets[{i}] {budget!r} is not an integer in 1..{MAX_DDTREE_BUDGET}"
    topk_max = tree.get("topk_max")
    if not is_int_in(topk_max, 1, MAX_DDTREE_TOPK):
        return f"ddtree.topk_max {topk_max!r} is not an integer in 1..{MAX_DDTREE_TOPK}"
    policy = tree.get("policy")
    if not isinstance(policy, Mapping) or not policy:
        return "ddtree.policy must be a non-empty object"
    for key, entry in policy.items():
        where = f"ddtree.policy[{key!r}]"
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and is_int_in(int(key), 1, MAX_CONCURRENCY)):
            return f"{where}: a key is a batch size, an integer in 1..{MAX_CONCURRENCY}"
        if not isinstance(entry, Mapping):
            return f'{where} must be {{"budget": B, "topk": K}}'
        if problem := tree_problem(entry.get("budget"), entry.get("topk")):
            return f"{where}: {problem}"
        if entry["budget"] not in budgets:
            return f"{where}: budget {entry['budget']} is not in ddtree.budgets {budgets}"
        if entry["topk"] > topk_max:
            return f"{where}: top-k {entry['topk']} is above ddtree.topk_max {topk_max}"
    eager = tree.get("eager_budgets", [])
    if not isinstance(eager, list) or any(budget not in budgets for budget in eager):
        return f"ddtree.eager_budgets {eager!r} must be a list of budgets in ddtree.budgets {budgets}"
    return None


__all__ = [
    "MAX_CONCURRENCY",
    "MAX_DDTREE_BUDGET",
    "MAX_DDTREE_TOPK",
    "MAX_DFLASH_DRAFT_TOKENS",
    "MAX_LOAD_S",
    "is_int_in",
    "is_seconds",
    "policy_problem",
    "tree_problem",
]
