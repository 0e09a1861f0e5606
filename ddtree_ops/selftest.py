"""The DDTree bundle's self-tests on a host, against the files deployed there: what
``ddtree-ops selftest [--e2e]`` runs and reads.

``selftest.py`` is sent to the host's own interpreter (``ddtree.python``) as a host
program (:mod:`ddtree_ops.transport.hostprogram`), so nothing is copied to the host and
the interpreter that SGLang runs under is the one that loads the deployed
``ddtree_utils.py``. One remote command per host; its one report becomes a
:class:`SelftestResult` (or a clear error).

``selftest_e2e.py`` (``--e2e``) travels the same way with ``selftest.py``'s text and its
parameters in the payload: it launches the host's real SGLang with tiny random-weight
models, once alone and once per (budget, decode-graph mode) with DDTREE, compares greedy
outputs token for token and reports what ``/server_info`` says about the verify path,
plus ``selftest.py``'s checks; with ``bisect``, the first failing budget. Its report
becomes an :class:`E2eResult` (frozen, parsed here, pure).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ddtree_ops.errors import BundleError, CommandFailed, PatchError
from ddtree_ops.inventory_types import Host
from ddtree_ops.limits import MAX_DDTREE_BUDGET
from ddtree_ops.shipped import DEFAULT_BUNDLE
from ddtree_ops.transport.base import Transport
from ddtree_ops.transport.hostprogram import last_message, run_program

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
MAX_BUDGET = MAX_DDTREE_BUDGET  # --speculative-num-draft-tokens 2..257


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
    """The script's report (its message: transport/hostprogram.py), or a clear error.

    Exit 2 means the script could not test at all (bundle not deployed, no torch, no
    sglang): that is an error for the host, not a failed check.
    """
    report = last_message(stdout)
    if report is None:
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
    result = run_program(transport, host.python, source, {}, timeout=timeout).result
    return parse_report(host.name, result.returncode, result.stdout, result.stderr, (host.python, "-c", "<selftest>"))


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
    # The launch's graph ceiling: the largest batch its verify graph replays (a larger
    # batch runs eager); None without a graph, or from a bundle that predates it.
    verify_cuda_graph_max_bs: int | None = None
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


def _opt_positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


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
        verify_cuda_graph_max_bs=_opt_positive_int(raw.get("verify_cuda_graph_max_bs")),
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
    payload = {"params": options.params(host), "selftest": selftest}
    result = run_program(transport, host.python, source, payload, timeout=timeout).result
    return parse_e2e_report(
        host.name, result.returncode, result.stdout, result.stderr, (host.python, "-c", f"<{E2E_NAME}>")
    )


# ---------------------------------------------------------------------------- command


__all__ = [
    "BisectStep",
    "Bisection",
    "CheckResult",
    "Divergence",
    "E2eOptions",
    "E2eResult",
    "E2eRun",
    "SelftestResult",
    "parse_e2e_report",
    "parse_report",
    "run_e2e",
    "run_selftest",
    "selftest_source",
]
