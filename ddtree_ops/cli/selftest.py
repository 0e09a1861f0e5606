"""`ddtree-ops selftest TARGET [--e2e]`: run the bundle's self-tests on each host, against
the files deployed there.

The script is sent as a :class:`Script` on stdin to the host's own interpreter
(``ddtree.python``), so nothing is copied to the host and the interpreter that SGLang
runs under is the one that loads the deployed ``ddtree_utils.py``. One remote command
per host. The script prints one JSON object; this module turns it into a
:class:`SelftestResult` (or a clear error) and the command renders one row per host.

``--e2e`` sends ``selftest_e2e.py`` instead (``selftest.py``'s text and the parameters
follow it on stdin, after a NUL byte): it launches the host's real SGLang with tiny
random-weight models, once alone and once per (budget, decode-graph mode) with DDTREE,
compares greedy outputs token for token and reports what ``/server_info`` says about
the verify path, plus ``selftest.py``'s checks. Its report becomes an :class:`E2eResult`
(frozen, parsed here, pure) rendered one row per (host, budget, graph mode).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import typer

from ddtree_ops.cli.common import (
    check_output_path,
    load_hosts,
    raise_if_failed,
    set_json_data,
    transport_for,
)
from ddtree_ops.cli.main import AppContext, app
from ddtree_ops.ddtree_core import REPO_ROOT
from ddtree_ops.errors import (
    BundleError,
    CommandFailed,
    ConfigError,
    DdtreeOpsError,
    PatchError,
)
from ddtree_ops.fleet import run_on_hosts
from ddtree_ops.inventory_types import Host
from ddtree_ops.transport.base import Script, Transport, python_program

DEFAULT_BUNDLE = REPO_ROOT / "patches" / "ddtree_temperature"
SELFTEST_NAME = "selftest.py"
# Generous: the script takes a few seconds on a CPU host; a cold CUDA context plus the
# kernel's JIT build on first use can take a minute.
DEFAULT_TIMEOUT_S = 300.0
E2E_NAME = "selftest_e2e.py"
# Several server launches (one baseline + budgets x graph modes), each with CUDA-graph
# capture and the first one with JIT builds: minutes each on a GPU, ~40 s on CPU.
E2E_TIMEOUT_S = 3600.0
E2E_BUDGETS = (4, 8, 16, 32)
E2E_GRAPHS = ("on", "off")
# Around the B300's known edge (capture crashes above budget 8): 8 passes there.
BISECT_BUDGETS = (8, 9, 10, 12, 16)
E2E_TOPK = 4
MAX_BUDGET = 256  # --speculative-num-draft-tokens 2..257


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    detail: str


class _Checked:
    checks: Mapping[str, CheckResult]

    @property
    def failed_checks(self) -> list[str]:
        return [name for name, c in self.checks.items() if not c.ok]


@dataclass(frozen=True)
class SelftestResult(_Checked):
    """What one host's selftest reported. ``ok`` is False when any check failed."""

    host: str
    ok: bool
    kernel: str
    checks: Mapping[str, CheckResult] = field(default_factory=lambda: MappingProxyType({}))
    torch: str | None = None
    cuda: bool = False
    ddtree_utils: str | None = None
    seconds: float | None = None

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


def selftest_source(bundle_dir: Path = DEFAULT_BUNDLE, name: str = SELFTEST_NAME) -> str:
    """A self-test program's text, read from the bundle (the one copy)."""
    path = Path(bundle_dir) / name
    try:
        return path.read_text()
    except OSError as exc:
        raise BundleError(f"{path}: cannot read the bundle's selftest script ({exc.strerror})") from exc


def _read_report(host: str, returncode: int, stdout: str, stderr: str, argv: Sequence[str]) -> dict[str, Any]:
    """The script's last stdout line as a JSON object, or a clear error.

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
    if returncode == 2:
        raise PatchError(f"selftest: {report.get('error') or 'exit code 2'}", host=host)
    return report


def _checks(report: Mapping[str, Any]) -> Mapping[str, CheckResult]:
    checks = report.get("checks")
    return MappingProxyType({
        str(name): CheckResult(ok=bool(c.get("ok")), detail=str(c.get("detail", "")))
        for name, c in (checks.items() if isinstance(checks, dict) else ())
        if isinstance(c, dict)
    })


def parse_report(host: str, returncode: int, stdout: str, stderr: str, argv: Sequence[str]) -> SelftestResult:
    """Turn selftest.py's JSON line into a result; anything else becomes a clear error."""
    report = _read_report(host, returncode, stdout, stderr, argv)
    if report.get("error"):
        raise PatchError(f"selftest: {report['error']}", host=host)
    checks = _checks(report)
    return SelftestResult(
        host=host,
        ok=bool(report.get("ok")) and returncode == 0 and all(c.ok for c in checks.values()),
        kernel=str(report.get("kernel", "unknown")),
        checks=checks,
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


# ------------------------------------------------------------------------------- e2e


@dataclass(frozen=True)
class E2eOptions:
    """What ``--e2e`` runs: tree budgets x decode CUDA-graph modes ("on": SGLang's
    default, "off": ``--cuda-graph-backend-decode disabled``); with ``bisect``, the
    budgets in ascending order with graphs on, up to the first that fails."""

    budgets: tuple[int, ...] = E2E_BUDGETS
    graphs: tuple[str, ...] = E2E_GRAPHS
    bisect: bool = False
    topk: int = E2E_TOPK

    def params(self, host: Host) -> dict[str, Any]:
        """The script's parameters for ``host``: its usual server command, flags and
        environment."""
        from ddtree_ops.service.launch import launcher_argv

        params: dict[str, Any] = {
            "budgets": list(self.budgets),
            "graphs": list(self.graphs),
            "topk": self.topk,
            "extra_args": list(host.ddtree.server.extra_args),
            "env": dict(host.ddtree.server.env),
            "server_command": list(launcher_argv(host)),
        }
        if self.bisect:
            params["bisect"] = list(self.budgets)
        return params


def _comma_list(option: str, text: str) -> list[str]:
    items = [part.strip() for part in text.split(",")]
    if not all(items):
        raise ConfigError(f"{option}: expected a comma list without empty items, got {text!r}")
    if len(set(items)) != len(items):
        raise ConfigError(f"{option}: {text!r} names an item twice")
    return items


def e2e_options(
    *, e2e: bool, budgets: str | None, graphs: str | None, bisect: bool = False
) -> E2eOptions | None:
    """Validate the --e2e options (None without --e2e); ConfigError names the option."""
    if not e2e:
        for option, value in (("--budgets", budgets), ("--graphs", graphs), ("--bisect-budgets", bisect or None)):
            if value is not None:
                raise ConfigError(f"{option} applies to --e2e only")
        return None
    if bisect and graphs is not None:
        raise ConfigError("--graphs does not apply to --bisect-budgets (it bisects with decode CUDA graphs on)")
    picked = E2eOptions(budgets=BISECT_BUDGETS, graphs=("on",), bisect=True) if bisect else E2eOptions()
    if budgets is not None:
        values = []
        for item in _comma_list("--budgets", budgets):
            if not item.isdigit() or not 1 <= int(item) <= MAX_BUDGET:
                raise ConfigError(f"--budgets: {item!r} is not a tree budget (an integer in 1..{MAX_BUDGET})")
            values.append(int(item))
        picked = E2eOptions(budgets=tuple(values), graphs=picked.graphs, bisect=picked.bisect)
    if graphs is not None:
        modes = _comma_list("--graphs", graphs)
        bad = [m for m in modes if m not in E2E_GRAPHS]
        if bad:
            raise ConfigError(f"--graphs: {bad[0]!r} is not a graph mode (on, off)")
        picked = E2eOptions(budgets=picked.budgets, graphs=tuple(modes))
    return picked


@dataclass(frozen=True)
class Divergence:
    """Where a DDTREE output first left the target's own (``margin``: the target alone's
    top-2 log-prob margin there; ``verdict`` "tie" when under the script's threshold)."""

    position: int
    margin: float | None
    verdict: str
    prompt: int | None = None
    batch: int | None = None


@dataclass(frozen=True)
class E2eRun:
    """One DDTREE launch of the e2e test: a budget under one decode-graph mode."""

    budget: int
    graphs: str
    ok: bool
    served: bool
    equal: bool | None = None
    compared_tokens: int = 0
    first_divergence: Divergence | None = None
    accept_length: float | None = None
    max_logprob_delta: float | None = None
    verify_cuda_graph_captured: bool | None = None
    verify_attention_backend: str | None = None
    decode_cuda_graph: str | None = None
    startup_s: float | None = None
    error: str | None = None

    @property
    def verdict(self) -> str:
        """"equal", "tie" (diverged only at near-ties) or "FAILED"."""
        if not self.ok:
            return "FAILED"
        return "equal" if self.equal else "tie"


@dataclass(frozen=True)
class BisectStep:
    """One decode-graph launch of the bisection."""

    budget: int
    ok: bool
    captured: bool | None = None
    error: str | None = None


@dataclass(frozen=True)
class Bisection:
    """What ``--bisect-budgets`` found: the launches in budget order up to the first that
    failed, that budget's rerun with ``CUDA_LAUNCH_BLOCKING=1`` and with the eager
    candidate head (``SGLANG_DFLASH_EAGER_DRAFT_SAMPLER=1``)."""

    budgets: tuple[int, ...]
    tried: tuple[BisectStep, ...]
    first_failing: int | None
    blocking_error: str | None = None
    eager_head: BisectStep | None = None

    @property
    def eager_head_avoids(self) -> bool | None:
        return None if self.eager_head is None else self.eager_head.ok

    @property
    def passed_up_to(self) -> int | None:
        """The largest budget that served below the first failing one (or of all)."""
        ok = [s.budget for s in self.tried if s.ok]
        return max(ok) if ok else None


@dataclass(frozen=True)
class E2eResult(_Checked):
    """What one host's ``selftest_e2e.py`` reported. ``ok`` is False when any run or
    check failed; ``report`` is the script's JSON as received (written by ``--out``)."""

    host: str
    ok: bool
    runs: tuple[E2eRun, ...] = ()
    checks: Mapping[str, CheckResult] = field(default_factory=lambda: MappingProxyType({}))
    kernel: str = "unknown"
    sglang_version: str | None = None
    device: str | None = None
    baseline_startup_s: float | None = None
    graph_capture: Mapping[int, bool] = field(default_factory=lambda: MappingProxyType({}))
    gpu_arch: str | None = None
    bisect: Bisection | None = None
    seconds: float | None = None
    error: str | None = None
    report: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def as_dict(self) -> dict[str, Any]:
        return {**json.loads(json.dumps(dict(self.report))), "host": self.host, "ok": self.ok}


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _opt_bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _divergence(value: Any) -> Divergence | None:
    if not isinstance(value, dict) or not isinstance(value.get("position"), int):
        return None
    return Divergence(
        position=value["position"],
        margin=_num(value.get("margin")),
        verdict=str(value.get("verdict", "diverged")),
        prompt=value.get("prompt") if isinstance(value.get("prompt"), int) else None,
        batch=value.get("batch") if isinstance(value.get("batch"), int) else None,
    )


def _e2e_run(raw: Mapping[str, Any]) -> E2eRun:
    return E2eRun(
        budget=int(raw.get("budget", 0)),
        graphs=str(raw.get("graphs", "?")),
        ok=raw.get("ok") is True and not raw.get("error"),
        served=raw.get("served") is True,
        equal=_opt_bool(raw.get("equal")),
        compared_tokens=int(raw.get("compared_tokens") or 0),
        first_divergence=_divergence(raw.get("first_divergence")),
        accept_length=_num(raw.get("accept_length")),
        max_logprob_delta=_num(raw.get("max_logprob_delta")),
        verify_cuda_graph_captured=_opt_bool(raw.get("verify_cuda_graph_captured")),
        verify_attention_backend=_opt_str(raw.get("verify_attention_backend")),
        decode_cuda_graph=_opt_str(raw.get("decode_cuda_graph")),
        startup_s=_num(raw.get("startup_s")),
        error=_opt_str(raw.get("error")),
    )


def _step(raw: Any) -> BisectStep | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("budget"), int):
        return None
    return BisectStep(budget=raw["budget"], ok=raw.get("ok") is True, captured=_opt_bool(raw.get("captured")),
                      error=_opt_str(raw.get("error")))


def _bisection(raw: Any) -> Bisection | None:
    if not isinstance(raw, dict):
        return None
    budgets = tuple(b for b in raw.get("budgets") or () if isinstance(b, int))
    tried = tuple(s for s in (_step(r) for r in raw.get("tried") or ()) if s is not None)
    first = raw.get("first_failing")
    blocking = raw.get("blocking")
    return Bisection(
        budgets=budgets,
        tried=tried,
        first_failing=first if isinstance(first, int) else None,
        blocking_error=_opt_str(blocking.get("error")) if isinstance(blocking, dict) else None,
        eager_head=_step(raw.get("eager_head")),
    )


def parse_e2e_report(host: str, returncode: int, stdout: str, stderr: str, argv: Sequence[str]) -> E2eResult:
    """Turn selftest_e2e.py's JSON line into an :class:`E2eResult`; no JSON, exit 2 or an
    undeployed bundle become errors, as for :func:`parse_report`. A run or check that
    failed is data (``ok`` False), not an error."""
    report = _read_report(host, returncode, stdout, stderr, argv)
    try:
        runs = tuple(_e2e_run(r) for r in report.get("runs") or () if isinstance(r, dict))
        capture = report.get("graph_capture")
        if not isinstance(capture, dict):
            capture = {}
        graph_capture = {int(b): v is True for b, v in capture.items()}
    except (TypeError, ValueError) as exc:
        raise CommandFailed(
            returncode, list(argv), stderr, host=host, detail=f"selftest --e2e report is malformed ({exc})"
        ) from exc
    checks = _checks(report)
    baseline = report.get("baseline")
    if not isinstance(baseline, dict):
        baseline = {}
    error = _opt_str(report.get("error"))
    bisect = _bisection(report.get("bisect"))
    return E2eResult(
        host=host,
        ok=(report.get("ok") is True and returncode == 0 and not error and (bool(runs) or bisect is not None)
            and all(r.ok for r in runs) and all(c.ok for c in checks.values())),
        runs=runs,
        checks=checks,
        kernel=str(report.get("kernel") or "unknown"),
        sglang_version=_opt_str(report.get("sglang_version")),
        device=_opt_str(report.get("device")),
        baseline_startup_s=_num(baseline.get("startup_s")),
        graph_capture=MappingProxyType(graph_capture),
        gpu_arch=_opt_str(report.get("gpu_arch")),
        bisect=bisect,
        seconds=_num(report.get("seconds")),
        error=error,
        report=MappingProxyType(report),
    )


def run_e2e(
    transport: Transport,
    host: Host,
    *,
    source: str,
    selftest: str,
    options: E2eOptions,
    timeout: float = E2E_TIMEOUT_S,
) -> E2eResult:
    """Run ``selftest_e2e.py`` with ``host``'s interpreter (one round trip). Its parameters
    and ``selftest.py`` travel on stdin (no value on the host's command line)."""
    payload = json.dumps({"params": options.params(host), "selftest": selftest})
    script = python_program(host.python, source, payload)
    result = transport.run(script, timeout=timeout)
    return parse_e2e_report(
        host.name, result.returncode, result.stdout, result.stderr, (host.python, "-c", f"<{E2E_NAME}>")
    )


# ---------------------------------------------------------------------------- command


def _summary(result: SelftestResult) -> str:
    if result.ok:
        return f"{len(result.checks)} checks passed"
    return "failed: " + ", ".join(result.failed_checks)


def _render(obj: AppContext, results: Mapping[str, Any]) -> bool:
    """Render one row per host as a rich table. True if any failed."""
    any_failed = any(not (isinstance(r, SelftestResult) and r.ok) for r in results.values())
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="selftest")
    for col in ("host", "result", "kernel", "torch", "seconds"):
        table.add_column(col)
    for name, r in results.items():
        if isinstance(r, SelftestResult):
            style = "green" if r.ok else "red"
            table.add_row(
                escape(name), f"[{style}]{escape(_summary(r))}[/]", escape(r.kernel), escape(r.torch or ""),
                f"{r.seconds or 0:.1f}",
            )
            if obj.verbose:
                for check, c in r.checks.items():
                    table.add_row("", escape(f"  {check}: {'ok' if c.ok else 'FAILED'}"), escape(c.detail), "", "")
        else:
            msg = str(r) if isinstance(r, DdtreeOpsError) else f"{type(r).__name__}: {r}"
            table.add_row(escape(name), f"[red]error: {escape(msg)}[/]", "", "", "")
    obj.console.print(table)
    return any_failed


def _run_cell(run: E2eRun) -> str:
    """The result column of one e2e row."""
    from rich.markup import escape

    if run.verdict == "equal":
        return "[green]equal[/]"
    d = run.first_divergence
    where = f" at token {d.position} (margin {d.margin:.3g})" if d is not None and d.margin is not None else ""
    if run.verdict == "tie":
        return f"[yellow]tie{where}[/]"
    return f"[red]FAILED: {escape(run.error or 'diverged' + where)}[/]"


def _yes_no(value: bool | None) -> str:
    return "" if value is None else ("yes" if value else "no")


def _render_e2e(obj: AppContext, results: Mapping[str, Any]) -> bool:
    """One row per (host, budget, graph mode), after a row with the host's checks. True if
    any host failed."""
    any_failed = any(not (isinstance(r, E2eResult) and r.ok) for r in results.values())
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="selftest --e2e")
    for col in ("host", "budget", "graphs", "result", "graph captured", "accept length", "verify backend", "startup s"):
        table.add_column(col)
    for name, r in results.items():
        if not isinstance(r, E2eResult):
            msg = str(r) if isinstance(r, DdtreeOpsError) else f"{type(r).__name__}: {r}"
            table.add_row(escape(name), "", "", f"[red]error: {escape(msg)}[/]", "", "", "", "")
            continue
        checks = escape(
            f"{len(r.checks)} checks passed" if not r.failed_checks else "failed: " + ", ".join(r.failed_checks)
        )
        style = "red" if r.failed_checks else "green"
        head = f"[{style}]{checks}[/]" + escape(
            f"; kernel {r.kernel}; sglang {r.sglang_version or '?'} on {r.device or '?'}"
        )
        table.add_row(escape(name), "checks", "", head, "", "", "", f"{r.baseline_startup_s or 0:.0f}")
        for run in r.runs:
            accept = "" if run.accept_length is None else f"{run.accept_length:.2f}"
            table.add_row(
                "", str(run.budget), escape(run.graphs), _run_cell(run), _yes_no(run.verify_cuda_graph_captured),
                accept, escape(run.verify_attention_backend or ""), f"{run.startup_s or 0:.0f}",
            )
        if r.bisect is not None:
            for step in r.bisect.tried:
                cell = "[green]served[/]" if step.ok else f"[red]FAILED: {escape(step.error or '')}[/]"
                table.add_row("", str(step.budget), "on", cell, _yes_no(step.captured), "", "", "")
            table.add_row("", "", "", escape(_bisect_summary(r.bisect)), "", "", "", "")
        if r.error:
            table.add_row("", "", "", f"[red]error: {escape(r.error)}[/]", "", "", "", "")
    obj.console.print(table)
    return any_failed


def _bisect_summary(b: Bisection) -> str:
    if b.first_failing is None:
        return f"bisection: every budget served with decode CUDA graphs ({', '.join(map(str, b.budgets))})"
    head = {True: "the eager candidate head avoids it", False: "the eager candidate head does not avoid it",
            None: "the eager candidate head was not tried"}[b.eager_head_avoids]
    blocking = f"; with CUDA_LAUNCH_BLOCKING=1: {b.blocking_error}" if b.blocking_error else ""
    return f"bisection: first failing budget {b.first_failing}{blocking}; {head}"


def _host_dict(name: str, result: Any) -> dict[str, Any]:
    if isinstance(result, (SelftestResult, E2eResult)):
        return result.as_dict()
    msg = str(result) if isinstance(result, DdtreeOpsError) else f"{type(result).__name__}: {result}"
    return {"host": name, "ok": False, "error": msg}


def check_out_dir(out: Path | None) -> None:
    """Refuse an --out that cannot become a directory (its parent must exist), before any
    host is contacted."""
    check_output_path("--out", out, directory=True)


def write_reports(out: Path, results: Mapping[str, Any]) -> list[Path]:
    """``out/<host>.json`` per host (failed hosts too: their error)."""
    try:
        out.mkdir(exist_ok=True)
        written = []
        for name, r in results.items():
            path = out / f"{name.replace('/', '_')}.json"
            path.write_text(json.dumps(_host_dict(name, r), indent=2, sort_keys=True) + "\n")
            written.append(path)
    except OSError as exc:
        raise ConfigError(f"--out: cannot write the reports into {out} ({exc.strerror or exc})") from exc
    return written


@app.command("selftest")
def selftest_command(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="Host, group, comma list or 'all'."),
    bundle: Path = typer.Option(DEFAULT_BUNDLE, "--bundle", help="Bundle directory holding selftest.py."),
    timeout: float | None = typer.Option(
        None, "--timeout", min=1.0,
        help=f"Seconds per host (default {DEFAULT_TIMEOUT_S:.0f}; {E2E_TIMEOUT_S:.0f} with --e2e).",
    ),
    e2e: bool = typer.Option(
        False, "--e2e", help="End to end: launch the host's SGLang with tiny models, alone and with DDTREE per budget "
        "and decode-graph mode, and compare greedy outputs (GPU acceptance test; minutes per launch)."
    ),
    budgets: str | None = typer.Option(
        None, "--budgets", help="--e2e: comma list of tree budgets (default 4,8,16,32)."
    ),
    graphs: str | None = typer.Option(
        None, "--graphs", help="--e2e: comma list of decode CUDA-graph modes, on and/or off (default on,off)."
    ),
    bisect_budgets: bool = typer.Option(
        False, "--bisect-budgets", help="--e2e: with decode CUDA graphs on, launch DDTREE at each of --budgets "
        f"(default {','.join(map(str, BISECT_BUDGETS))}) up to the first that fails; rerun that one with "
        "CUDA_LAUNCH_BLOCKING=1 and with the eager candidate head; remember the eager fallback from that budget up."
    ),
    out: Path | None = typer.Option(None, "--out", help="Also write each host's report to DIR/<host>.json."),
) -> None:
    """Test the DEPLOYED DDTree files on each host with its own interpreter: golden
    encoding, tree properties, greedy walk, sampler exactness, and kernel vs reference
    where CUDA and SGLang's kernel are available. With --e2e, also the real server:
    greedy DDTREE output equals the target alone per budget and graph mode."""
    obj: AppContext = ctx.obj
    options = e2e_options(e2e=e2e, budgets=budgets, graphs=graphs, bisect=bisect_budgets)
    check_out_dir(out)
    hosts = load_hosts(obj, target)
    source = selftest_source(bundle)
    e2e_source = selftest_source(bundle, E2E_NAME) if options is not None else ""

    def one(host: Host) -> SelftestResult | E2eResult:
        with transport_for(obj, host) as transport:
            if options is None:
                return run_selftest(transport, host, source=source, timeout=timeout or DEFAULT_TIMEOUT_S)
            return run_e2e(transport, host, source=e2e_source, selftest=source, options=options,
                           timeout=timeout or E2E_TIMEOUT_S)

    results = run_on_hosts(hosts, one, max_parallel=obj.max_parallel)
    if options is not None and options.bisect:
        from ddtree_ops.service.fallback import remember_bisection
        from ddtree_ops.state import StateStore

        state = StateStore()
        by_name = {h.name: h for h in hosts}
        for name, r in results.items():
            if isinstance(r, E2eResult) and r.ok and r.bisect is not None:
                remember_bisection(state, by_name[name], r.bisect, gpu_arch=r.gpu_arch,
                                   sglang_version=r.sglang_version, topk=options.topk)
    if out is not None:
        write_reports(out, results)
    set_json_data(obj, [_host_dict(name, r) for name, r in results.items()])
    if not obj.json:
        _render_e2e(obj, results) if options is not None else _render(obj, results)
    raise_if_failed("selftest", results, failure=_failed_checks)


def _failed_checks(result: SelftestResult | E2eResult) -> BaseException | None:
    """A host whose script ran but reported a failure fails the command too."""
    if result.ok:
        return None
    what = ", ".join(result.failed_checks) or (
        "; ".join(f"budget {r.budget} graphs {r.graphs}: {r.verdict}" for r in getattr(result, "runs", ()) if not r.ok)
        or getattr(result, "error", None) or "failed"
    )
    return PatchError(f"selftest: {what}", host=result.host)

__all__ = [
    "BisectStep",
    "Bisection",
    "CheckResult",
    "Divergence",
    "E2eOptions",
    "E2eResult",
    "E2eRun",
    "SelftestResult",
    "check_out_dir",
    "e2e_options",
    "parse_e2e_report",
    "parse_report",
    "run_e2e",
    "run_selftest",
    "selftest_command",
    "selftest_source",
    "write_reports",
]
