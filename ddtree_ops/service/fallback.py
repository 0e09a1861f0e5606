"""Eager fallback: decide whether to try CUDA graphs, recognise a capture failure, remember it.

Large DDTree budgets crash CUDA-graph capture on some GPUs (B300, sm_103, budget > 8)
while eager mode works. Re-discovering that on every restart costs a full model load,
so a fallback is remembered in the local state, keyed by what plausibly decides it:
host, GPU arch, SGLang version, algorithm, budget and topk; a record at a budget sends
every larger budget eager too (the crash grows with the verify width), and
``selftest --e2e --bisect-budgets`` records the first failing budget. The host is the machine,
not a GPU slot of it: its slots share the GPU arch and the installed SGLang, so a
capture failure on one slot sends the others eager directly. ``--retry-cuda-graph``
tries graphs again (and forgets the record if they work).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from ddtree_ops.inventory_types import Host
from ddtree_ops.service.launch import RunConfig
from ddtree_ops.service.logphases import LogEvent, Phase, PhaseTracker
from ddtree_ops.state import FallbackKey, StateStore


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
    record = state.fallback_for(key)
    if record is not None:
        return False, f"recorded fallback: {record.reason}"
    return True, None


def capture_failure(tracker: PhaseTracker, *, alive: bool) -> str | None:
    """Why this launch counts as a CUDA-graph capture failure, or None."""
    line = tracker.first_line(LogEvent.CAPTURE_FAILED)
    if line is not None:
        return "CUDA-graph capture failed: " + _message(line)
    if not alive and tracker.phase is Phase.CAPTURING:
        return "server died during CUDA-graph capture"
    return None


def _message(line: str) -> str:
    # The matching line may be SGLang's own log line or the traceback's "Exception: ..."
    # line; keep what follows the marker, short enough for one line.
    idx = line.lower().find("capture cuda graph failed:")
    text = line[idx + len("capture cuda graph failed:"):] if idx >= 0 else line
    return text.strip()[:200]
