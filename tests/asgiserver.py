"""A real uvicorn server for an ASGI app, on a loopback port, in a thread of the test."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


@contextmanager
def serve_in_thread(app: Any, **config: Any) -> Iterator[str]:
    """Serve ``app`` until the block ends; yields its base URL. ``config`` goes to
    ``uvicorn.Config`` (e.g. ``http=`` a protocol class)."""
    # proto=IPPROTO_TCP: asyncio turns Nagle off only on sockets that say TCP (its
    # _set_nodelay checks sock.proto), and accepted sockets inherit this one's. With
    # proto 0 the server held each frame until the client's delayed ACK (~40 ms) on a
    # kept-alive connection, so frames of every request after the first arrived together.
    # A server started on host/port (uvicorn, SGLang, the simulator) has proto 6 already.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
