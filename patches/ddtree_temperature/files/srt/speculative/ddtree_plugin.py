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
* ``get_default_attn_backend`` (as ``arg_groups/overrides.py`` calls it): a DDTREE
  launch that names no attention backend gets one that verifies a tree on its GPU
  (0.5.23's default at top-k 1 on B200/B300 is trtllm_mha, which has no custom mask).
* ``Scheduler.get_init_info``: ``/server_info`` gains a ``ddtree`` entry with the
  resolved tree size, draft block, verify backend, decode graph mode and sampler.
* ``SchedulerInternalStateController.set_internal_state`` /
  ``get_internal_state`` and ``TokenizerControlMixin.set_internal_state``: the
  runtime tree states (``ddtree_runtime``): ``/set_internal_state`` switches the
  active (budget, top-k) or the per-batch-size policy, validated as a whole before
  anything changes, a refusal answered with HTTP 400 and its reason;
  ``/server_info``'s ``internal_states[i].ddtree`` reports the live state. As a
  pull request these are entries of ``_update_handlers`` and a
  ``_add_speculative`` branch.
* ``Scheduler.get_output_streamer_class`` and
  ``TokenizerManager.update_request_meta_info``: the tree trace
  (``ddtree_trace``) reaches a finished request's ``meta_info["ddtree_trace"]``
  through SGLang's customized-info fields (``sampling/sampling_observer.py`` names
  these two as the extension points); the streamer asks for them only while a
  trace is on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
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


# Per target graph runner (by id), whether each verify capture got the runner's
# mask buffer: what the worker checks at start (check_verify_graphs).
CAPTURED_WITH_MASK: Dict[int, list] = {}


def capture_spec_info(original, runner, num_tokens: int):
    """Target-verify graphs of a DDTREE target are captured with a tree mask."""
    if not is_ddtree(runner.model_runner.spec_algorithm):
        return original(runner, num_tokens)
    if runner.model_runner.is_draft_worker:
        # The DFlash draft block: DFlash's own capture input, no mask.
        return original(runner, num_tokens)
    info = ddtree_dummy_verify_input(
        custom_mask=runner.buffers.custom_mask,
        num_tokens_per_req=runner.captured_req_width,
        is_draft_worker=False,
    )
    CAPTURED_WITH_MASK.setdefault(id(runner), []).append(
        info.custom_mask is not None and info.custom_mask is runner.buffers.custom_mask
    )
    return info


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


# Logit adjustments SGLang applies alike to every verify row
# (``apply_dflash_verify_logits_adjustments``, ``dflash_utils.py``). A tree node at
# depth >= 2 would see its request's committed tokens without its ancestors', so
# none of these is exact under DDTREE: each is refused per request (field, default).
# Watermarking, a server-wide switch, is refused at startup.
_PER_NODE_INEXACT = (
    ("frequency_penalty", 0.0),
    ("presence_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("min_new_tokens", 0),
)


def _inexact_adjustments(req: Any) -> list:
    params = req.sampling_params
    names = [
        name
        for name, default in _PER_NODE_INEXACT
        if getattr(params, name, default) not in (None, default)
    ]
    if getattr(params, "logit_bias", None):
        names.append("logit_bias")
    if getattr(req, "custom_logit_processor", None):
        names.append("custom_logit_processor")
    return names


@dataclass(frozen=True)
class RoundShape:
    """What bounds a DDTREE round near the context end, known once the worker
    exists (one worker per scheduler process)."""

    context_len: int
    row_len: int  # slots of a req_to_token row
    window: int  # slots one round writes from the committed length
    max_depth: int  # tree nodes one round may commit (plus the bonus token)


_ROUND_SHAPE: Optional[RoundShape] = None


def set_round_shape(shape: RoundShape) -> None:
    global _ROUND_SHAPE
    _ROUND_SHAPE = shape


def context_end_error(req: Any, enable_overlap: bool) -> Optional[str]:
    """The overlap scheduler runs one more round for a request that finished in the
    round before (its tokens are discarded). That round starts up to ``max_depth``
    tokens past the request's last length and writes ``window`` slots; refuse a
    request whose final round could run past its ``req_to_token`` row."""
    shape = _ROUND_SHAPE
    if not enable_overlap or shape is None:
        return None
    input_len = len(req.origin_input_ids)
    asked = req.sampling_params.max_new_tokens
    # The scheduler caps max_new_tokens at context_len - 2 - input_len
    # (Scheduler.init_req_max_new_tokens, after this check).
    cap = shape.context_len - 2 - input_len
    max_new = cap if asked is None else min(int(asked), cap)
    # Last length before its final round: input + max_new - 2, plus the up to
    # max_depth + 1 tokens that round commits.
    end = input_len + max_new - 1 + shape.max_depth + shape.window
    if end <= shape.row_len:
        return None
    allowed = shape.row_len - shape.window - shape.max_depth + 1
    return (
        f"DDTREE: {input_len} prompt tokens + max_new_tokens {max_new} leave no room "
        f"for the last tree round ({shape.window} KV slots, up to "
        f"{shape.max_depth} draft tokens deep) within the context of "
        f"{shape.context_len} tokens; send at most {allowed} tokens in total."
    )


def _deterministic_inference() -> bool:
    from sglang.srt.runtime_context import get_exec

    return bool(get_exec().deterministic.enable_deterministic_inference)


def ddtree_request_error(req: Any, enable_overlap: bool = False) -> Optional[str]:
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
    inexact = _inexact_adjustments(req)
    if inexact:
        return (
            f"DDTREE does not apply {', '.join(inexact)} per tree node (a node would "
            "ignore its ancestors' tokens); send defaults, or use DFLASH or no "
            "speculative decoding."
        )
    message = context_end_error(req, enable_overlap)
    if message is not None:
        return message
    if float(params.min_p) > 0.0 and _deterministic_inference():
        # Not DDTREE's own limit, but one request would take every other down: the
        # seeded sampler asserts on any min-p row of its batch
        # (top_k_top_p_min_p_sampling_from_probs_torch, srt/layers/sampler.py).
        return (
            "DDTREE: min_p is not served under --enable-deterministic-inference "
            "(SGLang's seeded sampler cannot apply it); send min_p=0."
        )
    greedy = int(params.top_k) == 1 or float(params.temperature) == 0.0
    if greedy:
        return None
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
    message = ddtree_request_error(req, enable_overlap)
    if message is not None and _deterministic_inference():
        # An aborted request still rides the prefill it was queued for, and the seeded
        # sampler asserts on a min-p row of that batch: refused, it must not carry one.
        req.sampling_params.min_p = 0.0
    return message


def validate_sampling_mask_request(original, req, spec_algorithm):
    if is_ddtree(spec_algorithm):
        return "return_sampling_mask is not supported with DDTREE."
    return original(req, spec_algorithm)


def need_hidden_states(original):
    if is_ddtree(_active_algorithm()):
        return False
    return original()


def default_attention_backend(original, server_args, use_mla_backend, model_config):
    """SGLang's default attention backend, or for a DDTREE launch where DDTREE cannot
    verify with it (trtllm_mha at top-k 1 on B200/B300; fa3 at launch top-k 1 with
    runtime states of a larger top-k) the one SGLang picks for a tree there
    (``ddtree_registration.default_attention_backend``)."""
    from sglang.srt.speculative.ddtree_registration import (
        default_attention_backend as ddtree_default,
    )

    chosen = original(server_args, use_mla_backend, model_config)
    return ddtree_default(server_args, chosen, model_config)


def add_server_info(result: Dict[str, Any], scheduler) -> Dict[str, Any]:
    worker = getattr(scheduler, "draft_worker", None)
    describe = getattr(worker, "describe_ddtree", None)
    if callable(describe):
        result["ddtree"] = describe()
    return result


def _ddtree_worker(scheduler) -> Optional[Any]:
    worker = getattr(scheduler, "draft_worker", None)
    return worker if hasattr(worker, "ddtree_runtime") else None


def set_internal_state(original, controller, recv_req):
    """The DDTREE switch keys of a ``/set_internal_state`` request, handled as one
    update: all validated first (nothing changes on a refusal), committed in the
    scheduler's loop, between two rounds; the other keys go to SGLang's handlers."""
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput
    from sglang.srt.speculative.ddtree_runtime import SWITCH_KEYS, TreeSwitchRefused
    from sglang.srt.speculative.ddtree_trace import trace_keys

    requested = dict(recv_req.server_args)
    traced = set(trace_keys(requested))
    ours = {
        k: requested.pop(k) for k in list(requested) if k in SWITCH_KEYS or k in traced
    }
    worker = _ddtree_worker(controller.scheduler)
    if not ours or worker is None:
        return original(controller, recv_req)
    try:
        planned = worker.request_tree_switch(ours)
        if planned[0] == "trace" and planned[1] is not None:
            _check_trace_output(controller.scheduler)
    except TreeSwitchRefused as refusal:
        logger.warning(str(refusal))
        return SetInternalStateReqOutput(updated=False)
    if requested:
        recv_req.server_args = requested
        result = original(controller, recv_req)
        if not result.updated:
            worker.ddtree_runtime.last_refusal = (
                f"DDTREE: the switch was not made: SGLang refused "
                f"{', '.join(sorted(requested))} (see the server log)."
            )
            return result
    worker.commit_tree_switch(planned)
    if planned[0] == "trace":
        _set_trace_output(controller.scheduler, planned[1] is not None)
        logger.info("DDTREE trace: %s", worker.describe_trace())
        return SetInternalStateReqOutput(updated=True)
    # Acceptance statistics describe the previous tree; start over (as
    # _apply_accept_threshold does for a new threshold).
    reporter = controller.scheduler.metrics_reporter
    reporter.spec_total_num_accept_tokens = reporter.spec_total_num_forward_ct = 0
    logger.info(
        "DDTREE runtime switch: mode %s, tree %s",
        worker.ddtree_runtime.mode,
        worker.ddtree_runtime.active.as_dict(),
    )
    return SetInternalStateReqOutput(updated=True)


def add_internal_state(result, controller, recv_req):
    worker = _ddtree_worker(controller.scheduler)
    if worker is not None:
        result.internal_state["ddtree"] = worker.ddtree_runtime.describe()
        result.internal_state["ddtree"]["trace"] = worker.describe_trace()
    return result


def _check_trace_output(scheduler) -> None:
    """Refuse a trace whose records could not reach the client."""
    from sglang.srt.speculative.ddtree_runtime import TreeSwitchRefused

    streamer = getattr(scheduler, "output_streamer", None)
    if not getattr(type(streamer), "ddtree_trace_output", False):
        reason = "the output streamer is not DDTREE's"
    elif getattr(streamer, "rust_server", None) is not None:
        reason = "SGLang's Rust egress (SGLANG_RUST_SERVER) carries no customized info"
    else:
        return
    worker = _ddtree_worker(scheduler)
    message = f"DDTREE: the trace cannot be returned here: {reason}."
    worker.ddtree_runtime.last_refusal = message
    raise TreeSwitchRefused(message)


def _set_trace_output(scheduler, on: bool) -> None:
    """While a trace is on, the output streamer asks for DDTREE's customized info
    (``has_additional_customized_info``); while it is off it never calls in."""
    cls = type(getattr(scheduler, "output_streamer", None))
    if getattr(cls, "ddtree_trace_output", False):
        cls.has_additional_customized_info = on or cls.base_has_additional_info


def output_streamer_class(original, scheduler):
    """DDTREE servers stream with a subclass that can add ``meta_info["ddtree_trace"]``
    for finished requests (the scheduler's extension point for customized fields,
    ``sampling/sampling_observer.py``); it adds nothing until a trace is turned on."""
    base = original(scheduler)
    if not is_ddtree(getattr(scheduler, "spec_algorithm", None)):
        return base
    return _trace_streamer(base)


_TRACE_STREAMERS: Dict[type, type] = {}


def _trace_streamer(base: type) -> type:
    if base in _TRACE_STREAMERS:
        return _TRACE_STREAMERS[base]
    from sglang.srt.speculative import ddtree_trace

    class DDTreeOutputStreamer(base):
        __slots__ = ()
        ddtree_trace_output = True
        base_has_additional_info = bool(base.has_additional_customized_info)
        has_additional_customized_info = base_has_additional_info

        def build_additional_customized_info(self, reqs):
            info = dict(super().build_additional_customized_info(reqs))
            values = [
                ddtree_trace.finished_payload(req, _last_position(req)) for req in reqs
            ]
            if any(v is not None for v in values):
                info[ddtree_trace.TRACE_KEY] = values
            return info

    _TRACE_STREAMERS[base] = DDTreeOutputStreamer
    return DDTreeOutputStreamer


def _last_position(req) -> int:
    """Position of a finished request's last returned token (its visible length as
    ``OutputStreamer._visible_output_len`` counts it)."""
    visible = req.finished_len if req.finished_len is not None else len(req.output_ids)
    return len(req.origin_input_ids) + visible - 1


def trace_meta_info(
    original, manager, meta_info, state, customized_info, index, finish_reason
):
    """``meta_info["ddtree_trace"]`` is one object per request (SGLang accumulates a
    customized field as a list over the request's chunks); the other fields go to
    SGLang's own accumulation."""
    from sglang.srt.speculative.ddtree_trace import TRACE_KEY

    if TRACE_KEY not in customized_info:
        return original(
            manager, meta_info, state, customized_info, index, finish_reason
        )
    rest = {k: v for k, v in customized_info.items() if k != TRACE_KEY}
    if rest:
        original(manager, meta_info, state, rest, index, finish_reason)
    trace = customized_info[TRACE_KEY][index]
    if trace is not None:
        meta_info[TRACE_KEY] = trace
    return None


async def refuse_with_reason(original, manager, obj):
    """A refused DDTREE switch answers HTTP 400 with the scheduler's reason (0.5.23
    answers ``[false]`` and logs why), so a client sees why and can stop."""
    from sglang.srt.speculative.ddtree_runtime import SWITCH_KEYS
    from sglang.srt.speculative.ddtree_trace import trace_keys

    updated = await original(manager, obj)
    if all(updated) or not (
        any(k in SWITCH_KEYS for k in obj.server_args) or trace_keys(obj.server_args)
    ):
        return updated
    reason = None
    try:
        states = await manager.get_internal_state()
        reason = next(
            (
                s["ddtree"]["last_refusal"]
                for s in states
                if (s.get("ddtree") or {}).get("last_refusal")
            ),
            None,
        )
    except Exception as e:  # the reason is a courtesy; the refusal stands
        logger.warning("DDTREE: no refusal reason from the scheduler: %s", e)
    from fastapi import HTTPException

    raise HTTPException(
        status_code=400,
        detail=reason
        or "DDTREE: the switch was refused (not a DDTREE server with runtime "
        "states, or see the server log).",
    )


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
        # The name ``_attention_backend_default`` calls (overrides.py imports it from
        # model_override_base.py): resolution asks it only when no backend was named.
        "sglang.srt.arg_groups.overrides.get_default_attn_backend",
        default_attention_backend,
        HookType.AROUND,
    ),
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
    (
        "sglang.srt.managers.scheduler_components.internal_state."
        "SchedulerInternalStateController.set_internal_state",
        set_internal_state,
        HookType.AROUND,
    ),
    (
        "sglang.srt.managers.scheduler_components.internal_state."
        "SchedulerInternalStateController.get_internal_state",
        add_internal_state,
        HookType.AFTER,
    ),
    (
        "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin."
        "set_internal_state",
        refuse_with_reason,
        HookType.AROUND,
    ),
    (
        "sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class",
        output_streamer_class,
        HookType.AROUND,
    ),
    (
        "sglang.srt.managers.tokenizer_manager.TokenizerManager."
        "update_request_meta_info",
        trace_meta_info,
        HookType.AROUND,
    ),
)


def _resolve_target(target: str) -> Any:
    import pkgutil

    owner, attr = target.rsplit(".", 1)
    return getattr(pkgutil.resolve_name(owner), attr)


def _wraps_hook(fn: Any, hook: Any) -> bool:
    """Whether ``hook`` is in the wrapper chain HookRegistry built for ``fn``
    (``_wrap_fn`` closes over the hook and sets ``__wrapped__``)."""
    for _ in range(64):
        if fn is None:
            return False
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # an empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return False


def verify_hooks() -> list:
    """The hooked sites, each checked to hold its DDTREE hook; raise otherwise.

    ``load_plugins`` and ``HookRegistry.apply_hooks`` (``srt/plugins``) log a failing
    plugin or hook and carry on, so a server could start with, say, mask-less verify
    graphs (the ``get_spec_info`` hook missing) and return wrong tokens."""
    from sglang.srt.managers.scheduler_components import metrics_reporter
    from sglang.srt.speculative.ddtree_registration import DDTreeError

    missing = []
    for target, hook, _ in HOOKS:
        try:
            live = _resolve_target(target)
        except (AttributeError, ImportError, ValueError):
            live = None
        if not _wraps_hook(live, hook):
            missing.append(target)
    if register_ddtree() not in metrics_reporter._SPEC_DECODE_SNAPSHOT_ALGORITHMS:
        missing.append("metrics_reporter._SPEC_DECODE_SNAPSHOT_ALGORITHMS")
    if missing:
        raise DDTreeError(
            "DDTREE refuses to start: its hooks are not in place at "
            f"{', '.join(missing)} (look for 'Failed to apply hooks' or 'Failed to "
            "execute general plugin' in the log)."
        )
    return [
        target.rsplit(".", 2)[-2] + "." + target.rsplit(".", 1)[-1]
        for target, _, _ in HOOKS
    ]


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
