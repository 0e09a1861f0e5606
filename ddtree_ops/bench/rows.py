"""Ledger rows as the runner writes them: one :class:`~ddtree_ops.bench.ledger.LedgerRow`
per (host, cell, repeat), from the sweep's identity, the host's provenance, the launch
that served it, the live tree it was switched to (on a launch with runtime states) and
what was measured (nothing, on a row that failed before measuring)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ddtree_ops.bench import ledger
from ddtree_ops.bench.ledger import LedgerRow
from ddtree_ops.bench.livetree import LiveTree
from ddtree_ops.bench.metrics import CellMetrics, GroupMetrics
from ddtree_ops.bench.plan import Cell, LaunchConfig
from ddtree_ops.bench.provenance import Provenance
from ddtree_ops.bench.sweep import SweepSpec
from ddtree_ops.inventory_types import Host
from ddtree_ops.workload.draw import WorkloadPrompts

if TYPE_CHECKING:
    from ddtree_ops.service.launch import Algorithm, RunConfig
    from ddtree_ops.service.lifecycle import RestartResult

LEDGER_ALGORITHM: dict[str, Algorithm] = {"autoregressive": "AR", "dflash": "DFLASH", "ddtree": "DDTREE"}


def run_config(launch: LaunchConfig, *, adaptive_config: str | None = None) -> RunConfig:
    """The lifecycle's launch configuration of one of the sweep's launches (its launch
    state; ``adaptive_config``: the runtime-state file of a live launch, on the host)."""
    from ddtree_ops.service.launch import RunConfig

    return RunConfig(algorithm=LEDGER_ALGORITHM[launch.algorithm], budget=launch.budget, topk=launch.topk,
                     adaptive_config=adaptive_config)


def argv_hash(argv: tuple[str, ...] | list[str]) -> str:
    """The ledger's ``launch_argv_hash``: sha256 of the argv as JSON, 16 hex."""
    return hashlib.sha256(json.dumps(list(argv)).encode()).hexdigest()[:16]


def launch_identity(restart: RestartResult) -> tuple[str, str]:
    """(``launch_argv_hash``, ``launch_id``) of one launch: the command, and the process."""
    digest = argv_hash(restart.argv)
    return digest, f"{digest}.{restart.pid}.{int(restart.ready_at)}"


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class RowMaker:
    """What every row of one sweep run shares, and how a row is put together."""

    spec: SweepSpec
    workload: WorkloadPrompts
    run_id: str
    sweep_hash: str

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

    def row(
        self, *, machine: str, server_host: Host, client: str, prov: Provenance, restart: RestartResult | None,
        cell: Cell, repeat: int, started_at: str, error: str | None, metrics: CellMetrics | None = None,
        live: LiveTree | None = None, groups: Mapping[str, GroupMetrics] | None = None,
        outputs: Sequence[str | None] = (),
    ) -> LedgerRow:
        """``machine``: the inventory host the row belongs to; ``server_host``: the server
        place that served it (the machine itself, or one of its GPU slots); ``live``: the
        tree the server was switched to and proven at (None: not switched, or the switch
        failed and ``error`` says why).

        A switched row's CUDA-graph fields are its own state's, not the launch's: a budget
        whose verify graph failed to capture is served eager by a server launched with
        graphs, and its rows must say eager."""
        wl = self.spec.workload
        slot = server_host.slot
        smoke = None if restart is None else restart.smoke
        cuda_graph = restart.cuda_graph if restart is not None else False
        fallback = restart.fallback_reason if restart is not None else None
        verify_graph = prov.verify_cuda_graph
        graph_max_bs = prov.verify_cuda_graph_max_bs
        if live is not None:
            if not cuda_graph:
                fallback = fallback or live.fallback_reason()  # the whole server eager
            elif live.graph:
                # This state kept its graph: a launch note about other budgets (its
                # eager_budgets) is not this row's fallback.
                fallback = None
            else:
                fallback = "; ".join(r for r in (live.fallback_reason(), fallback) if r) or None
            cuda_graph = cuda_graph and live.graph
            verify_graph = live.graph
            graph_max_bs = live.cuda_graph_max_bs
        launch_hash, launch_id = launch_identity(restart) if restart is not None else (None, None)
        fields: dict[str, Any] = self.key_fields(machine, cell, repeat) | {
            "run_id": self.run_id,
            "sweep": self.spec.name,
            "sweep_hash": self.sweep_hash,
            "started_at": started_at,
            "finished_at": now_iso(),
            "gpu_name": prov.gpu_name,
            "gpu_arch": prov.gpu_arch,
            "gpu_count": prov.gpu_count,
            "driver": prov.driver,
            "sglang_version": prov.serving_version or prov.sglang_version,
            "sglang_installed_version": prov.sglang_version,
            "bundle_name": prov.bundle_name,
            "bundle_hash": prov.bundle_hash,
            "verify_attention_backend": prov.verify_attention_backend,
            "verify_cuda_graph": verify_graph,
            # The ceiling of the state that served the row (an eager row has none): the
            # report marks a cell whose concurrency is above it (its larger rounds ran eager).
            "cuda_graph_max_bs": graph_max_bs if cuda_graph else None,
            "draft_block_size": prov.draft_block_size,
            "tree_sampler": prov.tree_sampler,
            "server_argv": list(restart.argv) if restart is not None else [],
            "cuda_graph": cuda_graph,
            "fallback_reason": fallback,
            "launch_argv_hash": launch_hash,
            "launch_id": launch_id,
            # The launch's kind decides it, not the switch's outcome: a failed switch is
            # still a row of a switching launch (its error says what went wrong).
            "tree_switched": None if restart is None else cell.switched,
            # None where no server started; else whether its smoke ran (``--no-smoke``).
            "smoke": None if restart is None else ("passed" if smoke is not None and smoke.passed else "skipped"),
            "smoke_s": smoke.seconds if smoke is not None else None,
            "readiness_s": {str(k): v for k, v in restart.phase_durations.items()} if restart is not None else {},
            "workload_name": self.workload.name,
            "workload_prompt_format": self.workload.prompt_format,
            "workload_num_prompts": len(self.workload.prompts),
            "workload_max_new_tokens": self.workload.max_new_tokens,
            "workload_ignore_eos": self.workload.ignore_eos,
            "workload_seed": wl.seed,
            "client": client,
            "slot": slot.index if slot is not None else None,
            "gpu_indices": list(slot.gpus) if slot is not None else None,
            "status": "failed" if error else "ok",
            "error": error,
        }
        if metrics is not None:
            flat: Mapping[str, object] = metrics.flat()
            fields.update(
                completed=metrics.completed,
                failed=metrics.failed,
                duration_s=metrics.duration_s,
                output_tok_s=metrics.output_tok_s,
                request_s=metrics.request_s,
                total_input_tokens=metrics.input_tokens,
                total_output_tokens=metrics.output_tokens,
                accept_length=metrics.accept_length,
                verify_ct=metrics.verify_steps or None,
                client_coalesced_frac=metrics.coalesced_frac,
                client_bound=metrics.client_bound,
                categories=[{"group": name, **asdict(g)} for name, g in groups.items()] if groups else None,
                output_hashes=list(outputs) if any(h is not None for h in outputs) else None,
                **{name: flat[name] for name in ledger.LATENCY_FIELDS},
            )
        return LedgerRow(**fields)


__all__ = ["LEDGER_ALGORITHM", "RowMaker", "argv_hash", "launch_identity", "now_iso", "run_config"]
