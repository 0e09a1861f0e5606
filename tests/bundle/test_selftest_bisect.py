"""`ddtree-ops selftest --e2e --bisect-budgets` against a simulated B300.

The host is a local prefix with the real SGLang 0.5.23 files and the DDTree bundle
deployed (what ``selftest_e2e.py`` checks first), whose server command is the simulator:
on its b300 profile decode-graph capture crashes for DDTREE budgets above 8, in the verify
graph (``SIM_CAPTURE_FAULT=verify``) or in the draft graph's candidate head
(``candidate_head``: SGLang's eager draft-head switch avoids it). The bisection must find
budget 9, say whether the eager head avoids the crash, and leave an eager fallback that
covers budget 9 and up -- and only those -- which a later ``restart`` honours.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from cli_json import json_data
from fleetlib import cached_prefix_template, fast_root, find_wheel, free_port

from ddtree_ops.inventory_types import DdtreeSettings, Host
from ddtree_ops.patching import deploy, load_bundle
from ddtree_ops.selftest import DEFAULT_BUNDLE, E2E_NAME
from ddtree_ops.state import FallbackKey, StateStore
from ddtree_ops.transport.local import LocalTransport

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
FAST_SIM = {"SIM_GPU": "b300", "SIM_LOAD_S": "1", "SIM_TIME_SCALE": "0.05", "SIM_WARMUP_S": "0.2"}


@pytest.fixture
def b300_python(tmp_path: Path):  # type: ignore[no-untyped-def]
    root, owned = fast_root(tmp_path / "prefixes")
    prefix = root / "b300"
    shutil.copytree(cached_prefix_template(find_wheel()), prefix, symlinks=True,
                    ignore=shutil.ignore_patterns(".ready"))
    python = prefix / "bin" / "python"
    host = Host(name="b300", connection="local", ddtree=DdtreeSettings(python=str(python)), source="<test>")
    with LocalTransport(host.name) as t:
        assert deploy(t, host, load_bundle(DEFAULT_BUNDLE)).outcome == "applied"
    try:
        yield python
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)


def _inventory(tmp_path: Path, python: Path, env: dict[str, str]) -> Path:
    inv = {"all": {"hosts": {"b300": {"ansible_connection": "local", "ddtree": {
        "python": str(python), "run_dir": str(tmp_path / "run"), "gpu": "b300",
        "server": {"command": "{python} -m ddtree_ops.sim", "model_path": "sim/qwen3-8b",
        "draft_model_path": "sim/qwen3-8b-dflash", "port": free_port(), "expected_load_s": 2, "env": env},
    }}}}}
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(inv))
    return path


def test_the_first_failing_budget_is_found_and_remembered_from_there_up(cli, b300_python, tmp_path: Path) -> None:
    inv = _inventory(tmp_path, b300_python, FAST_SIM)
    res = cli("-i", str(inv), "--json", "selftest", "b300", "--e2e", "--bisect-budgets", "--budgets", "8,9,12")
    assert res.exit_code == 0, (res.stdout[-3000:], res.stderr[-2000:])
    [row] = json_data(res.stdout)
    found = row["bisect"]
    assert [(s["budget"], s["ok"]) for s in found["tried"]] == [(8, True), (9, False)], found
    assert found["first_failing"] == 9 and found["eager_head_avoids"] is False
    assert "Capture cuda graph failed" in found["blocking"]["error"]
    assert row["runs"] == [] and row["ok"] is True

    state = StateStore()
    key = FallbackKey("b300", "b300", "0.5.23", "DDTREE", 9, 4)
    [record] = state.fallbacks()
    assert record.key == key and record.reason.startswith("selftest bisection: budget 9 fails")
    for budget, eager in ((8, False), (9, True), (16, True)):
        assert (state.fallback_for(FallbackKey("b300", "b300", "0.5.23", "DDTREE", budget, 4)) is not None) is eager

    # A restart at budget 12 goes eager at once: no capture attempt, no model load lost.
    res = cli("-i", str(inv), "--json", "restart", "b300", "--algorithm", "DDTREE", "--budget", "12", "--topk", "4")
    try:
        assert res.exit_code == 0, (res.stdout[-3000:], res.stderr[-2000:])
        [row] = json_data(res.stdout)["hosts"]
        restart = row["result"]
        assert restart["cuda_graph"] is False and restart["attempts"] == 1
        assert restart["fallback_reason"].startswith("recorded fallback: selftest bisection"), restart
    finally:
        cli("-i", str(inv), "stop", "b300")


def test_a_crash_in_the_candidate_head_is_avoided_by_the_eager_head(b300_python, tmp_path: Path) -> None:
    """The script alone (the CLI path is the test above), bisecting budget 9 only."""
    script = DEFAULT_BUNDLE / E2E_NAME
    params = {"bisect": [9], "server_command": [str(b300_python), "-m", "ddtree_ops.sim"],
              "env": {**FAST_SIM, "SIM_CAPTURE_FAULT": "candidate_head"}, "launch_timeout": 120}
    proc = subprocess.run([str(b300_python), str(script), json.dumps(params)], capture_output=True, text=True,
                          timeout=280, cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)})
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, report
    found = report["bisect"]
    assert found["first_failing"] == 9 and found["eager_head_avoids"] is True, found
    assert found["eager_head"]["ok"] is True and found["eager_head"]["captured"] is True


def test_the_script_refuses_a_bad_bisect_list() -> None:
    spec = importlib.util.spec_from_file_location("e2e", DEFAULT_BUNDLE / E2E_NAME)
    assert spec is not None and spec.loader is not None
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    assert e2e.parse_params({"bisect": [16, 8, 8]})["bisect"] == [8, 16]
    for bad in ([], [0], ["9"], 9):
        with pytest.raises(ValueError, match="bisect"):
            e2e.parse_params({"bisect": bad})
    with pytest.raises(ValueError, match="server_command"):
        e2e.parse_params({"server_command": []})
