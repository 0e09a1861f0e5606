"""DDTREE runtime states: the ``--speculative-adaptive-config`` file and the live switch.

Torch-free and pure except for :class:`RuntimeStates`, the one mutable controller a
server holds (like SGLang 0.5.23's ``AdaptiveController``). The contract both the real
plugin and the simulator implement is written down in the issue "One model load per
host for the whole budget x top-k grid" (``/server_info internal_states[0].ddtree``,
``POST /set_internal_state``); the toolkit depends only on that.

Why a JSON file and not new flags: 0.5.23 builds its parser before plugins load, so the
plugin can only read a file passed through a flag 0.5.23 already has,
``--speculative-adaptive-config``. 0.5.23 itself ignores it for anything but EAGLE.

A state per *budget*: the verify width (``budget + 1``) fixes the shapes of the verify
pass, so each budget has its own verify graph. Top-k only changes which tree is built
from the draft's candidates (buffers sized for ``topk_max``), so any top-k up to
``topk_max`` is switchable without a state of its own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

MAX_BUDGET = 256
CAPTURE_FAILURE_POLICIES = ("eager", "drop")
GraphOutcome = Literal["captured", "eager", "disabled", "dropped"]
Mode = Literal["fixed", "pinned", "policy"]
_DDTREE_KEYS = ("budgets", "topk_max", "policy", "on_capture_failure", "eager_budgets", "state_memory_fraction")
# The plugin's default share of the memory free after the KV pool that the extra states may take.
DEFAULT_STATE_MEMORY_FRACTION = 0.5


class AdaptiveConfigError(ValueError):
    """A bad ``--speculative-adaptive-config`` file; the message names the file and key."""


class SwitchRefused(ValueError):
    """A ``/set_internal_state`` request the server refuses; nothing changed."""


@dataclass(frozen=True)
class TreeState:
    """One (budget, top-k) a round runs with."""

    budget: int
    topk: int

    def as_json(self) -> dict[str, int]:
        return {"budget": self.budget, "topk": self.topk}


@dataclass(frozen=True)
class AdaptiveConfig:
    """A validated ``{"ddtree": {...}}`` file. ``policy`` is sorted by batch size."""

    path: str
    budgets: tuple[int, ...]
    topk_max: int
    policy: tuple[tuple[int, TreeState], ...] = ()
    on_capture_failure: str = "eager"
    # Budgets served eager without a capture attempt (known to fail on this machine), as
    # the plugin's ddtree_runtime.py takes them.
    eager_budgets: tuple[int, ...] = ()
    state_memory_fraction: float = DEFAULT_STATE_MEMORY_FRACTION


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_adaptive_config(
    data: object, *, path: str, launch_budget: int, launch_topk: int
) -> AdaptiveConfig:
    """Validate an already-parsed file against the launch state.

    Every error is one line: ``DDTREE: --speculative-adaptive-config PATH: KEY ...``.
    """
    where = f"DDTREE: --speculative-adaptive-config {path}"

    def fail(key: str, msg: str) -> AdaptiveConfigError:
        return AdaptiveConfigError(f"{where}: {key} {msg}")

    if not isinstance(data, Mapping) or "ddtree" not in data:
        raise AdaptiveConfigError(f"{where}: the file must be a JSON object with a \"ddtree\" key")
    raw = data["ddtree"]
    if not isinstance(raw, Mapping):
        raise fail("ddtree", "must be an object")
    unknown = sorted(set(raw) - set(_DDTREE_KEYS))
    if unknown:
        raise fail(f"ddtree.{unknown[0]}", f"is not a key (expected {', '.join(_DDTREE_KEYS)})")
    budgets_raw = raw.get("budgets")
    if not isinstance(budgets_raw, list) or not budgets_raw:
        raise fail("ddtree.budgets", "must be a non-empty list of budgets")
    budgets: list[int] = []
    for i, b in enumerate(budgets_raw):
        if not _is_int(b) or not 1 <= b <= MAX_BUDGET:
            raise fail(f"ddtree.budgets[{i}]", f"{b!r} is not an integer in 1..{MAX_BUDGET}")
        if b in budgets:
            raise fail(f"ddtree.budgets[{i}]", f"{b} is listed twice")
        budgets.append(b)
    ordered = tuple(sorted(budgets))
    if launch_budget not in ordered:
        raise fail(
            "ddtree.budgets",
            f"{list(ordered)} does not hold the launch budget {launch_budget} "
            f"(--speculative-num-draft-tokens {launch_budget + 1})",
        )
    policy_raw = raw.get("policy")
    if policy_raw is not None and not isinstance(policy_raw, Mapping):
        raise fail("ddtree.policy", "must be an object of batch size -> {budget, topk}")
    policy_items = list((policy_raw or {}).items())
    topk_max_raw = raw.get("topk_max")
    topk_max: int
    if topk_max_raw is None:
        # Default: big enough for the launch top-k and every top-k the policy uses.
        policy_topks: list[int] = [
            e["topk"] for _, e in policy_items if isinstance(e, Mapping) and _is_int(e.get("topk"))
        ]
        topk_max = max([launch_topk, *policy_topks])
    elif not _is_int(topk_max_raw) or topk_max_raw < 1:
        raise fail("ddtree.topk_max", f"{topk_max_raw!r} is not an integer >= 1")
    else:
        topk_max = int(topk_max_raw)
    if launch_topk > topk_max:
        raise fail("ddtree.topk_max", f"{topk_max} is below the launch top-k {launch_topk} (--speculative-eagle-topk)")
    policy: list[tuple[int, TreeState]] = []
    for key, entry in policy_items:
        at = f"ddtree.policy[{json.dumps(key)}]"
        if not isinstance(key, str) or not key.isdecimal() or int(key) < 1:
            raise fail(at, "is not a batch size (a decimal string >= 1)")
        if not isinstance(entry, Mapping) or set(entry) != {"budget", "topk"}:
            raise fail(at, "must be an object with exactly budget and topk")
        budget, topk = entry["budget"], entry["topk"]
        if not _is_int(budget) or budget not in ordered:
            raise fail(f"{at}.budget", f"{budget!r} is not in ddtree.budgets {list(ordered)}")
        if not _is_int(topk) or not 1 <= topk <= topk_max:
            raise fail(f"{at}.topk", f"{topk!r} is not in 1..{topk_max} (ddtree.topk_max)")
        policy.append((int(key), TreeState(budget, topk)))
    sizes = [bs for bs, _ in policy]
    if len(set(sizes)) != len(sizes):
        raise fail("ddtree.policy", "names one batch size twice")
    on_failure = raw.get("on_capture_failure", "eager")
    if on_failure not in CAPTURE_FAILURE_POLICIES:
        raise fail("ddtree.on_capture_failure", f"{on_failure!r} is not one of {', '.join(CAPTURE_FAILURE_POLICIES)}")
    eager_raw = raw.get("eager_budgets", [])
    if not isinstance(eager_raw, list):
        raise fail("ddtree.eager_budgets", "must be a list of budgets")
    for i, b in enumerate(eager_raw):
        if not _is_int(b) or b not in ordered:
            raise fail(f"ddtree.eager_budgets[{i}]", f"{b!r} is not in ddtree.budgets {list(ordered)}")
    if launch_budget in eager_raw:
        # SGLang captures the launch width itself, before the plugin sees the set.
        raise fail("ddtree.eager_budgets", f"holds the launch budget {launch_budget}; launch on a budget whose "
                                           "graph captures (or with graphs disabled)")
    fraction = raw.get("state_memory_fraction", DEFAULT_STATE_MEMORY_FRACTION)
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise fail("ddtree.state_memory_fraction", f"{fraction!r} is not a number in (0, 1]")
    return AdaptiveConfig(
        state_memory_fraction=float(fraction),
        path=path,
        budgets=ordered,
        topk_max=topk_max,
        policy=tuple(sorted(policy)),
        on_capture_failure=str(on_failure),
        eager_budgets=tuple(sorted(set(eager_raw))),
    )


def load_adaptive_config(path: str, *, launch_budget: int, launch_topk: int) -> AdaptiveConfig:
    """Read and validate the file (:class:`AdaptiveConfigError` naming it on any problem)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise AdaptiveConfigError(
            f"DDTREE: --speculative-adaptive-config {path}: cannot read the file: {exc.strerror or exc}"
        ) from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise AdaptiveConfigError(f"DDTREE: --speculative-adaptive-config {path}: not valid JSON: {exc}") from None
    return parse_adaptive_config(data, path=path, launch_budget=launch_budget, launch_topk=launch_topk)


@dataclass(frozen=True)
class StateGraph:
    """One budget's verify graph as startup left it."""

    budget: int
    cuda_graph: GraphOutcome
    reason: str | None = None
    # Modelled, not measured: what an extra state's attention workspace and verify graph take
    # (the plugin measures it on the device); None for the launch state, which SGLang builds.
    memory_mb: float | None = None
    # The largest batch its verify graph replays (the plugin's ``cuda_graph_max_bs``: the
    # runner's largest capture size); None without a graph. A larger batch runs eager.
    cuda_graph_max_bs: int | None = None

    @property
    def verify_width(self) -> int:
        return self.budget + 1

    @property
    def served_with_graph(self) -> bool:
        return self.cuda_graph == "captured"

    def replays_graph(self, batch: int) -> bool:
        """Whether a round of ``batch`` requests at this state replays its verify graph."""
        return self.served_with_graph and (self.cuda_graph_max_bs is None or batch <= self.cuda_graph_max_bs)

    def as_json(self) -> dict[str, Any]:
        return {"budget": self.budget, "verify_width": self.verify_width, "cuda_graph": self.cuda_graph,
                "reason": self.reason, "memory_mb": self.memory_mb, "cuda_graph_max_bs": self.cuda_graph_max_bs}


class RuntimeStates:
    """The server's set of runtime states and which one the next round uses.

    Mutated only by the scheduler loop (:meth:`for_round`) and the HTTP handler
    (:meth:`apply`), both on the one asyncio thread, so a switch lands between two rounds:
    a round reads its state once, at its start.
    """

    def __init__(
        self, *, launch: TreeState, graphs: tuple[StateGraph, ...], config: AdaptiveConfig | None
    ) -> None:
        self.config = config
        self.graphs = {g.budget: g for g in graphs}
        self.topk_max = config.topk_max if config is not None else launch.topk
        self.policy = config.policy if config is not None else ()
        self.mode: Mode = "fixed" if config is None else ("policy" if self.policy else "pinned")
        self.active = launch
        self.switches = 0
        self.last_refusal: str | None = None
        # The plugin's ``state_memory`` readback (cap and use of the extra states), modelled.
        self.state_memory: dict[str, Any] | None = None
        # The tree trace (the deployed bundle's ddtree_trace.TraceConfig); None: off.
        self.trace: Any = None

    @property
    def budgets(self) -> tuple[int, ...]:
        """Switchable budgets (a dropped state is not one)."""
        return tuple(sorted(b for b, g in self.graphs.items() if g.cuda_graph != "dropped"))

    def graph(self, budget: int) -> StateGraph:
        return self.graphs[budget]

    def policy_state(self, batch_size: int) -> TreeState:
        """The entry of the largest batch-size key <= ``batch_size``; the smallest key when
        the batch is below all (``AdaptiveSpeculativeParams._find_closest_bs``)."""
        chosen = self.policy[0][1]
        for bs, state in self.policy:
            if bs <= batch_size:
                chosen = state
        return chosen

    def for_round(self, batch_size: int) -> TreeState:
        """The state a round of ``batch_size`` requests runs with (policy mode: chosen now)."""
        if self.mode == "policy":
            self.active = self.policy_state(batch_size)
        return self.active

    def apply(self, server_args: Mapping[str, object]) -> bool:
        """``/set_internal_state``'s ddtree keys. True: accepted (the caller restarts the
        acceptance statistics). Raises :class:`SwitchRefused` and changes nothing but
        ``last_refusal`` otherwise."""
        try:
            self._apply(server_args)
        except SwitchRefused as exc:
            self.last_refusal = str(exc)
            raise
        self.last_refusal = None
        self.switches += 1
        return True

    def _apply(self, server_args: Mapping[str, object]) -> None:
        keys = {"ddtree_budget", "ddtree_topk", "ddtree_policy"}
        unknown = sorted(set(server_args) - keys)
        if unknown:
            raise SwitchRefused(f"DDTREE: {unknown[0]} is not a runtime setting of this server "
                                f"(switchable: {', '.join(sorted(keys))})")
        if not server_args:
            raise SwitchRefused("DDTREE: nothing to set (give ddtree_budget and/or ddtree_topk, or ddtree_policy)")
        values: dict[str, int] = {}
        for key, value in server_args.items():
            # 0.5.23's SetInternalStateReq.server_args holds int | float: 8.0 is 8.
            integral = isinstance(value, float) and value.is_integer()
            if not (_is_int(value) or integral):
                raise SwitchRefused(f"DDTREE: {key} must be an integer, got {value!r}")
            values[key] = int(value)  # type: ignore[call-overload]
        if self.config is None:
            raise SwitchRefused(
                "DDTREE: this server has no runtime states (mode \"fixed\"); launch it with "
                "--speculative-adaptive-config to switch budget or top-k live"
            )
        if "ddtree_policy" in values:
            if set(values) != {"ddtree_policy"}:
                raise SwitchRefused("DDTREE: ddtree_policy cannot be combined with ddtree_budget/ddtree_topk")
            if values["ddtree_policy"] not in (0, 1):
                raise SwitchRefused(f"DDTREE: ddtree_policy takes 1 (follow the launch policy) or 0 (pin the "
                                    f"active state), got {values['ddtree_policy']}")
            if values["ddtree_policy"] == 0:
                self.mode = "pinned"
                return
            if not self.policy:
                raise SwitchRefused("DDTREE: this server was launched without a policy (ddtree.policy)")
            self.mode = "policy"
            return
        budget = values.get("ddtree_budget", self.active.budget)
        topk = values.get("ddtree_topk", self.active.topk)
        graph = self.graphs.get(budget)
        if graph is not None and graph.cuda_graph == "dropped":
            raise SwitchRefused(
                f"DDTREE: budget {budget} was dropped from this server's runtime states after its verify "
                f"graph failed to capture ({graph.reason}); switchable budgets {list(self.budgets)}"
            )
        if graph is None:
            raise SwitchRefused(
                f"DDTREE: budget {budget} is not in this server's runtime states {list(self.budgets)}; "
                "relaunch with it in ddtree.budgets of --speculative-adaptive-config"
            )
        if not 1 <= topk <= self.topk_max:
            raise SwitchRefused(
                f"DDTREE: top-k {topk} is not in 1..{self.topk_max} (ddtree.topk_max of this server)"
            )
        self.active = TreeState(budget, topk)
        self.mode = "pinned"

    def as_json(self) -> dict[str, Any]:
        """``/server_info``'s ``internal_states[0]["ddtree"]``."""
        return {
            "mode": self.mode,
            "active": self.active.as_json(),
            "budgets": list(self.budgets),
            "topk_max": self.topk_max,
            "policy": {str(bs): s.as_json() for bs, s in self.policy} if self.policy else None,
            "states": [self.graphs[b].as_json() for b in sorted(self.graphs)],
            "state_memory": self.state_memory,
            "switches": self.switches,
            # Why the last switch request was refused (None after an accepted one).
            "last_refusal": self.last_refusal,
            # The tree trace, as the plugin describes it (ddtree_trace.TraceConfig.describe).
            "trace": self.trace.describe() if self.trace is not None else {"on": False},
        }


__all__ = [
    "AdaptiveConfig",
    "AdaptiveConfigError",
    "RuntimeStates",
    "StateGraph",
    "SwitchRefused",
    "TreeState",
    "load_adaptive_config",
    "parse_adaptive_config",
]
