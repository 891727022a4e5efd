"""A worker's link to the launcher: the control connection, heartbeats and the inbox.

The reader thread decodes every frame once (``protocol.decode``): what reaches the main thread
is a typed message, and a frame that is not one of ours (an unknown type, a missing field, a
wrong type) is logged and dropped there, so neither thread ever trips over it later. It acts on
``abort`` at once (it fails the communicator's pending collectives, so a main thread blocked in a
collective wakes up) and queues everything else for the main thread.
It also keeps the peer table (``link_table.py``): ``peer_table`` chunks never reach the inbox,
and a ``recover`` reaches it with its peer table and plan filled in.

Heartbeats go to the record the host's agent reads (``agent/beats.py``) when the agent gave us
one, else over the control connection.

Coordinator failover (docs/architecture.md): once the coordinator has sent a ``succession``, a
lost connection is not the end; the link looks for the successor (``link_failover.py``), and the
worker exits only when no coordinator has taken it by a deadline.
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, overload

from checkpointless.agent.beats import BEAT_ENV, BeatWriter
from checkpointless.agent.tables import TABLE_ENV
from checkpointless.config import WorkerEnv
from checkpointless.events import get_logger
from checkpointless.launcher.control import ControlClient
from checkpointless.peer_table import TableHolder
from checkpointless.protocol import (
    SUCCESSION_ENV,
    Abort,
    Assign,
    Done,
    DoneSeen,
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
    succession_from_env,
)
from checkpointless.recovery.link_failover import bound_silence, on_lost
from checkpointless.recovery.link_table import on_table_chunk, resolve

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
        self.table = TableHolder()  # the reader thread's alone
        self._held: Recover | None = None  # a recover waiting for the full table
        self._asked = 0  # full tables asked for in a row that did not arrive intact
        self._beats: BeatWriter | None = None
        self._beat_lock = threading.Lock()
        tables = os.environ.get(TABLE_ENV)
        self._tables = Path(tables) if tables else None  # the host's peer tables (agent/tables.py)
        path = os.environ.get(BEAT_ENV)
        if path:
            try:
                self._beats = BeatWriter(Path(path))
            except OSError as e:
                log.warning("heartbeats go over the control connection: %s", e)
        # what a new coordinator needs to hear after a failover (see link_failover._reconnect)
        self._succession: Succession | None = None
        self._term = 0  # the newest coordinator term this link has seen; it never goes back
        self._rank = -1
        self._generation = -1
        self._aborted = -1
        self._ready = False
        self._done = False  # it sent Done: the job's loop is finished here
        self._done_seen = threading.Event()  # the coordinator recorded it (DoneSeen)
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
            lost = functools.partial(on_lost, self)
            self.client = ControlClient(env.control, env.secret, self._on_message, lost, timeout)
        except ConnectionError as e:
            if self._succession is None:
                raise
            self.client = _Unconnected()
            on_lost(self, f"cannot reach it at start: {e}")
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
                on_lost(self, f"send failed: {e}")

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
                bound_silence(self, msg.lease)
            return
        if isinstance(msg, PeerTable):
            on_table_chunk(self, msg)
            return
        if isinstance(msg, DoneSeen):
            self._done_seen.set()
            return
        if isinstance(msg, Assign):
            self._rank = msg.rank
        elif isinstance(msg, Recover):
            ready = resolve(self, msg)
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
