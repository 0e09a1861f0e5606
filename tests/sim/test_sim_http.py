"""The HTTP API of a running simulator, checked against SGLang 0.5.23's shapes."""

from __future__ import annotations

import itertools
import json
import threading
import time

import httpx
import pytest


def _sse(resp: httpx.Response) -> list[str]:
    """Payloads of ``data: ...`` events, in order (blank separator lines dropped)."""
    out = []
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        out.append(line[len("data: "):])
    return out


def test_server_info_is_flat_and_says_simulated(ddtree_server) -> None:
    info = httpx.get(ddtree_server.url + "/server_info").json()
    assert info["version"] == "0.5.23-sim"
    assert info["speculative_algorithm"] == "DDTREE"
    # SGLang's generic fields, resolved the way the DDTree plugin resolves them.
    assert info["speculative_num_draft_tokens"] == 17
    assert info["speculative_eagle_topk"] == 4
    assert info["speculative_dflash_block_size"] == 16
    assert info["speculative_num_steps"] == 1
    assert not any(key.startswith("speculative_ddtree") for key in info)
    assert info["launch_command"].startswith("--model-path sim-model")
    assert "--speculative-num-draft-tokens 17 --speculative-eagle-topk 4" in info["launch_command"]
    assert isinstance(info["startup_time"], float)
    assert "avg_spec_accept_length" in info["internal_states"][0]
    # Beyond real SGLang: the simulated machine, named so it never passes for real hardware.
    assert info["simulated"] is True
    assert info["simulated_gpu"] == {"profile": "h200", "name": "NVIDIA H200 (simulated)", "compute_cap": "9.0",
                                     "count": 8, "indices": list(range(8)), "cuda_visible_devices": None}
    assert httpx.get(ddtree_server.url + "/get_server_info").json()["startup_time"] == info["startup_time"]
    models = httpx.get(ddtree_server.url + "/v1/models").json()
    assert models["data"][0]["id"] == "sim-model"
    assert httpx.get(ddtree_server.url + "/model_info").json()["model_path"] == "sim-model"
    assert httpx.get(ddtree_server.url + "/health_generate").status_code == 200


def test_server_info_reports_the_ddtree_object(ddtree_server) -> None:
    info = httpx.get(ddtree_server.url + "/server_info").json()
    tree = info["ddtree"]
    assert tree == {
        "budget": info["speculative_num_draft_tokens"] - 1,
        "topk": 4,
        "draft_block_size": 16,
        "verify_width": 17,
        "max_depth": 15,
        "verify_attention_backend": "simulated",
        "draft_attention_backend": "simulated",
        "decode_cuda_graph": "full",
        "verify_cuda_graph_captured": True,
        # The graph ceiling: min(--cuda-graph-max-bs-decode 256, --max-running-requests 128).
        "verify_cuda_graph_max_bs": 128,
        "candidate_head": "draft CUDA graph",
        "tree_mask": {"hooks_in_place": [], "capture_input": "simulated", "verify_graphs": "simulated"},
        "sampler": "reference",
        "accept_thresholds": [1.0, 1.0],
    }
    assert tree["budget"] == 16


def test_generate_non_stream_spec_fields_consistent(ddtree_server) -> None:
    r = httpx.post(
        ddtree_server.url + "/generate",
        json={
            "text": "def add(a, b): return a + b",
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
        },
        timeout=30,
    )
    assert r.status_code == 200
    body = r.json()
    meta = body["meta_info"]
    assert meta["completion_tokens"] == 40 == len(body["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 40}
    assert meta["prompt_tokens"] == 7
    assert meta["spec_verify_ct"] >= 1
    assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
    assert meta["spec_accept_length"] > 1.0  # a tree never does worse than one token per verify
    assert 0.0 <= meta["spec_accept_rate"] <= 1.0
    assert meta["e2e_latency"] > 0
    assert isinstance(body["text"], str) and body["text"]


def test_generate_stream_chunks_are_cumulative_and_end_with_done(ddtree_server) -> None:
    with httpx.stream(
        "POST", ddtree_server.url + "/generate",
        json={"input_ids": [5, 6, 7, 8], "stream": True,
              "sampling_params": {"max_new_tokens": 24, "temperature": 0.8, "sampling_seed": 3, "ignore_eos": True}},
        timeout=30,
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = _sse(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2
    lengths = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 24
    for a, b in itertools.pairwise(chunks):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_sampling_seed_makes_outputs_repeatable(ddtree_server) -> None:
    def run(seed: int) -> list[int]:
        r = httpx.post(
            ddtree_server.url + "/generate",
            json={
                "text": "tell me about the sea",
                "sampling_params": {
                    "max_new_tokens": 32, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True
                },
            },
            timeout=30,
        )
        return r.json()["output_ids"]

    a, b, c = run(11), run(11), run(12)
    assert a == b
    assert a != c


def test_chat_completions_stream_reports_usage_when_asked(ddtree_server) -> None:
    payload = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", ddtree_server.url + "/v1/chat/completions", json=payload, timeout=30) as resp:
        assert resp.status_code == 200
        events = _sse(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage_chunks = [c for c in chunks if c.get("usage")]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert usage_chunks[0]["choices"] == []
    usage = usage_chunks[0]["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content.strip()
    # Without include_usage there is no usage chunk.
    payload["stream_options"] = {"include_usage": False}
    with httpx.stream("POST", ddtree_server.url + "/v1/chat/completions", json=payload, timeout=30) as resp:
        plain = [json.loads(e) for e in _sse(resp)[:-1]]
    assert not any(c.get("usage") for c in plain)


def test_completions_non_stream(ddtree_server) -> None:
    r = httpx.post(ddtree_server.url + "/v1/completions",
                   json={"model": "sim-model", "prompt": "count to ten", "max_tokens": 8, "temperature": 0}, timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    "route, payload, needle",
    [
        ("/generate", {"sampling_params": {"max_new_tokens": 4}}, "Either text or input_ids"),
        ("/generate", {"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),
        ("/generate", {"text": "x", "sampling_params": {"top_p": 0}}, "top_p"),
        ("/generate", {"text": "x", "sampling_params": {"top_k": 0}}, "top_k"),
        ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, "bogus"),
        ("/generate", "not json", "Invalid JSON"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
    ],
)
def test_malformed_requests_get_400_not_500(ddtree_server, route: str, payload: object, needle: str) -> None:
    if isinstance(payload, str):
        r = httpx.post(ddtree_server.url + route, content=payload.encode(), timeout=10)
    else:
        r = httpx.post(ddtree_server.url + route, json=payload, timeout=10)
    assert r.status_code == 400, r.text
    assert needle in r.text
    assert "Traceback" not in r.text


def test_flush_cache_when_idle(ddtree_server) -> None:
    r = httpx.post(ddtree_server.url + "/flush_cache", timeout=10)
    assert r.status_code == 200
    assert r.text.startswith("Cache flushed.")


def _running(url: str) -> int:
    info = httpx.get(url + "/server_info", timeout=10).json()
    return sum(int(s["num_running_reqs"]) + int(s["num_waiting_reqs"]) for s in info["internal_states"])


def test_flush_cache_waits_for_running_requests_up_to_its_timeout_as_sglang_does(sim_factory) -> None:
    """SGLang 0.5.23's ``/flush_cache?timeout=S`` (``SchedulerFlushWrapper``): refused at
    once while a request runs (no timeout), refused after S seconds if it still runs, and
    done as soon as it has ended when S is long enough: the answer comes after the request's."""
    sim = sim_factory(env={"SIM_TIME_SCALE": "0.1"})  # a 2000-token request: seconds
    sim.wait_ready()
    ended: list[float] = []

    def long_request() -> None:
        body = {"text": "a long one", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        httpx.post(sim.url + "/generate", json=body, timeout=120).raise_for_status()
        ended.append(time.monotonic())

    worker = threading.Thread(target=long_request)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while _running(sim.url) == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.02)
        now = httpx.post(sim.url + "/flush_cache", timeout=10)
        assert (now.status_code, now.text) == (400, "Flush cache failed.\n")
        late = httpx.post(sim.url + "/flush_cache", params={"timeout": "0.2"}, timeout=10)
        assert (late.status_code, late.text) == (400, "Timed out waiting for idle state.")
        assert not ended, "the request ended before the flushes it was to refuse: make it longer"
        waited = httpx.post(sim.url + "/flush_cache", params={"timeout": "60"}, timeout=70)
        answered = time.monotonic()
    finally:
        worker.join(120)
    assert waited.status_code == 200 and waited.text.startswith("Cache flushed."), waited.text
    # The request's last step, on the server's clock (CLOCK_MONOTONIC, this machine's):
    # before the flush's answer. (Its client may read its last bytes just after.)
    done = max(httpx.get(sim.url + "/sim/request_times", timeout=10).json()["requests"],
               key=lambda r: len(r["emits"]))  # not the server's own warmup request
    assert ended and done["emits"][-1][0] <= answered, (done["emits"][-1], answered)
    bad = httpx.post(sim.url + "/flush_cache", params={"timeout": "-1"}, timeout=10)
    assert bad.status_code == 422


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 1e-6}])
def test_top_k_and_top_p_reshape_the_verified_distribution(ddtree_server, filters: dict[str, float]) -> None:
    """top_k=1 (or a vanishing top_p) leaves only the argmax, so sampling at T=1 must
    reproduce greedy decoding token for token: the filters reach verification."""
    def run(params: dict[str, object]) -> list[int]:
        body = {"text": "solve 12 + 30 step by step",
                "sampling_params": {"max_new_tokens": 32, "ignore_eos": True, **params}}
        return httpx.post(ddtree_server.url + "/generate", json=body, timeout=30).json()["output_ids"]

    greedy = run({"temperature": 0})
    assert run({"temperature": 1.0, "sampling_seed": 4, **filters}) == greedy
    assert run({"temperature": 1.0, "sampling_seed": 4}) != greedy  # without the filter, T=1 wanders


def test_request_times_give_each_finished_request_on_the_servers_clock(ddtree_server) -> None:
    """``/sim/request_times`` (benchmarks/client_accuracy.py's reference): per finished
    request its arrival and each step's commit time and tokens, on CLOCK_MONOTONIC, then
    forgotten; the tokens add up to what the request streamed."""
    import time

    httpx.get(ddtree_server.url + "/sim/request_times")  # start from an empty log
    before = time.monotonic()
    body = {"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}
    outs = [httpx.post(ddtree_server.url + "/generate", json=body, timeout=30).json() for _ in range(2)]
    after = time.monotonic()
    got = httpx.get(ddtree_server.url + "/sim/request_times").json()
    assert got["clock"] == "monotonic" and before <= got["now"]
    assert [r["rid"] for r in got["requests"]] == [o["meta_info"]["id"] for o in outs]
    for r, out in zip(got["requests"], outs, strict=True):
        times = [t for t, _ in r["emits"]]
        assert before <= r["created"] < times[0] and times == sorted(times) and times[-1] <= after
        assert sum(n for _, n in r["emits"]) == out["meta_info"]["completion_tokens"] == 12
        # The prefill's token, then one commit per verify step of several tokens each.
        assert r["emits"][0][1] == 1 and len(r["emits"]) == out["meta_info"]["spec_verify_ct"] + 1 < 12
    assert httpx.get(ddtree_server.url + "/sim/request_times").json()["requests"] == []
