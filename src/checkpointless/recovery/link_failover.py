"""Coordinator failover at a worker's end of the link: a lost coordinator, and finding its successor.

Once the coordinator has sent a ``succession`` (docs/architecture.md), a lost connection is not
the end. The link tries the candidates term by term, says who it is in its hello (rank,
generation, step) and carries on with whichever coordinator accepts it; only when no coordinator
has taken it by a deadline (two leases: the election, then the agents' fencing) does the worker
exit, as it always did without a succession. Kept apart from the connection in use (``link.py``):
this is what the link does when that connection is lost (the search runs on a thread of its own),
and how it makes sure a partition that drops every packet is noticed as a loss at all. Functions
of the :class:`~checkpointless.recovery.link.LauncherLink` they act on.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import time
from typing import TYPE_CHECKING

from checkpointless.events import get_logger
from checkpointless.launcher.control import ControlClient
from checkpointless.protocol import Hello, encode

if TYPE_CHECKING:
    from checkpointless.recovery.link import LauncherLink

__all__ = ["await_release", "bound_silence", "on_lost"]

log = get_logger()


def on_lost(link: LauncherLink, why: str) -> None:
    if link._stop.is_set():
        return
    if link._succession is None:
        # Nobody is left to coordinate a recovery; staying alive would only leave orphans.
        log.error("lost the launcher (%s); exiting", why)
        os._exit(70)
    with link._lock:
        link._between = True
        if link._lost_since is None:
            link._lost_since = time.monotonic()
        if link._reconnector is not None and link._reconnector.is_alive():
            link._retry.set()
            return
        log.warning("lost the coordinator (%s); looking for its successor", why)
        link._reconnector = threading.Thread(
            target=_reconnect, args=(link,), daemon=True, name="cl-reconnect"
        )
        link._reconnector.start()


def await_release(link: LauncherLink) -> None:
    """At a finished worker's exit, on many hosts: stay until the coordinator has recorded this
    worker's Done (``DoneSeen``). A Done can be lost with its coordinator: sent into nowhere
    while the link looked for a successor, or into a connection whose far end had died unseen
    (a lost host, a partition: noticed only a lease later). The hello to the successor then
    says it (``Hello.done``). A process that left at once would look to the successor like a
    rank that vanished, and with every rank gone that way it would fail a finished job. Bounded:
    a lease to notice a silent loss, then the search's own deadline (two leases), after which
    the search exits the process anyway. One machine has no successor: nothing to wait for."""
    succ = link._succession
    if succ is None or link._stop.is_set():
        return
    start = time.monotonic()
    deadline = start + 3 * succ.lease + 3.0
    told = False
    while not link._done_seen.wait(0.05) and time.monotonic() < deadline:
        if not told and (link._lost_since is not None or time.monotonic() - start > 1.0):
            told = True
            log.info("finished; waiting for a coordinator to record it before leaving")
    if not link._done_seen.is_set():
        log.warning("left without the coordinator recording that this rank finished")


def bound_silence(link: LauncherLink, lease: float) -> None:
    """A coordinator cut off by a partition never closes our connection: its FIN is dropped
    too. Data we send then goes unacknowledged, and TCP_USER_TIMEOUT turns that into a
    connection error after a lease, so the reader notices and the reconnect starts. Our
    heartbeats usually go to the agent's records, not this socket, so the kernel's keepalive
    probes (every second once idle; answered by the peer's kernel, no work for the
    coordinator) provide the unacknowledged data."""
    if not isinstance(link.client, ControlClient):
        return  # not connected: the next connection gets it (see LauncherLink._dispatch)
    with contextlib.suppress(OSError, AttributeError):
        sock = link.client.sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(lease * 1000))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, int(lease)))


def _reconnect(link: LauncherLink) -> None:
    """Try the successors in order (from the next term's candidate) until one takes this
    worker, or exit at the deadline. The hello names the lowest term this worker accepts: a
    stale coordinator (a lower term) refuses it, and so does an agent that is not a
    candidate; a candidate that loses its election hangs up."""
    succ = link._succession
    assert succ is not None and link._lost_since is not None
    lease = succ.lease
    deadline = link._lost_since + 2 * lease + 2.0
    addresses = list(succ.addresses)
    floor = link._term + 1
    turn = floor - 1
    while addresses and time.monotonic() < deadline:
        host, _, port = addresses[turn % len(addresses)].rpartition(":")
        turn += 1
        left = deadline - time.monotonic()
        # before the connection exists: a hang-up right after our hello must not be forgotten
        link._retry.clear()
        try:
            client = ControlClient(
                (host, int(port)),
                link.env.secret,
                link._on_message,
                functools.partial(on_lost, link),
                timeout=min(1.0, left),
            )
        except (ConnectionError, ValueError):
            time.sleep(0.05)
            continue
        status = link._status()
        with link._lock:  # a report sent meanwhile is in this hello or goes after it (link.send)
            hello = Hello(
                worker_id=link.env.worker_id,
                pid=os.getpid(),
                role=link.env.role,
                term=floor,
                rank=link._rank,
                generation=link._generation,
                aborted=link._aborted,
                step=status.step if status.step is not None else -1,
                ready=link._ready,
                done=link._done,
            )
            try:
                client.send(encode(hello))
            except OSError:
                client.close()
                continue
            old, link.client = link.client, client
            # from now on reports go to the candidate: one that wins handles them in its first
            # round (a Stopped sent after the hello would otherwise be lost for good)
            link._between = False
        old.close()
        log.info("reconnected to a successor (term %d or later) at %s:%s", floor, host, port)
        # the candidate may still lose its election: then it hangs up and on_lost calls again;
        # until a message arrives, _lost_since keeps the deadline running
        while link._lost_since is not None and time.monotonic() < deadline:
            if link._stop.wait(0.05):
                return
            if link._retry.is_set():
                break
        if link._lost_since is None:
            return
    if link._stop.is_set():
        return
    log.error("no coordinator took over within %.1f s of losing the last one; exiting", 2 * lease + 2.0)
    os._exit(70)
