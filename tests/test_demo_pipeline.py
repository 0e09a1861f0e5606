"""`make demo` end to end, shortened by settings: doctor -> deploy -> status -> restart ->
bench -> report, through the real CLI entry point, on two local simulated hosts.

The hosts are the shipped ``inventories/local.yaml`` with its paths and ports moved into
the test: each has its own Python prefix holding the real SGLang 0.5.23 files (copied
from the test fleet's cached template), is served by ``{python} -m ddtree_ops.sim`` with
the RTX PRO 6000 or the B300 profile on a free loopback port, and keeps its run dir, the
state file and every output under the test's tmp dir. The sweep is the shipped
``bench_configs/demo.yaml`` cut down to an autoregressive baseline and DDTree budgets
4 and 16 at top-k 4, one temperature, concurrency 1 and a few short requests, so that
the whole chain runs in well under a minute while keeping what the demo shows: the
B300 profile cannot capture CUDA graphs for budget 16 and falls back to eager mode, and
every later step (ledger, CSVs, plots) carries that.
"""

from __future__ import annotations

import csv
import hashlib
import shutil
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from cli_json import json_data
from fleetlib import cached_prefix_template, fast_root, find_wheel, free_port

from ddtree_ops.bench import ledger
from ddtree_ops.inventory import load_inventory
from ddtree_ops.patching.bundle import load_bundle
from ddtree_ops.service import lifecycle
from ddtree_ops.transport.local import LocalTransport

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "patches" / "ddtree_temperature"
# Fast but inside the simulator's safe range (sim/README.md): launches still log every
# SGLang phase and the B300 capture failure, a simulated second is 100 ms.
FAST_SIM_ENV = {"SIM_LOAD_S": "2", "SIM_WARMUP_S": "1", "SIM_TIME_SCALE": "0.1", "SIM_SEED": "0"}
NUM_PROMPTS = 3
MAX_NEW_TOKENS = 16
BUDGETS = (4, 16)
TOPK = 4
TEMPERATURE = 0.0  # greedy: the simulated tokens, hence acceptance, are deterministic
# AR baseline + one DDTree cell per budget, at one temperature and one concurrency.
ROWS_PER_HOST = 1 + len(BUDGETS)
PLOT_KINDS = ("throughput", "accept-length", "speedup-heatmap", "pareto")


@dataclass(frozen=True)
class DemoHost:
    name: str
    gpu: str
    prefix: Path
    port: int
    # One per server: the host's port, or each GPU slot's (the slots' count form derives
    # port + i, as the shipped sim-ct200 has two).
    ports: tuple[int, ...] = ()
    slots: tuple[str, ...] = ()

    @property
    def sglang_dir(self) -> Path:
        purelib = sysconfig.get_path("purelib", vars={"base": str(self.prefix), "platbase": str(self.prefix)})
        return Path(purelib) / "sglang"


@dataclass(frozen=True)
class DemoFleet:
    inventory: Path
    sweep: Path
    hosts: dict[str, DemoHost]

    def by_gpu(self, gpu: str) -> DemoHost:
        return next(h for h in self.hosts.values() if h.gpu == gpu)


def _short_sweep(path: Path) -> Path:
    """bench_configs/demo.yaml with its grid and workload cut down to a few seconds a host."""
    spec = yaml.safe_load((REPO / "bench_configs" / "demo.yaml").read_text())
    spec["baselines"] = ["autoregressive"]
    spec["grid"] = {
        "algorithm": ["ddtree"],
        "budget": list(BUDGETS),
        "topk": [TOPK],
        "temperature": [TEMPERATURE],
        "concurrency": [1],
    }
    spec["workload"] = {**spec["workload"], "num_prompts": NUM_PROMPTS, "max_new_tokens": MAX_NEW_TOKENS}
    spec.update(repeats=1, warmup=1, request_timeout_s=60)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture
def demo_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[DemoFleet]:
    """The shipped local inventory, each host with its own prefix, port and run dir here.

    The finaliser stops whatever server each host still runs, also when the test failed
    halfway (restart leaves servers up; bench stops only the ones it started).
    """
    monkeypatch.setenv("DDTREE_OPS_STATE", str(tmp_path / "state.json"))
    monkeypatch.delenv("DDTREE_OPS_INVENTORY", raising=False)
    # Nothing may land in the repository (results/, relative defaults).
    monkeypatch.chdir(tmp_path)

    shipped = yaml.safe_load((REPO / "inventories" / "local.yaml").read_text())
    group = shipped["all"]["children"]["local"]
    template = cached_prefix_template(find_wheel())
    # Prefixes are ~130 MB each: on tmpfs when there is one, as the ssh test fleet does.
    root, owned = fast_root(tmp_path / "prefixes")
    hosts: dict[str, DemoHost] = {}
    inventory = tmp_path / "local.yaml"
    try:
        for name, entry in group["hosts"].items():
            ddtree = entry["ddtree"]
            prefix = root / name
            shutil.copytree(template, prefix, symlinks=True, ignore=shutil.ignore_patterns(".ready"))
            count = int(ddtree["server"].get("slots", {}).get("count", 1))
            port = free_port(count)  # never `make demo`'s own ports (testports.RESERVED)
            ddtree["python"] = str(prefix / "bin" / "python")
            ddtree["run_dir"] = str(tmp_path / "run" / name)
            ddtree["server"]["port"] = port
            ddtree["server"]["env"] = {**ddtree["server"].get("env", {}), **FAST_SIM_ENV}
            slots = tuple(f"{name}/{i}" for i in range(count)) if "slots" in ddtree["server"] else ()
            hosts[name] = DemoHost(name=name, gpu=ddtree["gpu"], prefix=prefix, port=port,
                                   ports=tuple(range(port, port + count)), slots=slots)
        assert sorted(h.gpu for h in hosts.values()) == ["b300", "rtx-pro-6000"], "local.yaml changed its hosts"
        assert [len(h.slots) for h in hosts.values()] == [2, 0], "local.yaml: sim-ct200 runs two GPU slots"
        inventory.write_text(yaml.safe_dump(shipped, sort_keys=False))
        yield DemoFleet(inventory=inventory, sweep=_short_sweep(tmp_path / "demo_short.yaml"), hosts=hosts)
    finally:
        try:
            _stop_servers(inventory)
        finally:
            if owned:
                shutil.rmtree(root, ignore_errors=True)


def _stop_servers(inventory: Path) -> None:
    """Stop each host's server (a no-op where none runs); an inventory never written means
    nothing was started."""
    if not inventory.exists():
        return
    errors: list[BaseException] = []
    for host in (s for h in load_inventory([inventory]).resolve("local") for s in h.slot_hosts()):
        try:
            with LocalTransport(host.name) as t:
                lifecycle.stop(t, host, grace_s=5.0)
        except Exception as exc:  # one host's failure must not leave the other's server running
            errors.append(exc)
    if errors:
        raise errors[0]


def _ok_json(result: Any, what: str) -> Any:
    assert result.exit_code == 0, f"{what} exited {result.exit_code}:\n{result.stderr[-3000:]}\n{result.stdout[-3000:]}"
    return json_data(result.stdout)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _csv_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_demo_pipeline_on_two_simulated_hosts(demo_fleet: DemoFleet, cli: Callable[..., Any], tmp_path: Path) -> None:
    inv = ("-i", str(demo_fleet.inventory))
    rtx, b300 = demo_fleet.by_gpu("rtx-pro-6000"), demo_fleet.by_gpu("b300")
    names = set(demo_fleet.hosts)

    # doctor: both prefixes hold SGLang 0.5.23 and the server ports are free.
    doctor = _ok_json(cli("--json", *inv, "doctor", "local"), "doctor")
    assert doctor["ok"] is True
    facts = {h["host"]: h["result"] for h in doctor["hosts"]}
    assert set(facts) == names
    for name, f in facts.items():
        host = demo_fleet.hosts[name]
        assert f["sglang_version"] == "0.5.23", f
        assert Path(f["sglang_dir"]).resolve() == host.sglang_dir.resolve(), f
        assert f["port"] == host.port and f["port_in_use"] is False, f

    # deploy: the real bundle is applied on both hosts and the files on disk are the bundle's.
    # Keys as plans and status name them: relative to the package, "../<path>" for an
    # entry beside it (root: site-packages, the plugin's dist-info).
    bundle_files = load_bundle(BUNDLE).files
    planned = {f.path for f in bundle_files}
    deployed = _ok_json(cli("--json", *inv, "deploy", "local", str(BUNDLE)), "deploy")
    assert {r["host"] for r in deployed} == names
    identities = {row["host"]: row["plan"]["identity"] for row in deployed}
    for row in deployed:
        assert row["ok"] is True and row["outcome"] == "applied", row
        assert {f["path"] for f in row["plan"]["files"]} == planned, row
    for host in demo_fleet.hosts.values():
        for f in bundle_files:
            assert _sha256(host.sglang_dir / f.path) == f.sha256, f"{host.name}: {f.path} not deployed"

    # status: the bundle is recorded and every one of its files reads as patched.
    status = _ok_json(cli("--json", *inv, "status", "local", "--bundle", str(BUNDLE)), "status")
    assert {r["host"] for r in status} == names
    for row in status:
        assert row["ok"] is True and row["package_version"] == "0.5.23", row
        assert row["bundle"]["name"] == "ddtree_temperature", row
        assert row["bundle"]["identity"] == identities[row["host"]], row
        states = {f["path"]: f["state"] for f in row["files"]}
        assert states == dict.fromkeys(planned, "patched"), row
        assert row["journal"] is None and row["lock"] is None, row

    # restart on DDTree budget 16: CUDA graphs on the RTX host, eager fallback on the B300 one.
    restarted = _ok_json(
        cli("--json", *inv, "restart", "local", "--algorithm", "DDTREE", "--budget", "16", "--topk", "4"), "restart"
    )
    assert restarted["ok"] is True
    results = {h["host"]: h["result"] for h in restarted["hosts"]}
    assert set(results) == {*rtx.slots, b300.name}  # one row per server: the RTX host's two slots
    on_b300 = results[b300.name]
    for slot in rtx.slots:
        on_rtx = results[slot]
        assert on_rtx["cuda_graph"] is True and on_rtx["fallback_reason"] is None and on_rtx["attempts"] == 1, on_rtx
    assert on_b300["cuda_graph"] is False and on_b300["attempts"] == 2, on_b300
    # The reason is the capture error the server logged, not a generic "crashed".
    assert "capture failed" in on_b300["fallback_reason"].lower(), on_b300
    assert "illegal memory access" in on_b300["fallback_reason"], on_b300
    # The new processes really serve what was asked for.
    for port, graphs in [*((p, True) for p in rtx.ports), (b300.port, False)]:
        info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=10).json()
        assert info["speculative_algorithm"] == "DDTREE" and info["ddtree"]["budget"] == 16, info
        assert (info["speculative_num_draft_tokens"], info["speculative_eagle_topk"]) == (17, 4), info
        assert info["ddtree"]["verify_cuda_graph_captured"] is graphs, info
        assert (info["cuda_graph_backend_decode"] != "disabled") is graphs, info

    # bench: exactly the planned rows, all ok, eager fallback recorded on the B300 budget-16 rows.
    out_dir = tmp_path / "results"
    out = out_dir / "demo.jsonl"
    plan = _ok_json(cli("--json", *inv, "bench", "--sweep", str(demo_fleet.sweep), "--dry-run"), "bench --dry-run")
    assert set(plan["hosts"]) == names and plan["rows_per_host"] == ROWS_PER_HOST, plan
    bench = cli(*inv, "bench", "--sweep", str(demo_fleet.sweep), "--out", str(out))
    if bench.exit_code != 0:  # name each failed row's error: the summary table only counts them
        rows = ledger.read_ledger(out).rows
        errors = [(r["host"], r["algorithm"], r["budget"], r["error"]) for r in rows if r["error"]]
        raise AssertionError(f"bench exited {bench.exit_code}: {errors}\n{bench.stderr[-3000:]}")
    read = ledger.read_ledger(out)
    assert read.bad_lines == []
    rows = read.rows
    assert len(rows) == len(names) * plan["rows_per_host"], [(r["host"], r["algorithm"], r["budget"]) for r in rows]
    assert len({r["run_id"] for r in rows}) == 1
    cells = {(r["host"], r["algorithm"], r["budget"], r["topk"]) for r in rows}
    expected_cells = {(n, "AR", None, None) for n in names} | {(n, "DDTREE", b, TOPK) for n in names for b in BUDGETS}
    assert cells == expected_cells
    for r in rows:
        where = f"{r['host']} {r['algorithm']} b={r['budget']}"
        assert r["status"] == "ok" and r["error"] is None, (where, r["error"])
        assert r["completed"] == NUM_PROMPTS and r["failed"] == 0, where
        assert r["total_output_tokens"] == NUM_PROMPTS * MAX_NEW_TOKENS, where  # ignore_eos: every token generated
        assert r["output_tok_s"] > 0 and r["temperature"] == TEMPERATURE and r["concurrency"] == 1, where
        # Half the project's prompts (chat ones through the served model's template), half
        # HumanEval as completion text; each row broken down by where its prompts came from.
        assert r["workload_name"] == "mixed+humaneval", where
        groups = {g["group"]: g for g in r["categories"]}
        assert "humaneval" in groups and set(groups) - {"humaneval"} <= {"code", "math", "chat"}, (where, groups)
        assert sum(g["requests"] for g in groups.values()) == NUM_PROMPTS, where
        # Provenance: the serving simulator, the probed SGLang install, the simulated GPU
        # (no nvidia-smi here) and the bundle deploy put there.
        assert r["sglang_version"] == "0.5.23-sim" and r["sglang_installed_version"] == "0.5.23", where
        sim_gpu = {rtx.name: ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition (simulated)", "sm_120"),
                   b300.name: ("NVIDIA B300 SXM6 AC (simulated)", "sm_103")}[r["host"]]
        # The RTX host's rows come from its two slots of four GPUs; the B300's from all eight.
        gpus = 4 if r["host"] == rtx.name else 8
        assert (r["gpu_name"], r["gpu_arch"], r["gpu_count"]) == (*sim_gpu, gpus), where
        assert (r["slot"] is not None) is (r["host"] == rtx.name), where
        assert r["bundle_name"] == "ddtree_temperature" and r["bundle_hash"] == identities[r["host"]], where
        if r["algorithm"] == "AR":
            assert r["accept_length"] is None, where
        else:
            assert r["accept_length"] > 1.0, where  # greedy trees always accept some drafts here
        eager = r["host"] == b300.name and r["algorithm"] == "DDTREE" and r["budget"] == 16
        if eager:
            assert r["cuda_graph"] is False, where
            assert "illegal memory access" in (r["fallback_reason"] or ""), where
        else:
            assert r["cuda_graph"] is True and r["fallback_reason"] is None, where
    assert {r["slot"] for r in rows if r["host"] == rtx.name} == {0, 1}  # both slots measured
    # The sweep leaves each server place as it found it: the restart's DDTREE budget 16 top-k 4
    # serves again (a new process of the same launch, ready), and no sweep launch is left.
    after = _ok_json(cli("--json", *inv, "service-status", "local"), "service-status")
    for h in after["hosts"]:
        r = h["result"]
        assert r["running"] and r["health"] == 200 and r["run"] == "DDTREE budget=16 topk=4", h
        assert r["pid"] != results[h["host"]]["pid"], h

    # report, as `make demo` runs it (terminal tables, not --json).
    tidy_csv, best_csv, plots = out_dir / "demo.csv", out_dir / "demo_best.csv", out_dir / "demo_plots"
    report = cli(*inv, "report", str(out), "--min-repeats", "1", "--csv", str(tidy_csv), "--csv-best", str(best_csv),
                 "--plots", str(plots))
    assert report.exit_code == 0, f"report exited {report.exit_code}:\n{report.stderr[-3000:]}\n{report.stdout[-3000:]}"
    assert f"Read {len(rows)} rows from 1 ledger(s)." in report.stdout
    assert "Best configuration" in report.stdout
    assert "Best configurations per category" in report.stdout and "humaneval" in report.stdout
    assert "T0=AR" in report.stdout

    # The tidy CSV: one row per (host, cell); the B300 budget-16 cell stays visibly eager.
    columns, tidy = _csv_rows(tidy_csv)
    for col in ("machine", "hosts", "algorithm", "budget", "topk", "cuda_graph", "temperature", "concurrency", "n",
                "output_tok_s_median", "output_tok_s_mad", "score", "accept_length_median", "speedup_vs_ar",
                "fallback_reason"):
        assert col in columns, f"tidy CSV lacks {col}: {columns}"
    assert len(tidy) == len(rows)
    by_cell = {(t["hosts"], t["algorithm"], t["budget"]): t for t in tidy}
    assert set(by_cell) == {(h, a, "" if b is None else str(b)) for h, a, b, _ in expected_cells}
    for (host, algo, budget), t in by_cell.items():
        assert t["n"] == "1" and float(t["output_tok_s_median"]) > 0, t
        assert float(t["speedup_vs_ar"]) > 0, t  # every host has its AR baseline
        if algo == "AR":
            assert float(t["speedup_vs_ar"]) == 1.0, t
        else:  # T = 0: every DDTree output is the target's own, prompt for prompt
            assert (t["t0_prompts"], float(t["t0_match_frac"])) == (str(NUM_PROMPTS), 1.0), t
        eager = host == b300.name and budget == "16"
        assert t["cuda_graph"] == ("False" if eager else "True"), t
        assert ("illegal memory access" in t["fallback_reason"]) is eager, t

    # The best-config CSV: a pick for every (GPU type, temperature, concurrency) measured;
    # the simulated GPU names the machine, not the host.
    _, best = _csv_rows(best_csv)
    measured = {(t["gpu_name"], t["temperature"], t["concurrency"]) for t in tidy}
    assert {(b["machine"], b["temperature"], b["concurrency"]) for b in best} == measured
    assert all(b["algorithm"] in ("AR", "DDTREE") for b in best), best
    # Eager and graph cells are picked separately unless asked: the B300 machine gets both.
    b300_machine = by_cell[(b300.name, "AR", "")]["gpu_name"]
    assert b300_machine == "NVIDIA B300 SXM6 AC (simulated)"
    assert {b["modes"] for b in best if b["machine"] == b300_machine} == {"graph", "eager"}, best

    # Four plots per machine (GPU type), each a real, non-empty PNG.
    machines = {t["gpu_name"] for t in tidy}
    pngs = sorted(plots.glob("*.png"))
    assert len(pngs) == len(PLOT_KINDS) * len(machines), pngs
    for kind in PLOT_KINDS:
        assert sum(p.name.endswith(f"-{kind}.png") for p in pngs) == len(machines), (kind, pngs)
    for png in pngs:
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, png
