"""Launch flags (SGLang 0.5.23 names and rules) and simulation settings (environment).

The simulator must reject what SGLang rejects and accept what it accepts for the subset
the toolkit uses, because the launch-command builder is tested against it: an unknown
flag, or the removed ``--cuda-graph-max-bs``, is an argparse error (exit 2); the
deprecated ``--disable-cuda-graph`` is accepted with SGLang's warning wording and folds
into both ``--cuda-graph-backend-*`` phases. Settings that have no SGLang flag (which GPU
to pretend to be, how long loading takes, how fast time runs) come from ``SIM_*``
environment variables so an inventory can set them per host without touching the
command line.

DDTREE is configured the way the DDTree plugin (``patches/ddtree_temperature``,
``ddtree_registration.resolve_ddtree_server_args``) configures it on SGLang 0.5.23, with
SGLang's generic speculative fields in EAGLE's meaning: ``--speculative-num-draft-tokens
N`` is the verify window (root + ``budget = N - 1`` tree nodes, 2..257; default the draft
block), ``--speculative-eagle-topk K`` the candidates per draft position (default 4), and
the draft block is the draft model's trained ``block_size`` (its ``config.json``), with
``--speculative-dflash-block-size`` only for a draft whose config has none. The plugin
cannot add flags of its own (SGLang builds its parser before plugins load), so the old
``--speculative-ddtree-*`` flags are unknown arguments here as they are there.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ddtree_ops.sim.profiles import PROFILES
from ddtree_ops.sim.states import AdaptiveConfig, AdaptiveConfigError, load_adaptive_config

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


def _draft_config_block_size(draft_model_path: str | None) -> tuple[bool, int | None]:
    """(has a config, its trained block size) for a draft model directory.

    SGLang reads ``dflash_config.block_size``, else a top-level ``block_size``
    (``parse_dflash_draft_config``). A path without a readable ``config.json`` is the
    simulator's own drafter, which has no config: (False, None).
    """
    if not draft_model_path:
        return False, None
    try:
        with open(os.path.join(draft_model_path, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return False, None
    if not isinstance(config, dict):
        return False, None
    dflash = config.get("dflash_config")
    raw = dflash.get("block_size") if isinstance(dflash, dict) and "block_size" in dflash else config.get("block_size")
    return True, (int(raw) if isinstance(raw, int) and not isinstance(raw, bool) else None)


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
    # SGLang's flag for clients that send token ids (selftest --e2e does); the simulator
    # takes ids either way.
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--log-level", type=str, default="info")
    parser.add_argument("--speculative-algorithm", type=str, default=None)
    parser.add_argument(
        "--speculative-draft-model-path",
        "--speculative-draft-model",
        dest="speculative_draft_model_path",
        type=str,
        default=None,
    )
    # Plain ints, as in SGLang: the range checks come after parsing, per algorithm.
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    parser.add_argument("--speculative-eagle-topk", type=int, default=None)
    parser.add_argument("--speculative-num-steps", type=int, default=None)
    parser.add_argument("--speculative-dflash-block-size", type=_positive_int, default=None)
    parser.add_argument("--cuda-graph-backend-decode", choices=CUDA_GRAPH_BACKENDS, default=None)
    parser.add_argument("--cuda-graph-backend-prefill", choices=CUDA_GRAPH_BACKENDS, default=None)
    parser.add_argument("--cuda-graph-max-bs-decode", type=_positive_int, default=None)
    # Both per-phase spellings exist, so argparse (abbreviations on, as in SGLang) calls
    # the removed --cuda-graph-max-bs ambiguous and exits 2, exactly like 0.5.23 does.
    parser.add_argument("--cuda-graph-max-bs-prefill", type=_positive_int, default=None)
    parser.add_argument("--disable-cuda-graph", action=_DeprecatedStoreTrue)
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    parser.add_argument("--max-running-requests", type=_positive_int, default=None)
    # 0.5.23's own flag for runtime speculative configurations; the DDTree plugin reads its
    # "ddtree" key (the set of runtime states, see ddtree_ops/sim/states.py).
    parser.add_argument("--speculative-adaptive-config", type=str, default=None)
    return parser


@dataclass(frozen=True)
class DDTreeConfig:
    """DDTREE's resolved tree: what ``/server_info`` reports under ``ddtree``."""

    budget: int  # tree nodes verified per round besides the root (= num_draft_tokens - 1)
    topk: int  # candidates per draft position
    draft_block_size: int  # the draft model's trained block

    @property
    def verify_width(self) -> int:
        """Tokens verified per request per round: the root plus the budget."""
        return self.budget + 1

    @property
    def max_depth(self) -> int:
        """The deepest tree node: the block drafts ``block - 1`` positions."""
        return min(self.draft_block_size - 1, self.budget)


@dataclass(frozen=True)
class ServerArgs:
    """Resolved launch flags, flat, as ``/server_info`` reports them.

    ``ddtree`` is not a flag: it is the resolved tree (None unless DDTREE), reported as
    ``/server_info``'s top-level ``ddtree`` object, not among the flat fields; nor is
    ``ddtree_adaptive``, the validated ``--speculative-adaptive-config`` file.
    """

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
    speculative_eagle_topk: int | None
    speculative_num_steps: int | None
    speculative_dflash_block_size: int | None
    cuda_graph_backend_decode: str
    cuda_graph_backend_prefill: str
    cuda_graph_max_bs_decode: int
    disable_cuda_graph: bool
    mem_fraction_static: float
    max_running_requests: int
    speculative_adaptive_config: str | None = None
    ddtree: DDTreeConfig | None = None
    # The validated runtime-state set (DDTREE with --speculative-adaptive-config only).
    ddtree_adaptive: AdaptiveConfig | None = None

    @property
    def speculating(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def draft_positions(self) -> int:
        """Positions one draft forward covers: the draft block (0 without speculation)."""
        return (self.speculative_dflash_block_size or 0) if self.speculating else 0

    @property
    def draft_depth(self) -> int:
        """Draft positions per step (block size minus the verified root)."""
        if not self.speculating:
            return 0
        return max(1, self.draft_positions - 1)

    @property
    def decode_cuda_graph(self) -> bool:
        return self.cuda_graph_backend_decode != "disabled"

    @property
    def decode_graph_max_bs(self) -> int | None:
        """The largest batch a captured decode (or verify) graph replays; None without
        decode graphs. 0.5.23 captures up to ``--cuda-graph-max-bs-decode`` but never above
        the request pool (``get_batch_sizes_to_capture`` adds the pool size and drops what
        is above it), and runs a larger batch eager (``can_run_graph``)."""
        if not self.decode_cuda_graph:
            return None
        return min(self.cuda_graph_max_bs_decode, self.max_running_requests)

    def graph_replays(self, batch: int) -> bool:
        """Whether a decode round of ``batch`` requests replays a graph (of its own state:
        the caller checks that the state has one)."""
        ceiling = self.decode_graph_max_bs
        return ceiling is not None and batch <= ceiling

    def as_dict(self) -> dict[str, Any]:
        """The flat fields (everything but ``ddtree``)."""
        flat = asdict(self)
        del flat["ddtree"], flat["ddtree_adaptive"]
        return flat


# The DDTree plugin's rules (ddtree_registration.py).
DEFAULT_DDTREE_TOPK = 4
MAX_DDTREE_BUDGET = 256
# The block of the simulator's own drafter (no config.json), as of the DFlash drafter
# checkpoints in the paper; --speculative-dflash-block-size sets it instead.
SIM_DRAFT_BLOCK_SIZE = 16


def _resolve_ddtree(ns: argparse.Namespace) -> tuple[DDTreeConfig | None, str | None]:
    """(tree, None) or (None, the one-line error the plugin raises), checked in its order."""
    has_config, trained = _draft_config_block_size(ns.speculative_draft_model_path)
    flag = ns.speculative_dflash_block_size
    if trained is not None and flag is not None and flag != trained:
        return None, (
            f"--speculative-dflash-block-size {flag} differs from the draft model's trained "
            f"block_size {trained}; DDTREE drafts with the trained block (drop the flag)."
        )
    block = trained if trained is not None else flag
    if block is None:
        if has_config:
            return None, (
                "the DDTREE draft model's config has no block_size; pass "
                "--speculative-dflash-block-size with the block it was trained with."
            )
        block = SIM_DRAFT_BLOCK_SIZE
    if block < 2:
        return None, f"--speculative-dflash-block-size must be >= 2 for DDTREE, got {block}."
    topk = DEFAULT_DDTREE_TOPK if ns.speculative_eagle_topk is None else ns.speculative_eagle_topk
    if topk < 1:
        return None, f"--speculative-eagle-topk must be >= 1, got {topk}."
    num_draft = ns.speculative_num_draft_tokens
    budget = block - 1 if num_draft is None else num_draft - 1
    if not 1 <= budget <= MAX_DDTREE_BUDGET:
        got = num_draft if num_draft is not None else f"the draft block {block}"
        return None, (
            "--speculative-num-draft-tokens is the DDTREE verify window (root + budget nodes) "
            f"and must be in 2..{MAX_DDTREE_BUDGET + 1}, got {got}."
        )
    if ns.speculative_num_steps not in (None, 1):
        return None, (
            "--speculative-num-steps does not apply to DDTREE (one draft forward per round); "
            f"got {ns.speculative_num_steps}."
        )
    return DDTreeConfig(budget=budget, topk=topk, draft_block_size=block), None


def parse_server_args(argv: Sequence[str]) -> tuple[ServerArgs, list[str]]:
    """Parse and resolve flags; returns the args and warnings to log.

    Exits 2 through argparse on anything SGLang would refuse at parse time (unknown
    flags, among them the old ``--speculative-ddtree-*``), plus the semantic checks
    SGLang and the DDTree plugin perform right after parsing (unknown algorithm, DDTREE's
    ranges), each as one ``error:`` line naming the flag.
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
    if ns.speculative_dflash_block_size is not None and algo is None:
        parser.error("--speculative-dflash-block-size requires --speculative-algorithm DFLASH or DDTREE")
    num_draft = block = topk = steps = None
    tree: DDTreeConfig | None = None
    if algo == "DFLASH":
        if (
            ns.speculative_dflash_block_size is not None
            and ns.speculative_num_draft_tokens is not None
            and ns.speculative_dflash_block_size != ns.speculative_num_draft_tokens
        ):
            parser.error(
                "--speculative-dflash-block-size and --speculative-num-draft-tokens disagree "
                f"({ns.speculative_dflash_block_size} != {ns.speculative_num_draft_tokens})"
            )
        # DFlash's default block is 16 (the drafter checkpoints in the paper use 16).
        given = (ns.speculative_num_draft_tokens, ns.speculative_dflash_block_size)
        num_draft = block = next((v for v in given if v is not None), 16)
        if num_draft < 2:
            parser.error("--speculative-num-draft-tokens must be at least 2 when speculating")
        # SGLang's _handle_dflash: the EAGLE fields are forced to 1, with a warning.
        for name, value in (
            ("speculative_num_steps", ns.speculative_num_steps),
            ("speculative_eagle_topk", ns.speculative_eagle_topk),
        ):
            if value is not None and value != 1:
                warnings.append(f"DFLASH only supports {name} == 1; overriding {name}={value} to 1.")
        topk = steps = 1
    elif algo == "DDTREE":
        tree, error = _resolve_ddtree(ns)
        if error is not None:
            parser.error(error)
        assert tree is not None
        num_draft, block, topk, steps = tree.verify_width, tree.draft_block_size, tree.topk, 1
    adaptive: AdaptiveConfig | None = None
    if ns.speculative_adaptive_config is not None:
        if tree is None:
            # 0.5.23 itself honours the file for EAGLE only; its "ddtree" key is the plugin's.
            parser.error("--speculative-adaptive-config: the simulator reads its \"ddtree\" key only with "
                         "--speculative-algorithm DDTREE")
        assert tree is not None
        try:
            adaptive = load_adaptive_config(ns.speculative_adaptive_config, launch_budget=tree.budget,
                                            launch_topk=tree.topk)
        except AdaptiveConfigError as exc:
            parser.error(str(exc))
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
        speculative_eagle_topk=topk,
        speculative_num_steps=steps,
        speculative_dflash_block_size=block,
        cuda_graph_backend_decode=decode,
        cuda_graph_backend_prefill=prefill,
        cuda_graph_max_bs_decode=ns.cuda_graph_max_bs_decode or 256,
        disable_cuda_graph=bool(ns.disable_cuda_graph),
        mem_fraction_static=ns.mem_fraction_static if ns.mem_fraction_static is not None else 0.85,
        max_running_requests=ns.max_running_requests or 128,
        speculative_adaptive_config=ns.speculative_adaptive_config,
        ddtree=tree,
        ddtree_adaptive=adaptive,
    )
    return args, warnings


@dataclass(frozen=True)
class SimSettings:
    """Simulation knobs from the environment (see ddtree_ops/sim/README.md)."""

    gpu: str = "h200"
    load_s: float = 5.0
    # The load's progress lines (one per weight shard), and where a load hangs, silent.
    load_shards: int = 4
    stall_at_s: float | None = None
    time_scale: float = 1.0
    shutdown_drain_s: float = 0.0
    seed: int = 0
    port_wait_s: float = 30.0
    warmup_s: float = 2.0
    # Failure modes of the first decodes (see ddtree_ops/sim/README.md): a speculative
    # server with decode CUDA graphs on and a tree budget above this crashes at its first
    # verify-graph replay; with crash_sampled, any decode with a request at temperature > 0
    # takes the scheduler down (graphs or not).
    replay_crash_budget_over: int | None = None
    crash_sampled: bool = False
    # Where the profile's capture crash (B300, budget > 8) is simulated to lie: "verify"
    # (the target's verify graph: nothing but eager decode avoids it) or "candidate_head"
    # (the draft graph's candidate top-k: SGLANG_DFLASH_EAGER_DRAFT_SAMPLER=1 avoids it).
    # Which one the real fleet has is what `selftest --e2e --bisect-budgets` finds out.
    capture_fault: str = "verify"
    eager_draft_head: bool = False
    # The capture crash of a runtime state's verify graph is sticky (an illegal memory
    # access poisons the CUDA context): the plugin's probe finds the context unusable and
    # refuses the start with one line naming the budget, instead of serving that state eager.
    capture_sticky: bool = False
    # A DDTree plugin that misbehaves (what a rollout's canary gate must catch), DDTREE only:
    # "accept_collapse" (every round keeps only its first token: acceptance length 1, the
    # tokens still right), "wrong_greedy" (a greedy round's last token is off by one: wrong
    # greedy text), "crash_sampled" (a decode holding a sampled request takes the scheduler down),
    # "late_token" (one confident greedy token of each code prompt, at output index fault_at or
    # later, replaced by the target's runner-up), "tie_flip" (greedy verification breaks an exact
    # tie of the target towards the last tied token instead of the first), "slow" (every decode
    # step costs SLOW_FAULT_FACTOR times the cost model), "crash_load" (the plugin's worker raises
    # while the server loads, after the weights: the process dies before its port opens).
    ddtree_fault: str | None = None
    # Where "late_token" starts looking for its confident position (output index, 0 = the first
    # generated token).
    fault_at: int = 200
    # The target model itself (every algorithm, so the baseline sees it too): at this output
    # index of every code prompt its two best logits are exactly equal (None: no forced tie).
    target_tie_at: int | None = None
    # A DDTree plugin that predates runtime states: --speculative-adaptive-config is not
    # read (0.5.23 ignores it for DDTREE), so the server is mode "fixed" and refuses switches.
    no_runtime_states: bool = False
    # CUDA_VISIBLE_DEVICES as CUDA reads it (None: unset, every GPU of the machine): the
    # physical indices this process may use, so that GPU slots are testable without GPUs.
    visible_devices: str | None = None

    def visible_gpus(self, machine_count: int) -> tuple[int, ...]:
        """The physical GPU indices CUDA would expose, in the order given.

        CUDA's rule: entries are read up to the first that is not a valid, unrepeated index
        of this machine; that entry and all after it are ignored (so "9" on an 8-GPU box
        hides every GPU, and "1,9,2" exposes only GPU 1).
        """
        if self.visible_devices is None:
            return tuple(range(machine_count))
        seen: list[int] = []
        for part in self.visible_devices.split(","):
            part = part.strip()
            if not part.isdigit() or int(part) >= machine_count or int(part) in seen:
                break
            seen.append(int(part))
        return tuple(seen)

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
    """Read SIM_GPU, SIM_LOAD_S, SIM_LOAD_SHARDS, SIM_STALL_AT_S, SIM_TIME_SCALE, SIM_SHUTDOWN_DRAIN_S,
    SIM_SEED, SIM_WARMUP_S,
    SIM_REPLAY_CRASH_BUDGET_OVER, SIM_CRASH_SAMPLED, SIM_CAPTURE_FAULT, SIM_CAPTURE_STICKY, SIM_NO_RUNTIME_STATES,
    SIM_DDTREE_FAULT, SIM_FAULT_AT, SIM_TARGET_TIE_AT,
    SGLang's own SGLANG_WAIT_PORT_TIMEOUT and SGLANG_DFLASH_EAGER_DRAFT_SAMPLER, and CUDA's
    CUDA_VISIBLE_DEVICES."""
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
        load_shards=_env_int_or_none(env, "SIM_LOAD_SHARDS") or 4,
        stall_at_s=_env_float(env, "SIM_STALL_AT_S", -1.0) if env.get("SIM_STALL_AT_S") else None,
        time_scale=_env_float(env, "SIM_TIME_SCALE", 1.0),
        shutdown_drain_s=_env_float(env, "SIM_SHUTDOWN_DRAIN_S", 0.0),
        seed=seed,
        port_wait_s=port_wait,
        warmup_s=_env_float(env, "SIM_WARMUP_S", 2.0),
        replay_crash_budget_over=_env_int_or_none(env, "SIM_REPLAY_CRASH_BUDGET_OVER"),
        crash_sampled=_env_flag(env, "SIM_CRASH_SAMPLED"),
        capture_fault=_capture_fault(env),
        eager_draft_head=_env_flag(env, "SGLANG_DFLASH_EAGER_DRAFT_SAMPLER"),
        capture_sticky=_env_flag(env, "SIM_CAPTURE_STICKY"),
        no_runtime_states=_env_flag(env, "SIM_NO_RUNTIME_STATES"),
        ddtree_fault=_ddtree_fault(env),
        fault_at=_env_positive_int(env, "SIM_FAULT_AT") or 200,
        target_tie_at=_env_positive_int(env, "SIM_TARGET_TIE_AT"),
        visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
    )


CAPTURE_FAULTS = ("verify", "candidate_head")
DDTREE_FAULTS = ("accept_collapse", "wrong_greedy", "crash_sampled", "late_token", "tie_flip", "slow", "crash_load")
# How much slower every decode step of a DDTREE server with SIM_DDTREE_FAULT=slow is.
SLOW_FAULT_FACTOR = 4.0


def _ddtree_fault(env: Mapping[str, str]) -> str | None:
    raw = env.get("SIM_DDTREE_FAULT", "")
    if raw and raw not in DDTREE_FAULTS:
        raise SimSettingsError(f"SIM_DDTREE_FAULT={raw!r} is not one of {', '.join(DDTREE_FAULTS)}")
    return raw or None


def _capture_fault(env: Mapping[str, str]) -> str:
    raw = env.get("SIM_CAPTURE_FAULT", "") or "verify"
    if raw not in CAPTURE_FAULTS:
        raise SimSettingsError(f"SIM_CAPTURE_FAULT={raw!r} is not one of {', '.join(CAPTURE_FAULTS)}")
    return raw


def _env_int_or_none(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    if not raw.isdigit():
        raise SimSettingsError(f"{name}={raw!r} is not a non-negative integer")
    return int(raw)


def _env_positive_int(env: Mapping[str, str], name: str) -> int | None:
    """An output index that must be at least 1 (index 0 is the prefill's token, which no
    speculative round produces), or None when unset."""
    value = _env_int_or_none(env, name)
    if value is not None and value < 1:
        raise SimSettingsError(f"{name}={env.get(name)!r} must be at least 1")
    return value


def _env_flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "")
    if raw not in ("", "0", "1"):
        raise SimSettingsError(f"{name}={raw!r} must be 0 or 1")
    return raw == "1"
