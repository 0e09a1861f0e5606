"""The `ddtree-ops` Typer app: global options, command registration, error rendering.

This is the ONLY place that catches :class:`DdtreeOpsError`: it prints one line and exits
with the error's exit code (a traceback only with ``--debug``). Under ``--json`` it also
writes the command's one JSON document, the envelope (:func:`ddtree_ops.cli.common.envelope`),
on success and on failure alike. Each command group lives in its own module under
``ddtree_ops/cli/`` and registers itself in :func:`_register`. Global options may also
follow the command: :func:`hoist_global_options` moves them before it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import typer
from rich.console import Console
from rich.markup import escape

from ddtree_ops import __version__
from ddtree_ops.cli import interrupts, metavars, numbers, pathargs
from ddtree_ops.cli.common import write_envelope
from ddtree_ops.cli.terminal import console, err_console
from ddtree_ops.errors import ConfigError, DdtreeOpsError, Interrupted

app = typer.Typer(
    name="ddtree-ops",
    help="Deploy, restart, benchmark and report SGLang DDTree speculative decoding across a GPU fleet.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's own help formatter: flags (--dry-run, -v, --help) without a value placeholder;
    # typer's rich panels print "<bool>" / "<int>" after them as if they took one.
    rich_markup_mode=None,
    # A wide terminal gets the whole first sentence of each command's help (click stops at 80).
    context_settings={"max_content_width": 120},
)


@dataclass
class AppContext:
    """Global options, handed to every command through ``ctx.obj``."""

    inventory: list[Path] = field(default_factory=list)
    json: bool = False
    verbose: int = 0
    debug: bool = False
    host_key_policy: str = "strict"
    max_parallel: int = 8
    # The inventory paths came from $DDTREE_OPS_INVENTORY (no -i): errors name the variable.
    inventory_from_env: bool = False
    # Set while a command runs: its name, and its --json payload (cli/common.set_json_data).
    command: str | None = None
    data: Any = None
    has_data: bool = False

    @property
    def console(self) -> Console:
        return console


def default_inventory_paths() -> list[Path]:
    """``$DDTREE_OPS_INVENTORY`` (os.pathsep-separated), else ``inventories/`` as one
    directory source (YAML and INI, ``.yml`` too), as Ansible reads ``-i inventories/``."""
    from ddtree_ops.inventory import default_sources

    return default_sources()


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"ddtree-ops {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    inventory: list[Path] | None = typer.Option(
        None,
        "-i",
        "--inventory",
        help="Inventory file or directory, YAML or INI (repeatable). Default: $DDTREE_OPS_INVENTORY or inventories/.",
    ),
    json_output: bool = typer.Option(False, "--json", help="Machine-readable JSON on stdout."),
    verbose: int = typer.Option(0, "-v", "--verbose", count=True, help="More detail (repeat for more)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
    host_key_policy: str = typer.Option(
        "strict",
        "--host-key-policy",
        help="strict: reject unknown host keys (default); accept-new: add unknown keys, still reject changed ones.",
    ),
    max_parallel: int = typer.Option(8, "--max-parallel", min=1, help="Hosts worked on at once."),
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Show the version."
    ),
) -> None:
    if host_key_policy not in ("strict", "accept-new"):
        raise typer.BadParameter("must be 'strict' or 'accept-new'", param_hint="--host-key-policy")
    obj = ctx.ensure_object(AppContext)  # run() passes its own, to write the envelope at the end
    obj.inventory = list(inventory) if inventory else default_inventory_paths()
    obj.inventory_from_env = not inventory and bool(os.environ.get("DDTREE_OPS_INVENTORY"))
    obj.json = json_output
    obj.verbose = verbose
    obj.debug = debug
    obj.host_key_policy = host_key_policy
    obj.max_parallel = max_parallel
    obj.command = ctx.invoked_subcommand


def _register() -> None:
    """Import command modules; each one adds its commands to ``app``."""
    import importlib

    for name in (
        "hosts",
        "doctor",
        "deploy",
        "selftest",
        "service",
        "bench",
        "report",
        "tune",
        "ansible",
    ):
        importlib.import_module(f"ddtree_ops.cli.{name}")


def build_command() -> Any:
    """The click command tree ``run`` parses with (the command modules registered first):
    readable placeholders in ``--help``, and every number option read in ASCII digits only
    (cli/numbers.py), as one check for all of them."""
    command = typer.main.get_command(app)
    metavars.apply(command)
    numbers.apply(command)
    pathargs.apply(command)  # and every path one a name this system can hold (cli/pathargs.py)
    return command


def _json_envelope(obj: AppContext, error: BaseException | None = None) -> None:
    """Under --json, the command's one document: on failure always, on success when the
    command gave its payload (so ``--help`` of a command stays plain text)."""
    if not obj.json or (error is None and not obj.has_data):
        return
    write_envelope(obj.command, data=obj.data, error=error)


def _option_names(command: Any, *, with_values: bool) -> dict[str, int]:
    """A click command's option names -> how many values each takes (0 for flags and counts)."""
    names: dict[str, int] = {}
    for param in command.params:
        if param.param_type_name != "option" or (param.is_eager and not with_values):
            continue
        takes = 0 if param.is_flag or param.count else param.nargs
        for name in (*param.opts, *param.secondary_opts):
            names[name] = takes
    return names


def hoist_global_options(group: Any, argv: Sequence[str]) -> list[str]:
    """``deploy ct200 -i inv.yaml --json`` -> ``-i inv.yaml --json deploy ct200``.

    Global options written after the command move before it, so they work on either side.
    A command's own option of the same name stays its own (``report --json``, ``deploy
    --max-parallel``), a value of one of its options is never taken for a global option
    (``--extra-arg --json``), and nothing after ``--`` moves. Anything else (no command, an
    unknown one) is left for click to report.
    """
    args = list(argv)
    global_opts = _option_names(group, with_values=False)  # not --version / --help
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        name = args[i].split("=", 1)[0]
        i += 1 + (global_opts.get(name, 0) if "=" not in args[i] else 0)
    command = group.commands.get(args[i]) if i < len(args) else None
    if command is None or hasattr(command, "commands"):
        return args
    own = _option_names(command, with_values=True)
    own.setdefault("--help", 0)
    moved: list[str] = []
    kept: list[str] = []
    j = i + 1
    while j < len(args):
        token = args[j]
        if token == "--":
            kept.extend(args[j:])
            break
        name, attached = token.split("=", 1)[0], "=" in token
        if name in own:
            n = 1 + (0 if attached else own[name])
            kept.extend(args[j : j + n])
        elif name in global_opts:
            n = 1 + (0 if attached else global_opts[name])
            moved.extend(args[j : j + n])
        elif _short_globals(token, global_opts, own):  # -vv, -iinv.yaml
            n = 1
            moved.append(token)
        else:
            n = 1
            kept.append(token)
        j += n
    return [*args[:i], *moved, args[i], *kept]


def _short_globals(token: str, global_opts: dict[str, int], own: dict[str, int]) -> bool:
    """``-vv`` (a repeated global flag) or ``-iPATH`` (a global short option with its value
    attached), when the command has no short option of that letter."""
    if not token.startswith("-") or token.startswith("--") or len(token) <= 2:
        return False
    first = token[:2]
    if first in own or first not in global_opts:
        return False
    return global_opts[first] > 0 or all(f"-{c}" == first for c in token[1:])


@contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM (kill, systemd, timeout(1)) ends a command the way Ctrl-C does: every host
    stops between two steps and reports how it was left, exit 143. Python's default would
    end the process at once, in the middle of a fan-out. The process's entry point has
    its own handlers, for the whole process (cli/interrupts.py); this one is for a run()
    called in-process (the tests), and is undone when it returns."""
    if interrupts.installed() or threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        interrupts.note(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _warnings_on_err_console() -> Iterator[None]:
    """Python warnings reach the terminal through ``err_console``, as every other line does:
    matplotlib's missing-glyph warning quotes a character of a GPU name from the ledger,
    an ANSI escape included, and Python's own handler wrote it raw. One line each, each
    text once (the same glyph is missing from every figure)."""
    said: set[str] = set()

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        text = " ".join(str(message).split())
        if text not in said:
            said.add(text)
            err_console.print(f"warning: {text}", style="yellow", markup=False, highlight=False, soft_wrap=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def run() -> None:
    """Parse the command line, run the command, render its outcome, exit with its code.
    The process's entry point, cli/entry.py, calls it (signals are its business); the
    tests call it in-process."""
    interrupts.reset()
    with _sigterm_as_ctrl_c(), _warnings_on_err_console():
        _run()


def _run() -> None:
    debug = "--debug" in sys.argv
    obj = AppContext()
    try:
        _register()  # inside: a Ctrl-C while the command modules import is an interruption too
        command = build_command()
        args = hoist_global_options(command, sys.argv[1:])
        code = command.main(args=args, prog_name="ddtree-ops", standalone_mode=False, obj=obj)
        interrupts.exit_decided()
        # typer turns a KeyboardInterrupt that leaves a command into Exit(130), which in
        # non-standalone mode is RETURNED, not raised: unread, a second Ctrl-C exited 0.
        if code == Interrupted.exit_code:
            raise KeyboardInterrupt
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            sys.exit(code)
    except DdtreeOpsError as exc:
        # From each of these branches on a signal is noted, not raised (cli/interrupts.py): the
        # exit status is decided, and a KeyboardInterrupt here would escape its rendering.
        interrupts.exit_decided()
        if exc.exit_code == Interrupted.exit_code:
            exc.exit_code = interrupts.interrupted_status()  # SIGTERM's 143, in the --json document too
        if debug:
            err_console.print_exception()
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        _json_envelope(obj, exc)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        interrupts.exit_decided()
        interrupted = Interrupted("interrupted")
        interrupted.exit_code = interrupts.interrupted_status()
        if obj.command is None:  # before the global options were parsed (the imports)
            obj.json = interrupts.json_wanted(sys.argv[1:])
        err_console.print("[yellow]interrupted[/]")
        _json_envelope(obj, interrupted)
        sys.exit(interrupted.exit_code)
    except typer.Exit as exc:
        interrupts.exit_decided()
        sys.exit(exc.exit_code)
    except typer.Abort:
        interrupts.exit_decided()
        err_console.print("[yellow]aborted[/]")
        sys.exit(1)
    except Exception as exc:  # click usage errors arrive here in standalone_mode=False
        interrupts.exit_decided()
        import click

        # typer >= 0.20 vendors click: its usage errors derive from typer.TyperException.
        if isinstance(exc, (click.exceptions.ClickException, typer.TyperException)) and hasattr(exc, "show"):
            exc.show()
            if obj.command is None:  # a global option's error: the global callback never ran
                obj.json = interrupts.json_wanted(sys.argv[1:])
            # Bad command-line input (a usage error, exit 2) is a ConfigError's case.
            message = exc.format_message()
            _json_envelope(
                obj, ConfigError(message) if exc.exit_code == ConfigError.exit_code else DdtreeOpsError(message)
            )
            sys.exit(exc.exit_code)
        raise
    _json_envelope(obj)
