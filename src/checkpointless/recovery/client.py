"""The recovery client: this rank's end of the recovery protocol, between rounds.

It holds the link to the coordinator (``link.py``, absent under plain torchrun or run plainly),
the newest abort heard and the generation this rank reports for next, the event that cancels a
rendezvous in progress when a newer fault arrives, and the key server a root-less rendezvous
serves from this process. :class:`RecoveryClient` owns these fields and the link's callbacks: an
``Abort`` (on the link's reader thread, so that a main thread blocked in a collective wakes at
once), a rehearsed fault that fired, and a fatal error. The round itself is in ``recover.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from checkpointless.config import WorkerEnv
from checkpointless.errors import NotRecoverableError
from checkpointless.events import get_logger
from checkpointless.faults.inject import FaultSpec
from checkpointless.protocol import Abort, Fatal, Fired, Heartbeat, Message
from checkpointless.recovery.groups import Groups
from checkpointless.recovery.link import LauncherLink
from checkpointless.recovery.process import on_last_words

__all__ = ["RecoveryClient"]

log = get_logger()

_ENDS_PROCESS = frozenset({"kill", "killall", "exit"})
# bounded: a coordinator that is gone (or being replaced) does not hold a rehearsed fault up for long
_WAIT_S = 5.0


class RecoveryClient:
    """The link to the coordinator and what this rank knows of the recovery rounds."""

    def __init__(self, groups: Groups) -> None:
        self._groups = groups  # aborted at once when the coordinator aborts a generation
        self.link: LauncherLink | None = None
        self.report_gen = 0  # the generation this rank's next report is for
        self.latest_abort = -1  # the newest generation an Abort named
        self.cancel = threading.Event()  # set by an abort: a rendezvous in progress gives up
        self.first_commit = False  # the next commit is the first after a recovery: report it
        self.store_state: dict[str, Any] = {}  # the rendezvous key server ("server") and its state
        # run after an abort's groups were aborted (recovery/first_generation.py: during start-up)
        self.after_abort: Callable[[Abort], None] | None = None

    @property
    def connected(self) -> bool:
        """Under the launcher: there is a coordinator to recover with."""
        return self.link is not None

    def connect(self, env: WorkerEnv, status: Callable[[], Heartbeat]) -> LauncherLink:
        """Connect to the coordinator; ``status`` is what each heartbeat says."""
        self.link = LauncherLink(env, self.on_abort, status)
        on_last_words(self.send)  # a ConfigError that ends the script is told through it
        return self.link

    def send(self, msg: Message) -> None:
        """Tell the coordinator, if there is one."""
        if self.link is not None:
            self.link.send(msg)

    def on_abort(self, msg: Abort) -> None:
        gen = msg.generation
        if gen > self.latest_abort:
            self.latest_abort = gen
            self.cancel.set()
            n = self._groups.abort(msg.reason)
            if n:
                log.info("aborted %d pending collective(s) for generation %d", n, gen)
            if self.after_abort is not None:
                self.after_abort(msg)

    def announce_fault(self, spec: FaultSpec, step: int) -> None:
        """A rehearsed fault fires here, at ``step`` (the injector's callback). One that ends this
        process first waits until the coordinator has recorded it: the coordinator may handle
        the exit before it reads the last frame, and the replacement, not told that the fault
        fired, fired it again (seen under load: a kill at step 3 killed the spare that took the
        rank too). A fault that leaves the process alive is read in time anyway."""
        log.warning("injecting fault %s", spec.to_text())
        self.send(Fired(id=spec.id, kind=spec.kind, time=time.time(), step=step))
        link = self.link
        if link is not None and spec.kind in _ENDS_PROCESS and not link.await_fired_seen(spec.id, _WAIT_S):
            log.warning("the coordinator did not confirm fault %s within %.0f s", spec.id, _WAIT_S)

    def fatal(self, why: str, kind: str = "fatal", tries: int = 0) -> NoReturn:
        """End the job, or with ``kind`` "retries" this process: its in-process retries of a step
        are used up (``tries``: how often it raised), and the coordinator may give the rank to a
        fresh process (the coordinator hears why first)."""
        self.send(Fatal(error=why, kind=kind, tries=tries))
        raise NotRecoverableError(why)
