"""The predict phase of ``bench --predict`` (issue 43): per host, on the sweep's live DDTree
launch, round-time probes and trace runs, every DDTree cell predicted into the ledger, and
the cells worth measuring chosen. The measuring that follows is the ordinary runner's,
restricted to those cells and the baselines (``SweepRunner(only=...)``), and its DDTree
cells are measured on the predict phase's servers, left running for it
(``SweepRunner(kept=...)``): every budget of the grid is a runtime state of that launch
too, so a server place loads the DDTree model once for the whole predicted plan (a model
load on a GPU host is minutes).

On a host with several GPU slots every slot launches that launch once, all at once, and
the probes and trace runs are split over them (:func:`~.predictplan.split_work`, the cut
``--dry-run`` estimates with): the phase takes its slowest slot's share rather than the
sum. The predictions need every slot's results, so they are made once all have returned;
every slot then hands its server over, and measures its share of the chosen cells on it.
A slot that fails fails the host's phase: the others stop at their next item.

Rows, like every other row, go to the sweep's ledger: ``source: probe`` (one per
(verify path, concurrency, budget), from the slot that probed it, at the probe's sampling:
``round_ms``, ``overhead_ms``, the probed state's graph mode and the host's GPU) and
``source: predicted`` (one per DDTree cell: ``accept_length`` and ``output_tok_s``
predicted by the walk; the naive ones beside them). The traces go beside the ledger, one
file per (server place, sampling, trace group): ``<ledger>.traces/*.ndjson`` (not
``.jsonl``: the report reads those as ledgers). A host whose predict phase fails says
why, stops its servers and is measured in full on the sweep's own launch, never guessed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ddtree_ops.bench import ledger
from ddtree_ops.bench.client import LoadSpec, sent_prompts
from ddtree_ops.bench.lifetime import Borrowed, KeptServer, Leases, SweepOptions, SweepServer
from ddtree_ops.bench.livetree import LiveTree, judge_switch
from ddtree_ops.bench.metrics import calculate_metrics, group_metrics
from ddtree_ops.bench.onhost import LoadClient, make_client
from ddtree_ops.bench.plan import Cell, Sampling, ServerConfig, cell_steps
from ddtree_ops.bench.predictplan import (
    PredictPlan,
    ProbeRun,
    TraceRun,
    WorkItem,
    plan_predict,
    probe_requests,
    probe_warmup,
    split_work,
    trace_groups,
)
from ddtree_ops.bench.prepare import HostPlan, PreparedSweep, learn_step
from ddtree_ops.bench.provenance import Provenance, for_slot, probe_provenance, with_server_info
from ddtree_ops.bench.rows import RowMaker, now_iso
from ddtree_ops.bench.runner import Progress
from ddtree_ops.bench.services import Services, default_services
from ddtree_ops.bench.sweep import sweep_hash
from ddtree_ops.errors import BenchError, ConfigError, DdtreeOpsError
from ddtree_ops.fsutil import IS_LINK, is_disk_full, replace_file, write_problem
from ddtree_ops.inventory_types import Host
from ddtree_ops.predict.decide import Candidate, Verdict, judge, repeats_cap, repeats_floor
from ddtree_ops.predict.estimate import (
    CellPrediction,
    ProbeKey,
    ProbeRequest,
    RoundTime,
    measure_round_time,
    predict_acceptance,
    predict_cell,
    smooth_round_times,
    top_cells,
)
from ddtree_ops.predict.trace import TRACE_OFF, RequestTrace, TraceProblem, parse_trace, trace_line, trace_switch
from ddtree_ops.workload.draw import WorkloadPrompts
from ddtree_ops.workload.prompt import Prompt

if TYPE_CHECKING:
    from ddtree_ops.service.lifecycle import RestartResult

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class GroupDecision:
    """One (sampling, concurrency) group's measured candidates (the top N predicted) and the
    verdict on them (:func:`~ddtree_ops.predict.decide.judge`) after the last pass."""

    temperature: float
    top_p: float
    top_k: int
    concurrency: int
    candidates: tuple[Candidate, ...]
    verdict: Verdict


@dataclass(frozen=True)
class HostPrediction:
    """One host's predict phase: the DDTree cell keys chosen to measure, the top N per
    group (None: every cell, the phase failed and ``error`` says why), what it wrote, and
    the servers it left running, one per server place (none where it failed: they were
    stopped).

    The chosen cells are measured by the phase itself, in interleaved passes until each
    group is decided (``decisions``; ``measured_ok``/``measured_failed`` rows); ``left``:
    the DDTree cells the runner still measures (``SweepRunner(only=...)``): none where the
    phase measured them all, the chosen cells not measured yet where measuring failed
    (``error`` says why). ``took``: the planned runs of the chosen cells the phase took
    from the runner (the runner counts them skipped)."""

    host: str
    chosen: frozenset[str] | None
    predicted_rows: int = 0
    probe_rows: int = 0
    traces: tuple[Path, ...] = ()
    error: str | None = None
    kept: tuple[KeptServer, ...] = ()
    decisions: tuple[GroupDecision, ...] = ()
    left: frozenset[str] | None = None
    measured_ok: int = 0
    measured_failed: int = 0
    took: int = 0


@dataclass(frozen=True)
class _Place:
    """One server place of a host (the host itself, or one of its GPU slots) with the
    predict launch serving there: what its work and its rows need."""

    host: Host
    server: SweepServer
    client: LoadClient
    prov: Provenance
    restart: RestartResult
    prompts: tuple[Prompt, ...]

    @property
    def label(self) -> str:
        return _slot_label(self.host)


def _slot_label(place: Host) -> str:
    """What progress names a place by: its slot's name, nothing for a host without slots."""
    return place.name if place.slot is not None else ""


@dataclass(frozen=True)
class _ShareDone:
    """What one place's share of the work measured: round times and the states they were
    probed at, by budget; trace runs' traces and files."""

    times: tuple[RoundTime, ...]
    lives: Mapping[int, LiveTree]
    traces: Mapping[TraceRun, tuple[list[RequestTrace], Path]]


@dataclass(frozen=True)
class _Decided:
    """The measured phase's end: each group's decision, the rows it wrote, the chosen cells
    with an ok row, and why it stopped early (None: every group judged to its end)."""

    decisions: tuple[GroupDecision, ...]
    ok: int
    failed: int
    ok_keys: frozenset[str]
    error: str | None = None


class _Stopped(BenchError):
    """A place stopped because another place of the host failed (not the cause to report)."""


class _Steps:
    """The host's progress over its places' threads: work items done of the phase's."""

    def __init__(self, phase: PredictPhase, hp: HostPlan, total: int) -> None:
        self._phase, self._hp, self.total = phase, hp, total
        self._done = 0
        self._lock = threading.Lock()

    def say(self, message: str, *, slot: str = "", finished: bool = False) -> None:
        with self._lock:
            if finished:
                self._done += 1
            done = self._done
        self._phase.on_progress(Progress(host=self._hp.host.name, done=done, total=self.total, phase="predicting",
                                         message=message, slot=slot))


def traces_dir(ledger_path: Path) -> Path:
    return ledger_path.with_name(ledger_path.name + ".traces")


def check_traces_dir(ledger_path: Path) -> None:
    """ConfigError unless the traces folder beside ``ledger_path`` can be made or used: run
    before any host is touched (a file or a symbolic link there would fail the predict
    phase after its servers loaded and its trace runs ran)."""
    folder = traces_dir(ledger_path)
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"{folder}: cannot use the traces folder: {exc.strerror or exc}") from None
    if stat.S_ISLNK(mode):
        raise ConfigError(f"{folder}: the traces folder {IS_LINK}; remove it or pass another --out")
    if not stat.S_ISDIR(mode):
        raise ConfigError(f"{folder}: exists and is not a folder: bench --predict writes its traces there; "
                          "remove it or pass another --out")


def write_traces(out: Path, lines: Sequence[str]) -> None:
    """A trace run's file, written whole and atomically (a temp file renamed over the name:
    never through a link, never half a file). Raises OSError (a full disk: ENOSPC)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    replace_file(out, lambda fh: fh.write("".join(lines).encode("utf-8")))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


class PredictPhase:
    """Runs the predict phase on every host of a prepared sweep (hosts in parallel)."""

    def __init__(
        self, prepared: PreparedSweep, workload: WorkloadPrompts, *, ledger_path: Path, run_id: str,
        options: SweepOptions | None = None, services: Services | None = None,
        on_progress: Callable[[Progress], None] | None = None, cancel: threading.Event | None = None,
        borrowed: Borrowed | None = None, leases: Leases | None = None,
    ) -> None:
        """``borrowed``: the measuring runner's (:attr:`SweepRunner.borrowed`): what served on
        each place before this phase changed it, which the measuring puts back at its end.
        ``leases``: the runner's too (:attr:`SweepRunner.leases`): each place's lease, taken
        here, is kept for the measuring, which gives it back; without it (a library caller)
        this phase holds and gives back its own."""
        self.prepared, self.workload, self.ledger_path, self.run_id = prepared, workload, Path(ledger_path), run_id
        self.borrowed = borrowed if borrowed is not None else Borrowed()
        self.leases = leases
        self.options = options or SweepOptions()
        self.services = services or default_services()
        self.on_progress = on_progress or (lambda _p: None)
        self.cancel = cancel or threading.Event()
        self.rows = RowMaker(prepared.spec, workload, run_id, sweep_hash(prepared.spec))
        self.plan = plan_predict(prepared.spec, prepared.plan)
        # Why the ledger took no more rows (the disk filled), or None.
        self.ledger_error: str | None = None

    def _append(self, row: ledger.LedgerRow) -> None:
        line = ledger.encode_row(row)
        try:
            ledger.append_line(self.ledger_path, line)
        except BenchError as exc:
            # The ledger takes no more rows (the disk filled): said once, for the measuring
            # to stop on (SweepRunner.ledger_failed) rather than launch for rows it cannot keep.
            if self.ledger_error is None:
                self.ledger_error = exc.message
            raise

    def run(self) -> dict[str, HostPrediction]:
        if self.plan is None:
            raise BenchError(f"{self.prepared.spec.source}: predict: the sweep has no DDTree cells on a live launch "
                             "(relaunch: never) to predict")
        try:
            with ThreadPoolExecutor(max_workers=max(1, len(self.prepared.hosts)), thread_name_prefix="predict") as pool:
                done = list(pool.map(self._host, self.prepared.hosts))
        except BaseException:
            if self.leases is not None:  # no measuring follows to give them back
                self.leases.release_all(self.services)
            raise
        return {d.host: d for d in done}

    def _host(self, hp: HostPlan) -> HostPrediction:
        try:
            return self._predict(hp)
        except DdtreeOpsError as exc:
            return HostPrediction(hp.host.name, None, error=f"predict phase: {exc}; measuring every cell")

    def _predict(self, hp: HostPlan) -> HostPrediction:
        planned = self.plan
        assert planned is not None
        wl = self.prepared.spec.workload
        planned_shares = split_work(planned, len(hp.host.slot_hosts()), num_prompts=wl.num_prompts,
                                    max_new_tokens=wl.max_new_tokens, s_per_step=hp.step_s,
                                    trace_s_per_step=hp.trace_step_s)
        steps = _Steps(self, hp, sum(map(len, planned_shares)))
        failed = threading.Event()
        with ExitStack() as stack:
            servers = [self._enter(stack, hp, place, steps) for place in hp.host.slot_hosts()]
            # Entered last, left first: every thread has returned before a server is stopped.
            pool = stack.enter_context(ThreadPoolExecutor(max_workers=len(servers),
                                                          thread_name_prefix=f"predict-{hp.host.name}"))
            places = self._each(pool, failed, lambda server: self._launch(hp, server, planned, steps, failed), servers)
            pplan = self._replan(planned, places)
            shares = split_work(pplan, len(places), num_prompts=wl.num_prompts, max_new_tokens=wl.max_new_tokens,
                                s_per_step=hp.step_s, trace_s_per_step=hp.trace_step_s)
            done = self._each(pool, failed, lambda job: self._run_share(hp, job[0], pplan, job[1], steps, failed),
                              list(zip(places, shares, strict=True)))
            # The probes pooled (estimate.smooth_round_times): the raw ones are in the ledger.
            times = smooth_round_times(rt for d in done for rt in d.times)
            lives = {k: v for d in done for k, v in d.lives.items()}
            traced = {k: v for d in done for k, v in d.traces.items()}
            # A trace run cut into parts over slots: its parts' requests together (walked one by one).
            parts = sorted(traced, key=lambda item: item.shard)
            by_sampling = {s: [(group, [t for item in parts if item.whole == TraceRun(s, gi) for t in traced[item][0]])
                               for gi, group in enumerate(pplan.trace_groups)]
                           for s in pplan.samplings}
            files = [traced[item][1] for share in shares for item in share if isinstance(item, TraceRun)]
            predictions = self._predictions(pplan, by_sampling, times)
            keys = {(c.server.budget, c.server.topk, c.sampling.temperature, c.sampling.top_p, c.sampling.top_k,
                     c.concurrency): c
                    for c in self.prepared.plan.cells if c.server.algorithm == "ddtree" and c.switched}
            # Predicted rows were measured on no one slot: they carry the first's launch, as
            # one server's did (every slot serves the same launch).
            for p in predictions:
                cell = keys[(p.budget, p.topk, p.temperature, p.top_p, p.top_k, p.concurrency)]
                self._append(self._row(
                    hp, places[0], cell, lives.get(p.budget), source="predicted", accept_length=p.accept_length,
                    output_tok_s=p.output_tok_s, round_ms=p.round_s * 1000, overhead_ms=p.overhead_s * 1000,
                    predicted_accept_naive=p.accept_length_naive, predicted_tok_s_naive=p.output_tok_s_naive,
                ))
            top = [keys[(p.budget, p.topk, p.temperature, p.top_p, p.top_k, p.concurrency)]
                   for p in top_cells(predictions, pplan.spec.top)]
            chosen = frozenset(c.key for c in top)
            steps.say(f"{len(predictions)} cells predicted, {len(chosen)} to measure")
            decided = self._decide(hp, pool, failed, places, pplan, top, steps)
            repeats = self.prepared.plan.repeats
            measured = dataclasses.replace(
                HostPrediction(hp.host.name, chosen, len(predictions), len(times), tuple(files)),
                decisions=decided.decisions, measured_ok=decided.ok, measured_failed=decided.failed)
            if decided.error is not None:
                # Its servers stop with this block: the runner measures, on the sweep's own
                # launch, the chosen cells that have no ok row yet (every repeat).
                left = chosen - decided.ok_keys
                return dataclasses.replace(measured, left=left, took=len(chosen - left) * repeats,
                                           error=f"measuring the chosen cells: {decided.error}; the runner measures "
                                                 f"the {len(left)} not measured yet")
            kept = tuple(place.server.hand_over(pplan.launch, place.restart) for place in places)
            return dataclasses.replace(measured, kept=kept, left=frozenset(), took=len(chosen) * repeats)

    def _each(self, pool: ThreadPoolExecutor, failed: threading.Event, fn: Callable[[T], R],
              items: Sequence[T]) -> list[R]:
        """``fn`` over ``items`` (one per server place) at once, results in order. The first
        failure sets ``failed``, which stops the others at their next item, and is raised
        once all have returned (the cause, not another place's :class:`_Stopped`)."""

        def guarded(item: T) -> R:
            try:
                return fn(item)
            except BaseException:
                failed.set()
                raise

        futures = [pool.submit(guarded, item) for item in items]
        wait(futures)
        errors = [e for f in futures if (e := f.exception()) is not None]
        if errors:
            raise next((e for e in errors if not isinstance(e, _Stopped)), errors[0])
        return [f.result() for f in futures]

    def _enter(self, stack: ExitStack, hp: HostPlan, place: Host, steps: _Steps) -> SweepServer:
        """``place``'s transport and server over the phase, left with ``stack``."""
        transport = stack.enter_context(self.services.open_transport(place))

        def on_takeover(message: str) -> None:
            steps.say(message, slot=_slot_label(place))

        # Not kept by --keep-server: a phase that fails stops its servers (the measuring
        # launches the sweep's own); one that succeeds hands them over to the measuring. Not
        # final: the measuring that follows on every place puts back what served before.
        return stack.enter_context(SweepServer(
            self.services, transport, place, hp.host, sweep=self.prepared.spec.name, run_id=self.run_id,
            options=dataclasses.replace(self.options, keep_server=False), cancel=self.cancel, on_takeover=on_takeover,
            borrowed=self.borrowed, final=False, leases=self.leases,
        ))

    def _launch(self, hp: HostPlan, server: SweepServer, pplan: PredictPlan, steps: _Steps,
                failed: threading.Event) -> _Place:
        """Launch the predict launch on ``server``'s place, once for the whole plan."""
        place = server.host
        prov = for_slot(probe_provenance(server.transport, place, self.services), place)
        self._check(failed)
        steps.say(f"launching {pplan.launch.key}", slot=_slot_label(place))
        restart = server.restart(pplan.launch, pplan.samplings, prov.facts)
        client = make_client(hp.client, server.transport, place)
        prov = with_server_info(prov, client.server_info())
        return _Place(place, server, client, prov, restart, self._prompts(client))

    def _replan(self, pplan: PredictPlan, places: Sequence[_Place]) -> PredictPlan:
        """``pplan`` with the draft block the servers report (the trace groups follow it);
        every slot must report the same (the work is split by one plan)."""
        blocks = sorted({p.prov.draft_block_size for p in places if p.prov.draft_block_size})
        if len(blocks) > 1:
            raise BenchError(f"the slots' servers of one launch report different draft blocks {blocks}")
        if not blocks or blocks[0] == pplan.block:
            return pplan
        groups = trace_groups(pplan.trees, blocks[0], max(pplan.launch.budgets))
        return dataclasses.replace(pplan, block=blocks[0], trace_groups=groups)

    def _run_share(self, hp: HostPlan, place: _Place, pplan: PredictPlan, share: Sequence[WorkItem],
                   steps: _Steps, failed: threading.Event) -> _ShareDone:
        """One place's probes (each written to the ledger as it is measured) and trace runs."""
        times: list[RoundTime] = []
        lives: dict[int, LiveTree] = {}
        traces: dict[TraceRun, tuple[list[RequestTrace], Path]] = {}
        for item in share:
            self._check(failed)
            if isinstance(item, ProbeRun):
                c, b = item.concurrency, item.budget
                steps.say(f"probe {item.sampling.verify_path} concurrency {c} budget {b}", slot=place.label)
                live = judge_switch(place.client.switch_tree(b, pplan.probe_topk), b, pplan.probe_topk)
                if isinstance(live, str):
                    raise BenchError(live)
                rt, metrics = self._probe(place.client, place.prompts, pplan, item, live,
                                          warmup=probe_warmup(pplan, share, item))
                times.append(rt)
                lives[b] = live
                cell = Cell(ServerConfig("ddtree", b, pplan.probe_topk), item.sampling, c, via=pplan.launch)
                self._append(self._row(
                    hp, place, cell, live, metrics=metrics, source="probe", round_ms=rt.round_s * 1000,
                    overhead_ms=rt.overhead_s * 1000))
            else:
                groups = len(pplan.trace_groups)
                part = f" part {item.shard + 1}/{item.shards}" if item.shards > 1 else ""
                steps.say(f"trace run {item.sampling.key} group {item.group + 1}/{groups}{part}", slot=place.label)
                traces[item] = self._trace(place, pplan, item)
            steps.say("", slot=place.label, finished=True)
        return _ShareDone(tuple(times), lives, traces)

    def _decide(self, hp: HostPlan, pool: ThreadPoolExecutor, failed: threading.Event, places: Sequence[_Place],
                pplan: PredictPlan, chosen: Sequence[Cell], steps: _Steps) -> _Decided:
        """Measure the chosen cells (the top N of each group) until each group is decided
        (:mod:`ddtree_ops.predict.decide`): pass after pass, every candidate still in
        contention in every undecided group once (repeat = the pass), the pass's runs split
        over the places and taken in the other order every other pass (no candidate is
        always measured first). Never raises for a measurement: a failure ends the passes and
        :attr:`_Decided.error` says why (the groups are judged on what was measured)."""
        sweep_repeats = self.prepared.plan.repeats
        floor, cap = repeats_floor(sweep_repeats), repeats_cap(sweep_repeats, pplan.spec.max_repeats)
        groups: dict[tuple[float, float, int, int], list[Cell]] = {}
        for cell in chosen:
            s = cell.sampling
            groups.setdefault((s.temperature, s.top_p, s.top_k, cell.concurrency), []).append(
                dataclasses.replace(cell, via=pplan.launch))
        values: dict[str, list[float]] = {c.key: [] for cells in groups.values() for c in cells}
        taken = dict.fromkeys(values, 0)
        counts = {"ok": 0, "failed": 0}
        lock = threading.Lock()

        def record(cell: Cell, row: ledger.LedgerRow) -> None:
            # As each row is written (a pass cut short keeps what it measured).
            with lock:
                taken[cell.key] += 1
                if row.status == "ok" and row.output_tok_s is not None:
                    values[cell.key].append(float(row.output_tok_s))
                    counts["ok"] += 1
                else:
                    counts["failed"] += 1

        def candidates(cells: Sequence[Cell]) -> tuple[Candidate, ...]:
            return tuple(Candidate((c.server.budget or 0, c.server.topk or 0), tuple(values[c.key]), taken[c.key])
                         for c in cells)

        verdicts: dict[tuple[float, float, int, int], Verdict] = {}
        pending = dict(groups)
        error: str | None = None
        rep = 0
        while pending:
            runs = [(cell, rep) for cells in pending.values() for cell in cells]
            if rep % 2:
                runs.reverse()
            shares = [runs[i::len(places)] for i in range(len(places))]
            try:
                self._each(pool, failed, lambda job: self._measure_share(hp, job[0], job[1], steps, failed, record),
                           list(zip(places, shares, strict=True)))
            except DdtreeOpsError as exc:
                error = str(exc)
            rep += 1
            for key in pending:
                verdicts[key] = judge(candidates(groups[key]), floor=floor, cap=cap)
            if error is not None:
                break
            pending = {key: [c for c in groups[key] if (c.server.budget, c.server.topk) in verdicts[key].contenders]
                       for key in pending if verdicts[key].more}
        decisions = tuple(GroupDecision(*key, candidates(groups[key]), verdicts[key]) for key in sorted(verdicts))
        undecided = sum(1 for d in decisions if not d.verdict.decided)
        steps.say(f"{len(decisions) - undecided} of {len(decisions)} groups decided after {rep} repeat(s)")
        return _Decided(decisions, counts["ok"], counts["failed"], frozenset(k for k, v in values.items() if v), error)

    def _measure_share(self, hp: HostPlan, place: _Place, runs: Sequence[tuple[Cell, int]], steps: _Steps,
                       failed: threading.Event, record: Callable[[Cell, ledger.LedgerRow], None]) -> None:
        """One place's runs of a pass, each measured as the runner measures a switched cell
        (its tree switched to and proven, the cache flushed, the sweep's warmup, load and
        seed), written to the ledger as a measured row and handed to ``record``. A failed row
        whose server is gone ends the phase's measuring (BenchError)."""
        prompts = place.prompts if self.prepared.spec.api == "generate" else self.workload.prompts
        for cell, rep in runs:
            self._check(failed)
            budget, topk = cell.server.budget or 0, cell.server.topk or 0
            steps.say(f"measuring {cell.key} repeat {rep + 1}", slot=place.label)
            live = judge_switch(place.client.switch_tree(budget, topk), budget, topk)
            if isinstance(live, str):
                row = self.rows.row(machine=hp.host.name, server_host=place.host, client=hp.client, prov=place.prov,
                                    restart=place.restart, cell=cell, repeat=rep, started_at=now_iso(), error=live)
            else:
                row = self._measure(hp, place, cell, rep, prompts, live)
            self._append(row)
            record(cell, row)
            if row.status != "ok" and not place.server.serving():
                raise BenchError(f"{place.host.name}: the server is gone ({row.error})")

    def _measure(self, hp: HostPlan, place: _Place, cell: Cell, rep: int, prompts: Sequence[Prompt],
                 live: LiveTree) -> ledger.LedgerRow:
        spec, started_at, began = self.prepared.spec, now_iso(), time.monotonic()
        sent = sent_prompts(tuple(prompts))
        load = place.client.run_load(LoadSpec(
            prompts=tuple(prompts), max_new_tokens=self.workload.max_new_tokens, sampling=cell.sampling.as_params(),
            ignore_eos=self.workload.ignore_eos, concurrency=cell.concurrency, request_rate=spec.request_rate,
            warmup=spec.warmup, seed=spec.workload.seed + rep, api=spec.api,  # type: ignore[arg-type]
            timeout_s=spec.request_timeout_s), flush=True)
        metrics = calculate_metrics(load.results, duration_s=load.duration_s)
        error = None
        if metrics.failed:
            error = f"{metrics.failed}/{metrics.requests} requests failed: " + "; ".join(metrics.errors)
        made = self.rows.row(machine=hp.host.name, server_host=place.host, client=hp.client, prov=place.prov,
                             restart=place.restart, cell=cell, repeat=rep, started_at=started_at, error=error,
                             metrics=metrics, live=live, groups=group_metrics(load.results, [p.group for p in sent]),
                             outputs=[r.output_hash for r in load.results])
        if error is None:
            learn_step(place.host, cell, time.monotonic() - began, self.prepared.spec)
        return made

    def _row(self, hp: HostPlan, place: _Place, cell: Cell, live: LiveTree | None,
             **fields: object) -> ledger.LedgerRow:
        made = self.rows.row(machine=hp.host.name, server_host=place.host, client=hp.client, prov=place.prov,
                             restart=place.restart, cell=cell, repeat=0, started_at=now_iso(), error=None, live=live,
                             metrics=fields.pop("metrics", None))  # type: ignore[arg-type]
        return dataclasses.replace(made, **fields)  # type: ignore[arg-type]

    def _check(self, failed: threading.Event) -> None:
        if self.cancel.is_set():
            raise BenchError("interrupted")
        if failed.is_set():
            raise _Stopped("stopped: another slot of the host failed")

    def _prompts(self, client: LoadClient) -> tuple[Prompt, ...]:
        """The workload for ``/generate`` (the route that returns ``meta_info``): chat
        prompts rendered through the served model's template."""
        prompts = self.workload.prompts
        conversations = list(dict.fromkeys(p.messages for p in prompts if p.chat))
        if not conversations:
            return prompts
        rendered = client.render_chat(conversations)
        if rendered.error is not None or len(rendered.ids) != len(conversations):
            raise BenchError(f"chat prompts could not be rendered (POST /v1/tokenize): {rendered.error}")
        ids = dict(zip(conversations, rendered.ids, strict=True))
        return tuple(dataclasses.replace(p, input_ids=ids[p.messages]) if p.chat else p for p in prompts)

    def _load(self, prompts: Sequence[Prompt], *, tokens: int, sampling: Sampling, concurrency: int,
              warmup: int = 0) -> LoadSpec:
        return LoadSpec(prompts=tuple(prompts), max_new_tokens=tokens, sampling=sampling.as_params(),
                        ignore_eos=self.workload.ignore_eos if tokens == self.workload.max_new_tokens else True,
                        concurrency=concurrency, warmup=warmup, seed=self.prepared.spec.workload.seed, api="generate",
                        timeout_s=self.prepared.spec.request_timeout_s)

    def probe_load(self, prompts: Sequence[Prompt], pplan: PredictPlan, probe: ProbeRun, *, warmup: int) -> LoadSpec:
        """What a probe sends: ``warmup`` requests, then its waves of the place's prompts
        (cycled) at the probe's concurrency, sampling and tokens."""
        n = probe_requests(probe.concurrency, pplan.probe_waves(probe.concurrency))
        sent = (tuple(prompts) * math.ceil(n / len(prompts)))[:n]
        return self._load(sent, tokens=pplan.probe_tokens, sampling=probe.sampling, concurrency=probe.concurrency,
                          warmup=warmup)

    def _probe(self, client: LoadClient, prompts: Sequence[Prompt], pplan: PredictPlan, probe: ProbeRun,
               live: LiveTree, *, warmup: int) -> tuple[RoundTime, object]:
        c, b = probe.concurrency, probe.budget
        load = client.run_load(self.probe_load(prompts, pplan, probe, warmup=warmup), flush=True)
        reqs = [ProbeRequest(r.e2e, r.ttft or 0.0, r.spec_verify_ct or 0) for r in load.results if r.ok]
        rt = measure_round_time(reqs, concurrency=c, budget=b, duration_s=load.duration_s, cuda_graph=live.graph,
                                verify_path=probe.sampling.verify_path)
        if rt is None:
            errors = "; ".join(sorted({r.error or "" for r in load.results if not r.ok}))[:300]
            raise BenchError(f"round-time probe ({probe.sampling.verify_path}) at concurrency {c} budget {b} "
                             f"measured no round ({errors})")
        return rt, calculate_metrics(load.results, duration_s=load.duration_s)

    def _trace(self, place: _Place, pplan: PredictPlan, run: TraceRun) -> tuple[list[RequestTrace], Path]:
        sampling, group, index = run.sampling, pplan.trace_groups[run.group], run.group
        client = place.client
        prompts = tuple(place.prompts[i] for i in run.prompts(len(place.prompts)))
        tokens = self.workload.max_new_tokens
        answer = client.set_state(trace_switch(group, max_rounds=pplan.max_rounds(tokens)))
        if answer.status != 200:
            raise BenchError(f"trace switch refused (HTTP {answer.status}): {answer.detail}")
        try:
            load = client.run_load(self._load(prompts, tokens=tokens, sampling=sampling,
                                              concurrency=pplan.trace_concurrency), flush=True)
        finally:
            client.set_state(TRACE_OFF)
        if load.results and all(r.ok for r in load.results):
            self._learn_trace_step(place.host, pplan, len(prompts), tokens, load.duration_s)
        # The place's name: the host's, or its slot's ("h/1"), as the rows name where they ran.
        part = f"-p{run.shard}" if run.shards > 1 else ""
        out = traces_dir(self.ledger_path) / _slug(
            f"{self.run_id}-{place.host.name}-{sampling.key}-g{index}{part}.ndjson")
        traces: list[RequestTrace] = []
        lines: list[str] = []
        for i, result in enumerate(load.results):
            if not result.ok or result.trace is None:
                continue
            try:
                traces.append(parse_trace(result.trace))
            except TraceProblem as exc:
                raise BenchError(f"{place.host.name}: request {i}'s trace: {exc}") from None
            lines.append(trace_line(result.trace))
        if not traces:
            raise BenchError(f"trace run {sampling.key}: no request came back with a trace (meta_info.ddtree_trace)")
        try:
            write_traces(out, lines)
        except OSError as exc:
            message = f"{out}: cannot write the trace file: {write_problem(exc)}"
            if is_disk_full(exc) and self.ledger_error is None:
                # The ledger's disk (the traces go beside it): no row can be kept either.
                self.ledger_error = message
            raise BenchError(message) from None
        return traces, out

    def _learn_trace_step(self, host: Host, pplan: PredictPlan, num_prompts: int, tokens: int, seconds: float) -> None:
        """Remember what a step of a trace run took on this place, for the next dry run's
        trace charge (``prepare.expected_trace_step_s``), as the runner does for a run."""
        from ddtree_ops.state import StateStore

        cell = Cell(ServerConfig("ddtree"), Sampling(), pplan.trace_concurrency)
        steps = cell_steps(cell, num_prompts=num_prompts, max_new_tokens=tokens, warmup=0)
        if steps:
            StateStore().record_step_time(host.name, host.ddtree.server.model_path or "", seconds / steps, trace=True)

    def _predictions(
        self, pplan: PredictPlan,
        by_sampling: Mapping[Sampling, Sequence[tuple[tuple[tuple[int, int], ...], list[RequestTrace]]]],
        times: Mapping[ProbeKey, RoundTime],
    ) -> list[CellPrediction]:
        out: list[CellPrediction] = []
        tokens = self.workload.max_new_tokens
        for sampling, runs in by_sampling.items():
            for group, traces in runs:
                try:
                    accepts = predict_acceptance(traces, group)
                except ValueError as exc:  # too short to walk, or a tree the union missed
                    raise BenchError(f"trace run {sampling.key}: {exc}") from None
                for tree in group:
                    for c in pplan.concurrencies:
                        rt = times[(sampling.verify_path, c, tree[0])]
                        out.append(predict_cell(accepts[tree], rt, tokens=tokens,
                                                temperature=sampling.temperature, top_p=sampling.top_p,
                                                top_k=sampling.top_k))
        return out


def chosen_cells(outcome: Mapping[str, HostPrediction]) -> dict[str, frozenset[str]]:
    """``SweepRunner(only=...)``: the hosts whose prediction worked, with the DDTree cells
    the runner still measures there (none where the phase measured its chosen cells; a
    host left out is measured in full)."""
    return {host: p.left if p.left is not None else p.chosen for host, p in outcome.items() if p.chosen is not None}


def kept_servers(outcome: Mapping[str, HostPrediction]) -> dict[str, tuple[KeptServer, ...]]:
    """``SweepRunner(kept=...)``: the servers (one per server place) the hosts whose
    prediction worked left running, whose launch measures their chosen cells."""
    return {host: p.kept for host, p in outcome.items() if p.kept}


__all__ = ["GroupDecision", "HostPrediction", "PredictPhase", "check_traces_dir", "chosen_cells", "kept_servers",
           "traces_dir", "write_traces"]
