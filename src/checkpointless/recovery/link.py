"""A worker's link to the launcher: the control connection, heartbeats and the inbox.

The reader thread acts on ``abort`` at once (it fails the communicator's pending collectives, so
a main thread blocked in a collective wakes up) and queues everything else for the main thread.
It also keeps the peer table (``peer_table.TableHolder``): ``peer_table`` chunks never reach the
inbox, and a ``recover`` reaches it with its peer table and plan filled in; one whose delta does
not apply to the table held here is kept back while the full table is asked for.

Heartbeats go to the record the host's agent reads (``agent/beats.py``) when the agent gave us
one, else over the control connection.
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
from typing import Any

from checkpointless.agent.beats import BEAT_ENV, BeatWriter
from checkpointless.config import WorkerEnv
from checkpointless.events import get_logger
from checkpointless.launcher.control import ControlClient
from checkpointless.peer_table import TableChunk, TableHolder
from checkpointless.protocol import (
    Heartbeat,
    Hello,
    Message,
    PeerTable,
    PeerTableRequest,
    ProtocolError,
    decode,
    encode,
)

__all__ = ["LauncherLink", "set_parent_death_signal"]

log = get_logger()


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
        on_abort: Callable[[dict[str, Any]], None],
        status: Callable[[], Heartbeat],
        heartbeat_s: float = 0.25,
    ) -> None:
        self.env = env
        self.inbox: queue.Queue[dict[str, Any]] = queue.Queue()
        self._on_abort = on_abort
        self._status = status
        self._stop = threading.Event()
        self.table = TableHolder()  # the reader thread's alone
        self._held: dict[str, Any] | None = None  # a recover waiting for the full table
        self._asked = 0  # full tables asked for in a row that did not arrive intact
        self._beats: BeatWriter | None = None
        path = os.environ.get(BEAT_ENV)
        if path:
            try:
                self._beats = BeatWriter(Path(path))
            except OSError as e:
                log.warning("heartbeats go over the control connection: %s", e)
        self.client = ControlClient(env.control, env.secret, self._on_message, self._on_lost)
        self.send(Hello(worker_id=env.worker_id, pid=os.getpid(), role=env.role))
        self._hb = threading.Thread(
            target=self._heartbeat, args=(heartbeat_s,), daemon=True, name="cl-heartbeat"
        )
        self._hb.start()

    def send(self, msg: Message) -> None:
        try:
            self.client.send(encode(msg))
        except OSError as e:
            self._on_lost(f"send failed: {e}")

    def _on_message(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "peer_table":
            self._on_table_chunk(msg)
            return
        if kind == "recover":
            try:
                resolved = self.table.resolve(msg)
            except (ValueError, TypeError, KeyError) as e:  # TableError is a ValueError
                # a plan we cannot read: pass it on as it is, so that joining it fails and is
                # reported as this round's failure (never a dead reader thread)
                log.warning("cannot read the plan for generation %s: %s", msg.get("generation"), e)
                resolved = msg
            if resolved is None:
                # a delta for a table we do not hold (or that would not match its digest):
                # never meet peers at guessed addresses; ask for all of it and wait
                log.info(
                    "peer table v%d does not apply to v%d here; asking for all of it",
                    int(msg.get("table_version", -1)),
                    self.table.version,
                )
                self._held = msg
                self.send(PeerTableRequest(have=self.table.version))
                return
            self._held = None
            msg = resolved
        elif kind == "abort":
            self._on_abort(msg)
        elif kind == "shutdown":
            code = int(msg.get("code", 0))
            if code:
                log.error("launcher stops this process: %s", msg.get("reason", ""))
            os._exit(code)
        self.inbox.put(msg)

    def _on_table_chunk(self, msg: dict[str, Any]) -> None:
        try:
            m = decode(msg)
            if not isinstance(m, PeerTable):
                raise ProtocolError(f"{m.TYPE} is not a peer_table")
            done = self.table.on_chunk(
                m.version, m.digest, m.world_size, TableChunk(m.first, m.hosts, m.runs)
            )
        except (ProtocolError, ValueError) as e:  # TableError is a ValueError
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
            self._on_message(held)  # the plan that waited for this table

    def _on_lost(self, why: str) -> None:
        if self._stop.is_set():
            return
        # Nobody is left to coordinate a recovery; staying alive would only leave orphans.
        log.error("lost the launcher (%s); exiting", why)
        os._exit(70)

    def _heartbeat(self, every: float) -> None:
        while not self._stop.wait(every):
            if self._beats is not None:
                self._beats.write(self._status(), time.monotonic())
                continue
            try:
                self.client.send(encode(self._status()))
            except OSError:
                return

    def wait_for(self, kinds: set[str], deadline: float) -> dict[str, Any]:
        """Next queued message of one of ``kinds`` (others are dropped); TimeoutError after deadline."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {'/'.join(sorted(kinds))} message from the launcher in time")
            try:
                msg = self.inbox.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if msg.get("type") in kinds:
                return msg

    def close(self) -> None:
        self._stop.set()
        self.client.close()
        if self._beats is not None:
            self._beats.path.unlink(missing_ok=True)
