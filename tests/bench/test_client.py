"""The load client against a real streaming server on loopback (uvicorn in a thread).

Every test runs twice: with the local client (httpx, in this process) and with the
on-host client (``_hostclient`` run by the host's Python over the local transport), so
the two modes are held to the same payloads, token counts and error texts.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from ddtree_ops.bench import onhost
from ddtree_ops.bench._hostclient import FLUSH_ANSWER_S
from ddtree_ops.bench.client import LoadResult, LoadSpec, UnrenderedChat, request_for
from ddtree_ops.bench.metrics import calculate_metrics
from ddtree_ops.bench.onhost import HostClient, LoadClient, LocalClient
from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.transport.base import RoundTripCounter
from ddtree_ops.transport.local import LocalTransport
from ddtree_ops.workload.prompt import Prompt

from .fake_server import FakeState, serve


def client_at(mode: str, url: str) -> LoadClient:
    if mode == "local":
        return LocalClient(url)
    port = urlsplit(url).port
    assert port is not None
    host = Host(name="fake", connection="local", source="<test>",
                ddtree=DdtreeSettings(python=sys.executable, server=ServerSettings(port=port)))
    return HostClient(LocalTransport("fake"), host)


@pytest.fixture(params=["local", "host"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def server(mode: str) -> Iterator[tuple[LoadClient, FakeState]]:
    state = FakeState()
    with serve(state) as url:
        yield client_at(mode, url), state


def run_load(client: LoadClient, spec: LoadSpec) -> LoadResult:
    return client.run_load(spec)


def prompts(n: int, text: str = "hello world") -> tuple[Prompt, ...]:
    return tuple(Prompt(text=f"{text} {i}") for i in range(n))


def test_generate_counts_tokens_steps_and_itls(server) -> None:
    url, state = server
    state.step_s = 0.02  # steps the client sees apart on a busy machine too: every ITL > 0
    spec = LoadSpec(prompts=prompts(6), max_new_tokens=10, sampling={"temperature": 0.6, "top_k": 20},
                    concurrency=2, warmup=2)
    load = run_load(url, spec)
    assert len(load.results) == 6 and all(r.ok for r in load.results)
    assert state.requests == 8  # warmup sent, not reported
    for r in load.results:
        # 1 prefill token then steps of 3: 1, 4, 7, 10 -> 3 verify steps, 9 per-token ITLs
        assert r.completion_tokens == 10 and r.spec_verify_ct == 3 and r.chunks == 4
        assert len(r.itls) == 9 and all(x > 0 for x in r.itls)
        assert r.ttft is not None and 0 < r.ttft <= r.e2e
        assert r.prompt_tokens == 3
    sent = state.bodies[-1]["sampling_params"]
    assert sent == {"max_new_tokens": 10, "ignore_eos": True, "temperature": 0.6, "top_k": 20}
    m = calculate_metrics(load.results, duration_s=load.duration_s)
    assert m.accept_length == pytest.approx(60 / 18)
    assert m.output_tokens == 60


def test_chunks_read_together_are_counted_and_make_the_cell_client_bound(server) -> None:
    """A chunk read in one piece with the one before it has no observed gap: counted per
    request, so a row says the client could not see the stream's timing."""
    url, state = server
    state.step_s = 0.02  # well above a busy machine's scheduling delay
    spaced = run_load(url, LoadSpec(prompts=prompts(2), max_new_tokens=10))
    burst = run_load(url, LoadSpec(prompts=prompts(2, "burst"), max_new_tokens=10))
    for r in spaced.results:  # a step every 20 ms, read as it comes
        assert r.ok and r.chunks == 4 and r.coalesced == 0, r
    for r in burst.results:  # the 3 decode chunks in one write: 2 of them arrive with another
        assert r.ok and r.chunks == 4 and r.coalesced == 2, r
        assert r.itls[3:].count(0.0) == 6, r.itls  # their 6 ITLs read as zero
    m_spaced = calculate_metrics(spaced.results, duration_s=spaced.duration_s)
    m_burst = calculate_metrics(burst.results, duration_s=burst.duration_s)
    assert (m_spaced.coalesced_frac, m_spaced.client_bound) == (0.0, False)
    assert m_burst.coalesced_frac == pytest.approx(4 / 6) and m_burst.client_bound is True


def test_closed_loop_never_exceeds_concurrency(server) -> None:
    url, state = server
    state.step_s = 0.01
    run_load(url, LoadSpec(prompts=prompts(9), max_new_tokens=12, concurrency=3))
    assert 2 <= state.max_in_flight <= 3


def test_failures_are_recorded_not_raised(server) -> None:
    url, state = server
    mixed = (Prompt("fine"), Prompt("fail500 please"), Prompt("die now"), Prompt("error here"))
    load = run_load(url, LoadSpec(prompts=mixed, max_new_tokens=12, concurrency=4))
    by_text = dict(zip([p.text for p in mixed], load.results, strict=True))
    assert by_text["fine"].ok
    assert by_text["fail500 please"].error.startswith("HTTP 500")
    assert not by_text["die now"].ok and by_text["die now"].error
    assert by_text["error here"].error == "server error: out of memory"
    m = calculate_metrics(load.results)
    assert m.completed == 1 and m.failed == 3 and len(m.errors) == 3


def test_a_run_ends_at_its_last_response_not_after_reporting_it() -> None:
    """The run's duration (what tok/s divides by) is first send to the last response's
    end, as AIPerf times a benchmark: reporting the results on the client's loop (here a
    slow on_done, in a sweep the ledger and progress) is not the server's time. The run
    used to end after gather, with every report inside it."""
    state = FakeState(step_s=0.002)  # ~0.01 s of server time: far below the report's 0.5 s on any machine
    with serve(state) as url:
        client = LocalClient(url)
        load = client.run_load(LoadSpec(prompts=prompts(1), max_new_tokens=7),
                               on_done=lambda r: time.sleep(0.5))
    (r,) = load.results
    assert r.ok and r.e2e < 0.45, r
    assert load.duration_s == pytest.approx(r.e2e, abs=0.05), (load.duration_s, r)


def test_responses_that_arrived_together_end_together_however_late_the_client_reads_them() -> None:
    """A response is timed when its bytes reached the client, not when the client's loop
    got round to it: two responses that arrive while the loop is busy (here, reporting the
    first request) are fed in one pass of the loop, before either stream is read, so the
    second ends when it arrived, not after the first was read and reported. (Before, it
    ended ~0.3 s later, after the first one's report.)"""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    # The slow responses are sent once the client is reporting the fast one, and its report
    # goes on until they were sent: they arrive while the loop is busy however slow the
    # machine (a fixed 0.1 s wait for the report to start was a guess).
    reporting, sent = threading.Event(), threading.Event()

    def report(r: object) -> None:
        if not reporting.is_set():
            reporting.set()
            assert sent.wait(30)
        time.sleep(0.3)
    frame = b'data: {"text": "x", "meta_info": {"prompt_tokens": 1, "completion_tokens": 1}}\n\ndata: [DONE]\n\n'
    response = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(frame)
                + frame)

    def serve_three() -> None:
        conns = []
        for _ in range(3):
            conn, _ = listener.accept()
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, body = data.split(b"\r\n\r\n", 1)
            length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            while len(body) < length:
                body += conn.recv(65536)
            data = body
            conns.append((b"fast" in data, conn))
        for fast, conn in conns:
            if fast:
                conn.sendall(response)
        reporting.wait(30)  # the client is now reporting the fast one (0.3 s): both arrive meanwhile
        for fast, conn in conns:
            if not fast:
                conn.sendall(response)
        sent.set()
        time.sleep(1.0)
        for _, conn in conns:
            conn.close()

    server = threading.Thread(target=serve_three, daemon=True)
    server.start()
    try:
        load = LocalClient(f"http://127.0.0.1:{port}").run_load(
            LoadSpec(prompts=(Prompt("fast"), Prompt("slow a"), Prompt("slow b")), max_new_tokens=1, concurrency=3),
            on_done=report)
    finally:
        server.join(5)
        listener.close()
    fast, a, b = load.results
    assert fast.ok and a.ok and b.ok, load.results
    assert a.end - fast.end > 0.25  # read after the first report (0.3 s): the loop was busy
    assert abs(b.end - a.end) < 0.1, (a.end, b.end)  # arrived together, end together


def test_unreachable_server_fails_every_request(mode: str) -> None:
    client = client_at(mode, "http://127.0.0.1:9")
    seen: list[bool] = []
    load = client.run_load(LoadSpec(prompts=prompts(3), max_new_tokens=4, timeout_s=5),
                           on_done=lambda r: seen.append(r.ok))
    assert [r.ok for r in load.results] == [False] * 3 and seen == [False] * 3
    assert all(r.error.startswith("connection failed") for r in load.results)
    ok, detail = client.flush_cache()
    assert not ok and "connection failed" in detail
    assert client.server_info() is None


def test_openai_mode_completions_and_chat(server) -> None:
    url, state = server
    ps = (Prompt("plain"), Prompt("u: hi", messages=(("user", "hi"),)))
    load = run_load(url, LoadSpec(prompts=ps, max_new_tokens=7, api="openai", model="m"))
    assert all(r.ok for r in load.results)
    # 1, 4, 7 tokens in three chunks; usage gives the count
    assert [r.completion_tokens for r in load.results] == [7, 7]
    assert [len(r.itls) for r in load.results] == [2, 2]
    assert "prompt" in state.bodies[0] and state.bodies[1]["messages"] == [{"role": "user", "content": "hi"}]
    assert state.bodies[0]["stream_options"] == {"include_usage": True}


def test_poisson_rate_and_flush(server) -> None:
    url, state = server
    load = run_load(url, LoadSpec(prompts=prompts(5), max_new_tokens=4, concurrency=5, request_rate=20.0))
    assert all(r.ok for r in load.results)
    starts = [r.start for r in load.results]
    # Seed 0 at 20/s: gaps of 93, 71, 27 and 15 ms between arrivals, in prompt order. The
    # host client sleeps each thread until its request is due, so a thread that wakes late
    # shortens the spread by as much (24 ms once, both cores busy in a fresh-clone CI run)
    # and may start after the next one (gaps of 15 ms): hence the slack; all five sent at
    # once would spread over ~0 ms.
    assert starts[-1] - starts[0] >= 0.206 - 0.05
    assert all(b > a - 0.03 for a, b in zip(starts, starts[1:], strict=False))
    assert url.flush_cache() == (True, "HTTP 200") and state.flushes == 1


def test_a_flushed_load_flushes_first_and_on_the_host_in_the_same_run(mode: str) -> None:
    """``run_load(..., flush=True)``: the prefix cache flushed before the load's first
    request, in either mode; on the host in the same program run as the load (one round
    trip a measured cell, where a flush and a load were two)."""
    state = FakeState()
    with serve(state) as url:
        client = client_at(mode, url)
        counter = RoundTripCounter()
        if isinstance(client, HostClient):
            client = HostClient(LocalTransport("fake", counter=counter), client.host)
        load = client.run_load(LoadSpec(prompts=prompts(3), max_new_tokens=4, concurrency=2, warmup=1), flush=True)
        assert all(r.ok for r in load.results), load.results
        assert state.requests_at_flush == [0] and state.requests == 4  # the warmup's request, then three
        assert counter.commands == (1 if mode == "host" else 0), counter.log
        client.run_load(LoadSpec(prompts=prompts(1), max_new_tokens=4))
        assert state.flushes == 1 and state.requests == 5


def test_a_refused_flush_sends_no_request_and_fails_every_one_saying_why(mode: str) -> None:
    """The flush asks the server to wait for requests still running (SGLang's
    ``/flush_cache?timeout=``: _FLUSH_S less the answer's slack); a flush refused all the
    same (requests it could not wait out) is no measurement: the load is not sent, and
    every request of the result fails naming the refusal, in either mode."""
    state = FakeState(flush_refusal="Timed out waiting for idle state.")
    with serve(state) as url:
        client = client_at(mode, url)
        seen: list[bool] = []
        load = client.run_load(LoadSpec(prompts=prompts(3), max_new_tokens=4, warmup=1), flush=True,
                               on_done=lambda r: seen.append(r.ok))
        assert state.requests == 0 and seen == [False] * 3, state.requests
        assert [r.ok for r in load.results] == [False] * 3
        assert {r.error for r in load.results} == {
            "not measured: the prefix cache was not flushed before the load "
            "(HTTP 400: Timed out waiting for idle state.)"}
        assert client.flush_cache() == (False, "HTTP 400: Timed out waiting for idle state.")
        waits = {float(t) for t in state.flush_timeouts if t is not None}
        assert len(state.flush_timeouts) == 2 and waits == {onhost._FLUSH_S - FLUSH_ANSWER_S}, state.flush_timeouts
        state.flush_refusal = None
        again = client.run_load(LoadSpec(prompts=prompts(3), max_new_tokens=4), flush=True)
        assert all(r.ok for r in again.results) and state.requests == 3


def _python38() -> str | None:
    """A Python 3.8 on this machine, if any: the oldest interpreter a host may run the
    host client with."""
    import glob
    import os

    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.8*/bin/python3.8")))
    return found[0] if found else None


@pytest.mark.skipif(_python38() is None, reason="no Python 3.8 here")
def test_host_client_runs_on_python_3_8() -> None:
    state = FakeState()
    with serve(state) as url:
        client = client_at("host", url)
        assert isinstance(client, HostClient)
        old = dataclasses.replace(client.host, ddtree=dataclasses.replace(client.host.ddtree, python=_python38()))
        client = HostClient(client.transport, old)
        for api in ("generate", "openai"):
            load = client.run_load(LoadSpec(prompts=prompts(3), max_new_tokens=7, concurrency=2, warmup=1,
                                            api=api, request_rate=100.0))  # type: ignore[arg-type]
            assert [(r.ok, r.completion_tokens) for r in load.results] == [(True, 7)] * 3, load.results
        assert client.flush_cache() == (True, "HTTP 200")


def test_chat_prompts_reach_generate_as_the_servers_rendering_never_a_transcript(server) -> None:
    client, state = server
    chat = (Prompt(text="user: hi\nassistant:", messages=(("user", "hi"),)),
            Prompt(text="system: be brief\nuser: why?\nassistant:",
                   messages=(("system", "be brief"), ("user", "why?"))))
    with pytest.raises(UnrenderedChat):
        request_for(chat[0], LoadSpec(prompts=chat, max_new_tokens=4))
    rendered = client.render_chat([p.messages for p in chat])
    assert rendered.error is None
    assert [bytes(ids).decode() for ids in rendered.ids] == [
        "<|user|>hi<|assistant|>", "<|system|>be brief<|user|>why?<|assistant|>"]
    sent = tuple(dataclasses.replace(p, input_ids=ids) for p, ids in zip(chat, rendered.ids, strict=True))
    load = client.run_load(LoadSpec(prompts=sent, max_new_tokens=4))
    assert all(r.ok for r in load.results)
    generated = [b for b in state.bodies if "sampling_params" in b]
    assert [b["input_ids"] for b in generated] == [list(ids) for ids in rendered.ids]
    assert all("text" not in b for b in generated)


def test_a_multi_turn_question_sends_each_turn_after_the_answer_to_the_one_before(server) -> None:
    """MT-Bench's second turn is the conversation so far (the question, the model's own
    answer, the next question) through the served model's template, sent once the first
    turn is answered; one result per turn, the follow-ups after every first turn."""
    client, state = server
    questions = (Prompt(text="q", messages=(("user", "Write a haiku."),), followups=("Now in French.", "Shorter.")),
                 Prompt(text="plain prompt"))
    (ids,) = client.render_chat([questions[0].messages]).ids
    sent = (dataclasses.replace(questions[0], input_ids=ids), questions[1])
    load = client.run_load(LoadSpec(prompts=sent, max_new_tokens=4))
    assert [r.ok for r in load.results] == [True] * 4 and [r.completion_tokens for r in load.results] == [4] * 4
    generated = [bytes(b["input_ids"]).decode() if "input_ids" in b else b["text"]
                 for b in state.bodies if "sampling_params" in b]
    first = "<|user|>Write a haiku."
    second = first + "<|assistant|>xxxx<|user|>Now in French."
    assert sorted(generated) == sorted([first + "<|assistant|>", "plain prompt", second + "<|assistant|>",
                                        second + "<|assistant|>xxxx<|user|>Shorter.<|assistant|>"])
    # Rendered by the server, one conversation per follow-up; the third turn after the second.
    rendered = [b["messages"] for b in state.bodies if "messages" in b]
    assert [m[-1]["content"] for m in rendered] == ["Write a haiku.", "Now in French.", "Shorter."]
    assert load.results[2].start >= load.results[0].end and load.results[3].start >= load.results[2].end


def test_a_turn_not_answered_leaves_the_turns_after_it_failed_not_sent(server) -> None:
    client, state = server
    failing = Prompt(text="q", messages=(("user", "fail500 please"),), followups=("next", "last"))
    (ids,) = client.render_chat([failing.messages]).ids
    load = client.run_load(LoadSpec(prompts=(dataclasses.replace(failing, input_ids=ids),), max_new_tokens=4))
    assert [r.ok for r in load.results] == [False] * 3
    assert [r.error for r in load.results[1:]] == ["not sent: the turn before it failed"] * 2
    # A conversation the template cannot render is that turn's reason, and no later turn runs.
    ok = Prompt(text="q", messages=(("user", "hello"),), followups=("next",))
    (ids,) = client.render_chat([ok.messages]).ids
    state.chat_template = False
    load = client.run_load(LoadSpec(prompts=(dataclasses.replace(ok, input_ids=ids),), max_new_tokens=4))
    assert load.results[0].ok and not load.results[1].ok
    assert load.results[1].error == ("not sent: the conversation could not be rendered through the chat template "
                                     "(POST /v1/tokenize): HTTP 400: this model has no chat template")


def test_a_multi_turn_question_on_the_openai_route_carries_the_answer_as_messages(server) -> None:
    client, state = server
    question = Prompt(text="q", messages=(("user", "hi"),), followups=("and?",))
    load = client.run_load(LoadSpec(prompts=(question,), max_new_tokens=4, api="openai", model="m"))
    assert [r.ok for r in load.results] == [True, True]
    chats = [b["messages"] for b in state.bodies if "messages" in b]
    assert chats == [[{"role": "user", "content": "hi"}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yyyy"},
                      {"role": "user", "content": "and?"}]]


def test_a_model_without_a_chat_template_is_the_servers_reason(server) -> None:
    client, state = server
    state.chat_template = False
    rendered = client.render_chat([(("user", "hi"),)])
    assert rendered.ids == () and rendered.error == "HTTP 400: this model has no chat template"
    assert client_at(client.mode, "http://127.0.0.1:9").render_chat([(("user", "hi"),)]).error.startswith(
        "connection failed")


def test_the_output_hash_is_the_same_for_cumulative_and_incremental_streams() -> None:
    """SGLang streams output_ids whole by default and as deltas under
    --incremental-streaming-output (tokenizer_manager.py): one output, one hash."""
    from ddtree_ops.bench import _hostclient as hc

    def run(chunks: list[list[int]], counts: list[int]) -> str | None:
        tally = hc.GenerateTally(0.0)
        for t, (ids, n) in enumerate(zip(chunks, counts, strict=True), 1):
            tally.feed(float(t), json.dumps({"output_ids": ids, "meta_info": {"completion_tokens": n}}).encode())
        return tally.result(9.0, True)["output_hash"]

    cumulative = run([[5], [5, 6, 7], [5, 6, 7, 8]], [1, 3, 4])
    incremental = run([[5], [6, 7], [8]], [1, 3, 4])
    assert cumulative == incremental == hc.output_hash([5, 6, 7, 8])
    assert run([[5], [5, 6, 9], [5, 6, 9, 8]], [1, 3, 4]) != cumulative
    assert hc.GenerateTally(0.0).result(1.0, True)["output_hash"] is None  # no ids sent: nothing to compare


def _tally_of(frames: list[bytes], *, parse_all: bool) -> tuple[dict, bool]:
    """(result, whether frames were read by their token count)"""
    from ddtree_ops.bench import _hostclient as hc

    tally = hc.GenerateTally(0.0)
    for t, data in enumerate(frames, 1):
        if parse_all:
            tally._parsed(float(t), hc.parse_frame(data))
        else:
            tally.feed(float(t), data)
    return tally.result(99.0, True), tally.unparsed is not None


def test_reading_only_the_token_count_of_cumulative_frames_measures_what_parsing_each_would() -> None:
    """A cumulative /generate stream is read by its token counts after the second frame and
    its last frame is parsed at the end: the result is the one parsing every frame gives,
    also with spec statistics that only the last frame carries, a text that quotes the key,
    and a last frame that adds no token."""
    ids = [7, 8, 9, 10, 11, 12, 13]
    counts = [1, 3, 4, 7, 7]
    frames = []
    for i, n in enumerate(counts):
        meta = {"id": "r", "prompt_tokens": 5, "completion_tokens": n}
        if i == len(counts) - 1:
            meta |= {"spec_verify_ct": 3, "spec_accept_length": 2.33, "e2e_latency": 0.5}
        text = '"completion_tokens": 99 and \\"error\\"' if i == 2 else f"t{i}"
        frames.append(json.dumps({"text": text, "output_ids": ids[:n], "meta_info": meta},
                                 separators=(",", ":") if i % 2 else (", ", ": ")).encode())
    (fast, skipped), (full, _) = _tally_of(frames, parse_all=False), _tally_of(frames, parse_all=True)
    assert skipped and fast == full
    assert (fast["completion_tokens"], fast["chunks"], fast["spec_verify_ct"], fast["spec_accept_length"]) == (
        7, 4, 3, 2.33)
    assert fast["output_hash"] is not None and fast["itls"] == [0.5, 0.5, 1.0, 1 / 3, 1 / 3, 1 / 3]


def test_a_cumulative_stream_whose_later_frame_is_an_error_fails_with_the_servers_message() -> None:
    from ddtree_ops.bench import _hostclient as hc

    tally = hc.GenerateTally(0.0)
    for t, n in enumerate([1, 2, 3], 1):
        tally.feed(float(t), json.dumps({"output_ids": list(range(n)), "meta_info": {"completion_tokens": n}}).encode())
    assert tally.cumulative
    with pytest.raises(hc.Failed, match="server error: out of memory"):
        tally.feed(4.0, b'{"error": {"message": "out of memory"}}')
    tally.feed(4.0, b'{"output_ids": [0, 1, 2, 3], "meta_info": {"completion_tokens": 4}')  # cut short
    assert tally.result(5.0, True)["error"].startswith("JSONDecodeError")
