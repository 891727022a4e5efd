"""Hangs, as a pure rule: the live workers' heartbeat and progress times in, the ranks that hold
the job up (or a stall of everyone) out. The limits it is given scale with the job's step time
(``budget.progress_limit``, ``budget.first_step_limit``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WorkerHealth", "find_hung"]


@dataclass
class WorkerHealth:
    """The launcher's view of one live worker, as of ``now``."""

    rank: int
    last_message: float  # monotonic time of the last frame received (heartbeats included)
    last_progress: float  # monotonic time the main thread last started or finished a step
    in_collective: bool  # the main thread is waiting for peers
    first_step: bool = False  # a fresh process that has not finished a step yet (may be compiling)


def find_hung(
    workers: list[WorkerHealth],
    now: float,
    hang_timeout: float,
    progress_limit: float | None = None,
    first_step_limit: float | None = None,
) -> tuple[list[int], str]:
    """Decide which ranks hold the job up. Returns (culprit ranks, why).

    A stopped process sends nothing at all; a busy loop keeps its heartbeat thread talking but
    makes no progress and is not waiting for anyone. Ranks stuck waiting in a collective are
    victims, not culprits. If every stalled rank is a victim (a lost link, a deadlock), nobody is
    replaced: the caller rebuilds the communicator with the same members.

    ``hang_timeout`` bounds heartbeat silence; ``progress_limit`` (default the same) bounds the
    time without step progress, which the caller scales with the observed step time. A worker in
    its first step (``first_step``: a fresh process, which may be compiling its model) has
    ``first_step_limit`` instead when that is longer (``--first-step-timeout``).
    """
    limit = hang_timeout if progress_limit is None else progress_limit
    first_limit = max(limit, first_step_limit if first_step_limit is not None else limit)
    silent = [w.rank for w in workers if now - w.last_message > hang_timeout]
    if silent:
        return sorted(silent), f"no heartbeat for more than {hang_timeout:.1f} s (process stopped?)"
    # the first step's allowance is for a rank busy compiling, i.e. outside any collective; one
    # that waits in a collective is a victim like any other (a replacement can deadlock with the
    # survivors in its first step, and would otherwise hold the job up for the whole allowance)
    stalled = [
        w
        for w in workers
        if now - w.last_progress > (first_limit if w.first_step and not w.in_collective else limit)
    ]
    if not stalled:
        return [], ""
    busy = [w for w in stalled if not w.in_collective]
    if busy and all(w.first_step for w in busy):
        return sorted(w.rank for w in busy), (
            f"its first step made no progress for more than {first_limit:.1f} s outside any collective "
            "(a fresh process's first step may compile the model with torch.compile or warm caches; "
            "if it needs longer, raise --first-step-timeout)"
        )
    if busy:
        return sorted(w.rank for w in busy), (
            f"no step progress for more than {limit:.1f} s outside any collective"
        )
    if len(stalled) < len(workers):
        return [], ""  # someone still made progress recently: it may be the one holding the others
    if any(now - w.last_message > _FRESH_S for w in workers):
        return [], ""  # someone has gone quiet: let the heartbeat limit name it before calling a stall
    return [], "all stalled ranks are waiting in a collective"


_FRESH_S = 2.0  # heartbeats come every 0.25 s; older than this and a process may have stopped
