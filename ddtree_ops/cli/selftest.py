"""`ddtree-ops selftest TARGET [--e2e]`: run the bundle's self-tests on each host
(:mod:`ddtree_ops.selftest`) and render one row per host, or per (host, budget, graph
mode) with ``--e2e``; ``--bisect-budgets`` records what it finds as eager fallbacks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import typer
from rich.text import Text

from ddtree_ops.cli.common import (
    WIDE_HELP,
    TableColumn,
    check_output_path,
    fitted_table,
    graph_mode,
    load_hosts,
    print_table,
    raise_if_failed,
    set_json_data,
    transport_for,
)
from ddtree_ops.cli.main import AppContext, app
from ddtree_ops.errors import ConfigError, DdtreeOpsError, PatchError
from ddtree_ops.fleet import run_on_hosts
from ddtree_ops.inventory_types import Host
from ddtree_ops.numbers import parse_count, shown
from ddtree_ops.selftest import (
    BISECT_BUDGETS,
    DEFAULT_BUNDLE,
    DEFAULT_TIMEOUT_S,
    E2E_GRAPHS,
    E2E_NAME,
    E2E_TIMEOUT_S,
    MAX_BUDGET,
    Bisection,
    E2eOptions,
    E2eResult,
    E2eRun,
    SelftestResult,
    run_e2e,
    run_selftest,
    selftest_source,
)


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
            budget = parse_count(item)  # ASCII digits: '²'.isdigit() is true, and int() refuses it
            if budget is None or not 1 <= budget <= MAX_BUDGET:
                raise ConfigError(f"--budgets: {shown(item)} is not a tree budget (an integer in 1..{MAX_BUDGET})")
            values.append(budget)
        picked = E2eOptions(budgets=tuple(values), graphs=picked.graphs, bisect=picked.bisect)
    if graphs is not None:
        modes = _comma_list("--graphs", graphs)
        bad = [m for m in modes if m not in E2E_GRAPHS]
        if bad:
            raise ConfigError(f"--graphs: {bad[0]!r} is not a graph mode (on, off)")
        picked = E2eOptions(budgets=picked.budgets, graphs=tuple(modes))
    return picked


def _summary(result: SelftestResult) -> str:
    if result.ok:
        return f"{len(result.checks)} checks passed"
    return "failed: " + ", ".join(result.failed_checks)


def _render(obj: AppContext, results: Mapping[str, Any], *, wide: bool = False) -> bool:
    """Render one row per host as a table that fits the terminal. True if any failed."""
    any_failed = any(not (isinstance(r, SelftestResult) and r.ok) for r in results.values())
    columns = (TableColumn("host", wrap=True), TableColumn("result", wrap=True), TableColumn("kernel", wrap=True),
               TableColumn("torch", drop=1), TableColumn("seconds", "right"))
    rows: list[list[str | Text]] = []
    for name, r in results.items():
        if isinstance(r, SelftestResult):
            rows.append([name, Text(_summary(r), style="green" if r.ok else "red"), r.kernel, r.torch or "",
                         f"{r.seconds or 0:.1f}"])
            if obj.verbose:
                for check, c in r.checks.items():
                    rows.append(["", f"  {check}: {'ok' if c.ok else 'FAILED'}", c.detail, "", ""])
        else:
            msg = str(r) if isinstance(r, DdtreeOpsError) else f"{type(r).__name__}: {r}"
            rows.append([name, Text(f"error: {msg}", style="red"), "", "", ""])
    print_table(obj.console, fitted_table(columns, rows, width=obj.console.width, wide=wide, title="selftest"))
    return any_failed


def _run_cell(run: E2eRun) -> Text:
    """The result column of one e2e row."""
    if run.verdict == "equal":
        return Text("equal", style="green")
    d = run.first_divergence
    where = f" at token {d.position} (margin {d.margin:.3g})" if d is not None and d.margin is not None else ""
    if run.verdict == "tie":
        return Text(f"tie{where}", style="yellow")
    return Text(f"FAILED: {run.error or 'diverged' + where}", style="red")


def _yes_no(value: bool | None) -> str:
    return "" if value is None else ("yes" if value else "no")


def _graph_cell(run: E2eRun) -> str:
    """Whether the verify graph was captured, and its ceiling: the largest batch it replays."""
    if run.verify_cuda_graph_captured and run.verify_cuda_graph_max_bs is not None:
        return f"yes, batch <= {run.verify_cuda_graph_max_bs}"
    return _yes_no(run.verify_cuda_graph_captured)


def _render_e2e(obj: AppContext, results: Mapping[str, Any], *, wide: bool = False) -> bool:
    """One row per (host, budget, graph mode), after a row with the host's checks. True if
    any host failed. At 80 columns the result keeps the room (errors are long) and the
    lesser columns give way, named in the caption."""
    any_failed = any(not (isinstance(r, E2eResult) and r.ok) for r in results.values())
    columns = (
        TableColumn("host", wrap=True), TableColumn("budget", "right"), TableColumn("mode"),
        TableColumn("result", wrap=True), TableColumn("graph captured", wrap=True, drop=1),
        TableColumn("accept length", "right", drop=2), TableColumn("verify backend", drop=3),
        TableColumn("startup s", "right", drop=4),
    )
    rows: list[list[str | Text]] = []
    for name, r in results.items():
        if not isinstance(r, E2eResult):
            msg = str(r) if isinstance(r, DdtreeOpsError) else f"{type(r).__name__}: {r}"
            rows.append([name, "", "", Text(f"error: {msg}", style="red"), "", "", "", ""])
            continue
        checks = f"{len(r.checks)} checks passed" if not r.failed_checks else "failed: " + ", ".join(r.failed_checks)
        head = Text(checks, style="red" if r.failed_checks else "green")
        head.append(f"; kernel {r.kernel}; sglang {r.sglang_version or '?'} on {r.device or '?'}")
        rows.append([name, "checks", "", head, "", "", "", f"{r.baseline_startup_s or 0:.0f}"])
        for run in r.runs:
            accept = "" if run.accept_length is None else f"{run.accept_length:.2f}"
            rows.append(["", str(run.budget), graph_mode(run.graphs != "off"), _run_cell(run), _graph_cell(run),
                         accept, run.verify_attention_backend or "", f"{run.startup_s or 0:.0f}"])
        if r.bisect is not None:
            for step in r.bisect.tried:
                cell = Text("served", style="green") if step.ok else Text(f"FAILED: {step.error or ''}", style="red")
                rows.append(["", str(step.budget), graph_mode(True), cell, _yes_no(step.captured), "", "", ""])
            rows.append(["", "", "", _bisect_summary(r.bisect), "", "", "", ""])
        if r.error:
            rows.append(["", "", "", Text(f"error: {r.error}", style="red"), "", "", "", ""])
    table = fitted_table(columns, rows, width=obj.console.width, wide=wide, title="selftest --e2e")
    print_table(obj.console, table)
    if any(run.verify_cuda_graph_max_bs is not None for r in results.values() if isinstance(r, E2eResult)
           for run in r.runs):
        obj.console.print("graph captured: batch <= N is the launch's graph ceiling per budget, the largest batch "
                          "its verify graph replays; concurrency above it runs eager (--cuda-graph-max-bs-decode "
                          "raises it).", highlight=False, markup=False)
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
    from ddtree_ops.fsutil import replace_file, write_problem

    try:
        out.mkdir(exist_ok=True)
        written = []
        for name, r in results.items():
            path = out / f"{name.replace('/', '_')}.json"
            # Replaced atomically (fsutil): a link at the name is replaced, never written through.
            data = (json.dumps(_host_dict(name, r), indent=2, sort_keys=True) + "\n").encode()
            replace_file(path, lambda fh: fh.write(data))  # noqa: B023 (called here, at once)
            written.append(path)
    except OSError as exc:
        raise ConfigError(f"--out: cannot write the reports into {out} ({write_problem(exc)})") from None
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
    wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
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
    if options is not None and options.bisect:
        from ddtree_ops.state import StateStore

        # The bisection's finding is remembered there after minutes of launches: a state
        # file that cannot take it is refused now, before any host is touched.
        StateStore().check()

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
        _render_e2e(obj, results, wide=wide) if options is not None else _render(obj, results, wide=wide)
    raise_if_failed("selftest", results, failure=_failed_checks)


def _failed_checks(result: SelftestResult | E2eResult) -> BaseException | None:
    """A host whose script ran but reported a failure fails the command too."""
    if result.ok:
        return None
    what = ", ".join(result.failed_checks) or (
        "; ".join(f"budget {r.budget} {graph_mode(r.graphs != 'off')}: {r.verdict}"
                  for r in getattr(result, "runs", ()) if not r.ok)
        or getattr(result, "error", None) or "failed"
    )
    return PatchError(f"selftest: {what}", host=result.host)


__all__ = ["check_out_dir", "e2e_options", "selftest_command", "write_reports"]
