"""`ddtree-ops selftest --e2e` without a server: option validation, the report parsing and
rendering, the script's own pure parts (parameters, token comparison), its process
handling against a fake launcher, and its plumbing end to end through the real CLI with a
host whose "SGLang" cannot launch. The real server run is tests/sglang_real/test_selftest_e2e.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import py_compile
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from cli_json import json_data
from test_selftest import _fake_site

from ddtree_ops.cli.main import AppContext
from ddtree_ops.cli.selftest import _render_e2e, e2e_options, write_reports
from ddtree_ops.errors import CommandFailed, ConfigError, PatchError
from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.selftest import DEFAULT_BUNDLE, E2E_NAME, E2eOptions, E2eResult, parse_e2e_report
from ddtree_ops.transport.hostprogram import MARKER

REPO = Path(__file__).resolve().parents[2]
SCRIPT = DEFAULT_BUNDLE / E2E_NAME
ARGV = ("python3", "-c", "<selftest_e2e.py>")


@pytest.fixture(scope="module")
def e2e() -> ModuleType:
    """The bundle's selftest_e2e.py as a module (its main() only runs as __main__)."""
    spec = importlib.util.spec_from_file_location("ddtree_selftest_e2e", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------- the bundle files


def test_e2e_script_byte_compiles(tmp_path: Path) -> None:
    py_compile.compile(str(SCRIPT), cfile=str(tmp_path / "e2e.pyc"), doraise=True)


def test_no_bundle_file_names_the_deployment_tool() -> None:
    """What runs on a host stands alone: nothing under patches/ refers to ddtree-ops."""
    offenders = []
    for path in (REPO / "patches").rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            text = path.read_bytes().decode("utf-8", errors="replace").lower()
            offenders += [f"{path.relative_to(REPO)}: {name}" for name in ("ddtree-ops", "ddtree_ops") if name in text]
    assert offenders == []


# ----------------------------------------------------------------------- CLI options


def test_e2e_options_defaults_and_lists() -> None:
    assert e2e_options(e2e=False, budgets=None, graphs=None) is None
    assert e2e_options(e2e=True, budgets=None, graphs=None) == E2eOptions((4, 8, 16, 32), ("on", "off"))
    assert e2e_options(e2e=True, budgets="16, 4", graphs="off") == E2eOptions((16, 4), ("off",))
    assert e2e_options(e2e=True, budgets="1,256", graphs="off,on") == E2eOptions((1, 256), ("off", "on"))


@pytest.mark.parametrize(
    ("budgets", "graphs", "message"),
    [
        ("0", None, "--budgets: '0' is not a tree budget"),
        ("257", None, "--budgets: '257' is not a tree budget"),
        ("4,x", None, "--budgets: 'x' is not a tree budget"),
        ("-4", None, "--budgets: '-4' is not a tree budget"),
        ("4,,16", None, "--budgets: expected a comma list"),
        ("4,4", None, "names an item twice"),
        (None, "maybe", "--graphs: 'maybe' is not a graph mode (on, off)"),
        (None, "", "--graphs: expected a comma list"),
    ],
)
def test_e2e_options_refuse_bad_values(budgets: str | None, graphs: str | None, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        e2e_options(e2e=True, budgets=budgets, graphs=graphs)
    assert message in str(info.value)


def test_budgets_and_graphs_need_e2e() -> None:
    with pytest.raises(ConfigError, match="--budgets applies to --e2e only"):
        e2e_options(e2e=False, budgets="4", graphs=None)
    with pytest.raises(ConfigError, match="--graphs applies to --e2e only"):
        e2e_options(e2e=False, budgets=None, graphs="on")


def test_params_carry_the_hosts_server_flags_and_env() -> None:
    host = Host(
        name="h",
        ddtree=DdtreeSettings(server=ServerSettings(extra_args=("--tp-size", "8"), env={"A": "1"})),
    )
    # The host's own server command too: the script launches what restart launches.
    assert E2eOptions((4,), ("off",)).params(host) == {
        "budgets": [4], "graphs": ["off"], "topk": 4, "extra_args": ["--tp-size", "8"], "env": {"A": "1"},
        "server_command": ["python3", "-m", "sglang.launch_server"],
    }
    bisect = E2eOptions((8, 9), ("on",), bisect=True).params(host)
    assert bisect["bisect"] == [8, 9] and bisect["budgets"] == [8, 9]


def test_bisect_options() -> None:
    assert e2e_options(e2e=True, budgets=None, graphs=None, bisect=True) == E2eOptions(
        (8, 9, 10, 12, 16), ("on",), bisect=True
    )
    assert e2e_options(e2e=True, budgets="9,12", graphs=None, bisect=True) == E2eOptions((9, 12), ("on",), bisect=True)
    with pytest.raises(ConfigError, match="--bisect-budgets applies to --e2e only"):
        e2e_options(e2e=False, budgets=None, graphs=None, bisect=True)
    with pytest.raises(ConfigError, match="--graphs does not apply to --bisect-budgets"):
        e2e_options(e2e=True, budgets=None, graphs="off", bisect=True)


def _inventory(tmp_path: Path, python: str) -> Path:
    path = tmp_path / "inv.yaml"
    host = {"ansible_connection": "local", "ddtree": {"python": python}}
    path.write_text(yaml.safe_dump({"all": {"hosts": {"h1": host}}}))
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--e2e", "--budgets", "0"], "--budgets: '0' is not a tree budget"),
        (["--e2e", "--graphs", "on,eager"], "--graphs: 'eager' is not a graph mode"),
        (["--budgets", "4"], "--budgets applies to --e2e only"),
        (["--e2e", "--out", "FILE"], "exists and is not a directory"),
        (["--out", "NODIR/reports"], "directory NODIR does not exist"),
    ],
)
def test_cli_refuses_bad_options_in_one_line_before_any_host(
    cli, tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "FILE").write_text("")
    # The host's python does not exist: reaching the host would be a different error.
    inv = _inventory(tmp_path, str(tmp_path / "no-python"))
    args = [str(tmp_path / a) if a.startswith(("FILE", "NODIR")) else a for a in args]
    res = cli("-i", str(inv), "selftest", "h1", *args)
    assert res.exit_code == 2, res
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    message = message.replace("NODIR", str(tmp_path / "NODIR"))
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr
    assert not (tmp_path / "NODIR").exists()


# --------------------------------------------------------------------- report parsing


def _run(budget: int, graphs: str, **kw: object) -> dict:
    run = {
        "budget": budget, "graphs": graphs, "ok": True, "served": True, "equal": True, "compared_tokens": 128,
        "divergences": 0, "first_divergence": None, "accept_length": 1.4, "max_logprob_delta": 3e-6,
        "verify_cuda_graph_captured": graphs == "on", "verify_cuda_graph_max_bs": 48 if graphs == "on" else None,
        "verify_attention_backend": "FlashInferAttnBackend",
        "decode_cuda_graph": "full" if graphs == "on" else "disabled", "startup_s": 61.0, "error": None,
    }
    run.update(kw)
    return run


def _report(**kw: object) -> dict:
    report = {
        "ok": True, "deployed": True, "sglang_version": "0.5.23", "device": "NVIDIA H200 x1", "kernel": "available",
        "checks": {"golden_encoding": {"ok": True, "detail": "x"}, "kernel_vs_reference": {"ok": True, "detail": "y"}},
        "baseline": {"served": True, "startup_s": 55.0, "error": None},
        "runs": [_run(4, "on"), _run(4, "off")],
        "graph_capture": {"4": True},
        "seconds": 300.0, "error": None,
    }
    report.update(kw)
    return report


def _parse(report: dict, rc: int = 0, stdout_prefix: str = "") -> E2eResult:
    return parse_e2e_report("gpu-1", rc, stdout_prefix + "\n" + MARKER + json.dumps(report) + "\n", "", ARGV)


def test_parse_a_passing_report() -> None:
    r = _parse(_report(), stdout_prefix="some warning\n")
    assert r.ok and r.host == "gpu-1" and r.kernel == "available" and r.device == "NVIDIA H200 x1"
    assert [(x.budget, x.graphs, x.verdict) for x in r.runs] == [(4, "on", "equal"), (4, "off", "equal")]
    assert dict(r.graph_capture) == {4: True}
    assert r.runs[0].verify_cuda_graph_captured is True and r.runs[1].decode_cuda_graph == "disabled"
    assert (r.runs[0].verify_cuda_graph_max_bs, r.runs[1].verify_cuda_graph_max_bs) == (48, None)
    assert r.baseline_startup_s == 55.0 and r.failed_checks == []
    d = r.as_dict()
    assert d["host"] == "gpu-1" and d["ok"] is True and d["runs"][0]["budget"] == 4


def test_a_near_tie_passes_as_tie_and_a_real_divergence_fails() -> None:
    tie = {"batch": 3, "prompt": 1, "position": 9, "margin": 0.004, "verdict": "tie", "want": 20, "got": 22}
    r = _parse(_report(runs=[_run(16, "on", equal=False, divergences=1, first_divergence=tie)]))
    assert r.ok and r.runs[0].verdict == "tie"
    assert r.runs[0].first_divergence is not None and r.runs[0].first_divergence.margin == 0.004
    hard = dict(tie, margin=0.7, verdict="diverged")
    bad = _parse(_report(ok=False, runs=[_run(16, "on", ok=False, equal=False, first_divergence=hard,
                                              error="diverged from the target alone at token 9")]), rc=1)
    assert not bad.ok and bad.runs[0].verdict == "FAILED"


def test_any_failure_makes_the_host_fail_even_if_the_report_claims_ok() -> None:
    failed_run = _report(runs=[_run(32, "on", ok=False, served=False, error="the server exited with code 1")])
    assert not _parse(failed_run).ok
    failed_check = _report(checks={"kernel_vs_reference": {"ok": False, "detail": "mismatch"}})
    assert not _parse(failed_check).ok and _parse(failed_check).failed_checks == ["kernel_vs_reference"]
    assert not _parse(_report(runs=[])).ok  # nothing ran: nothing passed
    assert not _parse(_report(), rc=1).ok
    no_baseline = _parse(_report(ok=False, runs=[], error="the target alone did not serve: x"), rc=1)
    assert not no_baseline.ok and no_baseline.error == "the target alone did not serve: x"


def test_not_deployed_bad_exit_and_no_json_are_errors() -> None:
    with pytest.raises(PatchError, match="bundle not deployed"):
        _parse({"ok": False, "deployed": False, "error": "bundle not deployed: x is missing"}, rc=2)
    with pytest.raises(PatchError, match="sglang is not installed"):
        _parse({"ok": False, "deployed": False, "error": "sglang is not installed for /usr/bin/python3"}, rc=2)
    with pytest.raises(PatchError, match="selftest: torch does not import"):
        _parse({"ok": False, "deployed": True, "error": "torch does not import: x"}, rc=2)
    with pytest.raises(CommandFailed, match="no JSON report"):
        parse_e2e_report("gpu-1", 137, "Traceback ...\n", "Killed", ARGV)


def _rendered(results: dict[str, object]) -> tuple[bool, str]:
    """(whether any host failed, the table as text), wide enough not to wrap cells."""
    obj = AppContext(json=False)
    with obj.console.capture() as cap:
        width = obj.console.width
        obj.console.width = 250
        try:
            failed = _render_e2e(obj, results)
        finally:
            obj.console.width = width
    return failed, cap.get()


def test_rendering_one_row_per_host_budget_and_graph_mode() -> None:
    tie = {"batch": 3, "prompt": 1, "position": 9, "margin": 0.004, "verdict": "tie"}
    good = _parse(_report(runs=[_run(4, "on"), _run(16, "on", equal=False, first_divergence=tie)]))
    crashed = _run(32, "on", ok=False, served=False, verify_cuda_graph_captured=None,
                   error="the server exited with code 1 before it was ready")
    bad = _parse(_report(ok=False, runs=[crashed]), rc=1)
    refused = _run(8, "off", ok=False, error="POST /generate failed: [Errno 111] refused")
    lost = _parse(_report(ok=False, runs=[refused]))
    failed, out = _rendered({"a": good, "b": bad, "c": PatchError("bundle not deployed: x", host="c"), "d": lost})
    assert failed is True
    assert "FAILED: POST /generate failed: [Errno 111] refused" in out  # not taken for markup
    assert "equal" in out and "tie at token 9 (margin 0.004)" in out
    assert "FAILED: the server exited with code 1 before it was ready" in out
    assert "c: bundle not deployed: x" in out and "2 checks passed" in out and "FlashInferAttnBackend" in out
    # Each graph launch names its graph ceiling, and a line says what it means.
    assert "yes, batch <= 48" in out and "concurrency above it runs eager" in out
    assert _rendered({"a": good})[0] is False


def test_reports_are_written_per_host(tmp_path: Path) -> None:
    good = _parse(_report())
    paths = write_reports(tmp_path / "out", {"gpu-1": good, "gpu-2": PatchError("bundle not deployed", host="gpu-2")})
    assert [p.name for p in paths] == ["gpu-1.json", "gpu-2.json"]
    assert json.loads(paths[0].read_text())["runs"][1]["graphs"] == "off"
    assert json.loads(paths[1].read_text()) == {"host": "gpu-2", "ok": False, "error": "gpu-2: bundle not deployed"}


# ------------------------------------------------------------- the script's pure parts


def test_script_parameters(e2e: ModuleType) -> None:
    p = e2e.parse_params({})
    assert p["budgets"] == [4, 8, 16, 32] and p["graphs"] == ["on", "off"] and p["tie_margin"] == 0.02
    assert e2e.parse_params({"budgets": [16, 4, 16], "graphs": ["off"]})["budgets"] == [16, 4]
    for bad, key in (
        ({"budget": [4]}, "unknown parameter(s): budget"),
        ({"budgets": [0]}, "budgets"),
        ({"budgets": [True]}, "budgets"),
        ({"graphs": ["eager"]}, "graphs"),
        ({"prompts": [[1, 5000]]}, "prompts"),
        ({"env": {"A": 1}}, "env"),
        ({"extra_args": "--tp-size 8"}, "extra_args"),
    ):
        with pytest.raises(ValueError, match=key.replace("(", r"\(").replace(")", r"\)")):
            e2e.parse_params(bad)


def test_script_keeps_secrets_out_of_its_report(e2e: ModuleType) -> None:
    args = ["--api-key", "s3cret", "--tp-size", "8", "--admin-api-key=x"]
    assert e2e._redacted(args) == ["--api-key", "***", "--tp-size", "8", "--admin-api-key=***"]
    assert e2e._api_key(args) == "s3cret" and e2e._api_key(["--api-key=k"]) == "k" and e2e._api_key([]) is None


def _out(ids: list[int], tops: list[list[float]] | None = None) -> dict:
    """One /generate output; ``tops``: the top-2 log-probs per position."""
    tops = tops or [[-0.1, -2.0]] * len(ids)
    return {"output_ids": ids, "meta_info": {
        "output_top_logprobs": [[[a, t, None], [b, t + 1, None]] for (a, b), t in zip(tops, ids, strict=True)],
        "spec_accept_length": 1.5, "spec_verify_ct": 4,
    }}


def test_compare_equal_tie_and_divergence(e2e: ModuleType) -> None:
    want = [_out([5, 6, 7, 8]), _out([9, 10, 11])]
    same = e2e.compare([(want, [_out([5, 6, 7, 8]), _out([9, 10, 11])])], 0.02)
    assert same == {"equal": True, "compared_tokens": 7, "divergences": 0, "first_divergence": None,
                    "max_logprob_delta": 0.0}

    near = [_out([5, 6, 7, 8], [[-0.1, -2.0], [-0.69, -0.7], [-0.1, -2.0], [-0.1, -2.0]]), _out([9, 10, 11])]
    late = e2e.compare([(near, [_out([5, 6, 99, 98]), _out([9, 10, 11])])], 0.02)
    assert not late["equal"] and late["compared_tokens"] == 2 + 3 and late["divergences"] == 1
    assert late["first_divergence"] == {"batch": 2, "prompt": 0, "position": 1 + 1, "margin": 1.9,
                                       "verdict": "diverged", "want": 7, "got": 99}

    flip = e2e.compare([(near, [_out([5, 99, 7, 8]), _out([9, 10, 11])])], 0.02)
    assert flip["first_divergence"]["verdict"] == "tie" and flip["first_divergence"]["margin"] == pytest.approx(0.01)

    # A tie in one request and a real divergence in another: the real one is reported.
    both = e2e.compare([(near[:1], [_out([5, 99, 7, 8])]), (want[1:], [_out([9, 12, 11])])], 0.02)
    assert both["divergences"] == 2 and both["first_divergence"]["verdict"] == "diverged"
    assert both["first_divergence"]["position"] == 1 and both["first_divergence"]["batch"] == 1

    short = e2e.compare([([_out([5, 6, 7])], [_out([5, 6])])], 0.02)
    assert short["first_divergence"]["position"] == 2 and short["first_divergence"]["verdict"] == "diverged"
    assert short["first_divergence"]["margin"] is None

    delta = e2e.compare([([_out([5], [[-0.1, -2.0]])], [_out([5], [[-0.15, -2.0]])])], 0.02)
    assert delta["equal"] and delta["max_logprob_delta"] == pytest.approx(0.05)
    assert e2e.accept_length([[_out([1])], [_out([2]), {"output_ids": [3], "meta_info": {}}]]) == 1.5


# ---------------------------------------------------------- processes and the real CLI


def _fake_sglang(root: Path, launch_server: str, *, deployed: bool = True) -> Path:
    """test_selftest's fake site made to look installed (a dist-info) with a
    ``sglang.launch_server`` of ``launch_server``; returns the python wrapper that sees it."""
    wrapper = _fake_site(root, deployed=deployed)
    site = root / "site"
    (site / "sglang" / "launch_server.py").write_text(launch_server)
    (site / "sglang-0.5.23.dist-info").mkdir()
    (site / "sglang-0.5.23.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")
    # The models are written with safetensors, which SGLang hosts have and this venv need not.
    (site / "safetensors").mkdir()
    (site / "safetensors" / "__init__.py").write_text("")
    (site / "safetensors" / "torch.py").write_text(
        "def save_file(tensors, path, metadata=None):\n    open(path, 'wb').close()\n"
    )
    return wrapper


READY_FOREVER = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print('The server is fired up and ready to roll!', flush=True)\n"
    "time.sleep(600)\n"
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_server_stop_ends_the_launchers_whole_group(
    e2e: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fake's child ignores the launcher's end: the group SIGKILL after the grace ends it.
    monkeypatch.setattr(e2e, "STOP_GRACE_S", 1.0)
    _fake_sglang(tmp_path, READY_FOREVER, deployed=False)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    with e2e.Server("fake", "model", [], env, str(tmp_path)) as srv:
        srv.start(timeout=60)
        pgid = srv.proc.pid
        assert len(e2e._group_pids(pgid)) == 2  # the launcher and its child
    assert e2e._group_pids(pgid) == [] and srv.proc is None


def test_a_launch_that_dies_is_reported_with_its_log_and_a_capture_crash_by_name(
    e2e: ModuleType, tmp_path: Path
) -> None:
    crash = (
        "print('Capture target verify CUDA graph begin.')\n"
        "print('Capture cuda graph failed: CUDA error: an illegal memory access was encountered')\n"
        "print('Scheduler hit an exception:', flush=True)\n"
        "raise SystemExit(1)\n"
    )
    _fake_sglang(tmp_path, crash, deployed=False)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    with e2e.Server("fake", "model", [], env, str(tmp_path)) as srv, pytest.raises(e2e.LaunchError) as info:
        srv.start(timeout=60)
    assert str(info.value) == (
        "CUDA-graph capture failed: Capture cuda graph failed: CUDA error: an illegal memory access was encountered"
    )
    assert "Scheduler hit an exception:" in info.value.log_tail


def test_a_launcher_dies_with_the_script_even_on_sigkill(e2e: ModuleType, tmp_path: Path) -> None:
    _fake_sglang(tmp_path, READY_FOREVER, deployed=False)
    driver = (
        "import importlib.util, os, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('e2e', {str(SCRIPT)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"env = dict(os.environ, PYTHONPATH={str(tmp_path / 'site')!r})\n"
        f"srv = m.Server('fake', 'model', [], env, {str(tmp_path)!r})\n"
        "srv.start(60)\n"
        "print(srv.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    launcher = None
    try:
        assert proc.stdout is not None
        launcher = int(proc.stdout.readline())
        assert _alive(launcher)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while _alive(launcher) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(launcher), "the server launcher outlived the SIGKILLed script"
    finally:
        proc.kill()
        if launcher is not None:
            try:
                os.killpg(launcher, signal.SIGKILL)  # the fake's own child has no death signal
            except ProcessLookupError:
                pass


def test_cli_e2e_runs_the_checks_and_reports_a_server_that_cannot_start(cli, tmp_path: Path) -> None:
    """The whole path without a real SGLang: bootstrap, parameters and selftest.py on stdin,
    the checks in the report, the launch failure with its log tail, one row, exit 4 (the
    one failed host's own code: a selftest failure is a PatchError)."""
    python = _fake_sglang(tmp_path, "print('Load weight begin.', flush=True)\nraise SystemExit(3)\n")
    inv = _inventory(tmp_path, str(python))
    res = cli("-i", str(inv), "--json", "selftest", "h1", "--e2e", "--budgets", "4", "--graphs", "off",
              "--out", str(tmp_path / "reports"))
    assert res.exit_code == 4, res
    [row] = json_data(res.stdout)
    assert row["host"] == "h1" and row["ok"] is False and row["deployed"] is True
    assert {"golden_encoding", "greedy_walk"} <= set(row["checks"])
    assert all(c["ok"] for c in row["checks"].values())
    assert row["kernel"].startswith("not available")
    assert row["baseline"]["served"] is False
    assert "exited with code 3 before it was ready" in row["baseline"]["error"]
    assert "Load weight begin." in row["baseline"]["log_tail"]
    assert row["error"].startswith("the target alone did not serve") and row["runs"] == []
    assert row["params"]["budgets"] == [4] and row["params"]["graphs"] == ["off"]
    assert json.loads((tmp_path / "reports" / "h1.json").read_text()) == row


def test_cli_e2e_says_bundle_not_deployed(cli, tmp_path: Path) -> None:
    python = _fake_sglang(tmp_path, "raise SystemExit(3)\n", deployed=False)
    res = cli("-i", str(_inventory(tmp_path, str(python))), "--json", "selftest", "h1", "--e2e")
    assert res.exit_code == 4, res
    [row] = json_data(res.stdout)
    assert row["ok"] is False and row["error"].startswith("h1: bundle not deployed"), row
    assert "h1" in res.stderr.splitlines()[-1]
