"""`ddtree-ops selftest HOST --e2e` against the REAL SGLang 0.5.23 server on CPU.

Through the real CLI, on a local host whose python is a prefix with the DDTree bundle
deployed by ddtree-ops (the session fixture in conftest.py) and whose inventory
gives the CPU flags and environment the test harness uses: the bundle's
``selftest_e2e.py`` writes its tiny random-weight models, launches the target alone and
DDTREE at budgets 4 and 16 with decode graphs off, and reports. What must hold: every run
served and equal to the target alone token for token (float32: no near-ties to excuse,
and the chosen tokens' log-probs agree to float32 noise), the verify path is the one the
server says (torch_native with the tree mask, no graphs), acceptance is reported (a random
draft over the model's 16 live tokens is sometimes right), the unit checks pass with the
kernel "not available" (no CUDA), and no server process or work directory is left.

Budgets 4 and 16 with graphs "off" only, one baseline: three CPU launches (~25-45 s
each). Graphs "on" on CPU: SGLang resolves decode CUDA graphs to disabled there, which
the report shows (``decode_cuda_graph`` "disabled", ``verify_cuda_graph_captured`` false)
rather than assuming.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from cli_json import json_data

from .server import BASE_ARGS
from .serverenv import COVERAGE_VARS, server_env

pytestmark = [pytest.mark.slow, pytest.mark.sglang_real, pytest.mark.timeout(900)]

HOST = "cpu-e2e"
CPU_ARGS = [*BASE_ARGS, "--speculative-draft-attention-backend", "torch_native"]


def _processes_naming(text: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry}: {cmdline[:200]}")
    return found


def test_selftest_e2e_on_the_real_cpu_server(
    cli,
    ddtree_python: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    # The script's work directory lands under TMPDIR; a short path, so that it also becomes
    # the servers' TMPDIR (their IPC socket paths must stay under 108 bytes).
    work = tmp_path_factory.mktemp("e2e")
    monkeypatch.setenv("TMPDIR", str(work))
    for key in COVERAGE_VARS:  # these servers run code other tests measure (serverenv.py)
        monkeypatch.delenv(key, raising=False)
    env = {**server_env(), "HOME": str(home), "OMP_NUM_THREADS": "1"}
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {HOST: {
        "ansible_connection": "local",
        "ddtree": {"python": str(ddtree_python), "server": {"extra_args": CPU_ARGS, "env": env}},
    }}}}))

    res = cli("-i", str(inventory), "--json", "selftest", HOST, "--e2e", "--budgets", "4,16", "--graphs", "off",
              "--out", str(tmp_path / "reports"))

    assert res.exit_code == 0, f"{res.stderr[-3000:]}\n{res.stdout[-6000:]}"
    [report] = json_data(res.stdout)
    assert report["ok"] is True and report["error"] is None
    assert report["sglang_version"] == "0.5.23" and report["device"] == "cpu"
    assert report["baseline"]["served"] is True
    assert set(report["checks"]) >= {"golden_encoding", "builder_encoding_properties", "greedy_walk",
                                     "reference_sampler_exact", "device_round"}
    assert all(c["ok"] for c in report["checks"].values())
    assert report["kernel"].startswith("not available")
    assert [(r["budget"], r["graphs"]) for r in report["runs"]] == [(4, "off"), (16, "off")]
    for run in report["runs"]:
        label = f"budget {run['budget']}: {run}"
        assert run["ok"] and run["served"] and run["equal"] and run["first_divergence"] is None, label
        assert run["compared_tokens"] == 32 * 4, label  # 32 new tokens: 1 prompt alone + 3 in a batch
        assert run["max_logprob_delta"] < 1e-3, label  # float32: a wrong mask moves them by > 1e-1
        assert run["accept_length"] is not None and run["accept_length"] > 1.0, label
        assert run["verify_attention_backend"] == "TorchNativeAttnBackend", label
        assert run["decode_cuda_graph"] == "disabled" and run["verify_cuda_graph_captured"] is False, label
        tree = run["ddtree"]
        assert (tree["budget"], tree["verify_width"], tree["draft_block_size"]) == (
            run["budget"], run["budget"] + 1, 16), label
        assert tree["tree_mask"]["capture_input"] == "DDTreeVerifyInput with the runner's mask buffer", label
        assert tree["tree_mask"]["verify_graphs"] == "none captured", label
    assert report["graph_capture"] == {}  # no graphs "on" run
    assert json.loads((tmp_path / "reports" / f"{HOST}.json").read_text()) == report
    assert report["params"]["env"] == sorted(env)  # names only: values stay on the host

    assert _processes_naming(str(work)) == [], "a server of the e2e run is still running"
    assert list(work.iterdir()) == [], "the e2e work directory was left behind"
