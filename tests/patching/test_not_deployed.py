"""A DDTREE launch on a host without the DDTree bundle: refused up front, one line naming the
host and ``deploy``, before the running server is touched (exit 4, ``not_deployed``). The
same host after ``deploy`` serves DDTREE, and after ``rollback`` refuses it again; a sweep's
DDTREE cells there fail with that reason while its AR cell is measured. The simulated host
serves DDTREE only from what is deployed in its SGLang (``ddtree_ops/sim/plugin.py``), so
nothing here is taken on trust from the toolkit's own copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from cli_json import json_data, read_envelope
from service.simhosts import run_cli

from ddtree_ops.bench import ledger
from ddtree_ops.inventory import load_inventory
from ddtree_ops.service.manager import ProcessManager
from ddtree_ops.transport.local import LocalTransport
from patching.conftest import MiniHost, sim_inventory

pytestmark = pytest.mark.slow
DDTREE = ("--algorithm", "DDTREE", "--budget", "4", "--topk", "4")


def _refused(out, host: str = "b1") -> str:  # type: ignore[no-untyped-def]
    assert out.returncode == 4, out.stdout + out.stderr
    (error,) = [e for e in read_envelope(out.stdout)["errors"] if e["host"] == host]
    assert error["code"] == "not_deployed", error
    return str(error["message"])


def test_ddtree_needs_the_bundle_deployed_and_rollback_takes_it_away(tmp_path: Path, mini: MiniHost) -> None:
    inv = sim_inventory(tmp_path, mini)
    state = tmp_path / "state.json"
    host = load_inventory([inv]).hosts["b1"]
    svc = ProcessManager(LocalTransport("b1"), host)
    try:
        message = _refused(run_cli(inv, "--json", "restart", "b1", *DDTREE, state=state))
        assert message == ("DDTREE needs the DDTree bundle, which is not deployed on b1 (its SGLang has no ddtree "
                           "plugin); `ddtree-ops deploy b1` installs it")
        assert not (tmp_path / "run" / "launch.json").exists()  # nothing was launched

        assert run_cli(inv, "restart", "b1", "--algorithm", "AR", state=state).returncode == 0
        ar_pid = svc.status(lines=0)["record"]["pid"]
        _refused(run_cli(inv, "--json", "restart", "b1", *DDTREE, state=state))
        assert svc.status(lines=0)["record"]["pid"] == ar_pid and svc.status(lines=0)["alive"]  # untouched

        assert run_cli(inv, "deploy", "b1", state=state).returncode == 0
        served = run_cli(inv, "--json", "restart", "b1", *DDTREE, state=state)
        assert served.returncode == 0, served.stdout + served.stderr
        assert json_data(served.stdout)["hosts"][0]["result"]["run"] == "DDTREE budget=4 topk=4"

        assert run_cli(inv, "rollback", "b1", state=state).returncode == 0
        ddtree_pid = svc.status(lines=0)["record"]["pid"]
        _refused(run_cli(inv, "--json", "restart", "b1", *DDTREE, state=state))
        assert svc.status(lines=0)["record"]["pid"] == ddtree_pid  # the running server is left alone

        sweep = tmp_path / "sweep.yaml"
        sweep.write_text(yaml.safe_dump({
            "name": "nd", "targets": ["b1"], "baselines": ["autoregressive"],
            "grid": {"algorithm": ["ddtree"], "budget": [4], "topk": [4], "temperature": [0.0],
                     "concurrency": [1]},
            "workload": {"prompt_set": "mixed", "num_prompts": 2, "max_new_tokens": 8, "seed": 0},
            "repeats": 1, "warmup": 0,
        }))
        out = tmp_path / "l.jsonl"
        swept = run_cli(inv, "bench", "--sweep", str(sweep), "--out", str(out), state=state)
        # The DDTREE server that ran before the sweep cannot come back without the bundle: the
        # put-back says so, and the host fails with its code (service, 5) over the rows' (6).
        assert swept.returncode == 5, swept.stdout + swept.stderr
        assert "NOT put back (DDTREE budget=4 topk=4" in swept.stdout
        rows = {r["algorithm"]: r for r in ledger.read_ledger(out).rows}
        assert rows["AR"]["status"] == "ok", rows["AR"]
        assert rows["DDTREE"]["status"] == "failed" and "`ddtree-ops deploy b1`" in rows["DDTREE"]["error"]
    finally:
        svc.stop(grace_s=5)


def test_a_plugin_whitelist_without_ddtree_is_refused_without_showing_the_env(tmp_path: Path, mini: MiniHost) -> None:
    inv = sim_inventory(tmp_path, mini)
    doc = yaml.safe_load(inv.read_text())
    doc["all"]["children"]["b"]["hosts"]["b1"]["ddtree"]["server"]["env"]["SGLANG_PLUGINS"] = "only_this_one"
    inv.write_text(yaml.safe_dump(doc))
    state = tmp_path / "state.json"
    assert run_cli(inv, "deploy", "b1", state=state).returncode == 0
    out = run_cli(inv, "--json", "restart", "b1", *DDTREE, state=state)
    assert "SGLANG_PLUGINS (inventory env) leaves out" in _refused(out) and "only_this_one" not in out.stdout
    assert not (tmp_path / "run" / "launch.json").exists()
