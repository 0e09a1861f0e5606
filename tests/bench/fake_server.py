"""A tiny SGLang-shaped streaming server on loopback, run by uvicorn in a thread.

Speaks the routes the client uses, with behaviour chosen by the prompt text:
``fail500`` answers HTTP 500, ``die`` drops the connection after two chunks, ``error``
sends SGLang's in-stream error object, ``burst`` writes every decode chunk at once after
the last step (chunks that queued while a client was busy reach it in one read);
``/v1/tokenize`` renders chat messages through a toy chat template. Each
step emits ``tokens_per_step`` tokens (as a speculating server does) and counts as one
verify step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from asgiserver import serve_in_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class FakeState:
    step_s: float = 0.002
    tokens_per_step: int = 3
    in_flight: int = 0
    max_in_flight: int = 0
    requests: int = 0
    flushes: int = 0
    # How many requests had arrived at each flush: a flush meant for a load comes before it.
    requests_at_flush: list[int] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)
    chat_template: bool = True
    # The ``timeout`` query parameter of each flush (SGLang's wait for idle, in seconds).
    flush_timeouts: list[str | None] = field(default_factory=list)
    # Set: every flush is refused with this answer (HTTP 400), as SGLang refuses one while
    # requests it could not wait out are running.
    flush_refusal: str | None = None


def make_app(state: FakeState) -> Starlette:
    async def generate(request: Request) -> Response:
        body = await request.json()
        state.bodies.append(body)
        # Rendered chat prompts arrive as ids: the fake "tokenizer" is one id per byte.
        text = body["text"] if "text" in body else bytes(body["input_ids"]).decode("utf-8", "replace")
        n = int(body["sampling_params"]["max_new_tokens"])
        if "fail500" in text:
            return JSONResponse({"error": "boom"}, status_code=500)

        async def stream() -> AsyncIterator[bytes]:
            state.requests += 1
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                done, steps = 0, 0
                await asyncio.sleep(state.step_s)  # prefill
                done, steps = 1, 0
                chunk = {"text": "x", "meta_info": {"prompt_tokens": len(text.split()), "completion_tokens": 1}}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                queued = b""
                while done < n:
                    await asyncio.sleep(state.step_s)
                    done = min(n, done + state.tokens_per_step)
                    steps += 1
                    if "die" in text and steps == 2:
                        raise RuntimeError("server killed")
                    if "error" in text and steps == 2:
                        yield b'data: {"error": {"message": "out of memory"}}\n\n'
                        break
                    meta = {
                        "prompt_tokens": len(text.split()),
                        "completion_tokens": done,
                        "spec_verify_ct": steps,
                        "spec_accept_length": done / steps,
                    }
                    frame = b"data: " + json.dumps({"text": "x" * done, "meta_info": meta}).encode() + b"\n\n"
                    if "burst" in text:
                        queued += frame
                    else:
                        yield frame
                if queued:
                    yield queued
                yield b"data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def completions(request: Request) -> Response:
        body = await request.json()
        state.bodies.append(body)
        n = int(body["max_tokens"])
        chat = request.url.path.endswith("chat/completions")

        async def stream() -> AsyncIterator[bytes]:
            done = 0
            while done < n:
                await asyncio.sleep(state.step_s)
                step = 1 if done == 0 else state.tokens_per_step
                done = min(n, done + step)
                choice = {"index": 0, "delta": {"content": "y" * step}} if chat else {"index": 0, "text": "y" * step}
                yield b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
            usage = {"prompt_tokens": 5, "completion_tokens": done}
            yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def flush(request: Request) -> Response:
        state.flush_timeouts.append(request.query_params.get("timeout"))
        if state.flush_refusal is not None:
            return Response(state.flush_refusal, status_code=400)
        state.flushes += 1
        state.requests_at_flush.append(state.requests)
        return Response("ok")

    async def tokenize(request: Request) -> Response:
        """SGLang's /v1/tokenize for messages: the chat template (``<|role|>content``
        turns, then the assistant's opening) as one id per UTF-8 byte; without a
        template, the 400 a model without one gets."""
        body = await request.json()
        state.bodies.append(body)
        if not state.chat_template:
            return JSONResponse({"object": "error", "message": "this model has no chat template", "type":
                                 "BadRequestError", "param": None, "code": 400}, status_code=400)
        rendered = "".join(f"<|{m['role']}|>{m['content']}" for m in body["messages"]) + "<|assistant|>"
        ids = list(rendered.encode())
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": 4096})

    return Starlette(
        routes=[
            Route("/generate", generate, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/flush_cache", flush, methods=["POST"]),
            Route("/v1/tokenize", tokenize, methods=["POST"]),
        ]
    )


@contextmanager
def serve(state: FakeState) -> Iterator[str]:
    with serve_in_thread(make_app(state)) as url:
        yield url
