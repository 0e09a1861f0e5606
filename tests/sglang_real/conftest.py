"""Session fixtures for tests against the REAL SGLang 0.5.23 server on CPU.

The venv comes from ``python3 tests/sglang_real/setup_env.py`` (the Makefile builds it);
without it every test here is skipped with that reason. Each server configuration starts
once per session (:class:`~sglang_real.server.ServerPool`); its log is in the session's tmp
dir and its tail is part of every start/request error.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddtree_ops.inventory_types import DdtreeSettings, Host
from ddtree_ops.patching import deploy, load_bundle
from ddtree_ops.transport.local import LocalTransport

from . import models, setup_env
from .prefix import make_prefix
from .server import Output, ServerPool, is_built

BUNDLE = Path(__file__).resolve().parents[2] / "patches" / "ddtree_temperature"
# Tokens every greedy DDTREE comparison generates (the references hold 16 more).
NEW_TOKENS = 24

DRAFT_BLOCK_SIZE = 8


# SGLang 0.5.23's per-server load-snapshot files (managers/load_snapshot.py, shm_path_for):
# a server ended by a signal never unlinks its own (utils/stale_shm_cleanup.py says so and
# sweeps them only in SGLang's CI), so every lane left a few behind in the machine's
# /dev/shm. The controller process removes those that appeared during its session, once
# every worker and its servers are gone; the names are random per server, so one that
# existed before (another session's) is never touched.
_SHM = Path("/dev/shm")
_SHM_PATTERN = "sglang_loads_*.shm"
_SHM_BEFORE = pytest.StashKey[set[str]]()


def _is_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sglang_real: starts the real SGLang server on CPU (.cache/sglang-cpu)")
    if _is_controller(config):
        config.stash[_SHM_BEFORE] = {p.name for p in _SHM.glob(_SHM_PATTERN)}


def pytest_unconfigure(config: pytest.Config) -> None:
    before = config.stash.get(_SHM_BEFORE, None)
    if before is None or not _is_controller(config):
        return
    for leftover in _SHM.glob(_SHM_PATTERN):
        if leftover.name not in before:
            leftover.unlink(missing_ok=True)



# How the lane shares its workers (`make real-server-lane`: three xdist workers on two
# cores, ``--no-loadscope-reorder``; the figures below were measured with two). A worker
# is its own session with its own ServerPool, so each module is one unit (its
# module-scoped servers start once), and the two modules that share the target alone run
# as one unit, the smoke first while that server is up. The
# units go out longest first, the free worker taking the next; measured per unit with two
# workers busy (server starts included): the tree unit 728 s, pipeline 249 s, sampling
# 200 s, selftest --e2e 200 s, triton 161 s (it started the target alone again, for
# reference outputs the tree unit's worker now hands over: ``reference_outputs``), the
# rest under 50 s each; the workers ended at 789 s and 848 s. With loadscope's order (most
# tests first) one worker ran test_ddtree_real alone and then idled 220 s while the other
# ran everything else, the longest single tests last (lane 880 s against 858 s now: the
# lane is CPU-bound, so the balance gains little).
LANE_UNITS = (
    ("tree", ("test_real_server_smoke", "test_ddtree_real", "test_ddtree_runtime")),
    ("pipeline", ("test_pipeline_real",)),
    ("sampling", ("test_ddtree_sampling",)),
    ("trace", ("test_ddtree_trace",)),
    ("selftest-e2e", ("test_selftest_e2e",)),
    ("triton", ("test_ddtree_triton",)),
    # The launch matrix (~880 resolutions, ~40 s) shares the in-process checks' prefix.
    ("inprocess", ("test_ddtree_inprocess", "test_launch_matrix")),
    ("kernels", ("test_standin_kernels",)),
)
_UNIT_OF = {module: name for name, modules in LANE_UNITS for module in modules}


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The lane's tests in LANE_UNITS order (the order the units go out in)."""
    here = Path(__file__).resolve().parent
    rank = {module: (i, j) for i, (_, modules) in enumerate(LANE_UNITS) for j, module in enumerate(modules)}
    at = [i for i, item in enumerate(items) if item.path.parent == here]
    lane = sorted((items[i] for i in at), key=lambda item: rank.get(item.path.stem, (len(rank), 0)))  # stable
    for i, item in zip(at, lane, strict=True):
        items[i] = item


# xdist's loadgroup marks do not group under pytest 9 (xdist 3.8 renames ``item._nodeid``,
# which pytest 9's ``nodeid`` no longer reads), so the units are xdist scopes instead.
@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class LaneUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            return _UNIT_OF.get(module, module)

    return LaneUnits(config, log)


@pytest.fixture(scope="session")
def sglang_cpu_env() -> Path:
    """The built venv's python; skip when it is not built, fail when it is stale."""
    if not is_built():
        pytest.skip(
            f"{setup_env.CACHE} is not built: run `python3 tests/sglang_real/setup_env.py` "
            "(real SGLang 0.5.23 on CPU, ~7 GB, a few minutes)"
        )
    stamp = json.loads((setup_env.CACHE / "stamp.json").read_text())
    if stamp != setup_env.digests():
        pytest.fail(
            f"{setup_env.CACHE} is stale (requirements, setup script or stand-ins changed): "
            "rerun `python3 tests/sglang_real/setup_env.py`"
        )
    return setup_env.venv_python()


@pytest.fixture(scope="session")
def tiny_models(sglang_cpu_env: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"target": dir, "draft": dir}``: the tiny Qwen3 target and its DFlash draft (block 8)."""
    return models.write_pair(tmp_path_factory.mktemp("sglang-real-models"), block_size=DRAFT_BLOCK_SIZE)


@pytest.fixture(scope="session")
def real_servers(sglang_cpu_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    pool = ServerPool(tmp_path_factory.mktemp("sglang-real-logs"))
    try:
        yield pool
    finally:
        pool.close()


# Function-scoped on purpose: ``get`` is free while the server runs, and restarts it if the
# pool had to stop it to make room for another configuration.
@pytest.fixture
def baseline_server(real_servers: ServerPool, tiny_models: dict[str, Path]):
    """The target alone (no speculation)."""
    return real_servers.get("baseline", tiny_models["target"])


@pytest.fixture
def dflash_server(real_servers: ServerPool, tiny_models: dict[str, Path]):
    """The target with ``--speculative-algorithm DFLASH`` and the tiny draft."""
    return real_servers.get(
        "dflash",
        tiny_models["target"],
        ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(tiny_models["draft"])],
    )


@pytest.fixture(scope="session")
def ddtree_python(sglang_cpu_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prefix with the real SGLang 0.5.23 and the DDTree bundle deployed by ddtree-ops."""
    python = make_prefix(tmp_path_factory.mktemp("ddtree-prefix") / "prefix")
    host = Host(name="cpu-ddtree", connection="local", ddtree=DdtreeSettings(python=str(python)), source="<test>")
    with LocalTransport(host.name) as t:
        outcome = deploy(t, host, load_bundle(BUNDLE))
    assert outcome.outcome == "applied", outcome
    return python


def _model_digest(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(model_dir.rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(model_dir).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def reference_outputs(real_servers, tiny_models, tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> list:
    """The target alone: the outputs every DDTREE server must reproduce.

    Run once per lane, not once per worker: the first worker to need them runs the
    target alone and writes them beside the workers' temp dirs; the other reads them
    (the lane's second worker otherwise started the target alone again, ~55 s of two
    busy cores, for these outputs only). They are keyed by the target's bytes and the
    request, so a worker whose model or prompts differ computes its own."""
    from .test_real_server_smoke import PROMPTS, TOP_LOGPROBS

    def generate() -> list:
        baseline = real_servers.get("baseline", tiny_models["target"])
        baseline.flush_cache()
        return baseline.generate(PROMPTS, max_new_tokens=NEW_TOKENS + 16, top_logprobs=TOP_LOGPROBS)

    if worker_id == "master":  # one process: nothing to share
        return generate()
    key = hashlib.sha256(
        json.dumps([_model_digest(tiny_models["target"]), PROMPTS, NEW_TOKENS + 16, TOP_LOGPROBS]).encode()
    ).hexdigest()[:16]
    shared = tmp_path_factory.getbasetemp().parent / f"reference-outputs-{key}.json"
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits rather than starting a second server
        if shared.exists():
            return [Output(**o) for o in json.loads(shared.read_text())]
        outputs = generate()
        shared.write_text(json.dumps([dataclasses.asdict(o) for o in outputs]))
        return outputs


@pytest.fixture(scope="session")
def oracle_file(reference_outputs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's own greedy continuation per prompt, for the oracle drafter probe."""
    from .test_real_server_smoke import PROMPTS

    path = tmp_path_factory.mktemp("oracle") / "oracle.json"
    path.write_text(
        json.dumps({",".join(map(str, p)): o.output_ids for p, o in zip(PROMPTS, reference_outputs, strict=True)})
    )
    return path
