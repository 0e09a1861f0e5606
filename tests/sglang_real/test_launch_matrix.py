"""Every launch ddtree-ops computes, resolved by SGLang 0.5.23 with the DDTree bundle as it
would be on each GPU the toolkit knows, on CPU (no server: ``launch_matrix.py`` in one
interpreter of the lane's DDTree prefix, the device query answering as the GPU).

The launches: every server launch the shipped sweeps plan (``bench_configs/*.yaml``, both
``relaunch`` modes: the live DDTree launch with its runtime-state file, with and without
eager budgets, and each (budget, top-k) launch), tuned policies at launch top-k 1..8 (the
file ``tune`` writes, ``Policy.render``, with and without ``eager_budgets``), each with
decode CUDA graphs and eager (the toolkit's eager flags); and operator variants (an
``--attention-backend`` in ``extra_args``, ``--page-size``, a graph ceiling), on H100
(sm_90), B200 (sm_100), B300 (sm_103) and RTX PRO 6000 (sm_120).

What it proves: each launch the toolkit computes by itself serves on every one of these
GPUs (issue 55's N2: at top-k 1 on B200/B300, 0.5.23's default backend is trtllm_mha, which
DDTREE refuses); and the toolkit's own check (``launch.ddtree_launch_refusal``, run before a
restart stops anything) refuses exactly the launches SGLang with the bundle refuses, so no
refusal the toolkit can know is found by a failed start. The bundle README's table of
resolved backends and graph settings is this module's output
(``DDTREE_LAUNCH_MATRIX_WRITE=1`` rewrites it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddtree_ops.bench.livetree import states_file
from ddtree_ops.bench.plan import LaunchConfig, plan_sweep
from ddtree_ops.bench.rows import run_config
from ddtree_ops.bench.sweep import load_sweep
from ddtree_ops.errors import ConfigError
from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.report.policy import Policy, PolicyEntry
from ddtree_ops.service.launch import RunConfig, build_launch_spec, ddtree_launch_refusal

from .serverenv import coverage_env, server_env

pytestmark = [pytest.mark.slow, pytest.mark.sglang_real, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("launch_matrix.py")
README = REPO / "patches" / "ddtree_temperature" / "README.md"
BEGIN, END = "<!-- launch-matrix:begin -->", "<!-- launch-matrix:end -->"
VERSION = "0.5.23"


@dataclass(frozen=True)
class Machine:
    """A GPU as its device query answers: name, compute capability, total memory (MiB, as
    nvidia-smi reports it) and the ``sm_XY`` the toolkit's probe reads."""

    name: str
    capability: tuple[int, int]
    memory_mib: int

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


MACHINES = {
    "H100": Machine("NVIDIA H100 80GB HBM3", (9, 0), 81559),
    "B200": Machine("NVIDIA B200", (10, 0), 183359),
    "B300": Machine("NVIDIA B300 SXM6 AC", (10, 3), 275040),
    "RTX PRO 6000": Machine("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", (12, 0), 97887),
}


@dataclass(frozen=True)
class Launch:
    """One launch before a GPU is chosen: its run, the operator's extra args, and whether
    the toolkit computes it by itself (a sweep's or a tuned policy's: it must serve)."""

    label: str
    run: RunConfig
    extra: tuple[str, ...] = ()
    topk_max: int | None = None
    computed: bool = True


def _policy(entries: list[tuple[int, int, int]]) -> Policy:
    """A tuned policy as ``tune`` builds it: (batch size, budget, top-k) per entry."""
    return Policy(
        machine="matrix", temperature=0.0, cuda_graph=True, hosts=("h",),
        entries=tuple(PolicyEntry(concurrency=c, budget=b, topk=k, output_tok_s=1.0, output_tok_s_mad=0.0, n=1,
                                  accept_length=None, speedup_vs_ar=None, runner_up=None, note=None)
                      for c, b, k in entries),
    )


def _launches(files: Path) -> list[Launch]:
    out: dict[tuple[Any, ...], Launch] = {}

    def add(launch: Launch) -> None:
        out.setdefault((launch.run, launch.extra), launch)

    def write(name: str, content: bytes) -> str:
        path = files / name
        path.write_bytes(content)
        return str(path)

    for sweep in sorted((REPO / "bench_configs").glob("*.yaml")):
        spec = load_sweep(sweep)
        for relaunch in ("never", "always"):
            for group in plan_sweep(spec, relaunch=relaunch).groups:
                launch: LaunchConfig = group.launch
                label = f"{sweep.name} {launch.key}"
                if not launch.live:
                    add(Launch(label, run_config(launch)))
                    continue
                # With the fallbacks the B300 is known for: every budget above 8 eager.
                for eager in ((), tuple(b for b in launch.budgets if b > 8)):
                    name, content = states_file(launch, eager_budgets=eager)
                    add(Launch(label + (" eager_budgets" if eager else ""),
                               run_config(launch, adaptive_config=write(name, content)), topk_max=launch.topk_max))
    # `ddtree-ops restart --algorithm ddtree --budget B --topk K` (also what `selftest --e2e`
    # and the rollout's canary launch): every top-k the toolkit accepts, at a small and the
    # largest budget.
    for k in range(1, 9):
        for budget in (16, 256):
            add(Launch(f"restart DDTREE budget {budget} top-k {k}", RunConfig("DDTREE", budget=budget, topk=k)))
    for k in range(1, 9):
        for entries, eager in (([(1, 16, k)], ()), ([(1, 16, k), (8, 8, 8), (32, 4, 2)], ()),
                               ([(1, 8, k), (8, 32, 8), (32, 64, 2)], (32, 64))):
            policy = _policy(entries)
            path = write(f"policy-{len(entries)}-{k}-{len(eager)}.json", policy.render(eager).encode())
            label = f"tuned policy launch top-k {k}, states {list(policy.budgets)} top-k to {policy.topk_max}"
            add(Launch(label + (f" eager_budgets {list(eager)}" if eager else ""),
                       RunConfig("DDTREE", budget=policy.launch.budget, topk=k, adaptive_config=path),
                       topk_max=policy.topk_max))
    # What an operator may add (inventory extra_args, restart --extra-arg): not computed by
    # the toolkit, so it may be refused, but never only at start.
    mixed = _policy([(1, 16, 1), (8, 8, 8)])
    mixed_path = write("policy-operator.json", mixed.render().encode())
    variants: list[tuple[str, tuple[str, ...]]] = [
        (f"--attention-backend {b}", ("--attention-backend", b))
        for b in ("fa3", "flashinfer", "triton", "trtllm_mha", "fa4", "flex_attention")
    ] + [
        ("--page-size 16", ("--page-size", "16")),
        ("--cuda-graph-max-bs-decode 64", ("--cuda-graph-max-bs-decode", "64")),
        ("--speculative-attention-mode decode --decode-attention-backend trtllm_mha",
         ("--speculative-attention-mode", "decode", "--decode-attention-backend", "trtllm_mha")),
        # A backend in the phase that does not verify: SGLang's page-size rules still apply.
        ("--prefill-attention-backend flashinfer --decode-attention-backend trtllm_mha",
         ("--prefill-attention-backend", "flashinfer", "--decode-attention-backend", "trtllm_mha")),
        ("--prefill-attention-backend flashinfer --decode-attention-backend fa4",
         ("--prefill-attention-backend", "flashinfer", "--decode-attention-backend", "fa4")),
        ("--speculative-draft-attention-backend trtllm_mha", ("--speculative-draft-attention-backend", "trtllm_mha")),
    ]
    for what, extra in variants:
        for run, topk_max in ((RunConfig("DDTREE", budget=16, topk=1), None),
                              (RunConfig("DDTREE", budget=16, topk=4), None),
                              (RunConfig("DDTREE", budget=16, topk=1, adaptive_config=mixed_path), 8)):
            add(Launch(f"operator {what}: {run.describe()}", run, extra, topk_max, computed=False))
    return list(out.values())


def _host(models: dict[str, Path], extra: tuple[str, ...] = ()) -> Host:
    server = ServerSettings(model_path=str(models["target"]), draft_model_path=str(models["draft"]), port=30000,
                            extra_args=("--tp-size", "1", *extra))
    return Host(name="matrix", connection="local", ddtree=DdtreeSettings(python="python", server=server),
                source="<matrix>")


@dataclass(frozen=True)
class Case:
    launch: Launch
    machine: str
    cuda_graph: bool
    argv: tuple[str, ...]
    toolkit: str | None  # the toolkit's refusal; None: it launches
    result: dict[str, Any]

    @property
    def name(self) -> str:
        return f"{self.machine}: {self.launch.label}{'' if self.cuda_graph else ' (eager)'}"


@pytest.fixture(scope="module")
def matrix(ddtree_python: Path, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[Case]:
    work = tmp_path_factory.mktemp("launch-matrix")
    # The drafters the sweeps are written for have a block of 16 (their DFlash baselines
    # run chains up to 16): the tiny draft's config with that block (resolution reads
    # config.json only).
    draft = work / "draft-b16"
    draft.mkdir()
    config = json.loads((tiny_models["draft"] / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {"block_size": 16}))
    shutil.copy(tiny_models["draft"] / "model.safetensors", draft / "model.safetensors")
    models = {"target": tiny_models["target"], "draft": draft}
    files = work / "files"
    files.mkdir()
    pending: list[tuple[Launch, str, bool, tuple[str, ...], str | None]] = []
    for launch in _launches(files):
        for cuda_graph in (True, False):
            plain = build_launch_spec(_host(models), launch.run, VERSION, cuda_graph=cuda_graph).server_args
            argv = (*plain, *launch.extra)
            for name, machine in MACHINES.items():
                refusal = ddtree_launch_refusal(argv, gpu_arch=machine.arch, topk_max=launch.topk_max)
                # The check restart makes: build_launch_spec with the probed arch refuses the same.
                try:
                    build_launch_spec(_host(models, launch.extra), launch.run, VERSION, cuda_graph=cuda_graph,
                                      gpu_arch=machine.arch, topk_max=launch.topk_max)
                    built = None
                except ConfigError as exc:
                    built = exc.message
                assert built == refusal, (name, launch.label, built, refusal)
                pending.append((launch, name, cuda_graph, argv, refusal))
    spec = {
        "machines": {n: {"name": m.name, "capability": list(m.capability), "memory_mib": m.memory_mib}
                     for n, m in MACHINES.items()},
        "cases": [{"machine": name, "argv": list(argv)} for _, name, _, argv, _ in pending],
    }
    (work / "cases.json").write_text(json.dumps(spec))
    env = {k: v for k, v in server_env().items() if k not in ("SGLANG_USE_CPU_ENGINE", "SGLANG_NATIVE_MOVE_KV_CACHE")}
    proc = subprocess.run(
        [str(ddtree_python), str(SCRIPT), str(work / "cases.json")], capture_output=True, text=True, timeout=600,
        cwd=work, env={**env, **coverage_env(now=True), "SGLANG_PLUGINS": "ddtree", "HOME": str(work),
                       "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return [Case(launch, name, cg, argv, refusal, result)
            for (launch, name, cg, argv, refusal), result in zip(pending, results, strict=True)]


def test_every_launch_the_toolkit_computes_serves_on_every_gpu(matrix: list[Case]) -> None:
    computed = [c for c in matrix if c.launch.computed]
    assert len({c.launch.label for c in computed}) > 60 and {c.machine for c in computed} == set(MACHINES)
    refused = [f"{c.name}: {c.result.get('message')}" for c in computed if not c.result["ok"]]
    assert refused == []
    # ... each on the backend it was resolved to: a tree on one that reads the tree mask.
    for c in computed:
        if "DDTREE" in c.argv:
            assert c.result["verify_backend"] in ("fa3", "flashinfer", "triton"), c.name
            assert c.result["decode_graphs"] == ("full" if c.cuda_graph else "disabled"), c.name


def test_the_toolkit_refuses_exactly_what_sglang_with_the_bundle_refuses(matrix: list[Case]) -> None:
    disagree = [f"{c.name}: toolkit {c.toolkit!r}, SGLang {c.result.get('message', 'serves')!r}"
                for c in matrix if (c.toolkit is None) != c.result["ok"]]
    assert disagree == []
    refused = [c for c in matrix if not c.result["ok"]]
    assert len(refused) > 20  # the operator variants the bundle refuses, on several GPUs
    for c in refused:
        # The launcher's last line: the bundle's own refusal (SGLang's own for flex_attention,
        # which refuses every speculative algorithm), one line.
        assert c.result["type"] == ("AssertionError" if "flex_attention" in c.argv else "DDTreeError"), c.result
        assert "\n" not in c.result["message"] and "\n" not in (c.toolkit or ""), c.name


def test_top_k_1_on_b200_and_b300_verifies_on_flashinfer(matrix: list[Case]) -> None:
    # N2: 0.5.23 resolves an MHA target at top-k 1 on sm_100/sm_103 to trtllm_mha (no custom
    # mask): without the bundle's default-backend hook every such launch was refused.
    ones = [c for c in matrix if c.machine in ("B200", "B300") and c.launch.computed and not c.launch.extra
            and "DDTREE" in c.argv and c.argv[c.argv.index("--speculative-eagle-topk") + 1] == "1"]
    assert len(ones) >= 16
    assert {c.result["verify_backend"] for c in ones} == {"flashinfer"}
    # The DFlash baselines keep SGLang's own choice there.
    dflash = [c for c in matrix if c.machine == "B300" and "DFLASH" in c.argv]
    assert dflash and {c.result["verify_backend"] for c in dflash} == {"trtllm_mha"}


# (row label, with decode CUDA graphs?, predicate on a case) for the README's table, in order.
ROWS: tuple[tuple[str, bool, Any], ...] = (
    ("AR", True, lambda c: "--speculative-algorithm" not in c.argv),
    ("DFLASH chain of 16 (the sweeps' baseline)", True,
     lambda c: "DFLASH" in c.argv and c.argv[c.argv.index("--speculative-num-draft-tokens") + 1] == "16"),
    ("DDTREE budget 16, top-k 1", True, lambda c: c.launch.run == RunConfig("DDTREE", budget=16, topk=1)),
    ("DDTREE budget 16, top-k 1, eager", False, lambda c: c.launch.run == RunConfig("DDTREE", budget=16, topk=1)),
    ("DDTREE budget 16, top-k 4", True, lambda c: c.launch.run == RunConfig("DDTREE", budget=16, topk=4)),
    ("DDTREE budget 256, top-k 8", True, lambda c: c.launch.run == RunConfig("DDTREE", budget=256, topk=8)),
    ("DDTREE live states 4-64, top-k 2-8 (budgets.yaml)", True,
     lambda c: c.launch.label == "budgets.yaml ddtree-states-b4,8,12,16,24,32,48,64-topk8"),
    ("DDTREE tuned policy, launch top-k 1, states top-k to 8", True,
     lambda c: c.launch.label == "tuned policy launch top-k 1, states [4, 8, 16] top-k to 8"),
)


def _cell(c: Case) -> str:
    r = c.result
    if not r["ok"]:
        return f"refused: {r['message'][:60]}"
    graphs = f"{r['decode_graphs']} (max bs {r['graph_max_bs']})" if c.cuda_graph else r["decode_graphs"]
    running = r["max_running_requests"] if r["max_running_requests"] is not None else "memory-sized"
    return f"{r['verify_backend']} | {r['draft_backend'] or '—'} | {graphs} | {running}"


def render_table(matrix: list[Case]) -> str:
    lines = [
        "| GPU (arch, memory) | launch | verify attention | draft attention | decode CUDA graphs | "
        "max running requests |",
        "|---|---|---|---|---|---:|",
    ]
    for name, machine in MACHINES.items():
        gpu = f"{name} ({machine.arch}, {machine.memory_mib // 1024} GiB)"
        for label, graphs, pick in ROWS:
            found = [c for c in matrix
                     if c.machine == name and c.cuda_graph == graphs and not c.launch.extra and pick(c)]
            assert found, (name, label)
            cells = sorted({_cell(c) for c in found})
            assert len(cells) == 1, (name, label, cells)
            lines.append(f"| {gpu} | {label} | {cells[0]} |")
    return "\n".join(lines)


def test_the_readme_table_is_what_resolution_says(matrix: list[Case]) -> None:
    table = render_table(matrix) + "\n"
    text = README.read_text()
    match = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    assert match, f"{README} has no {BEGIN} ... {END} block"
    if os.environ.get("DDTREE_LAUNCH_MATRIX_WRITE") == "1":
        README.write_text(text[:match.start(1)] + table + text[match.end(1):])
        return
    assert match.group(1) == table, f"the README's launch table is stale; the resolution says:\n{table}"
