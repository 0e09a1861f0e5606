"""On-host load generation: the benchmark client as it runs on the GPU host, next to its server.

Sent like every host program (:mod:`ddtree_ops.transport.hostprogram`): the program text
travels on stdin with every run, the payload after a NUL, so the host always runs the
controller's own version and nothing is installed there. Stdlib only and Python 3.8-compatible: it runs with the host's
``ddtree.python``, whose guaranteed content is SGLang's environment and no more.

Why on the host: a server bound to loopback (as fleets ship, so that no unauthenticated
LLM server is exposed) cannot be reached from the operator's machine, and measuring
there puts the network and the operator's CPU into TTFT and ITL.

The payload (JSON) holds requests already built by the controller (route and body per
prompt, :mod:`ddtree_ops.bench.client`), so the request payloads have one source. Output
is one message per object (``reply``: a marked line), flushed as soon as it exists, so the
controller can write progress while the load runs::

    {"kind": "flush", "ok": true, "detail": "HTTP 200"}
    {"kind": "set_state", "status": 200 | 400 | null, "body": "<the answer's body, text>"}
    {"kind": "server_info", "info": {...} | null}
    {"kind": "rendered", "ids": [[int, ...], ...]} | {"kind": "rendered", "error": "..."}
    {"kind": "request", "index": 3, "result": {RequestResult's fields}}
    {"kind": "summary", "duration_s": ..., "warmup_failures": 0, "cpu_s": ...}

The pieces that decide what a request measured (SSE framing, token counting, ITL
spreading, error texts) are the classes below, and the controller's own client imports
them: both client modes count the same way.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import queue
import random
import socket
import threading
import time

SUMMARY = "summary"


class Failed(Exception):
    """A request that ended in a server-reported failure (HTTP status or in-stream error)."""


def http_status_error(status, body):
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body)
    return f"HTTP {status}: {text.strip()[:200]}"


class SseFrames:
    """Server-sent events of one streamed response, fed raw bytes as they arrive.

    Frames are split by hand on raw bytes: a text line decoder costs more CPU per chunk
    than the JSON parse itself. ``done`` tells whether ``[DONE]`` arrived; a stream cut
    before it is a failure.
    """

    def __init__(self):
        self.done = False
        self._buf = b""

    def feed(self, raw):
        """The JSON objects completed by ``raw``; raises Failed on an error frame."""
        self._buf += raw
        frames = self._buf.split(b"\n")
        self._buf = frames.pop()
        objs: list = []
        for frame in frames:
            if not frame.startswith(b"data:"):
                continue
            data = frame[5:].strip()
            if data == b"[DONE]":
                self.done = True
                return objs
            obj = json.loads(data)
            if "error" in obj:
                err = obj["error"]
                msg = err.get("message", err) if isinstance(err, dict) else err
                raise Failed(f"server error: {msg}"[:300])
            objs.append(obj)
        return objs


def output_hash(value):
    """16 hex of sha256 over a request's output (token ids, or text where a route gives
    no ids): equal outputs, equal hashes, so a report can check T = 0 losslessness."""
    return hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).hexdigest()[:16]


def failed_result(start, end, error):
    return {"ok": False, "start": start, "end": end, "error": error}


class GenerateTally:
    """SGLang's native ``/generate``: ``meta_info`` carries the server's token counts, so a
    chunk carrying n new tokens (speculation emits several per step) adds n gaps of gap/n."""

    def __init__(self, start):
        self.start = start
        self.ttft = None
        self.last_t = start
        self.last_tokens = 0
        self.itls = []
        self.meta = {}
        self.chunks = 0
        self.coalesced = 0
        self.output_ids = None

    def feed(self, now, obj):
        self.meta = obj.get("meta_info") or {}
        tokens = int(self.meta.get("completion_tokens", 0))
        new = tokens - self.last_tokens
        if new <= 0:
            return
        ids = obj.get("output_ids")
        if isinstance(ids, list):
            # Cumulative by default; deltas under --incremental-streaming-output, where a
            # chunk holds only its new tokens.
            if len(ids) == tokens or self.output_ids is None:
                self.output_ids = ids  # a list of the parsed frame's own: nobody else holds it
            else:
                self.output_ids.extend(ids)
        self.chunks += 1
        if self.ttft is None:
            self.ttft = now - self.start
        else:
            # Read together with the chunk before it: the gap between the two was not
            # observed (the client read late), so this chunk's ITLs read as zero.
            self.coalesced += now == self.last_t
            gap = (now - self.last_t) / new
            self.itls.extend([gap] * new)
        self.last_t, self.last_tokens = now, tokens

    def result(self, end, done):
        if not done:
            return failed_result(self.start, end, "stream ended before [DONE]")
        meta = self.meta
        verify = meta.get("spec_verify_ct")
        accept = meta.get("spec_accept_length")
        server_e2e = meta.get("e2e_latency")
        return {
            "ok": True,
            "start": self.start,
            "end": end,
            "ttft": self.ttft,
            "itls": self.itls,
            "prompt_tokens": int(meta.get("prompt_tokens", 0)),
            "completion_tokens": self.last_tokens,
            "spec_verify_ct": int(verify) if verify is not None else None,
            "spec_accept_length": float(accept) if accept is not None else None,
            "chunks": self.chunks,
            "coalesced": self.coalesced,
            "output_hash": output_hash(self.output_ids) if self.output_ids is not None else None,
            "server_e2e": float(server_e2e)
            if isinstance(server_e2e, (int, float)) and not isinstance(server_e2e, bool)
            else None,
        }


class OpenAITally:
    """``/v1/completions`` and ``/v1/chat/completions``: token counts from the final
    ``usage`` chunk; chunks do not say how many tokens they carry."""

    def __init__(self, start):
        self.start = start
        self.times = []
        self.usage = {}
        self.pieces = []

    def feed(self, now, obj):
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or ():
            piece = choice.get("text") or (choice.get("delta") or {}).get("content")
            if piece:
                self.times.append(now)
                self.pieces.append(piece)
                break

    def result(self, end, done):
        if not done:
            return failed_result(self.start, end, "stream ended before [DONE]")
        times = self.times
        tokens = int(self.usage.get("completion_tokens", len(times)))
        # Spread the decode time evenly over the tokens after the first, so that mean ITL
        # equals TPOT as in the native mode.
        itls = []
        if len(times) >= 2 and tokens > 1:
            per_chunk_tokens = (tokens - 1) / (len(times) - 1)
            itls = [(b - a) / per_chunk_tokens for a, b in zip(times, times[1:])]
        return {
            "ok": True,
            "start": self.start,
            "end": end,
            "ttft": (times[0] - self.start) if times else None,
            "itls": itls,
            "prompt_tokens": int(self.usage.get("prompt_tokens", 0)),
            "completion_tokens": tokens,
            "chunks": len(times),
            "coalesced": sum(a == b for a, b in zip(times, times[1:])),
            "output_hash": output_hash("".join(self.pieces)),
        }


def new_tally(api, start):
    return OpenAITally(start) if api == "openai" else GenerateTally(start)


# ---------------------------------------------------------------------------- host side


def _error_text(exc, phase):
    """The controller client's texts (httpx's exception names) for stdlib exceptions."""
    if isinstance(exc, socket.timeout):
        return "timed out (ConnectTimeout)" if phase == "connect" else "timed out (ReadTimeout)"
    if phase == "connect" and isinstance(exc, OSError):
        return f"connection failed: {exc}"[:300]
    if isinstance(exc, http.client.IncompleteRead):
        # httpx's wording for the same event, so both modes' rows read alike.
        return "server closed the connection mid-response: peer closed connection without sending complete " \
            "message body (incomplete chunked read)"
    if isinstance(exc, (http.client.RemoteDisconnected, ConnectionError)):
        return f"server closed the connection mid-response: {exc}"[:300]
    return f"{type(exc).__name__}: {exc}"[:300]


class _Connection:
    """One worker's keep-alive connection to the server (the controller's client pools
    connections too, so neither mode pays a TCP connect per request)."""

    def __init__(self, address, port, timeout):
        self.address, self.port, self.timeout = address, port, timeout
        self.conn = None

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def send(self, api, route, body):
        """One streamed request as a RequestResult dict; never raises for HTTP failures."""
        start = time.perf_counter()
        tally = new_tally(api, start)
        frames = SseFrames()
        phase = "connect"
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.address, self.port, timeout=self.timeout)
                self.conn.connect()
            phase = "request"
            self.conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
            resp = self.conn.getresponse()
            if resp.status != 200:
                text = resp.read(1 << 16)
                self.close()
                raise Failed(http_status_error(resp.status, text))
            while not frames.done:
                raw = resp.read1(65536)
                if not raw:
                    break
                now = time.perf_counter()
                for obj in frames.feed(raw):
                    tally.feed(now, obj)
            if frames.done:
                resp.read()  # the end of the chunked body, so the connection can be reused
            else:
                self.close()
        except Failed as exc:
            self.close()
            return failed_result(start, time.perf_counter(), str(exc))
        except (OSError, ValueError, http.client.HTTPException) as exc:
            self.close()
            return failed_result(start, time.perf_counter(), _error_text(exc, phase))
        return tally.result(time.perf_counter(), frames.done)


class _Writer:
    """Sends one message per object, whole messages only (workers send concurrently)."""

    def __init__(self, send):
        self.send = send
        self.lock = threading.Lock()

    def emit(self, obj):
        with self.lock:
            self.send(obj)


# How far ahead of the first arrival a rate-driven batch is scheduled: time for every
# worker thread to hold its request and sleep on its own timer, so that no arrival waits
# for a thread to wake.
_SCHEDULE_LEAD_S = 0.02


def _run_batch(requests, load, address, port, rng, on_result):
    """Send ``requests`` with at most ``concurrency`` in flight; returns the time the
    batch began (its first request was due).

    With ``rng``, Poisson arrivals at ``request_rate`` as the controller's client has them
    (the same seeded gaps): request i is due at its arrival time and waits for a free
    slot, as a task waits for the semaphore there. The schedule is fixed up front, and
    each worker sleeps until its request is due, so threads waking late do not shift the
    arrivals that follow.
    """
    work: queue.Queue = queue.Queue()
    concurrency = max(1, int(load["concurrency"]))

    def worker():
        conn = _Connection(address, port, float(load["timeout_s"]))
        try:
            while True:
                item = work.get()
                if item is None:
                    return
                index, route, body, due = item
                if due is not None:
                    delay = due - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                on_result(index, conn.send(load["api"], route, body))
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    began = time.perf_counter()
    offset = None
    if rng is not None:
        began += _SCHEDULE_LEAD_S
        offset = 0.0
    for index, (route, body) in enumerate(requests):
        if offset is not None and index:
            offset += rng.expovariate(load.get("request_rate") or 1.0)
        work.put((index, route, body, None if offset is None else began + offset))
    for _ in threads:
        work.put(None)
    for t in threads:
        t.join()
    return began


def run_load(load, address, port, writer):
    warm_failed = [0]

    def warm_done(_index, result):
        if not result["ok"]:
            warm_failed[0] += 1

    def done(index, result):
        writer.emit({"kind": "request", "index": index, "result": result})

    if load.get("warmup"):
        _run_batch(load["warmup"], load, address, port, None, warm_done)
    rng = random.Random(load.get("seed", 0)) if load.get("request_rate") else None
    cpu0 = time.process_time()
    began = _run_batch(load["requests"], load, address, port, rng, done)
    writer.emit({
        "kind": SUMMARY,
        "duration_s": time.perf_counter() - began,
        "warmup_failures": warm_failed[0],
        "cpu_s": time.process_time() - cpu0,
    })


def _simple(address, port, method, path, timeout, body=None):
    conn = http.client.HTTPConnection(address, port, timeout=timeout)
    try:
        if body is None:
            conn.request(method, path)
        else:
            conn.request(method, path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read(1 << 20)
    finally:
        conn.close()


def flush_cache(address, port, timeout):
    try:
        status, _ = _simple(address, port, "POST", "/flush_cache", timeout)
    except (OSError, ValueError) as exc:
        return {"kind": "flush", "ok": False, "detail": _error_text(exc, "connect")}
    return {"kind": "flush", "ok": status == 200, "detail": f"HTTP {status}"}


def set_state(address, port, body, timeout):
    """``POST /set_internal_state`` (a live DDTree tree switch); the controller judges it."""
    try:
        status, raw = _simple(address, port, "POST", "/set_internal_state", timeout, body=body)
    except (OSError, ValueError) as exc:
        return {"kind": "set_state", "status": None, "body": _error_text(exc, "connect")}
    return {"kind": "set_state", "status": status, "body": raw.decode("utf-8", "replace")}


def rendered_ids(status, body):
    """(ids, None) or (None, why) from one ``/v1/tokenize`` answer for a chat prompt.

    SGLang renders ``messages`` there exactly as for a chat completion (the served
    model's chat template, ``serving_tokenize.py`` ``_tokenize_chat_request``); a model
    without a template answers 400 with its ``message``."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body)
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if status != 200:
        msg = (obj.get("message") or obj.get("detail")) if isinstance(obj, dict) else None
        return None, f"HTTP {status}: {str(msg or text.strip())[:200]}"
    tokens = obj.get("tokens") if isinstance(obj, dict) else None
    if not isinstance(tokens, list) or not tokens or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        return None, "the answer holds no token ids"
    return tokens, None


def render_chat(address, port, conversations, timeout):
    """Each conversation's ids as the served model's chat template renders them."""
    ids = []
    for messages in conversations:
        body = {"messages": messages}
        try:
            status, raw = _simple(address, port, "POST", "/v1/tokenize", timeout, body=body)
        except (OSError, ValueError) as exc:
            return {"kind": "rendered", "error": _error_text(exc, "connect")}
        one, why = rendered_ids(status, raw)
        if why is not None:
            return {"kind": "rendered", "error": why}
        ids.append(one)
    return {"kind": "rendered", "ids": ids}


def server_info(address, port, timeout):
    try:
        status, body = _simple(address, port, "GET", "/server_info", timeout)
        info = json.loads(body) if status == 200 else None
    except (OSError, ValueError):
        info = None
    return {"kind": "server_info", "info": info if isinstance(info, dict) else None}


def main(p, send):
    writer = _Writer(send)
    address, port = p["address"], int(p["port"])
    if p.get("flush"):
        writer.emit(flush_cache(address, port, float(p.get("flush_timeout_s", 30.0))))
    # Before server_info, so that one run switches the tree and reads back whether it took.
    if p.get("set_state"):
        writer.emit(set_state(address, port, p["set_state"], float(p.get("set_state_timeout_s", 30.0))))
    if p.get("server_info"):
        writer.emit(server_info(address, port, float(p.get("info_timeout_s", 10.0))))
    if p.get("render"):
        writer.emit(render_chat(address, port, p["render"], float(p.get("render_timeout_s", 30.0))))
    if p.get("load"):
        run_load(p["load"], address, port, writer)


if __name__ == "__main__":
    main(globals()["PAYLOAD"], globals()["reply"])  # both defined by the bootstrap
