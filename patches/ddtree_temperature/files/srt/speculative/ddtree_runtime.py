"""DDTREE runtime states: one per tree budget of a set given at launch, switched
between rounds without reloading weights.

SGLang 0.5.23 switches EAGLE's step count at runtime
(``srt/speculative/adaptive_runtime_state.py``: a ``SpecRuntimeState`` per
configuration, each with its own target-verify attention backend and graph runner,
swapped atomically by ``AdaptiveController``; ``adaptive_spec_params.py`` routes a
batch size to its slot). DDTREE follows the same pattern with the tree budget in
the place of the step count: a budget fixes the verify width ``budget + 1`` and so
needs its own verify attention backend and CUDA graph. The top-k changes only the
tree built from the draft's candidates, which are computed for the largest top-k
of the set, so it switches without a state of its own.

The set comes through 0.5.23's flag for runtime speculative configurations,
``--speculative-adaptive-config PATH`` (a plugin cannot add flags: the parser is
built before plugins load), under a ``"ddtree"`` key::

    {"ddtree": {"budgets": [4, 8, 16], "topk_max": 8,
                "policy": {"1": {"budget": 16, "topk": 4}, "32": {"budget": 4, "topk": 2}},
                "on_capture_failure": "eager", "eager_budgets": [],
                "state_memory_fraction": 0.5}}

This module is pure Python (no torch, no SGLang; the default CUDA-context probe
imports torch when it runs): the launch check, the worker and the tests share it.
"""

from __future__ import annotations

import bisect
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

CONFIG_KEY = "ddtree"
CAPTURE_FAILURE_CHOICES = ("eager", "drop")
# /set_internal_state keys (0.5.23's SetInternalStateReq takes numbers only).
SWITCH_KEYS = ("ddtree_budget", "ddtree_topk", "ddtree_policy")
_CONFIG_KEYS = {
    "budgets",
    "topk_max",
    "policy",
    "on_capture_failure",
    "eager_budgets",
    "state_memory_fraction",
}
# Share of the device memory free when the runtime states are built (after the KV
# pool and SGLang's own graphs) that the extra states may take together.
DEFAULT_STATE_MEMORY_FRACTION = 0.5
# What SGLang 0.5.23 raises when a decode graph fails to capture
# (``DecodeCudaGraphRunner.__init__``); the toolkit's log reader knows it.
CAPTURE_FAILED_MARKER = "Capture cuda graph failed:"
# A supervisor's way to serve eager, for this launch, every runtime budget at or above N
# (the toolkit's relaunch after a state's capture failed there: the failures grow with
# the verify width, and the file it launched with may not be its to rewrite). Merged
# into ddtree.eager_budgets; the launch budget, which SGLang captured, is never affected.
EAGER_FROM_ENV = "SGLANG_DDTREE_EAGER_FROM_BUDGET"
LISTED_EAGER = "listed in ddtree.eager_budgets"


class RuntimeConfigError(ValueError):
    """A ``--speculative-adaptive-config`` whose ``ddtree`` section DDTREE cannot serve."""


class TreeSwitchRefused(ValueError):
    """A runtime switch this server cannot make; nothing was changed."""


class CaptureContextPoisoned(RuntimeError):
    """A budget's capture failed and left the CUDA context unusable (an illegal
    memory access is sticky): the server must not start, whatever the budget."""


class CaptureDisagreement(RuntimeError):
    """Under TP > 1, a budget's verify graph failed to capture on some rank: every rank
    refuses to start (graph mode on one rank and eager on another would have custom
    all-reduce read a peer's graph buffer, not its eager staging buffer)."""


class StateMemoryExceeded(RuntimeError):
    """The runtime states took more device memory than ``state_memory_fraction``
    allows: refused at startup, never served eager in silence."""


@dataclass(frozen=True, order=True)
class TreeShape:
    """What a round's tree is: its node budget and candidates per draft position."""

    budget: int
    topk: int

    def as_dict(self) -> Dict[str, int]:
        return {"budget": self.budget, "topk": self.topk}


@dataclass(frozen=True)
class RuntimeConfig:
    source: str
    budgets: Tuple[int, ...]
    topk_max: int
    # (smallest batch size, shape), sorted by batch size
    policy: Tuple[Tuple[int, TreeShape], ...] = ()
    on_capture_failure: str = "eager"
    eager_budgets: Tuple[int, ...] = ()
    state_memory_fraction: float = DEFAULT_STATE_MEMORY_FRACTION
    # EAGER_FROM_ENV: every budget at or above it is served eager (None: unset)
    eager_from: Optional[int] = None

    @property
    def max_budget(self) -> int:
        return max(self.budgets)

    def listed_eager(self, budget: int) -> Optional[str]:
        """Why ``budget`` is served eager without a capture attempt, or None."""
        if budget in self.eager_budgets:
            return LISTED_EAGER
        if self.eager_from is not None and budget >= self.eager_from:
            return (
                f"{LISTED_EAGER} by {EAGER_FROM_ENV}={self.eager_from} (a capture at "
                "that budget failed on this machine)"
            )
        return None

    def route(self, batch_size: int) -> TreeShape:
        """The policy's shape for a round of ``batch_size`` requests: the entry of the
        largest batch size not above it, the smallest entry below all (as
        ``AdaptiveSpeculativeParams._find_closest_bs``)."""
        sizes = [bs for bs, _ in self.policy]
        at = bisect.bisect_right(sizes, int(batch_size)) - 1
        return self.policy[max(0, at)][1]

    def policy_dict(self) -> Optional[Dict[str, Dict[str, int]]]:
        if not self.policy:
            return None
        return {str(bs): shape.as_dict() for bs, shape in self.policy}


def _int(value: Any, where: str, low: int, high: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RuntimeConfigError(f"{where} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        raise RuntimeConfigError(f"{where} must be {bounds}, got {value}")
    return value


def parse_runtime_config(
    data: Any,
    *,
    source: str,
    launch: TreeShape,
    max_budget: int,
    eager_from: Optional[str] = None,
) -> Optional[RuntimeConfig]:
    """The ``ddtree`` section of an adaptive config, checked against the launch tree;
    None when the file has no such section (it may hold EAGLE's keys only)."""
    if not isinstance(data, dict):
        raise RuntimeConfigError("the file must hold a JSON object")
    if CONFIG_KEY not in data:
        return None
    section = data[CONFIG_KEY]
    if not isinstance(section, dict):
        raise RuntimeConfigError(f"{CONFIG_KEY} must be an object")
    unknown = sorted(set(section) - _CONFIG_KEYS)
    if unknown:
        raise RuntimeConfigError(
            f"{CONFIG_KEY}.{unknown[0]} is not a key DDTREE reads "
            f"(known: {', '.join(sorted(_CONFIG_KEYS))})"
        )
    raw = section.get("budgets")
    if not isinstance(raw, list) or not raw:
        raise RuntimeConfigError(f"{CONFIG_KEY}.budgets must be a non-empty list")
    budgets = [
        _int(b, f"{CONFIG_KEY}.budgets[{i}]", 1, max_budget) for i, b in enumerate(raw)
    ]
    if len(set(budgets)) != len(budgets):
        raise RuntimeConfigError(f"{CONFIG_KEY}.budgets has duplicates: {budgets}")
    budgets = sorted(budgets)
    if launch.budget not in budgets:
        raise RuntimeConfigError(
            f"the launch budget {launch.budget} (--speculative-num-draft-tokens "
            f"{launch.budget + 1}) is not in {CONFIG_KEY}.budgets {budgets}"
        )

    policy: List[Tuple[int, TreeShape]] = []
    raw_policy = section.get("policy") or {}
    if not isinstance(raw_policy, dict):
        raise RuntimeConfigError(f"{CONFIG_KEY}.policy must be an object")
    for key, entry in raw_policy.items():
        where = f'{CONFIG_KEY}.policy["{key}"]'
        if not (isinstance(key, str) and key.isdigit() and int(key) >= 1):
            raise RuntimeConfigError(f"{where}: keys are batch sizes (integers >= 1)")
        if not isinstance(entry, dict) or set(entry) != {"budget", "topk"}:
            raise RuntimeConfigError(f'{where} must be {{"budget": B, "topk": K}}')
        budget = _int(entry["budget"], f"{where}.budget", 1, max_budget)
        if budget not in budgets:
            raise RuntimeConfigError(
                f"{where}.budget {budget} is not in {CONFIG_KEY}.budgets {budgets}"
            )
        topk = _int(entry["topk"], f"{where}.topk", 1)
        policy.append((int(key), TreeShape(budget, topk)))
    policy.sort()

    wanted_topk = max([launch.topk, *(s.topk for _, s in policy)])
    topk_max = section.get("topk_max", wanted_topk)
    topk_max = _int(topk_max, f"{CONFIG_KEY}.topk_max", 1)
    if topk_max < wanted_topk:
        raise RuntimeConfigError(
            f"{CONFIG_KEY}.topk_max {topk_max} is below a top-k the server must "
            f"serve ({wanted_topk}: --speculative-eagle-topk or the policy)"
        )

    on_failure = section.get("on_capture_failure", "eager")
    if on_failure not in CAPTURE_FAILURE_CHOICES:
        raise RuntimeConfigError(
            f"{CONFIG_KEY}.on_capture_failure must be one of "
            f"{', '.join(CAPTURE_FAILURE_CHOICES)}, got {on_failure!r}"
        )
    raw_eager = section.get("eager_budgets", [])
    if not isinstance(raw_eager, list):
        raise RuntimeConfigError(f"{CONFIG_KEY}.eager_budgets must be a list")
    eager = sorted({_int(b, f"{CONFIG_KEY}.eager_budgets", 1) for b in raw_eager})
    for budget in eager:
        if budget not in budgets:
            raise RuntimeConfigError(
                f"{CONFIG_KEY}.eager_budgets: {budget} is not in {CONFIG_KEY}.budgets"
            )
    if launch.budget in eager:
        # SGLang captures the launch width itself, before the worker sees the set.
        raise RuntimeConfigError(
            f"{CONFIG_KEY}.eager_budgets holds the launch budget {launch.budget}; "
            "launch on a budget whose graph captures (or with graphs disabled)"
        )
    fraction = section.get("state_memory_fraction", DEFAULT_STATE_MEMORY_FRACTION)
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float))
        or not 0 < fraction <= 1
    ):
        raise RuntimeConfigError(
            f"{CONFIG_KEY}.state_memory_fraction must be a number in (0, 1], "
            f"got {fraction!r}"
        )
    from_budget = None
    if eager_from not in (None, ""):
        text = str(eager_from).strip()
        if not text.isdigit() or int(text) < 1:
            raise RuntimeConfigError(
                f"{EAGER_FROM_ENV} must be a budget (an integer >= 1), got {text!r}"
            )
        from_budget = int(text)
    return RuntimeConfig(
        source=source,
        budgets=tuple(budgets),
        topk_max=topk_max,
        policy=tuple(policy),
        on_capture_failure=on_failure,
        eager_budgets=tuple(eager),
        state_memory_fraction=float(fraction),
        eager_from=from_budget,
    )


def load_runtime_config(
    path: Optional[str],
    *,
    launch: TreeShape,
    max_budget: int,
    eager_from: Optional[str] = None,
) -> Optional[RuntimeConfig]:
    """Read ``--speculative-adaptive-config``; errors name the file and the key."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise RuntimeConfigError(
            f"--speculative-adaptive-config {path}: cannot read it ({e.strerror})"
        ) from e
    except json.JSONDecodeError as e:
        raise RuntimeConfigError(
            f"--speculative-adaptive-config {path}: not JSON (line {e.lineno}: {e.msg})"
        ) from e
    try:
        return parse_runtime_config(
            data,
            source=path,
            launch=launch,
            max_budget=max_budget,
            eager_from=eager_from,
        )
    except RuntimeConfigError as e:
        raise RuntimeConfigError(f"--speculative-adaptive-config {path}: {e}") from e


@dataclass
class StateOutcome:
    """How one budget's verify state came out at start."""

    budget: int
    cuda_graph: str  # "captured" | "eager" | "disabled" | "dropped"
    reason: Optional[str] = None
    # device memory the state took (attention backend + verify graph), measured
    # around its build; None for the launch state, which SGLang built
    memory_mb: Optional[float] = None
    # the largest batch its verify graph replays (graph_max_bs); None: no graph
    cuda_graph_max_bs: Optional[int] = None

    def as_dict(self) -> Dict[str, Any]:
        return {
            "budget": self.budget,
            "verify_width": self.budget + 1,
            "cuda_graph": self.cuda_graph,
            "reason": self.reason,
            "memory_mb": (None if self.memory_mb is None else round(self.memory_mb, 1)),
            "cuda_graph_max_bs": self.cuda_graph_max_bs,
        }


def graph_max_bs(graph_runner: Any) -> Optional[int]:
    """The largest batch size a verify graph runner replays, or None without one.

    0.5.23's DecodeCudaGraphRunner captures the batch sizes that
    ``get_batch_sizes_to_capture`` leaves of ``cuda_graph_config.decode.bs`` for its
    width (runner/base_cuda_graph_runner.py: aligned, at most the request pool) and
    ``can_run_graph`` sends a batch above ``max(capture_bs)`` eager; so this is the
    concurrency up to which a state's rounds replay its graph."""
    return None if graph_runner is None else int(max(graph_runner.capture_bs))


def cuda_context_probe() -> None:
    """Raise if the CUDA context no longer runs kernels: a synchronize, a tiny
    kernel and its result back on the host. An illegal memory access is sticky (every
    later CUDA call fails), an out-of-memory or a Python error is not."""
    import torch

    if not torch.cuda.is_available():  # no CUDA context to poison
        return
    torch.cuda.synchronize()
    probe = torch.ones(8, device="cuda")
    if float((probe + 1).sum().item()) != 16.0:
        raise RuntimeError("a probe kernel computed a wrong sum")
    torch.cuda.synchronize()


def one_line(error: BaseException, limit: int = 300) -> str:
    """An exception as one line: its type and words, without SGLang's multi-line
    advice after a failed capture (``CUDA_GRAPH_CAPTURE_FAILED_MSG``)."""
    text = str(error).split("Possible solutions:")[0]
    return " ".join(f"{type(error).__name__}: {text}".split())[:limit]


def tp_capture_agreement(group: Any, world_size: int) -> Callable[[int], List[int]]:
    """Every TP rank's capture status (0 captured, 1 failed with a usable context, 2 the
    context poisoned), gathered over ``group``: SGLang's TP CPU group (gloo), which still
    works on a rank whose CUDA context a capture poisoned."""

    def agree(status: int) -> List[int]:
        import torch
        import torch.distributed as dist

        mine = torch.tensor([int(status)], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(int(world_size))]
        dist.all_gather(every, mine, group=group)
        return [int(t.item()) for t in every]

    return agree


def _ranks(statuses: Sequence[int], wanted: Sequence[int]) -> str:
    return ", ".join(str(r) for r, s in enumerate(statuses) if s in wanted)


def capture_outcome(
    budget: int,
    capture: Callable[[int], Any],
    *,
    graphs_enabled: bool,
    config: RuntimeConfig,
    probe: Callable[[], None] = cuda_context_probe,
    agree: Optional[Callable[[int], List[int]]] = None,
    log: Optional[Callable[[str], None]] = None,
) -> Tuple[Any, StateOutcome]:
    """Capture one budget's verify graph (``capture(budget)`` returns the runner) and
    say how it went.

    Every capture, returned or raised, is followed by ``probe()``: a sticky CUDA error
    (an illegal memory access in the last warm-up) can surface only at the next CUDA
    call, and a capture that "returned" on a poisoned context must not be served. A
    failing capture with a usable context serves that budget eager (or drops it) and
    never takes the other budgets' graphs with it; a poisoned context refuses the start
    (:class:`CaptureContextPoisoned`) with one line carrying SGLang's capture-failure
    marker and the budget, so a supervisor relaunches with that budget eager.

    Under TP > 1 (``agree``: every rank's status, :func:`tp_capture_agreement`) the
    ranks must decide alike: any failure on any rank refuses the start on every rank
    (:class:`CaptureDisagreement`, the same marker and budget), never graph mode on
    one rank and eager on another.

    ``log`` gets SGLang's own wording around the capture ("Capture ... CUDA graph
    begin." / "... end."), which log readers take as the capture phase."""
    if not graphs_enabled:
        return None, StateOutcome(budget, "disabled")
    listed = config.listed_eager(budget)
    if listed is not None:
        return None, StateOutcome(budget, "eager", listed)
    say = log or (lambda _line: None)
    name = f"DDTREE budget {budget} target verify"
    say(f"Capture {name} CUDA graph begin. verify_width={budget + 1}")
    started = time.perf_counter()
    graph, error, poisoned = None, None, None
    try:
        graph = capture(budget)
    except Exception as e:  # a capture failure of one budget, whatever raised it
        error = e
    try:
        probe()
    except Exception as e:
        poisoned = e
    reason = None if error is None else one_line(error)
    status = 2 if poisoned is not None else (1 if error is not None else 0)
    statuses = [status] if agree is None else agree(status)
    relaunch = (
        "refusing to start (relaunch with decode CUDA graphs disabled, or "
        f"with {budget} in {CONFIG_KEY}.eager_budgets)"
    )
    if poisoned is not None:
        what = reason if reason is not None else "the capture returned"
        raise CaptureContextPoisoned(
            f"{CAPTURE_FAILED_MARKER} DDTREE budget {budget}: {what} -- the "
            f"CUDA context is unusable after it ({one_line(poisoned, 120)}); {relaunch}"
        ) from (error or poisoned)
    if agree is not None and any(statuses):
        # A rank failed (this one's context is usable): every rank refuses alike.
        failed = _ranks(statuses, (1, 2))
        worst = "its CUDA context is unusable" if 2 in statuses else "not captured"
        mine = f"; here: {reason}" if reason is not None else ""
        raise CaptureDisagreement(
            f"{CAPTURE_FAILED_MARKER} DDTREE budget {budget}: the verify graph failed "
            f"on TP rank(s) {failed} of {len(statuses)} ({worst}){mine}; the ranks "
            f"must all serve it with a graph or all eager; {relaunch}"
        ) from error
    elapsed = time.perf_counter() - started
    if error is None:
        say(f"Capture {name} CUDA graph end. elapsed={elapsed:.2f} s, captured.")
        return graph, StateOutcome(budget, "captured")
    kind = "dropped" if config.on_capture_failure == "drop" else "eager"
    say(
        f"Capture {name} CUDA graph end. elapsed={elapsed:.2f} s, not captured "
        f"({reason}): {'dropped' if kind == 'dropped' else 'served eager'}."
    )
    return None, StateOutcome(budget, kind, reason)


@dataclass
class StateMemory:
    """What the runtime states may take of the device memory, and what they took.

    ``free_mb()`` reads the device's free memory in MB (the worker passes SGLang's
    ``get_available_gpu_memory``); the first reading, taken before any extra state is
    built, sets the cap: ``fraction`` of it for all extra states together."""

    free_mb: Callable[[], float]
    fraction: float = DEFAULT_STATE_MEMORY_FRACTION
    free_at_start_mb: float = field(init=False)
    cap_mb: float = field(init=False)
    used_mb: float = 0.0
    # the extra budgets charged so far, all under the cap
    fitted: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free_at_start_mb = float(self.free_mb())
        self.cap_mb = self.fraction * self.free_at_start_mb

    def charge(self, budget: int, free_before_mb: float, *, kept: bool) -> float:
        """The MB a state took since ``free_before_mb``; raises
        :class:`StateMemoryExceeded` when the kept states pass the cap, naming the
        budgets built before it (the largest set of these states that fits)."""
        took = max(0.0, float(free_before_mb) - float(self.free_mb()))
        if not kept:
            return took
        self.used_mb += took
        if self.used_mb > self.cap_mb:
            raise StateMemoryExceeded(
                f"DDTREE refuses to start: runtime state budget {budget} took "
                f"{took:.0f} MB, past the cap of {self.cap_mb:.0f} MB for all runtime "
                f"states ({CONFIG_KEY}.state_memory_fraction {self.fraction:g} of "
                f"{self.free_at_start_mb:.0f} MB free after the KV pool; the states "
                f"built so far took {self.used_mb:.0f} MB); the extra states that fit: "
                f"{sorted(self.fitted)}; drop budgets from {CONFIG_KEY}.budgets "
                f"(launch those in another server) or raise "
                f"{CONFIG_KEY}.state_memory_fraction"
            )
        self.fitted.append(int(budget))
        return took

    def as_dict(self) -> Dict[str, Any]:
        return {
            "state_memory_fraction": self.fraction,
            "free_at_start_mb": round(self.free_at_start_mb, 1),
            "cap_mb": round(self.cap_mb, 1),
            "used_mb": round(self.used_mb, 1),
        }


def build_state(
    budget: int,
    make_backend: Callable[[int], Any],
    capture: Callable[[Any, int], Any],
    *,
    graphs_enabled: bool,
    config: RuntimeConfig,
    memory: StateMemory,
    probe: Callable[[], None] = cuda_context_probe,
    agree: Optional[Callable[[int], List[int]]] = None,
    log: Optional[Callable[[str], None]] = None,
) -> Tuple[Any, Any, StateOutcome]:
    """One extra budget's state, measured: ``make_backend(budget)`` (its target
    attention backend and workspace), then ``capture(backend, budget)`` (its verify
    graph) through :func:`capture_outcome`. Returns (backend, graph or None, outcome
    with ``memory_mb``); raises :class:`CaptureContextPoisoned` or
    :class:`StateMemoryExceeded` to refuse the start."""
    before = float(memory.free_mb())
    backend = make_backend(budget)
    graph, outcome = capture_outcome(
        budget,
        lambda b: capture(backend, b),
        graphs_enabled=graphs_enabled,
        config=config,
        probe=probe,
        agree=agree,
        log=log,
    )
    outcome.memory_mb = memory.charge(
        budget, before, kept=outcome.cuda_graph != "dropped"
    )
    outcome.cuda_graph_max_bs = graph_max_bs(graph)
    return backend, graph, outcome


@dataclass
class TreeRuntime:
    """Which tree the next round uses, and what may change it.

    Mode ``fixed``: no set was given (one state). ``pinned``: a switch request (or a
    launch without a policy) fixed the shape. ``policy``: each round takes the
    shape the per-batch-size policy routes its batch size to.
    """

    launch: TreeShape
    config: Optional[RuntimeConfig] = None
    outcomes: List[StateOutcome] = field(default_factory=list)
    mode: str = "fixed"
    pinned: Optional[TreeShape] = None
    active: Optional[TreeShape] = None
    switches: int = 0
    last_refusal: Optional[str] = None
    memory: Optional[StateMemory] = None

    def __post_init__(self) -> None:
        self.pinned = self.pinned or self.launch
        self.active = self.active or self.launch
        if self.config is not None:
            self.mode = "policy" if self.config.policy else "pinned"

    @property
    def budgets(self) -> List[int]:
        """The switchable budgets (dropped ones removed)."""
        if self.config is None:
            return [self.launch.budget]
        dropped = {o.budget for o in self.outcomes if o.cuda_graph == "dropped"}
        return [b for b in self.config.budgets if b not in dropped]

    @property
    def topk_max(self) -> int:
        return self.launch.topk if self.config is None else self.config.topk_max

    def for_round(self, batch_size: int) -> TreeShape:
        """The shape of the next round (policy mode: routed by its batch size; a
        policy entry whose budget was dropped falls back to the launch tree)."""
        if self.mode == "policy" and self.config is not None:
            shape = self.config.route(batch_size)
            if shape.budget not in self.budgets:
                shape = self.launch
        else:
            shape = self.pinned or self.launch
        self.active = shape
        return shape

    def plan(self, request: Mapping[str, Any]) -> Tuple[str, TreeShape]:
        """The (mode, pinned shape) a switch request asks for; raises
        :class:`TreeSwitchRefused` with the reason, recorded for ``/server_info``."""
        try:
            return self._plan(request)
        except TreeSwitchRefused as e:
            self.last_refusal = str(e)
            raise

    def _plan(self, request: Mapping[str, Any]) -> Tuple[str, TreeShape]:
        if self.config is None:
            raise TreeSwitchRefused(
                "DDTREE: this server has one tree (budget "
                f"{self.launch.budget}, top-k {self.launch.topk}); launch it with "
                "--speculative-adaptive-config holding ddtree.budgets to switch at "
                "runtime."
            )
        values: Dict[str, int] = {}
        for key, value in request.items():
            if key not in SWITCH_KEYS:
                raise TreeSwitchRefused(f"DDTREE: {key} is not a DDTREE switch key.")
            if isinstance(value, bool) or float(value) != int(value):
                raise TreeSwitchRefused(
                    f"DDTREE: {key} must be an integer, got {value!r}."
                )
            values[key] = int(value)
        if "ddtree_policy" in values:
            if set(values) != {"ddtree_policy"}:
                raise TreeSwitchRefused(
                    "DDTREE: ddtree_policy goes alone (a pinned tree is "
                    "ddtree_budget / ddtree_topk)."
                )
            if values["ddtree_policy"] not in (0, 1):
                raise TreeSwitchRefused("DDTREE: ddtree_policy must be 0 or 1.")
            if values["ddtree_policy"] == 0:
                return "pinned", self.active or self.launch
            if not self.config.policy:
                raise TreeSwitchRefused(
                    f"DDTREE: no per-batch-size policy in {self.config.source} "
                    "(ddtree.policy); pin a tree with ddtree_budget / ddtree_topk."
                )
            return "policy", self.pinned or self.launch
        base = self.active or self.launch
        budget = values.get("ddtree_budget", base.budget)
        topk = values.get("ddtree_topk", base.topk)
        if budget not in self.budgets:
            dropped = [o for o in self.outcomes if o.budget == budget]
            why = (
                f" (dropped at start: {dropped[0].reason})"
                if dropped and dropped[0].cuda_graph == "dropped"
                else ""
            )
            raise TreeSwitchRefused(
                f"DDTREE: budget {budget} is not in this server's runtime states "
                f"{self.budgets}{why}; relaunch with it in ddtree.budgets of "
                "--speculative-adaptive-config."
            )
        if not 1 <= topk <= self.topk_max:
            raise TreeSwitchRefused(
                f"DDTREE: top-k {topk} is outside 1..{self.topk_max} (the draft "
                "candidates are computed for ddtree.topk_max); relaunch with a larger "
                "ddtree.topk_max."
            )
        return "pinned", TreeShape(budget, topk)

    def commit(self, planned: Tuple[str, TreeShape]) -> None:
        self.mode, self.pinned = planned
        if self.mode == "pinned":
            self.active = self.pinned
        self.switches += 1
        self.last_refusal = None

    def describe(self) -> Dict[str, Any]:
        """What ``/server_info`` reports under ``internal_states[i].ddtree``."""
        if self.outcomes:
            states = [o.as_dict() for o in self.outcomes]
        else:
            states = [StateOutcome(b, "disabled").as_dict() for b in self.budgets]
        return {
            "mode": self.mode,
            "active": (self.active or self.launch).as_dict(),
            "budgets": self.budgets,
            "topk_max": self.topk_max,
            "policy": None if self.config is None else self.config.policy_dict(),
            "states": states,
            "state_memory": None if self.memory is None else self.memory.as_dict(),
            "switches": self.switches,
            "last_refusal": self.last_refusal,
        }
