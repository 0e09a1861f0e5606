"""Fan-out: run one function on many hosts in parallel, and report every host's outcome.

Modelled on fabric's ``Group``: the answer is a :class:`FleetResult`, a read-only
``{host: result | exception}`` mapping in inventory order with ``.succeeded`` /
``.failed`` views (fabric's ``GroupResult``). One host failing never stops the others
nor hides their results; deciding what a failure means (and the exit code) is the
caller's job — the CLI renders a per-host summary and raises
:class:`~ddtree_ops.errors.FleetError` (carrying this result) when any host failed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import MappingProxyType
from typing import TypeVar

from ddtree_ops.inventory_types import Host
from ddtree_ops.transport.base import interrupting

T = TypeVar("T")
U = TypeVar("U")


class FleetResult(Mapping[str, T | BaseException]):
    """Every host's value, or the exception its function raised, in host order.

    Read-only: ``result[name]``, iteration and ``len`` work as on the plain dict it
    replaces, and the views say which hosts succeeded and which failed, so no caller
    re-checks ``isinstance(value, BaseException)``.
    """

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, T | BaseException] | None = None) -> None:
        self._values: dict[str, T | BaseException] = dict(values or {})

    def __getitem__(self, host: str) -> T | BaseException:
        return self._values[host]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"FleetResult({self._values!r})"

    @property
    def succeeded(self) -> Mapping[str, T]:
        """Hosts whose function returned, with their values."""
        return MappingProxyType({n: v for n, v in self._values.items() if not isinstance(v, BaseException)})

    @property
    def failed(self) -> Mapping[str, BaseException]:
        """Hosts whose function raised, with the exception."""
        return MappingProxyType({n: v for n, v in self._values.items() if isinstance(v, BaseException)})

    @property
    def ok(self) -> bool:
        """True when no host raised."""
        return not any(isinstance(v, BaseException) for v in self._values.values())

    def failures(self, judge: Callable[[T], BaseException | None] | None = None) -> Mapping[str, BaseException]:
        """The failed hosts, plus those whose value carries its own failure: ``judge(value)``
        returns the error for such a value (e.g. doctor's facts of an unreachable host)."""
        out: dict[str, BaseException] = {}
        for name, value in self._values.items():
            if isinstance(value, BaseException):
                out[name] = value
            elif judge is not None and (err := judge(value)) is not None:
                out[name] = err
        return MappingProxyType(out)

    def map(self, fn: Callable[[T], U]) -> FleetResult[U]:
        """``fn`` applied to every successful value; failures kept as they are."""
        return FleetResult({n: v if isinstance(v, BaseException) else fn(v) for n, v in self._values.items()})


def run_on_hosts(
    hosts: Sequence[Host],
    fn: Callable[[Host], T],
    *,
    max_parallel: int = 8,
) -> FleetResult[T]:
    """``fn(host)`` for every host, at most ``max_parallel`` at once.

    Exceptions raised by ``fn`` become that host's value (ours are DdtreeOpsError; anything
    else is kept as is, so that a bug shows up as a bug rather than as a host problem).
    Ctrl-C cancels the hosts not started yet and propagates.
    """
    if max_parallel < 1:
        raise ValueError("max_parallel must be at least 1")
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise ValueError("duplicate host names in fan-out")
    if not hosts:
        return FleetResult()
    results: dict[str, T | BaseException] = {}
    pool = ThreadPoolExecutor(max_workers=min(max_parallel, len(hosts)), thread_name_prefix="host")
    # The submissions are inside the try: a worker starts its host's command as soon as it
    # is submitted, and a Ctrl-C that lands before the last submission (on a loaded
    # machine, after every host's program has started) must end those commands too. Left
    # to the pool's own exit, it waited for each to finish by itself.
    futures: list[tuple[str, Future[T]]] = []
    try:
        for h in hosts:
            futures.append((h.name, pool.submit(fn, h)))
        for name, future in futures:
            try:
                results[name] = future.result()
            except Exception as exc:  # noqa: BLE001 - a host's failure is data here
                results[name] = exc
    except BaseException:
        # The running workers wait on commands the Ctrl-C never reached: end them rather
        # than wait for each to finish by itself; the queued ones never start.
        with interrupting():
            pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return FleetResult(results)


def run_interruptible(
    hosts: Sequence[Host], fn: Callable[[Host], T], *, max_parallel: int, cancel: threading.Event
) -> FleetResult[T]:
    """:func:`run_on_hosts` in a worker thread, so that Ctrl-C reaches the caller's thread:
    there it sets ``cancel`` (which ``fn`` looks at between its steps) and waits for every
    host to report how it was left. A pool's running workers cannot be stopped from
    outside; without this they would carry on to their last step after Ctrl-C."""
    box: dict[str, FleetResult[T]] = {}
    done = threading.Event()

    def work() -> None:
        try:
            box["r"] = run_on_hosts(hosts, fn, max_parallel=max_parallel)
        finally:
            done.set()

    # An Event rather than Thread.join: a join interrupted by Ctrl-C can leave the thread
    # looking finished while it still runs (CPython issue 90882).
    if start_watched(threading.Thread(target=work, daemon=True)):
        cancel.set()
    while not done.is_set():
        try:
            done.wait(0.2)
        except KeyboardInterrupt:
            cancel.set()
    return box["r"]


def start_watched(thread: threading.Thread, *, up_s: float = 10.0) -> bool:
    """``thread.start()`` for a thread the main thread then watches for Ctrl-C: True when a
    Ctrl-C landed during the start and the thread runs all the same (the caller handles it
    as one that lands in its watch loop: the thread stops between its steps).

    start() waits for the new thread to come up, and on a loaded machine that wait is most
    of it: a KeyboardInterrupt raised there left the caller before its watch loop, while the
    thread went on to change every host. One that lands before the thread is made (a few
    bytecodes) leaves nothing running: it is raised, once the thread has not come up within
    ``up_s``."""
    try:
        thread.start()
    except KeyboardInterrupt:
        deadline = time.monotonic() + up_s
        while thread.ident is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if thread.ident is None:
            raise
        return True
    return False


def failed_hosts(results: Mapping[str, object]) -> list[str]:
    """Names of the hosts whose value is an exception, in order."""
    return list(FleetResult(results).failed)
