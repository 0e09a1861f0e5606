"""The bundle's ``selftest.py`` as a host runs it (``ddtree-ops selftest``): the deployed
``ddtree_utils.py`` under the real SGLang 0.5.23 venv's torch.

This is also what executes the bundle's per-request reference layer (the list-based
builders, encodings and sampler the worker's batched path is checked against) in the
coverage the bundle README reports; the worker itself only runs the batched code.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .serverenv import coverage_env

pytestmark = [pytest.mark.slow, pytest.mark.sglang_real, pytest.mark.timeout(300)]

SELFTEST = Path(__file__).resolve().parents[2] / "patches" / "ddtree_temperature" / "selftest.py"


def test_selftest_passes_on_the_deployed_bundle(ddtree_python, tmp_path):
    # stdin, as the deployment tool sends it over SSH
    proc = subprocess.run(
        [str(ddtree_python), "-"], input=SELFTEST.read_text(), capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env={**coverage_env(now=True), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and report["ok"], (report, proc.stderr[-2000:])
    assert report["deployed"] and report["ddtree_utils"].startswith(str(ddtree_python.parents[1])), report
    # no CUDA here: the kernel comparison is the GPU check's (benchmarks/gpu_check.py)
    assert report["cuda"] is False and report["kernel"].startswith("not available"), report
    assert set(report["checks"]) == {"golden_encoding", "builder_encoding_properties", "greedy_walk",
                                     "reference_sampler_exact", "device_round"}, report
    assert all(c["ok"] for c in report["checks"].values()), report
