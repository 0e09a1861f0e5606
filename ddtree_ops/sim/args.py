"""Launch flags (SGLang 0.5.23 names and rules) and simulation settings (environment).

The simulator must reject what SGLang rejects and accept what it accepts for the subset
the toolkit uses, because the launch-command builder is tested against it: an unknown
flag, or the removed ``--cuda-graph-max-bs``, is an argparse error (exit 2); the
deprecated ``--disable-cuda-graph`` is accepted with SGLang's warning wording and folds
into both ``--cuda-graph-backend-*`` phases. Settings that have no SGLang flag (which GPU
to pretend to be, how long loading takes, how fast time runs) come from ``SIM_*``
environment variables so an inventory can set them per host without touching the
command line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ddtree_ops.sim.profiles import PROFILES

CUDA_GRAPH_BACKENDS = ("full", "breakable", "disabled")
SPEC_ALGORITHMS = ("DFLASH", "DDTREE")

# SGLang's wording (sglang/srt/arg_groups/argparse_actions.py, DeprecatedStoreTrueAction).
DISABLE_CUDA_GRAPH_WARNING = (
    "'--disable-cuda-graph' is deprecated and will be removed in a future release. "
    "Use '--cuda-graph-backend-{decode,prefill}=disabled' instead."
)


class _DeprecatedStoreTrue(argparse.Action):
    """Stores True and remembers that the deprecation warning must be logged.

    The warning is logged after logging is configured (SGLang logs it through its
    logger, so it carries the timestamp prefix), hence it is only recorded here.
    """

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, const=True, default=False, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, True)
        warnings = list(getattr(namespace, "_warnings", []))
        warnings.append(DISABLE_CUDA_GRAPH_WARNING)
        namespace._warnings = warnings


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The launch_server parser for the subset of flags the simulator honours."""
    parser = argparse.ArgumentParser(
        prog="python -m ddtree_ops.sim",
        description="Simulated SGLang 0.5.23 server (no GPU; all numbers are simulated).",
    )
    parser.add_argument("--model-path", "--model", dest="model_path", type=str, required=True)
    parser.add_argument("--served-model-name", type=str, default=None)
    parser.add_argument("--tokenizer-path", type=str, default=None)
    parser.add_argument("--host", type=str, default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=_positive_int, default=1)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--log-level", type=str, default="info")
    parser.add_argument("--speculative-algorithm", type=str, default=None)
    parser.add_argument(
        "--speculative-draft-model-path", "--speculative-draft-model", dest="speculative_draft_model_path", type=str, default=None
    )
    parser.add_argument("--speculative-num-draft-tokens", type=_positive_int, default=None)
    parser.add_argument("--speculative-dflash-block-size", type=_positive_int, default=None)
    parser.add_argument("--speculative-ddtree-budget", type=_positive_int, default=None)
    parser.add_argument("--speculative-ddtree-topk", type=_positive_int, default=None)
    parser.add_argument("--cuda-graph-backend-decode", choices=CUDA_GRAPH_BACKENDS, default=None)
    parser.add_argument("--cuda-graph-backend-prefill", choices=CUDA_GRAPH_BACKENDS, default=None)
    parser.add_argument("--cuda-graph-max-bs-decode", type=_positive_int, default=None)
    # Both per-phase spellings exist, so argparse (abbreviations on, as in SGLang) calls
    # the removed --cuda-graph-max-bs ambiguous and exits 2, exactly like 0.5.23 does.
    parser.add_argument("--cuda-graph-max-bs-prefill", type=_positive_int, default=None)
    parser.add_argument("--disable-cuda-graph", action=_DeprecatedStoreTrue)
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    parser.add_argument("--max-running-requests", type=_positive_int, default=None)
    return parser


@dataclass(frozen=True)
class ServerArgs:
    """Resolved launch flags, flat, as ``/server_info`` reports them."""

    model_path: str
    served_model_name: str
    tokenizer_path: str
    host: str
    port: int
    tp_size: int
    log_level: str
    speculative_algorithm: str | None
    speculative_draft_model_path: str | None
    speculative_num_draft_tokens: int | None
    speculative_dflash_block_size: int | None
    speculative_ddtree_budget: int | None
    speculative_ddtree_topk: int | None
    cuda_graph_backend_decode: str
    cuda_graph_backend_prefill: str
    cuda_graph_max_bs_decode: int
    disable_cuda_graph: bool
    mem_fraction_static: float
    max_running_requests: int

    @property
    def speculating(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def draft_depth(self) -> int:
        """Draft positions per step (block size minus the verified root)."""
        if self.speculative_num_draft_tokens is None:
            return 0
        return max(1, self.speculative_num_draft_tokens - 1)

    @property
    def decode_cuda_graph(self) -> bool:
        return self.cuda_graph_backend_decode != "disabled"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_server_args(argv: Sequence[str]) -> tuple[ServerArgs, list[str]]:
    """Parse and resolve flags; returns the args and deprecation warnings to log.

    Exits 2 through argparse on anything SGLang would refuse at parse time, plus the
    semantic checks SGLang performs right after parsing (unknown algorithm, DDTree
    flags without DDTREE).
    """
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    warnings: list[str] = list(getattr(ns, "_warnings", []))
    algo = ns.speculative_algorithm.upper() if ns.speculative_algorithm else None
    if algo is not None and algo not in SPEC_ALGORITHMS:
        parser.error(
            f"argument --speculative-algorithm: unsupported value {ns.speculative_algorithm!r} "
            f"(the simulator knows {', '.join(SPEC_ALGORITHMS)}; absent = autoregressive)"
        )
    ddtree_flags = ns.speculative_ddtree_budget is not None or ns.speculative_ddtree_topk is not None
    if ddtree_flags and algo != "DDTREE":
        parser.error("--speculative-ddtree-budget/--speculative-ddtree-topk require --speculative-algorithm DDTREE")
    if ns.speculative_dflash_block_size is not None and algo is None:
        parser.error("--speculative-dflash-block-size requires --speculative-algorithm DFLASH or DDTREE")
    if (
        ns.speculative_dflash_block_size is not None
        and ns.speculative_num_draft_tokens is not None
        and ns.speculative_dflash_block_size != ns.speculative_num_draft_tokens
    ):
        parser.error(
            "--speculative-dflash-block-size and --speculative-num-draft-tokens disagree "
            f"({ns.speculative_dflash_block_size} != {ns.speculative_num_draft_tokens})"
        )
    num_draft = None
    budget = topk = None
    if algo is not None:
        # DFlash's default block is 16 (the drafter checkpoints in the paper use 16).
        num_draft = ns.speculative_num_draft_tokens or ns.speculative_dflash_block_size or 16
        if num_draft < 2:
            parser.error("--speculative-num-draft-tokens must be at least 2 when speculating")
    if algo == "DDTREE":
        budget = ns.speculative_ddtree_budget or 16
        topk = ns.speculative_ddtree_topk or 4
    decode = ns.cuda_graph_backend_decode or "full"
    prefill = ns.cuda_graph_backend_prefill or "breakable"
    if ns.disable_cuda_graph:
        decode = prefill = "disabled"
    args = ServerArgs(
        model_path=ns.model_path,
        served_model_name=ns.served_model_name or ns.model_path,
        tokenizer_path=ns.tokenizer_path or ns.model_path,
        host=ns.host,
        port=ns.port,
        tp_size=ns.tp_size,
        log_level=ns.log_level,
        speculative_algorithm=algo,
        speculative_draft_model_path=ns.speculative_draft_model_path,
        speculative_num_draft_tokens=num_draft,
        speculative_dflash_block_size=num_draft if algo is not None else None,
        speculative_ddtree_budget=budget,
        speculative_ddtree_topk=topk,
        cuda_graph_backend_decode=decode,
        cuda_graph_backend_prefill=prefill,
        cuda_graph_max_bs_decode=ns.cuda_graph_max_bs_decode or 256,
        disable_cuda_graph=bool(ns.disable_cuda_graph),
        mem_fraction_static=ns.mem_fraction_static if ns.mem_fraction_static is not None else 0.85,
        max_running_requests=ns.max_running_requests or 128,
    )
    return args, warnings


@dataclass(frozen=True)
class SimSettings:
    """Simulation knobs from the environment (see ddtree_ops/sim/README.md)."""

    gpu: str = "h200"
    load_s: float = 5.0
    time_scale: float = 1.0
    shutdown_drain_s: float = 0.0
    seed: int = 0
    port_wait_s: float = 30.0
    warmup_s: float = 2.0

    def scaled(self, sim_seconds: float) -> float:
        """Real seconds to sleep for ``sim_seconds`` of simulated time."""
        return sim_seconds * self.time_scale


class SimSettingsError(ValueError):
    """A SIM_* variable is malformed; the message names the variable."""


def _env_float(env: Mapping[str, str], name: str, default: float, *, minimum: float = 0.0) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SimSettingsError(f"{name}={raw!r} is not a number") from None
    if value < minimum:
        raise SimSettingsError(f"{name}={raw!r} must be >= {minimum}")
    return value


def sim_settings_from_env(env: Mapping[str, str] | None = None) -> SimSettings:
    """Read SIM_GPU, SIM_LOAD_S, SIM_TIME_SCALE, SIM_SHUTDOWN_DRAIN_S, SIM_SEED, SIM_WARMUP_S
    and SGLang's own SGLANG_WAIT_PORT_TIMEOUT."""
    env = os.environ if env is None else env
    gpu = env.get("SIM_GPU", "h200") or "h200"
    if gpu not in PROFILES:
        raise SimSettingsError(f"SIM_GPU={gpu!r} is not a known profile ({', '.join(sorted(PROFILES))})")
    seed_raw = env.get("SIM_SEED", "0") or "0"
    try:
        seed = int(seed_raw)
    except ValueError:
        raise SimSettingsError(f"SIM_SEED={seed_raw!r} is not an integer") from None
    # SGLang's own knob for the port wait (sglang/srt/utils/network.py).
    port_wait = _env_float(env, "SGLANG_WAIT_PORT_TIMEOUT", 30.0)
    return SimSettings(
        gpu=gpu,
        load_s=_env_float(env, "SIM_LOAD_S", 5.0),
        time_scale=_env_float(env, "SIM_TIME_SCALE", 1.0),
        shutdown_drain_s=_env_float(env, "SIM_SHUTDOWN_DRAIN_S", 0.0),
        seed=seed,
        port_wait_s=port_wait,
        warmup_s=_env_float(env, "SIM_WARMUP_S", 2.0),
    )
