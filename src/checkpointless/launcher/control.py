"""The control channel between the launcher and its workers.

One TCP connection per worker process, on loopback (or the job's own interface), every frame
sealed with the per-job secret (:mod:`checkpointless.wire`). Messages are small JSON objects with
a ``type``. The launcher's side funnels every received message into one queue read by its single
decision loop; the worker's side runs a reader thread that hands messages to a callback, so an
``abort`` reaches a worker whose main thread is stuck inside a collective.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.wire import FrameError, recv_frame, send_frame

__all__ = ["Connection", "ControlClient", "ControlServer"]

_SEND_TIMEOUT_S = 5


def _prepare(sock: socket.socket) -> None:
    """Blocking reads, bounded writes. A reader thread and writers share the socket, so the
    send bound is a kernel option (SO_SNDTIMEO) rather than ``settimeout``, which would also
    make the reader's wait time out in the middle of a frame."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", _SEND_TIMEOUT_S, 0))


class Connection:
    """The launcher's end of one worker's connection."""

    def __init__(self, sock: socket.socket, secret: bytes) -> None:
        self.sock = sock
        self.secret = secret
        self.worker_id: int | None = None
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, msg: dict[str, Any]) -> bool:
        """Send; return False (and close) if the worker is gone or not reading."""
        if self.closed:
            return False
        try:
            with self._send_lock:
                send_frame(self.sock, self.secret, msg)
            return True
        except (OSError, FrameError):
            self.close()
            return False

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class ControlServer:
    """Accepts worker connections; every message lands in :attr:`inbox` as (connection, msg).

    A connection's end is delivered as ``{"type": "_closed"}`` so the decision loop sees it.
    """

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
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: list[Connection] = []

    def start(self) -> None:
        t = threading.Thread(target=self._accept_loop, daemon=True, name="cl-control-accept")
        t.start()
        self._threads.append(t)

    def _accept_loop(self) -> None:
        self._sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            _prepare(sock)
            conn = Connection(sock, self.secret)
            self._conns.append(conn)
            t = threading.Thread(target=self._read_loop, args=(conn,), daemon=True, name="cl-control-read")
            t.start()

    def _read_loop(self, conn: Connection) -> None:
        while not self._stop.is_set():
            try:
                msg, _ = recv_frame(conn.sock, self.secret)
            except (OSError, FrameError) as e:
                # an unauthenticated peer never reaches the decision loop as a worker
                self.inbox.put((conn, {"type": "_closed", "error": str(e)}))
                conn.close()
                return
            self.inbox.put((conn, msg))

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        for c in self._conns:
            c.close()


class ControlClient:
    """A worker's end. ``on_message`` runs on the reader thread; ``on_lost`` when the launcher
    goes away (then the worker must exit: nobody is left to coordinate it)."""

    def __init__(
        self,
        address: tuple[str, int],
        secret: bytes,
        on_message: Callable[[dict[str, Any]], None],
        on_lost: Callable[[str], None],
        timeout: float = 10.0,
    ) -> None:
        self.secret = secret
        deadline = time.monotonic() + timeout
        last: OSError | None = None
        while True:
            try:
                self.sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as e:
                last = e
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"cannot reach the launcher at {address[0]}:{address[1]}: {last}"
                    ) from e
                time.sleep(0.05)
        _prepare(self.sock)
        self._on_message = on_message
        self._on_lost = on_lost
        self._send_lock = threading.Lock()
        self._closing = False
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="cl-control-client")
        self._reader.start()

    def send(self, msg: dict[str, Any]) -> None:
        with self._send_lock:
            send_frame(self.sock, self.secret, msg)

    def _read_loop(self) -> None:
        while True:
            try:
                msg, _ = recv_frame(self.sock, self.secret)
            except (OSError, FrameError) as e:
                if not self._closing:
                    self._on_lost(str(e))
                return
            self._on_message(msg)

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
