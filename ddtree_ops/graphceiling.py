"""The CUDA-graph ceiling of a DDTree launch, per budget, as its ``/server_info`` says it.

SGLang captures a decode (for DDTree: verify) graph for a list of batch sizes up to
``cuda_graph_config.decode.max_bs`` (``--cuda-graph-max-bs-decode``; its default follows
the GPU memory and ``--max-running-requests``), and a round with more requests than the
largest of them runs eager -- silently, at a fraction of the speed. Each runtime state of
the DDTree plugin has its own verify graph runner, so its ceiling is its own: the plugin
reports it per state (``internal_states[0].ddtree.states[*].cuda_graph_max_bs``) and for the
active one (``ddtree.verify_cuda_graph_max_bs``); ``null`` where a state has no graph.

Pure: ``doctor`` (through the host probe), ``selftest --e2e`` and ``bench`` hand the
server's answer here; a bundle that predates the field reports no ceiling (None), which
is not the same as a state without a graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The per-state field (and, with the ``verify_`` prefix, the ``ddtree`` object's).
FIELD = "cuda_graph_max_bs"


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass(frozen=True)
class BudgetCeiling:
    """One budget's verify graph: how it came out at start and the largest batch it replays."""

    budget: int
    cuda_graph: str  # "captured" | "eager" | "disabled" | "dropped"
    max_bs: int | None  # None: the state has no graph, every batch runs eager

    def above(self, concurrency: int) -> bool:
        """Whether rounds of ``concurrency`` requests outgrow the graph and run eager
        (False for a state without a graph: it is eager at any concurrency, and says so)."""
        return self.max_bs is not None and concurrency > self.max_bs

    def describe(self) -> str:
        if self.max_bs is None:
            return f"budget {self.budget}: no graph ({self.cuda_graph})"
        return f"budget {self.budget}: graphs up to batch {self.max_bs}"

    def as_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "cuda_graph": self.cuda_graph, "max_bs": self.max_bs}


@dataclass(frozen=True)
class GraphCeilings:
    """A launch's ceilings, one per budget it serves (one for a launch without runtime states)."""

    budgets: tuple[BudgetCeiling, ...]

    def of(self, budget: int) -> BudgetCeiling | None:
        return next((b for b in self.budgets if b.budget == budget), None)

    def describe(self) -> str:
        """One line, e.g. ``budget 4: graphs up to batch 8; budget 16: no graph (eager);
        concurrency above a budget's ceiling runs eager``."""
        text = "; ".join(b.describe() for b in self.budgets)
        if any(b.max_bs is not None for b in self.budgets):
            text += "; concurrency above a budget's ceiling runs eager"
        return text

    def as_dict(self) -> list[dict[str, Any]]:
        return [b.as_dict() for b in self.budgets]


def graph_ceilings(info: Mapping[str, Any] | None) -> GraphCeilings | None:
    """The ceilings a DDTree server reports in ``info`` (its ``/server_info``), or None: not
    a DDTree server, or a bundle that does not report them."""
    if not isinstance(info, Mapping):
        return None
    states = info.get("internal_states")
    first = states[0] if isinstance(states, list) and states else None
    live = first.get("ddtree") if isinstance(first, Mapping) else None
    entries = live.get("states") if isinstance(live, Mapping) else None
    found: list[BudgetCeiling] = []
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, Mapping) or FIELD not in entry:
            continue
        budget = _positive_int(entry.get("budget"))
        if budget is not None:
            found.append(BudgetCeiling(budget, str(entry.get("cuda_graph")), _positive_int(entry.get(FIELD))))
    if found:
        return GraphCeilings(tuple(sorted(found, key=lambda b: b.budget)))
    tree = info.get("ddtree")
    budget = _positive_int(tree.get("budget")) if isinstance(tree, Mapping) else None
    if not isinstance(tree, Mapping) or budget is None or f"verify_{FIELD}" not in tree:
        return None
    max_bs = _positive_int(tree.get(f"verify_{FIELD}"))
    if tree.get("verify_cuda_graph_captured") is True:
        outcome = "captured"
    else:
        outcome = "disabled" if tree.get("decode_cuda_graph") == "disabled" else "eager"
    return GraphCeilings((BudgetCeiling(budget, outcome, max_bs),))


__all__ = ["BudgetCeiling", "GraphCeilings", "graph_ceilings"]
