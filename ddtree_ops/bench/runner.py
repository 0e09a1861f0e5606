"""Run a planned sweep on every target host and append one ledger row per (host, cell, repeat).

Hosts run in parallel, one worker thread per host, and within a host one per server
place: the host itself, or each of its GPU slots (``ddtree.server.slots``), each with its
own server. A host's cells are grouped into launches by what cannot be switched
(:mod:`.plan`), so a server is restarted only when the launch changes (through the
lifecycle's ``restart``, which also decides eager fallback; every row records
``cuda_graph`` and ``fallback_reason``); with one server they run in plan order, with
several slots each slot takes the next launch when it frees, longest expected first
(:mod:`.schedule`; a launch split over idle slots is launched once by each, which measures
its part). Each ok row teaches the state file what a decode step took on its slot, for the
next dry run's estimate. On a live DDTree launch (runtime states, ``relaunch: never``) each
cell's tree is switched through ``/set_internal_state`` and proven through
``/server_info`` before it is measured (:mod:`.livetree`); a switch that is refused or does
not show is that cell's failed row, never a measurement of another tree. Every row records
its launch (``launch_argv_hash``, ``launch_id``) and whether its tree was switched live.

Servers left running for the measuring (``kept``: a predicted sweep's predict phase,
:mod:`.predictrun`, leaves one on every slot of a host) are taken on by the slots they
run on without loading again, where each is still the same process
(:meth:`~.lifetime.SweepServer.adopt`); its host's DDTree cells are then measured on
their launch (the predict phase's runtime states, a superset of the sweep's), by every
slot of the host alike, so a cell measures the same server whatever slot serves it.

Failures are rows, not exceptions: a host that cannot be reached, a server that crashes
or never gets ready, a server killed mid-cell — each is written as ``status: failed`` with
its error on the affected rows, and the other hosts carry on. After a cell with failed
requests the server is checked and restarted before the next cell if it is gone.
``fail_fast`` stops every host after its current row at the first failed row.

Interruption (Ctrl-C in the CLI sets ``cancel``): each worker finishes the row it is
measuring, writes it, puts its place's previous server back and returns. However a place's
work ends (done, failed rows, Ctrl-C, the host lost), what served there before the sweep is
put back (:mod:`.lifetime`: relaunched and proven ready, or left stopped where none ran;
``--leave-stopped``, ``--keep-server``), and each host's summary says what was put back and
what the place was observed doing afterwards; a place not put back fails its host. ``resume`` skips runs whose
ledger key (host, configuration, workload hash, repeat) already has an ``ok`` row; it
refuses a ledger of another sweep (rows carry ``sweep_hash``) and cuts off a truncated
last line first (:meth:`SweepRunner.prepare`, before any host is touched).

The sweep arrives planned (:mod:`.prepare`: the same plan ``--dry-run`` renders). The
rest lives beside this slot worker: provenance (:mod:`.provenance`), row assembly
(:mod:`.rows`), a server place's servers and lease over the sweep (:mod:`.lifetime`), and
the typed calls into the lower layers (:mod:`.services`).

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
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddtree_ops.bench import ledger
from ddtree_ops.bench.client import LoadSpec, sent_prompts
from ddtree_ops.bench.ledger import LedgerRow
from ddtree_ops.bench.lifetime import Borrowed, KeptServer, Leases, PutBack, SweepOptions, SweepServer
from ddtree_ops.bench.livetree import LiveTree, judge_switch
from ddtree_ops.bench.metrics import CellMetrics, GroupMetrics, RequestResult, calculate_metrics, group_metrics
from ddtree_ops.bench.onhost import LoadClient, make_client
from ddtree_ops.bench.plan import Cell, LaunchConfig
from ddtree_ops.bench.prepare import HostPlan, PreparedSweep, learn_step
from ddtree_ops.bench.provenance import Provenance, for_slot, probe_provenance, with_server_info
from ddtree_ops.bench.rows import RowMaker, now_iso
from ddtree_ops.bench.schedule import Job, plan_runs
from ddtree_ops.bench.services import Services, default_services
from ddtree_ops.bench.sweep import sweep_hash
from ddtree_ops.errors import (
    AuthError,
    BenchError,
    ConfigError,
    ConnectError,
    DdtreeOpsError,
    HostKeyError,
    Interrupted,
    LeaseHeld,
)
from ddtree_ops.inventory_types import Host
from ddtree_ops.workload.draw import WorkloadPrompts
from ddtree_ops.workload.prompt import Prompt

if TYPE_CHECKING:
    from ddtree_ops.service.lifecycle import RestartResult

# Errors after which nothing more can be done on the host in this sweep (LeaseHeld:
# another sweep holds it).
_HOST_LOST = (ConnectError, AuthError, HostKeyError, LeaseHeld)
Run = tuple[Cell, int]


@dataclass(frozen=True)
class Progress:
    """One event for the progress display: what a host is doing and how far it is."""

    host: str
    done: int
    total: int
    phase: str  # "probing" | "restarting" | "running" | "row" | "putting back" | "finished" | "interrupted" | "failed"
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
    # The class of the error that ended the host's work (one class: every slot's), else None.
    error_type: str | None = None
    # What the sweep's end did to each server place (the host, or each GPU slot).
    put_back: tuple[PutBack, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"put_back": [p.as_dict() for p in self.put_back]}


@dataclass(frozen=True)
class SweepOutcome:
    run_id: str
    ledger: Path
    hosts: tuple[HostSummary, ...]
    bad_ledger_lines: tuple[tuple[int, str], ...] = ()
    # What --resume repaired before running (a truncated last line cut off), to be said once.
    healed: str | None = None
    # Why the ledger could not be appended to (the disk filled): the sweep stopped there, on
    # every host, with the rows before it kept.
    ledger_error: str | None = None

    @property
    def failed(self) -> bool:
        return any(h.failed_rows or h.error for h in self.hosts)

    @property
    def interrupted(self) -> bool:
        return any(h.interrupted for h in self.hosts)


@dataclass
class _HostRun:
    """Mutable bookkeeping of one host's workers (one per GPU slot; counters under ``lock``)."""

    plan: HostPlan
    pending: list[Run]
    planned: int
    skipped: int
    done: int = 0
    ok_rows: int = 0
    failed_rows: int = 0
    restarts: int = 0
    started: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The classes of the errors that ended its slots (ConnectError: unreachable), so the
    # CLI exits with their code rather than with a benchmark failure's.
    error_types: set[str] = field(default_factory=set)
    put_back: list[PutBack] = field(default_factory=list)

    @property
    def host(self) -> Host:
        return self.plan.host

    def eta(self) -> float | None:
        if not self.done:
            return None
        per = (time.monotonic() - self.started) / self.done
        return per * (len(self.pending) - self.done)


@dataclass(frozen=True)
class _SlotRun:
    """One server place of a host: the host itself, or one of its GPU slots (a slot host
    with its own port, run dir, lease and load client)."""

    hr: _HostRun
    host: Host

    @property
    def label(self) -> str:
        return self.host.name if self.host.slot is not None else ""


class _JobQueue:
    """A host's server launches still to run, shared by its slots: each slot takes the
    next when it frees (longest expected first, see :mod:`.schedule`), preferring one of
    the launch it already serves, which needs no restart.

    ``first``: the slots that take a job before the others take any: those a kept server
    runs on, so that each takes a job of that launch (first in line, the longest, a slot
    without one would take it and load the launch again). The others wait until each of
    them has taken its job or given up (its lease and probe: well under a second)."""

    def __init__(self, jobs: Sequence[Job], *, first: Collection[str] = ()) -> None:
        self._jobs = list(jobs)
        self._lock = threading.Lock()
        self._first = frozenset(first)
        self._waiting = set(self._first)
        self._first_took = threading.Event()
        if not self._waiting:
            self._first_took.set()

    def take(self, serving: LaunchConfig | None, place: str) -> Job | None:
        if place in self._first:
            try:
                return self._take(serving)
            finally:
                self._took(place)
        self._first_took.wait()
        return self._take(serving)

    def done(self, place: str) -> None:
        """``place`` takes no more jobs (whether or not it took one): the others need not wait."""
        if place in self._first:
            self._took(place)

    def _took(self, place: str) -> None:
        with self._lock:
            self._waiting.discard(place)
            if not self._waiting:
                self._first_took.set()

    def _take(self, serving: LaunchConfig | None) -> Job | None:
        with self._lock:
            if not self._jobs:
                return None
            at = next((i for i, j in enumerate(self._jobs) if j.launch == serving), 0)
            return self._jobs.pop(at)

    def drain(self) -> list[Job]:
        with self._lock:
            left, self._jobs = self._jobs, []
            return left


@dataclass(frozen=True)
class _GaveUp:
    """A launch that ended the slot's work: the host is lost (``error``) or the sweep was
    interrupted (``error`` None)."""

    error: str | None


class SweepRunner:
    """Carries out one prepared sweep. Build it, then :meth:`run` (blocking; threads inside)."""

    def __init__(
        self,
        prepared: PreparedSweep,
        workload: WorkloadPrompts,
        *,
        ledger_path: Path,
        options: SweepOptions | None = None,
        services: Services | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        cancel: threading.Event | None = None,
        run_id: str | None = None,
        only: Mapping[str, Collection[str]] | None = None,
        kept: Mapping[str, Sequence[KeptServer]] | None = None,
        borrowed: Borrowed | None = None,
        leases: Leases | None = None,
    ) -> None:
        """``only``: per host, the DDTree cell keys to measure (a predicted sweep's chosen
        cells; baselines always run); a host it leaves out, or None: every cell. ``kept``:
        per host, the live DDTree servers a phase before left running on its server places
        (the predict phase's, all of one launch), whose launch measures the host's DDTree
        cells (see the module docstring). ``borrowed``: what served on each place before the
        command's first change there (shared with a phase before; a fresh one by default).
        ``leases``: the command's sweep leases (:class:`.lifetime.Leases`), shared with a
        phase before so that no place is free between the two; this run gives them back."""
        self.borrowed = borrowed if borrowed is not None else Borrowed()
        self.leases = leases if leases is not None else Leases()
        self.only = only
        self.kept: Mapping[str, Sequence[KeptServer]] = kept or {}
        self.prepared = prepared
        self.spec = prepared.spec
        self.workload = workload
        self.ledger_path = Path(ledger_path)
        self.options = options or SweepOptions()
        self.services = services or default_services()
        self.on_progress = on_progress or (lambda _p: None)
        self.cancel = cancel or threading.Event()
        self.stop_all = threading.Event()
        self.run_id = run_id or f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"
        self.rows = RowMaker(self.spec, workload, self.run_id, sweep_hash(self.spec))
        self.bad_lines: tuple[tuple[int, str], ...] = ()
        self.healed: str | None = None
        self.ledger_error: str | None = None
        self._done: set[str] | None = None

    # -- planning ---------------------------------------------------------------------

    def pending_runs(self, host: str, done: set[str]) -> list[Run]:
        plan = self.prepared.plan
        return [
            (self._launched_by(host, cell), r)
            for cell, r in plan_runs(plan)
            if ledger.row_key(self.rows.key_fields(host, cell, r)) not in done
            and (self.only is None or host not in self.only or cell.baseline or cell.key in self.only[host])
        ]

    def _launched_by(self, host: str, cell: Cell) -> Cell:
        """``cell`` with the launch that measures it on ``host``: the kept server's where it
        can switch to the cell's tree (so the rows record that launch), else the plan's."""
        kept = self.kept.get(host)
        if not kept or not cell.switched or not kept[0].launch.serves(cell.server):
            return cell
        return dataclasses.replace(cell, via=kept[0].launch)

    def prepare(self, *, dry_run: bool = False) -> None:
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
        if not self.options.resume:
            self._check_ours()
            self._done = set()
            return
        if not self.ledger_path.exists():
            # A mistyped --out must not start the sweep over under a new name.
            raise ConfigError(f"{self.ledger_path}: --resume: no such ledger to continue (a typo in --out? Without "
                              f"--resume the sweep starts there)")
        read = ledger.read_ledger(self.ledger_path)
        planned = [self.rows.key_fields(hp.host.name, cell, 0) for hp in self.prepared.hosts[:1]
                   for cell in self.prepared.plan.cells]
        # Whose ledger it is, from every row (a row the row check refused still says so);
        # which cells are done, from the rows a report would count (read.rows) only.
        ledger.check_same_sweep(read.rows + read.refused, sweep=self.spec.name, sweep_hash=self.rows.sweep_hash,
                                path=self.ledger_path, planned=planned)
        ledger.check_same_client(read.rows + read.refused, {hp.host.name: hp.client for hp in self.prepared.hosts},
                                 path=self.ledger_path)
        self._check_ours()
        bad = list(read.bad_lines)
        removed = 0 if dry_run else ledger.heal_truncated_tail(self.ledger_path)  # a dry run changes nothing
        if removed:
            lineno = bad.pop()[0] if bad and bad[-1][1].startswith("truncated") else None
            where = f"{self.ledger_path}:{lineno}" if lineno is not None else str(self.ledger_path)
            self.healed = f"{where}: removed a truncated last line ({removed} bytes; a writer stopped mid-line)"
        self.bad_lines = tuple(bad)
        self._done = ledger.completed_keys(read.rows)

    def _check_ours(self) -> None:
        """Appended only to a ledger of this sweep (never ``/etc/passwd``, never another
        sweep's: :func:`.ledger.check_ledger_of`), on a disk with room for its rows."""
        ledger.check_ledger_of(self.ledger_path, sweep=self.spec.name, sweep_hash=self.rows.sweep_hash)
        ledger.check_room(self.ledger_path, self.prepared.plan.runs * len(self.prepared.hosts),
                          num_prompts=self.spec.workload.num_prompts)

    def done_keys(self) -> set[str]:
        self.prepare()
        return self._done or set()

    def left(self) -> dict[str, tuple[int, int]]:
        """Per host: (rows the ledger has done, rows left to run), for ``--resume --dry-run``
        (the ledger checked as the run checks it, and left as it is)."""
        self.prepare(dry_run=True)
        done = self.done_keys()
        planned = self.prepared.plan.runs
        out = {}
        for hp in self.prepared.hosts:
            pending = len(self.pending_runs(hp.host.name, done))
            out[hp.host.name] = (planned - pending, pending)
        return out

    # -- running ----------------------------------------------------------------------

    def run(self) -> SweepOutcome:
        done = self.done_keys()
        runs = []
        planned = self.prepared.plan.runs
        for hp in self.prepared.hosts:
            pending = self.pending_runs(hp.host.name, done)
            runs.append(_HostRun(hp, pending, planned=planned, skipped=planned - len(pending)))
        try:
            with ThreadPoolExecutor(max_workers=max(1, len(runs)), thread_name_prefix="bench") as pool:
                summaries = list(pool.map(self._run_host, runs))
        finally:
            # The leases a phase before took on places this run never entered (nothing left
            # to measure there, the host lost): the sweep ends here for them too.
            self.leases.release_all(self.services)
        return SweepOutcome(self.run_id, self.ledger_path, tuple(summaries), self.bad_lines, self.healed,
                            self.ledger_error)

    def _emit(self, hr: _HostRun, phase: str, *, slot: str = "", **kw: Any) -> None:
        self.on_progress(
            Progress(host=hr.host.name, done=hr.done, total=len(hr.pending), phase=phase, eta_s=hr.eta(), slot=slot,
                     **kw)
        )

    def _stopping(self) -> bool:
        return self.cancel.is_set() or self.stop_all.is_set()

    def _run_host(self, hr: _HostRun) -> HostSummary:
        host = hr.host
        slots = host.slot_hosts()
        # A kept server with nothing left to measure is still taken on, to be put back; so is
        # a place a phase before changed.
        if not hr.pending and not self.kept.get(host.name) and not self.borrowed.owes(s.name for s in slots):
            self._emit(hr, "finished", message="nothing left to run")
            return HostSummary(host.name, hr.planned, hr.skipped, 0, 0, 0)
        kept = self.kept.get(host.name, ())
        first = {k.place for k in kept} & {s.name for s in slots} if len(slots) > 1 else set()
        # The kept launch costs its slots no load: its cells split over them for free.
        queue = _JobQueue(self.prepared.jobs(hr.plan, hr.pending, running=kept[0].launch if kept else None),
                          first=first)
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
        if left and error is not None and all(errors) and not self.cancel.is_set():
            for job in left:
                self._fail_rest(_SlotRun(hr, host), Provenance(), None, job.runs, error)
        interrupted = self.cancel.is_set() and hr.done < len(hr.pending)
        phase = "failed" if error else "interrupted" if interrupted else "finished"
        self._emit(hr, phase, message=error or ("" if not interrupted else f"{hr.done} of {len(hr.pending)} rows"))
        error_type = next(iter(hr.error_types)) if error is not None and len(hr.error_types) == 1 else None
        return HostSummary(
            host.name, hr.planned, hr.skipped, hr.ok_rows, hr.failed_rows, hr.restarts, error, interrupted, error_type,
            tuple(sorted(hr.put_back, key=lambda p: p.place)),
        )

    def _run_slot(self, sr: _SlotRun, queue: _JobQueue) -> str | None:
        """One server place's worker: lease, probe, then launch and measure job after job
        until the queue is empty; leaving puts the place's previous server back. Returns why it
        gave up (or why the place was not put back), or None."""
        server: SweepServer | None = None
        try:
            with self.services.open_transport(sr.host) as transport, SweepServer(
                self.services, transport, sr.host, sr.hr.host, sweep=self.spec.name, run_id=self.run_id,
                options=self.options, cancel=self.cancel,
                on_takeover=lambda message: self._emit(sr.hr, "restarting", slot=sr.label, message=message),
                borrowed=self.borrowed,
                on_put_back=lambda message: self._emit(sr.hr, "putting back", slot=sr.label, message=message),
                leases=self.leases,
            ) as server:
                # Taken on first, under the lease: from here an interrupt or a failure stops it.
                # The predict phase leaves one on every slot of the host; each takes a job of
                # its launch before the slots without one take any (:class:`_JobQueue`), so
                # no slot loads that launch again.
                kept = next((k for k in self.kept.get(sr.hr.host.name, ()) if k.place == sr.host.name), None)
                adopted = kept if kept is not None and server.adopt(kept) else None
                # The lease came first: a host another sweep holds is refused without
                # probing it (the probe and bundle status cost ~0.13 s per host).
                self._emit(sr.hr, "probing", slot=sr.label)
                prov = for_slot(probe_provenance(transport, sr.host, self.services), sr.host)
                error = self._run_jobs(sr, server, prov, queue, adopted)
        except DdtreeOpsError as exc:
            # No lease, no connection: the queue's jobs wait for another slot, or fail at
            # the host's end with this reason.
            error = str(exc)
            with sr.hr.lock:
                sr.hr.error_types.add(type(exc).__name__)
        finally:
            queue.done(sr.host.name)
        put = server.put_back if server is not None else None
        if put is not None:
            with sr.hr.lock:
                sr.hr.put_back.append(put)
                if not put.ok and put.error_type is not None:
                    sr.hr.error_types.add(put.error_type)
            if not put.ok:
                # The host is not as the sweep found it: that fails it, whatever its rows.
                error = "; ".join(e for e in (error, f"{sr.host.name}: {put.describe()}") if e)
        if error:
            self._emit(sr.hr, "failed", slot=sr.label, message=error)
        return error

    def _launch(
        self, sr: _SlotRun, server: SweepServer, prov: Provenance, job: Job, rest: Sequence[Run], *, again: bool,
    ) -> RestartResult | _GaveUp | None:
        """Launch ``job``'s server: its result; or :class:`_GaveUp`; or None where it did not
        start (``rest`` fails with the reason and the slot goes on with the next job)."""
        with sr.hr.lock:
            sr.hr.restarts += 1
        try:
            # The smoke decodes at the sampling settings this server is about to be measured at.
            return server.restart(job.launch, (c.sampling for c, _ in job.runs), prov.facts)
        except _HOST_LOST as exc:
            self._fail_rest(sr, prov, None, rest, str(exc))
            with sr.hr.lock:
                sr.hr.error_types.add(type(exc).__name__)
            return _GaveUp(str(exc))
        except Interrupted:
            return _GaveUp(None)
        except DdtreeOpsError as exc:
            self._fail_rest(sr, prov, None, rest, f"server did not {'restart' if again else 'start'}: {exc}")
            return None

    def _run_jobs(self, sr: _SlotRun, server: SweepServer, prov: Provenance, queue: _JobQueue,
                  adopted: KeptServer | None = None) -> str | None:
        """Take jobs from ``queue`` until it is empty: launch each job's server (unless the
        slot serves its launch already: ``adopted``, or the job before's), measure its runs.
        Returns the error that ended this slot (a failure past the rows' own handling fails
        the runs of the job in hand with it)."""
        client = make_client(sr.hr.plan.client, server.transport, sr.host)
        serving: LaunchConfig | None = None
        restart: RestartResult | None = None  # the server measuring ``left``; None: launch one
        left: list[Run] = []
        try:
            if adopted is not None:
                serving, restart = adopted.launch, adopted.restart
                served = with_server_info(prov, client.server_info())
                prompts = self._render(sr, client)
            while not self._stopping() and (job := queue.take(serving, sr.host.name)) is not None:
                left = list(job.runs)
                if job.launch != serving:
                    restart = None
                why = ""  # why it is launched again
                while left:
                    if restart is None:
                        self._emit(sr.hr, "restarting", slot=sr.label, cell=job.launch.key, message=why)
                        launched = self._launch(sr, server, prov, job, left, again=bool(why))
                        if isinstance(launched, _GaveUp):
                            return launched.error
                        if launched is None:
                            serving = None
                            break
                        serving, restart = job.launch, launched
                        served = with_server_info(prov, client.server_info())
                        prompts = self._render(sr, client)
                    if self._stopping():
                        return None
                    cell, rep = left[0]
                    live = self._switch(sr, client, cell) if cell.switched else None
                    if isinstance(live, str) or isinstance(prompts, str):
                        unmeasured = live if isinstance(live, str) else str(prompts)
                        row = self._row(sr, served, restart, cell, rep, now_iso(), error=unmeasured)
                        self._append(sr, row, cell)
                    else:
                        row = self._measure(sr, client, served, restart, cell, rep, prompts, live=live)
                    left.pop(0)  # written: no longer the caller's to fail
                    if row.status == "failed" and not server.serving():
                        restart, why = None, "server gone; restarting"
        except DdtreeOpsError as exc:
            self._fail_rest(sr, prov, None, left, str(exc))
            with sr.hr.lock:
                sr.hr.error_types.add(type(exc).__name__)
            return str(exc)
        return None

    def _render(self, sr: _SlotRun, client: LoadClient) -> tuple[Prompt, ...] | str:
        """The workload as this launch receives it: for ``/generate``, each chat prompt with
        the ids the served model's chat template renders it to; or why it cannot be sent
        (every row of the launch fails with it: a transcript is never sent instead)."""
        prompts = self.workload.prompts
        if self.spec.api != "generate" or not any(p.chat for p in prompts):
            return prompts
        conversations = list(dict.fromkeys(p.messages for p in prompts if p.chat))
        self._emit(sr.hr, "running", slot=sr.label, message=f"rendering {len(conversations)} chat prompts")
        rendered = client.render_chat(conversations)
        if rendered.error is not None or len(rendered.ids) != len(conversations):
            return ("chat prompts could not be rendered through the served model's chat template "
                    f"(POST /v1/tokenize): {rendered.error or 'answer incomplete'}")
        ids = dict(zip(conversations, rendered.ids, strict=True))
        return tuple(dataclasses.replace(p, input_ids=ids[p.messages]) if p.chat else p for p in prompts)

    def _switch(self, sr: _SlotRun, client: LoadClient, cell: Cell) -> LiveTree | str:
        """Pin ``cell``'s tree on the live launch and prove it took: the state it is measured
        at, or why the cell fails (its row's error)."""
        budget, topk = cell.server.budget, cell.server.topk
        assert budget is not None and topk is not None  # a switched cell is a DDTree cell
        self._emit(sr.hr, "running", slot=sr.label, cell=cell.key, message=f"switching to budget {budget} top-k {topk}")
        return judge_switch(client.switch_tree(budget, topk), budget, topk)

    def _measure(
        self, sr: _SlotRun, client: LoadClient, prov: Provenance, restart: RestartResult, cell: Cell, rep: int,
        prompts: tuple[Prompt, ...], *, live: LiveTree | None = None,
    ) -> LedgerRow:
        self._emit(sr.hr, "running", slot=sr.label, cell=cell.key, repeat=rep)
        started_at = now_iso()
        began = time.monotonic()
        finished = [0]
        sent = sent_prompts(prompts)  # a multi-turn question is one request per turn

        def on_done(_result: RequestResult) -> None:
            # Records stream in as requests finish (from the host too): show them arriving.
            finished[0] += 1
            self._emit(sr.hr, "running", slot=sr.label, cell=cell.key, repeat=rep,
                       message=f"{finished[0]}/{len(sent)} requests")

        load = client.run_load(
            LoadSpec(
                prompts=prompts,
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
            flush=True,
            on_done=on_done,
        )
        metrics = calculate_metrics(load.results, duration_s=load.duration_s)
        groups = group_metrics(load.results, [p.group for p in sent])
        error = None
        if metrics.failed:
            error = f"{metrics.failed}/{metrics.requests} requests failed: " + "; ".join(metrics.errors)
        row = self._row(sr, prov, restart, cell, rep, started_at, error=error, metrics=metrics, live=live,
                        groups=groups, outputs=[r.output_hash for r in load.results])
        self._append(sr, row, cell)
        if error is None:
            learn_step(sr.host, cell, time.monotonic() - began, self.spec)
        return row

    def _row(self, sr: _SlotRun, prov: Provenance, restart: RestartResult | None, cell: Cell, rep: int,
             started_at: str, *, error: str | None, metrics: CellMetrics | None = None,
             live: LiveTree | None = None, groups: Mapping[str, GroupMetrics] | None = None,
             outputs: Sequence[str | None] = ()) -> LedgerRow:
        return self.rows.row(machine=sr.hr.host.name, server_host=sr.host, client=sr.hr.plan.client, prov=prov,
                             restart=restart, cell=cell, repeat=rep, started_at=started_at, error=error,
                             metrics=metrics, live=live, groups=groups, outputs=outputs)

    def _append(self, sr: _SlotRun, row: LedgerRow, cell: Cell) -> None:
        hr = sr.hr
        line = ledger.encode_row(row)  # an invalid row fails its slot (a bug), not the sweep
        try:
            ledger.append_line(self.ledger_path, line)
        except BenchError as exc:
            self.ledger_failed(exc.message)
            raise
        with hr.lock:
            hr.done += 1
            if row.status == "ok":
                hr.ok_rows += 1
            else:
                hr.failed_rows += 1
        if row.status != "ok" and self.options.fail_fast:
            self.stop_all.set()
        self._emit(hr, "row", slot=sr.label, cell=cell.key, repeat=row.repeat, status=row.status,
                   message=row.error or "")

    def ledger_failed(self, message: str) -> None:
        """The ledger takes no more rows (the disk filled; ``message`` says so): every host
        stops after its current row, puts back and gives back, and the outcome says why
        (:attr:`SweepOutcome.ledger_error`); the rows before are in the ledger, fsynced."""
        if self.ledger_error is None:
            self.ledger_error = message
        self.stop_all.set()

    def _fail_rest(
        self, sr: _SlotRun, prov: Provenance, restart: RestartResult | None, runs: Sequence[Run], error: str
    ) -> None:
        if self.ledger_error is not None:
            return  # the ledger takes no row: these runs are left to --resume
        for cell, rep in runs:
            self._append(sr, self._row(sr, prov, restart, cell, rep, now_iso(), error=error), cell)


__all__ = ["HostSummary", "Progress", "SweepOptions", "SweepOutcome", "SweepRunner"]
