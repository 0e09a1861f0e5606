"""A synthetic language: a path-dependent target model and a noisy block drafter.

Why synthetic: acceptance length is what makes speculative decoding pay off, and it
must come out of the *real* DDTree code (tree building, verification, rejection
sampling), not a formula. That code needs per-node target logits and per-position
draft top-k lists; this module provides both cheaply on CPU.

Target. The next-token logits at absolute position ``pos`` after token ``last`` in a
request keyed ``key`` are

    logits = beta * (w * G[h(key, pos)] + (1 - w) * G[h(key, pos, last)])

where ``G`` is a fixed seeded table of standard Gumbel rows (``TABLE_ROWS x VOCAB``) and
``h`` a seeded integer hash. The k-th largest of V Gumbels sits near ``log(V / k)``, so
``softmax(beta * z)`` has probabilities falling roughly like ``k ** -beta``: Zipf-like,
with ``beta`` setting how predictable a prompt category is. The first term depends only
on the position (what the text "is about" there), the second on the path, so a sibling
branch of the draft tree sees a related but different distribution.

Drafter. Like DFlash's block-diffusion drafter it proposes all positions of a block at
once from the committed context only: at depth ``d`` it sees the target's logits along
its own greedy chain plus Gaussian-like noise (another Gumbel row, scaled by
``noise * (1 + growth * (d - 1))``), i.e. per-position marginals that get worse with
depth. Its top-k per position feeds ``build_ddtree_tree_from_topk``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree_ops.sim.text import _MOD, EOS_TOKEN, VOCAB

TABLE_ROWS = 8192


@dataclass(frozen=True)
class Category:
    """How predictable a kind of prompt is, for target and drafter alike."""

    name: str
    beta: float
    position_weight: float
    draft_noise: float
    noise_growth: float


CATEGORIES: dict[str, Category] = {
    "code": Category("code", beta=2.4, position_weight=0.75, draft_noise=0.55, noise_growth=0.10),
    "math": Category("math", beta=2.0, position_weight=0.65, draft_noise=0.70, noise_growth=0.12),
    "chat": Category("chat", beta=1.6, position_weight=0.55, draft_noise=0.85, noise_growth=0.15),
}


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash on int64 tensors (products stay below 2**62: no overflow)."""
    x = x % _MOD
    for mul, add in ((1103515245, 12345), (1664525, 1013904223)):
        x = (x * mul + add) % _MOD
        x = x ^ (x >> 13)
    return x


class SyntheticLanguage:
    """Seeded target/drafter pair; every method is deterministic given its inputs."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        u = torch.rand((TABLE_ROWS, VOCAB), generator=gen, dtype=torch.float32)
        self.table = -torch.log(-torch.log(u.clamp(1e-7, 1 - 1e-7)))
        # Keep EOS rare so that lengths are governed by max_new_tokens, as in benchmarks.
        self.table[:, EOS_TOKEN] -= 4.0
        self.seed = seed

    def _rows(self, mixed_keys: torch.Tensor) -> torch.Tensor:
        """Table rows for already-hashed keys (hashing twice would only cost time)."""
        return self.table[mixed_keys % TABLE_ROWS]

    def target_logits(
        self,
        keys: torch.Tensor,
        positions: torch.Tensor,
        last_tokens: torch.Tensor,
        categories: list[Category],
    ) -> torch.Tensor:
        """Logits ``[M, VOCAB]`` for rows (request key, position, previous token)."""
        beta = torch.tensor([c.beta for c in categories], dtype=torch.float32)[:, None]
        w = torch.tensor([c.position_weight for c in categories], dtype=torch.float32)[:, None]
        return self._logits(keys, positions, last_tokens, beta, w)

    def _logits(
        self,
        keys: torch.Tensor,
        positions: torch.Tensor,
        last_tokens: torch.Tensor,
        beta: torch.Tensor,
        w: torch.Tensor,
    ) -> torch.Tensor:
        pos_key = _mix(keys * 7919 + positions)
        path_key = _mix(pos_key * 131 + last_tokens + 1)
        return beta * (w * self._rows(pos_key) + (1.0 - w) * self._rows(path_key))

    def draft_topk(
        self,
        keys: torch.Tensor,
        start_positions: torch.Tensor,
        last_tokens: torch.Tensor,
        categories: list[Category],
        depth: int,
        topk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position draft top-k ``(ids, logprobs)``, each ``[B, depth, topk]``.

        Position ``d`` (0-based) drafts the token at ``start_positions + d``; the context
        the drafter assumes is its own greedy chain, which is what a block drafter that
        never sees the verified path effectively conditions on.
        """
        beta = torch.tensor([c.beta for c in categories], dtype=torch.float32)[:, None]
        w = torch.tensor([c.position_weight for c in categories], dtype=torch.float32)[:, None]
        noise = torch.tensor([c.draft_noise for c in categories], dtype=torch.float32)[:, None]
        growth = torch.tensor([c.noise_growth for c in categories], dtype=torch.float32)[:, None]
        ids_out = []
        lp_out = []
        last = last_tokens
        for d in range(depth):
            pos = start_positions + d
            logits = self._logits(keys, pos, last, beta, w)
            noise_rows = self._rows(_mix(keys * 104729 + pos * 17 + 3))
            logits = logits + noise * (1.0 + growth * d) * noise_rows
            logprobs = torch.log_softmax(logits, dim=-1)
            top_lp, top_ids = torch.topk(logprobs, topk, dim=-1)
            ids_out.append(top_ids)
            lp_out.append(top_lp)
            last = top_ids[:, 0]
        return torch.stack(ids_out, dim=1), torch.stack(lp_out, dim=1)
