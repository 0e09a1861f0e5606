"""Fan-out: run one function on many hosts in parallel, and report every host's outcome.

Modelled on fabric's ``Group``: the answer is ``{host: result | exception}`` in inventory
order. One host failing never stops the others nor hides their results; deciding what a
failure means (and the exit code) is the caller's job — the CLI renders a per-host summary
and exits non-zero when any host failed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from ddtree_ops.errors import DdtreeOpsError
from ddtree_ops.inventory_types import Host

T = TypeVar("T")
HostResults = dict[str, "T | DdtreeOpsError | BaseException"]


def run_on_hosts(
    hosts: Sequence[Host],
    fn: Callable[[Host], T],
    *,
    max_parallel: int = 8,
) -> dict[str, T | DdtreeOpsError | BaseException]:
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
        return {}
    results: dict[str, T | DdtreeOpsError | BaseException] = {}
    with ThreadPoolExecutor(max_workers=min(max_parallel, len(hosts)), thread_name_prefix="host") as pool:
        futures: list[tuple[str, Future[T]]] = [(h.name, pool.submit(fn, h)) for h in hosts]
        try:
            for name, future in futures:
                try:
                    results[name] = future.result()
                except Exception as exc:  # noqa: BLE001 - a host's failure is data here
                    results[name] = exc
        except BaseException:
            for _, future in futures:
                future.cancel()
            raise
    return results


def failed_hosts(results: dict[str, object]) -> list[str]:
    """Names of the hosts whose value is an exception, in order."""
    return [name for name, value in results.items() if isinstance(value, BaseException)]
