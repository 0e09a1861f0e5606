"""Ctrl-C and SIGTERM from the process's first instruction to its last: what each signal
does, and the exit status it leaves.

A signal ends the process with 130 (SIGINT) or 143 (SIGTERM), 128 + its number as a shell
reports it, and one line on stderr; never a traceback, never death by the signal (-2 / -15),
whenever it lands. :mod:`ddtree_ops.cli.entry`, the process's entry point, installs the
handlers before anything heavy is imported (typer, rich, pandas: about a second), so this
module needs the standard library only. The process goes through three phases:

- **running** (the imports, then the command): a signal raises ``KeyboardInterrupt`` in the
  main thread, as Python's own Ctrl-C does; the command stops every host between two steps
  and reports how each was left. A second signal raises again (it aborts a wind-down, such
  as bench's put-back). One that arrived before ``cli.main`` could take it (during the
  imports) is one ``interrupted`` line (:func:`interrupted_here`).
- **deciding**: ``cli.main`` has decided the exit status and is writing it (its error line,
  the ``--json`` document): :func:`exit_decided`. A signal now is noted, not raised: raised,
  it escaped the rendering and ended the process by the signal. One noted while the
  command's own status was not already an interruption's turns it into one, with a line
  that says so.
- **final** (:func:`finish`): the status is decided and written; the interpreter winds down
  (it joins the fan-out's worker threads, runs atexit). A signal now ends the process at
  once with that status (an interruption's own status unchanged). The last atexit call
  ends the process with it, before the interpreter's teardown (:func:`_last_at_exit`).

The first signal names the status: Ctrl-C then SIGTERM exits 130, SIGTERM then Ctrl-C 143.
A signal the process inherited as ignored stays ignored (a shell without job control starts
a background job so, to keep the terminal's Ctrl-C away from it).

Only the entry point installs the handlers (:func:`install`). ``cli.main.run()`` is also the
tests' in-process entry (``tests/conftest.py``'s ``cli``): a handler installed there stays
in the pytest worker, and a ``SIG_IGN`` left there is inherited by every process it starts
later (3020cad took back such a fix for that). There, :func:`reset` starts each run afresh
and ``cli.main`` records its own SIGTERM (:func:`note`).
"""

from __future__ import annotations

# The standard library's lightest parts only, loaded with the interpreter or nearly (json is
# imported where it is needed, dataclasses and typing not at all): the handlers are in place
# a few milliseconds after the interpreter's own start-up.
import atexit
import os
import signal
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (mypy reads the name)
if TYPE_CHECKING:
    from types import FrameType
    from typing import NoReturn

INTERRUPTED = 130  # errors.Interrupted.exit_code; not imported: that module is not needed yet
# 128 + the signal's number: the status a shell reports for a process the signal ended.
SIGNAL_STATUS: dict[int, int] = {int(signal.SIGINT): INTERRUPTED, int(signal.SIGTERM): 128 + int(signal.SIGTERM)}
_STATUSES = frozenset(SIGNAL_STATUS.values())


class _Signals:
    """What the process's signals have done so far (one per process; reset per in-process run)."""

    def __init__(self) -> None:
        self.installed = False  # install() ran: the real process, not a test's run()
        self.first: int | None = None  # the first SIGINT/SIGTERM taken: it names the exit status
        self.deciding = False  # the exit status is being decided and written: signals are noted
        self.late: int | None = None  # the first signal noted while deciding
        self.final: int | None = None  # the status, decided and written: a signal ends the process with it
        self.said = False  # the interruption's line is on stderr


_state = _Signals()


def installed() -> bool:
    """Whether this process's handlers are :func:`install`'s."""
    return _state.installed


def reset() -> None:
    """A new in-process run (tests): nothing taken yet. A no-op in the real process."""
    global _state
    if not _state.installed:
        _state = _Signals()


def note(signum: int) -> None:
    """``signum`` was taken (``cli.main``'s SIGTERM handler for in-process runs)."""
    if _state.first is None:
        _state.first = signum


def interrupted_status() -> int:
    """The exit status of an interrupted command: the first signal's (130 when none was
    seen: a KeyboardInterrupt from a test's own code)."""
    return _status_of(_state.first)


def signal_taken() -> bool:
    """Whether a SIGINT or SIGTERM has been taken (by the entry point's handlers)."""
    return _state.first is not None


def exit_decided() -> None:
    """``cli.main`` has decided the exit status: from here until :func:`finish` writes it, a
    signal is noted instead of raised."""
    _state.deciding = True


def json_wanted(args: list[str]) -> bool:
    """``--json`` on a command line not parsed yet (an interruption before the parse)."""
    return "--json" in (args[: args.index("--")] if "--" in args else args)


def install() -> None:
    """The process's handlers, for its whole life (the entry point only)."""
    for signum in SIGNAL_STATUS:
        if signal.getsignal(signum) != signal.SIG_IGN:
            signal.signal(signum, _on_signal)
    _state.installed = True
    atexit.register(_last_at_exit)  # registered first, so it runs last


def interrupted_here() -> int:
    """A KeyboardInterrupt ``cli.main`` never rendered (it came during the imports): its line,
    and under ``--json`` the one document, as ``cli.main`` writes it for an interruption."""
    _state.deciding = True
    status = interrupted_status()
    if not _state.said:
        _say("interrupted")
        if json_wanted(sys.argv[1:]):
            import json

            error = {"code": "interrupted", "message": "interrupted", "host": None}
            doc = {"schema_version": 1, "command": None, "ok": False, "exit_code": status, "data": None,
                   "errors": [error]}
            try:
                sys.stdout.write(json.dumps(doc, indent=2) + "\n")
            except (OSError, ValueError, RuntimeError):
                pass
    return status


def finish(status: int) -> NoReturn:
    """Exit with ``status``, or the interruption's if a signal was noted while it was being
    written; from here a signal ends the process at once."""
    status = _with_late(status)
    _flush()
    _state.final = status  # from here a signal ends the process at once (_on_signal)
    later = _with_late(status)
    if later != status:  # one came between the two looks (its line is out)
        _flush()
        os._exit(later)
    sys.exit(status)


def _status_of(signum: int | None) -> int:
    return INTERRUPTED if signum is None else SIGNAL_STATUS.get(signum, INTERRUPTED)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    note(signum)
    if _state.final is not None:
        _end_now(signum)
    if _state.deciding:
        if _state.late is None:
            _state.late = signum
        return
    raise KeyboardInterrupt


def _last_at_exit() -> None:
    """The interpreter's last atexit call: the process ends here, with its decided status.

    Past this point the interpreter turns its signal handling off (handlers back to
    SIG_DFL) and tears its modules down, pandas and all: a signal there ended the process
    by the signal (-2, -15). And CPython 3.11 ends the process by SIGINT, whatever its exit
    status, once a KeyboardInterrupt has crossed an ``exec`` of a string (dataclasses and
    namedtuple build their methods so; its ``_Py_UnhandledKeyboardInterrupt``), caught or
    not: a Ctrl-C during the imports exited -2 after its line. By now the fan-out's threads
    are joined, every other atexit call has run (registered later, they run earlier) and
    the status is written; only the modules' teardown is left out."""
    if _state.final is None:  # an exception escaped the entry point: the interpreter reports it
        return
    _flush()
    os._exit(_state.final)


def _say(line: str) -> None:
    """One line on stderr, plain (rich is not imported yet, or is winding down)."""
    _state.said = True
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, RuntimeError):  # a closed or broken stderr, a re-entered write
        pass


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):
            pass


def _with_late(status: int) -> int:
    """``status``, or the interruption's when a signal was noted while it was being written
    (unless it already is one: the first signal's line is out)."""
    if _state.late is None or status in _STATUSES:
        return status
    _say(_late_line(status))
    return _status_of(_state.late)


def _late_line(status: int) -> str:
    """A signal after the command ended: its output above is complete, its status was this."""
    return f"interrupted as ddtree-ops was exiting (the command's own exit status: {status})"


def _end_now(signum: int) -> NoReturn:
    """A signal in the final phase: the process ends here, its threads and atexit unrun."""
    status = _state.final if _state.final is not None else INTERRUPTED
    if status not in _STATUSES:
        _say(_late_line(status))
        status = _status_of(signum)
    _flush()
    os._exit(status)
