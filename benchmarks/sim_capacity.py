"""How much load one simulator process carries before its own CPU work distorts timing.

Starts ``python -m ddtree_ops.sim`` (a real subprocess on a free loopback port), then for
each concurrency level opens that many streaming ``/generate`` requests at once and
measures, per request, the interval between stream chunks after the first (one chunk
per decode step). The cost model says what that interval should be
(``GpuProfile.step_ms`` for the batch, times ``SIM_TIME_SCALE``); the ratio measured /
modelled shows where the simulator stops being a faithful clock (> 1.05 = distorted).
The client runs in this process on the same cores, as a benchmark client would. The
simulator runs on a small real SGLang 0.5.23 prefix with the DDTree bundle deployed into it
(``tests/minisglang.py``, made at the start): it serves DDTREE only from the deployed plugin.

    .venv/bin/python benchmarks/sim_capacity.py                 # default grid
    .venv/bin/python benchmarks/sim_capacity.py --scales 1 --concurrency 1,8,32
    .venv/bin/python benchmarks/sim_capacity.py --quick         # DDTREE-16, scale 1, concurrency 1 and 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from ddtree_ops.sim.profiles import PROFILES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from minisglang import deployed_python  # noqa: E402


@dataclass(frozen=True)
class Cell:
    mode: str
    scale: float
    concurrency: int
    tokens_per_s: float
    itl_ms_measured: float
    itl_ms_model: float

    @property
    def ratio(self) -> float:
        return self.itl_ms_measured / self.itl_ms_model if self.itl_ms_model else float("nan")


MODES = {
    "AR": ([], 1, 0),
    "DDTREE-16": (["--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "17",
                   "--speculative-eagle-topk", "4"], 17, 16),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(flags: list[str], scale: float, gpu: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {**os.environ, "SIM_GPU": gpu, "SIM_LOAD_S": "0", "SIM_WARMUP_S": "0", "SIM_TIME_SCALE": str(scale)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [deployed_python(), "-m", "ddtree_ops.sim", "--model-path", "bench", "--port", str(port),
             "--max-running-requests", "512", *flags],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-4:])
            raise SystemExit(f"simulator exited with {proc.returncode} (b300 + DDTREE budget > 8 fails capture by "
                             f"design); log tail: {tail}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("simulator did not become ready")


async def _one(client: httpx.AsyncClient, url: str, tokens: int, seed: int) -> tuple[list[float], int]:
    stamps: list[float] = []
    done = 0
    body = {"text": f"benchmark prompt number {seed}", "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    async with client.stream("POST", url + "/generate", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
                done = json.loads(line[6:])["meta_info"]["completion_tokens"]
    return stamps, done


async def _level(url: str, concurrency: int, tokens: int) -> tuple[float, float]:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, tokens, i) for i in range(concurrency)))
        wall = time.perf_counter() - t0
    total = sum(n for _, n in results)
    itls = [(s[-1] - s[1]) / (len(s) - 2) for s, _ in results if len(s) > 2]
    return total / wall, statistics.median(itls) * 1000 if itls else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--scales", default="1,0.1")
    ap.add_argument("--concurrency", default="1,8,32,64,128")
    ap.add_argument("--modes", default="AR,DDTREE-16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true",
                    help="DDTREE-16 at scale 1, concurrency 1 and 8, 16 tokens a request")
    opts = ap.parse_args()
    if opts.quick:
        opts.modes, opts.scales, opts.concurrency, opts.tokens = "DDTREE-16", "1", "1,8", 16
    profile = PROFILES[opts.gpu]
    cells: list[Cell] = []
    print(f"profile={opts.gpu} tokens/request={opts.tokens} cores={os.cpu_count()} "
          f"load={os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'mode':<10} {'scale':>6} {'conc':>5} {'tok/s':>9} {'ITL ms':>8} {'model ms':>9} {'ratio':>6}")
    logs = tempfile.TemporaryDirectory(prefix="sim-capacity-")  # each server's log, for its tail on a failure
    for mode in opts.modes.split(","):
        flags, verify_tokens, draft = MODES[mode]
        for scale in (float(s) for s in opts.scales.split(",")):
            proc, url = _start(flags, scale, opts.gpu, Path(logs.name) / f"{mode}-{scale:g}.log")
            try:
                for conc in (int(c) for c in opts.concurrency.split(",")):
                    tps, itl = asyncio.run(_level(url, conc, opts.tokens))
                    model = profile.step_ms(batch=conc, verify_tokens=verify_tokens, draft_positions=draft) * scale
                    cell = Cell(mode, scale, conc, tps, itl, model)
                    cells.append(cell)
                    flag = "" if cell.ratio <= 1.05 else "  <- distorted (>5%)"
                    print(f"{mode:<10} {scale:>6g} {conc:>5} {tps:>9.0f} {itl:>8.2f} {model:>9.2f}"
                          f" {cell.ratio:>6.2f}{flag}", flush=True)
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait()


if __name__ == "__main__":
    main()
