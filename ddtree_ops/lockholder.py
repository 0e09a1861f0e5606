"""Who holds a host lock, and whether that holder is provably dead.

Both host locks (the patch engine's deploy lock and the service's restart lock) record
their holder with :func:`holder_record`: the controller's hostname, its pid and that
pid's kernel start time, the boot id and pid namespace the pid belongs to, the user and
the time. A lock whose holder is provably dead is taken over at once instead of
blocking the host until it expires; anything less than proof keeps it blocking.

"Provably dead" can only be decided on the holder's own machine, and only by its
process table: the holder ran on this controller (same hostname, and where recorded the
same boot and pid namespace, so a twin hostname or a container sharing the name is not
mistaken for us) and its pid is gone, a zombie, or now belongs to a process with another
start time (pid reuse). A holder that is this very process is dead only when the run
that took the lock has ended (:func:`active_run`). A holder on another machine is never
provably dead from here.
"""

from __future__ import annotations

import getpass
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

_ACTIVE: set[str] = set()
_ACTIVE_LOCK = threading.Lock()


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (which may contain spaces)."""
    data = _read(f"/proc/{pid}/stat")
    if data is None:
        return None
    return data[data.rindex(")") + 2 :].split()


def process_start(pid: int) -> int | None:
    """Kernel start time of ``pid`` (clock ticks since boot); with the boot id it names one process."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) <= 19:
        return None
    return int(fields[19])


def boot_id() -> str | None:
    data = _read("/proc/sys/kernel/random/boot_id")
    return data.strip() if data else None


def pid_namespace() -> str | None:
    """The pid namespace (``pid:[inode]``): two containers may share a hostname and a kernel."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return str(os.getuid())


def controller_identity() -> dict[str, Any]:
    """This process as a lock holder: enough to prove later, on this machine, that it is gone."""
    return {
        "controller": socket.gethostname(),
        "pid": os.getpid(),
        "pstart": process_start(os.getpid()),
        "boot_id": boot_id(),
        "pidns": pid_namespace(),
        "user": _user(),
    }


def holder_record(run_id: str, command: str) -> dict[str, Any]:
    """The identity plus the run that takes the lock, what it is doing and since when."""
    return controller_identity() | {"run": run_id, "command": command, "started": time.time()}


def run_started(run_id: str) -> None:
    """Mark ``run_id`` as running in this process, so its lock is not mistaken for an abandoned one."""
    with _ACTIVE_LOCK:
        _ACTIVE.add(run_id)


def run_ended(run_id: str) -> None:
    with _ACTIVE_LOCK:
        _ACTIVE.discard(run_id)


@contextmanager
def active_run(run_id: str) -> Iterator[None]:
    """:func:`run_started` for the body, :func:`run_ended` after it, however it ends."""
    run_started(run_id)
    try:
        yield
    finally:
        run_ended(run_id)


def run_active(run_id: object) -> bool:
    with _ACTIVE_LOCK:
        return run_id in _ACTIVE


def process_alive(pid: int, pstart: int | None) -> bool:
    """Whether ``pid`` still runs as the process that started at ``pstart`` (None: any start time).

    Errs towards "alive" whenever the process table cannot be read. The host-side
    programs (the service agent, the patch engine's remote) keep their own copies of
    this check because they run alone on the host with its interpreter.
    """
    fields = _stat_fields(pid)
    if fields is None:
        if os.path.isdir("/proc/self"):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if fields[0] in ("Z", "X"):
        return False  # killed and not yet reaped: it can no longer do anything
    if pstart is not None and len(fields) > 19 and int(fields[19]) != pstart:
        return False  # the pid was reused by another process
    return True


def _uncheckable(holder: Mapping[str, Any]) -> str | None:
    """Why this machine cannot judge ``holder``'s process, or None when it can."""
    if holder.get("controller") != socket.gethostname():
        return "on another machine, so whether it still runs cannot be checked from here"
    for key, mine in (("boot_id", boot_id()), ("pidns", pid_namespace())):
        theirs = holder.get(key)
        if theirs is not None and theirs != mine:
            return "under another boot or container with this hostname, so it cannot be checked from here"
    pid = holder.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return "recorded without a pid, so it cannot be checked"
    return None


def holder_is_dead(holder: Mapping[str, Any], *, run_id: object = None) -> bool:
    """True only when ``holder`` (a :func:`holder_record`) provably no longer runs.

    ``run_id`` names the holder's run, used when the holder is this very process. Fields
    missing from an older record (boot id, pid namespace, start time) are not held
    against it; the hostname and pid are required.
    """
    if _uncheckable(holder) is not None:
        return False
    pid = int(holder["pid"])
    pstart = holder.get("pstart")
    pstart = pstart if isinstance(pstart, int) and not isinstance(pstart, bool) else None
    if pid == os.getpid() and (pstart is None or pstart == process_start(pid)):
        return run_id is not None and not run_active(run_id)
    return not process_alive(pid, pstart)


def holder_state(holder: Mapping[str, Any]) -> str:
    """Why a holder that is not provably dead still counts, in words for a refusal."""
    return _uncheckable(holder) or "still running"


def format_age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def describe_holder(holder: Mapping[str, Any]) -> str:
    """``user@controller pid N`` for messages; ``?`` where the record lacks a field."""
    return f"{holder.get('user', '?')}@{holder.get('controller', '?')} pid {holder.get('pid', '?')}"


__all__ = [
    "active_run",
    "boot_id",
    "controller_identity",
    "describe_holder",
    "format_age",
    "holder_is_dead",
    "holder_record",
    "holder_state",
    "pid_namespace",
    "process_alive",
    "process_start",
    "run_active",
    "run_ended",
    "run_started",
]
