"""Local state file and the pure readiness pieces (deadline policy, judge, wait loop)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from ddtree_ops.errors import ConfigError
from ddtree_ops.service.launch import LaunchSpec, RunConfig
from ddtree_ops.service.readiness import (
    DeadlinePolicy,
    LoadWindow,
    judge,
    served_cuda_graph,
    served_tree,
    tree_mismatch,
    wait_loop,
)
from ddtree_ops.state import FallbackKey, StateStore


def key(budget: int = 16) -> FallbackKey:
    return FallbackKey("b300", "sm_103", "0.5.23", "DDTREE", budget, 4)


def test_state_roundtrip_and_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDTREE_OPS_STATE", str(tmp_path / "s" / "state.json"))
    store = StateStore()
    assert store.path == tmp_path / "s" / "state.json"
    assert store.learned_load_s("h", "m") is None
    assert store.fallback_for(key()) is None
    store.record_load_time("h", "m", 12.5)
    store.record_fallback(key(), "capture failed")
    again = StateStore()
    assert again.learned_load_s("h", "m") == 12.5
    assert again.learned_restart_s("h", "m") is None  # a load alone: no whole restart yet
    again.record_load_time("h", "m", 12.5, restart_s=15.0)
    assert (StateStore().learned_load_s("h", "m"), StateStore().learned_restart_s("h", "m")) == (12.5, 15.0)
    assert again.fallback_for(key()).reason == "capture failed"  # type: ignore[union-attr]
    assert again.fallback_for(key(budget=8)) is None
    assert [r.key for r in again.fallbacks()] == [key()]
    assert again.clear_fallback(key()) is True
    assert again.fallback_for(key()) is None


def test_a_fallback_covers_its_budget_and_every_larger_one(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.json")
    store.record_fallback(key(9), "capture failed at 9")
    store.record_fallback(key(16), "capture failed at 16")
    assert store.fallback_for(key(8)) is None
    assert store.fallback_for(key(9)).reason == "capture failed at 9"  # type: ignore[union-attr]
    # The smallest covering record answers, whatever the order they were written in.
    assert store.fallback_for(key(32)).reason == "capture failed at 9"  # type: ignore[union-attr]
    other_topk = FallbackKey("b300", "sm_103", "0.5.23", "DDTREE", 32, 8)
    other_arch = FallbackKey("b300", "sm_120", "0.5.23", "DDTREE", 32, 4)
    assert store.fallback_for(other_topk) is None and store.fallback_for(other_arch) is None
    # Graphs that worked at 12 disprove the record at 9, not the one at 16.
    assert store.clear_fallback(key(12)) is True
    assert [r.key.budget for r in store.fallbacks()] == [16]
    assert store.fallback_for(key(12)) is None and store.fallback_for(key(16)) is not None
    assert store.clear_fallback(key(12)) is False
    # Budget-less keys (AR, DFLASH) match exactly.
    ar = FallbackKey("b300", "sm_103", "0.5.23", "AR", None, None)
    store.record_fallback(ar, "capture failed")
    assert store.fallback_for(ar) is not None and store.fallback_for(key(64)).key.budget == 16  # type: ignore[union-attr]


def test_state_parallel_updates_lose_nothing(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.json")
    threads = [threading.Thread(target=store.record_load_time, args=(f"h{i}", "m", float(i + 1))) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [store.learned_load_s(f"h{i}", "m") for i in range(24)] == [float(i + 1) for i in range(24)]


def test_corrupt_state_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=r"state\.json: state file is not valid JSON"):
        StateStore(path).learned_load_s("h", "m")


def test_deadline_policy() -> None:
    policy = DeadlinePolicy(factor=2.0, floor_s=60.0)
    assert policy.deadline(600.0, None) == (1200.0, "inventory")
    assert policy.deadline(600.0, 100.0) == (200.0, "learned")
    assert policy.deadline(5.0, None) == (60.0, "inventory")


def test_load_window_watches_from_the_deadline_and_gives_up_on_silence() -> None:
    policy = DeadlinePolicy()
    # Kimi K2.6 expected at 360 s: watched from 720 s, up to 2880 s; silent for 180 s fails.
    assert policy.window(360.0, None) == LoadWindow(720.0, "inventory", 180.0, 2880.0)
    # A small model: the floors (60 s deadline, 120 s of silence).
    assert policy.window(5.0, None) == LoadWindow(60.0, "inventory", 120.0, 240.0)
    assert policy.window(5.0, 30.0).source == "learned"
    # --timeout: a fixed deadline, never extended.
    fixed = LoadWindow.fixed(12.0)
    assert (fixed.deadline_s, fixed.source, fixed.stall_s, fixed.longest_s) == (12.0, "timeout", None, 12.0)
    assert policy.window(360.0, None).longest_s == 2880.0


def test_wait_loop_follows_progress_past_the_deadline_and_stops_at_silence_or_the_cap() -> None:
    clock = FakeClock()
    progress = [0.0]

    def loading(every: float | None) -> Callable[[float], tuple[str | None, str]]:
        def step(elapsed: float) -> tuple[str | None, str]:
            clock.t += 1.0
            if every is not None and clock.t % every == 0:
                progress[0] = clock.t  # a new log line
            return None, "loading"
        return step

    # A line every 2 s: past the 5 s deadline, up to the 20 s cap.
    out = wait_loop(loading(2), deadline_s=5.0, interval_s=0.0, clock=clock,
                    progressed_at=lambda: progress[0], stall_s=4.0, cap_s=20.0)
    assert (out.reason, out.elapsed_s) == ("timeout", 20.0)
    # Silent from the start: given up at the stall window, before the deadline.
    clock.t, progress[0] = 0.0, 0.0
    out = wait_loop(loading(None), deadline_s=50.0, interval_s=0.0, clock=clock,
                    progressed_at=lambda: progress[0], stall_s=4.0, cap_s=200.0)
    assert (out.reason, out.elapsed_s) == ("stalled", 4.0) and out.detail == "no progress for 4s; loading"
    # Lines every 3 s, then none after 9 s: stalls at 13 s, past the deadline but before the cap.
    clock.t, progress[0] = 0.0, 0.0

    def then_silent(elapsed: float) -> tuple[str | None, str]:
        clock.t += 1.0
        if clock.t % 3 == 0 and clock.t <= 9:
            progress[0] = clock.t
        return None, "capturing"

    out = wait_loop(then_silent, deadline_s=5.0, interval_s=0.0, clock=clock,
                    progressed_at=lambda: progress[0], stall_s=4.0, cap_s=200.0)
    assert (out.reason, out.elapsed_s) == ("stalled", 13.0)


SPEC = LaunchSpec(
    host="h", argv=("py", "-m", "sim", "--port", "1"), server_args=("--port", "1"), env={}, port=1,
    probe_host="127.0.0.1", cuda_graph=True, model="m", run=RunConfig(),
)


def poll(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "port_open": True, "health": 200, "listener_ours": True,
        "server_info": {"status": 200, "launch_command": "--port 1", "startup_time": 1000.0},
    }
    base.update(over)
    return base


@pytest.mark.parametrize(
    ("answer", "ok", "stale"),
    [
        (poll(), True, False),
        (poll(port_open=False, health=None), False, False),
        (poll(health=503), False, False),
        (poll(server_info={"status": 200, "launch_command": "--port 2", "startup_time": 1000.0}), False, True),
        (poll(listener_ours=False), False, True),
        (poll(listener_ours=None), True, False),  # no /proc: identity rests on launch_command + startup_time
        (poll(server_info={"status": 200, "launch_command": "--port 1", "startup_time": 10.0}), False, True),
        (
            poll(server_info={"status": 200, "launch_command": "--port 1", "startup_time": {"load_weight": 3.0}}),
            True,
            False,
        ),
        (poll(server_info=None), False, False),
    ],
)
def test_judge_never_trusts_a_bare_200(answer: dict[str, object], ok: bool, stale: bool) -> None:
    verdict = judge(answer, SPEC, started_at=999.0)
    assert (verdict.ok, verdict.stale) == (ok, stale)


DDTREE_SPEC = replace(SPEC, run=RunConfig("DDTREE", budget=16, topk=4))


@pytest.mark.parametrize(
    ("fields", "ok"),
    [
        ({}, True),  # a server that does not report its tree: identity is enough
        ({"ddtree": {"budget": 16, "topk": 4, "verify_width": 17}}, True),
        ({"ddtree": {"budget": 8, "topk": 4}}, False),
        ({"ddtree": {"budget": 16, "topk": 2}}, False),
        # Without the plugin's object: SGLang's generic fields, budget = N - 1.
        ({"speculative_algorithm": "DDTREE", "speculative_num_draft_tokens": 17, "speculative_eagle_topk": 4}, True),
        ({"speculative_algorithm": "DDTREE", "speculative_num_draft_tokens": 16, "speculative_eagle_topk": 4}, False),
        # A pre-plugin bundle overrides the generic fields; its own fields say what it serves.
        ({"speculative_algorithm": "DDTREE", "speculative_num_draft_tokens": 17,
          "speculative_ddtree_budget": 16, "speculative_ddtree_topk": 4}, True),
        ({"speculative_algorithm": "DDTREE", "speculative_num_draft_tokens": 9,
          "speculative_ddtree_budget": 16, "speculative_ddtree_topk": 4}, True),
        ({"speculative_algorithm": "DDTREE", "speculative_num_draft_tokens": 17,
          "speculative_ddtree_budget": 8, "speculative_ddtree_topk": 4}, False),
        ({"ddtree": "garbage"}, True),  # odd input never raises
    ],
)
def test_judge_checks_the_ddtree_tree_the_server_resolved(fields: dict[str, object], ok: bool) -> None:
    info = {"status": 200, "launch_command": "--port 1", "startup_time": 1000.0, **fields}
    verdict = judge(poll(server_info=info), DDTREE_SPEC, started_at=999.0)
    assert (verdict.ok, verdict.misconfigured, verdict.stale) == (ok, not ok, False)
    if not ok:
        assert "not the budget=16 topk=4 we launched" in verdict.detail


def test_served_tree_prefers_the_ddtree_object() -> None:
    info = {"ddtree": {"budget": 16, "topk": 4}, "speculative_algorithm": "DDTREE",
            "speculative_num_draft_tokens": 99, "speculative_eagle_topk": 1}
    assert served_tree(info) == (16, 4)
    assert served_tree({"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": 16}) is None
    # Other algorithms are never checked against a tree.
    assert tree_mismatch({"ddtree": {"budget": 1, "topk": 1}}, SPEC) is None


class FakeClock:
    """Deterministic clock: each call to step advances time by one second."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_wait_loop_deadline_threshold_and_cancel() -> None:
    clock = FakeClock()

    def slow(elapsed: float) -> tuple[str | None, str]:
        clock.t += 1.0
        return None, "still loading"

    out = wait_loop(slow, deadline_s=5.0, interval_s=0.0, clock=clock)
    assert (out.reason, out.detail, out.polls) == ("timeout", "still loading", 5)

    answers = iter(["unreachable", None, "unreachable", "unreachable", "unreachable"])
    out = wait_loop(lambda e: (next(answers), "x"), deadline_s=100.0, interval_s=0.0, failure_threshold=3)
    assert (out.reason, out.polls) == ("unreachable", 5)  # the success in between resets the count

    cancel = threading.Event()
    cancel.set()
    out = wait_loop(slow, deadline_s=100.0, interval_s=0.0, cancel=cancel)
    assert (out.reason, out.polls) == ("cancelled", 0)


@pytest.mark.parametrize(
    "info, expected",
    [
        # The DDTree plugin's own word wins: it knows whether its verify graph was captured.
        (
            {"ddtree": {"verify_cuda_graph_captured": False}, "cuda_graph_config": {"decode": {"backend": "full"}}},
            False,
        ),
        ({"ddtree": {"verify_cuda_graph_captured": True}}, True),
        # SGLang 0.5.23's resolved config: on CPU it disables decode graphs by itself.
        ({"cuda_graph_config": {"decode": {"backend": "disabled"}}, "cuda_graph_backend_decode": None}, False),
        ({"cuda_graph_config": {"decode": {"backend": "full"}}}, True),
        # The raw flag is not the resolution; odd shapes say nothing.
        ({"cuda_graph_backend_decode": "disabled"}, None),
        ({"ddtree": {"verify_cuda_graph_captured": "no"}}, None),
        ({"cuda_graph_config": {"decode": "disabled"}}, None),
        ({"cuda_graph_config": None}, None),
        ({}, None),
    ],
)
def test_served_cuda_graph_reads_what_the_server_resolved(info: dict, expected: bool | None) -> None:
    assert served_cuda_graph(info) is expected
