"""A real HTTP server on loopback standing in for an external tool or webhook: it records every
request's idempotency key and can fail, hang or delay on command."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Target:
    """``behaviour(key, nth_time_seen) -> status`` decides each answer (default: 200; a 3xx
    redirects to ``/elsewhere``; -1 hangs until released; -2 sends a 200 a byte every half
    second, status line and all, until released)."""

    def __init__(self, behaviour: Callable[[str, int], int] | None = None, delay: float = 0.0):
        self.behaviour = behaviour or (lambda key, n: 200)
        self.delay = delay
        self.seen: Counter[str] = Counter()
        self.requests: list[dict[str, Any]] = []
        self.in_flight: Counter[str] = Counter()
        self.overlaps = 0  # a key requested again while its previous request was still open
        self.first_request = threading.Event()
        self.release = threading.Event()  # for hang(): answer the held requests
        self.lock = threading.Lock()
        target = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                key = self.headers.get("Idempotency-Key", "")
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with target.lock:
                    target.seen[key] += 1
                    n = target.seen[key]
                    if target.in_flight[key]:
                        target.overlaps += 1
                    target.in_flight[key] += 1
                    target.requests.append(
                        {"key": key, "n": n, "body": body, "headers": dict(self.headers)}
                    )
                target.first_request.set()
                try:
                    status = target.behaviour(key, n)
                    if status == -1:  # hang until released (the caller is killed meanwhile)
                        target.release.wait(60)
                        status = 200
                    if target.delay:
                        time.sleep(target.delay)
                    if status == -2:  # a 200 that trickles in, a byte every half second
                        self._trickle()
                        return
                    self.send_response(status)
                    if 300 <= status < 400:
                        self.send_header("Location", "/elsewhere")
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok" if status < 400 else b"no")
                finally:
                    with target.lock:
                        target.in_flight[key] -= 1

            def do_GET(self) -> None:  # only a followed redirect would come here
                with target.lock:
                    target.requests.append({"key": None, "get": self.path})
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _trickle(self) -> None:
                for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok":
                    if target.release.wait(0.5):
                        return
                    try:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                    except OSError:
                        return

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def __enter__(self) -> Target:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
