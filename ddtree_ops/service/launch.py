"""Pure launch specification: host settings + run config + remote SGLang version -> argv.

Nothing here touches a host. The version-aware part is one small table
(:data:`EAGER_FLAGS`): SGLang 0.5.23 replaced ``--disable-cuda-graph`` by per-phase
``--cuda-graph-backend-{decode,prefill} disabled`` (the old spelling is a deprecated
alias there, ``sglang/srt/server_args.py``), so the eager flags depend on what the
remote host runs and must come from the probe, never from an assumption.

The argv is a list from start to end: inventory values and extra args are argv
entries, never shell text, so a hostile value such as ``"; rm -rf ~"`` reaches the
server as one literal argument.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from ddtree_ops.errors import ConfigError
from ddtree_ops.inventory.schema import owned_flag_problem
from ddtree_ops.inventory.values import printable
from ddtree_ops.inventory_types import Host
from ddtree_ops.limits import MAX_DDTREE_BUDGET, MAX_DDTREE_TOPK

Algorithm = Literal["AR", "DFLASH", "DDTREE"]
CudaGraphMode = Literal["auto", "on", "off"]
ALGORITHMS: tuple[str, ...] = ("AR", "DFLASH", "DDTREE")
# One algorithm, two spellings: the server's and the ledger's (AR, DFLASH, DDTREE) and the
# sweep file's (autoregressive, dflash, ddtree). Both are accepted anywhere, any case.
_ALGORITHM_NAMES = {"ar": "AR", "autoregressive": "AR", "dflash": "DFLASH", "ddtree": "DDTREE"}


def parse_algorithm(text: str) -> Algorithm:
    """``AR``/``autoregressive``, ``DFLASH``/``dflash``, ``DDTREE``/``ddtree`` -> the one name
    the server, the ledger and every table print. ConfigError for anything else."""
    name = _ALGORITHM_NAMES.get(text.strip().lower()) if isinstance(text, str) else None
    if name is None:
        raise ConfigError(f"unknown algorithm {text!r} (expected AR, DFLASH or DDTREE; autoregressive, dflash and "
                          f"ddtree mean the same)")
    return name  # type: ignore[return-value]  # one of Algorithm's literals

# (first version it applies to, eager flags). Newest first; the first row whose version
# is <= the remote version wins. Only 0.5.23 is verified against source; the boundary
# is conservative: anything older gets the spelling every older release accepts.
EAGER_FLAGS: tuple[tuple[tuple[int, ...], tuple[str, ...]], ...] = (
    ((0, 5, 23), ("--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled")),
    ((0,), ("--disable-cuda-graph",)),
)


@dataclass(frozen=True)
class RunConfig:
    """What to serve: the speculative algorithm and its knobs, independent of the host."""

    algorithm: Algorithm = "AR"
    budget: int | None = None
    topk: int | None = None
    cuda_graph: CudaGraphMode = "auto"
    # restart's --extra-arg values: never a flag ddtree-ops sets itself (OWNED_FLAGS).
    extra_args: tuple[str, ...] = ()
    # DDTREE only: a ``{"ddtree": {...}}`` runtime-state file on the host, passed as
    # ``--speculative-adaptive-config`` (0.5.23's own flag: the plugin cannot add one).
    # ``budget``/``topk`` are then the launch state, which must be in the file's set.
    adaptive_config: str | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"algorithm must be one of {', '.join(ALGORITHMS)}, not {self.algorithm!r}")
        if self.cuda_graph not in ("auto", "on", "off"):
            raise ConfigError(f"cuda_graph must be auto, on or off, not {self.cuda_graph!r}")
        for name in ("budget", "topk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, not {value!r}")
        if self.algorithm == "DDTREE" and self.budget is not None and self.budget > MAX_DDTREE_BUDGET:
            raise ConfigError(f"budget must be at most {MAX_DDTREE_BUDGET} for DDTREE, not {self.budget}")
        if self.topk is not None and self.topk > MAX_DDTREE_TOPK:
            raise ConfigError(f"topk must be at most {MAX_DDTREE_TOPK}, not {self.topk}")
        if self.algorithm == "AR" and (self.budget is not None or self.topk is not None):
            raise ConfigError("budget/topk only apply to DFLASH or DDTREE")
        if self.algorithm == "DFLASH" and self.topk is not None:
            raise ConfigError("topk only applies to DDTREE")
        if not all(isinstance(a, str) for a in self.extra_args):
            raise ConfigError("extra_args must be strings")
        for arg in self.extra_args:  # checked here, before any host is touched
            problem = owned_flag_problem(arg)
            if problem:
                raise ConfigError(f"--extra-arg {printable(arg)}: {problem}")
        if self.adaptive_config is not None:
            if self.algorithm != "DDTREE":
                raise ConfigError("adaptive_config (runtime states) only applies to DDTREE")
            if not isinstance(self.adaptive_config, str) or not self.adaptive_config.strip():
                raise ConfigError(f"adaptive_config must be a path on the host, not {self.adaptive_config!r}")

    def describe(self) -> str:
        parts: list[str] = [self.algorithm]
        if self.budget is not None:
            parts.append(f"budget={self.budget}")
        if self.topk is not None:
            parts.append(f"topk={self.topk}")
        if self.adaptive_config is not None:
            parts.append(f"adaptive_config={self.adaptive_config}")
        return " ".join(parts)


@dataclass(frozen=True)
class LaunchSpec:
    """A fully resolved launch: what runs, with which environment, and what it should report.

    ``server_args`` is the part after the launcher (``python -m sglang.launch_server``);
    SGLang reports exactly ``" ".join(server_args)`` as ``launch_command`` in
    ``/server_info``, which is how readiness recognises its own process.
    """

    host: str
    argv: tuple[str, ...]
    server_args: tuple[str, ...]
    env: Mapping[str, str]
    port: int
    probe_host: str
    cuda_graph: bool
    model: str
    run: RunConfig
    sglang_version: str | None = None

    @property
    def launch_command(self) -> str:
        return " ".join(self.server_args)

    @property
    def argv_hash(self) -> str:
        payload = json.dumps({"argv": list(self.argv), "env": dict(sorted(self.env.items()))})
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def display(self) -> str:
        return shlex.join(self.argv)


def probe_address(bind_host: str) -> str:
    """Where the host itself reaches the server: a wildcard bind is reached on loopback."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "", "::") else bind_host


def parse_version(text: str) -> tuple[int, ...]:
    """Leading numeric components of a version string: ``"0.5.23-sim"`` -> ``(0, 5, 23)``."""
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)", text)
    if not match:
        raise ConfigError(f"cannot read SGLang version {text!r}")
    return tuple(int(p) for p in match.group(1).split("."))


def eager_flags(sglang_version: str) -> tuple[str, ...]:
    """The flags that turn CUDA graphs off for this SGLang version (see :data:`EAGER_FLAGS`)."""
    version = parse_version(sglang_version)
    for first, flags in EAGER_FLAGS:
        if version >= first:
            return flags
    return EAGER_FLAGS[-1][1]


def speculative_flags(run: RunConfig, draft_model_path: str | None, *, host: str) -> tuple[str, ...]:
    if run.algorithm == "AR":
        return ()
    if not draft_model_path:
        raise ConfigError(
            f"{run.algorithm} needs ddtree.server.draft_model_path in the inventory", host=host
        )
    flags = ["--speculative-algorithm", run.algorithm, "--speculative-draft-model-path", draft_model_path]
    if run.algorithm == "DFLASH":
        if run.budget is not None:
            flags += ["--speculative-num-draft-tokens", str(run.budget)]
    else:
        if run.budget is None or run.topk is None:
            raise ConfigError("DDTREE needs both --budget and --topk", host=host)
        flags += ddtree_flags(run.budget, run.topk)
        if run.adaptive_config is not None:
            # One argv element, like every other value: a path with spaces stays one word.
            flags += ["--speculative-adaptive-config", run.adaptive_config]
    return tuple(flags)


def ddtree_flags(budget: int, topk: int) -> list[str]:
    """DDTREE's tree in SGLang's generic speculative fields, with EAGLE's meaning.

    The DDTree bundle is an SGLang plugin and cannot add flags of its own (0.5.23 builds
    its argument parser before plugins load), so ``--speculative-num-draft-tokens`` is
    the verify window, the root plus ``budget`` tree nodes, and
    ``--speculative-eagle-topk`` the candidates per draft position. The draft block is
    the draft model's trained block size, never a flag here.
    """
    return ["--speculative-num-draft-tokens", str(budget + 1), "--speculative-eagle-topk", str(topk)]


#: The attention backends the DDTree bundle verifies a tree with (its
#: ``TREE_VERIFY_BACKENDS``); it refuses every other one at start-up.
DDTREE_VERIFY_BACKENDS: tuple[str, ...] = ("fa3", "flashinfer", "triton")
#: Compute-capability majors FA3's kernels are built for (sgl_kernel's ``is_fa3_supported``).
FA3_ARCH_MAJORS: tuple[int, ...] = (8, 9)
# Flags whose mere presence the bundle refuses (ddtree_registration.resolve_ddtree_server_args),
# and what it says about them.
_DDTREE_REFUSED_SWITCHES: Mapping[str, str] = MappingProxyType({
    "--enable-dp-attention": "dp attention",
    "--speculative-use-rejection-sampling": "--speculative-use-rejection-sampling (it verifies by tree rejection "
                                            "sampling)",
    "--enable-watermark": "--enable-watermark (the watermark ignores a tree node's ancestors)",
})


def _flag_values(args: tuple[str, ...] | list[str]) -> dict[str, str | None]:
    """argv flags -> their last value (argparse: the last one wins); ``--x=v`` and
    ``--x v`` alike; a flag followed by another flag (a switch) maps to None."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg.partition("=")
        if eq:
            out[name] = value
        else:
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[name] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def _arch_major(gpu_arch: str | None) -> int | None:
    """``sm_103`` -> 10, ``sm_90`` -> 9, ``sm_120`` -> 12 (the minor is the last digit)."""
    match = re.fullmatch(r"sm_(\d+)(\d)", gpu_arch or "")
    return int(match.group(1)) if match else None


def ddtree_launch_refusal(
    server_args: tuple[str, ...] | list[str], *, gpu_arch: str | None = None, topk_max: int | None = None
) -> str | None:
    """Why the DDTree bundle would refuse this launch at start-up, as far as the argv and
    the host's GPU architecture tell (None: nothing known against it). Checked before a
    restart stops anything, so that such a launch is one line here, never a failed start.

    What it knows is what ``tests/sglang_real/test_launch_matrix.py`` checks against SGLang
    0.5.23's own argument resolution with the bundle, per GPU: the verify backend (only
    fa3, flashinfer, triton read the tree mask; fa3 only on sm_8x/sm_9x, and not at launch
    top-k 1 with runtime states of a larger top-k, ``topk_max``), ``--page-size`` 1, and
    the flags the bundle refuses outright. A launch that names no backend gets one the
    bundle verifies with on every GPU (its default-backend hook). A non-CUDA ``--device``
    is the bundle's own check (a CPU test server serves with test-only stand-ins)."""
    flags = _flag_values(server_args)
    if (flags.get("--speculative-algorithm") or "").upper() != "DDTREE":
        return None
    device = flags.get("--device")
    if device is not None and not device.startswith("cuda"):
        return None
    base = flags.get("--attention-backend")
    phase = "--decode-attention-backend" if flags.get("--speculative-attention-mode") == "decode" \
        else "--prefill-attention-backend"
    verify = flags.get(phase) or base
    flag = phase if flags.get(phase) else "--attention-backend"
    if verify is not None and verify not in DDTREE_VERIFY_BACKENDS:
        return (f"DDTREE cannot verify a tree with {flag} {printable(verify)}: the DDTree bundle verifies with "
                f"{', '.join(DDTREE_VERIFY_BACKENDS)} only (drop the flag: it picks one for this GPU)")
    if verify == "fa3":
        major = _arch_major(gpu_arch)
        if major is not None and major not in FA3_ARCH_MAJORS:
            return (f"{flag} fa3 cannot run on this GPU ({gpu_arch}): FA3's kernels run on sm_80/sm_90 only "
                    f"(drop the flag: the DDTree bundle picks flashinfer here)")
        if flags.get("--speculative-eagle-topk") == "1" and topk_max is not None and topk_max > 1:
            return (f"{flag} fa3 builds DDTREE's verify path from the launch top-k (1), and the runtime states "
                    f"serve top-k up to {topk_max}: launch at a top-k > 1, or drop the flag")
    # SGLang's own page-size rules for a backend named in any phase (arg_groups/overrides.py
    # _mla_backend_page_constraints, _fa4_page_constraint), which DDTREE's --page-size 1 refuses.
    phases = ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")
    for name in (*phases, "--speculative-draft-attention-backend"):
        if flags.get(name) in ("trtllm_mha", "hpc_ops"):
            return (f"{name} {flags[name]} makes SGLang set --page-size 64, and DDTREE needs --page-size 1 "
                    f"(accepted tree nodes are compacted token by token)")
    topk = flags.get("--speculative-eagle-topk")
    if (any(flags.get(name) == "fa4" for name in phases) and _arch_major(gpu_arch) == 10
            and (topk is None or topk in ("0", "1"))):
        return ("fa4 at top-k 1 on this GPU makes SGLang set --page-size 128, and DDTREE needs --page-size 1 "
                "(accepted tree nodes are compacted token by token)")
    page = flags.get("--page-size")
    if page is not None and page != "1":
        return f"DDTREE needs --page-size 1 (accepted tree nodes are compacted token by token), not {printable(page)}"
    for name, what in _DDTREE_REFUSED_SWITCHES.items():
        if name in flags:
            return f"DDTREE does not support {what}"
    for name, ok in (("--pp-size", "1"), ("--speculative-num-steps", "1")):
        value = flags.get(name)
        if value is not None and value != ok:
            return f"DDTREE needs {name} {ok}, not {printable(value)}"
    if flags.get("--speculative-draft-window-size") is not None:
        return "DDTREE does not support --speculative-draft-window-size (tree nodes are no contiguous window)"
    mode = flags.get("--disaggregation-mode")
    if mode is not None and mode != "null":
        return f"DDTREE does not support --disaggregation-mode {printable(mode)}"
    return None


def launcher_argv(host: Host) -> tuple[str, ...]:
    """``server.command`` with ``{python}`` filled in, split like a shell would split it.

    The template is the operator's own inventory text (not a user value passed at run
    time); it is split once here and from then on travels as a list.
    """
    template = host.ddtree.server.command
    try:
        words = shlex.split(template)
    except ValueError as exc:
        raise ConfigError(f"ddtree.server.command: {exc}", host=host.name) from exc
    if not words:
        raise ConfigError("ddtree.server.command is empty", host=host.name)
    out: list[str] = []
    for word in words:
        try:
            out.append(word.format(python=host.ddtree.python))
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"ddtree.server.command: only {{python}} may be substituted, got {word!r}", host=host.name
            ) from exc
    return tuple(out)


def build_launch_spec(
    host: Host,
    run: RunConfig,
    sglang_version: str | None,
    *,
    cuda_graph: bool,
    gpu_arch: str | None = None,
    topk_max: int | None = None,
) -> LaunchSpec:
    """Resolve the argv for ``host``. ``cuda_graph=False`` adds this version's eager flags.

    A DDTREE launch the bundle would refuse (:func:`ddtree_launch_refusal`, with the
    probed ``gpu_arch`` and the runtime states' ``topk_max`` where known) is a ConfigError
    here, before anything on the host changes."""
    server = host.ddtree.server
    if not server.model_path:
        raise ConfigError("ddtree.server.model_path is not set in the inventory", host=host.name)
    args: list[str] = ["--model-path", server.model_path, "--host", server.bind_host, "--port", str(server.port)]
    args += speculative_flags(run, server.draft_model_path, host=host.name)
    if not cuda_graph:
        if sglang_version is None:
            raise ConfigError(
                "remote SGLang version unknown, cannot choose the eager flags (run `ddtree-ops doctor`)",
                host=host.name,
            )
        args += eager_flags(sglang_version)
    args += server.extra_args
    args += run.extra_args
    refusal = ddtree_launch_refusal(args, gpu_arch=gpu_arch, topk_max=topk_max)
    if refusal is not None:
        raise ConfigError(refusal, host=host.name)
    env = MappingProxyType(dict(server.env))
    return LaunchSpec(
        host=host.name,
        argv=launcher_argv(host) + tuple(args),
        server_args=tuple(args),
        env=env,
        port=server.port,
        probe_host=probe_address(server.bind_host),
        cuda_graph=cuda_graph,
        model=server.model_path,
        run=run,
        sglang_version=sglang_version,
    )
