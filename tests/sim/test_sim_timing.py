"""Simulated timing as a client measures it: no request is served faster than the model says."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from urllib.parse import urlsplit

from asgiserver import serve_in_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ddtree_ops.bench._hostclient import Connection
from ddtree_ops.bench.client import LoadSpec, as_request_result, request_for
from ddtree_ops.sim.profiles import PROFILES
from ddtree_ops.sim.server import _arrived, _StampingH11Protocol
from ddtree_ops.workload.prompt import Prompt

# From "the previous request just finished" to well past the loop's catch-up window.
GAPS_S = (0.0, 0.002, 0.005, 0.01, 0.02, 0.035, 0.1)


def test_ttft_at_an_idle_server_never_beats_the_modelled_prefill(sim_factory) -> None:
    """A request reaching an idle engine starts a fresh timeline: its prefill takes the
    whole modelled prefill time after it arrived, however soon after the previous
    request's last step it came (the idle gap is not prefill time already spent)."""
    sim = sim_factory(env={"SIM_GPU": "h200", "SIM_TIME_SCALE": "1", "SIM_LOAD_S": "0.5"})
    sim.wait_ready()
    profile = PROFILES["h200"]
    spec = LoadSpec(prompts=(), max_new_tokens=2, timeout_s=30)
    prompt = Prompt(text="def add(a, b): return a + b")

    url = urlsplit(sim.url)
    route, body = request_for(prompt, spec)

    async def serve() -> list:
        # One keep-alive connection of the load client's own engine, as a closed loop has.
        conn = Connection(url.hostname, url.port, 30.0)
        try:
            await conn.send(spec.api, route, body)  # the first request after warmup
            results = []
            for gap in GAPS_S:
                await asyncio.sleep(gap)
                results.append(as_request_result(await conn.send(spec.api, route, body)))
            return results
        finally:
            conn.close()

    results = asyncio.run(serve())
    assert all(r.ok for r in results), [r.error for r in results]
    floors = [profile.prefill_ms(r.prompt_tokens) / 1000 for r in results]
    ttfts = [r.ttft for r in results]
    assert all(r.prompt_tokens > 0 for r in results)
    assert all(t is not None and t >= floor for t, floor in zip(ttfts, floors, strict=True)), (ttfts, floors)


def test_a_request_is_created_when_its_bytes_arrived_not_when_its_handler_ran() -> None:
    """The simulator's clock (``/sim/request_times``, TTFT, e2e) starts a request when its
    bytes reached the server. Here a real uvicorn server with the simulator's protocol has
    its loop held (a handler that blocks, as a burst of hundreds of requests keeps it
    busy): b and c arrive meanwhile, are read in the same pass of the loop, and c's handler
    runs only after b's has held the loop another 0.2 s; c is still created when it
    arrived, with b. (Stamped as its handler started, c was created 0.2 s late.)"""
    holding, sent = threading.Event(), threading.Event()

    async def stamp(request: Request) -> JSONResponse:
        arrived, started = _arrived(request), time.monotonic()
        # Holds the loop, as a busy server's is held: a's handler until b and c were sent
        # (on a busy machine a fixed hold could end before they are), b's for 0.2 s.
        if request.query_params.get("until_sent"):
            holding.set()
            assert sent.wait(30)
        time.sleep(float(request.query_params.get("hold", 0)))
        return JSONResponse({"arrived": arrived, "started": started})

    def send(port: int, path: bytes) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: sim\r\nConnection: close\r\n\r\n")
        return s

    def read(s: socket.socket) -> dict[str, float]:
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        s.close()
        return json.loads(data.split(b"\r\n\r\n", 1)[1])

    with serve_in_thread(Starlette(routes=[Route("/stamp", stamp)]), http=_StampingH11Protocol) as url:
        port = urlsplit(url).port
        assert port is not None
        a = send(port, b"/stamp?until_sent=1")
        assert holding.wait(30)  # a's handler holds the loop now
        b, c = send(port, b"/stamp?hold=0.2"), send(port, b"/stamp")
        sent.set()
        read(a)
        got_b, got_c = read(b), read(c)
    assert got_c["started"] - got_b["started"] > 0.15, (got_b, got_c)  # c's handler waited for b's
    assert abs(got_c["arrived"] - got_b["arrived"]) < 0.1, (got_b, got_c)  # yet both arrived together
    assert got_c["started"] - got_c["arrived"] > 0.15, got_c
