"""DDTREE as an SGLang plugin (entry point group ``sglang.srt.plugins``).

SGLang 0.5.23 runs ``load_plugins()`` in every process (launcher, scheduler,
detokenizer) before it resolves server arguments, so registering the algorithm
here makes ``--speculative-algorithm DDTREE`` known everywhere without replacing
any SGLang file. The hooks below are where DDTREE needs a decision that SGLang
makes by algorithm family; as a pull request each one becomes an
``is_ddtree()`` branch at the hooked site:

* ``DecodeCudaGraphRunner.get_spec_info`` and ``create_dummy_verify_input``: the
  DFlash family captures its target-verify graphs (and warms up) without a custom
  mask, which FlashInfer and Triton bake into the graph; DDTREE's target runner
  captures with the runner's mask buffer, like EAGLE and NGRAM trees.
* ``validate_dflash_request``: requests DDTREE cannot serve are aborted one by one
  at admission (HTTP 400 with the reason), never raised inside the forward, where
  they would take the scheduler down.
* ``validate_spec_sampling_mask_request``: the DDTREE worker does not capture
  sampling masks.
* ``spec_need_hidden_states``: like DFLASH, no hidden states ride the FutureMap.
* ``Scheduler.get_init_info``: ``/server_info`` gains a ``ddtree`` entry with the
  resolved tree size, draft block, verify backend, decode graph mode and sampler.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.speculative.ddtree_registration import (
    is_ddtree,
    reference_sampler_enabled,
    register_ddtree,
)

logger = logging.getLogger(__name__)


def _active_algorithm():
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)


def capture_spec_info(original, runner, num_tokens: int):
    """Target-verify graphs of a DDTREE target are captured with a tree mask."""
    if not is_ddtree(runner.model_runner.spec_algorithm):
        return original(runner, num_tokens)
    if runner.model_runner.is_draft_worker:
        # The DFlash draft block: DFlash's own capture input, no mask.
        return original(runner, num_tokens)
    return ddtree_dummy_verify_input(
        custom_mask=runner.buffers.custom_mask,
        num_tokens_per_req=runner.captured_req_width,
        is_draft_worker=False,
    )


def dummy_verify_input(
    original, spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker
):
    if not is_ddtree(spec_algorithm):
        return original(
            spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker
        )
    return ddtree_dummy_verify_input(
        custom_mask=None if is_draft_worker else custom_mask,
        num_tokens_per_req=num_tokens_per_req,
        is_draft_worker=is_draft_worker,
    )


def ddtree_dummy_verify_input(*, custom_mask, num_tokens_per_req, is_draft_worker):
    """A shape-only verify input for capture and warmup, sized by the runner."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative.ddtree_info import DDTreeVerifyInput
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    if is_draft_worker:
        return DFlashVerifyInput(
            draft_token=None,
            positions=None,
            draft_token_num=int(num_tokens_per_req),
            custom_mask=None,
            capture_hidden_mode=CaptureHiddenMode.NULL,
        )
    return DDTreeVerifyInput(
        draft_token=None,
        positions=None,
        draft_token_num=int(num_tokens_per_req),
        topk=int(get_spec().speculative_eagle_topk or 1),
        custom_mask=custom_mask,
        capture_hidden_mode=CaptureHiddenMode.FULL,
    )


def ddtree_request_error(req: Any) -> Optional[str]:
    """Why DDTREE cannot serve ``req`` exactly, or None."""
    from sglang.srt.speculative.ddtree_worker_v2 import sampling_verifier_available

    params = req.sampling_params
    if any(
        getattr(params, field, None)
        for field in ("json_schema", "regex", "ebnf", "structural_tag")
    ):
        return (
            "DDTREE does not support constrained decoding (json_schema, regex, "
            "ebnf, structural_tag); use DFLASH or no speculative decoding."
        )
    greedy = int(params.top_k) == 1 or float(params.temperature) == 0.0
    if greedy:
        return None
    if float(params.min_p) > 0.0:
        return "DDTREE sampling does not apply min_p; send min_p=0 or temperature=0."
    if not sampling_verifier_available():
        return (
            "DDTREE sampling (temperature > 0) needs SGLang's "
            "tree_speculative_sampling_target_only kernel, which this server "
            "cannot run (no CUDA device); send temperature=0."
        )
    return None


def validate_request(original, req, enable_overlap):
    message = original(req, enable_overlap)
    if message is not None or not is_ddtree(_active_algorithm()):
        return message
    return ddtree_request_error(req)


def validate_sampling_mask_request(original, req, spec_algorithm):
    if is_ddtree(spec_algorithm):
        return "return_sampling_mask is not supported with DDTREE."
    return original(req, spec_algorithm)


def need_hidden_states(original):
    if is_ddtree(_active_algorithm()):
        return False
    return original()


def add_server_info(result: Dict[str, Any], scheduler) -> Dict[str, Any]:
    worker = getattr(scheduler, "draft_worker", None)
    describe = getattr(worker, "describe_ddtree", None)
    if callable(describe):
        result["ddtree"] = describe()
    return result


def _count_spec_decode_metrics() -> None:
    """DDTREE rounds feed the same decode snapshot as DFLASH's."""
    from sglang.srt.managers.scheduler_components import metrics_reporter

    algo = register_ddtree()
    if algo not in metrics_reporter._SPEC_DECODE_SNAPSHOT_ALGORITHMS:
        metrics_reporter._SPEC_DECODE_SNAPSHOT_ALGORITHMS = (
            *metrics_reporter._SPEC_DECODE_SNAPSHOT_ALGORITHMS,
            algo,
        )


HOOKS = (
    (
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner."
        "DecodeCudaGraphRunner.get_spec_info",
        capture_spec_info,
        HookType.AROUND,
    ),
    (
        "sglang.srt.speculative.spec_info.create_dummy_verify_input",
        dummy_verify_input,
        HookType.AROUND,
    ),
    (
        "sglang.srt.speculative.dflash_utils.validate_dflash_request",
        validate_request,
        HookType.AROUND,
    ),
    (
        "sglang.srt.speculative.spec_sampling_mask.validate_spec_sampling_mask_request",
        validate_sampling_mask_request,
        HookType.AROUND,
    ),
    (
        "sglang.srt.speculative.spec_utils.spec_need_hidden_states",
        need_hidden_states,
        HookType.AROUND,
    ),
    (
        "sglang.srt.managers.scheduler.Scheduler.get_init_info",
        add_server_info,
        HookType.AFTER,
    ),
)


def load() -> None:
    """The plugin entry point: register DDTREE and its hooks in this process."""
    register_ddtree()
    for target, hook, hook_type in HOOKS:
        HookRegistry.register(target, hook, hook_type)
    _count_spec_decode_metrics()
    if reference_sampler_enabled():
        logger.warning(
            "DDTREE: sampled requests use the pure-torch reference sampler where "
            "the CUDA kernel cannot run (exact, slow; for testing)."
        )
