"""Drive the simulator's engine without HTTP or sleeping, for calibration and tests.

The same ``Engine`` methods the server's scheduler loop calls produce the tokens; the
step times are summed from the cost model instead of slept. This is how the
acceptance/throughput table in the sim README is produced and how the trend tests
check it, without paying wall-clock time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ddtree_ops.sim.args import ServerArgs, SimSettings, parse_server_args
from ddtree_ops.sim.engine import Engine
from ddtree_ops.sim.params import SamplingParams
from ddtree_ops.sim.text import classify_prompt, tokenize

# A fixed prompt set with all three categories (used by the README table and tests).
PROMPTS: tuple[str, ...] = (
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "class Stack: def push(self, item): self.items.append(item)",
    "import numpy as np; write a function that returns the mean",
    "Solve the equation 3x + 7 = 22 and explain each step",
    "Compute the sum of the first 100 odd numbers",
    "What is the integral of x squared from 0 to 3",
    "Tell me a short story about a lighthouse keeper",
    "How do I make a good cup of tea at home",
    "Write a friendly note to a neighbour about a lost cat",
)


@dataclass(frozen=True)
class OfflineResult:
    """Aggregate over the prompt set, one request at a time (batch size 1)."""

    accept_length: float
    tokens: int
    verify_steps: int
    sim_seconds: float

    @property
    def tokens_per_s(self) -> float:
        """Simulated decode throughput of one stream (tokens / simulated seconds)."""
        return self.tokens / self.sim_seconds if self.sim_seconds > 0 else 0.0


def server_args(flags: Sequence[str]) -> ServerArgs:
    args, _ = parse_server_args(["--model-path", "sim", *flags])
    return args


def run_offline(
    args: ServerArgs,
    settings: SimSettings,
    *,
    temperature: float,
    max_new_tokens: int = 96,
    prompts: Sequence[str] = PROMPTS,
    sampling_seed: int = 1,
    top_k: int = -1,
    top_p: float = 1.0,
) -> OfflineResult:
    """Generate every prompt alone and sum the modelled decode-step times."""
    engine = Engine(args, replace(settings, time_scale=0.0))
    total_tokens = verify = 0
    sim_ms = 0.0
    draft = args.draft_positions
    for i, text in enumerate(prompts):
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            ignore_eos=True,
            sampling_seed=sampling_seed + i,
        )
        req = engine.submit(tokenize(text), classify_prompt(text), params)
        engine._waiting.clear()
        engine._commit(req, engine._prefill([req])[0])
        first = len(req.output_ids)
        while req.finish_reason is None:
            outs, verify_tokens, graph = engine._decode([req])
            sim_ms += engine.profile.step_ms(
                batch=1, verify_tokens=verify_tokens, draft_positions=draft, cuda_graph=graph
            )
            engine._commit(req, outs[0])
            verify += 1
        total_tokens += len(req.output_ids) - first
    return OfflineResult(
        accept_length=total_tokens / verify if verify else 0.0,
        tokens=total_tokens,
        verify_steps=verify,
        sim_seconds=sim_ms / 1000.0,
    )


def acceptance_table(
    gpus: Sequence[str] = ("b300", "rtx-pro-6000"),
    temperatures: Sequence[float] = (0.0, 1.0),
    budgets: Sequence[int] = (4, 8, 16, 32, 64, 128),
    max_new_tokens: int = 64,
) -> list[str]:
    """Markdown rows: simulated accept length and single-stream tok/s per config."""
    rows = [
        "| profile | T | algorithm | budget | accept length | tok/s (sim) | vs AR |",
        "|---|---|---|---|---|---|---|",
    ]
    for gpu in gpus:
        settings = SimSettings(gpu=gpu, seed=0)
        for temp in temperatures:
            ar = run_offline(server_args([]), settings, temperature=temp, max_new_tokens=max_new_tokens)
            rows.append(f"| {gpu} | {temp:g} | AR | - | 1.00 | {ar.tokens_per_s:.0f} | 1.00x |")
            configs: list[tuple[str, str, list[str]]] = [
                ("DFLASH", "16 (chain)", ["--speculative-algorithm", "DFLASH"])
            ]
            configs += [
                ("DDTREE", str(b), ["--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", str(b + 1),
                                    "--speculative-eagle-topk", "4"])
                for b in budgets
            ]
            for algo, budget, flags in configs:
                r = run_offline(server_args(flags), settings, temperature=temp, max_new_tokens=max_new_tokens)
                rows.append(
                    f"| {gpu} | {temp:g} | {algo} | {budget} | {r.accept_length:.2f} | {r.tokens_per_s:.0f} | "
                    f"{r.tokens_per_s / ar.tokens_per_s:.2f}x |"
                )
    return rows


if __name__ == "__main__":
    # python -m ddtree_ops.sim.offline  -> the README's acceptance table (simulated figures)
    for row in acceptance_table():
        print(row, flush=True)
