"""The key server every participant runs: it serves the keys that participant owns.

One event-loop thread per participant handles every connection (a full-mesh rendezvous of N ranks
opens N-1 connections to each server, so a thread per connection would not scale). This module is
the connection side: accepting, reading and sealing frames, and deciding which connections to
trust (what each connection has proved so far, and the load counters, are
:mod:`~checkpointless.rendezvous.connections`). What an authenticated request does to the keys,
including the requests that wait for a key (parked, so the loop never blocks on a slow key), is
:mod:`~checkpointless.rendezvous.server_requests`; what both ends share (labels, version, ops) is
:mod:`~checkpointless.rendezvous.keyproto`.

Security: every frame is sealed (:mod:`checkpointless.wire`) with keys derived from the job secret,
one per direction (``keyserver/c2s`` for requests, ``keyserver/s2c`` for replies, so a recorded
reply can never pass as a request). A frame that fails authentication, announces more than the
caps, or breaks the sequence closes its connection with no answer at all: a sealed error would
hand a forger a valid frame for free. Requests carry a strictly increasing sequence number.
Requests that change a key must also carry a nonce that the server issued on that connection
(``hello``), so a recorded request cannot be replayed: an ``add`` replayed would corrupt a
counter. Reads need no nonce: replaying one changes nothing and reveals nothing a recording did
not, and skipping the extra round trip matters because a full-mesh rendezvous is N-1 single reads
per owner.

The loop never blocks on a client's bytes: each connection assembles its frames incrementally
(:class:`~checkpointless.wire.FrameDecoder`) from whatever the socket holds, so a client that
dribbles a frame costs only its buffer, and a frame left incomplete for ``io_timeout`` closes the
connection. (Replies are still written with ``io_timeout`` as their bound: they are small, and a
client that stops reading its own replies only delays the loop by that much once.)

A connection that has not yet sent a sealed frame proves nothing, so it is held on a short leash:
closed if its first frame is not complete within ``hello_timeout``, and at most ``max_unsealed``
such connections are held: for each new one past that, the oldest is served what it sent, and
closed if that did not seal it. A flood of idle connections from a local process therefore holds
a bounded number of descriptors, while the job's own peers, which send their first frame as they
connect (client.py), are sealed rather than closed, even when N of them arrive at once; should
one be closed anyway, the client sends its request again once on a new connection.
"""

from __future__ import annotations

import contextlib
import json
import queue
import selectors
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.rendezvous.connections import Connection, ServerStats
from checkpointless.rendezvous.keyproto import KEYSERVER_C2S, KEYSERVER_S2C, PROTOCOL_VERSION, clamp_wait
from checkpointless.rendezvous.keyspace import KeySpace
from checkpointless.rendezvous.ports import open_listener
from checkpointless.rendezvous.server_requests import RequestHandler
from checkpointless.wire import FrameError, derive_key, send_frame

__all__ = ["KeyServer"]

_READ_CHUNK = 256 << 10
_HELLO_TIMEOUT_S = 30.0  # a peer connects to every owner, then sends: the gap grows with N
_MAX_UNSEALED = 256  # well under a process's usual 1024 descriptors
_FRAME_OVERHEAD = 12 + 32  # length prefix + MAC, for the byte counters
_LISTENER = object()
_WAKER = object()


class KeyServer:
    """Serves this participant's keys, for every generation, on ``host:port``.

    The socket is bound in the constructor so that a taken port is reported (as a
    :class:`ConfigError` naming the port and the setting to change) before anything else starts.
    ``listen_fd`` adopts a socket that the launcher bound and listens on already: connections
    that arrive before this process serves them wait in the kernel's backlog instead of being
    refused, which is how a reader tells "not started yet" from "dead".
    """

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        *,
        listen_fd: int | None = None,
        io_timeout: float = 5.0,
        hello_timeout: float = _HELLO_TIMEOUT_S,
        max_unsealed: int = _MAX_UNSEALED,
    ) -> None:
        if not isinstance(secret, bytes) or not secret:
            raise ConfigError("the key server needs the job secret as non-empty bytes")
        if io_timeout <= 0 or hello_timeout <= 0:
            raise ConfigError(
                f"io_timeout and hello_timeout must be positive, got {io_timeout}, {hello_timeout}"
            )
        if max_unsealed < 1:
            raise ConfigError(f"max_unsealed must be at least 1, got {max_unsealed}")
        self.hello_timeout = hello_timeout
        self.max_unsealed = max_unsealed
        self.secret = secret
        self._rx_key = derive_key(secret, KEYSERVER_C2S)
        self._tx_key = derive_key(secret, KEYSERVER_S2C)
        self.io_timeout = io_timeout
        if listen_fd is None:
            self._listener = open_listener(host, port)
        else:
            self._listener = socket.socket(fileno=listen_fd)
            if not self._listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                self._listener.detach()
                raise ConfigError(f"listen_fd {listen_fd} is not a listening socket")
        self._listener.setblocking(False)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self.keyspace = KeySpace()
        self.stats = ServerStats()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._requests: RequestHandler[Connection] = RequestHandler(self.keyspace, self._send, self._wake)
        self._conns: set[Connection] = set()
        # connections with no sealed frame yet, oldest first (insertion order is accept order)
        self._unsealed: OrderedDict[Connection, None] = OrderedDict()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # connections handed over to a bulk transfer (see open_channel), by channel name
        self._channels: dict[str, queue.SimpleQueue[tuple[socket.socket, dict[str, Any]]]] = {}
        self._channels_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"KeyServer({self.address})"

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKER)
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"cl-keyserver-{self.port}")
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Close the port and every connection; join the loop thread for at most ``timeout`` s."""
        first = not self._stopping.is_set()
        self._stopping.set()
        if self._thread is not None:
            self._wake()
            self._thread.join(timeout)
        elif first:  # never started: nothing but the sockets to close
            self._close_all()

    def __enter__(self) -> KeyServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def drop_prefix(self, prefix: str) -> int:
        """Forget an old generation's keys (e.g. ``"gen3/"``); return how many were dropped."""
        if not prefix:
            raise ConfigError("drop_prefix needs a non-empty prefix (it would drop every generation)")
        return self.keyspace.drop_prefix(prefix)

    def open_channel(self, name: str) -> queue.SimpleQueue[tuple[socket.socket, dict[str, Any]]]:
        """Accept ``stream`` requests for ``name``: each such connection, authenticated and
        nonce-checked like any mutating request, leaves the loop and is queued here with its
        request header, for a bulk transfer (peer state) on the port this process already has."""
        with self._channels_lock:
            return self._channels.setdefault(name, queue.SimpleQueue())

    def close_channel(self, name: str) -> None:
        """Stop accepting for ``name`` and close connections nobody took."""
        with self._channels_lock:
            q = self._channels.pop(name, None)
        while q is not None and not q.empty():
            q.get_nowait()[0].close()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    # -- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                timeout = self._next_timeout()
                for key, _ in self._sel.select(timeout):
                    if key.data is _LISTENER:
                        self._accept()
                    elif key.data is _WAKER:
                        with contextlib.suppress(BlockingIOError, OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._serve(key.data)
                self._requests.answer_ready()
                self._requests.expire()
                self._expire_partial()
                self._expire_unsealed()
            # Answers already due go out before the port closes: a rank that leaves right after
            # a barrier must not take with it the reply that lets the last peer leave too.
            self._requests.answer_ready()
        finally:
            self._close_all()

    def _next_timeout(self) -> float | None:
        deadline = self._requests.next_deadline()
        due = [deadline] if deadline is not None else []
        due += [c.partial_since + self.io_timeout for c in self._conns if c.partial_since is not None]
        if self._unsealed:
            due.append(next(iter(self._unsealed)).accepted + self.hello_timeout)
        # clamped: select cannot wait longer than MAX_WAIT_S (it raises), and waking early only
        # means one more turn of the loop
        return clamp_wait(min(due) - time.monotonic()) if due else None

    def _expire_unsealed(self) -> None:
        """Close connections that have not sent a sealed frame within hello_timeout."""
        cutoff = time.monotonic() - self.hello_timeout
        while self._unsealed:
            conn = next(iter(self._unsealed))
            if conn.accepted > cutoff:
                return
            self.stats.unsealed_closed += 1
            self._drop(conn)

    def _expire_partial(self) -> None:
        """Close connections whose frame stayed incomplete for io_timeout (stopped or hostile)."""
        cutoff = time.monotonic() - self.io_timeout
        for conn in [c for c in self._conns if c.partial_since is not None and c.partial_since <= cutoff]:
            self._drop(conn)

    def _close_all(self) -> None:
        for conn in list(self._conns):
            self._drop(conn)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(self._listener)
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        self._sel.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. EMFILE: leave it in the backlog; the next select retries
                return
            sock.setblocking(False)  # reads never wait; _send bounds its writes by io_timeout
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if len(self._unsealed) >= self.max_unsealed:
                self._make_room()
            conn = Connection(sock, self._rx_key, time.monotonic())
            self._unsealed[conn] = None
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self.stats.connections += 1
            self.stats.peak_connections = max(self.stats.peak_connections, len(self._conns))

    def _make_room(self) -> None:
        """Close the oldest unsealed connection, serving first what it may have sent: one whose
        frame waits unread in its buffer is a peer that connected in a burst (a fan-out of N
        ranks), not an idle one, and its frame seals it. The job's peers send their first frame
        as they connect (client.py), so only a connection that sent nothing at all is closed."""
        while len(self._unsealed) >= self.max_unsealed:
            oldest = next(iter(self._unsealed))
            self._serve(oldest)
            if oldest in self._unsealed:
                self.stats.unsealed_closed += 1
                self._drop(oldest)

    def _drop(self, conn: Connection) -> None:
        self._requests.cancel(conn)
        self._unsealed.pop(conn, None)
        if conn in self._conns:
            self._conns.discard(conn)
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(conn.sock)
        conn.sock.close()

    def _send(self, conn: Connection, header: dict[str, Any], payload: bytes = b"") -> bool:
        try:
            conn.sock.settimeout(self.io_timeout)
            send_frame(conn.sock, self._tx_key, header, payload)
            conn.sock.setblocking(False)
        except OSError:  # the reader left or stopped reading for io_timeout: forget it
            self._drop(conn)
            return False
        self.stats.bytes_out += _FRAME_OVERHEAD + len(json.dumps(header)) + len(payload)
        return True

    def _serve(self, conn: Connection) -> None:
        """Read what the socket holds (never past the frame in progress); serve a completed frame."""
        frame: tuple[dict[str, Any], bytearray] | None = None
        try:
            while frame is None:
                data = conn.sock.recv(min(_READ_CHUNK, conn.decoder.want()))
                if not data:  # closed, perhaps mid-frame
                    self._drop(conn)
                    return
                frames = conn.decoder.feed(data)
                if frames:
                    # want() never asks past the frame in progress, so there is exactly one
                    frame = frames[0]
        except (BlockingIOError, InterruptedError):
            if conn.decoder.partial and conn.partial_since is None:
                conn.partial_since = time.monotonic()
            return
        except FrameError:  # bad seal, or a prefix over the caps: close, answer nothing
            self.stats.rejected += 1
            self._drop(conn)
            return
        except OSError:  # reset
            self._drop(conn)
            return
        conn.partial_since = None
        header, payload = frame
        seq, op = header.get("seq"), header.get("op")
        if not conn.admits(header):
            self.stats.rejected += 1  # replayed or reordered: never trust this connection again
            self._drop(conn)
            return
        if conn.served(header["seq"]):  # its first sealed frame: off the short leash of the unsealed
            self._unsealed.pop(conn, None)
        self.stats.requests += 1
        self.stats.bytes_in += _FRAME_OVERHEAD + len(json.dumps(header)) + len(payload)
        if op == "hello":
            self._send(conn, {"seq": seq, "ok": True, "v": PROTOCOL_VERSION, "nonce": conn.issue_nonce()})
            return
        try:
            if op == "stream":
                self._hand_over(conn, header)
            else:
                self._requests.dispatch(conn, header, payload)
        except Exception as e:  # a bug must cost one request, never the loop (and every rank)
            self._send(conn, {"seq": seq, "ok": False, "error": "bad-request", "detail": repr(e)})

    def _hand_over(self, conn: Connection, h: dict[str, Any]) -> None:
        """A ``stream`` request: the connection leaves the loop for the channel it names (see
        :meth:`open_channel`)."""
        seq = h["seq"]
        with self._channels_lock:
            q = self._channels.get(str(h.get("channel")))
        if q is None:  # not open (yet): the peer retries until its deadline
            self._send(conn, {"seq": seq, "ok": False, "error": "no-channel"})
            return
        if conn.pending:  # a connection with parked reads cannot leave the loop
            self._send(conn, {"seq": seq, "ok": False, "error": "busy"})
            return
        if self._send(conn, {"seq": seq, "ok": True}):
            self._conns.discard(conn)
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(conn.sock)
            conn.sock.settimeout(self.io_timeout)  # leaves the loop: bounded, blocking calls
            q.put((conn.sock, h))
