"""A worker's link to the launcher: the control connection, heartbeats and the inbox.

The reader thread decodes every frame once (``protocol.decode``): what reaches the main thread
is a typed message, and a frame that is not one of ours (an unknown type, a missing field, a
wrong type) is logged and dropped there, so neither thread ever trips over it later. It acts on
``abort`` at once (it fails the communicator's pending collectives, so a main thread blocked in a
collective wakes up) and queues everything else for the main thread.
It also keeps the peer table (``link_table.PlanTables``): ``peer_table`` chunks never reach the
inbox, and a ``recover`` reaches it with its peer table and plan filled in.

Heartbeats go to the record the host's agent reads (``protocol/beats.py``) when the agent gave us
one, else over the control connection.

Coordinator failover (docs/architecture.md): once the coordinator has sent a ``succession``, a
lost connection is not the end; the link looks for the successor (``link_failover.Failover``), and
the worker exits only when no coordinator has taken it by a deadline.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, overload

from checkpointless.config import WorkerEnv
from checkpointless.events import get_logger
from checkpointless.protocol import (
    Abort,
    Assign,
    Done,
    DoneSeen,
    FiredSeen,
    Heartbeat,
    Hello,
    Message,
    PeerTable,
    ProtocolError,
    Recover,
    Recovered,
    Shutdown,
    SpareReady,
    Stopped,
    Succession,
    decode,
    encode,
)
from checkpointless.protocol.beats import BEAT_ENV, BeatWriter
from checkpointless.protocol.control_client import ControlClient
from checkpointless.protocol.tables import TABLE_ENV
from checkpointless.recovery.link_failover import Failover
from checkpointless.recovery.link_table import PlanTables

__all__ = ["LauncherLink", "set_parent_death_signal"]

log = get_logger()
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
        tables = os.environ.get(TABLE_ENV)  # the host's peer tables (protocol/tables.py)
        self.tables = PlanTables(self.send, self._dispatch, Path(tables) if tables else None)
        self._beats: BeatWriter | None = None
        self._beat_lock = threading.Lock()
        path = os.environ.get(BEAT_ENV)
        if path:
            try:
                self._beats = BeatWriter(Path(path))
            except OSError as e:
                log.warning("heartbeats go over the control connection: %s", e)
        # what a new coordinator needs to hear after a failover (see _switch)
        self._rank = -1
        self._generation = -1
        self._aborted = -1
        self._ready = False
        self._done = False  # it sent Done: the job's loop is finished here
        self._done_seen = threading.Event()  # the coordinator recorded it (DoneSeen)
        self._fired_seen: set[str] = set()  # injected faults the coordinator recorded (FiredSeen)
        self._fired_cond = threading.Condition()
        self._between = False  # lost it and not connected to a candidate either
        self._lock = threading.Lock()
        self.failover = Failover(env.secret, self._stop, self._on_message, self._on_lost, self._switch)
        self.client: ControlClient | _Unconnected
        try:
            # with a succession in hand a dead coordinator is not the end: do not spend the
            # successors' election window on it (a lost host never refuses, it only times out)
            timeout = 10.0 if self.failover.succession is None else min(10.0, self.failover.lease())
            self.client = ControlClient(env.control, env.secret, self._on_message, self._on_lost, timeout)
        except ConnectionError as e:
            if self.failover.succession is None:
                raise
            self.client = _Unconnected()
            self._on_lost(f"cannot reach it at start: {e}")
        else:
            self.send(Hello(worker_id=env.worker_id, pid=os.getpid(), role=env.role))
        self._hb = threading.Thread(
            target=self._heartbeat, args=(heartbeat_s,), daemon=True, name="cl-heartbeat"
        )
        self._hb.start()

    def send(self, msg: Message) -> None:
        # Under the lock the reconnect builds its hello and swaps the connection with: a report
        # is either in the hello's fields or sent on the new connection, never dropped between.
        with self._lock:
            if isinstance(msg, Recovered):
                self._generation = max(self._generation, msg.generation)
            elif isinstance(msg, SpareReady):
                self._ready = True
            elif isinstance(msg, Done):
                self._done = True
            elif isinstance(msg, Stopped):
                # a report that may be lost with the coordinator: the successor's first round
                # must be for a newer generation, so that this worker reports again
                self._aborted = max(self._aborted, msg.for_generation)
            between, client = self._between, self.client
        if isinstance(msg, Done) and self._beats is not None:
            # the agent reads it when the process has gone: a successor coordinator learns from
            # its vote that this rank finished, if the coordinator is lost before it ends the job
            self._write_beat()
        if between:
            return  # connected to nobody: the report counts in the next hello (see _aborted)
        try:
            client.send(encode(msg))
        except OSError as e:
            with self._lock:
                stale = client is not self.client  # the reconnect replaced it meanwhile
            if not stale:
                self._on_lost(f"send failed: {e}")

    def _on_lost(self, why: str) -> None:
        if self._stop.is_set():
            return
        if self.failover.succession is None:
            # Nobody is left to coordinate a recovery; staying alive would only leave orphans.
            log.error("lost the launcher (%s); exiting", why)
            os._exit(70)
        with self._lock:
            self._between = True
            self.failover.search(why)

    def _switch(self, client: ControlClient, floor: int) -> bool:
        """Say hello to a successor's candidate (accepting term ``floor`` or later) and make it
        this link's connection; False when the hello could not be sent."""
        status = self._status()
        with self._lock:  # a report sent meanwhile is in this hello or goes after it (send)
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
                done=self._done,
            )
            try:
                client.send(encode(hello))
            except OSError:
                client.close()
                return False
            old, self.client = self.client, client
            # from now on reports go to the candidate: one that wins handles them in its first
            # round (a Stopped sent after the hello would otherwise be lost for good)
            self._between = False
        old.close()
        return True

    def await_release(self) -> None:
        """At a finished worker's exit, on many hosts: stay until the coordinator has recorded
        this worker's Done (``DoneSeen``). A Done can be lost with its coordinator: sent into
        nowhere while the link looked for a successor, or into a connection whose far end had
        died unseen (a lost host, a partition: noticed only a lease later). The hello to the
        successor then says it (``Hello.done``). A process that left at once would look to the
        successor like a rank that vanished, and with every rank gone that way it would fail a
        finished job. Bounded: a lease to notice a silent loss, then the search's own deadline
        (two leases), after which the search exits the process anyway. One machine has no
        successor: nothing to wait for."""
        succ = self.failover.succession
        if succ is None or self._stop.is_set():
            return
        start = time.monotonic()
        deadline = start + 3 * succ.lease + 3.0
        told = False
        while not self._done_seen.wait(0.05) and time.monotonic() < deadline:
            if not told and (self.failover.lost_since is not None or time.monotonic() - start > 1.0):
                told = True
                log.info("finished; waiting for a coordinator to record it before leaving")
        if not self._done_seen.is_set():
            log.warning("left without the coordinator recording that this rank finished")

    def await_fired_seen(self, fault_id: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the coordinator to record that injected fault
        ``fault_id`` fired (``FiredSeen``); whether it did."""
        deadline = time.monotonic() + timeout
        with self._fired_cond:
            while fault_id not in self._fired_seen:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                self._fired_cond.wait(min(left, 0.1))
            return True

    def _on_message(self, raw: dict[str, Any]) -> None:
        """The reader thread's entry for every frame: decoded once, then dispatched."""
        self.failover.heard()  # a coordinator is talking to us (even one that garbles a frame)
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
            self.failover.on_succession(msg, self.client)
            return
        if isinstance(msg, PeerTable):
            self.tables.on_chunk(msg)
            return
        if isinstance(msg, DoneSeen):
            self._done_seen.set()
            return
        if isinstance(msg, FiredSeen):
            with self._fired_cond:
                self._fired_seen.add(msg.id)
                self._fired_cond.notify_all()
            return
        if isinstance(msg, Assign):
            self._rank = msg.rank
        elif isinstance(msg, Recover):
            ready = self.tables.resolve(msg)
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

    def _write_beat(self) -> None:
        assert self._beats is not None
        with self._beat_lock:  # the heartbeat thread, and a Done at once (the record's one writer)
            self._beats.write(self._status(), time.monotonic(), self._rank, self._done)

    def _heartbeat(self, every: float) -> None:
        while not self._stop.wait(every):
            if self._beats is not None:
                # to the host's agent, which stays through a coordinator failover
                self._write_beat()
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
