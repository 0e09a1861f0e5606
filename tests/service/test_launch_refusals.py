"""The toolkit's own check of a DDTREE launch against what the DDTree bundle refuses at start-up
(issue 55): a refusal it can know from the argv and the probed GPU architecture is one line
before a restart stops anything, never a failed start. That it agrees with SGLang 0.5.23's own
resolution on four GPUs is tests/sglang_real/test_launch_matrix.py; these are its rules, pure."""

from __future__ import annotations

import pytest

from ddtree_ops.errors import ConfigError
from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.service.launch import RunConfig, build_launch_spec, ddtree_launch_refusal

DDTREE = ("--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "17")


def _args(*extra: str, topk: int = 4) -> tuple[str, ...]:
    return (*DDTREE, "--speculative-eagle-topk", str(topk), *extra)


@pytest.mark.parametrize(
    ("extra", "arch", "topk", "topk_max", "says"),
    [
        (("--attention-backend", "trtllm_mha"), None, 4, None, "--attention-backend trtllm_mha"),
        (("--attention-backend=fa4",), "sm_90", 4, None, "--attention-backend fa4"),
        (("--speculative-attention-mode", "decode", "--decode-attention-backend", "trtllm_mha"), "sm_103", 1, None,
         "--decode-attention-backend trtllm_mha"),
        (("--attention-backend", "fa3"), "sm_103", 4, None, "cannot run on this GPU (sm_103)"),
        (("--attention-backend", "fa3"), "sm_120", 1, None, "sm_80/sm_90 only"),
        (("--attention-backend", "fa3"), "sm_90", 1, 8, "top-k up to 8"),
        (("--page-size", "16"), "sm_90", 4, None, "--page-size 1"),
        # SGLang's page-size rules for a backend of the phase that does not verify
        (("--decode-attention-backend", "trtllm_mha", "--prefill-attention-backend", "flashinfer"), "sm_103", 4,
         None, "--decode-attention-backend trtllm_mha makes SGLang set --page-size 64"),
        (("--speculative-draft-attention-backend", "trtllm_mha"), "sm_120", 4, None, "--page-size 64"),
        (("--decode-attention-backend", "fa4", "--prefill-attention-backend", "flashinfer"), "sm_100", 1, None,
         "--page-size 128"),
        (("--pp-size", "2"), None, 4, None, "--pp-size 1"),
        (("--enable-dp-attention", "--tp-size", "2"), None, 4, None, "dp attention"),
        (("--disaggregation-mode", "prefill"), None, 4, None, "--disaggregation-mode prefill"),
    ],
)
def test_what_the_bundle_refuses_is_refused_in_one_line(extra, arch, topk, topk_max, says) -> None:
    why = ddtree_launch_refusal(_args(*extra, topk=topk), gpu_arch=arch, topk_max=topk_max)
    assert why is not None and says in why and "\n" not in why, why


@pytest.mark.parametrize(
    ("extra", "arch", "topk", "topk_max"),
    [
        ((), "sm_103", 1, None),  # no backend named: the bundle picks one that reads the mask (N2)
        ((), "sm_90", 1, 8),
        (("--attention-backend", "fa3"), "sm_90", 1, 1),
        (("--attention-backend", "fa3"), "sm_90", 4, 8),
        (("--attention-backend", "fa3"), None, 4, None),  # arch unknown: the bundle decides
        (("--attention-backend", "flashinfer"), "sm_103", 1, 8),
        (("--attention-backend", "triton", "--page-size", "1"), "sm_120", 2, None),
        # fa4 in the phase that does not verify: no page-size rule at top-k 4 (sm_100's is at top-k 1)
        (("--decode-attention-backend", "fa4", "--prefill-attention-backend", "flashinfer"), "sm_103", 4, None),
        # a CPU launch is the bundle's own device check (test servers run CPU stand-ins)
        (("--device", "cpu", "--attention-backend", "torch_native"), None, 4, None),
    ],
)
def test_what_the_bundle_serves_is_launched(extra, arch, topk, topk_max) -> None:
    assert ddtree_launch_refusal(_args(*extra, topk=topk), gpu_arch=arch, topk_max=topk_max) is None


def test_other_algorithms_are_not_the_bundles() -> None:
    assert ddtree_launch_refusal(("--speculative-algorithm", "DFLASH", "--attention-backend", "trtllm_mha")) is None
    assert ddtree_launch_refusal(("--attention-backend", "trtllm_mha", "--page-size", "64")) is None


def test_build_launch_spec_refuses_before_the_host_is_touched() -> None:
    server = ServerSettings(model_path="/m", draft_model_path="/d", extra_args=("--attention-backend", "fa3"))
    host = Host(name="b300-a", connection="local", ddtree=DdtreeSettings(python="python", server=server))
    run = RunConfig("DDTREE", budget=16, topk=1)
    with pytest.raises(ConfigError) as err:
        build_launch_spec(host, run, "0.5.23", cuda_graph=True, gpu_arch="sm_103")
    assert str(err.value).startswith("b300-a: --attention-backend fa3 cannot run on this GPU (sm_103)")
    # Without the probed architecture the rule that needs it is left to the bundle.
    assert build_launch_spec(host, run, "0.5.23", cuda_graph=True).server_args[-2:] == ("--attention-backend", "fa3")
    # A tuned policy serving top-k up to 8 at launch top-k 1 on an H100.
    with pytest.raises(ConfigError, match="top-k up to 8"):
        build_launch_spec(host, run, "0.5.23", cuda_graph=False, gpu_arch="sm_90", topk_max=8)
