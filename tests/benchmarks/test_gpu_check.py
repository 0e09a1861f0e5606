"""benchmarks/gpu_check.py, run here without a GPU: the kernel transcribed to Python stands for
the CUDA kernel (so every request must agree with the twin, thresholds below 1 included), a
kernel that differs is caught, each phase is on disk as soon as it ends, ``--budget-s`` skips
what would not fit, and ``prepare`` builds a carry set under the device's 64 MiB."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

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


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]


def test_the_harness_agrees_with_the_transcribed_kernel(gpu_check: ModuleType, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--cpu-twin", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["ok"] and report["status"] == "passed" and not report["skipped"]
    for phase in ("kernel", "kernel_thresholds"):
        got = report[phase]
        assert got["ok"] and got["mismatches"] == 0 and got["complete"], got
        assert got["requests"] == got["tokens_equal"] + got["bonus_boundary_only"] > 0
        # Paths go past the root often enough to compare sibling walks, not only bonus draws.
        assert got["accepted_drafts"] > got["requests"] / 2, got
    pairs = {(c["threshold_single"], c["threshold_acc"]) for c in gpu_check._threshold_cases(True)}
    assert pairs >= {(0.5, 0.3), (1.0, 1.0)}
    lines = _lines(tmp_path)
    assert [x["phase"] for x in lines] == ["start", "kernel_load", "kernel_thresholds", "kernel", "kernel_past_2_32",
                                           "end"]
    assert json.loads((tmp_path / "gpu_check.json").read_text())["status"] == "passed"
    wide = report["kernel_past_2_32"]
    assert wide["chunk_calls"] == 2 and wide["chunked_mismatches"] == 0, wide


def test_thresholds_below_one_are_exercised(gpu_check: ModuleType) -> None:
    """A kernel that ignored --speculative-accept-threshold-single/-acc (always 1 / 1) is caught
    at every pair below 1, and not at 1 / 1. (That the twin agrees with the transcribed kernel
    at each pair is the harness run's kernel_thresholds phase, over the same quick cases:
    test_the_harness_agrees_with_the_transcribed_kernel; the pure-Python kernel is this
    file's slowest step, so it is run once.)"""
    du, ref = load_ddtree_utils(), load_ddtree_reference()

    def ignores_thresholds(**kw):
        ref.reference_tree_speculative_sampling(**{**kw, "threshold_single": 1.0, "threshold_acc": 1.0})

    for pair in gpu_check.THRESHOLDS:
        def cases(quick: bool, pair=pair):
            return (c for c in gpu_check._threshold_cases(quick) if (c["threshold_single"], c["threshold_acc"]) == pair)

        wrong = gpu_check.check_kernel(du, ref, torch, ignores_thresholds, quick=True, trials=1, device="cpu",
                                       cases=cases)
        assert wrong["requests"] > 0 and (wrong["mismatches"] > 0) == (pair != (1.0, 1.0)), (pair, wrong)
    assert any(s < 1 for s, _ in gpu_check.THRESHOLDS) and any(a < 1 for _, a in gpu_check.THRESHOLDS)


def test_a_kernel_that_draws_another_bonus_is_caught(gpu_check: ModuleType) -> None:
    du, ref = load_ddtree_utils(), load_ddtree_reference()

    def off_by_one(**kw):
        ref.reference_tree_speculative_sampling(**kw)
        bs = kw["candidates"].shape[0]
        last = kw["accept_index"][torch.arange(bs), kw["accept_token_num"].long()].long()
        kw["predicts"][last] = (kw["predicts"][last] + 1) % kw["target_probs"].shape[-1]

    got = gpu_check.check_kernel(du, ref, torch, off_by_one, quick=True, trials=1, device="cpu")
    assert not got["ok"] and got["mismatches"] > 0 and got["examples"], got


def test_a_batch_past_the_kernels_offset_limit_is_verified_in_row_chunks(gpu_check: ModuleType) -> None:
    """N1 (issue 55): the kernel's probability offset is uint32. The transcribed kernel wraps
    it at a lowered limit (as the CUDA kernel does at 2^32): called once on the whole batch it
    disagrees with the twin, and only in the requests whose offsets reach the limit; called
    on the bundle's row chunks it agrees request for request. A chunker that forgets to
    shift the retrieve indices into its chunk is caught."""
    du, ref = load_ddtree_utils(), load_ddtree_reference()
    wrapping = functools.partial(gpu_check.transcribed_kernel, offset_modulus=gpu_check.WIDE_CPU[3])
    got = gpu_check.check_past_2_32(du, ref, torch, wrapping, device="cpu", case=gpu_check.WIDE_CPU)
    assert got["ok"] and got["chunk_calls"] == 2 and got["chunked_mismatches"] == 0, got
    assert got["unchunked_differs_count"] > 0 and set(got["unchunked_differs_in"]) <= {3, 4, 5}, got
    # The device case is past 2^32 and what the phase asks of the device's memory.
    bs, budget, vocab, limit = gpu_check.WIDE_GPU
    assert bs * (budget + 1) * vocab > limit == 2**32 > (bs - 6) * (budget + 1) * vocab
    assert 34e9 < gpu_check.wide_batch_bytes(gpu_check.WIDE_GPU) < 36e9

    def forgets_the_shift_back(kernel, **kw):
        # The chunks' accept positions left chunk-local (the shift back undone).
        calls = du.sample_tree_in_row_chunks(kernel, **kw)
        acc, width = kw["accept_index"], kw["candidates"].shape[1]
        rows = (kw["limit"] - 1) // (width * kw["target_probs"].shape[-1])
        for start in range(rows, acc.shape[0], rows):
            chunk = acc[start:start + rows]
            chunk.sub_((chunk >= 0).to(chunk.dtype) * start * width)
        return calls

    broken = SimpleNamespace(build_tree_batch=du.build_tree_batch, tree_retrieve_batch=du.tree_retrieve_batch,
                             sample_tree_in_row_chunks=forgets_the_shift_back)
    wrong = gpu_check.check_past_2_32(broken, ref, torch, wrapping, device="cpu", case=gpu_check.WIDE_CPU)
    assert not wrong["ok"] and wrong["chunked_mismatches"] > 0, wrong


def test_finished_phases_survive_a_run_killed_mid_way(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "run", "--cpu-twin", "--quick", "--out", str(tmp_path),
                             "--only", "kernel_load,kernel", "--stall-before", "kernel"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        jsonl = tmp_path / "gpu_check.jsonl"
        while time.monotonic() < deadline:
            # Whole lines only, by phase: the start line names kernel_load too (its estimate).
            if jsonl.exists() and any(json.loads(line)["phase"] == "kernel_load"
                                      for line in jsonl.read_text().splitlines(keepends=True) if line.endswith("\n")):
                break
            assert proc.poll() is None, "the run ended before it was killed"
            time.sleep(0.2)
        else:
            pytest.fail("kernel_load was not on disk within 120 s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    lines = _lines(tmp_path)
    assert [x["phase"] for x in lines] == ["start", "kernel_load"]
    assert lines[0]["estimates_s"].keys() == {"kernel_load", "kernel"}
    assert lines[1]["status"] == "passed"
    assert not (tmp_path / "gpu_check.json").exists()


def test_budget_skips_the_phases_that_would_not_fit(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--cpu-twin", "--quick", "--out", str(tmp_path),
                           "--budget-s", "2"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["status"] == "incomplete" and report["ok"]
    assert report["kernel_load"]["status"] == "passed"
    for phase in ("kernel_thresholds", "kernel", "kernel_past_2_32"):
        assert report[phase]["status"] == "skipped", report[phase]
        assert "s left of --budget-s 2" in report[phase]["reason"]
    assert set(report["skipped"]) == {"kernel_thresholds", "kernel", "kernel_past_2_32"}
    assert [x["phase"] for x in _lines(tmp_path)] == ["start", "kernel_load", "kernel_thresholds", "kernel",
                                                      "kernel_past_2_32", "end"]


def test_a_kernel_phase_stops_when_its_pace_passes_the_deadline(gpu_check: ModuleType) -> None:
    du, ref = load_ddtree_utils(), load_ddtree_reference()
    got = gpu_check.check_kernel(du, ref, torch, gpu_check.transcribed_kernel, quick=True, trials=1, device="cpu",
                                 cases=gpu_check._threshold_cases, deadline=time.monotonic())
    assert got["cases"] == 1 and not got["complete"] and got["planned_cases"] > 1 and got["ok"]


def test_the_device_call_is_what_prepare_prints(gpu_check: ModuleType) -> None:
    call = gpu_check.device_call()
    assert call["carry"] == [".cache/gpu_check"] and "--budget-s" in call["command"] and "$OUT" in call["command"]
    assert call["timeout_s"] <= 600
    readme = (SCRIPT.parents[1] / "README.md").read_text()
    assert call["command"] in readme and f"timeout_s={call['timeout_s']}" in readme


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc here (CI has no CUDA toolkit): prepare's "
                    "kernel build runs only where nvcc is")
def test_prepare_builds_a_carry_under_64_mib(gpu_check: ModuleType) -> None:
    if not sorted((SCRIPT.parents[1] / ".cache" / "wheels").glob(gpu_check.SGLANG_WHEEL)):
        pytest.skip("no cached SGLang 0.5.23 wheel in .cache/wheels (make venv)")
    if gpu_check._curand_source() is None:
        pytest.skip("no curand.h here (neither the toolkit nor the .cache/sglang-cpu venv's nvidia wheels)")
    proc = subprocess.run([sys.executable, str(SCRIPT), "prepare", "--json"], capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["fits"] and got["total_bytes"] < 64 * 2**20 and got["carry"] == [".cache/gpu_check"]
    assert got["library"] and gpu_check.LIB.is_file() and (gpu_check.CUDA_EXTRA / "curand.h").is_file()
    manifest = json.loads((gpu_check.CARRY / "manifest.json").read_text())
    assert manifest["wrapper_sha256"] == gpu_check._sha(gpu_check.WRAPPER) and manifest["cuda_version"]
