"""DDTREE's tree trace: per request and per verify round, what a predictor needs to
compute the acceptance of any (budget, top-k) tree over the same draft.

With target-only tree rejection sampling the walk at a node accepts child ``c`` with
probability ``p_target(c | path)`` whatever the sibling order, so the expected accepted
length of a tree is ``1 + sum over its nodes of the product of p along the node's
path`` (at temperature 0 the same sum with ``p`` in {0, 1}). Which nodes a (budget,
top-k) tree holds depends only on the draft's per-position top-k, which the builder
turns into the tree. A traced round therefore verifies the *union* of the grid's
best-first trees (for each top-k ``K`` of the grid, the builder's tree at the largest
grid budget for ``K``: best-first trees are nested in the budget at a fixed top-k),
united by token path, and records the draft's top-k table and, per verified node, the
target's probability of its token under the request's own sampling distribution.

A recorded round commits one token: the first of the path the verifier accepted (the
depth-1 node it accepted, else the bonus it drew), so a request's recorded rounds start
at consecutive positions and the trace holds the draft at *every* position of its
stream. A smaller tree's rounds start where its own accepts ended, which the union's
rounds would skip; with a round at every position a predictor replays the smaller tree
along the stream exactly. The first token of the verifier's path is distributed as the
target's next token (the walk's first step is lossless on its own), so the tokens a
traced request returns follow the same distribution as any other; at temperature 0
they are the same tokens. Once a request's record is full (``max_rounds``) its rounds
commit the whole path again.

Off by default. While off the worker's round never calls into this module (one
attribute test per round); while on, building is host-side with the per-request
reference builder: a trace run is a measurement, its speed is not what is measured.

Torch and the standard library only (the builder is passed in), so it can be loaded
by path and tested without SGLang.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

TRACE_KEY = "ddtree_trace"
# 2: a recorded round commits one token (rounds at consecutive positions).
VERSION = 2
DEFAULT_MAX_ROUNDS = 64
MAX_ROUNDS_LIMIT = 4096
_GRID_PREFIX = TRACE_KEY + "_grid_"
_GRID_KEY = re.compile(re.escape(_GRID_PREFIX) + r"(\d+)x(\d+)")
_MAX_ROUNDS_KEY = TRACE_KEY + "_max_rounds"
# The top-k SGLang stores for "no top-k" (sampling_params.py, TOP_K_ALL).
_TOP_K_ALL = 1 << 30


class TraceRefused(ValueError):
    """A ``ddtree_trace`` switch this server cannot serve; the message says why."""


def tree_depth(budget: int, block_size: int) -> int:
    """Draft rows a tree of ``budget`` reads: ``min(block - 1, budget)``, as the
    worker slices its candidate table for a round."""
    return min(int(block_size) - 1, int(budget))


def _tree_nodes(topk: int, depth: int, cap: int) -> int:
    """Nodes of the full ``topk``-ary product tree of ``depth`` levels, at most ``cap``."""
    total, level = 0, 1
    for _ in range(depth):
        level *= topk
        total += level
        if total >= cap:
            return cap
    return total


@dataclass(frozen=True)
class TraceConfig:
    """A validated trace request and the runtime state that verifies its union."""

    grid: Tuple[Tuple[int, int], ...]
    max_rounds: int
    block_size: int
    union_bound: int  # worst-case union size (non-root nodes)
    state_budget: int  # the runtime state the traced rounds verify with

    @property
    def trees(self) -> Tuple[Tuple[int, int], ...]:
        """``(top-k, largest grid budget at that top-k)``, by top-k."""
        largest: Dict[int, int] = {}
        for budget, topk in self.grid:
            largest[topk] = max(budget, largest.get(topk, 0))
        return tuple(sorted(largest.items()))

    @property
    def depth(self) -> int:
        """Rows of the recorded draft table (the deepest grid tree's)."""
        return tree_depth(max(b for b, _ in self.grid), self.block_size)

    @property
    def topk(self) -> int:
        """Columns of the recorded draft table (the grid's largest top-k)."""
        return max(k for _, k in self.grid)

    @property
    def width(self) -> int:
        """Tokens a traced round verifies per request (root included)."""
        return self.state_budget + 1

    def describe(self) -> Dict[str, Any]:
        return {
            "on": True,
            "grid": [list(g) for g in self.grid],
            "max_rounds": self.max_rounds,
            "union_bound": self.union_bound,
            "state_budget": self.state_budget,
            "width": self.width,
        }


OFF_DESCRIPTION: Dict[str, Any] = {"on": False}


def union_bound(grid: Sequence[Tuple[int, int]], block_size: int) -> int:
    """Worst-case non-root node count of the grid's union: the sum over top-k ``K`` of
    the largest grid budget at ``K`` (each capped by the nodes a ``K``-ary tree of its
    depth has), capped by the nodes of the grid's widest product tree."""
    largest: Dict[int, int] = {}
    for budget, topk in grid:
        largest[topk] = max(budget, largest.get(topk, 0))
    total = sum(
        _tree_nodes(k, tree_depth(b, block_size), b) for k, b in largest.items()
    )
    deepest = tree_depth(max(largest.values()), block_size)
    return _tree_nodes(max(largest), deepest, total)


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceRefused(f"DDTREE: {what} must be an integer, got {value!r}.")
    if float(value) != int(value):
        raise TraceRefused(f"DDTREE: {what} must be an integer, got {value!r}.")
    return int(value)


def trace_keys(request: Mapping[str, Any]) -> List[str]:
    """The keys of a ``/set_internal_state`` request that belong to the trace."""
    return [k for k in request if k == TRACE_KEY or k.startswith(TRACE_KEY + "_")]


def trace_request(
    grid: Sequence[Sequence[int]], max_rounds: Optional[int] = None
) -> Dict[str, int]:
    """The ``server_args`` of ``/set_internal_state`` that turn the trace on for
    ``grid`` (SGLang 0.5.23 takes numbers only there, ``SetInternalStateReq``):
    ``{"ddtree_trace": 1, "ddtree_trace_grid_<budget>x<topk>": 1, ...,
    "ddtree_trace_max_rounds": n}``; ``{"ddtree_trace": 0}`` turns it off."""
    out = {TRACE_KEY: 1}
    out.update({f"{_GRID_PREFIX}{int(b)}x{int(k)}": 1 for b, k in grid})
    if max_rounds is not None:
        out[_MAX_ROUNDS_KEY] = int(max_rounds)
    return out


def parse_trace_request(
    request: Mapping[str, Any],
    *,
    budgets: Optional[Sequence[int]],
    topk_max: int,
    block_size: int,
) -> Optional[TraceConfig]:
    """The trace keys of a ``/set_internal_state`` request (:func:`trace_request`):
    returns the config, None for ``{"ddtree_trace": 0}`` (off), or raises
    :class:`TraceRefused`. ``budgets`` are the server's runtime-state budgets (None:
    a server without runtime states)."""
    keys = trace_keys(request)
    if TRACE_KEY not in keys:
        raise TraceRefused(
            f"DDTREE: {keys[0] if keys else 'the request'} goes with ddtree_trace "
            "(1 = on, 0 = off)."
        )
    on = _int(request[TRACE_KEY], TRACE_KEY)
    if on not in (0, 1):
        raise TraceRefused(f"DDTREE: {TRACE_KEY} must be 0 (off) or 1 (on), got {on}.")
    if on == 0:
        if len(keys) > 1:
            raise TraceRefused(f"DDTREE: {TRACE_KEY} 0 (off) goes alone.")
        return None
    if budgets is None:
        raise TraceRefused(
            "DDTREE: a trace needs the runtime tree states; launch with "
            "--speculative-adaptive-config holding ddtree.budgets."
        )
    grid: List[Tuple[int, int]] = []
    max_rounds = DEFAULT_MAX_ROUNDS
    for key in keys:
        if key == TRACE_KEY:
            continue
        if key == _MAX_ROUNDS_KEY:
            max_rounds = _int(request[key], key)
            continue
        match = _GRID_KEY.fullmatch(key)
        if match is None:
            raise TraceRefused(
                f"DDTREE: {key} is not a trace key ({TRACE_KEY}, "
                f"{_GRID_PREFIX}<budget>x<topk>, {_MAX_ROUNDS_KEY})."
            )
        if _int(request[key], key) != 1:
            raise TraceRefused(f"DDTREE: {key} must be 1 (a grid cell).")
        budget, topk = int(match.group(1)), int(match.group(2))
        if budget < 1:
            raise TraceRefused(
                f"DDTREE: a trace grid budget must be >= 1, got {budget}."
            )
        if not 1 <= topk <= topk_max:
            raise TraceRefused(
                f"DDTREE: trace grid top-k {topk} is outside 1..{topk_max} (the draft "
                "candidates are computed for ddtree.topk_max); relaunch with a larger "
                "ddtree.topk_max."
            )
        grid.append((budget, topk))
    if not grid:
        raise TraceRefused(
            f"DDTREE: a trace needs a grid: {_GRID_PREFIX}<budget>x<topk> keys, each 1."
        )
    grid.sort()
    if not 1 <= max_rounds <= MAX_ROUNDS_LIMIT:
        raise TraceRefused(
            f"DDTREE: {_MAX_ROUNDS_KEY} must be in 1..{MAX_ROUNDS_LIMIT}, "
            f"got {max_rounds}."
        )
    bound = union_bound(grid, block_size)
    fitting = sorted(b for b in budgets if b >= bound)
    if not fitting:
        raise TraceRefused(
            f"DDTREE: the trace grid's union tree can hold {bound} nodes, more than "
            f"the largest runtime state (budget {max(budgets)}); relaunch with a "
            f"budget >= {bound} in ddtree.budgets of --speculative-adaptive-config."
        )
    return TraceConfig(
        grid=tuple(grid),
        max_rounds=max_rounds,
        block_size=int(block_size),
        union_bound=bound,
        state_budget=fitting[0],
    )


def union_tree(
    ids: Sequence[Sequence[int]],
    logps: Sequence[Sequence[float]],
    root_token: int,
    config: TraceConfig,
    build: Callable[..., Any],
) -> Any:
    """The union of the grid's best-first trees over one request's draft table
    (``ids`` / ``logps``: ``config.depth`` rows of ``config.topk`` candidates, sorted),
    as a tree of ``build``'s type (``ddtree_reference.DDTree``): nodes identified by
    their token path, ordered by ``(-logw, depth, ranks along the path)`` -- every
    parent before its children, as the builder orders its own trees."""
    nodes: Dict[Tuple[int, ...], Tuple[float, int, Tuple[int, ...]]] = {}
    rank_of = [{int(t): r for r, t in enumerate(row)} for row in ids]
    tree_type = None
    for topk, budget in config.trees:
        rows = tree_depth(budget, config.block_size)
        tree = build(
            [list(r[:topk]) for r in ids[:rows]],
            [list(r[:topk]) for r in logps[:rows]],
            budget,
            root_token,
        )
        tree_type = type(tree)
        paths: List[Tuple[int, ...]] = [()]
        ranks: List[Tuple[int, ...]] = [()]
        for i in range(1, len(tree.parents)):
            p = tree.parents[i]
            token = int(tree.token_ids[i])
            paths.append(paths[p] + (token,))
            ranks.append(ranks[p] + (rank_of[tree.depths[i] - 1][token],))
            nodes.setdefault(
                paths[i], (float(tree.node_logws[i]), tree.depths[i], ranks[i])
            )
    order = sorted(
        nodes, key=lambda path: (-nodes[path][0], nodes[path][1], nodes[path][2])
    )
    index = {(): 0}
    parents, depths, tokens, logws = [-1], [0], [int(root_token)], [0.0]
    for path in order:
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        depths.append(len(path))
        tokens.append(path[-1])
        logws.append(nodes[path][0])
    assert tree_type is not None
    return tree_type(parents, depths, tokens, logws)


def to_device(trees: Any, device: Any) -> Any:
    """A ``TreeBatch`` (frozen dataclass of tensors) with its tensors on ``device``."""
    moved = {
        f.name: getattr(trees, f.name).to(device)
        for f in dataclasses.fields(trees)
        if isinstance(getattr(trees, f.name), torch.Tensor)
    }
    return dataclasses.replace(trees, **moved)


def short_float(x: float) -> float:
    """The shortest decimal that reads back as the same float32 (compact JSON)."""
    packed = struct.pack("<f", x)
    for digits in range(1, 10):
        y = float(f"{x:.{digits}g}")
        if struct.pack("<f", y) == packed:
            return y
    return float(x)


def node_probabilities(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_argmax: torch.Tensor,
    target_probs: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per node ``[bs, N]``: the target's probability of the node's token at its
    parent's row (``target_probs`` ``[bs, N, V]``; None for an all-greedy batch: 1.0
    at the argmax, 0.0 elsewhere) and whether the token is the target's argmax there.
    The root's entries are meaningless (its parent is clamped to itself)."""
    up = parents.clamp(min=0)
    argmax_at_parent = torch.gather(
        target_argmax.view(tokens.shape).to(tokens.dtype), 1, up
    )
    is_argmax = tokens == argmax_at_parent
    if target_probs is None:
        return is_argmax.to(torch.float32), is_argmax
    rows = torch.gather(
        target_probs, 1, up.unsqueeze(2).expand(-1, -1, target_probs.shape[2])
    )
    p = torch.gather(rows, 2, tokens.unsqueeze(2)).squeeze(2)
    return p.to(torch.float32), is_argmax


def sampling_of(params: Any) -> Dict[str, Any]:
    """The request's sampling distribution as the verifier applies it
    (``SamplingParams`` after SGLang's ``normalize``): a greedy request (top-k 1,
    which is how SGLang stores temperature 0) reads temperature 0.0 and top-k 1; "no
    top-k" reads -1."""
    top_k = int(params.top_k)
    greedy = top_k == 1 or float(params.temperature) == 0.0
    return {
        "temperature": 0.0 if greedy else float(params.temperature),
        "top_k": 1 if greedy else (-1 if top_k <= 0 or top_k >= _TOP_K_ALL else top_k),
        "top_p": float(params.top_p),
        "min_p": float(params.min_p),
    }


@dataclass
class RequestTrace:
    """One request's trace, bounded by ``config.max_rounds`` rounds."""

    config: TraceConfig
    sampling: Dict[str, Any]
    rounds: List[Dict[str, Any]] = field(default_factory=list)
    truncated: bool = False

    def recording(self) -> bool:
        """Whether the request's next round is recorded (and commits one token)."""
        return len(self.rounds) < self.config.max_rounds

    def wants_round(self) -> bool:
        """Whether the next round is recorded (else the trace is marked truncated)."""
        if self.recording():
            return True
        self.truncated = True
        return False

    def payload(self, end: Optional[int] = None) -> Dict[str, Any]:
        """``meta_info["ddtree_trace"]``. ``end``: the position of the request's last
        returned token; a round whose root is at or past it (the overlap scheduler
        runs one round more for a request that just finished) committed nothing the
        request returns."""
        rounds = [r for r in self.rounds if end is None or r["prefix"] < end]
        return {
            "version": VERSION,
            "grid": [list(g) for g in self.config.grid],
            "block": self.config.block_size,
            "sampling": dict(self.sampling),
            "truncated": self.truncated,
            "rounds": rounds,
        }


def round_record(
    *,
    prefix: int,
    root: int,
    draft_ids: List[List[int]],
    draft_logp: List[List[float]],
    tree: Any,
    p: List[float],
    argmax: List[bool],
    accepted: int,
) -> Dict[str, Any]:
    """One ROUND of the trace format (see the bundle README): ``p`` / ``argmax`` per
    node of ``tree`` (root first, its entry dropped)."""
    n = len(tree.parents)
    return {
        "prefix": int(prefix),
        "root": int(root),
        "draft_ids": draft_ids,
        "draft_logp": draft_logp,
        "parent": [int(x) for x in tree.parents[1:n]],
        "token": [int(x) for x in tree.token_ids[1:n]],
        "p": [short_float(x) for x in p[1:n]],
        "argmax": [int(bool(x)) for x in argmax[1:n]],
        "accepted": int(accepted),
    }


def record_rounds(
    reqs: Sequence[Any],
    config: TraceConfig,
    *,
    prefix_lens: List[int],
    roots: List[int],
    draft_ids: List[List[List[int]]],
    draft_logp: List[List[List[float]]],
    trees: Sequence[Any],
    p: List[List[float]],
    argmax: List[List[bool]],
    accepted: List[int],
) -> None:
    """Append this round to each request's trace (``req.ddtree_trace``, created at
    the request's first traced round)."""
    for b, req in enumerate(reqs):
        trace = getattr(req, TRACE_KEY, None)
        if trace is None:
            trace = RequestTrace(config, sampling_of(req.sampling_params))
            setattr(req, TRACE_KEY, trace)
        if not trace.wants_round():
            continue
        trace.rounds.append(
            round_record(
                prefix=prefix_lens[b],
                root=roots[b],
                draft_ids=draft_ids[b],
                draft_logp=draft_logp[b],
                tree=trees[b],
                p=p[b],
                argmax=argmax[b],
                accepted=accepted[b],
            )
        )


def recording_rows(reqs: Sequence[Any]) -> List[bool]:
    """Per request of a traced round: whether this round is recorded (a request's first
    traced round always is; ``max_rounds`` >= 1)."""
    out = []
    for req in reqs:
        trace = getattr(req, TRACE_KEY, None)
        out.append(trace is None or trace.recording())
    return out


def commit_first_only(paths: Any, rows: Sequence[bool]) -> Any:
    """``paths`` (``ddtree_utils.AcceptedPaths``) with the recorded rows cut to their
    first emitted token: entry 0 (the root, and the token the verifier emitted after
    it), repeated along the row as the type wants past its length."""
    keep = torch.tensor(list(rows), dtype=torch.bool, device=paths.commit_lens.device)
    first = keep.unsqueeze(1)
    return dataclasses.replace(
        paths,
        nodes=torch.where(
            first, paths.nodes[:, :1].expand_as(paths.nodes), paths.nodes
        ),
        tokens=torch.where(
            first, paths.tokens[:, :1].expand_as(paths.tokens), paths.tokens
        ),
        commit_lens=torch.where(
            keep, torch.ones_like(paths.commit_lens), paths.commit_lens
        ),
    )


def finished_payload(req: Any, end: Optional[int]) -> Optional[Dict[str, Any]]:
    """The trace of a finished request, once (then dropped from it); None otherwise.
    ``end``: the position of its last returned token (:meth:`RequestTrace.payload`)."""
    trace = getattr(req, TRACE_KEY, None)
    if trace is None or not req.finished():
        return None
    setattr(req, TRACE_KEY, None)
    return trace.payload(end)
