"""Per-round cost of laying out one DDTree verify pass: today's layout vs the new one.

A round turns the drafter's per-position top-k into trees and everything the target's
``TARGET_VERIFY`` pass reads: tokens, positions, the ancestor-only custom mask in the
layout attention backends read (per request ``N`` rows of ``prefix + N`` columns) and
the first-child / next-sibling retrieve tensors (built only when a request samples:
``--sampled`` measures such rounds, the default measures all-greedy ones).

* ``old``: the previous bundle's round (``host_layout.py``). The top-k crosses to the host (``.cpu()``),
  the trees are built by the heap per request, the layout (mask included, prefix
  columns and all) is built on the host and copied to the device.
* ``new``: the serving round now: ``build_tree_batch``, ``tree_ancestor_masks``,
  positions and ``tree_retrieve_batch`` on the device, and the mask written into a
  persistent buffer whose prefix cells stay True, so only ``bs * N * N`` cells change.

Columns: ``host_us`` is the wall time of the round's layout work per round (median of
``--repeats`` rounds after a warm-up; on a CPU-only machine the "device" is the CPU, so
this is all the work); ``h2d_bytes`` counts the tensor bytes a round copies from host
to device (the new round builds everything where the top-k already is: nothing but
kernel arguments crosses); ``d2h_bytes`` the bytes it copies back before the verify.

    .venv/bin/python benchmarks/verify_round.py           # the table
    .venv/bin/python benchmarks/verify_round.py --json    # the same rows as JSON
    .venv/bin/python benchmarks/verify_round.py --device cuda   # where CUDA exists

The script ends with the goal ratios, each computed from the rows of this run:
cost at prefix 32k / prefix 1k (new layout, every batch, budget and top-k) and
old / new at batch 32, prefix 8k, budget 16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import host_layout  # noqa: E402
from ddtree_ops.ddtree_core import load_ddtree_utils  # noqa: E402

BLOCK_SIZE = 16  # the draft block of the DFlash drafters the fleet serves
VOCAB = 151_936


def draft_topk(bs: int, depth: int, k: int, device: str, seed: int):
    """The drafter's per-position top-k: ids ``[bs, depth, k]`` and log-probs."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, 4096, generator=g) * 3.0
    top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    ids = top.indices + torch.randint(0, VOCAB - 4096, (bs, depth, 1), generator=g)
    return ids.to(device), top.values.to(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def old_round(du, ids, lps, roots, prefix_lens_cpu, budget, device, sampled):
    """The previous worker's layout path; returns (h2d bytes, d2h bytes)."""
    d2h = ids.numel() * 8 + lps.numel() * 4 + roots.numel() * 8
    trees = host_layout.build_ddtree_trees_from_topk_batch(ids.cpu(), lps.cpu(), budget, roots.cpu())
    layout = host_layout.layout_verify_batch(trees, prefix_lens_cpu, budget + 1, need_retrieve=sampled)
    h2d = 0
    for t in (
        layout.tokens,
        layout.positions,
        layout.custom_mask,
        layout.retrieve_index,
        layout.retrieve_next_token,
        layout.retrieve_next_sibling,
    ):
        if t is not None:
            t.to(device, non_blocking=True)
            h2d += t.numel() * t.element_size()
    return h2d, d2h


def new_round(du, ids, lps, roots, prefix_lens, cells, budget, mask_buffer, sampled):
    """The serving round's layout path; returns (h2d bytes, d2h bytes)."""
    trees = du.build_tree_batch(ids, lps, budget, roots)
    mask_buffer.write(du.tree_ancestor_masks(trees), prefix_lens, cells)
    _positions = prefix_lens.unsqueeze(1) + trees.depths
    if sampled:
        du.tree_retrieve_batch(trees)
    mask_buffer.restore()
    return 0, 0


def measure(du, *, bs, prefix, budget, topk, device, repeats, sampled, seed=0):
    depth = min(BLOCK_SIZE - 1, budget)
    ids, lps = draft_topk(bs, depth, topk, device, seed)
    roots = torch.randint(0, VOCAB, (bs,), device=device)
    prefix_cpu = torch.full((bs,), prefix, dtype=torch.int64)
    prefix_dev = prefix_cpu.to(device)
    n = budget + 1
    cells = n * (int(prefix_cpu.sum()) + bs * n)
    mask_buffer = du.TreeMaskBuffer(device)
    rows = []
    for layout, fn in (
        ("old", lambda: old_round(du, ids, lps, roots, prefix_cpu, budget, device, sampled)),
        ("new", lambda: new_round(du, ids, lps, roots, prefix_dev, cells, budget, mask_buffer, sampled)),
    ):
        fn()  # warm-up (first-touch allocation of the mask buffer, lazy inits)
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            h2d, d2h = fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        rows.append(
            {
                "batch": bs,
                "prefix": prefix,
                "budget": budget,
                "topk": topk,
                "layout": layout,
                "host_us": round(statistics.median(times) * 1e6, 1),
                "h2d_bytes": h2d,
                "d2h_bytes": d2h,
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="batch 32, prefix 1k/8k/32k, budget 16, top-k 4 only")
    ap.add_argument("--sampled", action="store_true", help="rounds with a sampled request (retrieve tensors built)")
    ap.add_argument("--batches", help="comma-separated batch sizes (default 1,32; --quick: 32)")
    ap.add_argument("--budgets", help="comma-separated budgets (default 16,64; --quick: 16)")
    ap.add_argument("--topks", help="comma-separated top-k (default 4,8; --quick: 4)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the round's tensors are tiny, and on a shared "
                         "machine extra threads only add contention; 0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    du = load_ddtree_utils()

    def ints(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(",")) if text else default

    grid = [
        (bs, prefix, budget, topk)
        for bs in ints(args.batches, (32,) if args.quick else (1, 32))
        for prefix in (1024, 8192, 32768)
        for budget in ints(args.budgets, (16,) if args.quick else (16, 64))
        for topk in ints(args.topks, (4,) if args.quick else (4, 8))
    ]
    rows = []
    for bs, prefix, budget, topk in grid:
        rows.extend(measure(du, bs=bs, prefix=prefix, budget=budget, topk=topk, device=args.device,
                            repeats=args.repeats, sampled=args.sampled))

    def cost(layout, bs, prefix, budget, topk):
        for r in rows:
            if (r["layout"], r["batch"], r["prefix"], r["budget"], r["topk"]) == (layout, bs, prefix, budget, topk):
                return r["host_us"]
        raise KeyError((layout, bs, prefix, budget, topk))

    prefix_ratios = {
        f"b{bs}/B{budget}/k{topk}": round(cost("new", bs, 32768, budget, topk) / cost("new", bs, 1024, budget, topk), 3)
        for bs, _p, budget, topk in grid
    }
    if args.json:
        print(json.dumps(rows))
        return 0
    speedup = round(cost("old", 32, 8192, 16, 4) / cost("new", 32, 8192, 16, 4), 1)
    new_at_goal = cost("new", 32, 8192, 16, 4)
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"draft block {BLOCK_SIZE}, {'sampled' if args.sampled else 'greedy'} rounds")
    print(f"{'batch':>5} {'prefix':>6} {'budget':>6} {'topk':>4} {'layout':>6} {'host_us':>10} {'h2d_bytes':>11} "
          f"{'d2h_bytes':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['prefix']:>6} {r['budget']:>6} {r['topk']:>4} {r['layout']:>6} "
              f"{r['host_us']:>10.1f} {r['h2d_bytes']:>11} {r['d2h_bytes']:>9}")
    print()
    print("new layout, cost at prefix 32k / prefix 1k (goal <= 1.1):")
    for key, ratio in prefix_ratios.items():
        print(f"  {key}: {ratio}")
    print(f"batch 32, prefix 8k, budget 16, top-k 4: old/new = {speedup}x (goal >= 20x), "
          f"new = {new_at_goal:.1f} us (goal <= 1000 us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
