"""The live board of a rollout shows each server's batch and the batch that runs."""

from __future__ import annotations

from rich.console import Console

from ddtree_ops.cli.service import _Live, server_batches
from ddtree_ops.inventory_types import Host
from ddtree_ops.rollout.executor import RolloutEvent
from ddtree_ops.rollout.plan import Serial, parse_canary, plan_rollout
from ddtree_ops.service.logphases import Phase, PhaseEvent


def _render(board: _Live) -> str:
    console = Console(record=True, width=120, color_system=None)
    console.print(board)
    return console.export_text()


def test_the_board_shows_batches_and_which_one_runs() -> None:
    hosts = [Host(name=n) for n in ("a", "b", "c")]
    plan = plan_rollout(["a", "b", "c"], serial=Serial.parse("1"), canary=parse_canary("b", ["a", "b", "c"]))
    board = _Live([h.name for h in hosts], server_batches(plan, hosts))
    board.on_batch(RolloutEvent(1, 3, ("b",), canary=True))
    board.on_phase(PhaseEvent("b", Phase.LOADING_WEIGHTS, 1.0, note="shard 2/4"))
    text = _render(board)
    assert "restart: batch 1/3 (canary)" in text
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]] for line in text.splitlines()
            if line.startswith("│")}
    assert rows["b"][0] == "1" and rows["a"] == ["2", "queued"] and rows["c"] == ["3", "queued"]
    board.on_batch(RolloutEvent(1, 3, ("b",), canary=True, done=True, failed=("b",)))
    assert "failed" in _render(board).split("│ b ")[1].splitlines()[0]
    # All at once (no rollout): no batch column.
    plain = _Live(["a"], server_batches(plan_rollout(["a"]), hosts[:1]))
    assert "batch" not in _render(plain)
