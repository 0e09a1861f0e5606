"""GPU profiles and the step cost model of the simulated server.

Every number here is a *model parameter*, chosen so that the simulator reproduces the
shape of what real deployments reported (design.md §1): decoding a large model is
memory-bound, so one step costs roughly the same whether it checks 1 or a few dozen
tokens per request; past a knee in (batch x tokens per request) the verify pass
becomes compute-bound and grows linearly; DFlash/DDTree add one draft forward pass;
eager mode (CUDA graphs disabled) is ~3.8x slower per decode step. None of these are
hardware measurements.

Step time, in simulated milliseconds, for a batch of ``b`` requests verifying
``t`` tokens each (t = 1 for autoregressive decoding, tree nodes + 1 for DDTree):

    verify(b, t) = base_ms + attn_ms_per_token * b * t
                   + slope_ms_per_token * max(0, b * t - knee_tokens)
    draft(b, d)  = draft_base_ms + draft_ms_per_token * b * d      (speculating only)
    prefill(p)   = prefill_ms_per_token * p                        (new prompt tokens)
    step         = (verify + draft + prefill) * (eager_factor if graphs disabled else 1)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuProfile:
    """Cost-model parameters for one simulated machine (8-GPU node, large MoE model)."""

    name: str
    gpu_name: str
    compute_cap: str
    gpu_mem_gb: float
    base_ms: float
    attn_ms_per_token: float
    knee_tokens: int
    slope_ms_per_token: float
    draft_base_ms: float
    draft_ms_per_token: float
    prefill_ms_per_token: float
    eager_factor: float = 3.8
    # sm_103 + DDTree sampling path + budget > 8 crashed in CUDA-graph capture.
    capture_fails_ddtree_budget_over: int | None = None

    def step_ms(
        self,
        *,
        batch: int,
        verify_tokens: int,
        draft_positions: int,
        prefill_tokens: int = 0,
        cuda_graph: bool = True,
    ) -> float:
        """Simulated duration of one scheduler step (see the module docstring)."""
        if batch <= 0 and prefill_tokens <= 0:
            return 0.0
        work = batch * verify_tokens
        ms = 0.0
        if batch > 0:
            ms += self.base_ms + self.attn_ms_per_token * work
            ms += self.slope_ms_per_token * max(0, work - self.knee_tokens)
            if draft_positions > 0:
                ms += self.draft_base_ms + self.draft_ms_per_token * batch * draft_positions
        ms += self.prefill_ms_per_token * prefill_tokens
        if not cuda_graph:
            ms *= self.eager_factor
        return ms

    def prefill_ms(self, prompt_tokens: int, *, cuda_graph: bool = True) -> float:
        """Simulated duration of a prefill step over ``prompt_tokens`` new prompt tokens:
        the fixed cost of a forward pass plus the per-token prefill cost. The engine
        charges exactly this, so it is also the floor of TTFT at an idle server."""
        return self.step_ms(
            batch=0, verify_tokens=0, draft_positions=0, prefill_tokens=prompt_tokens, cuda_graph=cuda_graph
        ) + self.base_ms


PROFILES: dict[str, GpuProfile] = {
    "h200": GpuProfile(
        name="h200",
        gpu_name="NVIDIA H200",
        compute_cap="9.0",
        gpu_mem_gb=141.0,
        base_ms=14.0,
        attn_ms_per_token=0.010,
        knee_tokens=32,
        slope_ms_per_token=0.10,
        draft_base_ms=4.0,
        draft_ms_per_token=0.025,
        prefill_ms_per_token=0.05,
    ),
    "b300": GpuProfile(
        name="b300",
        gpu_name="NVIDIA B300 SXM6 AC",
        compute_cap="10.3",
        gpu_mem_gb=275.0,
        base_ms=10.0,
        attn_ms_per_token=0.008,
        knee_tokens=32,
        slope_ms_per_token=0.07,
        draft_base_ms=3.0,
        draft_ms_per_token=0.02,
        prefill_ms_per_token=0.03,
        capture_fails_ddtree_budget_over=8,
    ),
    "rtx-pro-6000": GpuProfile(
        name="rtx-pro-6000",
        gpu_name="NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
        compute_cap="12.0",
        gpu_mem_gb=96.0,
        base_ms=22.0,
        attn_ms_per_token=0.016,
        knee_tokens=24,
        slope_ms_per_token=0.16,
        draft_base_ms=5.0,
        draft_ms_per_token=0.03,
        prefill_ms_per_token=0.08,
    ),
}
