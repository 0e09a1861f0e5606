"""How the runner completes host provenance from the launched server's ``/server_info``
(pure: the runs against real simulated servers are in test_runner.py)."""

from __future__ import annotations

from typing import Any

import pytest

from ddtree_ops.bench.runner import _Provenance, _with_server_info

PROBED_NO_GPU = _Provenance(sglang_version="0.5.23", bundle_name="ddtree_temperature", bundle_hash="ab" * 32)
PROBED_GPU = _Provenance(gpu_name="NVIDIA B300 SXM6 AC", gpu_arch="sm_103", gpu_count=8, driver="580.65.06",
                         sglang_version="0.5.23")
SIM_INFO: dict[str, Any] = {
    "version": "0.5.23-sim",
    "simulated_gpu": {"profile": "b300", "name": "NVIDIA B300 SXM6 AC (simulated)", "compute_cap": "10.3",
                      "count": 8},
}


def test_simulated_server_on_a_host_without_gpus() -> None:
    got = _with_server_info(PROBED_NO_GPU, SIM_INFO)
    assert (got.serving_version, got.sglang_version) == ("0.5.23-sim", "0.5.23")  # installed version kept
    assert (got.gpu_name, got.gpu_arch, got.gpu_count, got.driver) == (
        "NVIDIA B300 SXM6 AC (simulated)", "sm_103", 8, None)
    assert (got.bundle_name, got.bundle_hash) == (PROBED_NO_GPU.bundle_name, PROBED_NO_GPU.bundle_hash)


def test_a_gpu_found_by_the_probe_wins_over_the_simulated_one() -> None:
    got = _with_server_info(PROBED_GPU, SIM_INFO)
    assert got.serving_version == "0.5.23-sim"
    assert (got.gpu_name, got.gpu_arch, got.gpu_count, got.driver) == (
        "NVIDIA B300 SXM6 AC", "sm_103", 8, "580.65.06")


def test_real_sglang_server_info_changes_only_the_serving_version() -> None:
    got = _with_server_info(PROBED_NO_GPU, {"version": "0.5.23", "speculative_algorithm": "DFLASH"})
    assert got == _Provenance(sglang_version="0.5.23", serving_version="0.5.23",
                              bundle_name=PROBED_NO_GPU.bundle_name, bundle_hash=PROBED_NO_GPU.bundle_hash)


@pytest.mark.parametrize("info", [None, {}, {"version": ""}, {"version": 523}, {"simulated_gpu": "b300"},
                                  {"simulated_gpu": {"name": None, "compute_cap": "10.3", "count": 8}}])
def test_unreadable_or_malformed_server_info_leaves_the_probed_values(info: dict[str, Any] | None) -> None:
    assert _with_server_info(PROBED_NO_GPU, info) == PROBED_NO_GPU


def test_a_simulated_gpu_always_says_so_and_bad_parts_are_null() -> None:
    info = {"simulated_gpu": {"name": " NVIDIA H200 ", "compute_cap": None, "count": True}}
    got = _with_server_info(PROBED_NO_GPU, info)
    assert (got.gpu_name, got.gpu_arch, got.gpu_count) == ("NVIDIA H200 (simulated)", None, None)
    assert got.serving_version is None
