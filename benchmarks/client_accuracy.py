"""Client accuracy: does our load client measure what the server really did?

Runs the simulator (autoregressive, GPU profile ``--gpu``, ``SIM_TIME_SCALE=1``) whose
step cost model is known exactly (``ddtree_ops.sim.profiles``), and at each concurrency
c sends one wave of c requests (ignore_eos, fixed length) after a warmup wave that opens
the connections. In that wave all c requests are prefilled together and then decode in
one batch of c, so the ground truth is:

    ITL            = step_ms(batch=c, verify_tokens=1)                 (every decode step)
    output tok/s   = c * n / (prefill_ms(sum prompt tokens) + (n-1) * ITL)

and the client's median per-token ITL and whole-run output tok/s are compared with it.
Because the simulator only meets its model when the machine has CPU to spare, the client
is also checked against the server's own clock: each response's ``meta_info.e2e_latency``
gives the server's tok/s for the wave (tokens / slowest server e2e) and the mean gap
between client-measured and server-measured e2e (HTTP + client overhead).
The simulator's own CPU work counts towards each modelled step, so where that work
exceeds the step (high concurrency on few cores) the server is slower than the model and
the "error" is the server's, not the client's; the CPU line printed at the end helps to
tell.

Both client modes are measured side by side (``--clients local,host``): ``local`` runs
the load engine (``ddtree_ops.bench._hostclient``) in this process, as a sweep with
``client: local`` does; ``host`` runs the same engine as the on-host client, started over
the local transport with this Python, as a sweep starts it on a GPU host. At each level
the modes take turns wave by wave (``--repeats`` waves each, medians kept), and the
``host vs local`` line gives their disagreement in tok/s, median and mean ITL; the goal is
within 2% at concurrency 1/8/32.

Other clients against the same server (``--tools``): SGLang's own ``python -m
sglang.bench_serving`` (``--bench-serving-python``: an interpreter with sglang and its client
deps, see design.md §5) and NVIDIA AIPerf (``--aiperf``: its ``aiperf`` command), each sending
the same shape of wave (random ids or synthetic text of the same input length, the same
output length with ignore_eos, the same concurrency, a warmup wave of c first), with a
model directory holding a real ``tokenizer.json`` for the simulator's vocabulary.

Every tool is held against the server's own clock: the simulator records when each request
arrived and when each decode step committed its tokens (``GET /sim/request_times``), so the
wave's true output tok/s, median per-token ITL and median TTFT are known for whichever
client sent it. Printed per tool: its own tok/s, median ITL and median TTFT, each against
the server's, and its CPU time per output token: ours, the client process's CPU time over
the measured wave (``LoadResult.cpu_s``); bench_serving's, the CPU time around its
``cli_main()`` inside its process (imports excluded, its warmup and tokenizer load
included: a slight over-estimate); AIPerf's (about ten processes), the CPU of its whole
process tree sampled from /proc every 20 ms, over the measured wave's span on the server's
clock (start-up and warmup excluded).

    .venv/bin/python benchmarks/client_accuracy.py
    .venv/bin/python benchmarks/client_accuracy.py --quick    # concurrency 1 and 4, 16 tokens
    .venv/bin/python benchmarks/client_accuracy.py --concurrency 1,8,32 --repeats 3 --json
    .venv/bin/python benchmarks/client_accuracy.py --tools ours,bench_serving,aiperf \
        --bench-serving-python /path/venv/bin/python --aiperf /path/venv/bin/aiperf \
        --concurrency 1,8,32,128,256 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ddtree_ops.bench.client import LoadSpec
from ddtree_ops.bench.metrics import calculate_metrics
from ddtree_ops.bench.onhost import HostClient, LoadClient, LocalClient
from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.sim.profiles import PROFILES
from ddtree_ops.sim.text import WORDS
from ddtree_ops.transport.local import LocalTransport
from ddtree_ops.workload.prompt import Prompt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_TOKENIZER_SCRIPT = """
import json, sys
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
root, words = Path(sys.argv[1]), json.load(sys.stdin)
vocab = {w: i for i, w in enumerate(words)}
vocab.setdefault("[UNK]", len(vocab))
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
root.mkdir(parents=True, exist_ok=True)
tok.save(str(root / "tokenizer.json"))
(root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
    "unk_token": "[UNK]", "eos_token": "<eos>", "model_max_length": 1 << 20}))
(root / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
    "vocab_size": len(vocab)}))
"""


def write_model_dir(python: str, root: Path) -> Path:
    """A model directory with a real tokenizer.json: one token per whitespace word over the
    simulator's words, which is how the simulator counts prompt tokens, so a real HF
    tokenizer (bench_serving's) and the server agree on lengths. Built by ``python`` (the
    bench_serving interpreter, which has ``tokenizers``)."""
    subprocess.run([python, "-c", _TOKENIZER_SCRIPT, str(root)], input=json.dumps(WORDS), text=True, check=True)
    return root


def start_sim(model_dir: Path, port: int, gpu: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, SIM_GPU=gpu, SIM_LOAD_S="0.2", SIM_TIME_SCALE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddtree_ops.sim", "--model-path", str(model_dir), "--host", "127.0.0.1",
         "--port", str(port), "--cuda-graph-max-bs-decode", "128", "--max-running-requests", "256"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit("simulator exited during start-up")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("simulator not ready after 120 s")


def truth(gpu: str, c: int, n: int, prompt_tokens: int) -> tuple[float, float]:
    """(ITL seconds, output tok/s) the cost model says one wave of c requests takes."""
    p = PROFILES[gpu]
    decode_ms = p.step_ms(batch=c, verify_tokens=1, draft_positions=0)
    prefill_ms = p.step_ms(batch=0, verify_tokens=0, draft_positions=0, prefill_tokens=prompt_tokens) + p.base_ms
    duration_s = (prefill_ms + (n - 1) * decode_ms) / 1000.0
    return decode_ms / 1000.0, c * n / duration_s


def make_clients(url: str, port: int) -> dict[str, LoadClient]:
    """Both modes against the same server: here, and on the 'host' (this machine, reached
    over the local transport, its Python being this one) as a sweep would start it."""
    host = Host(name="bench-host", connection="local", source="<client_accuracy>",
                ddtree=DdtreeSettings(python=sys.executable, server=ServerSettings(port=port)))
    return {"local": LocalClient(url), "host": HostClient(LocalTransport(host.name), host)}


@dataclass(frozen=True)
class Wave:
    """One tool's measured wave, in its own words (median ITL and TTFT per token and per
    request, as the tool reports them) and CPU; ``server`` is the same wave on the
    server's clock."""

    tok_s: float
    itl_median_s: float
    ttft_median_s: float
    tokens: int
    cpu_s: float
    server: ServerClock | None = None
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "tok_s": self.tok_s, "itl_median_s": self.itl_median_s, "ttft_median_s": self.ttft_median_s,
            "tokens": self.tokens, "cpu_s": self.cpu_s,
            "cpu_us_per_token": self.cpu_s / self.tokens * 1e6 if self.tokens else None, **self.extra,
        }
        if self.server is not None:
            out["server"] = dataclasses.asdict(self.server)
            out["vs_server_pct"] = {
                "tok_s": _pct(self.tok_s, self.server.tok_s),
                "itl_median": _pct(self.itl_median_s, self.server.itl_median_s),
            }
            out["ttft_minus_server_ms"] = (self.ttft_median_s - self.server.ttft_median_s) * 1e3
        return out


@dataclass(frozen=True)
class ServerClock:
    """A wave as the simulator timed it: arrival to each step's commit."""

    tok_s: float
    itl_median_s: float
    ttft_median_s: float
    tokens: int
    requests: int
    # The wave on CLOCK_MONOTONIC (shared by every process of this machine): its first
    # arrival and its last token.
    start: float = 0.0
    end: float = 0.0


def server_clock(url: str, requests: int) -> ServerClock | None:
    """The last ``requests`` requests the simulator finished (the measured wave: every
    tool sends its warmup wave first and waits for it), on its own clock; clears its log."""
    got = httpx.get(url + "/sim/request_times", timeout=30, trust_env=False).json()["requests"]
    wave = sorted(got, key=lambda r: r["created"])[-requests:] if requests > 0 else []
    if not wave or len(wave) < requests or any(not r["emits"] for r in wave):
        return None
    itls: list[float] = []
    for r in wave:
        emits = r["emits"]
        for (t0, _), (t1, n) in zip(emits, emits[1:], strict=False):
            itls.extend([(t1 - t0) / n] * n)
    tokens = sum(n for r in wave for _, n in r["emits"])
    span = max(r["emits"][-1][0] for r in wave) - min(r["created"] for r in wave)
    return ServerClock(
        tok_s=tokens / span, itl_median_s=statistics.median(itls) if itls else float("nan"),
        ttft_median_s=statistics.median(r["emits"][0][0] - r["created"] for r in wave),
        tokens=tokens, requests=len(wave),
        start=min(r["created"] for r in wave), end=max(r["emits"][-1][0] for r in wave),
    )


def ours(client: LoadClient, c: int, n: int, input_len: int) -> Wave:
    words = WORDS[1:]
    prompts = tuple(Prompt(text=" ".join(words[(i * 7 + j) % len(words)] for j in range(input_len))) for i in range(c))
    spec = LoadSpec(prompts=prompts, max_new_tokens=n, concurrency=c, warmup=c, sampling={"temperature": 0.0})
    load = client.run_load(spec)
    m = calculate_metrics(load.results, duration_s=load.duration_s)
    if m.failed:
        raise SystemExit(f"c={c}: {m.failed} requests failed: {m.errors}")
    return Wave(
        tok_s=m.output_tok_s, itl_median_s=(m.itl_ms.median or 0) / 1000, ttft_median_s=(m.ttft_ms.median or 0) / 1000,
        tokens=m.output_tokens, cpu_s=load.cpu_s,
        extra={"itl_mean_s": (m.itl_ms.mean or 0) / 1000, "coalesced_frac": m.coalesced_frac or 0.0},
    )


# Runs exactly what ``python -m sglang.bench_serving`` runs (its ``cli_main``), but
# measures the CPU time of the benchmark itself, not of importing sglang + transformers.
_BENCH_SERVING_DRIVER = """
import json, resource, sys
from sglang.benchmark.serving import cli_main
sys.argv = ["sglang.bench_serving"] + json.loads(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF)
cli_main()
after = resource.getrusage(resource.RUSAGE_SELF)
cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
print("BENCH_CPU_S", cpu)
"""


def bench_serving(python: str, url: str, model_dir: Path, c: int, n: int, input_len: int, out: Path) -> Wave:
    argv = ["--backend", "sglang", "--base-url", url, "--tokenizer", str(model_dir), "--model", str(model_dir),
            "--dataset-name", "random-ids", "--random-input-len", str(input_len), "--random-output-len", str(n),
            "--random-range-ratio", "1.0", "--num-prompts", str(c), "--max-concurrency", str(c),
            "--output-file", str(out), "--warmup-requests", str(c)]
    done = subprocess.run([python, "-c", _BENCH_SERVING_DRIVER, json.dumps(argv)], capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    cpu = float(next(ln.split()[1] for ln in done.stdout.splitlines() if ln.startswith("BENCH_CPU_S")))
    row = json.loads(out.read_text().splitlines()[-1])
    return Wave(tok_s=row["output_throughput"], itl_median_s=row["median_itl_ms"] / 1000,
                ttft_median_s=row["median_ttft_ms"] / 1000, tokens=row["total_output_tokens"], cpu_s=cpu)


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _tree_cpu(root: int) -> float:
    """CPU seconds (user + system) of ``root`` and every live descendant, from /proc."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parent[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) * _TICK_S
    total, todo = 0.0, [root]
    seen = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += cpu.get(pid, 0.0)
        todo.extend(p for p, pp in parent.items() if pp == pid)
    return total


def _cpu_between(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """CPU spent between two monotonic times, interpolated from (time, cumulative CPU) samples."""

    def at(t: float) -> float:
        for (t0, c0), (t1, c1) in zip(samples, samples[1:], strict=False):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
        return samples[-1][1] if t > samples[-1][0] else samples[0][1]

    return at(end) - at(start)


def aiperf(aiperf_cmd: str, url: str, model_dir: Path, c: int, n: int, input_len: int, out: Path) -> Wave:
    """AIPerf's wave. It runs ~10 processes started for the run, so its CPU is that of its
    whole process tree sampled every 20 ms from /proc and taken over the measured wave's
    span on the server's clock (start-up and warmup excluded)."""
    argv = [aiperf_cmd, "profile", "--model", str(model_dir), "--tokenizer", str(model_dir), "--url", url,
            "--endpoint-type", "completions", "--streaming", "--concurrency", str(c), "--request-count", str(c),
            "--warmup-request-count", str(c), "--prompt-input-tokens-mean", str(input_len),
            "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(n),
            "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--ui-type", "none",
            "--output-artifact-dir", str(out / "run")]
    samples: list[tuple[float, float]] = []
    with open(out / "aiperf.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=out)
        while proc.poll() is None:
            samples.append((time.monotonic(), _tree_cpu(proc.pid)))
            time.sleep(0.02)
    summary = out / "run" / "profile_export_aiperf.json"
    if proc.returncode != 0 or not summary.exists():
        raise RuntimeError((out / "aiperf.log").read_text()[-3000:])
    d = json.loads(summary.read_text())
    clock = server_clock(url, c)
    cpu = _cpu_between(samples, clock.start, clock.end) if clock is not None and samples else float("nan")
    return Wave(tok_s=d["output_token_throughput"]["avg"], itl_median_s=d["inter_token_latency"]["p50"] / 1000,
                ttft_median_s=d["time_to_first_token"]["p50"] / 1000, tokens=int(d["total_osl"]["avg"]),
                cpu_s=cpu, server=clock)


def _pct(a: float, b: float) -> float:
    return (a / b - 1) * 100 if b else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--gpu", default="h200", choices=sorted(PROFILES))
    ap.add_argument("--tools", default="ours", help="Clients to measure, in turn: ours, bench_serving, aiperf.")
    ap.add_argument("--clients", default="local,host", help="Our client modes (tool 'ours'): local, host.")
    ap.add_argument("--repeats", type=int, default=1, help="Waves per tool and level; medians are reported.")
    ap.add_argument("--json", action="store_true", help="One JSON object per level on stdout instead of the table.")
    ap.add_argument("--bench-serving-python", default=None, help="Interpreter with sglang + its client deps.")
    ap.add_argument("--aiperf", default="aiperf", help="The aiperf command (tool 'aiperf').")
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 4, 16 output tokens, one wave each")
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.output_len, args.repeats = "1,4", 16, 1
    levels = [int(x) for x in args.concurrency.split(",")]
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    if not tools or any(t not in ("ours", "bench_serving", "aiperf") for t in tools):
        raise SystemExit("--tools: give ours, bench_serving, aiperf (comma-separated)")
    modes = [m.strip() for m in args.clients.split(",") if m.strip()] if "ours" in tools else []
    if any(m not in ("local", "host") for m in modes) or ("ours" in tools and not modes):
        raise SystemExit("--clients: give local, host or both")
    if "bench_serving" in tools and not args.bench_serving_python:
        raise SystemExit("--tools bench_serving needs --bench-serving-python")
    if "aiperf" in tools and shutil.which(args.aiperf) is None:
        raise SystemExit(f"--tools aiperf: no command {args.aiperf!r} (give --aiperf)")
    names = [f"ours-{m}" for m in modes] + [t for t in tools if t != "ours"]
    n = args.output_len
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "sim-model"
        if args.bench_serving_python:
            write_model_dir(args.bench_serving_python, model_dir)
        elif "aiperf" in tools:
            write_model_dir(str(Path(shutil.which(args.aiperf) or "").parent / "python"), model_dir)
        port = free_port()
        sim = start_sim(model_dir, port, args.gpu)
        url = f"http://127.0.0.1:{port}"
        clients = make_clients(url, port)
        counter = iter(range(1_000_000))

        def one(name: str, c: int) -> Wave:
            out = Path(tmp) / f"{name}-{c}-{next(counter)}"
            out.mkdir()
            server_clock(url, 0)  # reads and drops what came before: each wave's clock is its own
            if name == "bench_serving":
                wave = bench_serving(args.bench_serving_python, url, model_dir, c, n, args.input_len, out / "bs.jsonl")
            elif name == "aiperf":
                return aiperf(args.aiperf, url, model_dir, c, n, args.input_len, out)
            else:
                wave = ours(clients[name.removeprefix("ours-")], c, n, args.input_len)
            return dataclasses.replace(wave, server=server_clock(url, c))

        try:
            if not args.json:
                print(f"# simulator profile {args.gpu}, SIM_TIME_SCALE=1, input {args.input_len} tokens, output {n} "
                      f"tokens, one wave of c requests (after a warmup wave of c) per tool and level, "
                      f"{args.repeats} per tool (median); {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
                print(f"{'c':>4} {'tool':<14} {'tok/s':>9} {'server':>9} {'err':>7} {'ITL ms':>8} {'server':>8} "
                      f"{'err':>7} {'TTFT ms':>8} {'server':>8} {'CPU us/tok':>10}")
            for c in levels:
                runs: dict[str, list[Wave]] = {t: [] for t in names}
                for _ in range(args.repeats):  # tools take turns: background load falls on all alike
                    for name in names:
                        runs[name].append(one(name, c))
                record: dict[str, object] = {"concurrency": c}
                itl_model, tok_model = truth(args.gpu, c, n, args.input_len)
                record["model"] = {"itl_s": itl_model, "tok_s": tok_model}
                for name, waves in runs.items():
                    record[name] = _median_wave(waves)
                if args.json:
                    print(json.dumps(record), flush=True)
                    continue
                for name in names:
                    w = record[name]
                    assert isinstance(w, dict)
                    srv = w.get("server") or {}
                    print(f"{c:>4} {name:<14} {w['tok_s']:>9.1f} {srv.get('tok_s', float('nan')):>9.1f} "
                          f"{_pct(w['tok_s'], srv.get('tok_s', 0)):>+6.1f}% {w['itl_median_s'] * 1e3:>8.3f} "
                          f"{srv.get('itl_median_s', float('nan')) * 1e3:>8.3f} "
                          f"{_pct(w['itl_median_s'], srv.get('itl_median_s', 0)):>+6.1f}% "
                          f"{w['ttft_median_s'] * 1e3:>8.2f} {srv.get('ttft_median_s', float('nan')) * 1e3:>8.2f} "
                          f"{w['cpu_us_per_token']:>10.1f}", flush=True)
        finally:
            sim.terminate()
            try:
                sim.wait(15)
            except subprocess.TimeoutExpired:
                sim.kill()


def _median_wave(waves: list[Wave]) -> dict[str, object]:
    """Per field, the median over the repeats (a single wave as it is)."""
    dicts = [w.as_dict() for w in waves]
    if len(dicts) == 1:
        return dicts[0]

    def med(values: list[object]) -> object:
        dicts_only = [v for v in values if isinstance(v, dict)]
        if dicts_only and len(dicts_only) == len(values):
            return {k: med([v[k] for v in dicts_only]) for k in dicts_only[0]}
        nums = [v for v in values if isinstance(v, (int, float))]
        return statistics.median(nums) if nums else None

    return {k: med([d[k] for d in dicts]) for k in dicts[0]}


if __name__ == "__main__":
    main()
