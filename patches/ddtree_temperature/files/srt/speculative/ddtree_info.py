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
from typing import List, Optional, Sequence

import torch

from sglang.srt.speculative.ddtree_utils import (
    DDTree,
    compile_ddtree_retrieve,
    tree_attention_mask,
    tree_positions,
)
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


def _padded_parents(tree: DDTree, num_nodes: int) -> List[int]:
    """Pad a short tree (draft candidates ran out) with nodes hanging off the root.

    Padded nodes carry the root token and see only the prefix, the root and
    themselves; the commit path never accepts them because the greedy walk, the
    sampler and the retrieve encoding only see the real tree.
    """
    parents = list(tree.parents)
    parents.extend([0] * (num_nodes - len(parents)))
    return parents


def build_ddtree_verify_tensors(
    trees: Sequence[DDTree],
    prefix_lens: Sequence[int],
    num_nodes: int,
    *,
    device: torch.device | str,
    need_retrieve: bool,
) -> DDTreeVerifyTensors:
    """Lay out ``trees`` for one target verify pass.

    Built on the host (the trees are host objects, ``budget`` nodes each) and moved
    to ``device`` in one copy per tensor.
    """
    bs = len(trees)
    tokens = torch.empty((bs, num_nodes), dtype=torch.int64)
    positions = torch.empty((bs, num_nodes), dtype=torch.int64)
    masks: List[torch.Tensor] = []
    if need_retrieve:
        r_index = torch.empty((bs, num_nodes), dtype=torch.int64)
        r_next = torch.empty((bs, num_nodes), dtype=torch.int64)
        r_sib = torch.empty((bs, num_nodes), dtype=torch.int64)
    for b, tree in enumerate(trees):
        n = len(tree.parents)
        if n > num_nodes:
            raise ValueError(
                f"DDTree with {n} nodes does not fit the verify window of {num_nodes}."
            )
        parents = _padded_parents(tree, num_nodes)
        depths = list(tree.depths) + [1] * (num_nodes - n)
        root = int(tree.token_ids[0])
        tokens[b, :n] = torch.as_tensor(list(tree.token_ids), dtype=torch.int64)
        tokens[b, n:] = root
        prefix = int(prefix_lens[b])
        # The root is the last committed token; it is re-fed at position prefix.
        positions[b] = tree_positions(depths, prefix).to(torch.int64).cpu()
        tree_mask = tree_attention_mask(parents).cpu()
        masks.append(
            torch.cat(
                [torch.ones((num_nodes, prefix), dtype=torch.bool), tree_mask], dim=1
            ).reshape(-1)
        )
        if need_retrieve:
            # Encode the real tree only: no pointer reaches a padded node, so the
            # sampling kernel can never try (and accept) one.
            idx, nxt, sib = compile_ddtree_retrieve(
                list(tree.parents), list(tree.node_logws), offset=b * num_nodes
            )
            r_index[b] = torch.arange(
                b * num_nodes, (b + 1) * num_nodes, dtype=torch.int64
            )
            r_index[b, :n] = idx.cpu()
            r_next[b].fill_(-1)
            r_next[b, :n] = nxt.cpu()
            r_sib[b].fill_(-1)
            r_sib[b, :n] = sib.cpu()
    return DDTreeVerifyTensors(
        tokens=tokens.to(device, non_blocking=True),
        positions=positions.reshape(-1).to(device, non_blocking=True),
        custom_mask=torch.cat(masks).to(device, non_blocking=True),
        retrieve_index=r_index.to(device) if need_retrieve else None,
        retrieve_next_token=r_next.to(device) if need_retrieve else None,
        retrieve_next_sibling=r_sib.to(device) if need_retrieve else None,
    )
