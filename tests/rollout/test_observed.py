"""The closing observation and the checks before the first change (pure: no host).

* :func:`ddtree_ops.service.observed.mismatch`: a server counts as serving a launch only
  when it runs, answers on its own socket, passed its smoke, and its flags, launch record
  (argv and environment), tree and tuned policy are that launch's;
* :func:`ddtree_ops.rollout.executor.run_rollout`: every target's check runs before batch
  1, and a refusal stops the rollout with nothing applied; every target is observed at
  the end, and a host the change reported done but observed otherwise fails with the
  change's own error (its exit code).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest

from ddtree_ops.errors import ConfigError, DdtreeOpsError, ServiceError
from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.rollout.executor import HostChange, run_rollout
from ddtree_ops.rollout.observe import BundleView, HostSnapshot
from ddtree_ops.rollout.plan import Serial, plan_rollout
from ddtree_ops.service.launch import RunConfig, build_launch_spec
from ddtree_ops.service.observed import OBSERVE_SMOKE, ServerView, mismatch, view_of
from ddtree_ops.service.smoke import judge_smoke
from ddtree_ops.transport.base import Transport


def _host(name: str = "h1", env: Mapping[str, str] | None = None) -> Host:
    server = ServerSettings(model_path="m", draft_model_path="d", port=30000, env=dict(env or {}))
    return Host(name=name, connection="local", ddtree=DdtreeSettings(python="/usr/bin/python3", server=server),
                source="<test>")


RUN = RunConfig("DDTREE", budget=8, topk=2)
SPEC = build_launch_spec(_host(), RUN, "0.5.23", cuda_graph=True)


def _status(*, alive: bool = True, health: object = 200, launch_command: str | None = SPEC.launch_command,
            argv_hash: str | None = SPEC.argv_hash, ddtree: Mapping[str, Any] | None = None,
            listener_ours: bool = True, internal: list[Any] | None = None) -> dict[str, Any]:
    info = {"status": 200, "launch_command": launch_command, "speculative_algorithm": "DDTREE",
            "ddtree": dict(ddtree or {"budget": 8, "topk": 2}), "internal_states": internal or []}
    return {"alive": alive, "record": {"pid": 42, "argv_hash": argv_hash, "run": RUN.describe()}, "pid": 42,
            "port_open": True, "listener_ours": listener_ours, "health": health,
            "server_info": info if health == 200 else None}


def _smoke(ok: bool) -> Any:
    results = [{"round": 0, "status": 200, "completion_tokens": 16, "spec_verify_ct": 6 if ok else 0}]
    return judge_smoke({"results": results, "alive": True, "seconds": 0.1}, OBSERVE_SMOKE, speculative=True)


def _view(**kw: Any) -> ServerView:
    smoke = kw.pop("smoke", True)
    return view_of(_host(), "process", _status(**kw), _smoke(smoke))


def test_a_ready_server_of_exactly_the_launch_matches() -> None:
    view = _view()
    assert view.ready and mismatch(view, SPEC) is None
    assert view.describe() == "DDTREE budget=8 topk=2, pid 42, ready"


@pytest.mark.parametrize(("kw", "why"), [
    ({"alive": False}, "no server runs"),
    ({"health": 503}, "does not answer (health 503)"),
    ({"listener_ours": False}, "the port answers from another process"),
    ({"smoke": False}, "its smoke failed: no verify round ran"),
    ({"launch_command": SPEC.launch_command.replace("9", "5")}, "with other flags"),
    # Same flags, another environment (a token changed in the inventory's env): relaunched.
    ({"argv_hash": "0" * 16}, "another launcher or environment"),
    ({"ddtree": {"budget": 16, "topk": 4}}, "resolved DDTREE budget=16 topk=4"),
])
def test_anything_else_is_not_serving_it(kw: dict[str, Any], why: str) -> None:
    problem = mismatch(_view(**kw), SPEC)
    assert problem is not None and why in problem


def test_the_environment_is_part_of_the_launch() -> None:
    other = build_launch_spec(_host(env={"HF_TOKEN": "x"}), RUN, "0.5.23", cuda_graph=True)
    assert other.launch_command == SPEC.launch_command and other.argv_hash != SPEC.argv_hash
    assert "environment" in (mismatch(_view(), other) or "")


def test_a_tuned_policy_must_be_the_one_the_server_follows() -> None:
    policy = {"1": {"budget": 8, "topk": 2}, "8": {"budget": 4, "topk": 2}}
    following = [{"ddtree": {"mode": "policy", "policy": policy}}]
    assert mismatch(_view(internal=following), SPEC, policy=policy) is None
    pinned = [{"ddtree": {"mode": "pinned", "policy": policy}}]
    assert "not 'policy'" in (mismatch(_view(internal=pinned), SPEC, policy=policy) or "")


def test_an_operators_unit_is_not_our_launch() -> None:
    data = _status() | {"unit": {"ActiveState": "active", "SubState": "running", "MainPID": "42"},
                        "dropin_in_effect": False}
    view = view_of(_host(), "systemd", data, _smoke(True))
    assert view.operator and view.record_hash is None
    assert "its operator's own ExecStart" in (mismatch(view, SPEC) or "")


# -- the executor: checks before batch 1, the closing observation -------------------------


class _Change(HostChange[str, None]):
    """A change whose check refuses ``refuse``, and whose observation contradicts its own
    report on ``contradict``."""

    def __init__(self, *, refuse: set[str] = frozenset(), contradict: set[str] = frozenset()) -> None:
        self.run = RunConfig("AR")
        self.refuse, self.contradict = refuse, contradict
        self.applied: list[str] = []
        self.checked: list[str] = []
        self._lock = threading.Lock()

    def check(self, transport: Transport, host: Host) -> None:
        with self._lock:
            self.checked.append(host.name)
        if host.name in self.refuse:
            raise ConfigError("refused by its check", host=host.name)

    def remember(self, transport: Transport, host: Host) -> None:
        return None

    def apply(self, transport: Transport, host: Host, cancel: threading.Event) -> str:
        with self._lock:
            assert set(self.checked) == {"a", "b", "c"}, "a change before every target was checked"
            self.applied.append(host.name)
        return "done"

    def undo(self, transport: Transport, host: Host, before: None) -> str:
        return "nothing"

    def observe(self, transport: Transport, host: Host) -> HostSnapshot:
        bundle = BundleView("b", "1", "id", {"patched": 1}, True, False)
        return HostSnapshot(host.name, bundle, (), None if host.name not in self.contradict else "gone")

    def verify(self, host: Host, snapshot: HostSnapshot, value: str) -> DdtreeOpsError | None:
        if snapshot.error is not None:
            return ServiceError(f"observed: {snapshot.error}", host=host.name)
        return None

    def gate_error(self, message: str, host: str) -> DdtreeOpsError:
        return ServiceError(message, host=host)


@contextmanager
def _connect(host: Host) -> Iterator[Any]:
    yield None


HOSTS = {n: _host(n) for n in ("a", "b", "c")}


def test_every_target_is_checked_before_the_first_change_and_a_refusal_changes_nothing() -> None:
    change = _Change(refuse={"c"})
    result = run_rollout(plan_rollout(["a", "b", "c"], serial=Serial(size=1)), HOSTS, change, connect=_connect)
    assert change.applied == []
    assert result.refused == ("c",) and result.not_reached == ("a", "b")
    assert isinstance(result.results["c"], ConfigError)
    assert result.stopped is not None and "refused before any change" in result.stopped
    assert result.summary()[0] == "refused before any change (c): no host was changed"
    # Every target is still observed and shown.
    assert set(result.observed) == {"a", "b", "c"}


def test_max_fail_lets_a_refused_host_out_and_the_others_go_on() -> None:
    change = _Change(refuse={"c"})
    result = run_rollout(plan_rollout(["a", "b", "c"], max_fail=1), HOSTS, change, connect=_connect)
    assert sorted(change.applied) == ["a", "b"] and result.refused == ()
    assert list(result.results.succeeded) == ["a", "b"] and list(result.results.failed) == ["c"]


def test_a_refused_canary_stops_the_rollout_whatever_max_fail_allows() -> None:
    change = _Change(refuse={"a"})
    plan = plan_rollout(["a", "b", "c"], canary=("a",), max_fail=2)
    result = run_rollout(plan, HOSTS, change, connect=_connect)
    assert change.applied == [] and result.refused == ("a",)


def test_a_host_observed_otherwise_than_reported_fails_with_the_changes_error() -> None:
    change = _Change(contradict={"b"})
    result = run_rollout(plan_rollout(["a", "b", "c"]), HOSTS, change, connect=_connect)
    assert sorted(change.applied) == ["a", "b", "c"]
    assert list(result.results.succeeded) == ["a", "c"]
    error = result.results["b"]
    assert isinstance(error, ServiceError) and error.message == "observed: gone"
    assert result.summary()[0].endswith(": a, c")


def test_no_observation_for_a_dry_run() -> None:
    result = run_rollout(plan_rollout(["a", "b", "c"]), HOSTS, _Change(), connect=_connect, observe=False)
    assert result.observed == {} and list(result.results.succeeded) == ["a", "b", "c"]
