"""The DDTree bundle inside one real SGLang 0.5.23 interpreter (see inprocess_ddtree.py for
what each check runs against). That a server runs the hook check at start is what every
server's ``/server_info`` shows (``ddtree.tree_mask.hooks_in_place``, test_ddtree_real)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .serverenv import coverage_env, server_env

pytestmark = [pytest.mark.slow, pytest.mark.sglang_real, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).with_name("inprocess_ddtree.py")
CHECKS = ("target_laws", "context_end", "per_node_refusals", "tree_builder", "kernel_row_chunks", "broken_hook")


@pytest.fixture(scope="module")
def checks(ddtree_python, tmp_path_factory) -> dict:
    cwd = tmp_path_factory.mktemp("inprocess")
    proc = subprocess.run(
        [str(ddtree_python), str(SCRIPT), *CHECKS],
        capture_output=True, text=True, timeout=600, cwd=cwd,
        env={**server_env(), **coverage_env(now=True), "HOME": str(cwd), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_verifier_targets_the_law_sglang_samples_from(checks):
    """Temperature, top-k, top-p and min-p: the kernel branch's and the reference branch's
    target probabilities agree, and equal SGLang's own sampler's filtered probabilities."""
    laws = checks["target_laws"]
    assert laws["kernel_vs_reference_support_equal"] and laws["kernel_vs_reference_max_abs"] < 1e-6, laws
    assert laws["kernel_vs_sglang_sampler_support_equal"] and laws["kernel_vs_sglang_sampler_max_abs"] < 1e-6, laws
    assert laws["min_p_removed_tokens"] > 0, "min_p filtered nothing: the check would not see it ignored"


def test_the_last_overlap_round_must_fit_the_row(checks):
    got = checks["context_end"]
    assert got["fits"] is None and got["no_overlap"] is None, got
    for case in ("one_over", "capped_by_sglang"):
        assert got[case].startswith("DDTREE: ") and "send at most 2038 tokens in total" in got[case], got


def test_a_custom_logit_processor_is_refused_like_the_penalties(checks):
    got = checks["per_node_refusals"]
    assert got["plain"] is None, got
    assert got["custom_logit_processor"].startswith("DDTREE does not apply custom_logit_processor per tree node"), got
    # Checked after the per-node ones, as the admission hook does under the overlap scheduler.
    assert got["context_end_overlap"].startswith("DDTREE: 2000 prompt tokens + max_new_tokens 39"), got


def test_the_batched_tree_builder_equals_the_heap(checks):
    got = checks["tree_builder"]
    assert got["trees"] == 33 and got["mismatches"] == [], got


def test_a_hook_that_failed_to_apply_is_found(checks):
    got = checks["broken_hook"]
    assert got["refused"] and got["type"] == "DDTreeError", got
    assert "DecodeCudaGraphRunner.get_spec_info" in got["message"] and "\n" not in got["message"], got


def test_the_kernel_runs_on_row_chunks_and_gives_the_unchunked_tokens(checks):
    """N1 (issue 55): the CUDA op's probability offset is uint32, so a batch with
    batch x width x vocab >= 2**32 is verified in row chunks. With the limit lowered to
    3 rows, the 7-request batch takes three calls of the op's stand-in (entry checks
    included) and every request gets the unchunked call's path, count and tokens."""
    got = checks["kernel_row_chunks"]
    whole, chunked = got["whole"], got["chunked"]
    assert whole["calls"] == [7] and chunked["calls"] == [3, 3, 1], got
    assert chunked["tokens"] == whole["tokens"], got
    assert chunked["accept_index"] == whole["accept_index"], got
    assert chunked["accept_token_num"] == whole["accept_token_num"], got
    assert sum(whole["accept_token_num"]) > 3  # paths go past the root: the shifted indices are read
    assert got["too_wide"] is not None and got["too_wide"].startswith("DDTREE: ") and "\n" not in got["too_wide"]
