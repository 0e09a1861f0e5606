"""benchmarks/gpu_check.py's comparison harness, run here without a GPU: the twin stands for
the CUDA kernel (so every request must agree), and a kernel that differs is caught."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ddtree_ops.ddtree_core import load_ddtree_reference, load_ddtree_utils

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_harness_agrees_with_itself_over_deep_paths() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--cpu-twin", "--quick"], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    kernel = report["kernel"]
    assert report["ok"] and kernel["ok"] and kernel["mismatches"] == 0
    assert kernel["requests"] == kernel["tokens_equal"] > 0
    # Paths go past the root often enough to compare sibling walks, not only bonus draws.
    assert kernel["accepted_drafts"] > kernel["requests"] / 2, kernel


def test_a_kernel_that_draws_another_bonus_is_caught(gpu_check: ModuleType) -> None:
    du, ref = load_ddtree_utils(), load_ddtree_reference()

    def off_by_one(**kw):
        ref.reference_tree_speculative_sampling(**kw)
        bs = kw["candidates"].shape[0]
        last = kw["accept_index"][torch.arange(bs), kw["accept_token_num"].long()].long()
        kw["predicts"][last] = (kw["predicts"][last] + 1) % kw["target_probs"].shape[-1]

    got = gpu_check.check_kernel(du, ref, torch, off_by_one, quick=True, trials=1, device="cpu")
    assert not got["ok"] and got["mismatches"] > 0 and got["examples"], got
