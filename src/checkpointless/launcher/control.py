"""The control channel's server: the coordinator's end of every worker's and agent's connection.

The handshake and the framing both ends agree on are
:mod:`checkpointless.protocol.control_channel`; the client's end, which runs in every training
process, is :mod:`checkpointless.protocol.control_client`. This end runs only in the coordinator.

It is one selector thread for every connection: non-blocking sockets, frames assembled
incrementally, so an idle or slow peer costs a few hundred bytes, never a thread, and never
delays anyone else. A connection must authenticate (send one valid frame) within
:data:`AUTH_DEADLINE_S`, and at most :data:`MAX_UNAUTHENTICATED` may be waiting to do so. Every
authenticated message lands in :attr:`ControlServer.inbox`, read by the coordinator's single
decision loop.
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import select
import selectors
import socket
import threading
import time
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.protocol.control_channel import (
    C2S_LABEL,
    CLIENT_NONCE_FIELD,
    GREETING_TYPE,
    MAX_CONTROL_HEADER,
    MAX_CONTROL_PAYLOAD,
    NONCE_FIELD,
    OPEN_MAGIC,
    OPENING_SIZE,
    S2C_LABEL,
    SEND_TIMEOUT_S,
    SEQ_FIELD,
)
from checkpointless.wire import FrameDecoder, FrameError, derive_key, encode_frame

__all__ = ["AUTH_DEADLINE_S", "MAX_UNAUTHENTICATED", "Connection", "ControlServer"]

AUTH_DEADLINE_S = 2.0  # a worker sends its hello right after connecting
MAX_UNAUTHENTICATED = 256  # connections still owing their first valid frame
_READ_CHUNK = 64 << 10
_LISTENER, _WAKER = object(), object()


def _send_bounded(sock: socket.socket, key: bytes, msg: dict[str, Any], timeout: float) -> None:
    """Send a frame on a non-blocking socket shared with a reader, waiting at most ``timeout``."""
    deadline = time.monotonic() + timeout
    view = memoryview(encode_frame(key, msg))
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    while view:
        try:
            view = view[sock.send(view) :]
            continue
        except (BlockingIOError, InterruptedError):
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"peer took no control message for {timeout:.0f} s")
        poller.poll(left * 1000)


class Connection:
    """The launcher's end of one worker's connection."""

    def __init__(self, sock: socket.socket, secret: bytes) -> None:
        self.sock = sock
        self.worker_id: int | None = None
        self.closed = False
        self.authenticated = False
        self.opening = bytearray()  # the worker's opening, until it is whole
        self.nonce = secrets.token_hex(16)  # ours; the worker's frames must carry it
        self.peer_nonce = ""  # the worker's (from its opening); our frames carry it
        self.last_in = 0
        self.accepted_at = time.monotonic()
        self._tx_key = derive_key(secret, S2C_LABEL)
        self._seq_out = 0
        self._send_lock = threading.Lock()
        self.decoder = FrameDecoder(
            derive_key(secret, C2S_LABEL), max_header=MAX_CONTROL_HEADER, max_payload=MAX_CONTROL_PAYLOAD
        )

    def _send_sealed(self, msg: dict[str, Any]) -> None:
        with self._send_lock:
            self._seq_out += 1
            _send_bounded(self.sock, self._tx_key, {**msg, SEQ_FIELD: self._seq_out}, SEND_TIMEOUT_S)

    def send(self, msg: dict[str, Any]) -> bool:
        """Send; return False (and hang up) if the worker is gone or not reading."""
        if self.closed or not self.authenticated:
            return False
        try:
            self._send_sealed({**msg, NONCE_FIELD: self.peer_nonce})
            return True
        except (OSError, FrameError):
            self.hang_up()
            return False

    def hang_up(self) -> None:
        """End the connection from a thread other than the server's (the decision loop, the
        heartbeat thread): a shutdown only. The server's selector still has the socket and sees
        its end, then drops and closes it and reports ``_closed``. Closing it here would free the
        descriptor while it is still registered: the end would never be reported, and the next
        socket accepted under the same number would fail to register, ending the server's thread."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    @property
    def opened(self) -> bool:
        """True once the worker's opening is whole (and the greeting answered it)."""
        return len(self.opening) >= OPENING_SIZE

    def take_opening(self, data: bytes) -> bool:
        """Add bytes of the worker's opening; once it is whole, check its magic and answer with
        the greeting that carries its nonce. False: not an opening of this protocol version."""
        self.opening += data
        if not self.opened:
            return True
        if bytes(self.opening[: len(OPEN_MAGIC)]) != OPEN_MAGIC:
            return False
        self.peer_nonce = bytes(self.opening[len(OPEN_MAGIC) :]).hex()
        self._send_sealed({"type": GREETING_TYPE, "nonce": self.nonce, NONCE_FIELD: self.peer_nonce})
        return True

    def accept_frame(self, header: dict[str, Any]) -> dict[str, Any]:
        """Check a sealed frame's nonce and sequence; return the message without them."""
        seq = header.pop(SEQ_FIELD, None)
        if header.pop(NONCE_FIELD, None) != self.nonce or not isinstance(seq, int) or seq <= self.last_in:
            raise FrameError("control frame replayed, reordered or from another connection")
        header.pop(CLIENT_NONCE_FIELD, None)
        self.authenticated = True
        self.last_in = seq
        return header

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class ControlServer:
    """Accepts worker connections; every authenticated message lands in :attr:`inbox` as
    (connection, msg). An authenticated connection's end is delivered as ``{"type": "_closed"}``
    so the decision loop sees it; connections that never authenticated never reach it."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self.secret = secret
        self.inbox: queue.Queue[tuple[Connection, dict[str, Any]]] = queue.Queue()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise ConfigError(
                f"the launcher's control port {host}:{port} is not available ({e.strerror}); "
                "choose another with --control-port (0 picks a free one)"
            ) from e
        self._sock.listen(256)
        self._sock.setblocking(False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._conns: set[Connection] = set()  # read by tests and stop(); written by the loop
        self._thread: threading.Thread | None = None
        self.rejected = 0  # connections closed for a bad frame, an overrun cap or the deadline

    @property
    def unauthenticated(self) -> int:
        """Connections still owing their first valid frame (safe to read from any thread)."""
        while True:
            try:
                return sum(1 for c in list(self._conns) if not c.authenticated)
            except RuntimeError:  # the loop changed the set while we copied it: look again
                continue

    def start(self) -> None:
        self._sel.register(self._sock, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKER)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="cl-control")
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                for key, _ in self._sel.select(self._next_timeout()):
                    if key.data is _LISTENER:
                        self._accept()
                    elif key.data is _WAKER:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._read(key.data)
                self._expire()
        finally:
            for c in list(self._conns):
                self._drop(c, "launcher stopped", report=False)
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _next_timeout(self) -> float | None:
        pending = [c.accepted_at for c in self._conns if not c.authenticated]
        if not pending:
            return None
        return max(0.0, min(pending) + AUTH_DEADLINE_S - time.monotonic())

    def _expire(self) -> None:
        cutoff = time.monotonic() - AUTH_DEADLINE_S
        for c in [c for c in self._conns if not c.authenticated and c.accepted_at <= cutoff]:
            self.rejected += 1
            self._drop(c, "no authentication before the deadline", report=False)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. EMFILE: it stays in the backlog; the next select retries
                return
            if self.unauthenticated >= MAX_UNAUTHENTICATED:
                # A flood of idle connections: the oldest pays. Refusing the newest would let a
                # local process that keeps renewing its connections refuse every worker and
                # spare (each fails at its start); a real peer authenticates within
                # milliseconds, so it is never the oldest for long.
                oldest = min((c for c in self._conns if not c.authenticated), key=lambda c: c.accepted_at)
                self.rejected += 1
                self._drop(oldest, "too many unauthenticated connections", report=False)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock, self.secret)  # greeted once its opening is whole (_read)
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: Connection) -> None:
        want = conn.decoder.want() if conn.opened else OPENING_SIZE - len(conn.opening)
        try:
            data = conn.sock.recv(min(_READ_CHUNK, want))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(conn, str(e), report=True)
            return
        if not data:
            self._drop(conn, "peer closed the connection", report=True)
            return
        if not conn.opened:
            try:
                ok = conn.take_opening(data)
            except OSError as e:
                self._drop(conn, str(e), report=False)
                return
            if not ok:
                self.rejected += 1
                self._drop(conn, "not a control opening of this protocol version", report=False)
            return
        try:
            messages = [conn.accept_frame(h) for h, _ in conn.decoder.feed(data)]
        except FrameError as e:
            # an unauthenticated peer never reaches the decision loop, not even as "_closed"
            self.rejected += 1
            self._drop(conn, str(e), report=True)
            return
        for msg in messages:
            self.inbox.put((conn, msg))

    def _drop(self, conn: Connection, why: str, report: bool) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        conn.close()
        if report and conn.authenticated:
            self.inbox.put((conn, {"type": "_closed", "error": why}))

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            with contextlib.suppress(OSError):
                self._sock.close()
