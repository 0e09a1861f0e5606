"""The rollout options every restarting command shares, and how a rollout is shown.

``restart``, ``deploy``, ``tune --deploy`` and ``rollback`` take the same ``--serial``,
``--max-fail``, ``--canary``, ``--rollback-on-failure`` and gate options (one help text
each, here); the plan and the gate come from :mod:`ddtree_ops.rollout`, and this module
renders its batch log, its summary (which hosts are on what) and the gate's figures, and
adds them to ``--json``.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.live import Live
from rich.text import Text

from ddtree_ops.cli.common import transport_for
from ddtree_ops.cli.main import AppContext
from ddtree_ops.errors import ConfigError, DdtreeOpsError, FleetError, Interrupted
from ddtree_ops.fleet import FleetResult
from ddtree_ops.inventory_types import Host
from ddtree_ops.limits import MAX_DDTREE_BUDGET, MAX_DFLASH_DRAFT_TOKENS
from ddtree_ops.rollout.executor import HostChange, RolloutEvent, RolloutResult, hosts_by_name, run_rollout
from ddtree_ops.rollout.gate import (
    DEFAULT_ACCEPT_FLOOR,
    DEFAULT_AGREEMENT,
    DEFAULT_MIN_SPEED,
    DEFAULT_TIE_EPSILON,
    SAMPLED_TEMPERATURE,
    Floor,
    GateSpec,
    ledger_floors,
)
from ddtree_ops.rollout.plan import RolloutPlan, Serial, parse_canary, plan_rollout
from ddtree_ops.service.launch import RunConfig

T = TypeVar("T")
B = TypeVar("B")

SERIAL = typer.Option(
    None, "--serial", metavar="N|P%",
    help="Roll the targets in batches of N hosts (or P% of them); the next batch starts once every host of the "
    "batch is ready. Default: every host at once.",
)
MAX_FAIL = typer.Option(
    0, "--max-fail", min=0, metavar="N",
    help="Stop the rollout after the batch in which more than N hosts failed (default 0: the first failure); "
    "hosts not reached keep their old patch, configuration and server.",
)
CANARY = typer.Option(
    None, "--canary", metavar="HOST|N",
    help="Roll this target (or the first N) first and gate the rest on it: the same greedy tokens as before the "
    "change (a changed one only at a near-tie of the server before it), decode speed, acceptance at or above a "
    "floor, no failed request; a canary that fails the gate, or fails before it, is put back and the rollout stops.",
)
ROLLBACK_ON_FAILURE = typer.Option(
    False, "--rollback-on-failure",
    help="Put back any host whose change fails (patch and launch configuration, its previous server relaunched).",
)
# The gate flags' ranges, refused outside them by the option parser before any host is
# touched (the acceptance floor's top depends on the tree: RolloutArgs.gate). A sampled
# temperature SGLang's OpenAI routes take (0, 2]: 0 is the gate's greedy half already. A tie
# epsilon of 1 nat forgives a token e times less likely than the baseline's choice: beyond
# that a changed token is the model's decision, not rounding. A canary 10x faster than before
# is more than any tree gives (the DDTree paper's best is 8.22x over AR): a higher minimum
# could never pass.
MAX_GATE_TEMPERATURE = 2.0
MAX_TIE_EPSILON = 1.0
MAX_MIN_SPEED = 10.0
GATE_AGREEMENT = typer.Option(
    DEFAULT_AGREEMENT, "--gate-agreement", min=0.0, max=1.0,
    help="Canary: the share of the greedy tokens before the change that must have been compared, each prompt up "
    "to its first divergence (a near-tie ends a prompt's comparison; any other divergence fails anyway).",
)
GATE_TIE_EPSILON = typer.Option(
    DEFAULT_TIE_EPSILON, "--gate-tie-epsilon", min=0.0, max=MAX_TIE_EPSILON, metavar="NATS",
    help="Canary: a changed greedy token passes only where the server before the change held it within this many "
    "nats of its own choice (its log-probabilities); default one bf16 step of a logit of 16-32. 0: none passes.",
)
GATE_MIN_SPEED = typer.Option(
    DEFAULT_MIN_SPEED, "--gate-min-speed", min=0.0, max=MAX_MIN_SPEED, metavar="FRACTION",
    help="Canary: decode tok/s after the change, over before, on the same greedy requests (median over the "
    "prompts), must be at least this. 0: speed not judged.",
)
GATE_FLOOR = typer.Option(
    None, "--gate-accept-floor", min=1.0,
    help=f"Canary: the acceptance-length floor at every temperature (default: 0.75 x the ledger's median for the "
    f"machine type and tree, else {DEFAULT_ACCEPT_FLOOR}); below the tree's largest (DDTREE budget + 1, DFLASH "
    f"draft tokens).",
)
GATE_TEMPERATURE = typer.Option(
    SAMPLED_TEMPERATURE, "--gate-temperature", min=0.01, max=MAX_GATE_TEMPERATURE,
    help="Canary: the sampled temperature the gate checks besides T = 0.",
)
GATE_LEDGER = typer.Option(
    None, "--gate-ledger",
    help="Canary: ledger file or folder whose measured acceptance sets the floor (repeatable; default: every "
    "*.jsonl under results/).",
)


# Each option's parameter name, its typer declaration and its type, in RolloutArgs' order.
_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("serial", SERIAL, str | None),
    ("max_fail", MAX_FAIL, int),
    ("canary", CANARY, str | None),
    ("rollback_on_failure", ROLLBACK_ON_FAILURE, bool),
    ("gate_agreement", GATE_AGREEMENT, float),
    ("gate_tie_epsilon", GATE_TIE_EPSILON, float),
    ("gate_min_speed", GATE_MIN_SPEED, float),
    ("gate_accept_floor", GATE_FLOOR, float | None),
    ("gate_temperature", GATE_TEMPERATURE, float),
    ("gate_ledger", GATE_LEDGER, list[Path] | None),
)
F = TypeVar("F", bound=Callable[..., None])


def rollout_options(*, gated: bool = True) -> Callable[[F], F]:
    """Give a command the rollout options (``gated=False``: only ``--serial`` and
    ``--max-fail``), handed to it as one ``rollout_args: RolloutArgs`` argument, so that every
    restarting command declares them once, here, with one help text each."""
    names = [o for o in _OPTIONS if gated or o[0] in ("serial", "max_fail")]

    def decorate(func: F) -> F:
        signature = inspect.signature(func, eval_str=True)
        kept = [p for p in signature.parameters.values() if p.name != "rollout_args"]
        extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
                 for name, option, kind in names]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            values = {name: kwargs.pop(name) for name, _, _ in names}
            values["gate_ledger"] = tuple(values.get("gate_ledger") or ())
            kwargs["rollout_args"] = RolloutArgs(**values)
            func(*args, **kwargs)

        wrapper.__signature__ = signature.replace(parameters=[*kept, *extra])  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in [*kept, *extra]}
        return wrapper  # type: ignore[return-value]

    return decorate


@dataclass(frozen=True)
class RolloutArgs:
    """The rollout options as one value (vLLM's sweep keeps its options in one dataclass)."""

    serial: str | None = None
    max_fail: int = 0
    canary: str | None = None
    rollback_on_failure: bool = False
    gate_agreement: float = DEFAULT_AGREEMENT
    gate_tie_epsilon: float = DEFAULT_TIE_EPSILON
    gate_min_speed: float = DEFAULT_MIN_SPEED
    gate_accept_floor: float | None = None
    gate_temperature: float = SAMPLED_TEMPERATURE
    gate_ledger: tuple[Path, ...] = ()

    def plan(self, targets: Sequence[str]) -> RolloutPlan:
        serial = Serial.parse(self.serial) if self.serial is not None else None
        return plan_rollout(targets, serial=serial, canary=parse_canary(self.canary, targets), max_fail=self.max_fail)

    def gate(self, plan: RolloutPlan, hosts: Sequence[Host], run: RunConfig) -> GateSpec | None:
        """The canary's gate (None without a canary): its floors from the options, else from
        the ledger's rows of the canary's machine type and tree. Every floor is below the
        largest acceptance the tree can reach: a gate that can never pass is refused here,
        before any host is touched."""
        if not plan.canary:
            self._refuse_gate_flags()
            return None
        temperatures = (0.0, self.gate_temperature)
        if self.gate_accept_floor is not None:
            floors = {t: Floor(self.gate_accept_floor, "--gate-accept-floor") for t in temperatures}
        else:
            floors = _ledger_floors(self.gate_ledger, [h for h in hosts if h.name in plan.canary], run, temperatures)
        _check_floors(floors, run, given=self.gate_accept_floor is not None)
        return GateSpec(agreement=self.gate_agreement, sampled_temperature=self.gate_temperature, floors=floors,
                        tie_epsilon=self.gate_tie_epsilon, min_speed=self.gate_min_speed)


    def _refuse_gate_flags(self) -> None:
        """Without a canary nothing is gated: a gate option given then is a mistake (the
        --canary forgotten), not a setting to ignore."""
        given = [name for name, value, default in (
            ("--gate-agreement", self.gate_agreement, DEFAULT_AGREEMENT),
            ("--gate-tie-epsilon", self.gate_tie_epsilon, DEFAULT_TIE_EPSILON),
            ("--gate-min-speed", self.gate_min_speed, DEFAULT_MIN_SPEED),
            ("--gate-accept-floor", self.gate_accept_floor, None),
            ("--gate-temperature", self.gate_temperature, SAMPLED_TEMPERATURE),
            ("--gate-ledger", self.gate_ledger, ()),
        ) if value != default]
        if given:
            raise ConfigError(f"{given[0]} sets the canary's gate: add --canary HOST (or --canary N)")


def max_acceptance(run: RunConfig) -> tuple[float, str] | None:
    """The largest acceptance length (tokens per verify round, the bonus token included) the
    tree ``run`` launches can reach, and why; None for AR, which does not speculate. A
    budget not given (a policy's, the drafter's block) is at most the servers' own bound."""
    if run.algorithm == "DDTREE":
        if run.budget is None:
            return MAX_DDTREE_BUDGET + 1.0, f"DDTREE: a budget of at most {MAX_DDTREE_BUDGET} nodes and the bonus token"
        return run.budget + 1.0, f"DDTREE budget {run.budget}: {run.budget} nodes and the bonus token"
    if run.algorithm == "DFLASH":
        tokens = run.budget or MAX_DFLASH_DRAFT_TOKENS
        return float(tokens), f"DFLASH {tokens} draft tokens" + ("" if run.budget else " at most")
    return None


def _check_floors(floors: dict[float, Floor], run: RunConfig, *, given: bool) -> None:
    """ConfigError for a floor no canary of ``run``'s tree can reach (``given``: the flag's)."""
    top = max_acceptance(run)
    if top is None:
        if given:
            raise ConfigError(f"--gate-accept-floor: the canary launches {run.algorithm}, which does not speculate: "
                              "there is no acceptance to judge")
        return
    limit, why = top
    for floor in floors.values():
        if floor.value < limit:
            continue
        if given:
            raise ConfigError(f"--gate-accept-floor {floor.value:g}: must be below {limit:g}, the largest acceptance "
                              f"length of the tree launched ({why})")
        raise ConfigError(f"--gate-ledger: the floor {floor.describe()} is not below {limit:g}, the largest "
                          f"acceptance length of the tree launched ({why}): those rows are not this tree's "
                          "measurements (give --gate-accept-floor, or the ledger of this tree)")


def _ledger_floors(
    ledgers: Sequence[Path], canary: Sequence[Host], run: RunConfig, temperatures: Sequence[float]
) -> dict[float, Floor]:
    """Floors from the ledgers' rows of the canary machine's type (the GPU its rows name)."""
    from ddtree_ops.bench.ledger import read_ledger
    from ddtree_ops.report.loading import find_ledgers

    try:
        files = find_ledgers(list(ledgers))
    except ConfigError as exc:
        raise ConfigError(f"--gate-ledger: {exc.message}") from exc
    rows = [row for path in files for row in read_ledger(path).rows]
    machines = {h.machine for h in canary}
    types = [r.get("gpu_name") for r in rows if r.get("host") in machines and r.get("status") == "ok"]
    machine_type = types[-1] if types else None
    return ledger_floors(rows, machine_type=machine_type if isinstance(machine_type, str) else None, run=run,
                         temperatures=temperatures)


def refuse_without_undo(args: RolloutArgs, command: str) -> None:
    """A change with no way back (``rollback`` is the way back) takes no canary and no
    rollback-on-failure."""
    if args.canary is not None:
        raise ConfigError(f"{command}: --canary gates a change that can be put back; a rollback is the way back "
                          f"(use --serial to roll it)")
    if args.rollback_on_failure:
        raise ConfigError(f"{command}: --rollback-on-failure has nothing to roll back to after a rollback")


def say_baseline_cost(obj: AppContext, canary: Sequence[Host]) -> None:
    """Dry run: where no server runs on the canary, the gate first launches the target
    alone for its baseline answers: one more model load, said with what it costs."""
    from ddtree_ops.service.lifecycle import service_status
    from ddtree_ops.state import StateStore

    state = StateStore()
    for host in canary:
        for server in host.slot_hosts():
            try:
                with transport_for(obj, server) as t:
                    serving = service_status(t, server, log_lines=0)
            except DdtreeOpsError as exc:
                obj.console.print(f"{server.name}: cannot tell whether a server runs ({exc.message})",
                                  markup=False, highlight=False, soft_wrap=True)
                continue
            if serving.running and serving.health == 200:
                continue
            learned = state.learned_load_s(server.name, server.ddtree.server.model_path or "")
            load = f"{learned:.0f} s (learned)" if learned else \
                f"{server.ddtree.server.expected_load_s:.0f} s (expected_load_s)"
            obj.console.print(
                f"{server.name}: no server answers there; the gate first launches the target alone (AR) for its "
                f"baseline answers: one more model load, about {load}", markup=False, highlight=False, soft_wrap=True)


def rollout_lines(plan: RolloutPlan, gate: GateSpec | None) -> list[str]:
    """What a dry run says of the rollout: its batches, the stop rule, the gate."""
    if not plan.rolling:
        return []
    out = plan.lines()
    out.append(f"stop after a batch with more than {plan.max_fail} failed host(s)")
    if gate is not None:
        out.append(f"canary gate: {gate.describe()}")
    return out


def run_with_rollout(
    obj: AppContext,
    hosts: Sequence[Host],
    change: HostChange[T, B],
    plan: RolloutPlan,
    *,
    gate: GateSpec | None,
    rollback_on_failure: bool,
    cancel: threading.Event,
    board: Any | None = None,
    max_parallel: int | None = None,
    observe: bool = True,
) -> RolloutResult[T]:
    """:func:`ddtree_ops.rollout.executor.run_rollout` with the live board on a terminal
    (``board.on_batch`` sees every batch), and the batch log on stderr without one."""
    on_event: Callable[[RolloutEvent], None] | None = getattr(board, "on_batch", None)
    live = Live(board, console=obj.console, refresh_per_second=4, transient=True) \
        if board is not None and not obj.json else nullcontext()
    with live:
        return run_rollout(
            plan, hosts_by_name(hosts), change, connect=lambda h: transport_for(obj, h), gate=gate,
            rollback_on_failure=rollback_on_failure, max_parallel=max_parallel or obj.max_parallel, cancel=cancel,
            on_event=on_event, observe=observe,
        )


def render_rollout(obj: AppContext, result: RolloutResult[Any]) -> None:
    """After the command's own table: each target as observed at the end, then (a rollout)
    the batches as they ran, the gate, who is on what."""
    if obj.json:
        return
    if result.observed:
        obj.console.print("observed at the end:", markup=False, highlight=False)
        for snapshot in result.observed.values():
            for line in snapshot.lines():
                obj.console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    if not (result.plan.rolling or result.rolled_back or result.refused):
        return
    for line in result.batch_log():
        obj.console.print(line, markup=False, highlight=False, soft_wrap=True)
    for server, note in result.baseline_notes.items():
        obj.console.print(f"{server}: {note}", markup=False, highlight=False, soft_wrap=True)
    for server, verdict in result.gates.items():
        style = "green" if verdict.passed else "bold red"
        obj.console.print(Text(f"{server}: {verdict.describe()}", style=style), soft_wrap=True)
    for line in result.summary():
        obj.console.print(line, markup=False, highlight=False, soft_wrap=True)


def gate_cell(result: RolloutResult[Any], host: str) -> str:
    """A table cell: the gate's figures for ``host``'s servers ('' where none was gated)."""
    verdicts = [v for name, v in result.gates.items() if name == host or name.split("/")[0] == host]
    cells = []
    for v in verdicts:
        accept = " ".join(f"T={t:g}:{'-' if a is None else f'{a:.2f}'}" for t, a in v.accept.items())
        ties = sum(d.tie for d in v.divergences)
        tied = f" ({ties} tie)" if ties else ""
        # Only a judged speed: a compressed simulator clock's ratio would read as a verdict.
        speed = f" speed {v.speed.ratio:.2f}x" if v.speed is not None and v.speed.judged and v.speed.ratio else ""
        cells.append(f"{'passed' if v.passed else 'FAILED'} agree {v.agreement:.3f}{tied}{speed} accept {accept}")
    return "; ".join(cells)


def rollout_json(result: RolloutResult[Any]) -> dict[str, Any]:
    """The ``--json`` document's ``rollout`` object."""
    return {
        "batches": [list(b) for b in result.plan.batches],
        "canary": list(result.plan.canary),
        "max_fail": result.plan.max_fail,
        "stopped": result.stopped,
        "not_reached": list(result.not_reached),
        "rolled_back": list(result.rolled_back),
        "gates": {name: verdict.as_dict() for name, verdict in result.gates.items()},
        "baseline": dict(result.baseline_notes),
        "refused": list(result.refused),
        "observed": {name: snapshot.as_dict() for name, snapshot in result.observed.items()},
        "summary": result.summary(),
    }


def raise_if_rollout_failed(
    what: str, result: RolloutResult[Any], *, cancel: threading.Event,
    failure: Callable[[Any], BaseException | None] | None = None,
) -> None:
    """The command's exit: 130 when interrupted; else, when some host failed (``failure``
    judges a returned value too, as :func:`ddtree_ops.cli.common.raise_if_failed`), its
    error's code (the hosts not reached are named too, and are not failures of their own)."""
    results: FleetResult[Any] = result.results
    if cancel.is_set():
        raise Interrupted("interrupted; each host's state is shown above", failures=results.failed)
    failures = results.failures(failure)
    if failures:
        total = len(results) + len(result.not_reached)
        unreached = f"; not reached: {', '.join(result.not_reached)}" if result.not_reached else ""
        raise FleetError(
            f"{what} failed on {len(failures)} of {total} host(s): {', '.join(failures)}{unreached}",
            result=results, failures=failures,
        )


__all__ = [
    "RolloutArgs",
    "gate_cell",
    "raise_if_rollout_failed",
    "refuse_without_undo",
    "render_rollout",
    "rollout_json",
    "rollout_lines",
    "rollout_options",
    "run_with_rollout",
    "say_baseline_cost",
]
