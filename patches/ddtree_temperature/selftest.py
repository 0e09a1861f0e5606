"""Self-test of a DEPLOYED ddtree_temperature bundle, run by the host's own interpreter.

Usage: ``python selftest.py`` or ``python - < selftest.py`` (how a deployment tool
sends it over SSH). Needs torch; never imports sglang (test hosts carry
sglang's files without its dependencies): the package directory is found with
``importlib.util.find_spec`` and the deployed ``ddtree_reference.py`` and
``ddtree_utils.py`` are loaded by path, so what is tested is the files SGLang itself
would import.

Prints ONE JSON object on stdout (sent behind a deployment tool's bootstrap that defines ``reply``: one
message through it instead):
``{"ok", "deployed", "sglang_dir", "ddtree_utils", "torch", "cuda", "kernel",
"checks": {name: {"ok", "detail"}}, "seconds"}``.
Exit status: 0 all checks passed, 1 a check failed, 2 the bundle is not deployed (or
torch / sglang is missing).

Checks: the golden encoding of the worked example; builder and encoding properties on
random trees; the greedy walk; exactness of the pure-torch reference sampler (a fixed-seed
statistical check); the device round (``ddtree_utils``: trees and greedy walk) against the
reference; and, where CUDA and SGLang's kernel import, kernel vs reference on
identical coins over many random trees (outputs must be identical). Without them the
kernel check reports "not available" and the rest still runs.
"""

import importlib.util
import json
import math
import os
import random
import sys
import time
import traceback

REL_PATH = ("srt", "speculative", "ddtree_utils.py")
# The per-request reference beside it: the checks below run on it, and the device
# round in ddtree_utils.py is checked against it.
REFERENCE = "ddtree_reference.py"


def _emit(report, code):
    send = globals().get("reply")
    if send is not None:  # sent behind a deployment tool's bootstrap: its framed message
        send(report)
    else:
        sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")
        sys.stdout.flush()
    sys.exit(code)


def _locate():
    """(sglang package dir or None, deployed ddtree_utils path or None)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    for base in spec.submodule_search_locations:
        path = os.path.join(base, *REL_PATH)
        if os.path.isfile(path):
            return base, path
    return list(spec.submodule_search_locations)[0], None


def _load(path):
    name = "_ddtree_selftest_" + os.path.basename(path)[: -len(".py")]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- checks


def check_golden(m, torch):
    # design.md worked example: budget=5, depth=3, top-k=2; root->{1,4}, 1->{2,5}, 2->{3}.
    parents = [-1, 0, 1, 2, 0, 1]
    logws = [0.0, -0.1, -0.3, -0.6, -0.5, -0.7]
    idx, nxt, sib = m.compile_ddtree_retrieve(parents, logws)
    assert idx.tolist() == [0, 1, 2, 3, 4, 5], idx.tolist()
    assert nxt.tolist() == [1, 2, 3, -1, -1, -1], nxt.tolist()
    assert sib.tolist() == [-1, 4, 5, -1, -1, -1], sib.tolist()
    assert m.compile_ddtree_retrieve(parents, logws, offset=12)[0].tolist() == list(range(12, 18))
    # The builder reproduces the same shape from per-position top-2 log-probs.
    tree = m.build_ddtree_tree_from_topk(
        [[11, 12], [21, 22], [31, 32]],
        [[math.log(0.9), math.log(0.05)], [math.log(0.8), math.log(0.1)], [math.log(0.7), math.log(0.2)]],
        5,
        root_token=7,
    )
    assert tree.parents[0] == -1 and tree.token_ids[0] == 7 and len(tree.parents) == 6
    return "worked example encodes exactly"


def _random_topk(rng, depth, k, vocab):
    ids, lps = [], []
    for _ in range(depth):
        row = rng.sample(range(vocab), k)
        w = sorted((rng.random() + 1e-3 for _ in range(k)), reverse=True)
        s = sum(w) * (1.0 + rng.random())  # leave mass for tokens outside the top-k
        ids.append(row)
        lps.append([math.log(x / s) for x in w])
    return ids, lps


def _dfs_visits(nxt, sib):
    seen, stack = [], [0]
    while stack:
        node = stack.pop()
        seen.append(node)
        child = nxt[node]
        kids = []
        while child != -1:
            kids.append(child)
            child = sib[child]
        stack.extend(reversed(kids))
    return seen


def check_properties(m, torch, trees=200):
    rng = random.Random(1234)
    for _ in range(trees):
        depth, k = rng.randint(1, 6), rng.randint(1, 5)
        budget = rng.randint(1, 40)
        ids, lps = _random_topk(rng, depth, k, 50)
        t = m.build_ddtree_tree_from_topk(ids, lps, budget, root_token=3)
        n = len(t.parents)
        assert n == min(budget, sum(k ** d for d in range(1, depth + 1))) + 1, (n, budget, depth, k)
        assert t.parents[0] == -1 and t.depths[0] == 0 and t.node_logws[0] == 0.0
        for i in range(1, n):
            p = t.parents[i]
            assert 0 <= p < i, "ancestor-closed, parents before children"
            assert t.depths[i] == t.depths[p] + 1
            assert t.node_logws[i] <= t.node_logws[p] + 1e-9
        pops = t.node_logws[1:]
        assert all(a >= b - 1e-9 for a, b in zip(pops, pops[1:])), "pop order non-increasing"
        _, nxt, sib = m.compile_ddtree_retrieve(t.parents, t.node_logws)
        nxt, sib = nxt.tolist(), sib.tolist()
        visits = _dfs_visits(nxt, sib)
        assert sorted(visits) == list(range(n)), "DFS visits every node exactly once"
        for i in range(n):
            if nxt[i] != -1:
                assert t.parents[nxt[i]] == i
            if sib[i] != -1:
                assert t.parents[sib[i]] == t.parents[i]
                assert t.node_logws[i] >= t.node_logws[sib[i]]
        mask = m.tree_attention_mask(t.parents)
        for i in range(n):
            anc, j = set(), i
            while j != -1:
                anc.add(j)
                j = t.parents[j]
            assert [bool(x) for x in mask[i].tolist()] == [c in anc for c in range(n)]
        pos = m.tree_positions(t.depths, 100).tolist()
        assert pos == [100 + d for d in t.depths]
    return "%d random trees: builder, retrieve encoding, mask, positions" % trees


def check_greedy(m, torch, trees=100):
    rng = random.Random(99)
    for _ in range(trees):
        ids, lps = _random_topk(rng, rng.randint(1, 5), rng.randint(1, 4), 30)
        t = m.build_ddtree_tree_from_topk(ids, lps, rng.randint(1, 30), root_token=0)
        n = len(t.parents)
        # A target that agrees with a random root-to-leaf path, then stops.
        leaf = rng.randrange(n)
        path = []
        j = leaf
        while j != -1:
            path.append(j)
            j = t.parents[j]
        path.reverse()
        argmax = [1000 + i for i in range(n)]  # tokens no node carries
        for a, b in zip(path, path[1:]):
            argmax[a] = t.token_ids[b]
        accepted, proposed = m.follow_verified_tree(t.parents, t.token_ids, argmax)
        # Sibling tokens can repeat across ranks of different positions but not among
        # one node's children, so the walk is determined: it ends at `leaf`.
        assert accepted == path, (accepted, path)
        assert proposed == [t.token_ids[x] for x in path[1:]] + [argmax[leaf]]
    return "%d random trees: walk follows the target argmax, bonus at the last node" % trees


def check_device_round(m, dev, torch, batches=40):
    """The serving round (ddtree_utils) equals the reference tree for tree: same trees,
    and the same greedy walk, on random drafts (sorted rows, frequent ties)."""
    rng = random.Random(4321)
    for _ in range(batches):
        bs, depth, k, budget = rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 4), rng.randint(1, 30)
        lps = torch.tensor(
            [[sorted((-rng.randint(0, 12) / 4 for _ in range(k)), reverse=True) for _ in range(depth)]
             for _ in range(bs)], dtype=torch.float32)
        ids = torch.tensor([[[1000 * d + 7 * r + b for r in range(k)] for d in range(depth)] for b in range(bs)])
        roots = torch.tensor([rng.randrange(900) for _ in range(bs)])
        batch = dev.build_tree_batch(ids, lps, budget, roots)
        trees = [m.build_ddtree_tree_from_topk(ids[b], lps[b], budget, int(roots[b])) for b in range(bs)]
        want = dev.tree_batch_from_trees(trees, budget + 1)
        for field in ("tokens", "parents", "depths", "logws", "valid"):
            assert torch.equal(getattr(batch, field), getattr(want, field)), field
        argmax = torch.randint(0, 5000, (bs, budget + 1), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        for b, tree in enumerate(trees):
            for i in range(1, len(tree)):
                if rng.random() < 0.6:
                    argmax[b, tree.parents[i]] = tree.token_ids[i]
        paths = dev.follow_verified_tree_batch(batch, argmax)
        for b, tree in enumerate(trees):
            accepted, proposed = m.follow_verified_tree(tree.parents, tree.token_ids, argmax[b])
            length = int(paths.commit_lens[b])
            assert paths.nodes[b, :length].tolist() == accepted, (b, accepted)
            assert paths.tokens[b, :length].tolist() == proposed, (b, proposed)
    return "%d random batches: device trees and greedy walk equal the reference" % batches


def _tv(counts, probs, total):
    return 0.5 * sum(abs(counts.get(t, 0) / total - p) for t, p in enumerate(probs))


def check_reference_exact(m, torch, samples=4000):
    """First emitted token ~ target distribution at the root (T=1 and T=0.7 with top-p).

    With V=8 and 4000 samples the expected total-variation distance of an exact
    sampler is about 0.5 * sum_t sqrt(2 p_t (1-p_t) / (pi * n)) < 0.02; 0.06 leaves
    a wide margin for a fixed seed while a biased sampler (e.g. draft-only acceptance)
    lands far above it.
    """
    gen = torch.Generator().manual_seed(7)
    vocab, bound = 8, 0.06
    details = []
    for temp, top_p in ((1.0, 1.0), (0.7, 0.9)):
        ids = [[0, 1, 2], [3, 4, 5]]
        lps = [[math.log(0.5), math.log(0.3), math.log(0.1)], [math.log(0.6), math.log(0.2), math.log(0.1)]]
        tree = m.build_ddtree_tree_from_topk(ids, lps, 6, root_token=7)
        n = len(tree.parents)
        logits = torch.randn((1, n, vocab), generator=torch.Generator().manual_seed(11)) * 1.5
        target = m.target_probs_from_logits(
            logits[0, :1], torch.tensor([temp]), torch.tensor([vocab]), torch.tensor([top_p])
        )[0].tolist()
        batch = logits.expand(samples, n, vocab).contiguous()
        paths = m.sample_tree_paths(
            [tree] * samples,
            batch,
            [temp] * samples,
            [vocab] * samples,
            [top_p] * samples,
            generator=gen,
            use_kernel=False,
        )
        counts = {}
        for _, proposed in paths:
            counts[proposed[0]] = counts.get(proposed[0], 0) + 1
        tv = _tv(counts, target, samples)
        assert tv < bound, "TV %.4f >= %.2f at T=%s top_p=%s" % (tv, bound, temp, top_p)
        details.append("T=%s top_p=%s TV=%.4f" % (temp, top_p, tv))
    return "; ".join(details) + " (n=%d, bound %.2f)" % (samples, bound)


def check_kernel(m, torch, trees=300):
    if not torch.cuda.is_available():
        return None, "not available (no CUDA)"
    if not m.kernel_available():
        return None, "not available (SGLang tree_speculative_sampling_target_only does not import)"
    rng = random.Random(5)
    vocab = 64
    for i in range(trees):
        bs = rng.randint(1, 4)
        batch = []
        for _ in range(bs):
            ids, lps = _random_topk(rng, rng.randint(1, 5), rng.randint(1, 4), vocab)
            batch.append(m.build_ddtree_tree_from_topk(ids, lps, rng.randint(1, 24), root_token=1))
        n = max(len(t.parents) for t in batch)
        logits = torch.randn((bs, n, vocab), generator=torch.Generator().manual_seed(i)) * 2.0
        temps = [rng.choice([0.5, 1.0, 1.5]) for _ in range(bs)]
        top_ks = [rng.choice([vocab, 8]) for _ in range(bs)]
        top_ps = [rng.choice([1.0, 0.8]) for _ in range(bs)]
        ref = m.sample_tree_paths(batch, logits, temps, top_ks, top_ps,
                                  generator=torch.Generator().manual_seed(1000 + i), use_kernel=False)
        ker = m.sample_tree_paths(batch, logits.cuda(), temps, top_ks, top_ps,
                                  generator=torch.Generator().manual_seed(1000 + i), use_kernel=True)
        assert [list(map(list, p)) for p in ker] == [list(map(list, p)) for p in ref], (i, ker, ref)
    return True, "identical to the reference on %d random batches" % trees


def main():
    start = time.monotonic()
    report = {"ok": False, "deployed": False, "checks": {}, "kernel": "not available"}
    # Locate first: "not deployed" is the common answer and needs no torch import.
    sglang_dir, path = _locate()
    report["sglang_dir"] = sglang_dir
    report["ddtree_utils"] = path
    if sglang_dir is None:
        report["error"] = "sglang is not installed for %s" % sys.executable
        _emit(report, 2)
    if path is None:
        report["error"] = "bundle not deployed: %s is missing" % os.path.join(sglang_dir, *REL_PATH)
        _emit(report, 2)
    reference = os.path.join(os.path.dirname(path), REFERENCE)
    if not os.path.isfile(reference):
        report["error"] = "bundle not deployed: %s is missing" % reference
        _emit(report, 2)
    report["deployed"] = True
    try:
        import torch
    except Exception as exc:  # torch missing is a host problem, reported as data
        report["error"] = "torch does not import: %s" % exc
        _emit(report, 2)
    report["torch"] = torch.__version__
    report["cuda"] = bool(torch.cuda.is_available())
    try:
        m = _load(reference)
        device = _load(path)
    except Exception as exc:
        report["error"] = "deployed DDTree modules do not load: %s: %s" % (type(exc).__name__, exc)
        _emit(report, 1)

    for name, fn in (
        ("golden_encoding", check_golden),
        ("builder_encoding_properties", check_properties),
        ("greedy_walk", check_greedy),
        ("reference_sampler_exact", check_reference_exact),
        ("device_round", lambda m, torch: check_device_round(m, device, torch)),
    ):
        try:
            report["checks"][name] = {"ok": True, "detail": fn(m, torch)}
        except Exception as exc:
            tb = traceback.extract_tb(exc.__traceback__)[-1]
            report["checks"][name] = {
                "ok": False,
                "detail": "%s: %s (line %d)" % (type(exc).__name__, str(exc)[:300], tb.lineno),
            }
    try:
        ran, detail = check_kernel(m, torch)
        report["kernel"] = detail if ran is None else "available"
        if ran is not None:
            report["checks"]["kernel_vs_reference"] = {"ok": True, "detail": detail}
    except Exception as exc:
        report["kernel"] = "available"
        report["checks"]["kernel_vs_reference"] = {"ok": False, "detail": "%s: %s" % (type(exc).__name__, str(exc)[:300])}
    report["ok"] = all(c["ok"] for c in report["checks"].values())
    report["seconds"] = round(time.monotonic() - start, 3)
    _emit(report, 0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
