"""The job's callbacks for its launcher link and its fault injector, wired by
``startup.connect``: an ``Abort`` from the launcher, the status each heartbeat carries, and the
announcement of a rehearsed fault that fired.

Kept apart from the Job's public API in ``job.py`` because they are not called by the script:
the link calls :func:`on_abort` on its reader thread (so that a main thread blocked in a
collective wakes up at once) and :func:`status` for every heartbeat; the injector calls
:func:`announce_fault` from a fault site. Functions of the
:class:`~checkpointless.recovery.job.Job` they act on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from checkpointless.comm.work import waiting_since
from checkpointless.events import get_logger
from checkpointless.faults.inject import FaultSpec
from checkpointless.protocol import Abort, Fired, Heartbeat

if TYPE_CHECKING:
    from checkpointless.recovery.job import Job

__all__ = ["announce_fault", "on_abort", "status"]

log = get_logger()


def on_abort(job: Job, msg: Abort) -> None:
    gen = msg.generation
    if gen > job._latest_abort:
        job._latest_abort = gen
        job._cancel.set()
        n = job.groups.abort(msg.reason)
        if n:
            log.info("aborted %d pending collective(s) for generation %d", n, gen)


def status(job: Job) -> Heartbeat:
    return job.clock.heartbeat(job.comm.in_collective_since or waiting_since())


def announce_fault(job: Job, spec: FaultSpec) -> None:
    log.warning("injecting fault %s", spec.to_text())
    if job._link is not None:
        job._link.send(Fired(id=spec.id, kind=spec.kind, time=time.time()))
