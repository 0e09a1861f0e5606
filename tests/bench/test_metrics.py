"""calculate_metrics on hand-built requests with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from ddtree_ops.bench.metrics import RequestResult, calculate_metrics


def req(start: float, ttft: float, itls: list[float], tokens: int, verify: int | None = None) -> RequestResult:
    end = start + ttft + sum(itls)
    return RequestResult(
        ok=True, start=start, end=end, ttft=ttft, itls=tuple(itls), prompt_tokens=10,
        completion_tokens=tokens, spec_verify_ct=verify, spec_accept_length=tokens / verify if verify else None,
    )


def test_throughput_latency_and_weighted_accept_length() -> None:
    a = req(0.0, 0.1, [0.05] * 9, tokens=10, verify=2)  # accept length 5
    b = req(0.5, 0.2, [0.1] * 99, tokens=100, verify=50)  # accept length 2
    failed = RequestResult(ok=False, start=0.2, end=0.3, error="HTTP 500")
    m = calculate_metrics([a, b, failed])
    assert m.duration_s == pytest.approx(b.end)
    assert m.output_tokens == 110 and m.completed == 2 and m.failed == 1
    assert m.output_tok_s == pytest.approx(110 / b.end)
    assert m.request_s == pytest.approx(2 / b.end)
    # weighted by verify count: 110 / 52, not the mean of 5 and 2
    assert m.accept_length == pytest.approx(110 / 52)
    assert m.verify_steps == 52
    itls = [0.05] * 9 + [0.1] * 99
    assert m.itl_ms.mean == pytest.approx(np.mean(itls) * 1000)
    assert m.itl_ms.p99 == pytest.approx(np.percentile(itls, 99) * 1000)
    assert m.ttft_ms.median == pytest.approx(150.0)
    assert m.tpot_ms.mean == pytest.approx(np.mean([0.05, 0.1]) * 1000)
    assert m.errors == ("HTTP 500",)
    flat = m.flat()
    assert flat["ttft_ms_p90"] == m.ttft_ms.p90 and flat["errors"] == ["HTTP 500"]


def test_all_failed_gives_nulls_not_crashes() -> None:
    m = calculate_metrics([RequestResult(ok=False, start=0, end=1, error="refused")] * 3)
    assert m.completed == 0 and m.failed == 3 and m.output_tok_s == 0.0
    assert m.itl_ms.mean is None and m.accept_length is None
    assert calculate_metrics([]).requests == 0


def test_no_speculation_means_no_accept_length() -> None:
    m = calculate_metrics([req(0, 0.1, [0.01] * 4, tokens=5)])
    assert m.accept_length is None and m.verify_steps == 0
