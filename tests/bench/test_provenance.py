"""How the runner completes host provenance from the launched server's ``/server_info``
(pure: the runs against real simulated servers are in test_runner.py)."""

from __future__ import annotations

from typing import Any

import pytest

from ddtree_ops.bench.provenance import Provenance as _Provenance
from ddtree_ops.bench.provenance import with_server_info as _with_server_info

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


# /server_info.ddtree as the DDTree plugin reports it (DDTreeWorkerV2.describe_ddtree).
TREE = {"budget": 16, "topk": 4, "draft_block_size": 16, "verify_width": 17, "max_depth": 15,
        "verify_attention_backend": "FlashInferAttnBackend", "draft_attention_backend": "FlashInferAttnBackend",
        "decode_cuda_graph": "full", "verify_cuda_graph_captured": True, "candidate_head": "draft CUDA graph",
        "verify_cuda_graph_max_bs": 48,
        "tree_mask": {"hooks_in_place": ["DecodeCudaGraphRunner.get_spec_info", "spec_info.create_dummy_verify_input",
                                         "dflash_utils.validate_dflash_request",
                                         "spec_sampling_mask.validate_spec_sampling_mask_request",
                                         "spec_utils.spec_need_hidden_states", "Scheduler.get_init_info"],
                      "capture_input": "DDTreeVerifyInput with the runner's mask buffer",
                      "verify_graphs": "35 captured with the tree mask buffer"},
        "sampler": "kernel", "accept_thresholds": [1.0, 1.0]}


def test_the_served_tree_is_recorded_from_the_plugins_server_info() -> None:
    got = _with_server_info(PROBED_NO_GPU, {"version": "0.5.23", "ddtree": TREE})
    assert (got.verify_attention_backend, got.verify_cuda_graph, got.draft_block_size, got.tree_sampler) == (
        "FlashInferAttnBackend", True, 16, "kernel")
    assert got.verify_cuda_graph_max_bs == 48  # the launch's graph ceiling, for its rows


def test_tree_fields_belong_to_one_launch() -> None:
    # The provenance of a DDTREE launch, then an AR launch (no ddtree object) or a server
    # that does not answer: the next rows must not inherit the previous tree.
    ddtree = _with_server_info(PROBED_NO_GPU, {"version": "0.5.23", "ddtree": TREE})
    for info in ({"version": "0.5.23"}, None):
        got = _with_server_info(ddtree, info)
        assert (got.verify_attention_backend, got.verify_cuda_graph, got.draft_block_size, got.tree_sampler,
                got.verify_cuda_graph_max_bs) == (None, None, None, None, None), info


@pytest.mark.parametrize("bad", [{"verify_attention_backend": 3}, {"verify_cuda_graph_captured": "yes"},
                                 {"draft_block_size": True}, {"draft_block_size": 0}, {"sampler": "  "},
                                 {"verify_cuda_graph_max_bs": True}, {"verify_cuda_graph_max_bs": 0}])
def test_malformed_tree_fields_are_null(bad: dict[str, Any]) -> None:
    got = _with_server_info(PROBED_NO_GPU, {"ddtree": {**TREE, **bad}})
    fields = {
        "verify_attention_backend": got.verify_attention_backend,
        "verify_cuda_graph_captured": got.verify_cuda_graph,
        "draft_block_size": got.draft_block_size,
        "sampler": got.tree_sampler,
        "verify_cuda_graph_max_bs": got.verify_cuda_graph_max_bs,
    }
    (key,) = bad
    assert fields[key] is None, got
