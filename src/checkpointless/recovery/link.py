"""A worker's link to the launcher: the control connection, heartbeats and the inbox.

The reader thread decodes every frame once (``protocol.decode``): what reaches the main thread
is a typed message, and a frame that is not one of ours (an unknown type, a missing field, a
wrong type) is logged and dropped there, so neither thread ever trips over it later. It acts on
``abort`` at once (it fails the communicator's pending collectives, so a main thread blocked in a
collective wakes up) and queues everything else for the main thread.
It also keeps the peer table (``peer_table.TableHolder``): ``peer_table`` chunks never reach the
inbox, and a ``recover`` reaches it with its peer table and plan filled in; one whose delta does
not apply to the table held here is kept back while the full table is asked for.

Heartbeats go to the record the host's agent reads (``agent/beats.py``) when the agent gave us
one, else over the control connection.

Coordinator failover (docs/architecture.md): once the coordinator has sent a ``succession``, a
lost connection is not the end. The link tries the candidates term by term, says who it is in its
hello (rank, generation, step) and carries on with whichever coordinator accepts it; only when no
coordinator has taken it by a deadline (two leases: the election, then the agents' fencing) does
the worker exit, as it always did without a succession.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, overload

from checkpointless.agent.beats import BEAT_ENV, BeatWriter
from checkpointless.agent.tables import TABLE_ENV, read_table, table_path
from checkpointless.config import WorkerEnv
from checkpointless.events import get_logger
from checkpointless.launcher.control import ControlClient
from checkpointless.peer_table import TableChunk, TableHolder
from checkpointless.protocol import (
    SUCCESSION_ENV,
    Abort,
    Assign,
    Heartbeat,
    Hello,
    Message,
    PeerTable,
    PeerTableRequest,
    ProtocolError,
    Recover,
    Recovered,
    Shutdown,
    SpareReady,
    Stopped,
    Succession,
    decode,
    encode,
    succession_from_env,
)

__all__ = ["LauncherLink", "set_parent_death_signal"]

log = get_logger()
_HOST_TABLE_WAIT_S = 1.0  # how long a plan waits for its host's copy of the table to appear
# the kinds of message a caller waits for, so that it gets their union back, typed
A = TypeVar("A", bound=Message)
B = TypeVar("B", bound=Message)
C = TypeVar("C", bound=Message)


class _Unconnected:
    """The link's client before any coordinator took this process: sends fail like a closed
    connection's, so reports wait for the next hello (see ``LauncherLink.send``)."""

    def send(self, payload: dict[str, Any]) -> None:
        raise OSError("not connected to a coordinator")

    def close(self) -> None:
        pass


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to signal us when the launcher dies, even if it is SIGKILLed."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, sig)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the closed control connection still tells us


class LauncherLink:
    def __init__(
        self,
        env: WorkerEnv,
        on_abort: Callable[[Abort], None],
        status: Callable[[], Heartbeat],
        heartbeat_s: float = 0.25,
    ) -> None:
        self.env = env
        self.inbox: queue.Queue[Message] = queue.Queue()
        self._on_abort = on_abort
        self._status = status
        self._stop = threading.Event()
        self.table = TableHolder()  # the reader thread's alone
        self._held: Recover | None = None  # a recover waiting for the full table
        self._asked = 0  # full tables asked for in a row that did not arrive intact
        self._beats: BeatWriter | None = None
        tables = os.environ.get(TABLE_ENV)
        self._tables = Path(tables) if tables else None  # the host's peer tables (agent/tables.py)
        path = os.environ.get(BEAT_ENV)
        if path:
            try:
                self._beats = BeatWriter(Path(path))
            except OSError as e:
                log.warning("heartbeats go over the control connection: %s", e)
        # what a new coordinator needs to hear after a failover (see _reconnect)
        self._succession: Succession | None = None
        self._term = 0  # the newest coordinator term this link has seen; it never goes back
        self._rank = -1
        self._generation = -1
        self._aborted = -1
        self._ready = False
        self._lost_since: float | None = None  # lost the coordinator and no successor spoke yet
        self._between = False  # lost it and not connected to a candidate either
        self._reconnector: threading.Thread | None = None
        self._retry = threading.Event()  # the candidate we reached hung up: try the next term
        self._lock = threading.Lock()
        self._from_env()
        self.client: ControlClient | _Unconnected
        try:
            # with a succession in hand a dead coordinator is not the end: do not spend the
            # successors' election window on it (a lost host never refuses, it only times out)
            timeout = 10.0 if self._succession is None else min(10.0, self._lease())
            self.client = ControlClient(env.control, env.secret, self._on_message, self._on_lost, timeout)
        except ConnectionError as e:
            if self._succession is None:
                raise
            self.client = _Unconnected()
            self._on_lost(f"cannot reach it at start: {e}")
        else:
            self.send(Hello(worker_id=env.worker_id, pid=os.getpid(), role=env.role))
        self._hb = threading.Thread(
            target=self._heartbeat, args=(heartbeat_s,), daemon=True, name="cl-heartbeat"
        )
        self._hb.start()

    def _from_env(self) -> None:
        """The succession the agent knew when it started this process (agent/agent.py): a
        process that starts as the coordinator is lost has heard none itself."""
        try:
            known = succession_from_env(os.environ.get(SUCCESSION_ENV))
        except ProtocolError as e:
            log.warning("no successors known at start (%s)", e)
            return
        if known is not None:
            self._succession = known
            self._term = known.term

    def _lease(self) -> float:
        return self._succession.lease if self._succession is not None else 5.0

    def send(self, msg: Message) -> None:
        if isinstance(msg, Recovered):
            self._generation = max(self._generation, msg.generation)
        elif isinstance(msg, SpareReady):
            self._ready = True
        elif isinstance(msg, Stopped):
            # a report that may be lost with the coordinator: the successor's first round must
            # be for a newer generation, so that this worker reports again
            self._aborted = max(self._aborted, msg.for_generation)
        if self._between:
            return  # connected to nobody: the report counts in the next hello (see _aborted)
        try:
            self.client.send(encode(msg))
        except OSError as e:
            self._on_lost(f"send failed: {e}")

    def _on_message(self, raw: dict[str, Any]) -> None:
        """The reader thread's entry for every frame: decoded once, then dispatched."""
        self._lost_since = None  # a coordinator is talking to us (even one that garbles a frame)
        try:
            msg = decode(raw)
        except ProtocolError as e:
            # a bug or a version skew on the coordinator's side, never this worker's fault:
            # dropping the frame keeps the reader thread (and with it abort and shutdown) alive,
            # and a lost plan or assignment times out as the round or start-up would anyway
            log.warning("dropped a control message from the coordinator: %s", e)
            return
        self._dispatch(msg)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, Succession):
            if msg.term >= self._term:
                self._succession = msg
                self._term = msg.term
                self._bound_silence(msg.lease)
            return
        if isinstance(msg, PeerTable):
            self._on_table_chunk(msg)
            return
        if isinstance(msg, Assign):
            self._rank = msg.rank
        elif isinstance(msg, Recover):
            ready = self._resolve(msg)
            if ready is None:
                return  # held back until the full table arrives
            msg = ready
        elif isinstance(msg, Abort):
            self._aborted = max(self._aborted, msg.generation)
            self._on_abort(msg)
        elif isinstance(msg, Shutdown):
            if msg.code:
                log.error("launcher stops this process: %s", msg.reason or "")
            os._exit(msg.code)
        self.inbox.put(msg)

    def _resolve(self, msg: Recover) -> Recover | None:
        """The plan with its peer table filled in, or None when it must wait for the table."""
        try:
            resolved = self.table.resolve(encode(msg))
        except (ValueError, TypeError, KeyError) as e:  # TableError is a ValueError
            # a plan we cannot read: pass it on as it is, so that joining it fails and is
            # reported as this round's failure (never a dead reader thread)
            log.warning("cannot read the plan for generation %d: %s", msg.generation, e)
            self._held = None
            return msg
        if resolved is None and self._from_host(msg):
            resolved = self.table.resolve(encode(msg))
        if resolved is None:
            # a delta for a table we do not hold (or that would not match its digest), and no
            # good copy on this host: never meet peers at guessed addresses; ask for all of it
            log.info(
                "peer table v%d does not apply to v%d here; asking for all of it",
                msg.table_version,
                self.table.version,
            )
            self._held = msg
            self.send(PeerTableRequest(have=self.table.version))
            return None
        self._held = None
        return dataclasses.replace(msg, plan=resolved["plan"], rendezvous=resolved["rendezvous"])

    def _from_host(self, msg: Recover) -> bool:
        """Take the plan's table version from the copy this host's agent keeps (agent/tables.py),
        checked against the plan's digest. The agent gets it on a connection of its own, sent just
        before our plan: a copy not there yet is waited for briefly (on this reader thread, which
        has nothing else to do while it has no plan to hand on) when the coordinator must have
        sent one (we hold no table, or the plan carries no delta); a worker that merely missed a
        delta looks once and asks."""
        if self._tables is None or msg.table_version < 0:
            return False
        path = table_path(self._tables, msg.table_version)
        expected = self.table.version < 0 or msg.table_base < 0
        deadline = time.monotonic() + (_HOST_TABLE_WAIT_S if expected else 0.0)
        seen: tuple[int, int, int] | None = None
        while True:
            try:
                st = path.stat()
                now = (st.st_ino, st.st_mtime_ns, st.st_size)
            except OSError:
                now = None
            if now is not None and now != seen:  # there, or replaced: (re)read it
                seen = now
                peers = read_table(self._tables, msg.table_version, msg.table_digest)
                if peers is not None:
                    self.table.adopt(msg.table_version, peers)
                    return True
            # not there yet, or another table of that number (a coordinator elected after a
            # failover numbers from 1 again, and its copy may still be on its way)
            if time.monotonic() >= deadline:
                log.info("no good copy of peer table v%d on this host", msg.table_version)
                return False
            time.sleep(0.005)

    def _on_table_chunk(self, m: PeerTable) -> None:
        try:
            done = self.table.on_chunk(
                m.version, m.digest, m.world_size, TableChunk(m.first, m.hosts, m.runs)
            )
        except ValueError as e:  # TableError is a ValueError
            self._asked += 1
            if self._asked > 3:  # the coordinator keeps sending a broken table: stop asking
                log.error(
                    "peer table still broken after %d tries (%s); waiting for a new plan", self._asked, e
                )
                return
            log.warning("bad peer table chunk (%s); asking again", e)
            self.send(PeerTableRequest(have=self.table.version))
            return
        if done:
            self._asked = 0
        held = self._held
        if done and held is not None:
            self._held = None
            self._dispatch(held)  # the plan that waited for this table

    def _on_lost(self, why: str) -> None:
        if self._stop.is_set():
            return
        if self._succession is None:
            # Nobody is left to coordinate a recovery; staying alive would only leave orphans.
            log.error("lost the launcher (%s); exiting", why)
            os._exit(70)
        with self._lock:
            self._between = True
            if self._lost_since is None:
                self._lost_since = time.monotonic()
            if self._reconnector is not None and self._reconnector.is_alive():
                self._retry.set()
                return
            log.warning("lost the coordinator (%s); looking for its successor", why)
            self._reconnector = threading.Thread(target=self._reconnect, daemon=True, name="cl-reconnect")
            self._reconnector.start()

    def _bound_silence(self, lease: float) -> None:
        """A coordinator cut off by a partition never closes our connection: its FIN is dropped
        too. Data we send then goes unacknowledged, and TCP_USER_TIMEOUT turns that into a
        connection error after a lease, so the reader notices and the reconnect starts. Our
        heartbeats usually go to the agent's records, not this socket, so the kernel's keepalive
        probes (every second once idle; answered by the peer's kernel, no work for the
        coordinator) provide the unacknowledged data."""
        if not isinstance(self.client, ControlClient):
            return  # not connected: the next connection gets it (see _dispatch)
        with contextlib.suppress(OSError, AttributeError):
            sock = self.client.sock
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(lease * 1000))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, int(lease)))

    def _reconnect(self) -> None:
        """Try the successors in order (from the next term's candidate) until one takes this
        worker, or exit at the deadline. The hello names the lowest term this worker accepts: a
        stale coordinator (a lower term) refuses it, and so does an agent that is not a
        candidate; a candidate that loses its election hangs up."""
        succ = self._succession
        assert succ is not None and self._lost_since is not None
        lease = succ.lease
        deadline = self._lost_since + 2 * lease + 2.0
        addresses = list(succ.addresses)
        floor = self._term + 1
        turn = floor - 1
        while addresses and time.monotonic() < deadline:
            host, _, port = addresses[turn % len(addresses)].rpartition(":")
            turn += 1
            left = deadline - time.monotonic()
            try:
                client = ControlClient(
                    (host, int(port)),
                    self.env.secret,
                    self._on_message,
                    self._on_lost,
                    timeout=min(1.0, left),
                )
            except (ConnectionError, ValueError):
                time.sleep(0.05)
                continue
            status = self._status()
            hello = Hello(
                worker_id=self.env.worker_id,
                pid=os.getpid(),
                role=self.env.role,
                term=floor,
                rank=self._rank,
                generation=self._generation,
                aborted=self._aborted,
                step=status.step if status.step is not None else -1,
                ready=self._ready,
            )
            try:
                client.send(encode(hello))
            except OSError:
                client.close()
                continue
            old, self.client = self.client, client
            old.close()
            # from now on reports go to the candidate: one that wins handles them in its first
            # round (a Stopped sent after the hello would otherwise be lost for good)
            self._between = False
            log.info("reconnected to a successor (term %d or later) at %s:%s", floor, host, port)
            # the candidate may still lose its election: then it hangs up and _on_lost calls again;
            # until a message arrives, _lost_since keeps the deadline running
            self._retry.clear()
            while self._lost_since is not None and time.monotonic() < deadline:
                if self._stop.wait(0.05):
                    return
                if self._retry.is_set():
                    break
            if self._lost_since is None:
                return
        if self._stop.is_set():
            return
        log.error("no coordinator took over within %.1f s of losing the last one; exiting", 2 * lease + 2.0)
        os._exit(70)

    def _heartbeat(self, every: float) -> None:
        while not self._stop.wait(every):
            if self._beats is not None:
                # to the host's agent, which stays through a coordinator failover
                self._beats.write(self._status(), time.monotonic())
                continue
            if self._between:
                continue  # nobody to tell; the link is looking for the next coordinator
            try:
                self.client.send(encode(self._status()))
            except OSError:
                continue  # the reader thread sees the loss and starts looking

    @overload
    def wait_for(self, kinds: tuple[type[A]], deadline: float) -> A: ...
    @overload
    def wait_for(self, kinds: tuple[type[A], type[B]], deadline: float) -> A | B: ...
    @overload
    def wait_for(self, kinds: tuple[type[A], type[B], type[C]], deadline: float) -> A | B | C: ...
    def wait_for(self, kinds: tuple[type[Message], ...], deadline: float) -> Message:
        """Next queued message of one of ``kinds`` (others are dropped); TimeoutError after deadline."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                names = "/".join(sorted(k.TYPE for k in kinds))
                raise TimeoutError(f"no {names} message from the launcher in time")
            try:
                msg = self.inbox.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if isinstance(msg, kinds):
                return msg

    def close(self) -> None:
        self._stop.set()
        self.client.close()
        if self._beats is not None:
            self._beats.path.unlink(missing_ok=True)
