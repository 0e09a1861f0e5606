"""Verify input for DDTree: a DFlash verify pass whose tokens form a tree.

The target runs one ``TARGET_VERIFY`` forward over ``N = budget + 1`` tokens per
request (the root, i.e. the last committed token, plus the tree nodes in pop order).
Each node sits at the position of its depth and attends to the committed prefix and
to its own ancestors only. The three ``retrieve_*`` tensors are the first-child /
next-sibling encoding the EAGLE sampling kernel consumes; they are built only when
some request samples (``None`` on the greedy path, where the walk needs the parent
array alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sglang.srt.speculative.ddtree_utils import DDTree, layout_verify_batch
from sglang.srt.speculative.dflash_info import DFlashVerifyInput


@dataclass
class DDTreeVerifyInput(DFlashVerifyInput):
    """A DFlash verify input plus the tree encoding.

    ``topk`` is the tree's branching factor: attention backends that gate tree
    (custom-mask) metadata on ``topk > 1`` then honour ``custom_mask`` instead of
    falling back to a causal chain.
    """

    retrieve_index: Optional[torch.Tensor] = None
    retrieve_next_token: Optional[torch.Tensor] = None
    retrieve_next_sibling: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class DDTreeVerifyTensors:
    """Everything one verify pass needs, laid out ``[bs, N]`` (flattened where SGLang
    expects flat tensors)."""

    tokens: torch.Tensor  # [bs, N] int64
    positions: torch.Tensor  # [bs * N] int64
    custom_mask: torch.Tensor  # flat bool, per request [N, prefix + N] row-major
    retrieve_index: Optional[torch.Tensor]  # [bs, N] int64 or None (greedy)
    retrieve_next_token: Optional[torch.Tensor]
    retrieve_next_sibling: Optional[torch.Tensor]


def build_ddtree_verify_tensors(
    trees: Sequence[DDTree],
    prefix_lens: Sequence[int],
    num_nodes: int,
    *,
    device: torch.device | str,
    need_retrieve: bool,
) -> DDTreeVerifyTensors:
    """Lay out ``trees`` for one target verify pass.

    Built on the host (the trees are host objects, ``budget`` nodes each) in
    whole-batch operations (``layout_verify_batch``: a short tree is padded with nodes
    hanging off the root that carry the root token and that no retrieve pointer
    reaches) and moved to ``device`` in one copy per tensor.
    """
    layout = layout_verify_batch(trees, prefix_lens, num_nodes, need_retrieve=need_retrieve)
    return DDTreeVerifyTensors(
        tokens=layout.tokens.to(device, non_blocking=True),
        positions=layout.positions.reshape(-1).to(device, non_blocking=True),
        custom_mask=layout.custom_mask.to(device, non_blocking=True),
        retrieve_index=_to_device(layout.retrieve_index, device),
        retrieve_next_token=_to_device(layout.retrieve_next_token, device),
        retrieve_next_sibling=_to_device(layout.retrieve_next_sibling, device),
    )


def _to_device(t: Optional[torch.Tensor], device: torch.device | str) -> Optional[torch.Tensor]:
    return None if t is None else t.to(device)
