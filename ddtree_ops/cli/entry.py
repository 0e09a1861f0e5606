"""The process entry point of ``ddtree-ops``: the console script (pyproject's
``[project.scripts]``) and ``python -m ddtree_ops``.

It installs the signal handlers (:mod:`ddtree_ops.cli.interrupts`) before it imports the
command line (:mod:`ddtree_ops.cli.main`: typer, rich, every command module, about a
second), runs it, and exits with the status it decided, so that a Ctrl-C or SIGTERM
wherever it lands is 130 / 143 and one line. ``cli.main.run()`` stays free of anything
process-global: the tests call it in-process.
"""

from __future__ import annotations

import sys

from ddtree_ops.cli import interrupts

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (mypy reads the name)
if TYPE_CHECKING:
    from typing import NoReturn


def main() -> NoReturn:
    """``ddtree-ops``."""
    interrupts.install()
    try:
        status = _command()
    except KeyboardInterrupt:  # a second signal while the first was being reported
        status = interrupts.interrupted_here()
    interrupts.finish(status)


def _command() -> int:
    """The command line's exit status."""
    try:
        from ddtree_ops.cli.main import run  # typer, rich, every command module: the slow part

        run()
        return 0
    except SystemExit as exc:
        return _status(exc.code)
    except KeyboardInterrupt:
        return interrupts.interrupted_here()
    except Exception:
        if not interrupts.signal_taken():
            raise  # a bug: the interpreter shows it
        # What a signal broke on its way: a C extension turns a KeyboardInterrupt during its
        # import into ImportError (pandas: "pd_datetime.c could not import module pandas").
        if "--debug" in sys.argv:
            import traceback

            traceback.print_exc()
        return interrupts.interrupted_here()


def _status(code: object) -> int:
    """``SystemExit.code`` as a process exit status (what the interpreter itself does)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
