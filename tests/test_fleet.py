"""run_on_hosts: every host answered, in order, failures kept as values, bounded parallelism."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from ddtree_ops.errors import ConnectError, DdtreeOpsError, Interrupted
from ddtree_ops.fleet import FleetResult, failed_hosts, run_interruptible, run_on_hosts, start_watched
from ddtree_ops.inventory_types import Host
from ddtree_ops.transport.local import LocalTransport

HOSTS = [Host(f"h{i}", address=f"10.0.0.{i}") for i in range(7)]


def test_results_in_host_order_with_failures_as_values() -> None:
    def fn(h: Host) -> str:
        if h.name == "h2":
            raise ConnectError("connection refused", host=h.name)
        if h.name == "h5":
            raise RuntimeError("a bug")
        time.sleep(0.01 * (7 - int(h.name[1:])))  # later hosts finish first
        return h.name.upper()

    results = run_on_hosts(HOSTS, fn, max_parallel=4)
    assert list(results) == [h.name for h in HOSTS]
    assert results["h0"] == "H0" and results["h6"] == "H6"
    assert isinstance(results["h2"], ConnectError) and str(results["h2"]) == "h2: connection refused"
    assert isinstance(results["h5"], RuntimeError)
    assert failed_hosts(results) == ["h2", "h5"]
    assert list(results.failed) == ["h2", "h5"] and not results.ok
    assert list(results.succeeded) == ["h0", "h1", "h3", "h4", "h6"] and results.succeeded["h3"] == "H3"


@pytest.mark.parametrize("limit", [1, 3, 8])
def test_never_more_than_max_parallel_at_once(limit: int) -> None:
    cond = threading.Condition()
    active = 0
    peak = 0
    target = min(limit, len(HOSTS))

    def fn(h: Host) -> None:
        nonlocal active, peak
        with cond:
            active += 1
            peak = max(peak, active)
            cond.notify_all()
            # Until as many run at once as the pool should allow, however late a loaded
            # machine starts its workers (a fixed 20 ms gave a peak of 6 of 7 once) ...
            cond.wait_for(lambda: peak >= target, timeout=60)
        # ... then a while longer, so that a pool that let more run at once would show it.
        time.sleep(0.2)
        with cond:
            active -= 1

    run_on_hosts(HOSTS, fn, max_parallel=limit)
    assert peak <= limit
    assert peak == min(limit, len(HOSTS)) or limit == 1


class _CtrlCWhileSubmitting(Sequence[Host]):
    """Hosts whose walk for the submissions raises KeyboardInterrupt right after the first
    host, once that host's command runs: a Ctrl-C that lands while the fan-out is still
    submitting (on a loaded machine, after every host's program had started: CI hung there
    for the command's whole length). run_on_hosts walks the hosts once for their names,
    then once to submit them."""

    def __init__(self, hosts: list[Host], running: threading.Event) -> None:
        self._hosts, self._running, self._walks = hosts, running, 0

    def __len__(self) -> int:
        return len(self._hosts)

    def __getitem__(self, i: int) -> Host:  # type: ignore[override]
        return self._hosts[i]

    def __iter__(self) -> Iterator[Host]:
        self._walks += 1
        yield self._hosts[0]
        if self._walks > 1 and self._running.wait(timeout=60):
            raise KeyboardInterrupt
        yield from self._hosts[1:]


def test_ctrl_c_before_the_last_submission_ends_the_commands_already_running() -> None:
    running = threading.Event()
    outcomes: dict[str, str] = {}

    def fn(h: Host) -> None:
        try:
            LocalTransport(h.name).run(["sh", "-c", "echo started; exec sleep 60"], on_line=lambda _: running.set())
            outcomes[h.name] = "ran to its end"
        except Interrupted:
            outcomes[h.name] = "ended"

    with pytest.raises(KeyboardInterrupt):
        run_on_hosts(_CtrlCWhileSubmitting(HOSTS[:3], running), fn, max_parallel=3)
    assert running.is_set()
    # The first host's command was ended, not waited for; the others were never submitted.
    assert outcomes == {"h0": "ended"}


def _ctrl_c_in_start(monkeypatch: pytest.MonkeyPatch, *, comes_up: bool) -> None:
    """The main thread's next Thread.start() raises KeyboardInterrupt as a Ctrl-C does that
    lands in start()'s wait for the new thread (``comes_up``: after the thread is made), or
    before it is made (not ``comes_up``). A signal cannot be aimed at that wait from a test;
    the exception start() would raise there can."""
    real_start = threading.Thread.start
    main, fired = threading.current_thread(), []

    def start(self: threading.Thread) -> None:
        if threading.current_thread() is main and not fired:
            fired.append(self)
            if comes_up:
                real_start(self)
            raise KeyboardInterrupt
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)


def test_a_ctrl_c_while_the_fan_out_thread_starts_stops_every_host_between_its_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """run_interruptible: the Ctrl-C is taken as one in its watch loop (cancel set, every
    host reports how it was left), not raised past it while its thread changes every host."""
    cancel = threading.Event()
    _ctrl_c_in_start(monkeypatch, comes_up=True)
    results = run_interruptible(HOSTS[:3], lambda h: "stopped" if cancel.wait(60) else "ran on", max_parallel=3,
                                cancel=cancel)
    assert cancel.is_set() and dict(results) == {"h0": "stopped", "h1": "stopped", "h2": "stopped"}


def test_a_ctrl_c_before_the_thread_is_made_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = threading.Event()
    _ctrl_c_in_start(monkeypatch, comes_up=False)
    with pytest.raises(KeyboardInterrupt):
        start_watched(threading.Thread(target=ran.set), up_s=0.2)
    assert not ran.is_set()
    assert start_watched(thread := threading.Thread(target=ran.set)) is False  # no Ctrl-C: False
    thread.join()
    assert ran.is_set()


def test_empty_and_invalid() -> None:
    assert run_on_hosts([], lambda h: 1) == {}
    with pytest.raises(ValueError):
        run_on_hosts(HOSTS, lambda h: 1, max_parallel=0)
    with pytest.raises(ValueError, match="duplicate"):
        run_on_hosts([HOSTS[0], HOSTS[0]], lambda h: 1)


def test_fleet_result_views() -> None:
    err = ConnectError("refused", host="b")
    result: FleetResult[int] = FleetResult({"a": 1, "b": err, "c": 3})
    assert dict(result) == {"a": 1, "b": err, "c": 3} and result == {"a": 1, "b": err, "c": 3}
    assert dict(result.succeeded) == {"a": 1, "c": 3} and dict(result.failed) == {"b": err} and not result.ok
    assert FleetResult({"a": 1}).ok and FleetResult().ok and len(FleetResult()) == 0
    # A value that carries its own failure counts when a judge says so, in host order.
    own = DdtreeOpsError("no GPU", host="c")
    assert list(result.failures(lambda v: own if v == 3 else None).items()) == [("b", err), ("c", own)]
    doubled = result.map(lambda v: v * 2)
    assert isinstance(doubled, FleetResult) and dict(doubled) == {"a": 2, "b": err, "c": 6}
    with pytest.raises(TypeError):
        result["a"] = 2  # type: ignore[index]
