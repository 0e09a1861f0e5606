"""Registers the DDTREE speculative algorithm with SGLang 0.5.23.

Imported at the bottom of ``sglang/srt/speculative/spec_info.py`` (patched copy), so
the registration happens in every process that resolves an algorithm name: the
launcher that validates server args and every spawned scheduler. A
``sglang.srt.plugins`` entry point would need a dist-info ``entry_points.txt`` owned
by some installed distribution; sglang is installed from a wheel, so writing into its
dist-info would be undone by any reinstall and invisible to ``pip check``.

DDTREE is a DFLASH-family algorithm: same draft model, same target hidden capture,
same draft KV materialisation. :class:`DDTreeSpecAlgo` therefore answers the
``is_dflash*()`` predicates like ``SpeculativeAlgorithm.DFLASH`` so the scheduler,
model runner and KV sizing take the DFlash branches, and only the worker differs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

DDTREE_NAME = "DDTREE"
DEFAULT_DDTREE_BUDGET = 16
DEFAULT_DDTREE_TOPK = 4
# The verify window holds the root plus `budget` nodes; beyond this the tree mask and
# per-request KV reservation grow past what the DFlash verify buffers are tuned for.
MAX_DDTREE_BUDGET = 1024


def ddtree_verify_width(budget: int) -> int:
    """Tokens per request in one target verify pass: the root plus every tree node."""
    return int(budget) + 1


class DDTreeSpecAlgo(CustomSpecAlgo):
    """DDTREE answers like DFLASH everywhere except for its own name and worker."""

    def is_dflash(self) -> bool:
        return True

    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def supports_prefill_shared_read_done(self) -> bool:
        return True

    def supports_grammar_overlap(self) -> bool:
        # Grammar masks are built for chains (GrammarTree.from_linear_chain); the tree
        # worker refuses grammar requests, so there is nothing to overlap.
        return False

    def supports_mixed_chunk(self) -> bool:
        return True

    # The scheduler calls the next three on any algorithm (overlap_utils.py,
    # scheduler.py) but CustomSpecAlgo does not define them in 0.5.23; they mirror
    # SpeculativeAlgorithm's answers for DFLASH.
    def need_topk(self) -> bool:
        return False

    def carries_draft_hidden_states(self) -> bool:
        return False

    def create_future_map(
        self,
        device,
        req_to_token_pool,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(
            device,
            self,
            req_to_token_pool,
            needs_cpu_seq_lens,
            needs_confidence_relay,
        )

    def handle_server_args(self, server_args: ServerArgs) -> None:
        """Validate the DDTree flags and size the verify window.

        ``server_args`` is the recording stand-in SGLang hands to registered
        algorithms: plain attribute writes are declared as resolutions.
        """
        validate_ddtree_server_args(server_args)
        budget = int(server_args.speculative_ddtree_budget or DEFAULT_DDTREE_BUDGET)
        topk = int(server_args.speculative_ddtree_topk or DEFAULT_DDTREE_TOPK)
        server_args.speculative_ddtree_budget = budget
        server_args.speculative_ddtree_topk = topk
        # EAGLE-style knobs still size generic scheduler buffers; DFLASH pins them
        # to 1 for the same reason.
        server_args.speculative_num_steps = 1
        server_args.speculative_eagle_topk = 1
        # Every per-request reservation (KV slots, verify graphs, logits rows) is
        # sized by this field; for DDTree it is the tree window, not the draft block.
        server_args.speculative_num_draft_tokens = ddtree_verify_width(budget)
        if server_args.max_running_requests is None:
            server_args.max_running_requests = 48


def validate_ddtree_server_args(server_args: ServerArgs) -> None:
    """Refuse flag combinations the tree worker cannot serve, naming the flag."""
    budget = server_args.speculative_ddtree_budget
    topk = server_args.speculative_ddtree_topk
    if budget is not None and not 1 <= int(budget) <= MAX_DDTREE_BUDGET:
        raise ValueError(
            f"--speculative-ddtree-budget must be in 1..{MAX_DDTREE_BUDGET}, got {budget}."
        )
    if topk is not None and int(topk) < 1:
        raise ValueError(f"--speculative-ddtree-topk must be >= 1, got {topk}.")
    if server_args.speculative_draft_model_path is None:
        raise ValueError(
            "DDTREE speculative decoding requires --speculative-draft-model-path "
            "(a DFlash draft model)."
        )
    if server_args.pp_size != 1:
        raise ValueError("DDTREE speculative decoding only supports pp_size == 1.")
    if server_args.speculative_draft_window_size is not None:
        raise ValueError(
            "DDTREE does not support --speculative-draft-window-size (compact draft "
            "cache): tree nodes are not a contiguous window."
        )


def _ddtree_worker_factory(server_args: ServerArgs):
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeWorkerV2

    return DDTreeWorkerV2


def register_ddtree() -> Optional[DDTreeSpecAlgo]:
    """Register DDTREE once per process; a second call is a no-op."""
    from sglang.srt.speculative.spec_registry import get_spec

    existing = get_spec(DDTREE_NAME)
    if existing is not None:
        return existing  # type: ignore[return-value]
    SpeculativeAlgorithm.register(
        DDTREE_NAME,
        supports_overlap=True,
        spec_class=DDTreeSpecAlgo,
    )(_ddtree_worker_factory)
    return get_spec(DDTREE_NAME)  # type: ignore[return-value]


register_ddtree()
