"""`ddtree-ops selftest TARGET`: run the bundle's selftest.py on each host, against the
files deployed there.

The script is sent as a :class:`Script` on stdin to the host's own interpreter
(``ddtree.python``), so nothing is copied to the host and the interpreter that SGLang
runs under is the one that loads the deployed ``ddtree_utils.py``. One remote command
per host. The script prints one JSON object; this module turns it into a
:class:`SelftestResult` (or a clear error) and the command renders one row per host.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import typer

from ddtree_ops.cli.common import load_hosts, transport_for
from ddtree_ops.cli.main import AppContext, app
from ddtree_ops.ddtree_core import REPO_ROOT
from ddtree_ops.fleet import run_on_hosts
from ddtree_ops.errors import BundleError, CommandFailed, DdtreeOpsError, FleetError, PatchError
from ddtree_ops.inventory_types import Host
from ddtree_ops.transport.base import Script, Transport

DEFAULT_BUNDLE = REPO_ROOT / "patches" / "ddtree_temperature"
SELFTEST_NAME = "selftest.py"
# Generous: the script takes a few seconds on a CPU host; a cold CUDA context plus the
# kernel's JIT build on first use can take a minute.
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    detail: str


@dataclass(frozen=True)
class SelftestResult:
    """What one host's selftest reported. ``ok`` is False when any check failed."""

    host: str
    ok: bool
    kernel: str
    checks: Mapping[str, CheckResult] = field(default_factory=lambda: MappingProxyType({}))
    torch: str | None = None
    cuda: bool = False
    ddtree_utils: str | None = None
    seconds: float | None = None

    @property
    def failed_checks(self) -> list[str]:
        return [name for name, c in self.checks.items() if not c.ok]

    def as_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "ok": self.ok,
            "kernel": self.kernel,
            "torch": self.torch,
            "cuda": self.cuda,
            "ddtree_utils": self.ddtree_utils,
            "seconds": self.seconds,
            "checks": {k: {"ok": v.ok, "detail": v.detail} for k, v in self.checks.items()},
        }


def selftest_source(bundle_dir: Path = DEFAULT_BUNDLE) -> str:
    """The selftest program text, read from the bundle (the one copy)."""
    path = Path(bundle_dir) / SELFTEST_NAME
    try:
        return path.read_text()
    except OSError as exc:
        raise BundleError(f"{path}: cannot read the bundle's selftest script ({exc.strerror})") from exc


def parse_report(host: str, returncode: int, stdout: str, stderr: str, argv: Sequence[str]) -> SelftestResult:
    """Turn the script's JSON line into a result; anything else becomes a clear error.

    Exit 2 means the script could not test at all (bundle not deployed, no torch, no
    sglang): that is an error for the host, not a failed check.
    """
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    try:
        report = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        report = None
    if not isinstance(report, dict):
        raise CommandFailed(
            returncode, list(argv), stderr, host=host,
            detail=f"selftest produced no JSON report (exit code {returncode})",
        )
    if not report.get("deployed", False):
        raise PatchError(str(report.get("error") or "bundle not deployed"), host=host)
    if returncode == 2 or report.get("error"):
        raise PatchError(f"selftest: {report['error']}", host=host)
    checks = {
        str(name): CheckResult(ok=bool(c.get("ok")), detail=str(c.get("detail", "")))
        for name, c in (report.get("checks") or {}).items()
    }
    return SelftestResult(
        host=host,
        ok=bool(report.get("ok")) and returncode == 0 and all(c.ok for c in checks.values()),
        kernel=str(report.get("kernel", "unknown")),
        checks=MappingProxyType(checks),
        torch=report.get("torch"),
        cuda=bool(report.get("cuda")),
        ddtree_utils=report.get("ddtree_utils"),
        seconds=report.get("seconds"),
    )


def run_selftest(
    transport: Transport, host: Host, *, source: str, timeout: float = DEFAULT_TIMEOUT_S
) -> SelftestResult:
    """Run the selftest with ``host``'s interpreter over ``transport`` (one round trip)."""
    argv = (host.python, "-")
    result = transport.run(Script(argv=argv, source=source), timeout=timeout)
    return parse_report(host.name, result.returncode, result.stdout, result.stderr, argv)


# ---------------------------------------------------------------------------- command


def _summary(result: SelftestResult) -> str:
    if result.ok:
        return f"{len(result.checks)} checks passed"
    return "failed: " + ", ".join(result.failed_checks)


def _render(obj: AppContext, results: Mapping[str, Any]) -> bool:
    """Render one row per host (rich table, or JSON with --json). True if any failed."""
    any_failed = False
    rows: list[dict[str, Any]] = []
    for name, r in results.items():
        if isinstance(r, SelftestResult):
            any_failed |= not r.ok
            rows.append(r.as_dict())
        else:
            any_failed = True
            msg = str(r) if isinstance(r, DdtreeOpsError) else f"{type(r).__name__}: {r}"
            rows.append({"host": name, "ok": False, "error": msg})
    if obj.json:
        obj.console.print_json(json.dumps(rows))
        return any_failed
    from rich.table import Table

    table = Table(title="selftest")
    for col in ("host", "result", "kernel", "torch", "seconds"):
        table.add_column(col)
    for name, r in results.items():
        if isinstance(r, SelftestResult):
            style = "green" if r.ok else "red"
            table.add_row(name, f"[{style}]{_summary(r)}[/]", r.kernel, r.torch or "", f"{r.seconds or 0:.1f}")
            if obj.verbose:
                for check, c in r.checks.items():
                    table.add_row("", f"  {check}: {'ok' if c.ok else 'FAILED'}", c.detail, "", "")
        else:
            msg = str(r) if isinstance(r, DdtreeOpsError) else f"{type(r).__name__}: {r}"
            table.add_row(name, f"[red]error: {msg}[/]", "", "", "")
    obj.console.print(table)
    return any_failed


@app.command("selftest")
def selftest_command(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="Host, group, comma list or 'all'."),
    bundle: Path = typer.Option(DEFAULT_BUNDLE, "--bundle", help="Bundle directory holding selftest.py."),
    timeout: float = typer.Option(DEFAULT_TIMEOUT_S, "--timeout", min=1.0, help="Seconds per host."),
) -> None:
    """Test the DEPLOYED DDTree files on each host with its own interpreter: golden
    encoding, tree properties, greedy walk, sampler exactness, and kernel vs reference
    where CUDA and SGLang's kernel are available."""
    obj: AppContext = ctx.obj
    hosts = load_hosts(obj, target)
    source = selftest_source(bundle)

    def one(host: Host) -> SelftestResult:
        with transport_for(obj, host) as transport:
            return run_selftest(transport, host, source=source, timeout=timeout)

    results = run_on_hosts(hosts, one, max_parallel=obj.max_parallel)
    if _render(obj, results):
        failed = [n for n, r in results.items() if not (isinstance(r, SelftestResult) and r.ok)]
        raise FleetError(f"selftest failed on {len(failed)} of {len(results)} host(s): {', '.join(failed)}")


__all__ = [
    "CheckResult",
    "SelftestResult",
    "parse_report",
    "run_selftest",
    "selftest_command",
    "selftest_source",
]
