"""A bounded HTTP server for ``/metrics``: one thread, a few connections, short deadlines.

``prometheus_client.start_http_server`` starts a thread per connection and sets no timeout, so
300 clients that send half a request held 305 threads in the coordinator for over 32 s, and 300
fast ones kept the interpreter busy enough to starve its control loop past the lease (issue 36).
A metrics endpoint is scraped by one Prometheus every few seconds, so this one trades throughput
for bounds:

- one thread, a ``selectors`` loop over non-blocking sockets: no thread per client, and the
  control loop only ever competes with this one thread for the interpreter;
- at most ``max_conns`` connections open: one more is accepted and closed at once;
- ``timeout_s`` for a connection's whole life, from accept to the last byte sent, so a client
  that trickles bytes (slowloris) is cut off as surely as a silent one;
- a request is at most ``max_request`` bytes, head included (``GET /metrics`` needs a few hundred);
- at most ``accepts_per_s`` connections a second: past that the listening socket is left alone
  until the next tick, and the kernel's backlog queues (or refuses) the rest. This bounds the
  CPU that any flood costs, whatever the clients do;
- the body (``generate_latest``) is built at most every ``cache_s`` and shared by the requests
  in between, so a flood costs socket writes, not metric collection.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["MetricsServer"]


@dataclass
class _Conn:
    deadline: float  # monotonic time past which the connection is closed, whatever its state
    inbuf: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None  # the response still to send, once the request was read


def _response(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class MetricsServer:
    """Serve ``body()`` at ``GET /metrics`` (and ``/``) from one background thread."""

    def __init__(
        self,
        body: Callable[[], bytes],
        content_type: str,
        *,
        max_conns: int = 32,
        timeout_s: float = 2.0,
        max_request: int = 8192,
        accepts_per_s: float = 400.0,
        cache_s: float = 0.25,
    ) -> None:
        self._body_fn = body
        self._content_type = content_type
        self.max_conns = max_conns
        self.timeout_s = timeout_s
        self.max_request = max_request
        self.accepts_per_s = accepts_per_s
        self.cache_s = cache_s
        self._sel = selectors.DefaultSelector()
        self._conns: dict[socket.socket, _Conn] = {}
        self._listener: socket.socket | None = None
        self._listening = False
        self._tokens = 0.0  # accepts left in the current tick (a token bucket, refilled by time)
        self._refilled = time.monotonic()
        self._cached: tuple[float, bytes] | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cl-metrics-http", daemon=True)
        # what a test or the benchmark reads: how the server has been used
        self.served = 0
        self.refused = 0  # closed at accept: too many connections open
        self.expired = 0  # closed at their deadline
        self.rejected = 0  # a bad or oversized request

    # -- life ------------------------------------------------------------------------------------
    def start(self, host: str, port: int) -> int:
        """Bind ``host:port`` and start serving; the port bound. Raises ``OSError`` from bind."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._listen(True)
        self._thread.start()
        return int(self._listener.getsockname()[1])

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        for s in [*self._conns, self._listener, self._wake_r, self._wake_w]:
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()
        self._conns.clear()
        self._sel.close()

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    # -- the loop --------------------------------------------------------------------------------
    def _listen(self, on: bool) -> None:
        assert self._listener is not None
        if on and not self._listening:
            self._sel.register(self._listener, selectors.EVENT_READ)
        elif not on and self._listening:
            self._sel.unregister(self._listener)
        self._listening = on

    def _loop(self) -> None:
        tick = 0.05
        while not self._stop.is_set():
            now = time.monotonic()
            # refill the accept budget; with none left the listener sits out until the next tick
            self._tokens = min(
                self.accepts_per_s * tick, self._tokens + (now - self._refilled) * self.accepts_per_s
            )
            self._refilled = now
            self._listen(self._tokens >= 1.0)
            nearest = min((c.deadline for c in self._conns.values()), default=now + tick)
            for key, mask in self._sel.select(max(0.0, min(tick, nearest - now))):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                if s is self._listener:
                    self._accept()
                elif s is self._wake_r:
                    return
                elif mask & selectors.EVENT_WRITE:
                    self._send(s)
                else:
                    self._read(s)
            now = time.monotonic()
            for s in [s for s, c in self._conns.items() if c.deadline <= now]:
                self.expired += 1
                self._drop(s)

    def _accept(self) -> None:
        assert self._listener is not None
        while self._tokens >= 1.0:
            try:
                s, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. EMFILE: try again on the next tick
            self._tokens -= 1.0
            if len(self._conns) >= self.max_conns:
                self.refused += 1
                s.close()  # over the cap: closed at once, before reading a byte
                continue
            s.setblocking(False)
            self._conns[s] = _Conn(deadline=time.monotonic() + self.timeout_s)
            self._sel.register(s, selectors.EVENT_READ)

    def _drop(self, s: socket.socket) -> None:
        self._conns.pop(s, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(s)
        with contextlib.suppress(OSError):
            s.close()

    def _read(self, s: socket.socket) -> None:
        c = self._conns[s]
        try:
            data = s.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(s)
            return
        c.inbuf += data
        end = c.inbuf.find(b"\r\n\r\n")
        if end < 0:
            if len(c.inbuf) > self.max_request:
                self.rejected += 1
                self._reply(s, c, _response("431 Request Header Fields Too Large", b"request too large\n"))
            return
        line = bytes(c.inbuf[: c.inbuf.find(b"\r\n")]).split()
        if len(line) != 3 or not line[2].startswith(b"HTTP/"):
            self.rejected += 1
            self._reply(s, c, _response("400 Bad Request", b"bad request\n"))
        elif line[0] not in (b"GET", b"HEAD"):
            self.rejected += 1
            self._reply(s, c, _response("405 Method Not Allowed", b"GET /metrics\n"))
        elif line[1].split(b"?")[0] not in (b"/metrics", b"/"):
            self.rejected += 1
            self._reply(s, c, _response("404 Not Found", b"GET /metrics\n"))
        else:
            self.served += 1
            resp = _response("200 OK", self._body(), self._content_type)
            if line[0] == b"HEAD":
                resp = resp[: resp.index(b"\r\n\r\n") + 4]
            self._reply(s, c, resp)

    def _body(self) -> bytes:
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] >= self.cache_s:
            self._cached = (now, self._body_fn())
        return self._cached[1]

    def _reply(self, s: socket.socket, c: _Conn, resp: bytes) -> None:
        c.out = memoryview(resp)
        self._sel.modify(s, selectors.EVENT_WRITE)
        self._send(s)

    def _send(self, s: socket.socket) -> None:
        c = self._conns[s]
        assert c.out is not None
        try:
            sent = s.send(c.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(s)
            return
        c.out = c.out[sent:]
        if not len(c.out):
            self._drop(s)  # Connection: close, so a client cannot hold a slot between requests
