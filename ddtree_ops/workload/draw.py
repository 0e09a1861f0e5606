"""A sweep's workload: what it asks to send (:class:`Workload`), and the exact prompts drawn
from it (:class:`WorkloadPrompts`).

The workload is drawn deterministically from the seed, and its hash (prompts,
max_new_tokens, ignore_eos) goes on every ledger row so ``--resume`` and reports only
compare runs that sent the same thing.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddtree_ops.errors import SweepError
from ddtree_ops.workload.datasets import load_dataset
from ddtree_ops.workload.prompt import Prompt
from ddtree_ops.workload.prompts import find_prompt_set, load_prompt_file


@dataclass(frozen=True)
class DatasetRef:
    """A published data set by name (:mod:`.datasets`), read from ``path`` (a file or a
    folder), or, without one, from a shipped or locally cached copy."""

    name: str
    path: Path | None = None


@dataclass(frozen=True)
class Workload:
    """What is sent: prompts (files, a named set and/or published data sets), how many,
    how long, which seed."""

    prompt_files: tuple[Path, ...] = ()
    prompt_set: str | None = None
    datasets: tuple[DatasetRef, ...] = ()
    num_prompts: int = 32
    max_new_tokens: int = 128
    ignore_eos: bool = True
    seed: int = 0


@dataclass(frozen=True)
class WorkloadPrompts:
    """The prompts of one sweep, in send order, and the hash that identifies the workload."""

    prompts: tuple[Prompt, ...]
    max_new_tokens: int
    ignore_eos: bool
    workload_hash: str
    name: str  # its sources, ``+``-joined: the ledger's workload_name

    @property
    def prompt_format(self) -> str:
        """How the prompts reach the model (the ledger's ``workload_prompt_format``):
        ``chat-template`` (through the served model's chat template), ``text`` (plain
        completion text), or both joined by ``+``."""
        kinds = {"chat-template" if p.chat else "text" for p in self.prompts}
        return "+".join(k for k in ("chat-template", "text") if k in kinds)


def _draw(pool: Sequence[Prompt], count: int, rng: random.Random) -> list[Prompt]:
    """``count`` prompts of ``pool``, shuffled, cycling (re-shuffled) when it holds fewer."""
    chosen: list[Prompt] = []
    while len(chosen) < count:
        order = list(pool)
        rng.shuffle(order)
        chosen.extend(order[: count - len(chosen)])
    return chosen


def workload_pools(workload: Workload, *, search: Sequence[Path] = ()) -> list[tuple[str, tuple[Prompt, ...]]]:
    """The workload's sources, each (name, prompts): the prompt files and named set as one
    pool, then each data set (:mod:`.datasets`) as its own."""
    files = list(workload.prompt_files)
    if workload.prompt_set is not None:
        files.extend(find_prompt_set(workload.prompt_set, search=search))
    pools: list[tuple[str, tuple[Prompt, ...]]] = []
    own: list[Prompt] = []
    for f in dict.fromkeys(files):
        own.extend(load_prompt_file(f))
    if own:
        pools.append((workload.prompt_set or "+".join(p.stem for p in workload.prompt_files), tuple(own)))
    for ref in workload.datasets:
        pools.append((ref.name, load_dataset(ref.name, ref.path).prompts))
    return pools


def build_workload(workload: Workload, *, search: Sequence[Path] = ()) -> WorkloadPrompts:
    """Draw ``num_prompts`` prompts with the workload's seed and hash what will be sent.

    One source: drawn from it (cycling, re-shuffled, when it holds fewer). Several (the
    project's files and data sets, or a mix of data sets): an equal share from each, so
    that 80 MT-Bench questions are not drowned by 90k ShareGPT conversations, the shares
    then shuffled together so that the sets interleave in send order."""
    pools = workload_pools(workload, search=search)
    if not pools:
        raise SweepError("the workload names no prompt files")
    rng = random.Random(workload.seed)
    if len(pools) == 1:
        chosen = _draw(pools[0][1], workload.num_prompts, rng)
    else:
        share, extra = divmod(workload.num_prompts, len(pools))
        chosen = [p for i, (_, pool) in enumerate(pools) for p in _draw(pool, share + (i < extra), rng)]
        rng.shuffle(chosen)
    digest = hashlib.sha256(
        json.dumps(
            {
                # Follow-up turns only where there are some: the hashes of single-turn
                # workloads stay what their ledgers hold.
                "prompts": [[p.text, list(map(list, p.messages)), *([list(p.followups)] if p.followups else [])]
                            for p in chosen],
                "max_new_tokens": workload.max_new_tokens,
                "ignore_eos": workload.ignore_eos,
            },
            sort_keys=True,
            ensure_ascii=False,
        ).encode()
    ).hexdigest()
    return WorkloadPrompts(
        prompts=tuple(chosen),
        max_new_tokens=workload.max_new_tokens,
        ignore_eos=workload.ignore_eos,
        workload_hash=digest[:16],
        name="+".join(name for name, _ in pools),
    )
