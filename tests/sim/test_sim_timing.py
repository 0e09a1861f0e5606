"""Simulated timing as a client measures it: no request is served faster than the model says."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from ddtree_ops.bench._hostclient import Connection
from ddtree_ops.bench.client import LoadSpec, as_request_result, request_for
from ddtree_ops.bench.prompts import Prompt
from ddtree_ops.sim.profiles import PROFILES

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
