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

    {"kind": "flush", "ok": true, "detail": "HTTP 200"}   (not ok: nothing after it runs)
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
import random
import re
import socket
import threading
import time

SUMMARY = "summary"
# Of a flush's timeout, what is left for the server's answer after its own wait for idle.
FLUSH_ANSWER_S = 5.0
# A result's answer text, kept in the engine for a multi-turn question's next turn and
# taken out before the result is reported (nobody else needs it).
ANSWER = "_answer"


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
        """The data of each frame completed by ``raw`` (bytes, not parsed: a tally parses
        what it needs, see :func:`parse_frame`)."""
        self._buf += raw
        frames = self._buf.split(b"\n")
        self._buf = frames.pop()
        out: list = []
        for frame in frames:
            if not frame.startswith(b"data:"):
                continue
            data = frame[5:].strip()
            if data == b"[DONE]":
                self.done = True
                return out
            out.append(data)
        return out


def parse_frame(data):
    """One frame's JSON object; raises Failed on SGLang's in-stream error object."""
    obj = json.loads(data)
    if "error" in obj:
        err = obj["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise Failed(f"server error: {msg}"[:300])
    return obj


# The token count of a /generate frame, read without parsing the frame. A JSON string
# cannot hold this byte sequence (its quotes would be escaped), so a match is the key itself.
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


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
        # Once a frame after the first has shown whole output_ids (SGLang's default), each
        # frame repeats everything before it: only its token count is read, and the last
        # frame is parsed at the end. Parsing every frame was the largest part of the
        # client's CPU per token (a frame's JSON grows with the output).
        self.cumulative = False
        self.unparsed = None
        self.text = ""  # the answer so far: a multi-turn question's next turn carries it

    def feed(self, now, data):
        if self.cumulative and b'"error"' not in data:
            found = _COMPLETION_TOKENS.findall(data)
            if len(found) == 1:
                self.unparsed = data
                tokens = int(found[0])
                if tokens > self.last_tokens:
                    self._step(now, tokens)
                return
        self._parsed(now, parse_frame(data))

    def _parsed(self, now, obj):
        self.unparsed = None
        self.meta = obj.get("meta_info") or {}
        tokens = int(self.meta.get("completion_tokens", 0))
        ids = obj.get("output_ids")
        # Cumulative by default; deltas under --incremental-streaming-output, where a chunk
        # holds only its new tokens. The text also in a frame with no new token: the
        # detokenizer may have held back part of a character until then.
        whole = not isinstance(ids, list) or len(ids) == tokens or self.output_ids is None
        text = obj.get("text")
        text = text if isinstance(text, str) else ""
        self.text = text if whole else self.text + text
        if tokens <= self.last_tokens:
            return
        if isinstance(ids, list):
            if whole or self.output_ids is None:
                self.cumulative = self.output_ids is not None and len(ids) == tokens
                self.output_ids = ids  # a list of the parsed frame's own: nobody else holds it
            else:
                self.output_ids.extend(ids)
        self._step(now, tokens)

    def _step(self, now, tokens):
        new = tokens - self.last_tokens
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
        if self.unparsed is not None:  # the last frame: its meta_info and whole output_ids
            try:
                obj = parse_frame(self.unparsed)
            except Failed as exc:
                return failed_result(self.start, end, str(exc))
            except ValueError as exc:  # what a frame that does not parse fails with when read as it comes
                return failed_result(self.start, end, _error_text(exc, "request"))
            self.meta = obj.get("meta_info") or {}
            ids = obj.get("output_ids")
            if isinstance(ids, list) and len(ids) == self.last_tokens:
                self.output_ids = ids
            if isinstance(obj.get("text"), str):
                self.text = obj["text"]
        meta = self.meta
        verify = meta.get("spec_verify_ct")
        accept = meta.get("spec_accept_length")
        server_e2e = meta.get("e2e_latency")
        extra = {"trace": meta["ddtree_trace"]} if meta.get("ddtree_trace") is not None else {}
        return {
            **extra,
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
            ANSWER: self.text,
        }


class OpenAITally:
    """``/v1/completions`` and ``/v1/chat/completions``: token counts from the final
    ``usage`` chunk; chunks do not say how many tokens they carry."""

    def __init__(self, start):
        self.start = start
        self.times = []
        self.usage = {}
        self.pieces = []

    def feed(self, now, data):
        obj = parse_frame(data)
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
            ANSWER: "".join(self.pieces),
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


class _Chunked:
    """HTTP/1.1 chunked transfer decoding over raw reads, by hand: http.client's chunked
    reader costs several Python calls per chunk, and a streamed response is one chunk per
    SSE frame, so it was a large part of the client's CPU per token."""

    def __init__(self):
        self.buf = b""
        self.left = 0  # bytes of the current chunk still to come
        self.crlf = False  # the CRLF after a chunk's data is still to come
        self.finished = False

    def feed(self, raw):
        buf = self.buf + raw if self.buf else raw
        out = []
        pos = 0
        n = len(buf)
        while pos < n and not self.finished:
            if self.left:
                take = min(self.left, n - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self.left -= take
                if not self.left:
                    self.crlf = True
                continue
            if self.crlf:
                if n - pos < 2:
                    break
                pos += 2
                self.crlf = False
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(buf[pos:eol].split(b";", 1)[0], 16)
            if size == 0:
                # The last chunk; no trailers are sent by SGLang's server (uvicorn).
                if buf.find(b"\r\n", eol + 2) < 0:
                    break
                self.finished = True
                pos = n
                break
            pos = eol + 2
            self.left = size
        self.buf = buf[pos:] if pos < n else b""
        return b"".join(out)


class Connection:
    """One worker's keep-alive connection to the server, on asyncio streams (the
    controller's client pools connections too, so neither mode pays a TCP connect per
    request). One event loop serves every in-flight stream: threads, one per stream,
    cost a GIL hand-over per frame."""

    def __init__(self, address, port, timeout, tls=None):
        self.address, self.port, self.timeout, self.tls = address, port, timeout, tls
        self.reader = self.writer = None
        self.busy_since = None  # monotonic time of the last byte while a request is open
        self.timed_out = False

    def close(self):
        if self.writer is not None:
            self.writer.transport.abort()
            self.reader = self.writer = None

    def watch(self, now):
        """Called by the run's watchdog: cut a request whose stream has been silent for
        the timeout (httpx's read timeout: time since the last byte, not since the start)."""
        if self.busy_since is not None and now - self.busy_since > self.timeout and self.writer is not None:
            self.timed_out = True
            self.writer.transport.abort()

    async def _open(self):
        """asyncio.open_connection's own steps, with a reader that stamps arrivals."""
        import asyncio

        loop = asyncio.get_running_loop()
        reader = _stamped_reader_class()(limit=1 << 20, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: protocol, self.address, self.port, ssl=self.tls), self.timeout)
        except asyncio.TimeoutError:
            raise socket.timeout("connect") from None
        self.reader, self.writer = reader, asyncio.StreamWriter(transport, protocol, reader, loop)

    async def send(self, api, route, body):
        """One streamed request as a RequestResult dict; never raises for HTTP failures."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = (f"POST {route} HTTP/1.1\r\nHost: {self.address}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
        reused = self.writer is not None
        for attempt in (0, 1):
            start = time.perf_counter()
            result, retry = await self._send_once(api, head + data, start, reused and not attempt)
            if not retry:
                return result
            reused = False
        return result

    async def _send_once(self, api, request, start, may_retry):
        """(result, retry): retry when a kept-alive connection turned out closed before the
        server answered a byte (it had closed it while idle); the request is sent again on
        a new connection, as HTTP clients do."""
        tally = new_tally(api, start)
        frames = SseFrames()
        phase = "connect"
        self.timed_out = False
        try:
            if self.writer is None:
                await self._open()
            reader, writer = self.reader, self.writer
            assert reader is not None and writer is not None
            phase = "request"
            self.busy_since = time.monotonic()
            writer.write(request)
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except Exception:
                if may_retry and not self.timed_out:
                    self.close()
                    return None, True
                raise
            lines = head.split(b"\r\n")
            status = int(lines[0].split(None, 2)[1])
            headers = {}
            for line in lines[1:]:
                if b":" in line:
                    k, v = line.split(b":", 1)
                    headers[k.strip().lower()] = v.strip()
            chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
            length = headers.get(b"content-length")
            keep = headers.get(b"connection", b"").lower() != b"close"
            if status != 200:
                text = await reader.readexactly(int(length)) if length is not None else await reader.read(1 << 16)
                self.close()
                raise Failed(http_status_error(status, text))
            decoder = _Chunked() if chunked else None
            remaining = int(length) if (length is not None and not chunked) else None
            arrived = None
            while not frames.done:
                raw = await reader.read(65536)
                if not raw:
                    break
                # When these bytes reached the process, not when this coroutine got to
                # them: with hundreds of streams on one loop it runs late in a burst.
                now = arrived = reader.arrived
                self.busy_since = time.monotonic()
                if decoder is not None:
                    raw = decoder.feed(raw)
                elif remaining is not None:
                    remaining -= len(raw)
                for data in frames.feed(raw):
                    tally.feed(now, data)
                if (decoder is not None and decoder.finished) or (remaining is not None and remaining <= 0):
                    break
            if self.timed_out:
                raise socket.timeout("read")
            if frames.done and decoder is not None and not decoder.finished:
                # The end of the chunked body, so the connection can be reused.
                while not decoder.finished:
                    raw = await reader.read(65536)
                    if not raw:
                        keep = False
                        break
                    decoder.feed(raw)
            if decoder is not None and not decoder.finished and not frames.done:
                raise http.client.IncompleteRead(b"")
            if not (frames.done and keep and (decoder is None or decoder.finished)):
                self.close()
        except Failed as exc:
            self.close()
            return failed_result(start, time.perf_counter(), str(exc)), False
        except Exception as exc:  # noqa: BLE001 - every failure of one request is data
            self.close()
            err = exc
            if self.timed_out:
                err = socket.timeout("read")
            elif type(exc).__name__ == "IncompleteReadError":  # asyncio's EOF inside a head
                err = http.client.RemoteDisconnected("Remote end closed connection without response")
            return failed_result(start, time.perf_counter(), _error_text(err, phase)), False
        finally:
            self.busy_since = None
        # A whole stream ends when its [DONE] arrived (AIPerf's response end), not after
        # the reads of other streams the loop did first.
        return tally.result(arrived if frames.done else time.perf_counter(), frames.done), False


_STAMPED_READER: list[type] = []


def _stamped_reader_class():
    """asyncio.StreamReader that notes when its newest bytes arrived (``arrived``,
    perf_counter): the event loop feeds every readable socket's bytes before it resumes
    any coroutine, so this is the arrival to within one loop pass. Made on first use, as
    asyncio is imported only by the commands that run a load."""
    if not _STAMPED_READER:
        import asyncio

        class StampedReader(asyncio.StreamReader):
            arrived = 0.0

            def feed_data(self, data):
                self.arrived = time.perf_counter()
                super().feed_data(data)

        _STAMPED_READER.append(StampedReader)
    return _STAMPED_READER[0]


class _Writer:
    """Sends one message per object, whole messages only (workers send concurrently)."""

    def __init__(self, send):
        self.send = send
        self.lock = threading.Lock()

    def emit(self, obj):
        with self.lock:
            self.send(obj)


# How far ahead of the first arrival a rate-driven batch is scheduled: time for every
# worker to hold its request and sleep on its own timer, so that no arrival waits for a
# worker to wake.
_SCHEDULE_LEAD_S = 0.02


async def _run_batch(requests, load, conns, rng, on_result, turns=None):
    """Send ``requests`` with at most ``concurrency`` in flight; returns the time the
    batch began (its first request was due). ``turns`` (a :class:`_Turns`) sends the later
    turns of multi-turn questions, each after the answer to the turn before.

    With ``rng``, Poisson arrivals at ``request_rate`` as the controller's client has them
    (the same seeded gaps): request i is due at its arrival time and waits for a free
    slot, as a task waits for the semaphore there. The schedule is fixed up front, and
    each worker sleeps until its request is due, so workers waking late do not shift the
    arrivals that follow.
    """
    import asyncio

    timeout = float(load["timeout_s"])
    conns = conns[:max(1, len(requests))]
    began = time.perf_counter()
    offset = None
    if rng is not None:
        began += _SCHEDULE_LEAD_S
        offset = 0.0
    work = []
    for index, (route, body) in enumerate(requests):
        if offset is not None and index:
            offset += rng.expovariate(load.get("request_rate") or 1.0)
        work.append((index, route, json.dumps(body).encode(), None if offset is None else began + offset))
    work.reverse()  # popped from the end: in order
    if rng is None:
        began = time.perf_counter()  # a closed loop begins with its first send, after the bodies are built

    async def worker(conn):
        try:
            while work:
                index, route, body, due = work.pop()
                if due is not None:
                    delay = due - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                result = await conn.send(load["api"], route, body)
                answer = result.pop(ANSWER, None) if result["ok"] else None
                on_result(index, result)
                if turns is not None and index in turns.sessions:
                    await turns.follow_up(conn, index, route, requests[index][1], answer, on_result)
        except BaseException:
            conn.close()
            raise

    async def watchdog():
        tick = min(1.0, max(0.05, timeout / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for conn in conns:
                conn.watch(now)

    dog = asyncio.ensure_future(watchdog())
    try:
        await asyncio.gather(*(worker(c) for c in conns))
    finally:
        dog.cancel()
    return began


class _Turns:
    """The later turns of multi-turn questions (MT-Bench's second turn): each is sent on the
    same connection once the turn before it has its answer, as the conversation so far
    (the question, the model's answer, the next question) through the served model's chat
    template: as messages on the OpenAI chat route, or for ``/generate`` as the ids
    ``/v1/tokenize`` renders them to (untimed, in a thread, so that the loop keeps reading
    the other streams). ``load["sessions"]``: request index -> its messages, its follow-up
    texts and the result index of the first follow-up. A turn whose answer is missing
    leaves the turns after it failed, not sent."""

    def __init__(self, load, address, port, tls):
        self.sessions = {int(k): v for k, v in load["sessions"].items()}
        self.api = load["api"]
        self.address, self.port, self.tls = address, port, tls
        self.timeout = min(30.0, float(load["timeout_s"]))

    async def _render(self, messages):
        import asyncio

        got = await asyncio.get_running_loop().run_in_executor(
            None, render_chat, self.address, self.port, [messages], self.timeout, self.tls)
        return (got["ids"][0], None) if "ids" in got else (None, got["error"])

    async def follow_up(self, conn, index, route, first_body, answer, on_result):
        session = self.sessions[index]
        messages = list(session["messages"])
        for k, question in enumerate(session["followups"]):
            at = session["first"] + k
            if answer is None:
                now = time.perf_counter()
                on_result(at, failed_result(now, now, "not sent: the turn before it failed"))
                continue
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
            if self.api == "openai":
                body = dict(first_body, messages=messages)
            else:
                ids, why = await self._render(messages)
                if why is not None:
                    now = time.perf_counter()
                    on_result(at, failed_result(now, now, "not sent: the conversation could not be rendered "
                                                          f"through the chat template (POST /v1/tokenize): {why}"))
                    answer = None
                    continue
                body = dict(first_body, input_ids=ids)
            result = await conn.send(self.api, route, body)
            answer = result.pop(ANSWER, None) if result["ok"] else None
            on_result(at, result)


def run_load(load, address, port, writer, tls=None):
    """The load run: warmup, then the measured requests, each reported as it ends."""
    import asyncio

    warm_failed = [0]
    last_end = [None]

    def warm_done(_index, result):
        if not result["ok"]:
            warm_failed[0] += 1

    def done(index, result):
        if last_end[0] is None or result["end"] > last_end[0]:
            last_end[0] = result["end"]
        writer.emit({"kind": "request", "index": index, "result": result})

    async def both():
        # One pool for both batches: the warmup opens the connections the measured requests
        # use, so no TCP connect is timed (a closed loop keeps its connections alive).
        conns = [Connection(address, port, float(load["timeout_s"]), tls)
                 for _ in range(max(1, int(load["concurrency"])))]
        try:
            if load.get("warmup"):
                await _run_batch(load["warmup"], load, conns, None, warm_done)
            rng = random.Random(load.get("seed", 0)) if load.get("request_rate") else None
            turns = _Turns(load, address, port, tls) if load.get("sessions") else None
            cpu0 = time.process_time()
            began = await _run_batch(load["requests"], load, conns, rng, done, turns)
        finally:
            for conn in conns:
                conn.close()
        # The run ends when its last response ended (AIPerf's benchmark duration), not
        # after the client has reported every result and closed its connections.
        ended = last_end[0] if last_end[0] is not None else time.perf_counter()
        writer.emit({
            "kind": SUMMARY,
            "duration_s": max(0.0, ended - began),
            "warmup_failures": warm_failed[0],
            "cpu_s": time.process_time() - cpu0,
        })

    asyncio.run(both())


def _simple(address, port, method, path, timeout, body=None, tls=None):
    conn = (http.client.HTTPSConnection(address, port, timeout=timeout, context=tls) if tls is not None
            else http.client.HTTPConnection(address, port, timeout=timeout))
    try:
        if body is None:
            conn.request(method, path)
        else:
            conn.request(method, path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read(1 << 20)
    finally:
        conn.close()


def flush_cache(address, port, timeout, tls=None):
    """``POST /flush_cache?timeout=S``: SGLang 0.5.23 flushes at once when idle, else waits up
    to S seconds for its running and waiting requests to end (``SchedulerFlushWrapper``)
    and answers 400 if they do not. The answer's first line says which refusal it was."""
    wait = max(0.0, timeout - FLUSH_ANSWER_S)
    try:
        status, body = _simple(address, port, "POST", f"/flush_cache?timeout={wait:.3f}", timeout, tls=tls)
    except (OSError, ValueError, http.client.HTTPException) as exc:  # an answer, never a crash
        return {"kind": "flush", "ok": False, "detail": _error_text(exc, "connect")}
    detail = f"HTTP {status}"
    said = body.decode("utf-8", "replace").strip().splitlines()
    if status != 200 and said:
        detail += ": " + said[0][:200]
    return {"kind": "flush", "ok": status == 200, "detail": detail}


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


def render_chat(address, port, conversations, timeout, tls=None):
    """Each conversation's ids as the served model's chat template renders them."""
    ids = []
    for messages in conversations:
        body = {"messages": messages}
        try:
            status, raw = _simple(address, port, "POST", "/v1/tokenize", timeout, body=body, tls=tls)
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
        flushed = flush_cache(address, port, float(p.get("flush_timeout_s", 30.0)))
        writer.emit(flushed)
        if not flushed["ok"]:
            # A load after a refused flush would measure a warm cache, or beside requests
            # that are not its own: none is sent (the controller says why).
            return
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
