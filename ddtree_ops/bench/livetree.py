"""Switching a DDTree server's tree between two cells, and proving it took.

A server launched with runtime states (``--speculative-adaptive-config``, the issue-25
contract) changes its (budget, top-k) on ``POST /set_internal_state {"server_args":
{"ddtree_budget": B, "ddtree_topk": K}}``. An accepted request is not yet proof: the
sweep reads ``/server_info`` back and measures only when ``internal_states[0].ddtree``
says the state is pinned at exactly (B, K). Anything else -- a refusal, no answer, a
server without runtime states, a state that did not take, a budget dropped after its
capture failed -- is a failed cell with the reason as its error, never a measurement of
some other tree.

Pure: the clients (:mod:`.onhost`) send the two requests and hand the answers here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddtree_ops.bench.plan import LaunchConfig
from ddtree_ops.graphceiling import graph_ceilings

#: A live launch's runtime-state file goes into the server's run dir (the agent writes it
#: there; the server runs there), so the command line names it relative.
STATES_FILE_PREFIX = "runtime-states-"


def states_file(launch: LaunchConfig, *, eager_budgets: tuple[int, ...] = ()) -> tuple[str, bytes]:
    """(file name, content) of ``launch``'s ``--speculative-adaptive-config`` file.

    ``eager_budgets``: the budgets recorded to fail capture on this machine
    (:func:`ddtree_ops.service.fallback.plan_runtime_budgets`), listed as the bundle's
    ``ddtree.eager_budgets``: served eager without a capture attempt, while the others keep
    their graphs (left out when none, so a launch without fallbacks names the same file).

    Capture failures serve the budget eager (``on_capture_failure: eager``) rather than
    dropping it: the cell is still measured, and its rows say eager, so a report never
    ranks it among graph rows. The name carries the content's hash, so a launch command
    (and the argv hash on its rows) names exactly one set of states.
    """
    if not launch.live or launch.topk_max is None:
        raise ValueError(f"{launch.key} has no runtime states")
    body: dict[str, Any] = {
        "ddtree": {"budgets": list(launch.budgets), "topk_max": launch.topk_max, "on_capture_failure": "eager"}
    }
    if eager_budgets:
        body["ddtree"]["eager_budgets"] = sorted(eager_budgets)
    content = (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()
    return f"{STATES_FILE_PREFIX}{hashlib.sha256(content).hexdigest()[:12]}.json", content


def switch_request(budget: int, topk: int) -> dict[str, Any]:
    """The body of ``POST /set_internal_state`` that pins (budget, top-k)."""
    return {"server_args": {"ddtree_budget": budget, "ddtree_topk": topk}}


@dataclass(frozen=True)
class SwitchAnswer:
    """What the server said: the switch's HTTP status (None: no answer) and detail
    (the refusal's ``detail``, or why there was no answer), and ``/server_info`` read
    right after it (None when it could not be read)."""

    status: int | None
    detail: str
    info: Mapping[str, Any] | None


@dataclass(frozen=True)
class LiveTree:
    """The tree a cell is measured at, as the server reports it after the switch."""

    budget: int
    topk: int
    cuda_graph: str  # this budget's state: "captured" | "eager" | "disabled"
    reason: str | None = None  # why its capture failed ("eager")
    # The largest batch its verify graph replays (a round of more requests runs eager);
    # None without a graph, or from a bundle that does not report it.
    cuda_graph_max_bs: int | None = None

    @property
    def graph(self) -> bool:
        """Whether rounds at this state replay a captured verify graph."""
        return self.cuda_graph == "captured"

    def fallback_reason(self) -> str | None:
        """The row's ``fallback_reason`` for a state served eager after a failed capture."""
        if self.cuda_graph != "eager":
            return None
        return f"runtime state budget {self.budget}: verify graph not captured ({self.reason or 'no reason given'}); " \
               "served eager"


def _detail(raw: object) -> str:
    if isinstance(raw, Mapping):
        for key in ("detail", "error", "message"):
            value = raw.get(key)
            if isinstance(value, Mapping):
                value = value.get("message")
            if isinstance(value, str) and value:
                return value
    return json.dumps(raw)[:300] if raw is not None else ""


def refusal_detail(status: int, body: bytes) -> str:
    """The detail of a non-200 answer (``{"detail": ...}`` as the contract has it)."""
    try:
        return _detail(json.loads(body)) or f"HTTP {status}"
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:300] or f"HTTP {status}"


def judge_switch(answer: SwitchAnswer, budget: int, topk: int) -> LiveTree | str:
    """The tree to measure at, or why the cell cannot be measured (its row's error)."""
    what = f"live switch to budget {budget} top-k {topk}"
    if answer.status is None:
        return f"{what}: no answer from the server ({answer.detail or 'no detail'})"
    if answer.status != 200:
        return f"{what} refused (HTTP {answer.status}): {answer.detail}"
    if answer.info is None:
        return f"{what}: accepted, but /server_info could not be read back, so it is unproven"
    states = answer.info.get("internal_states")
    tree = states[0].get("ddtree") if isinstance(states, list) and states and isinstance(states[0], Mapping) else None
    if not isinstance(tree, Mapping):
        return f"{what}: accepted, but the server reports no runtime states (internal_states[0].ddtree)"
    active = tree.get("active")
    mode = tree.get("mode")
    if mode != "pinned" or not isinstance(active, Mapping) or (active.get("budget"), active.get("topk")) != (
        budget, topk
    ):
        got = f"budget {active.get('budget')} top-k {active.get('topk')}" if isinstance(active, Mapping) else "none"
        return f"{what} did not take: the server reports mode {mode!r}, active {got}"
    entries = tree.get("states")
    entry = next((e for e in entries if isinstance(e, Mapping) and e.get("budget") == budget), None) \
        if isinstance(entries, list) else None
    if entry is None:
        return f"{what}: the server lists no state for budget {budget} (internal_states[0].ddtree.states)"
    graph = entry.get("cuda_graph")
    if graph not in ("captured", "eager", "disabled"):
        return f"{what}: budget {budget}'s state is {graph!r} ({entry.get('reason') or 'no reason given'})"
    reason = entry.get("reason")
    ceiling = graph_ceilings(answer.info)
    state = ceiling.of(budget) if ceiling is not None else None
    return LiveTree(budget, topk, str(graph), reason if isinstance(reason, str) else None,
                    cuda_graph_max_bs=state.max_bs if state is not None else None)


__all__ = [
    "LiveTree",
    "SwitchAnswer",
    "judge_switch",
    "refusal_detail",
    "states_file",
    "switch_request",
]
