"""SGLang 0.5.23's own argument resolution of launches, with the device query answering as
a given GPU (run by ``test_launch_matrix.py`` in the interpreter of a prefix the DDTree
bundle was deployed into; no server, no GPU).

``python launch_matrix.py CASES.json`` where the file holds ``{"machines": {name: {"name",
"capability": [major, minor], "memory_mib"}}, "cases": [{"machine", "argv"}, ...]}``; prints
one JSON list, per case what ``prepare_server_args`` + ``resolve_once`` (the launcher's own
path, ``launch_server.py``, after ``load_plugins``) decided, or the exception it raised.

What is answered as the GPU, and why each:

* ``torch.cuda.is_available`` / ``device_count`` / ``current_device`` / ``is_initialized``
  (True: ``get_device_sm`` then asks torch, not NVML, which is absent here) and
  ``torch.version.cuda`` "13.0" (the CUDA of the torch 2.14.1 wheel 0.5.23 pins; torchvision
  checks the two agree at import): every ``is_sm*`` / ``is_hopper_with_cuda_12_3`` probe of
  ``srt/utils/common.py`` reads these;
* ``get_device_capability`` / ``get_device_name`` / ``get_device_properties`` /
  ``mem_get_info``: the capability, the name and the memory (``get_nvgpu_memory_capacity``
  falls back to ``mem_get_info`` without nvidia-smi), which size the graph batch sizes;
* FlashInfer present (``override_platform(has_flashinfer=True)``, SGLang's own way to say
  what the machine is): 0.5.23 requires ``flashinfer_python`` on every CUDA host; this CPU
  venv does not install it.

The probes are ``lru_cache``-d; they are cleared between machine types. Only the DDTree
plugin is loaded (``SGLANG_PLUGINS=ddtree``): the CPU stand-ins are not part of any GPU's
launch.
"""

from __future__ import annotations

import json
import logging
import sys
import types
from typing import Any

import torch

GPU: dict[str, Any] = {}


def _props(device: Any = None) -> Any:
    major, minor = GPU["capability"]
    return types.SimpleNamespace(
        name=GPU["name"], major=major, minor=minor, total_memory=GPU["memory_mib"] << 20,
        multi_processor_count=132, is_integrated=False, L2_cache_size=50 << 20, gcnArchName="",
    )


def answer_as_gpu() -> None:
    cuda = torch.cuda
    cuda.is_available = lambda: True  # type: ignore[assignment]
    cuda.device_count = lambda: 8  # type: ignore[assignment]
    cuda.current_device = lambda: 0  # type: ignore[assignment]
    cuda.is_initialized = lambda: True  # type: ignore[assignment]
    cuda.get_device_capability = lambda device=None: tuple(GPU["capability"])  # type: ignore[assignment]
    cuda.get_device_name = lambda device=None: GPU["name"]  # type: ignore[assignment]
    cuda.get_device_properties = _props  # type: ignore[assignment]
    cuda.mem_get_info = lambda device=None: (  # type: ignore[assignment]
        (GPU["memory_mib"] - 1024) << 20, GPU["memory_mib"] << 20)
    torch.version.cuda = "13.0"  # type: ignore[misc]


def _clear_probes() -> None:
    from sglang.srt.utils import common

    for value in vars(common).values():
        clear = getattr(value, "cache_clear", None)
        if callable(clear):
            clear()


def resolve(argv: list[str]) -> dict[str, Any]:
    from sglang.srt.arg_groups.model_override_base import attention_backends_of
    from sglang.srt.arg_groups.overrides import max_speculative_num_draft_tokens, resolved_view
    from sglang.srt.server_args import prepare_server_args

    try:
        args = prepare_server_args(argv)
        args.resolve_once()
    except Exception as exc:  # what the launcher would print as its last line
        return {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    view = resolved_view(args)
    prefill, decode = attention_backends_of(view)
    verify = decode if view.speculative_attention_mode == "decode" else prefill
    graphs = view.cuda_graph_config.decode
    return {
        "ok": True,
        "attention_backend": view.attention_backend,
        "verify_backend": verify if view.speculative_algorithm else decode,
        "draft_backend": view.speculative_draft_attention_backend,
        "page_size": view.page_size,
        "decode_graphs": graphs.backend,
        "graph_max_bs": graphs.max_bs,
        "max_running_requests": view.max_running_requests,
        "topk": view.speculative_eagle_topk,
        "num_draft_tokens": view.speculative_num_draft_tokens,
        "kv_reserve_tokens": max_speculative_num_draft_tokens(args) if view.speculative_algorithm else None,
    }


def main(path: str) -> None:
    spec = json.loads(open(path, encoding="utf-8").read())
    GPU.update(next(iter(spec["machines"].values())))  # SGLang asks at import already
    answer_as_gpu()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    logging.disable(logging.WARNING)  # SGLang logs every default it picks; the answer is the result
    from sglang.srt.runtime_context import override_platform

    out: list[dict[str, Any]] = [{} for _ in spec["cases"]]
    for machine, gpu in spec["machines"].items():
        GPU.clear()
        GPU.update(gpu)
        _clear_probes()
        with override_platform(has_flashinfer=True):
            for i, case in enumerate(spec["cases"]):
                if case["machine"] == machine:
                    out[i] = resolve(case["argv"])
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
