"""The client's end of the control channel: a worker's (or a host agent's) link to the coordinator.

It connects, sends its opening, checks the coordinator's greeting (it must be sealed with the
job's secret and answer this connection's nonce: :mod:`checkpointless.protocol.control_channel`
says why), and then runs a reader thread that hands every message to a callback, so an
``abort`` reaches a worker whose main thread is stuck inside a collective. The server's end runs
only in the coordinator (``launcher/control.py``); this one runs in every training process, so
it lives in the shared layer below both.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from checkpointless.protocol.control_channel import (
    C2S_LABEL,
    GREETING_TYPE,
    MAX_CONTROL_HEADER,
    MAX_CONTROL_PAYLOAD,
    NONCE_FIELD,
    S2C_LABEL,
    SEND_TIMEOUT_S,
    SEQ_FIELD,
    ReplayedGreeting,
    WrongSecret,
    opening,
)
from checkpointless.wire import FrameAuthError, FrameError, derive_key, recv_frame, send_frame

__all__ = ["ControlClient"]

# Every live ControlClient of this process. A forked child (a DataLoader worker) closes its copies
# of their sockets: it must never write to them, and while it held one the coordinator would not
# see the connection end when the worker itself dies, which is how it knows it has read the
# worker's last frames (coordinator.py, EXIT_GRACE_S). close(), not shutdown(): the parent's end
# stays up.
_CLIENTS: weakref.WeakSet[ControlClient] = weakref.WeakSet()


def _close_in_child() -> None:
    for client in list(_CLIENTS):
        with contextlib.suppress(OSError):
            client.sock.close()


os.register_at_fork(after_in_child=_close_in_child)


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
        self._tx_key = derive_key(secret, C2S_LABEL)
        self._rx_key = derive_key(secret, S2C_LABEL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"cannot reach the launcher at {address[0]}:{address[1]}: {e}"
                    ) from e
                time.sleep(0.05)
        where = f"{address[0]}:{address[1]}"
        opening_bytes, self._nonce = opening()
        self._seq_out = 0
        self._last_in = 0
        try:
            self.sock.sendall(opening_bytes)
            raw, _ = recv_frame(
                self.sock, self._rx_key, deadline, MAX_CONTROL_PAYLOAD, max_header=MAX_CONTROL_HEADER
            )
        except FrameAuthError as e:
            self.sock.close()
            raise WrongSecret(f"the greeting from {where} failed authentication: {e}") from e
        except (OSError, FrameError) as e:
            self.sock.close()
            raise ConnectionError(f"the launcher at {where} sent no valid greeting: {e}") from e
        try:
            greeting = self._accept(raw)  # it must answer our nonce: a recorded one does not
        except FrameError:
            self.sock.close()
            raise ReplayedGreeting(
                f"the greeting from {where} answers another connection's nonce (a replayed "
                "greeting, or an older checkpointless): refused"
            ) from None
        self._server_nonce = greeting.get("nonce")
        if greeting.get("type") != GREETING_TYPE or not isinstance(self._server_nonce, str):
            self.sock.close()
            raise ConnectionError(f"the launcher at {where} sent an unexpected greeting")
        # Blocking reads on the reader thread; sends bounded by a kernel option, because a
        # settimeout would also make the reader's long wait time out mid-frame.
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S), 0))
        self._on_message = on_message
        self._on_lost = on_lost
        self._send_lock = threading.Lock()
        self._closing = False
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="cl-control-client")
        self._reader.start()
        _CLIENTS.add(self)

    def send(self, msg: dict[str, Any]) -> None:
        with self._send_lock:
            self._seq_out += 1
            framed = {**msg, NONCE_FIELD: self._server_nonce, SEQ_FIELD: self._seq_out}
            send_frame(self.sock, self._tx_key, framed)

    def _accept(self, header: dict[str, Any]) -> dict[str, Any]:
        seq = header.pop(SEQ_FIELD, None)
        if header.pop(NONCE_FIELD, None) != self._nonce or not isinstance(seq, int) or seq <= self._last_in:
            raise FrameError("control frame from the launcher replayed or from another connection")
        self._last_in = seq
        return header

    def _read_loop(self) -> None:
        while True:
            try:
                header, _ = recv_frame(
                    self.sock, self._rx_key, None, MAX_CONTROL_PAYLOAD, max_header=MAX_CONTROL_HEADER
                )
                msg = self._accept(header)
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
