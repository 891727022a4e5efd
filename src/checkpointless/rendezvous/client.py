"""Talking to the owners of keys: authenticated connections, fan-out, and fail-fast errors.

A reader asks the owner of a key directly. A batched read touches many owners, so requests are
fanned out: connect to every owner first, then send every request, and collect the replies as
they come, in whatever order. (A connection that will change keys first gets a nonce from its
owner, all of them at once; reads need none, see the server's notes on replay.) One dead owner therefore costs nothing more
than the round trip that reveals it, and the reader raises at once with that owner's rank.

How an owner's death shows up, and what it becomes here (always :class:`RendezvousError` naming
the rank, its address and the generation):

* connection refused: nothing listens at the address. The participant is dead, or has not started
  yet; a refusal is retried for ``connect_grace`` seconds (start-up skew), then reported;
* connection reset, or closed while a request was outstanding: the participant died (a killed
  process's sockets are closed by its kernel at once, so this takes microseconds, not a timeout);
* no answer by the deadline: the key was never written (the server says which keys are missing),
  or the participant hangs.

One exception: an owner closes a fresh connection, before answering anything on it, when a flood
of idle connections fills its quota of unauthenticated ones (server.py). So a request whose fresh
connection is closed unanswered is sent again, once, on a new connection, if sending it twice
cannot change anything (a read, or a write that never left); a refusal on that new connection is
reported at once, since the owner was listening a moment before.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from checkpointless.errors import RendezvousError
from checkpointless.rendezvous.keyproto import KEYSERVER_C2S, KEYSERVER_S2C, MUTATING_OPS, PROTOCOL_VERSION
from checkpointless.rendezvous.peers import PeerTable
from checkpointless.wire import FrameError, derive_key, recv_frame, send_frame

__all__ = ["PeerClient", "Reply", "Request"]

Request = tuple[dict[str, Any], bytes]
Reply = tuple[dict[str, Any], bytearray]

_REPLY_MARGIN_S = 1.0  # wait this much past a wait's deadline for the owner's own timeout reply
_RETRY_FIRST_S = 0.02
_RETRY_MAX_S = 0.25


class _Link:
    """One connection to one owner's key server (every frame on it sealed with the secret)."""

    __slots__ = ("answered", "nonce", "rank", "seq", "sock")

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.nonce = ""
        self.seq = 0
        self.answered = False  # the owner has answered on it: a close now means its death

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class _ClosedFresh(RendezvousError):
    """A fresh connection was closed before any answer (see the module's note)."""


def _rewound(header: dict[str, Any], deadline: float) -> dict[str, Any]:
    if "timeout" not in header:
        return header
    return {**header, "timeout": max(0.0, deadline - time.monotonic())}


class PeerClient:
    """Connections from one participant to the owners of one generation's keys.

    Thread-safe: an operation checks its connections out of an idle pool and returns them when it
    completes, so two threads never share a connection (a second thread opens its own). Only
    connections that finished their exchange cleanly return to the pool; the pool keeps at most
    ``max_idle`` of them, because in a job of N ranks every reader contacts N owners once and
    keeping all of them would hold N descriptors per process for nothing.
    """

    def __init__(
        self,
        peers: PeerTable,
        secret: bytes,
        generation: str,
        connect_grace: float,
        max_idle: int = 128,
    ) -> None:
        self.peers = peers
        self.secret = secret
        self._tx_key = derive_key(secret, KEYSERVER_C2S)
        self._rx_key = derive_key(secret, KEYSERVER_S2C)
        self.generation = generation
        self.connect_grace = connect_grace
        self.max_idle = max_idle
        self._idle: dict[int, list[_Link]] = {}
        self._idle_order: list[_Link] = []
        self._lock = threading.Lock()
        self.requests_sent = 0  # read by the benchmarks

    # -- errors -------------------------------------------------------------------------------
    def _who(self, rank: int) -> str:
        return f"rank {rank} ({self.peers[rank]})"

    def _error(self, rank: int, what: str) -> RendezvousError:
        return RendezvousError(f"{self._who(rank)} {what} [generation {self.generation!r}]")

    # -- pool ---------------------------------------------------------------------------------
    def _checkout(self, rank: int) -> _Link | None:
        with self._lock:
            links = self._idle.get(rank)
            if not links:
                return None
            link = links.pop()
            self._idle_order.remove(link)
            return link

    def _checkin(self, link: _Link) -> None:
        with self._lock:
            self._idle.setdefault(link.rank, []).append(link)
            self._idle_order.append(link)
            while len(self._idle_order) > self.max_idle:
                old = self._idle_order.pop(0)
                self._idle[old.rank].remove(old)
                old.close()

    def close(self) -> None:
        with self._lock:
            for link in self._idle_order:
                link.close()
            self._idle.clear()
            self._idle_order.clear()

    # -- connecting ---------------------------------------------------------------------------
    def _connect(self, rank: int, deadline: float, grace: float | None = None) -> _Link:
        host, port = self.peers.endpoint(rank)
        grace = self.connect_grace if grace is None else grace
        refused_since: float | None = None
        pause = _RETRY_FIRST_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._error(rank, "could not be reached before the deadline")
            try:
                sock = socket.create_connection((host, port), timeout=left)
            except ConnectionRefusedError:
                now = time.monotonic()
                refused_since = now if refused_since is None else refused_since
                if grace <= 0:  # a retry: it listened a moment ago
                    raise self._error(
                        rank, "closed a fresh connection, then refused a new one: it has died"
                    ) from None
                if now - refused_since >= grace:
                    raise self._error(
                        rank,
                        f"refused connections for {now - refused_since:.1f} s: that participant "
                        "is dead or never started",
                    ) from None
                time.sleep(max(0.0, min(pause, deadline - now, refused_since + grace - now)))
                pause = min(pause * 2, _RETRY_MAX_S)
                continue
            except TimeoutError:
                raise self._error(rank, "did not accept a connection before the deadline") from None
            except OSError as e:
                raise self._error(rank, f"is unreachable: {e}") from e
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return _Link(rank, sock)

    def _finish_handshake(self, links: list[_Link], deadline: float) -> None:
        """Read the nonce (needed before a link may change a key) of each link whose hello went
        out as it connected: all round trips at once."""
        for link in links:
            header, _ = self._check_reply(link, "hello", self._receive(link, deadline, "the handshake"))
            nonce = header.get("nonce")
            if header.get("v") != PROTOCOL_VERSION or not isinstance(nonce, str):
                raise self._error(link.rank, f"speaks another rendezvous protocol: {header}")
            link.nonce = nonce

    def _receive(self, link: _Link, deadline: float, during: str) -> Reply:
        try:
            reply = recv_frame(link.sock, self._rx_key, deadline)
            link.answered = True
            return reply
        except FrameError as e:
            if "authentication" in str(e):
                raise self._error(
                    link.rank, f"failed authentication during {during}: wrong job secret?"
                ) from e
            # An owner closes, unanswered, a request that fails its authentication (a sealed
            # error would hand a forger a valid frame), so a fresh connection closed at once
            # may also mean that we hold the wrong secret.
            why = (
                "it has died"
                if link.seq > 1
                else "it has died, or refused our authentication (wrong job secret?)"
            )
            raise self._closed(link, f"closed the connection during {during}: {why}") from e
        except TimeoutError:
            raise self._error(link.rank, f"did not answer {during} before the deadline") from None
        except OSError as e:  # ECONNRESET and friends: the owner's kernel tore the socket down
            raise self._closed(link, f"dropped the connection during {during} ({e}): it has died") from e

    def _closed(self, link: _Link, what: str) -> RendezvousError:
        error = _ClosedFresh if not link.answered else RendezvousError
        return error(f"{self._who(link.rank)} {what} [generation {self.generation!r}]")

    # -- requests -----------------------------------------------------------------------------
    def _send(self, link: _Link, request: Request, deadline: float) -> None:
        header, payload = request
        link.seq += 1
        framed = {**header, "seq": link.seq}
        if link.nonce:
            framed["nonce"] = link.nonce
        try:
            link.sock.settimeout(max(0.001, deadline - time.monotonic()))
            send_frame(link.sock, self._tx_key, framed, payload)
        except TimeoutError:
            raise self._error(link.rank, f"did not take the {header['op']!r} request in time") from None
        except OSError as e:
            raise self._closed(link, f"dropped the connection ({e}): it has died") from e
        self.requests_sent += 1

    def _check_reply(self, link: _Link, op: str, reply: Reply) -> Reply:
        header = reply[0]
        if header.get("seq") != link.seq:
            raise self._error(link.rank, f"answered out of order (seq {header.get('seq')} for {link.seq})")
        if header.get("ok") is True:
            return reply
        if header.get("error") == "timeout":
            raise self._error(
                link.rank,
                f"holds no value for {header.get('missing')} at the deadline of {op!r}: "
                "the key was never written",
            )
        raise self._error(link.rank, f"rejected {op!r}: {header.get('detail', header.get('error'))}")

    def fanout(
        self,
        requests: dict[int, Request],
        deadline: float,
        local: Callable[[], None] | None = None,
    ) -> dict[int, Reply]:
        """Send one request to each owner in ``requests`` and return every owner's reply.

        ``local`` (the caller's share, served from its own key space) runs after the requests
        are on their way, so it overlaps with the owners' work. The first failing owner raises
        :class:`RendezvousError` at once; connections with replies still outstanding are closed.
        """
        replies: dict[int, Reply] = {}
        sent: set[int] = set()
        ran: list[bool] = []

        def share() -> None:
            ran.append(True)
            if local is not None:
                local()

        try:
            self._fanout(requests, deadline, share, replies, sent, grace=None)
        except _ClosedFresh:
            left = {r: q for r, q in requests.items() if r not in replies}
            if any(r in sent and q[0]["op"] in MUTATING_OPS for r, q in left.items()):
                raise  # a write may have been applied: sending it again could apply it twice
            # a wait's own timeout is what is left of the deadline now, so that the owner's
            # "never written" reply still arrives before ours
            left = {r: (_rewound(h, deadline), p) for r, (h, p) in left.items()}
            self._fanout(left, deadline, None if ran else share, replies, set(), grace=0.0)
        return replies

    def _fanout(
        self,
        requests: dict[int, Request],
        deadline: float,
        local: Callable[[], None] | None,
        replies: dict[int, Reply],
        sent: set[int],
        grace: float | None,
    ) -> None:
        reply_deadline = deadline + _REPLY_MARGIN_S
        links: dict[int, _Link] = {}
        hellos: list[_Link] = []
        try:
            # each request (or the hello a write needs first) goes out as its link connects: an
            # owner holds a connection that has sent nothing on a short leash (server.py)
            for rank, request in requests.items():
                link = links[rank] = self._checkout(rank) or self._connect(rank, deadline, grace)
                if request[0]["op"] in MUTATING_OPS and not link.nonce:
                    self._send(link, ({"op": "hello"}, b""), reply_deadline)
                    hellos.append(link)
                else:
                    self._send(link, request, reply_deadline)
                    sent.add(rank)
            self._finish_handshake(hellos, reply_deadline)
            for link in hellos:
                self._send(link, requests[link.rank], reply_deadline)
                sent.add(link.rank)
            if local is not None:
                local()
            self._collect(links, requests, replies, reply_deadline)
        except BaseException:
            for rank, link in links.items():
                if rank not in replies:
                    link.close()
                else:
                    self._checkin(link)
            raise
        for link in links.values():
            self._checkin(link)

    def _collect(
        self,
        links: dict[int, _Link],
        requests: dict[int, Request],
        replies: dict[int, Reply],
        deadline: float,
    ) -> None:
        if len(links) == 1:  # the common single-owner call needs no selector
            ((rank, link),) = links.items()
            op = requests[rank][0]["op"]
            replies[rank] = self._check_reply(link, op, self._receive(link, deadline, repr(op)))
            return
        with selectors.DefaultSelector() as sel:
            for rank, link in links.items():
                sel.register(link.sock, selectors.EVENT_READ, rank)
            while len(replies) < len(links):
                left = deadline - time.monotonic()
                if left <= 0:
                    late = [r for r in links if r not in replies]
                    raise self._error(
                        late[0], f"did not answer before the deadline (nor did ranks {late[1:]})"
                    )
                for key, _ in sel.select(left):
                    rank = key.data
                    link = links[rank]
                    op = requests[rank][0]["op"]
                    replies[rank] = self._check_reply(link, op, self._receive(link, deadline, repr(op)))
                    sel.unregister(link.sock)

    def call(self, rank: int, request: Request, deadline: float) -> Reply:
        """One request to one owner."""
        return self.fanout({rank: request}, deadline)[rank]
