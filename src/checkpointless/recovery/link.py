"""A worker's link to the launcher: the control connection, heartbeats and the inbox.

The reader thread acts on ``abort`` at once (it fails the communicator's pending collectives, so
a main thread blocked in a collective wakes up) and queues everything else for the main thread.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from checkpointless.config import WorkerEnv
from checkpointless.events import get_logger
from checkpointless.launcher.control import ControlClient
from checkpointless.protocol import Heartbeat, Hello, Message, encode

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
        if kind == "abort":
            self._on_abort(msg)
        elif kind == "shutdown":
            code = int(msg.get("code", 0))
            if code:
                log.error("launcher stops this process: %s", msg.get("reason", ""))
            os._exit(code)
        self.inbox.put(msg)

    def _on_lost(self, why: str) -> None:
        if self._stop.is_set():
            return
        # Nobody is left to coordinate a recovery; staying alive would only leave orphans.
        log.error("lost the launcher (%s); exiting", why)
        os._exit(70)

    def _heartbeat(self, every: float) -> None:
        while not self._stop.wait(every):
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
