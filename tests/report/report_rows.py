"""Hand-built ledger rows for the report tests: every field explicit, metrics chosen."""

from __future__ import annotations

from typing import Any

from ddtree_ops.bench.ledger import LedgerRow


def make_row(
    *,
    host: str = "ct200-a",
    gpu_name: str | None = "RTX PRO 6000",
    algorithm: str = "DDTREE",
    budget: int | None = 16,
    topk: int | None = 4,
    cuda_graph: bool = True,
    temperature: float = 0.0,
    concurrency: int = 1,
    repeat: int = 0,
    output_tok_s: float | None = 100.0,
    accept_length: float | None = 3.0,
    failed: int | None = 0,
    status: str = "ok",
    workload_hash: str = "w1",
    **extra: Any,
) -> dict[str, Any]:
    """A valid ledger row as a dict, with metric fields derived from ``output_tok_s``.
    A DFLASH row's budget is ``draft_tokens`` (None: the drafter's own block)."""
    if algorithm != "DDTREE":
        budget, topk = extra.pop("draft_tokens", None) if algorithm == "DFLASH" else None, None
    row = LedgerRow(
        run_id="run-1",
        sweep="test",
        started_at="2026-05-01T12:00:00Z",
        finished_at="2026-05-01T12:00:10Z",
        host=host,
        gpu_name=gpu_name,
        gpu_arch="sm_120",
        gpu_count=8,
        driver="580.1",
        sglang_version="0.5.23",
        bundle_name="ddtree_temperature",
        bundle_hash="abc",
        server_argv=["python", "-m", "sglang.launch_server", "--port", "30000"],
        algorithm=algorithm,
        budget=budget,
        topk=topk,
        cuda_graph=cuda_graph,
        fallback_reason=None if cuda_graph else "Capture cuda graph failed",
        readiness_s={"load": 10.0, "warmup": 1.0},
        workload_hash=workload_hash,
        workload_name="demo",
        workload_num_prompts=8,
        workload_max_new_tokens=64,
        workload_ignore_eos=True,
        workload_seed=0,
        temperature=temperature,
        top_p=1.0,
        top_k=-1,
        concurrency=concurrency,
        request_rate=None,
        repeat=repeat,
        status=status,
        error=None if status == "ok" else "server crashed",
    ).to_dict()
    if status == "ok":
        row.update(
            completed=8 - (failed or 0),
            failed=failed,
            duration_s=10.0,
            output_tok_s=output_tok_s,
            request_s=0.8,
            total_input_tokens=800,
            total_output_tokens=int((output_tok_s or 0) * 10),
            ttft_ms_mean=20.0,
            ttft_ms_median=19.0,
            ttft_ms_p90=30.0,
            ttft_ms_p99=40.0,
            itl_ms_mean=5.0,
            itl_ms_median=4.5,
            itl_ms_p90=8.0,
            itl_ms_p99=12.0,
            tpot_ms_mean=5.0,
            tpot_ms_median=4.8,
            tpot_ms_p90=8.0,
            tpot_ms_p99=12.0,
            e2e_ms_mean=500.0,
            e2e_ms_median=490.0,
            e2e_ms_p90=700.0,
            e2e_ms_p99=900.0,
            accept_length=accept_length if algorithm != "AR" else None,
            verify_ct=100 if algorithm != "AR" else None,
        )
    row.update(extra)
    return row
