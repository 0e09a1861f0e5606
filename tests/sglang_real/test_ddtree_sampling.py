"""DDTREE's sampled verify on the real CPU server: lossless, seeded, min-p exact.

The servers run a *spread* target (the tiny target with its lm_head scaled by 0.03: at
temperature 1 its top three tokens carry about 0.46 / 0.28 / 0.26 of their mass, where
the plain tiny target puts > 99.99 % on one) with the constructed DFlash draft, and
``--enable-deterministic-inference`` so that each request's ``sampling_seed`` fixes its
randomness (SGLang honours ``sampling_seed`` only there). The DDTREE server is launched
on budget 16 and switched at runtime to budget 4, the tree tested. DDTREE runs the worker's kernel
branch: ``build_speculative_verify_target_probs`` and the min-p filter feeding
``tree_speculative_sampling_target_only``, the CUDA op replaced by its pure-torch twin
(stand-in ``tree_sampling_kernel``) -- the path a GPU host takes.

Losslessness, tested statistically. Every request sends prompt ``P`` with temperature 1,
``top_k`` 3 and 3 new tokens: ``x1`` is drawn by
the prefill's ordinary sampler, ``x2`` and ``x3`` by the first tree round (a depth-1 node
or the bonus token, then a depth-2 node or the bonus). The exact law of ``(x1, x2, x3)``
comes from the target's own log-probs (13 greedy queries, one per prefix). ``N`` seeded
requests (seeds fixed) give counts over the 27 outcomes; Pearson's chi-square (rare
cells pooled) must not reject at ``ALPHA``. Power: with ``N = 1200`` and 26 degrees of
freedom the test rejects with probability >= 0.9 any law whose chi-square divergence
from the exact one is >= 0.045 (noncentrality 54, critical value 54.05), which every law
at total-variation distance >= 0.11 has (divergence >= 4 TV^2); with the fixed seeds it
is one deterministic outcome, under H0 a failure of probability ``ALPHA``. The control:
the same test on the target alone (the plain server's sampler) with the same seeds. A
check that the test can fail: the DDTREE samples against the law at temperature 0.5
must be rejected.

min-p is not part of this run: SGLang 0.5.23's seeded sampler asserts that no request
has min-p (``top_k_top_p_min_p_sampling_from_probs_torch``, srt/layers/sampler.py), so
under deterministic inference a min-p request kills the plain server in its prefill
sampler; DDTREE refuses such a request at admission instead (tested below). Its law is
tested in one interpreter against SGLang's own sampler (test_ddtree_inprocess.py) and a
min-p request is served on the kernel branch (test_ddtree_real.py).
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from pathlib import Path

import httpx
import pytest

from . import models
from .stats import chi_square_test
from .test_ddtree_real import SAMPLER_ENV, ddtree_args

pytestmark = [pytest.mark.slow, pytest.mark.sglang_real, pytest.mark.timeout(900)]

SPREAD = 0.03
PROMPT = [5, 6, 7, 8, 9, 10, 11]
TOP_K = 3
N = 1200
ALPHA = 1e-3
DETERMINISTIC = ["--enable-deterministic-inference"]


@pytest.fixture(scope="module")
def spread_target(sglang_cpu_env, tmp_path_factory) -> Path:
    return models.write_target(tmp_path_factory.mktemp("spread") / "target", lm_head_scale=SPREAD)


@pytest.fixture
def plain_spread(real_servers, spread_target):
    return real_servers.get("spread-plain", spread_target, DETERMINISTIC)


# The DDTREE server is launched on budget 16 with budget 4 among its runtime states, and
# switched to budget 4 before every test: the sampled tests hold after a live switch.
LAUNCH_BUDGET, TESTED = 16, {"budget": 4, "topk": 4}


@pytest.fixture
def ddtree_spread(real_servers, ddtree_python, spread_target, tiny_models, tmp_path_factory):
    config = tmp_path_factory.getbasetemp() / "spread-runtime.json"
    config.write_text(json.dumps({"ddtree": {"budgets": [TESTED["budget"], LAUNCH_BUDGET]}}))
    srv = real_servers.get(
        "spread-ddtree", spread_target,
        [*ddtree_args(tiny_models["draft"], LAUNCH_BUDGET), *DETERMINISTIC,
         "--speculative-adaptive-config", str(config)],
        env=SAMPLER_ENV["kernel"], python=ddtree_python,
    )
    resp = httpx.post(srv.url + "/set_internal_state", timeout=60,
                      json={"server_args": {"ddtree_budget": TESTED["budget"], "ddtree_topk": TESTED["topk"]}})
    assert resp.status_code == 200 and resp.json() == [True], resp.text
    assert srv.server_info()["internal_states"][0]["ddtree"]["active"] == TESTED
    return srv


def _top(out, k: int, temperature: float) -> dict[int, float]:
    """The law of the next token under temperature and top-k, from its log-probs."""
    top = out.meta_info["output_top_logprobs"][0][:k]
    weights = {int(t[1]): math.exp(float(t[0]) / temperature) for t in top}
    total = sum(weights.values())
    return {tok: w / total for tok, w in weights.items()}


@pytest.fixture(scope="module")
def exact_law(real_servers, spread_target) -> dict:
    """The law of (x1, x2, x3) at T = 1 (and 0.5), top-k 3, from the target alone."""
    srv = real_servers.get("spread-plain", spread_target, DETERMINISTIC)

    def step(prefixes: list[tuple[int, ...]]):
        outs = srv.generate([PROMPT + list(p) for p in prefixes], max_new_tokens=1, top_logprobs=TOP_K)
        return dict(zip(prefixes, outs, strict=True))

    level1 = step([()])
    firsts = list(_top(level1[()], TOP_K, 1.0))
    level2 = step([(a,) for a in firsts])
    seconds = [(a, b) for a in firsts for b in _top(level2[(a,)], TOP_K, 1.0)]
    level3 = step(seconds)
    outs = {**level1, **level2, **level3}
    laws = {}
    for temperature in (1.0, 0.5):
        law: dict[tuple[int, ...], float] = {}
        for a, pa in _top(outs[()], TOP_K, temperature).items():
            for b, pb in _top(outs[(a,)], TOP_K, temperature).items():
                for c, pc in _top(outs[(a, b)], TOP_K, temperature).items():
                    law[(a, b, c)] = pa * pb * pc
        laws[temperature] = law
    return laws


def _samples(srv, seed0: int) -> tuple[Counter, list]:
    params = [
        {"temperature": 1.0, "top_k": TOP_K, "max_new_tokens": 3, "ignore_eos": True,
         "sampling_seed": seed0 + i}
        for i in range(N)
    ]
    outs = srv.generate_each([PROMPT] * N, params)
    return Counter(tuple(o.output_ids) for o in outs), outs


def test_tree_rejection_sampling_is_lossless(ddtree_spread, exact_law):
    counts, outs = _samples(ddtree_spread, seed0=10_000)
    # The second and third tokens came out of a tree round, not the prefill's sampler.
    assert all(o.meta_info["spec_verify_ct"] >= 1 for o in outs)
    assert ddtree_spread.server_info()["ddtree"]["sampler"] == "kernel"
    fit = chi_square_test(counts, exact_law[1.0])
    print(f"DDTREE vs the exact law: {fit}")  # shown with pytest -s (the bundle README quotes it)
    assert fit.p_value >= ALPHA, f"DDTREE samples do not follow the target's law: {fit}, counts {counts}"
    wrong = chi_square_test(counts, exact_law[0.5])
    print(f"DDTREE vs the law at T=0.5: {wrong}")
    assert wrong.p_value < 1e-6, f"the test cannot tell T=1 from T=0.5: {wrong}"


def test_the_target_alone_passes_the_same_test(plain_spread, exact_law):
    counts, _ = _samples(plain_spread, seed0=10_000)
    fit = chi_square_test(counts, exact_law[1.0])
    print(f"target alone vs the exact law: {fit}")
    assert fit.p_value >= ALPHA, f"control: the plain server fails the test itself: {fit}, counts {counts}"


def test_seeded_requests_repeat_and_different_seeds_differ(ddtree_spread):
    def run(seed: int) -> list[int]:
        # One request per call: batch composition may move CPU float sums.
        (out,) = ddtree_spread.generate_each(
            [PROMPT],
            [{"temperature": 0.8, "top_k": 20, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": seed}],
        )
        assert out.meta_info["spec_verify_ct"] > 0
        return out.output_ids

    first, again = run(11), run(11)
    assert first == again, "the same sampling_seed gave different outputs"
    others = [tuple(run(seed)) for seed in (12, 13, 14, 15)]
    assert len({tuple(first), *others}) == 5, "different seeds gave the same output"


def test_outcomes_cover_the_tree_paths(exact_law):
    """Sanity of the setup: the law has all 27 outcomes with real mass (so siblings,
    rejections and bonus draws all happen), none negligible."""
    law = exact_law[1.0]
    assert len(law) == TOP_K**3 and min(law.values()) > 0.005, sorted(law.values())[:3]
    assert set(itertools.chain.from_iterable(law)) <= set(range(models.VOCAB))


def test_min_p_under_deterministic_inference_is_refused_alone(ddtree_spread):
    with pytest.raises(Exception) as err:
        ddtree_spread.generate([PROMPT], max_new_tokens=4, temperature=1.0, min_p=0.1, sampling_seed=3)
    assert "400" in str(err.value) and "min_p" in str(err.value) and "deterministic" in str(err.value), err.value
    (out,) = ddtree_spread.generate([PROMPT], max_new_tokens=4, temperature=1.0, top_k=TOP_K, sampling_seed=3)
    assert len(out.output_ids) == 4
