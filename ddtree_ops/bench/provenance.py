"""What a ledger row says about where it was measured: the host's GPU, driver and SGLang
(probed once per server place), the bundle deployed there, and what each launched server
says about itself (``/server_info``: its version, the DDTree tree it resolved).

Best effort by design: provenance that cannot be learned is null on the rows, it never
stops a benchmark.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddtree_ops.errors import DdtreeOpsError
from ddtree_ops.inventory_types import Host
from ddtree_ops.transport.base import Transport

if TYPE_CHECKING:
    from ddtree_ops.bench.services import Services
    from ddtree_ops.probe import HostFacts


@dataclass(frozen=True)
class Provenance:
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
    # The probe's facts, handed to the restart policy (no second probe per launch).
    facts: HostFacts | None = None
    # ``/server_info.ddtree`` of the serving process: what the plugin resolved.
    verify_attention_backend: str | None = None
    verify_cuda_graph: bool | None = None
    # The launch state's graph ceiling (``verify_cuda_graph_max_bs``): above it, eager.
    verify_cuda_graph_max_bs: int | None = None
    draft_block_size: int | None = None
    tree_sampler: str | None = None


def _arch(compute_cap: object) -> str | None:
    # nvidia-smi's "12.0" -> "sm_120", as the ledger spells architectures.
    return f"sm_{str(compute_cap).strip().replace('.', '')}" if compute_cap not in (None, "") else None


def probe_provenance(transport: Transport, host: Host, services: Services) -> Provenance:
    """GPU, SGLang version and deployed bundle of ``host``, best effort."""
    try:
        facts: HostFacts | None = services.probe(transport, host)
    except DdtreeOpsError:
        facts = None
    gpus = facts.gpus if facts is not None else ()
    gpu = gpus[0] if gpus else None
    version = facts.sglang_version if facts is not None else None
    bundle_name = bundle_hash = None
    try:
        st = services.patch_status(transport, host)
        bundle_name, bundle_hash = st.bundle_name, st.bundle_identity
        version = version or st.package_version
    except DdtreeOpsError:
        pass
    return Provenance(
        gpu_name=gpu.name if gpu is not None else None,
        gpu_arch=_arch(gpu.compute_cap) if gpu is not None else None,
        gpu_count=len(gpus) or None,
        driver=gpu.driver_version if gpu is not None else None,
        sglang_version=version,
        bundle_name=bundle_name,
        bundle_hash=bundle_hash,
        facts=facts,
    )


def for_slot(prov: Provenance, host: Host) -> Provenance:
    """A slot's rows count the GPUs its server sees, not the machine's. (No GPU probed: the
    server's own report fills it in, see :func:`with_server_info`.)"""
    if host.slot is None or prov.gpu_count is None:
        return prov
    return dataclasses.replace(prov, gpu_count=len(host.slot.gpus))


def with_server_info(prov: Provenance, info: Mapping[str, Any] | None) -> Provenance:
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
        ("verify_attention_backend", "verify_cuda_graph", "verify_cuda_graph_max_bs", "draft_block_size",
         "tree_sampler")
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
    max_bs = tree.get("verify_cuda_graph_max_bs")
    if isinstance(max_bs, int) and not isinstance(max_bs, bool) and max_bs > 0:
        out["verify_cuda_graph_max_bs"] = max_bs
    block = tree.get("draft_block_size")
    if isinstance(block, int) and not isinstance(block, bool) and block > 0:
        out["draft_block_size"] = block
    return out


__all__ = ["Provenance", "for_slot", "probe_provenance", "with_server_info"]
