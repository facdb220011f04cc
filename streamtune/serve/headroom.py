"""SLO headroom of `streamtune serve`, published for a trainer on the same device.

The server times every inference request (/v1/...) from its first byte in to its last byte
out, and keeps the last `window_s` seconds of them. Headroom is how far the p99 of that window
is below the target: (target − p99) / target, 1.0 with no request in the window (an idle
server has all of it), negative when the SLO is missed. A trainer sharing the device reads
it (operators/arbiter.py) and yields between micro-batches while it is used up.

It is published on a small HTTP endpoint of its own, on loopback by default (co-location
means the same machine): `GET /headroom` answers
`{"headroom", "p99_ms", "target_ms", "requests", "window_s"}`. It carries no secret and
changes nothing, so it needs no token, and it stays off the API's authenticated routes.

>>> clock = [100.0]
>>> slo = SloHeadroom(target_p99_ms=200, window_s=10, clock=lambda: clock[0])
>>> slo.snapshot()["headroom"]
1.0
>>> for ms in [50] * 98 + [300, 400]:
...     slo.observe(ms / 1000)
>>> s = slo.snapshot(); s["p99_ms"], s["headroom"]
(300.0, -0.5)
>>> clock[0] += 11  # the slow requests leave the window
>>> slo.snapshot()["headroom"], slo.snapshot()["requests"]
(1.0, 0)
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class SloHeadroom:
    """Request latencies over a sliding window, against a p99 target."""

    def __init__(self, target_p99_ms: float, window_s: float = 10.0, clock=time.monotonic, max_requests: int = 100_000):
        if not target_p99_ms > 0 or not window_s > 0:
            raise ValueError(f"SLO target ({target_p99_ms} ms) and window ({window_s} s) must be positive")
        self.target_ms, self.window_s, self.clock = float(target_p99_ms), float(window_s), clock
        self._latencies: deque[tuple[float, float]] = deque(maxlen=max_requests)  # (when, seconds)
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._latencies.append((self.clock(), seconds))

    def snapshot(self) -> dict:
        now = self.clock()
        with self._lock:
            while self._latencies and self._latencies[0][0] < now - self.window_s:
                self._latencies.popleft()
            latencies = sorted(s for _, s in self._latencies)
        if not latencies:
            p99_ms, headroom = None, 1.0
        else:
            # The nearest-rank p99: the smallest latency at or above 99 % of the requests.
            p99_ms = latencies[max(0, math.ceil(0.99 * len(latencies)) - 1)] * 1000
            headroom = (self.target_ms - p99_ms) / self.target_ms
        return {"headroom": round(headroom, 6), "p99_ms": None if p99_ms is None else round(p99_ms, 3),
                "target_ms": self.target_ms, "requests": len(latencies), "window_s": self.window_s}


class HeadroomMiddleware:
    """ASGI middleware: each request under `prefix` is timed into `slo` until its response ends
    (a streamed answer counts until its last chunk)."""

    def __init__(self, app, slo: SloHeadroom, prefix: str = "/v1/"):
        self.app, self.slo, self.prefix = app, slo, prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith(self.prefix):
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        done = False

        async def timed_send(message):
            nonlocal done
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not done:
                done = True
                self.slo.observe(time.perf_counter() - started)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            if not done:  # an error or a dropped client: the time it took still counts
                self.slo.observe(time.perf_counter() - started)


class HeadroomServer:
    """`GET /headroom` on its own port (0: any free one; `.url` names it), in a daemon thread."""

    def __init__(self, slo: SloHeadroom, host: str = "127.0.0.1", port: int = 0):
        slo_ = slo

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path.split("?")[0] != "/headroom":
                    self.send_error(404, "only /headroom here")
                    return
                body = json.dumps(slo_.snapshot()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # one line per poll would flood the server's log
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="slo-headroom", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/headroom"

    def start(self) -> "HeadroomServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def add_headroom_arguments(p: argparse.ArgumentParser) -> None:
    """`streamtune serve` flags: the SLO whose headroom a co-located trainer yields to."""
    p.add_argument("--slo-p99-ms", type=float, default=None,
                   help="p99 latency target of inference requests; with it the server publishes its headroom "
                        "for a trainer on the same device (operators/arbiter.py)")
    p.add_argument("--slo-window-s", type=float, default=10.0, help="the window the p99 is taken over")
    p.add_argument("--headroom-host", default="127.0.0.1", help="where GET /headroom listens (loopback by default)")
    p.add_argument("--headroom-port", type=int, default=8790, help="its port")


def install_headroom(app, args: argparse.Namespace) -> HeadroomServer | None:
    """With --slo-p99-ms: time the app's requests and publish the headroom; None without it."""
    if args.slo_p99_ms is None:
        return None
    slo = SloHeadroom(args.slo_p99_ms, args.slo_window_s)
    app.add_middleware(HeadroomMiddleware, slo=slo)
    return HeadroomServer(slo, args.headroom_host, args.headroom_port).start()
