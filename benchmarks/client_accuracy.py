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

Both client modes are measured side by side (``--clients local,host``): ``local`` is the
controller's httpx client in this process, ``host`` is the on-host client
(``ddtree_ops.bench._hostclient``) started over the local transport with this Python, as
a sweep starts it on a GPU host. At each level the modes take turns wave by wave
(``--repeats`` waves each, medians kept), and the ``host vs local`` line gives their
disagreement in tok/s, median and mean ITL; the goal is within 2% at concurrency 1/8/32.

Optionally (``--bench-serving-python``) SGLang's own ``python -m sglang.bench_serving``
runs the same shape of workload (`random-ids` dataset: random token ids, no download; same input/output lengths, same
concurrency) against the same server, from an interpreter that has sglang and its client
deps installed (see design.md §5), with a model directory holding a real
``tokenizer.json`` for the simulator's vocabulary. Printed side by side: throughput, median
ITL and client CPU time per output token (ours: the process CPU time of the measured
requests, ``LoadResult.cpu_s``; theirs: the CPU time around ``cli_main()`` — the function
``python -m sglang.bench_serving`` runs — measured inside its process: import start-up
excluded, but its warmup (c requests of at most 32 tokens), tokenizer load and result
writing included, so its figure is a slight over-estimate).

    .venv/bin/python benchmarks/client_accuracy.py
    .venv/bin/python benchmarks/client_accuracy.py --concurrency 1,8,32 --repeats 3 --json
    .venv/bin/python benchmarks/client_accuracy.py --bench-serving-python /path/venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ddtree_ops.bench.client import LoadSpec
from ddtree_ops.bench.metrics import calculate_metrics
from ddtree_ops.bench.onhost import HostClient, LoadClient, LocalClient
from ddtree_ops.bench.prompts import Prompt
from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.sim.profiles import PROFILES
from ddtree_ops.sim.text import WORDS
from ddtree_ops.transport.local import LocalTransport


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


def ours(client: LoadClient, c: int, n: int, input_len: int) -> dict[str, float]:
    words = WORDS[1:]
    prompts = tuple(Prompt(text=" ".join(words[(i * 7 + j) % len(words)] for j in range(input_len))) for i in range(c))
    spec = LoadSpec(prompts=prompts, max_new_tokens=n, concurrency=c, warmup=c, sampling={"temperature": 0.0})
    load = client.run_load(spec)
    cpu = load.cpu_s
    m = calculate_metrics(load.results, duration_s=load.duration_s)
    if m.failed:
        raise SystemExit(f"c={c}: {m.failed} requests failed: {m.errors}")
    server_e2e = [r.server_e2e for r in load.results if r.server_e2e is not None]
    client_e2e = [r.e2e for r in load.results if r.server_e2e is not None]
    return {
        "tok_s": m.output_tok_s,
        "itl_median_s": (m.itl_ms.median or 0) / 1000,
        "itl_mean_s": (m.itl_ms.mean or 0) / 1000,
        "tokens": m.output_tokens,
        "prompt_tokens": m.input_tokens,
        "cpu_s": cpu,
        # The server's view of the same wave: its slowest request's e2e bounds the wave.
        "server_tok_s": m.output_tokens / max(server_e2e) if server_e2e else float("nan"),
        "e2e_gap_ms": (sum(client_e2e) - sum(server_e2e)) / len(server_e2e) * 1e3 if server_e2e else float("nan"),
    }


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


def bench_serving(
    python: str, url: str, model_dir: Path, c: int, n: int, input_len: int, out: Path
) -> dict[str, float]:
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
    return {"tok_s": row["output_throughput"], "itl_median_s": row["median_itl_ms"] / 1000,
            "tokens": row["total_output_tokens"], "cpu_s": cpu}


def _median_runs(
    clients: dict[str, LoadClient], modes: list[str], c: int, n: int, input_len: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Per mode, the median of ``repeats`` waves; the modes alternate wave by wave, so that
    a change in the machine's background load falls on both alike."""
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(repeats):
        for m in modes:
            runs[m].append(ours(clients[m], c, n, input_len))
    return {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}


def _pct(a: float, b: float) -> float:
    return (a / b - 1) * 100 if b else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--gpu", default="h200", choices=sorted(PROFILES))
    ap.add_argument("--clients", default="local,host", help="Client modes to measure, in turn: local, host.")
    ap.add_argument("--repeats", type=int, default=1, help="Waves per mode and level; medians are reported.")
    ap.add_argument("--json", action="store_true", help="One JSON object per level on stdout instead of the table.")
    ap.add_argument("--bench-serving-python", default=None, help="Interpreter with sglang + its client deps.")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    modes = [m.strip() for m in args.clients.split(",") if m.strip()]
    if not modes or any(m not in ("local", "host") for m in modes):
        raise SystemExit("--clients: give local, host or both")
    n = args.output_len
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "sim-model"
        if args.bench_serving_python:
            write_model_dir(args.bench_serving_python, model_dir)
        port = free_port()
        sim = start_sim(model_dir, port, args.gpu)
        url = f"http://127.0.0.1:{port}"
        clients = make_clients(url, port)
        try:
            with_bs = bool(args.bench_serving_python)
            both = "local" in modes and "host" in modes
            if not args.json:
                print(
                    f"# simulator profile {args.gpu}, SIM_TIME_SCALE=1, input {args.input_len} tokens, output {n} "
                    f"tokens, one wave of c requests per level, {args.repeats} per mode (median); "
                    f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
                )
                head = f"{'c':>3} {'mode':>5} {'model ITL ms':>12} {'ITL ms':>8} {'err':>6} {'model tok/s':>11} "
                head += f"{'tok/s':>9} {'err':>6} {'server tok/s':>12} {'err':>6} {'e2e gap ms':>10} {'CPU us/tok':>10}"
                if with_bs:
                    head += "  | bench_serving tok/s  ITL ms  CPU us/tok"
                print(head)
            for c in levels:
                got = _median_runs(clients, modes, c, n, args.input_len, args.repeats)
                first = got[modes[0]]
                itl_true, tok_true = truth(args.gpu, c, n, int(first["prompt_tokens"]))
                record: dict[str, object] = {"concurrency": c, "model_itl_s": itl_true, "model_tok_s": tok_true}
                for m in modes:
                    record[m] = got[m]
                if both:
                    record["host_vs_local_pct"] = {
                        "tok_s": _pct(got["host"]["tok_s"], got["local"]["tok_s"]),
                        "itl_median": _pct(got["host"]["itl_median_s"], got["local"]["itl_median_s"]),
                        "itl_mean": _pct(got["host"]["itl_mean_s"], got["local"]["itl_mean_s"]),
                    }
                bs = None
                if with_bs:
                    bs = bench_serving(
                        args.bench_serving_python, url, model_dir, c, n, args.input_len, Path(tmp) / f"bs{c}.jsonl"
                    )
                    record["bench_serving"] = bs
                if args.json:
                    print(json.dumps(record), flush=True)
                    continue
                for m in modes:
                    g = got[m]
                    line = (f"{c:>3} {m:>5} {itl_true * 1e3:>12.3f} {g['itl_median_s'] * 1e3:>8.3f} "
                            f"{_pct(g['itl_median_s'], itl_true):>+5.1f}% {tok_true:>11.1f} {g['tok_s']:>9.1f} "
                            f"{_pct(g['tok_s'], tok_true):>+5.1f}% {g['server_tok_s']:>12.1f} "
                            f"{_pct(g['tok_s'], g['server_tok_s']):>+5.1f}% {g['e2e_gap_ms']:>10.2f} "
                            f"{g['cpu_s'] / g['tokens'] * 1e6:>10.1f}")
                    if bs is not None and m == modes[-1]:
                        line += (f"  | {bs['tok_s']:>19.1f} {bs['itl_median_s'] * 1e3:>7.3f} "
                                 f"{bs['cpu_s'] / bs['tokens'] * 1e6:>11.1f}")
                    print(line, flush=True)
                if both:
                    d = record["host_vs_local_pct"]
                    assert isinstance(d, dict)
                    print(f"{c:>3} host vs local: tok/s {d['tok_s']:+.2f}%  median ITL {d['itl_median']:+.2f}%  "
                          f"mean ITL {d['itl_mean']:+.2f}%", flush=True)
        finally:
            sim.terminate()
            try:
                sim.wait(15)
            except subprocess.TimeoutExpired:
                sim.kill()


if __name__ == "__main__":
    main()
