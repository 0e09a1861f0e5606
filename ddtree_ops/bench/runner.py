"""Run a planned sweep on every target host and append one ledger row per (host, cell, repeat).

Hosts run in parallel, one worker thread per host, and within a host one per server
place: the host itself, or each of its GPU slots (``ddtree.server.slots``), each with its
own server. A host's cells are grouped by server configuration into launches, so a server
is restarted only when algorithm/budget/top-k change (through the lifecycle's
``restart``, which also decides eager fallback; every row records ``cuda_graph`` and
``fallback_reason``); with one server they run in plan order, with several slots each
slot takes the next launch when it frees, longest expected first (:mod:`.schedule`).

Failures are rows, not exceptions: a host that cannot be reached, a server that crashes
or never gets ready, a server killed mid-cell — each is written as ``status: failed`` with
its error on the affected rows, and the other hosts carry on. After a cell with failed
requests the server is checked and restarted before the next cell if it is gone.
``fail_fast`` stops every host after its current row at the first failed row.

Interruption (Ctrl-C in the CLI sets ``cancel``): each worker finishes the row it is
measuring, writes it, stops the server it started and returns. ``resume`` skips runs whose
ledger key (host, configuration, workload hash, repeat) already has an ``ok`` row; it
refuses a ledger of another sweep (rows carry ``sweep_hash``) and cuts off a truncated
last line first (:meth:`SweepRunner.prepare`, before any host is touched).

Where the load comes from (:mod:`.onhost`): with ``client: host`` (the default when the
server binds loopback) the client runs on the GPU host over the host's transport and
streams each request's record back as it finishes; with ``client: local`` it runs here
and connects to the host's inventory address (``127.0.0.1`` for local hosts), so the
server must bind an address this machine can reach. No SSH tunnel is opened: a tunnel
would put SSH's own channel scheduling between the client and the server and distort
ITL at high concurrency. Every row records its ``client``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ddtree_ops import lockholder
from ddtree_ops.bench import ledger
from ddtree_ops.bench.client import LoadSpec
from ddtree_ops.bench.metrics import calculate_metrics
from ddtree_ops.bench.onhost import ClientMode, LoadClient, client_mode, make_client
from ddtree_ops.bench.onhost import server_url as server_url
from ddtree_ops.bench.plan import Cell, ServerConfig, SweepPlan, cell_seconds, plan_sweep
from ddtree_ops.bench.prompts import WorkloadPrompts
from ddtree_ops.bench.schedule import Job, Schedule, Slot, longest_first, make_jobs, plan_runs, schedule
from ddtree_ops.bench.sweep import SweepSpec, sweep_hash
from ddtree_ops.errors import AuthError, ConnectError, DdtreeOpsError, HostKeyError, Interrupted, LeaseHeld
from ddtree_ops.inventory_types import Host
from ddtree_ops.transport.base import Transport

if TYPE_CHECKING:
    from ddtree_ops.service.launch import Algorithm
    from ddtree_ops.service.lifecycle import RestartRequest

LEDGER_ALGORITHM: dict[str, Algorithm] = {"autoregressive": "AR", "dflash": "DFLASH", "ddtree": "DDTREE"}
# Errors after which nothing more can be done on the host in this sweep (LeaseHeld:
# another sweep holds it).
_HOST_LOST = (ConnectError, AuthError, HostKeyError, LeaseHeld)


@dataclass(frozen=True)
class Progress:
    """One event for the progress display: what a host is doing and how far it is."""

    host: str
    done: int
    total: int
    phase: str  # "probing" | "restarting" | "running" | "row" | "finished" | "failed"
    cell: str = ""
    repeat: int = 0
    status: str = ""
    eta_s: float | None = None
    message: str = ""
    # The GPU slot ("host/i") the event is about, on a host with several; "" otherwise.
    slot: str = ""


@dataclass(frozen=True)
class HostSummary:
    host: str
    planned: int
    skipped: int
    ok_rows: int
    failed_rows: int
    restarts: int
    error: str | None = None
    interrupted: bool = False


@dataclass(frozen=True)
class SweepOutcome:
    run_id: str
    ledger: Path
    hosts: tuple[HostSummary, ...]
    bad_ledger_lines: tuple[tuple[int, str], ...] = ()
    # What --resume repaired before running (a truncated last line cut off), to be said once.
    healed: str | None = None

    @property
    def failed(self) -> bool:
        return any(h.failed_rows or h.error for h in self.hosts)

    @property
    def interrupted(self) -> bool:
        return any(h.interrupted for h in self.hosts)


class RestartHook(Protocol):
    """``lifecycle.restart`` as the runner calls it."""

    def __call__(
        self, transport: Transport, request: RestartRequest, *, cancel: threading.Event | None = ...
    ) -> Any: ...


@dataclass(frozen=True)
class Services:
    """The lifecycle and transport functions the runner calls; swapped only by tests that
    need to count calls, never to fake a server."""

    open_transport: Callable[[Host], Transport]
    restart: RestartHook
    stop: Callable[..., Any]
    status: Callable[..., Any]
    probe: Callable[[Transport, Host], Any] | None = None
    patch_status: Callable[[Transport, Host], Any] | None = None
    # The host's sweep lease (manager.take_lease / release_lease); None: no lease taken.
    take_lease: Callable[..., Any] | None = None
    release_lease: Callable[[Transport, Host, str], Any] | None = None


def default_services(*, host_key_policy: str = "strict") -> Services:
    from ddtree_ops.patching.status import host_status
    from ddtree_ops.probe import probe_host
    from ddtree_ops.service import lifecycle, manager
    from ddtree_ops.transport import open_transport

    return Services(
        open_transport=lambda h: open_transport(h, host_key_policy=host_key_policy),
        restart=lifecycle.restart,
        stop=lifecycle.stop,
        status=lifecycle.service_status,
        probe=probe_host,
        patch_status=host_status,
        take_lease=manager.take_lease,
        release_lease=manager.release_lease,
    )


def run_config(server: ServerConfig) -> Any:
    from ddtree_ops.service.launch import RunConfig

    algo = LEDGER_ALGORITHM[server.algorithm]
    return RunConfig(algorithm=algo, budget=server.budget, topk=server.topk)


def _smoke_status(restart: Any) -> str | None:
    """The ledger's ``smoke``: None where no server started, else passed or skipped."""
    if restart is None:
        return None
    result = getattr(restart, "smoke", None)
    return "passed" if result is not None and result.passed else "skipped"


def _now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class _Provenance:
    gpu_name: str | None = None
    gpu_arch: str | None = None
    gpu_count: int | None = None
    driver: str | None = None
    # The SGLang installed on the host (probed); launch commands are built for it.
    sglang_version: str | None = None
    # What the serving process says it is (``/server_info.version``), once it runs.
    serving_version: str | None = None
    bundle_name: str | None = None
    bundle_hash: str | None = None
    facts: Any = None
    # ``/server_info.ddtree`` of the serving process: what the plugin resolved.
    verify_attention_backend: str | None = None
    verify_cuda_graph: bool | None = None
    draft_block_size: int | None = None
    tree_sampler: str | None = None


def _arch(compute_cap: object) -> str | None:
    # nvidia-smi's "12.0" -> "sm_120", as the ledger spells architectures.
    return f"sm_{str(compute_cap).strip().replace('.', '')}" if compute_cap not in (None, "") else None


def _provenance(transport: Transport, host: Host, services: Services) -> _Provenance:
    """GPU, SGLang version and deployed bundle, best effort: provenance that cannot be
    learned is null on the rows, it does not stop the benchmark."""
    facts = None
    if services.probe is not None:
        try:
            facts = services.probe(transport, host)
        except DdtreeOpsError:
            facts = None
    gpus = tuple(getattr(facts, "gpus", ()) or ())
    gpu = gpus[0] if gpus else None
    arch = _arch(getattr(gpu, "compute_cap", None))
    version = getattr(facts, "sglang_version", None)
    bundle_name = bundle_hash = None
    if services.patch_status is not None:
        try:
            st = services.patch_status(transport, host)
            bundle_name, bundle_hash = st.bundle_name, st.bundle_identity
            version = version or st.package_version
        except DdtreeOpsError:
            pass
    return _Provenance(
        gpu_name=getattr(gpu, "name", None),
        gpu_arch=arch,
        gpu_count=len(gpus) or None,
        driver=getattr(gpu, "driver_version", None),
        sglang_version=version,
        bundle_name=bundle_name,
        bundle_hash=bundle_hash,
        facts=facts,
    )


def _with_server_info(prov: _Provenance, info: Mapping[str, Any] | None) -> _Provenance:
    """Host provenance completed by what the launched server says about itself.

    ``version`` is the serving process's own version: the one the measurements belong to,
    even where it differs from the installed package (the simulator says ``0.5.23-sim``
    while serving from a prefix holding SGLang 0.5.23). ``simulated_gpu`` exists only on
    the simulator; it names the GPU only where the host probe found none, so a real
    ``nvidia-smi`` always wins and real SGLang (which has no such field) changes nothing.
    Malformed values are ignored: provenance never fails a sweep. The tree fields belong
    to one launch: a server that does not answer leaves them None, not the last one's.
    """
    if not info:
        return dataclasses.replace(prov, **_tree_provenance(None))
    changes: dict[str, Any] = {}
    version = info.get("version")
    if isinstance(version, str) and version.strip():
        changes["serving_version"] = version.strip()
    sim = info.get("simulated_gpu")
    if isinstance(sim, Mapping) and prov.gpu_name is None and prov.gpu_count is None:
        name = sim.get("name")
        if isinstance(name, str) and name.strip():
            name = name.strip()
            # The field says simulated; the row must never pass for real hardware.
            changes["gpu_name"] = name if name.endswith("(simulated)") else f"{name} (simulated)"
            cap = sim.get("compute_cap")
            changes["gpu_arch"] = _arch(cap) if isinstance(cap, (str, int, float)) else None
            count = sim.get("count")
            changes["gpu_count"] = (
                count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None
            )
    changes.update(_tree_provenance(info.get("ddtree")))
    return dataclasses.replace(prov, **changes)


def _tree_provenance(tree: object) -> dict[str, Any]:
    """The DDTree plugin's ``/server_info.ddtree`` fields a row keeps. Every launch reads
    them afresh: an AR or DFLASH server has no such object, and its rows say None."""
    out: dict[str, Any] = dict.fromkeys(
        ("verify_attention_backend", "verify_cuda_graph", "draft_block_size", "tree_sampler")
    )
    if not isinstance(tree, Mapping):
        return out
    for key, name in (("verify_attention_backend", "verify_attention_backend"), ("sampler", "tree_sampler")):
        value = tree.get(key)
        if isinstance(value, str) and value.strip():
            out[name] = value.strip()
    captured = tree.get("verify_cuda_graph_captured")
    if isinstance(captured, bool):
        out["verify_cuda_graph"] = captured
    block = tree.get("draft_block_size")
    if isinstance(block, int) and not isinstance(block, bool) and block > 0:
        out["draft_block_size"] = block
    return out


def expected_launch_s(host: Host) -> float:
    """What one server launch on ``host`` costs a sweep: its last whole restart (stopping
    the old server, load, capture, smoke; the state file), else its last load, else the
    inventory's ``expected_load_s``."""
    from ddtree_ops.state import StateStore

    state, model = StateStore(), host.ddtree.server.model_path or ""
    for learned in (state.learned_restart_s(host.name, model), state.learned_load_s(host.name, model)):
        if learned is not None:
            return learned
    return host.ddtree.server.expected_load_s


def expected_schedule(spec: SweepSpec, plan: SweepPlan, host: Host) -> Schedule:
    """Which of ``host``'s server places (its GPU slots, or the host itself) is expected to
    run which launch, and when: what ``bench --dry-run`` shows and the runner's queue
    follows (per launch: :func:`expected_launch_s`; measuring: :func:`cell_seconds`)."""
    slots = host.slot_hosts()

    def cell_s(cell: Cell) -> float:
        return cell_seconds(cell, num_prompts=spec.workload.num_prompts, max_new_tokens=spec.workload.max_new_tokens,
                            warmup=plan.warmup)

    loads = {Slot(host.name, i, s.slot.gpus if s.slot else ()): expected_launch_s(s) for i, s in enumerate(slots)}
    jobs = make_jobs(plan_runs(plan), cell_s=cell_s, load_s=min(loads.values()), slots=len(slots))
    return schedule(jobs, list(loads), load_s=loads)


def _for_slot(prov: _Provenance, host: Host) -> _Provenance:
    """A slot's rows count the GPUs its server sees, not the machine's. (No GPU probed: the
    server's own report fills it in, see :func:`_with_server_info`.)"""
    if host.slot is None or prov.gpu_count is None:
        return prov
    return dataclasses.replace(prov, gpu_count=len(host.slot.gpus))


@dataclass
class _Shared:
    cancel: threading.Event
    stop_all: threading.Event
    on_progress: Callable[[Progress], None]


@dataclass
class _HostRun:
    """Mutable bookkeeping of one host's workers (one per GPU slot; counters under ``lock``)."""

    host: Host
    pending: list[tuple[Cell, int]]
    planned: int
    skipped: int
    done: int = 0
    ok_rows: int = 0
    failed_rows: int = 0
    restarts: int = 0
    started: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def eta(self) -> float | None:
        if not self.done:
            return None
        per = (time.monotonic() - self.started) / self.done
        return per * (len(self.pending) - self.done)


@dataclass
class _SlotRun:
    """One server place of a host: the host itself, or one of its GPU slots (a slot host
    with its own port, run dir, lease and load client)."""

    hr: _HostRun
    host: Host
    lease: str | None = None  # the token of this sweep's lease on the slot, once taken

    @property
    def label(self) -> str:
        return self.host.name if self.host.slot is not None else ""


class _JobQueue:
    """A host's server launches still to run, shared by its slots: each slot takes the
    next when it frees (longest expected first, see :mod:`.schedule`), preferring one of
    the configuration it already serves, which needs no restart."""

    def __init__(self, jobs: Sequence[Job]) -> None:
        self._jobs = list(jobs)
        self._lock = threading.Lock()

    def take(self, serving: ServerConfig | None) -> Job | None:
        with self._lock:
            if not self._jobs:
                return None
            at = next((i for i, j in enumerate(self._jobs) if j.server == serving), 0)
            return self._jobs.pop(at)

    def drain(self) -> list[Job]:
        with self._lock:
            left, self._jobs = self._jobs, []
            return left


class SweepRunner:
    """Carries out one sweep. Build it, then :meth:`run` (blocking; threads inside)."""

    def __init__(
        self,
        spec: SweepSpec,
        hosts: Sequence[Host],
        workload: WorkloadPrompts,
        *,
        ledger_path: Path,
        resume: bool = False,
        fail_fast: bool = False,
        keep_server: bool = False,
        restart_timeout: float | None = None,
        smoke: bool = True,
        services: Services | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        cancel: threading.Event | None = None,
        run_id: str | None = None,
    ) -> None:
        self.spec = spec
        self.hosts = tuple(hosts)
        self.workload = workload
        self.ledger_path = Path(ledger_path)
        self.resume = resume
        self.fail_fast = fail_fast
        self.keep_server = keep_server
        self.restart_timeout = restart_timeout
        self.smoke = smoke
        self.services = services or default_services()
        self.shared = _Shared(
            cancel=cancel or threading.Event(), stop_all=threading.Event(), on_progress=on_progress or (lambda _p: None)
        )
        self.run_id = run_id or f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"
        self.sweep_hash = sweep_hash(spec)
        self.bad_lines: tuple[tuple[int, str], ...] = ()
        self.healed: str | None = None
        self._done: set[str] | None = None

    # -- planning ---------------------------------------------------------------------

    def key_fields(self, host: str, cell: Cell, repeat: int) -> dict[str, Any]:
        """The ledger's identity fields of one run (see ``ledger.KEY_FIELDS``)."""
        return {
            "host": host,
            "algorithm": LEDGER_ALGORITHM[cell.server.algorithm],
            "budget": cell.server.budget,
            "topk": cell.server.topk,
            "temperature": cell.sampling.temperature,
            "top_p": cell.sampling.top_p,
            "top_k": cell.sampling.top_k,
            "concurrency": cell.concurrency,
            "request_rate": self.spec.request_rate,
            "workload_hash": self.workload.workload_hash,
            "repeat": repeat,
        }

    def pending_runs(self, host: str, plan: SweepPlan, done: set[str]) -> list[tuple[Cell, int]]:
        return [
            (cell, r)
            for cell in plan.cells
            for r in range(plan.repeats)
            if ledger.row_key(self.key_fields(host, cell, r)) not in done
        ]

    def prepare(self) -> None:
        """Check the ledger before any host is touched (idempotent; :meth:`run` calls it).

        The ledger must be writable (ConfigError naming it). With ``resume``, its rows
        must belong to this sweep (same sweep hash; ConfigError naming both sweeps and
        the ledger) and each host's to the client this run uses, and a truncated last
        line left by a crash is cut off, so that new rows never follow it; :attr:`healed`
        says so.
        """
        if self._done is not None:
            return
        ledger.check_writable(self.ledger_path)
        if not self.resume:
            self._done = set()
            return
        read = ledger.read_ledger(self.ledger_path)
        ledger.check_same_sweep(read.rows, sweep=self.spec.name, sweep_hash=self.sweep_hash, path=self.ledger_path)
        modes = {h.name: self.client_mode(h) for h in self.hosts}
        ledger.check_same_client(read.rows, modes, path=self.ledger_path)
        bad = list(read.bad_lines)
        removed = ledger.heal_truncated_tail(self.ledger_path)
        if removed:
            lineno = bad.pop()[0] if bad and bad[-1][1].startswith("truncated") else None
            where = f"{self.ledger_path}:{lineno}" if lineno is not None else str(self.ledger_path)
            self.healed = f"{where}: removed a truncated last line ({removed} bytes; a writer stopped mid-line)"
        self.bad_lines = tuple(bad)
        self._done = ledger.completed_keys(read.rows)

    def done_keys(self) -> set[str]:
        self.prepare()
        return self._done or set()

    # -- running ----------------------------------------------------------------------

    def run(self) -> SweepOutcome:
        plan = plan_sweep(self.spec)
        done = self.done_keys()
        runs = []
        for host in self.hosts:
            pending = self.pending_runs(host.name, plan, done)
            runs.append(_HostRun(host, pending, planned=plan.runs, skipped=plan.runs - len(pending)))
        with ThreadPoolExecutor(max_workers=max(1, len(runs)), thread_name_prefix="bench") as pool:
            summaries = list(pool.map(self._run_host, runs))
        return SweepOutcome(self.run_id, self.ledger_path, tuple(summaries), self.bad_lines, self.healed)

    def _emit(self, hr: _HostRun, phase: str, *, slot: str = "", **kw: Any) -> None:
        self.shared.on_progress(
            Progress(host=hr.host.name, done=hr.done, total=len(hr.pending), phase=phase, eta_s=hr.eta(), slot=slot,
                     **kw)
        )

    def _stopping(self) -> bool:
        return self.shared.cancel.is_set() or self.shared.stop_all.is_set()

    def _jobs(self, hr: _HostRun, slots: Sequence[Host]) -> list[Job]:
        """The host's pending runs as server launches. One server: in plan order (the
        configuration already running first). Several slots: repeats split where a slot
        would idle, longest expected first."""
        if len(slots) == 1:
            return make_jobs(hr.pending, cell_s=lambda _c: 0.0, load_s=0.0, slots=1)

        def cell_s(cell: Cell) -> float:
            return cell_seconds(
                cell, num_prompts=len(self.workload.prompts), max_new_tokens=self.workload.max_new_tokens,
                warmup=self.spec.warmup,
            )

        load_s = min(expected_launch_s(slot) for slot in slots)
        return longest_first(make_jobs(hr.pending, cell_s=cell_s, load_s=load_s, slots=len(slots)))

    def _run_host(self, hr: _HostRun) -> HostSummary:
        host = hr.host
        if not hr.pending:
            self._emit(hr, "finished", message="nothing left to run")
            return HostSummary(host.name, hr.planned, hr.skipped, 0, 0, 0)
        slots = host.slot_hosts()
        queue = _JobQueue(self._jobs(hr, slots))
        if len(slots) == 1:
            errors = [self._run_slot(_SlotRun(hr, slots[0]), queue)]
        else:
            with ThreadPoolExecutor(max_workers=len(slots), thread_name_prefix=f"bench-{host.name}") as pool:
                errors = list(pool.map(lambda slot: self._run_slot(_SlotRun(hr, slot), queue), slots))
        found = [e for e in errors if e]
        error = "; ".join(dict.fromkeys(found)) or None
        # Every slot gave up (host lost, lease held): what nobody ran fails with the reason,
        # fail-fast or not — the host's rows must say why they are missing.
        left = queue.drain()
        if left and error is not None and all(errors) and not self.shared.cancel.is_set():
            for job in left:
                self._fail_rest(_SlotRun(hr, host), _Provenance(), None, job.runs, error)
        interrupted = self.shared.cancel.is_set() and hr.done < len(hr.pending)
        self._emit(hr, "failed" if error else "finished", message=error or "")
        return HostSummary(
            host.name, hr.planned, hr.skipped, hr.ok_rows, hr.failed_rows, hr.restarts, error, interrupted
        )

    def _run_slot(self, sr: _SlotRun, queue: _JobQueue) -> str | None:
        """One server place's worker: probe, then launch and measure job after job until
        the queue is empty. Returns why it gave up, or None."""
        error: str | None = None
        started_server = False
        transport: Transport | None = None
        holding: list[tuple[Cell, int]] = []
        try:
            transport = self.services.open_transport(sr.host)
            # The lease before anything else: a host another sweep holds is refused
            # without probing it first (the probe and bundle status cost ~0.13 s per host).
            self._hold(sr, transport)
            self._emit(sr.hr, "probing", slot=sr.label)
            prov = _for_slot(_provenance(transport, sr.host, self.services), sr.host)
            error, started_server = self._run_jobs(sr, transport, prov, queue, holding)
        except DdtreeOpsError as exc:
            # Not even provenance, or a failure past the rows' own handling: the runs in
            # hand fail with the reason; the queue's jobs wait for another slot, or fail
            # at the host's end.
            error = str(exc)
            self._fail_rest(sr, _Provenance(), None, list(holding), error)
        finally:
            if transport is not None:
                if started_server and (self.shared.cancel.is_set() or not self.keep_server):
                    try:
                        self.services.stop(transport, sr.host, lease=self._lease_pass(sr))
                    except DdtreeOpsError:
                        pass  # the host may be the one that went away; its rows say so
                self._release(sr, transport)
                transport.close()
        if error:
            self._emit(sr.hr, "failed", slot=sr.label, message=error)
        return error

    def _run_jobs(
        self, sr: _SlotRun, transport: Transport, prov: _Provenance, queue: _JobQueue,
        holding: list[tuple[Cell, int]],
    ) -> tuple[str | None, bool]:
        """Take jobs from ``queue`` until it is empty: launch each job's server, measure its
        runs. Returns (error that ended this slot, whether a server was started). The runs
        in hand not yet written are kept in ``holding``, for the caller to fail on an
        unexpected error."""
        host = sr.host
        started = False
        client = make_client(self.client_mode(host), transport, host)
        serving: ServerConfig | None = None
        while not self._stopping() and (job := queue.take(serving)) is not None:
            server, runs = job.server, list(job.runs)
            holding[:] = runs
            self._emit(sr.hr, "restarting", slot=sr.label, cell=server.key)
            try:
                restart = self._restart(sr, transport, prov, server, runs)
                started = True
                serving = server
            except _HOST_LOST as exc:
                holding.clear()
                self._fail_rest(sr, prov, None, runs, str(exc))
                return str(exc), started
            except Interrupted:
                return None, started
            except DdtreeOpsError as exc:
                holding.clear()
                self._fail_rest(sr, prov, None, runs, f"server did not start: {exc}")
                serving = None
                continue
            served = self._served(client, prov)
            for cell, rep in runs:
                if self._stopping():
                    return None, started
                row = self._measure(sr, client, served, restart, cell, rep)
                holding.remove((cell, rep))
                if row["status"] == "failed" and not self._serving(transport, host):
                    self._emit(sr.hr, "restarting", slot=sr.label, cell=server.key, message="server gone; restarting")
                    rest = runs[runs.index((cell, rep)) + 1 :]
                    try:
                        restart = self._restart(sr, transport, prov, server, runs)
                    except _HOST_LOST as exc:
                        holding.clear()
                        self._fail_rest(sr, prov, None, rest, str(exc))
                        return str(exc), started
                    except Interrupted:
                        return None, started
                    except DdtreeOpsError as exc:
                        holding.clear()
                        self._fail_rest(sr, prov, None, rest, f"server did not restart: {exc}")
                        serving = None
                        break
                    served = self._served(client, prov)
            holding.clear()
        return None, started

    def _lease_pass(self, sr: _SlotRun) -> Any:
        from ddtree_ops.service.manager import LeasePass

        return LeasePass(token=sr.lease)

    def _hold(self, sr: _SlotRun, transport: Transport) -> None:
        """Take the host's sweep lease when this sweep first reaches it (before probing it),
        so that no other sweep or restart touches the server until :meth:`_release`. Raises LeaseHeld
        at once when another live sweep holds it; a dead holder's lease is taken over."""
        if sr.lease is not None or self.services.take_lease is None:
            return
        token = uuid.uuid4().hex
        holder = lockholder.holder_record(token, "bench") | {"sweep": self.spec.name, "run_id": self.run_id}
        # Marked running first: a lease of this very process is dead only once its run ended.
        lockholder.run_started(token)
        try:
            taken = self.services.take_lease(transport, sr.host, token=token, holder=holder)
        except BaseException:
            lockholder.run_ended(token)
            raise
        sr.lease = token
        if isinstance(taken, dict):
            from ddtree_ops.service.manager import describe_lease

            message = f"took over the lease of dead {describe_lease(taken)}"
            self._emit(sr.hr, "restarting", slot=sr.label, message=message)

    def _release(self, sr: _SlotRun, transport: Transport) -> None:
        """Give the host back at the sweep's end, however it ended; a lease that cannot be
        released (host gone) is provably dead once this run has ended."""
        if sr.lease is None or self.services.release_lease is None:
            return
        try:
            self.services.release_lease(transport, sr.host, sr.lease)
        except DdtreeOpsError:
            pass
        finally:
            lockholder.run_ended(sr.lease)

    def _restart(
        self, sr: _SlotRun, transport: Transport, prov: _Provenance, server: ServerConfig,
        runs: Sequence[tuple[Cell, int]],
    ) -> Any:
        from ddtree_ops.service.lifecycle import LaunchFacts, RestartRequest
        from ddtree_ops.service.smoke import SmokeSampling, SmokeSpec

        self._hold(sr, transport)
        with sr.hr.lock:
            sr.hr.restarts += 1
        facts = LaunchFacts.from_probe(prov.facts) if prov.facts is not None else LaunchFacts(prov.sglang_version)
        # The smoke decodes at the sampling settings this server is about to be measured at.
        smoke = SmokeSpec.for_samplings(
            SmokeSampling.of(c.sampling.temperature, c.sampling.top_p, c.sampling.top_k) for c, _ in runs
        ) if self.smoke else None
        request = RestartRequest(sr.host, run_config(server), facts, timeout=self.restart_timeout, smoke=smoke,
                                 lease=self._lease_pass(sr))
        return self.services.restart(transport, request, cancel=self.shared.cancel)

    def _served(self, client: LoadClient, prov: _Provenance) -> _Provenance:
        """Provenance for the rows of the server just launched: read its ``/server_info``
        once per launch (a new process may be a different build). Unreadable -> the probed
        values stand."""
        return _with_server_info(prov, client.server_info())

    def client_mode(self, host: Host) -> ClientMode:
        """``local`` or ``host``: the sweep's ``client``, else decided by the bind address."""
        return client_mode(host, self.spec.client)

    def _serving(self, transport: Transport, host: Host) -> bool:
        try:
            st = self.services.status(transport, host)
        except DdtreeOpsError:
            return False
        return bool(getattr(st, "running", False)) and getattr(st, "health", None) == 200

    def _measure(
        self, sr: _SlotRun, client: LoadClient, prov: _Provenance, restart: Any, cell: Cell, rep: int
    ) -> dict[str, Any]:
        self._emit(sr.hr, "running", slot=sr.label, cell=cell.key, repeat=rep)
        started_at = _now_iso()
        client.flush_cache()
        finished = [0]

        def on_done(_result: Any) -> None:
            # Records stream in as requests finish (from the host too): show them arriving.
            finished[0] += 1
            self._emit(sr.hr, "running", slot=sr.label, cell=cell.key, repeat=rep,
                       message=f"{finished[0]}/{len(self.workload.prompts)} requests")

        load = client.run_load(
            LoadSpec(
                prompts=self.workload.prompts,
                max_new_tokens=self.workload.max_new_tokens,
                sampling=cell.sampling.as_params(),
                ignore_eos=self.workload.ignore_eos,
                concurrency=cell.concurrency,
                request_rate=self.spec.request_rate,
                warmup=self.spec.warmup,
                seed=self.spec.workload.seed + rep,
                api=self.spec.api,  # type: ignore[arg-type]
                timeout_s=self.spec.request_timeout_s,
            ),
            on_done=on_done,
        )
        metrics = calculate_metrics(load.results, duration_s=load.duration_s)
        error = None
        if metrics.failed:
            error = f"{metrics.failed}/{metrics.requests} requests failed: " + "; ".join(metrics.errors)
        row = self._row(sr, prov, restart, cell, rep, started_at, error=error)
        flat = metrics.flat()
        row.update(
            completed=metrics.completed,
            failed=metrics.failed,
            duration_s=metrics.duration_s,
            output_tok_s=metrics.output_tok_s,
            request_s=metrics.request_s,
            total_input_tokens=metrics.input_tokens,
            total_output_tokens=metrics.output_tokens,
            accept_length=metrics.accept_length,
            verify_ct=metrics.verify_steps or None,
            **{k: v for k, v in flat.items() if k[:3] in ("ttf", "itl", "tpo", "e2e")},
        )
        self._append(sr, row, cell)
        return row

    def _row(
        self, sr: _SlotRun, prov: _Provenance, restart: Any, cell: Cell, rep: int, started_at: str, *, error: str | None
    ) -> dict[str, Any]:
        wl = self.spec.workload
        name = wl.prompt_set or "+".join(p.stem for p in wl.prompt_files)
        row = self.key_fields(sr.hr.host.name, cell, rep)
        row.update(
            run_id=self.run_id,
            sweep=self.spec.name,
            sweep_hash=self.sweep_hash,
            started_at=started_at,
            finished_at=_now_iso(),
            gpu_name=prov.gpu_name,
            gpu_arch=prov.gpu_arch,
            gpu_count=prov.gpu_count,
            driver=prov.driver,
            sglang_version=prov.serving_version or prov.sglang_version,
            sglang_installed_version=prov.sglang_version,
            bundle_name=prov.bundle_name,
            bundle_hash=prov.bundle_hash,
            verify_attention_backend=prov.verify_attention_backend,
            verify_cuda_graph=prov.verify_cuda_graph,
            draft_block_size=prov.draft_block_size,
            tree_sampler=prov.tree_sampler,
            server_argv=list(getattr(restart, "argv", ()) or ()),
            cuda_graph=bool(getattr(restart, "cuda_graph", False)),
            fallback_reason=getattr(restart, "fallback_reason", None),
            smoke=_smoke_status(restart),
            smoke_s=getattr(getattr(restart, "smoke", None), "seconds", None),
            readiness_s=dict(getattr(restart, "phase_durations", {}) or {}),
            workload_name=name,
            workload_num_prompts=len(self.workload.prompts),
            workload_max_new_tokens=self.workload.max_new_tokens,
            workload_ignore_eos=self.workload.ignore_eos,
            workload_seed=wl.seed,
            client=self.client_mode(sr.host),
            slot=sr.host.slot.index if sr.host.slot is not None else None,
            gpu_indices=list(sr.host.slot.gpus) if sr.host.slot is not None else None,
            status="failed" if error else "ok",
            error=error,
        )
        return row

    def _append(self, sr: _SlotRun, row: Mapping[str, Any], cell: Cell) -> None:
        hr = sr.hr
        ledger.append_row(self.ledger_path, row)
        with hr.lock:
            hr.done += 1
            if row["status"] == "ok":
                hr.ok_rows += 1
            else:
                hr.failed_rows += 1
        if row["status"] != "ok" and self.fail_fast:
            self.shared.stop_all.set()
        self._emit(hr, "row", slot=sr.label, cell=cell.key, repeat=int(row["repeat"]), status=str(row["status"]),
                   message=row.get("error") or "")

    def _fail_rest(
        self, sr: _SlotRun, prov: _Provenance, restart: Any, runs: Sequence[tuple[Cell, int]], error: str
    ) -> None:
        for cell, rep in runs:
            self._append(sr, self._row(sr, prov, restart, cell, rep, _now_iso(), error=error), cell)


def run_sweep(
    spec: SweepSpec,
    hosts: Sequence[Host],
    workload: WorkloadPrompts,
    *,
    ledger_path: Path,
    **options: Any,
) -> SweepOutcome:
    """Convenience wrapper: ``SweepRunner(...).run()``."""
    return SweepRunner(spec, hosts, workload, ledger_path=ledger_path, **options).run()
