"""What a key server does with an authenticated request: the ops on its keys, and parked reads.

:class:`~checkpointless.rendezvous.server.KeyServer` owns the sockets: it accepts, reads and
seals frames, and checks each request's sequence number and nonce. What a request then does to
the participant's :class:`~checkpointless.rendezvous.keyspace.KeySpace` is this module's
:class:`RequestHandler`, which sees a connection only as something to reply to (through the
server's ``send``) and to park requests on. The split keeps the connection security of the one
apart from the store semantics of the other.

Requests that wait for a key (``get``, ``wait``) park as a :class:`Pending` with a
:class:`~checkpointless.rendezvous.keyspace.Watch`, and are answered when the key is written, or
with a timeout reply at their deadline; the server's loop never blocks on a slow key. The watch
fires on whichever thread wrote the key, so the answer is handed to the loop thread, which owns
the sockets, and the loop is woken.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from checkpointless.rendezvous.keyproto import clamp_wait, join_values, split_values
from checkpointless.rendezvous.keyspace import KeySpace, Watch

__all__ = ["Pending", "RequestHandler", "Requester"]


class Requester(Protocol):
    """A connection, as far as requests go: the set of its requests still parked."""

    pending: set[Pending[Any]]


# the server's own connection type: it gets back, in ``send``, the connection it handed in
C = TypeVar("C", bound=Requester)


class Pending(Generic[C]):
    """A request parked until its keys exist or its deadline passes."""

    __slots__ = ("conn", "deadline", "done", "header", "watch")

    def __init__(self, conn: C, header: dict[str, Any], deadline: float) -> None:
        self.conn = conn
        self.header = header
        self.deadline = deadline
        self.done = False
        self.watch: Watch | None = None


def _keys_of(header: dict[str, Any]) -> list[str] | None:
    keys = header.get("keys")
    if isinstance(keys, list) and keys and all(isinstance(k, str) for k in keys):
        return keys
    return None


class RequestHandler(Generic[C]):
    """Runs the key ops of one server on its loop thread (only the watches' callbacks come from
    writers' threads). ``send(conn, header, payload)`` replies on a connection (False: it is gone);
    ``wake`` makes the loop come round to :meth:`answer_ready`."""

    def __init__(
        self, keyspace: KeySpace, send: Callable[[C, dict[str, Any], bytes], bool], wake: Callable[[], None]
    ) -> None:
        self.keyspace = keyspace
        self._send = send
        self._wake = wake
        self._ready: deque[Pending[C]] = deque()  # appended by writer threads, drained by the loop
        self._ready_lock = threading.Lock()
        self._timers: list[tuple[float, int, Pending[C]]] = []
        self._tick = itertools.count()

    def next_deadline(self) -> float | None:
        """The monotonic time the earliest parked request times out; None: nothing is parked."""
        return self._timers[0][0] if self._timers else None

    def cancel(self, conn: C) -> None:
        """Forget the requests parked on a connection that is being closed."""
        for p in conn.pending:
            p.done = True
            if p.watch is not None:
                self.keyspace.unwatch(p.watch)
        conn.pending.clear()

    def dispatch(self, conn: C, h: dict[str, Any], payload: bytearray) -> None:
        """Serve one request (any op but ``hello`` and ``stream``, which belong to the connection);
        a malformed one raises, and the server answers it with ``bad-request``."""
        op, seq = h.get("op"), h["seq"]
        ks = self.keyspace
        if op == "count":
            prefix = h.get("prefix")
            if not isinstance(prefix, str):
                raise ValueError("count needs a prefix")
            self._send(conn, {"seq": seq, "ok": True, "count": ks.count(prefix)}, b"")
            return
        if op == "ping":
            self._send(conn, {"seq": seq, "ok": True}, b"")
            return
        keys = _keys_of(h)
        if keys is None:
            raise ValueError(f"{op!r} needs a non-empty list of string keys")
        if op in ("get", "wait"):
            timeout = h.get("timeout")
            if not isinstance(timeout, (int, float)):
                raise ValueError(f"{op} needs a timeout")
            # the client's own timeout, cut to what a deadline can hold (a huge or infinite one
            # would reach the loop's select and end the server thread)
            self._park(Pending(conn, h, time.monotonic() + clamp_wait(float(timeout))))
        elif op == "set":
            values = split_values(h.get("lens"), payload, len(keys))
            if values is None:
                raise ValueError("set: lengths do not match the payload")
            ks.multi_set(zip(keys, values, strict=True))
            self._send(conn, {"seq": seq, "ok": True}, b"")
        elif op == "check":
            self._send(conn, {"seq": seq, "ok": True, "present": not ks.missing(keys)}, b"")
        elif op == "add":
            amount = h.get("amount")
            if not isinstance(amount, int) or len(keys) != 1:
                raise ValueError("add needs one key and an integer amount")
            self._send(conn, {"seq": seq, "ok": True, "value": ks.add(keys[0], amount)}, b"")
        elif op == "cas":
            parts = split_values(h.get("lens"), payload, 2)
            if parts is None or len(keys) != 1:
                raise ValueError("cas needs one key, the expected and the desired value")
            self._send(conn, {"seq": seq, "ok": True}, ks.compare_set(keys[0], parts[0], parts[1]))
        elif op == "append":
            if len(keys) != 1:
                raise ValueError("append needs one key")
            ks.append(keys[0], bytes(payload))
            self._send(conn, {"seq": seq, "ok": True}, b"")
        elif op == "del":
            if len(keys) != 1:
                raise ValueError("del needs one key")
            self._send(conn, {"seq": seq, "ok": True, "deleted": ks.delete(keys[0])}, b"")
        else:
            raise ValueError(f"unknown op {op!r}")

    def _park(self, p: Pending[C]) -> None:
        """Answer now if the keys exist; otherwise wait for them (or the deadline)."""
        if self._answer(p):
            return
        p.conn.pending.add(p)
        p.watch = self.keyspace.watch(p.header["keys"], lambda _w: self._on_ready(p))
        if p.watch is None:  # written between the two looks
            p.conn.pending.discard(p)
            self._answer(p)
            return
        heapq.heappush(self._timers, (p.deadline, next(self._tick), p))

    def _on_ready(self, p: Pending[C]) -> None:
        # Runs on whichever thread wrote the last key: hand the answer to the loop thread,
        # which owns the sockets.
        with self._ready_lock:
            self._ready.append(p)
        self._wake()

    def answer_ready(self) -> None:
        """Answer the parked requests whose keys were written since the last call."""
        while True:
            with self._ready_lock:
                if not self._ready:
                    return
                p = self._ready.popleft()
            if p.done:
                continue
            p.conn.pending.discard(p)
            p.watch = None
            if not self._answer(p):  # a key was deleted again in between: keep waiting
                self._park(p)

    def _answer(self, p: Pending[C]) -> bool:
        """Send the reply when every key exists; False (nothing sent) otherwise."""
        h = p.header
        if h["op"] == "wait":
            if self.keyspace.missing(h["keys"]):
                return False
            p.done = True
            self._send(p.conn, {"seq": h["seq"], "ok": True}, b"")
            return True
        values = self.keyspace.values(h["keys"])
        if values is None:
            return False
        p.done = True
        lens, payload = join_values(values)
        self._send(p.conn, {"seq": h["seq"], "ok": True, "lens": lens}, payload)
        return True

    def expire(self) -> None:
        """Answer the parked requests whose deadline passed with a timeout naming the missing keys."""
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, p = heapq.heappop(self._timers)
            if p.done:
                continue
            p.done = True
            p.conn.pending.discard(p)
            if p.watch is not None:
                self.keyspace.unwatch(p.watch)
            missing = self.keyspace.missing(p.header["keys"])
            reply = {"seq": p.header["seq"], "ok": False, "error": "timeout", "missing": missing}
            self._send(p.conn, reply, b"")
