"""Coordinator failover at a worker's end of the link: a lost coordinator, and finding its successor.

Once the coordinator has sent a ``succession`` (docs/architecture.md), a lost connection is not
the end. The link tries the candidates term by term, says who it is in its hello (rank,
generation, step) and carries on with whichever coordinator accepts it; only when no coordinator
has taken it by a deadline (two leases: the election, then the agents' fencing) does the worker
exit, as it always did without a succession. Kept apart from the connection in use (``link.py``):
:class:`Failover` owns what the link knows of the succession and the search for the next
coordinator (run on a thread of its own), and :func:`bound_silence` makes sure a partition that
drops every packet is noticed as a loss at all. The link hands it what it needs explicitly: the
secret, the reader's entry for frames, its own loss handler and a way to switch to a candidate.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from checkpointless.events import get_logger
from checkpointless.protocol import SUCCESSION_ENV, ProtocolError, Succession, succession_from_env
from checkpointless.protocol.control_client import ControlClient

__all__ = ["Failover", "bound_silence"]

log = get_logger()


class Failover:
    """The succession this worker knows, and the search for a successor once the coordinator is lost.

    ``on_message`` and ``on_lost`` are the link's handlers for a candidate's connection;
    ``switch`` says hello to a connected candidate (naming the lowest term this worker accepts)
    and makes it the link's connection, or returns False when the hello could not be sent."""

    def __init__(
        self,
        secret: bytes,
        stop: threading.Event,
        on_message: Callable[[dict[str, Any]], None],
        on_lost: Callable[[str], None],
        switch: Callable[[ControlClient, int], bool],
    ) -> None:
        self._secret = secret
        self._stop = stop
        self._on_message = on_message
        self._on_lost = on_lost
        self._switch = switch
        self.succession: Succession | None = None
        self.term = 0  # the newest coordinator term this link has seen; it never goes back
        self.lost_since: float | None = None  # lost the coordinator and no successor spoke yet
        self._reconnector: threading.Thread | None = None
        self._retry = threading.Event()  # the candidate we reached hung up: try the next term
        self._from_env()

    def _from_env(self) -> None:
        """The succession the agent knew when it started this process (agent/agent.py): a
        process that starts as the coordinator is lost has heard none itself."""
        try:
            known = succession_from_env(os.environ.get(SUCCESSION_ENV))
        except ProtocolError as e:
            log.warning("no successors known at start (%s)", e)
            return
        if known is not None:
            self.succession = known
            self.term = known.term

    def lease(self) -> float:
        return self.succession.lease if self.succession is not None else 5.0

    def on_succession(self, msg: Succession, client: object) -> None:
        """A coordinator named its successors: keep the newest, and bound the silence of the
        connection in use by its lease."""
        if msg.term >= self.term:
            self.succession = msg
            self.term = msg.term
            bound_silence(client, msg.lease)

    def heard(self) -> None:
        """A coordinator is talking to us (even one that garbles a frame)."""
        self.lost_since = None

    def search(self, why: str) -> None:
        """Start looking for the successor (or make the search try the next candidate). The
        caller holds the link's lock, so that a report sent meanwhile is ordered with it."""
        if self.lost_since is None:
            self.lost_since = time.monotonic()
        if self._reconnector is not None and self._reconnector.is_alive():
            self._retry.set()
            return
        log.warning("lost the coordinator (%s); looking for its successor", why)
        self._reconnector = threading.Thread(target=self._reconnect, daemon=True, name="cl-reconnect")
        self._reconnector.start()

    def _reconnect(self) -> None:
        """Try the successors in order (from the next term's candidate) until one takes this
        worker, or exit at the deadline. The hello names the lowest term this worker accepts: a
        stale coordinator (a lower term) refuses it, and so does an agent that is not a
        candidate; a candidate that loses its election hangs up."""
        succ = self.succession
        assert succ is not None and self.lost_since is not None
        lease = succ.lease
        deadline = self.lost_since + 2 * lease + 2.0
        addresses = list(succ.addresses)
        floor = self.term + 1
        turn = floor - 1
        while addresses and time.monotonic() < deadline:
            host, _, port = addresses[turn % len(addresses)].rpartition(":")
            turn += 1
            left = deadline - time.monotonic()
            # before the connection exists: a hang-up right after our hello must not be forgotten
            self._retry.clear()
            try:
                client = ControlClient(
                    (host, int(port)), self._secret, self._on_message, self._on_lost, timeout=min(1.0, left)
                )
            except (ConnectionError, ValueError):
                time.sleep(0.05)
                continue
            if not self._switch(client, floor):
                continue
            log.info("reconnected to a successor (term %d or later) at %s:%s", floor, host, port)
            # the candidate may still lose its election: then it hangs up and on_lost calls
            # again; until a message arrives, lost_since keeps the deadline running
            while self.lost_since is not None and time.monotonic() < deadline:
                if self._stop.wait(0.05):
                    return
                if self._retry.is_set():
                    break
            if self.lost_since is None:
                return
        if self._stop.is_set():
            return
        log.error("no coordinator took over within %.1f s of losing the last one; exiting", 2 * lease + 2.0)
        os._exit(70)


def bound_silence(client: object, lease: float) -> None:
    """A coordinator cut off by a partition never closes our connection: its FIN is dropped
    too. Data we send then goes unacknowledged, and TCP_USER_TIMEOUT turns that into a
    connection error after a lease, so the reader notices and the reconnect starts. Our
    heartbeats usually go to the agent's records, not this socket, so the kernel's keepalive
    probes (every second once idle; answered by the peer's kernel, no work for the
    coordinator) provide the unacknowledged data."""
    if not isinstance(client, ControlClient):
        return  # not connected: the next connection gets it (see LauncherLink._dispatch)
    with contextlib.suppress(OSError, AttributeError):
        sock = client.sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(lease * 1000))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, int(lease)))
