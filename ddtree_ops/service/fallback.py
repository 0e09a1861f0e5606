"""Eager fallback: decide whether to try CUDA graphs, recognise a capture failure, remember it.

Large DDTree budgets crash CUDA-graph capture on some GPUs (B300, sm_103, budget > 8)
while eager mode works. Re-discovering that on every restart costs a full model load,
so a fallback is remembered in the local state, keyed by what plausibly decides it:
host, GPU arch, SGLang version, algorithm, budget and topk; a record at a budget sends
every larger budget eager too (the crash grows with the verify width), and
``selftest --e2e --bisect-budgets`` records the first failing budget. A record is keyed on
the budget that *failed*: the launch budget when the launch's own capture crashed, a
runtime state's budget when the server reported that state's verify graph eager after its
capture failed (:func:`runtime_capture_failures`). A launch holding several budgets (a
live sweep launch, a tuned policy) serves only the recorded ones eager, through the
bundle's ``ddtree.eager_budgets`` (:func:`plan_runtime_budgets`), and keeps the others'
graphs. A record at one top-k is taken as likely for the other top-k values (said so in
the reason), rather than paid for with a failed launch at each. The host is the machine,
not a GPU slot of it: its slots share the GPU arch and the installed SGLang, so a
capture failure on one slot sends the others eager directly. ``--retry-cuda-graph``
tries graphs again (and forgets the record if they work).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ddtree_ops.inventory_types import Host
from ddtree_ops.service.launch import RunConfig
from ddtree_ops.service.logphases import LogEvent, Phase, PhaseTracker
from ddtree_ops.state import FallbackKey, FallbackRecord, StateStore

#: The reason both the bundle and the simulator give for a state served eager because the
#: launch listed it: not a capture failure, so never recorded as one.
LISTED_EAGER = "listed in ddtree.eager_budgets"


class BisectionFinding(Protocol):
    """What a budget bisection tells (``ddtree_ops.selftest.Bisection``)."""

    @property
    def first_failing(self) -> int | None: ...

    @property
    def passed_up_to(self) -> int | None: ...

    @property
    def blocking_error(self) -> str | None: ...


def probed_gpu_arch(compute_caps: Iterable[str | None]) -> str | None:
    """``sm_<major><minor>`` of the first GPU whose compute capability the probe read."""
    return next(("sm_" + cap.replace(".", "") for cap in compute_caps if cap), None)


def fallback_key(host: Host, run: RunConfig, *, arch: str | None, sglang_version: str | None) -> FallbackKey:
    """``arch`` is the probed GPU architecture; without one the inventory's ``gpu`` stands in."""
    return FallbackKey(
        host=host.machine,
        gpu_arch=arch or host.ddtree.gpu or "unknown",
        sglang_version=sglang_version or "unknown",
        algorithm=run.algorithm,
        budget=run.budget,
        topk=run.topk,
    )


def remember_bisection(
    state: StateStore, host: Host, found: BisectionFinding, *, gpu_arch: str | None, sglang_version: str | None,
    topk: int,
) -> None:
    """What ``selftest --e2e --bisect-budgets`` found, as eager fallbacks of ``host``: a
    record at the first failing budget (it covers every larger one), and the records the
    budgets that served disprove dropped."""
    def key(budget: int) -> FallbackKey:
        return FallbackKey(host=host.machine, gpu_arch=gpu_arch or host.ddtree.gpu or "unknown",
                           sglang_version=sglang_version or "unknown", algorithm="DDTREE", budget=budget, topk=topk)

    if found.passed_up_to is not None:
        state.clear_fallback(key(found.passed_up_to))
    if found.first_failing is not None:
        state.record_fallback(
            key(found.first_failing),
            f"selftest bisection: budget {found.first_failing} fails with decode CUDA graphs: "
            f"{found.blocking_error or 'launch failed'}",
        )


def initial_cuda_graph(
    run: RunConfig, state: StateStore, key: FallbackKey, *, retry_cuda_graph: bool
) -> tuple[bool, str | None]:
    """(use CUDA graphs?, why not) for the first launch of this restart."""
    if run.cuda_graph == "off":
        return False, "eager requested"
    if run.cuda_graph == "on" or retry_cuda_graph:
        return True, None
    found = recorded_fallback(state, key)
    if found is not None:
        return False, found[1]
    return True, None


def recorded_fallback(state: StateStore, key: FallbackKey) -> tuple[FallbackRecord, str] | None:
    """(the record that sends ``key`` eager, why, as the restart's note), or None: a record
    at ``key``'s own top-k first, else one at another top-k as a likely failure (the note
    says which top-k it was recorded at, so an operator knows ``--retry-cuda-graph`` may
    prove it wrong for this one)."""
    record = state.fallback_for(key)
    if record is not None:
        return record, f"recorded fallback: {record.reason}"
    record = state.likely_fallback_for(key)
    if record is not None:
        return record, (f"recorded fallback at top-k {record.key.topk}, taken as likely at top-k {key.topk} "
                        f"(--retry-cuda-graph tries graphs): {record.reason}")
    return None


@dataclass(frozen=True)
class RuntimeBudgets:
    """How a launch holding several budgets serves them, given the recorded fallbacks.

    ``eager_budgets``: the bundle's ``ddtree.eager_budgets`` (served eager without a capture
    attempt; the others keep their graphs). ``launch_budget``: the launch state, moved off
    an eager budget where one with graphs is left (the bundle refuses the launch budget in
    ``eager_budgets``: SGLang captures the launch width itself). Every budget recorded
    failing: no eager budgets and the launch budget as asked, so that the restart's own
    :func:`initial_cuda_graph` launches the whole server eager, as for one budget.
    ``notes``: why each listed budget is eager, one line each."""

    launch_budget: int
    eager_budgets: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def note(self) -> str | None:
        """One line for the restart's row, or None where nothing is served eager."""
        if not self.eager_budgets:
            return None
        return f"eager_budgets {list(self.eager_budgets)} (the other budgets keep their graphs): " + "; ".join(
            self.notes
        )


def plan_runtime_budgets(
    state: StateStore, key: FallbackKey, budgets: Iterable[int], *, retry_cuda_graph: bool = False
) -> RuntimeBudgets:
    """The eager budgets and launch budget of a launch at ``key`` (its budget: the launch
    state asked for) holding ``budgets``: a budget goes eager where a record covers it at
    this top-k, or likely at another (:func:`recorded_fallback`). ``--retry-cuda-graph``
    tries every graph again."""
    assert key.budget is not None
    held = sorted(set(budgets) | {key.budget})
    if retry_cuda_graph:
        return RuntimeBudgets(key.budget)
    eager: list[int] = []
    notes: list[str] = []
    for budget in held:
        found = recorded_fallback(state, replace(key, budget=budget))
        if found is not None:
            eager.append(budget)
            notes.append(f"budget {budget}: {found[1]}")
    graphs = [b for b in held if b not in eager]
    if not eager or not graphs:
        return RuntimeBudgets(key.budget)
    # The nearest budget below the one asked for keeps the launch closest to it (the
    # records are upward closed, so every graph budget is below every eager one).
    launch = key.budget if key.budget in graphs else max(graphs)
    return RuntimeBudgets(launch, tuple(eager), tuple(notes))


def runtime_capture_failures(info: Mapping[str, Any]) -> list[tuple[int, str]]:
    """(budget, why) of each runtime state whose verify graph failed to capture, as the
    server answering ``info`` (``/server_info``) reports it in ``internal_states[0].ddtree
    .states``: served ``eager`` (or ``dropped``) with a reason other than being listed in
    ``ddtree.eager_budgets``. Nothing for a server without runtime states."""
    states = info.get("internal_states")
    first = states[0] if isinstance(states, list) and states else None
    live = first.get("ddtree") if isinstance(first, Mapping) else None
    entries = live.get("states") if isinstance(live, Mapping) else None
    out: list[tuple[int, str]] = []
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, Mapping) or entry.get("cuda_graph") not in ("eager", "dropped"):
            continue
        budget, reason = entry.get("budget"), entry.get("reason")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            continue
        if isinstance(reason, str) and LISTED_EAGER in reason:
            continue
        out.append((budget, reason if isinstance(reason, str) and reason else "no reason given"))
    return out


# The bundle names a runtime state's budget in its refusal after that state's capture
# failed (ddtree_runtime.capture_outcome: "Capture cuda graph failed: DDTREE budget 16: ...",
# a poisoned context, or under TP a failure on any rank) and in its capture lines ("Capture
# DDTREE budget 16 target verify CUDA graph begin."), which a death during it is blamed on.
_RUNTIME_BUDGET = re.compile(r"\bDDTREE budget (\d+)\b")
#: The bundle's switch that serves eager, for one launch, every runtime budget at or above
#: it (``ddtree_runtime.EAGER_FROM_ENV``): the relaunch after a runtime state's capture
#: failed keeps the other states' graphs, whoever wrote the launch's state file.
EAGER_FROM_ENV = "SGLANG_DDTREE_EAGER_FROM_BUDGET"


def failed_capture_budget(reason: str) -> int | None:
    """The runtime budget a whole-start capture failure names, or None (the launch's own)."""
    found = _RUNTIME_BUDGET.search(reason)
    return int(found.group(1)) if found else None


def capture_failure(tracker: PhaseTracker, *, alive: bool) -> str | None:
    """Why this launch counts as a CUDA-graph capture failure, or None. A death while
    capturing names the graph its last "Capture ... CUDA graph begin." line named."""
    line = tracker.first_line(LogEvent.CAPTURE_FAILED)
    if line is not None:
        return "CUDA-graph capture failed: " + _message(line)
    if not alive and tracker.phase is Phase.CAPTURING:
        found = _CAPTURING.search(tracker.phase_line)
        return "server died during CUDA-graph capture" + (f" of {found.group(1)}" if found else "")
    return None


_CAPTURING = re.compile(r"Capture (.{1,80}?) CUDA graph begin\.")


def _message(line: str) -> str:
    # The matching line may be SGLang's own log line or the traceback's "Exception: ..."
    # line; keep what follows the marker, short enough for one line.
    idx = line.lower().find("capture cuda graph failed:")
    text = line[idx + len("capture cuda graph failed:"):] if idx >= 0 else line
    return text.strip()[:200]
