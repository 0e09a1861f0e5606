"""The whole ddtree-ops pipeline against the REAL SGLang 0.5.23 server on CPU, once, without
the simulator: ``deploy`` the DDTree bundle into a host's SGLang, ``restart`` it on DDTREE,
``bench`` a small sweep (autoregressive baseline + DDTREE at T=0 and T>0), ``report`` to
CSV -- through the real CLI entry point and the local transport.

The host is this machine (``ansible_connection: local``) with its own Python prefix holding
a private copy of SGLang 0.5.23 (prefix.py), so the deploy writes into a real, untouched
SGLang package and the server that restart launches imports what was deployed. The model
is the tiny target of models.py with its byte-level tokenizer (a benchmark sends text) and
the built DFlash draft, whose drafts are often right: DDTREE must accept more than one
token per verify step, and its rows must say which tree, backend and graph mode served.
"""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from cli_json import json_data
from fleetlib import fast_root

from ddtree_ops.bench import ledger
from ddtree_ops.bench._hostclient import output_hash
from ddtree_ops.bench.client import LoadSpec
from ddtree_ops.bench.onhost import LocalClient
from ddtree_ops.inventory import load_inventory
from ddtree_ops.patching.bundle import load_bundle
from ddtree_ops.service import lifecycle
from ddtree_ops.transport.local import LocalTransport
from ddtree_ops.workload.prompt import Prompt

from . import models
from . import prefix as prefixes
from .server import BASE_ARGS, free_port
from .serverenv import COVERAGE_VARS, server_env

pytestmark = [pytest.mark.slow, pytest.mark.sglang_real, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / "patches" / "ddtree_temperature"
HOST = "sglang-cpu"
GROUP = "cpu"
BUDGET, TOPK = 4, 2
TEMPERATURES = (0.0, 0.7)
NUM_PROMPTS, MAX_NEW_TOKENS = 3, 24

# BASE_ARGS without --skip-tokenizer-init: the benchmark sends text. The DFlash-family
# draft worker needs a draft attention backend the CPU stand-ins provide.
CPU_ARGS = [a for a in BASE_ARGS if a != "--skip-tokenizer-init"] + [
    "--speculative-draft-attention-backend", "torch_native",
]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _ok_json(result: Any, what: str) -> Any:
    assert result.exit_code == 0, f"{what} exited {result.exit_code}:\n{result.stderr[-4000:]}\n{result.stdout[-4000:]}"
    return json_data(result.stdout)


def _server_log(run_dir: Path) -> str:
    try:
        return "\n".join((run_dir / "server.log").read_text(errors="replace").splitlines()[-60:])
    except FileNotFoundError:
        return "<no server.log>"


@pytest.fixture
def cpu_host(
    sglang_cpu_env: Path, tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, Any]]:
    """An inventory with one local host whose Python is a fresh SGLang 0.5.23 prefix and
    whose server is the real SGLang on CPU; the finaliser stops whatever it still runs."""
    monkeypatch.setenv("DDTREE_OPS_STATE", str(tmp_path / "state.json"))
    for key in COVERAGE_VARS:  # this server runs code other tests measure (serverenv.py)
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("DDTREE_OPS_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing may land in the repository (results/ defaults)
    root, owned = fast_root(tmp_path / "prefixes")
    python = prefixes.make_prefix(root / HOST)
    run_dir = tmp_path / "run"
    home = tmp_path / "server-home"
    home.mkdir()
    env = {
        **server_env(),
        # The server's caches in the test's tmp dir; the models are local dirs.
        "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        # T>0 on CPU: the pure-torch twin of the sampling kernel (sgl_kernel's is CUDA-only).
        "SGLANG_DDTREE_REFERENCE_SAMPLER": "1",
    }
    inventory = tmp_path / "cpu.yaml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {GROUP: {"hosts": {HOST: {
        "ansible_connection": "local",
        "ddtree": {
            "python": str(python),
            "gpu": "cpu",
            "run_dir": str(run_dir),
            "server": {
                "model_path": str(tiny_models["target"]),
                "draft_model_path": str(tiny_models["draft"]),
                "port": free_port(),
                "bind_host": "127.0.0.1",
                "expected_load_s": 60,
                "extra_args": CPU_ARGS,
                "env": env,
            },
        },
    }}}}}}, sort_keys=False))
    host = load_inventory([inventory]).resolve(HOST)[0]
    try:
        yield {"inventory": inventory, "python": python, "run_dir": run_dir, "host": host,
               "url": f"http://127.0.0.1:{host.ddtree.server.port}"}
    finally:
        try:
            with LocalTransport(host.name) as t:
                lifecycle.stop(t, host, grace_s=10.0)
        finally:
            if owned:
                shutil.rmtree(root, ignore_errors=True)


TEXT_PROMPTS = ("The quick brown fox jumps over the lazy dog. ",
                "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)\n")
# A chat prompt: /generate gets it as the ids the server's /v1/tokenize renders it to.
CHAT_PROMPT = [("system", "Answer briefly."), ("user", "Speculative decoding drafts a tree: why verify it at once?")]


def _sweep(path: Path, prompts: Path) -> Path:
    prompts.write_text(
        "".join(json.dumps({"prompt": text, "id": f"p{i}"}) + "\n" for i, text in enumerate(TEXT_PROMPTS))
        + json.dumps({"messages": [{"role": r, "content": c} for r, c in CHAT_PROMPT], "id": "chat"}) + "\n"
    )
    path.write_text(yaml.safe_dump({
        "name": "cpu-pipeline",
        "description": "DDTREE on the real SGLang 0.5.23 on CPU",
        "targets": [GROUP],
        "baselines": ["autoregressive"],
        "grid": {
            "algorithm": ["ddtree"], "budget": [BUDGET], "topk": [TOPK],
            "temperature": list(TEMPERATURES), "concurrency": [2],
        },
        "workload": {"prompt_files": [str(prompts)], "num_prompts": NUM_PROMPTS,
                     "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "seed": 0},
        "repeats": 1,
        "warmup": 1,
        "request_timeout_s": 120,
    }, sort_keys=False))
    return path


def test_deploy_restart_bench_report_on_real_sglang(
    cpu_host: dict[str, Any], cli: Callable[..., Any], tmp_path: Path
) -> None:
    inv = ("-i", str(cpu_host["inventory"]))
    run_dir: Path = cpu_host["run_dir"]
    python: Path = cpu_host["python"]

    # deploy: the bundle's files land beside (and inside) the prefix's own SGLang package.
    deployed = _ok_json(cli("--json", *inv, "deploy", HOST, str(BUNDLE)), "deploy")
    assert [r["host"] for r in deployed] == [HOST]
    assert deployed[0]["ok"] is True and deployed[0]["outcome"] == "applied", deployed[0]
    where = subprocess.run([str(python), "-c", "import sglang; print(sglang.__file__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    sglang_dir = Path(where).parent
    assert sglang_dir.is_relative_to(python.parent.parent), f"{sglang_dir}: not the prefix's own SGLang"
    for f in load_bundle(BUNDLE).files:
        assert _sha256(sglang_dir / f.path) == f.sha256, f"{f.path} not deployed"
    again = _ok_json(cli("--json", *inv, "deploy", HOST, str(BUNDLE)), "deploy again")
    assert again[0]["ok"] is True and again[0]["outcome"] == "noop", again[0]

    # restart on DDTREE: the new process serves the tree that was asked for, from the plugin.
    restarted = cli("--json", *inv, "restart", HOST, "--algorithm", "DDTREE",
                    "--budget", str(BUDGET), "--topk", str(TOPK))
    assert restarted.exit_code == 0, f"restart: {restarted.stderr[-3000:]}\n{_server_log(run_dir)}"
    result = json_data(restarted.stdout)["hosts"][0]["result"]
    info = httpx.get(cpu_host["url"] + "/server_info", timeout=10).json()
    assert info["speculative_algorithm"] == "DDTREE", info
    tree = info["ddtree"]
    assert (tree["budget"], tree["topk"], tree["draft_block_size"]) == (BUDGET, TOPK, 8), tree
    assert tree["tree_mask"]["capture_input"] == "DDTreeVerifyInput with the runner's mask buffer", tree
    assert len(tree["tree_mask"]["hooks_in_place"]) == 12 and tree["sampler"] == "reference", tree
    # Launched without the eager flags, but SGLang has no CUDA graphs on CPU: restart
    # reports the mode the server resolved, not the one it asked for.
    assert "disabled" not in result["argv"], result["argv"]
    assert tree["verify_cuda_graph_captured"] is False, tree
    assert result["cuda_graph"] is False and result["fallback_reason"] is None, result

    # bench: an AR baseline and DDTREE at two temperatures, every row measured and ok.
    out = tmp_path / "results" / "cpu.jsonl"
    sweep = _sweep(tmp_path / "cpu_sweep.yaml", tmp_path / "prompts.jsonl")
    bench = cli(*inv, "bench", "--sweep", str(sweep), "--out", str(out))
    assert bench.exit_code == 0, f"bench: {bench.stderr[-3000:]}\n{bench.stdout[-2000:]}\n{_server_log(run_dir)}"
    read = ledger.read_ledger(out)
    assert read.bad_lines == []
    rows = {(r["algorithm"], r["temperature"]): r for r in read.rows}
    # Baselines run at every temperature and concurrency of the grid (bench/plan.py).
    assert sorted(rows) == [(a, t) for a in ("AR", "DDTREE") for t in TEMPERATURES], list(rows)
    for key, row in rows.items():
        assert row["status"] == "ok" and row["error"] is None, (key, row["error"])
        assert row["completed"] == NUM_PROMPTS and row["failed"] == 0, (key, row)
        assert row["total_output_tokens"] == NUM_PROMPTS * MAX_NEW_TOKENS, (key, row)
        # The server counted what it was sent: the text prompts byte for byte (the tiny
        # tokenizer has one id per byte and adds no BOS), the chat prompt as the model's
        # own chat template renders it, never a transcript of ours.
        assert row["workload_prompt_format"] == "chat-template+text", row
        sent = sum(len(t.encode()) for t in TEXT_PROMPTS) + len(models.render_chat(CHAT_PROMPT).encode())
        assert row["total_input_tokens"] == sent, (key, row["total_input_tokens"], sent)
        assert row["sglang_version"] == "0.5.23" and row["sglang_installed_version"] == "0.5.23", row
        assert row["bundle_name"] == "ddtree_temperature" and row["bundle_hash"], row
    for t in TEMPERATURES:
        ar = rows[("AR", t)]
        assert "--speculative-algorithm" not in ar["server_argv"], ar["server_argv"]
        assert ar["verify_attention_backend"] is None and ar["accept_length"] is None, ar
        assert ar["cuda_graph"] is False, ar  # from the resolved cuda_graph_config
    for t in TEMPERATURES:
        row = rows[("DDTREE", t)]
        argv = row["server_argv"]
        assert argv[argv.index("--speculative-num-draft-tokens") + 1] == str(BUDGET + 1), argv
        assert argv[argv.index("--speculative-eagle-topk") + 1] == str(TOPK), argv
        # Provenance from the serving process's /server_info.
        assert row["draft_block_size"] == 8 and row["tree_sampler"] == "reference", row
        assert row["verify_attention_backend"] == tree["verify_attention_backend"], row
        assert row["verify_cuda_graph"] is False and row["cuda_graph"] is False, row
    # The built draft is right for up to 4 tokens of the target's period: a depth-4 tree
    # accepts several drafts per verify step (a lossy or mask-less verify would not).
    greedy = rows[("DDTREE", 0.0)]
    assert greedy["accept_length"] is not None and greedy["accept_length"] > 2.0, greedy["accept_length"]
    # Lossless in the field: at T = 0 the tree's outputs are the target's own, prompt for
    # prompt (the hashes of the token ids the real server streamed).
    assert None not in greedy["output_hashes"] and len(greedy["output_hashes"]) == NUM_PROMPTS
    assert greedy["output_hashes"] == rows[("AR", 0.0)]["output_hashes"]
    assert greedy["verify_ct"] < NUM_PROMPTS * MAX_NEW_TOKENS / 2, greedy["verify_ct"]

    # report: one CSV row per measured cell, each DDTREE cell against the AR one beside it.
    csv_path = tmp_path / "cpu.csv"
    rep = cli("report", str(out), "--csv", str(csv_path), "--min-repeats", "1")
    assert rep.exit_code == 0, f"report: {rep.stderr[-3000:]}"
    with csv_path.open(newline="") as f:
        table = list(csv.DictReader(f))
    by_key = {(r["algorithm"], float(r["temperature"])): r for r in table}
    assert set(by_key) == set(rows), list(by_key)
    for t in TEMPERATURES:
        cell, row = by_key[("DDTREE", t)], rows[("DDTREE", t)]
        assert float(cell["accept_length_median"]) == pytest.approx(row["accept_length"]), cell
        expected = row["output_tok_s"] / rows[("AR", t)]["output_tok_s"]
        assert float(cell["speedup_vs_ar"]) == pytest.approx(expected, rel=1e-6), cell
    assert (by_key[("DDTREE", 0.0)]["t0_prompts"], by_key[("DDTREE", 0.0)]["t0_match_frac"]) == (str(NUM_PROMPTS),
                                                                                                  "1.0")

    _restart_past_its_deadline_while_the_log_moves(cpu_host, tmp_path)
    _a_follow_up_turn_is_the_conversation_with_the_servers_own_answer(cpu_host["url"])


TURN_TOKENS = 12
TURN_QUESTION = (("system", "Answer briefly."), ("user", "Why verify a drafted tree in one pass?"))
TURN_FOLLOW_UP = "And in one word?"


def _a_follow_up_turn_is_the_conversation_with_the_servers_own_answer(url: str) -> None:
    """A multi-turn question's follow-up (MT-Bench's second question) reaches the server as
    the conversation so far through the model's own chat template: the question, the
    answer the server streamed for it, the next question. Checked against the server
    itself: greedy decoding gives the same first answer again, the server renders the
    conversation holding it (``/v1/tokenize``), and the client's second request must have
    had exactly those ids (its prompt token count) and produced what the server produces
    for them (output hash)."""
    client = LocalClient(url)
    rendered = client.render_chat([TURN_QUESTION])
    assert rendered.error is None, rendered.error
    (first_ids,) = rendered.ids
    prompt = Prompt(text="q", messages=TURN_QUESTION, followups=(TURN_FOLLOW_UP,), input_ids=first_ids)
    load = client.run_load(LoadSpec(prompts=(prompt,), max_new_tokens=TURN_TOKENS, sampling={"temperature": 0.0}))
    first, second = load.results
    assert first.ok and second.ok, load.results

    params = {"max_new_tokens": TURN_TOKENS, "temperature": 0.0, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=300, trust_env=False) as http:
        answer = http.post("/generate", json={"input_ids": list(first_ids), "sampling_params": params}).json()
        conversation = [{"role": r, "content": c} for r, c in TURN_QUESTION]
        conversation += [{"role": "assistant", "content": answer["text"]}, {"role": "user", "content": TURN_FOLLOW_UP}]
        second_ids = http.post("/v1/tokenize", json={"messages": conversation}).json()["tokens"]
        again = http.post("/generate", json={"input_ids": second_ids, "sampling_params": params}).json()
    assert answer["text"], answer  # a non-empty answer: the second turn really carries it
    assert first.output_hash == output_hash(answer["output_ids"])
    assert second.prompt_tokens == len(second_ids) > len(first_ids) + 1
    assert second.output_hash == output_hash(again["output_ids"])
    assert second.start >= first.end


def _restart_past_its_deadline_while_the_log_moves(cpu_host: dict[str, Any], tmp_path: Path) -> None:
    """The readiness wait follows the real server's load: with a deadline of 2 s (the policy's
    floor; no learned load), the wait goes on past it while the process lives and its log has
    not been silent for the stall window, and SGLang's own phases (weights, KV pool, warm-up)
    show up in the log after the deadline until the server is ready, where a fixed deadline
    would have given up at 2 s. The deadline is set well under the quickest load seen (a
    launch with forked subprocesses, tests/sglang_real/README.md: ready in 13.7 s on CI's
    machine, 27-58 s on a loaded 2-CPU one): a tenth of expected_load_s (6 s) was too close
    to it. A silent load failing in its stall window is the simulator's case
    (tests/service/test_restart_local.py): on CPU the silent stretch (imports) is most of
    the load, too close to it to set a window between them reliably."""
    from dataclasses import replace

    from ddtree_ops.service.launch import RunConfig
    from ddtree_ops.service.logphases import PhaseEvent
    from ddtree_ops.service.readiness import DeadlinePolicy
    from ddtree_ops.state import StateStore

    host = cpu_host["host"]
    events: list[PhaseEvent] = []
    # The cap (200 x 2 s) leaves a slow, loaded machine its whole load.
    policy = DeadlinePolicy(factor=0.01, floor_s=2.0, stall_floor_s=180.0, stall_factor=0.0, cap_factor=200.0)
    with LocalTransport(host.name) as t:
        request = replace(lifecycle.prepare_restart(t, host, RunConfig(algorithm="AR"), smoke=None), policy=policy)
        result = lifecycle.restart(t, request, state=StateStore(tmp_path / "fresh-state.json"), on_phase=events.append)
    assert (result.deadline_s, result.deadline_source) == (2.0, "inventory"), result
    assert result.load_s > 3 * result.deadline_s, (result.load_s, "the load must outlast the deadline 3x")
    seen = [(e.phase.value, round(e.elapsed_s, 1), e.note) for e in events]
    print(f"readiness past the deadline: load {result.load_s:.1f}s, deadline {result.deadline_s}s, phases {seen}")
    assert any("past the 2s deadline, still loading" in e.note for e in events), seen
    # What kept the wait going: phases SGLang's log showed after the deadline had passed.
    assert any(e.elapsed_s > result.deadline_s and not e.note for e in events), seen
    assert httpx.get(cpu_host["url"] + "/server_info", timeout=10).json().get("speculative_algorithm") is None
