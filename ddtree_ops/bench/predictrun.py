"""The predict phase of ``bench --predict`` (issue 43): per host, on the sweep's live DDTree
launch, round-time probes and trace runs, every DDTree cell predicted into the ledger, and
the cells worth measuring chosen. The measuring that follows is the ordinary runner's,
restricted to those cells and the baselines (``SweepRunner(only=...)``), and its DDTree
cells are measured on the predict phase's server, left running for it
(``SweepRunner(kept=...)``): every budget of the grid is a runtime state of that launch
too, so a host loads the DDTree model once for the whole predicted plan (a model load on
a GPU host is minutes).

Rows, like every other row, go to the sweep's ledger: ``source: probe`` (one per
(concurrency, budget): ``round_ms``, ``overhead_ms``, the probed state's graph mode and the
host's GPU) and ``source: predicted`` (one per DDTree cell: ``accept_length`` and
``output_tok_s`` predicted by the walk; the naive ones beside them). The traces go beside
the ledger, one file per (host, sampling, trace group): ``<ledger>.traces/*.ndjson``
(not ``.jsonl``: the report reads those as ledgers). A host whose predict phase fails
says why, stops its server and is measured in full on the sweep's own launch, never guessed.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ddtree_ops.bench import ledger
from ddtree_ops.bench.client import LoadSpec
from ddtree_ops.bench.lifetime import KeptServer, SweepOptions, SweepServer
from ddtree_ops.bench.livetree import LiveTree, judge_switch
from ddtree_ops.bench.metrics import calculate_metrics
from ddtree_ops.bench.onhost import LoadClient, make_client
from ddtree_ops.bench.plan import Cell, Sampling, ServerConfig
from ddtree_ops.bench.predictplan import PredictPlan, plan_predict, probe_requests, trace_groups
from ddtree_ops.bench.prepare import HostPlan, PreparedSweep
from ddtree_ops.bench.provenance import for_slot, probe_provenance, with_server_info
from ddtree_ops.bench.rows import RowMaker, now_iso
from ddtree_ops.bench.runner import Progress
from ddtree_ops.bench.services import Services, default_services
from ddtree_ops.bench.sweep import sweep_hash
from ddtree_ops.errors import BenchError, DdtreeOpsError
from ddtree_ops.predict.estimate import (
    CellPrediction,
    ProbeRequest,
    RoundTime,
    measure_round_time,
    predict_acceptance,
    predict_cell,
    top_cells,
)
from ddtree_ops.predict.trace import TRACE_OFF, RequestTrace, TraceProblem, parse_trace, trace_line, trace_switch
from ddtree_ops.workload.draw import WorkloadPrompts
from ddtree_ops.workload.prompt import Prompt


@dataclass(frozen=True)
class HostPrediction:
    """One host's predict phase: the DDTree cell keys to measure (None: every cell, the
    phase failed and ``error`` says why), what it wrote, and the server it left running
    for the measuring (None where it failed: its server was stopped)."""

    host: str
    chosen: frozenset[str] | None
    predicted_rows: int = 0
    probe_rows: int = 0
    traces: tuple[Path, ...] = ()
    error: str | None = None
    kept: KeptServer | None = None


def traces_dir(ledger_path: Path) -> Path:
    return ledger_path.with_name(ledger_path.name + ".traces")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


class PredictPhase:
    """Runs the predict phase on every host of a prepared sweep (hosts in parallel)."""

    def __init__(
        self, prepared: PreparedSweep, workload: WorkloadPrompts, *, ledger_path: Path, run_id: str,
        options: SweepOptions | None = None, services: Services | None = None,
        on_progress: Callable[[Progress], None] | None = None, cancel: threading.Event | None = None,
    ) -> None:
        self.prepared, self.workload, self.ledger_path, self.run_id = prepared, workload, Path(ledger_path), run_id
        self.options = options or SweepOptions()
        self.services = services or default_services()
        self.on_progress = on_progress or (lambda _p: None)
        self.cancel = cancel or threading.Event()
        self.rows = RowMaker(prepared.spec, workload, run_id, sweep_hash(prepared.spec))
        self.plan = plan_predict(prepared.spec, prepared.plan)

    def run(self) -> dict[str, HostPrediction]:
        if self.plan is None:
            raise BenchError(f"{self.prepared.spec.source}: predict: the sweep has no DDTree cells on a live launch "
                             "(relaunch: never) to predict")
        with ThreadPoolExecutor(max_workers=max(1, len(self.prepared.hosts)), thread_name_prefix="predict") as pool:
            done = list(pool.map(self._host, self.prepared.hosts))
        return {d.host: d for d in done}

    def _say(self, hp: HostPlan, step: int, total: int, message: str) -> None:
        self.on_progress(Progress(host=hp.host.name, done=step, total=total, phase="predicting", message=message))

    def _host(self, hp: HostPlan) -> HostPrediction:
        try:
            return self._predict(hp)
        except DdtreeOpsError as exc:
            return HostPrediction(hp.host.name, None, error=f"predict phase: {exc}; measuring every cell")

    def _predict(self, hp: HostPlan) -> HostPrediction:
        pplan = self.plan
        assert pplan is not None
        place = hp.host.slot_hosts()[0]
        steps = len(pplan.probes) + len(pplan.samplings) * len(pplan.trace_groups)
        # Not kept by --keep-server: a phase that fails stops its server (the measuring
        # launches the sweep's own); one that succeeds hands it over to the measuring.
        with self.services.open_transport(place) as transport, SweepServer(
            self.services, transport, place, hp.host, sweep=self.prepared.spec.name, run_id=self.run_id,
            options=dataclasses.replace(self.options, keep_server=False), cancel=self.cancel,
            on_takeover=lambda message: self._say(hp, 0, steps, message),
        ) as server:
            prov = for_slot(probe_provenance(transport, place, self.services), place)
            self._say(hp, 0, steps, f"launching {pplan.launch.key}")
            restart = server.restart(pplan.launch, pplan.samplings, prov.facts)
            client = make_client(hp.client, server.transport, place)
            prov = with_server_info(prov, client.server_info())
            if prov.draft_block_size and prov.draft_block_size != pplan.block:
                groups = trace_groups(pplan.trees, prov.draft_block_size, max(pplan.launch.budgets))
                pplan = dataclasses.replace(pplan, block=prov.draft_block_size, trace_groups=groups)
            prompts = self._prompts(client)

            def row(cell: Cell, live: LiveTree | None, **fields: object) -> ledger.LedgerRow:
                made = self.rows.row(machine=hp.host.name, server_host=place, client=hp.client, prov=prov,
                                     restart=restart, cell=cell, repeat=0, started_at=now_iso(), error=None, live=live,
                                     metrics=fields.pop("metrics", None))  # type: ignore[arg-type]
                return dataclasses.replace(made, **fields)  # type: ignore[arg-type]

            times: dict[tuple[int, int], RoundTime] = {}
            lives: dict[int, LiveTree] = {}
            probes = 0
            for step, (c, b) in enumerate(pplan.probes):
                self._check_cancel()
                self._say(hp, step, steps, f"probe concurrency {c} budget {b}")
                live = judge_switch(client.switch_tree(b, pplan.probe_topk), b, pplan.probe_topk)
                if isinstance(live, str):
                    raise BenchError(live)
                rt, metrics = self._probe(client, prompts, pplan, c, b, live)
                times[(c, b)] = rt
                lives[b] = live
                cell = Cell(ServerConfig("ddtree", b, pplan.probe_topk), Sampling(), c, via=pplan.launch)
                ledger.append_row(self.ledger_path, row(cell, live, metrics=metrics, source="probe",
                                                        round_ms=rt.round_s * 1000, overhead_ms=rt.overhead_s * 1000))
                probes += 1
            files: list[Path] = []
            by_sampling: dict[Sampling, list[tuple[tuple[tuple[int, int], ...], list[RequestTrace]]]] = {}
            step = len(pplan.probes)
            for sampling in pplan.samplings:
                for gi, group in enumerate(pplan.trace_groups):
                    self._check_cancel()
                    self._say(hp, step, steps, f"trace run {sampling.key} group {gi + 1}/{len(pplan.trace_groups)}")
                    traces, path = self._trace(hp, client, prompts, pplan, sampling, group, gi)
                    by_sampling.setdefault(sampling, []).append((group, traces))
                    files.append(path)
                    step += 1
            predictions = self._predictions(pplan, by_sampling, times)
            keys = {(c.server.budget, c.server.topk, c.sampling.temperature, c.sampling.top_p, c.sampling.top_k,
                     c.concurrency): c
                    for c in self.prepared.plan.cells if c.server.algorithm == "ddtree" and c.switched}
            for p in predictions:
                cell = keys[(p.budget, p.topk, p.temperature, p.top_p, p.top_k, p.concurrency)]
                ledger.append_row(self.ledger_path, row(
                    cell, lives.get(p.budget), source="predicted", accept_length=p.accept_length,
                    output_tok_s=p.output_tok_s, round_ms=p.round_s * 1000,
                    overhead_ms=times[(p.concurrency, p.budget)].overhead_s * 1000,
                    predicted_accept_naive=p.accept_length_naive, predicted_tok_s_naive=p.output_tok_s_naive,
                ))
            chosen = frozenset(keys[(p.budget, p.topk, p.temperature, p.top_p, p.top_k, p.concurrency)].key
                               for p in top_cells(predictions, pplan.spec.top))
            self._say(hp, steps, steps, f"{len(predictions)} cells predicted, {len(chosen)} to measure")
            kept = server.hand_over(pplan.launch, restart)
            return HostPrediction(hp.host.name, chosen, len(predictions), probes, tuple(files), kept=kept)

    def _check_cancel(self) -> None:
        if self.cancel.is_set():
            raise BenchError("interrupted")

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

    def _load(self, prompts: Sequence[Prompt], *, tokens: int, sampling: Sampling, concurrency: int) -> LoadSpec:
        return LoadSpec(prompts=tuple(prompts), max_new_tokens=tokens, sampling=sampling.as_params(),
                        ignore_eos=self.workload.ignore_eos if tokens == self.workload.max_new_tokens else True,
                        concurrency=concurrency, warmup=0, seed=self.prepared.spec.workload.seed, api="generate",
                        timeout_s=self.prepared.spec.request_timeout_s)

    def _probe(self, client: LoadClient, prompts: Sequence[Prompt], pplan: PredictPlan, c: int, b: int,
               live: LiveTree) -> tuple[RoundTime, object]:
        n = probe_requests(c, pplan.spec.probe_waves)
        sent = (tuple(prompts) * math.ceil(n / len(prompts)))[:n]
        client.flush_cache()
        load = client.run_load(self._load(sent, tokens=pplan.spec.probe_tokens, sampling=Sampling(), concurrency=c))
        reqs = [ProbeRequest(r.e2e, r.ttft or 0.0, r.spec_verify_ct or 0) for r in load.results if r.ok]
        rt = measure_round_time(reqs, concurrency=c, budget=b, duration_s=load.duration_s, cuda_graph=live.graph)
        if rt is None:
            errors = "; ".join(sorted({r.error or "" for r in load.results if not r.ok}))[:300]
            raise BenchError(f"round-time probe at concurrency {c} budget {b} measured no round ({errors})")
        return rt, calculate_metrics(load.results, duration_s=load.duration_s)

    def _trace(self, hp: HostPlan, client: LoadClient, prompts: Sequence[Prompt], pplan: PredictPlan,
               sampling: Sampling, group: tuple[tuple[int, int], ...], index: int) -> tuple[list[RequestTrace], Path]:
        tokens = self.workload.max_new_tokens
        answer = client.set_state(trace_switch(group, max_rounds=pplan.max_rounds(tokens)))
        if answer.status != 200:
            raise BenchError(f"trace switch refused (HTTP {answer.status}): {answer.detail}")
        try:
            client.flush_cache()
            load = client.run_load(self._load(prompts, tokens=tokens, sampling=sampling,
                                              concurrency=pplan.trace_concurrency))
        finally:
            client.set_state(TRACE_OFF)
        out = traces_dir(self.ledger_path) / _slug(f"{self.run_id}-{hp.host.name}-{sampling.key}-g{index}.ndjson")
        out.parent.mkdir(parents=True, exist_ok=True)
        traces: list[RequestTrace] = []
        with open(out, "w", encoding="utf-8") as fh:
            for i, result in enumerate(load.results):
                if not result.ok or result.trace is None:
                    continue
                try:
                    traces.append(parse_trace(result.trace))
                except TraceProblem as exc:
                    raise BenchError(f"{hp.host.name}: request {i}'s trace: {exc}") from None
                fh.write(trace_line(result.trace))
        if not traces:
            raise BenchError(f"trace run {sampling.key}: no request came back with a trace (meta_info.ddtree_trace)")
        return traces, out

    def _predictions(
        self, pplan: PredictPlan,
        by_sampling: Mapping[Sampling, Sequence[tuple[tuple[tuple[int, int], ...], list[RequestTrace]]]],
        times: Mapping[tuple[int, int], RoundTime],
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
                        out.append(predict_cell(accepts[tree], times[(c, tree[0])], tokens=tokens,
                                                temperature=sampling.temperature, top_p=sampling.top_p,
                                                top_k=sampling.top_k))
        return out


def chosen_cells(outcome: Mapping[str, HostPrediction]) -> dict[str, frozenset[str]]:
    """``SweepRunner(only=...)``: the hosts whose prediction worked, with their chosen cells
    (a host left out is measured in full)."""
    return {host: p.chosen for host, p in outcome.items() if p.chosen is not None}


def kept_servers(outcome: Mapping[str, HostPrediction]) -> dict[str, KeptServer]:
    """``SweepRunner(kept=...)``: the servers the hosts whose prediction worked left
    running, whose launch measures their chosen cells."""
    return {host: p.kept for host, p in outcome.items() if p.kept is not None}


__all__ = ["HostPrediction", "PredictPhase", "chosen_cells", "kept_servers", "traces_dir"]
