"""How long a round waits for a rank that has not reported, as a pure rule.

``--recovery-timeout`` bounds the time from a rank's assignment to its report: building the model,
receiving state, reaching ``job.steps()``. The time before a process has connected at all is the
start-up's, which ``--start-timeout`` bounds: its agent kills a process that has not connected
within it, or that makes no CPU progress for ``--hang-timeout`` before connecting, and the round
then replaces it like any lost rank. So a rank whose process is still starting does not fail the
round at ``--recovery-timeout``: at the job's start on a loaded host (or one importing torch from a
slow shared filesystem) the fork template alone can take longer than that, while it is plainly
making progress. Unit-tested in tests/unit/coordinator/test_round_wait.py.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Waiting", "overdue", "waiting"]


class _Holder(Protocol):
    """What the rule reads of the process holding a rank (``coordinator.state.Member``)."""

    @property
    def connected(self) -> bool: ...
    @property
    def spawned(self) -> float: ...
    @property
    def assigned_at(self) -> float: ...


@dataclass(frozen=True)
class Waiting:
    """A rank the round has no report from, and what is known of the process that holds it."""

    rank: int
    connected: bool  # its process has said hello
    spawned: float  # monotonic time its process was asked for
    assigned_at: float  # monotonic time it was given the rank


def waiting(holders: Mapping[int, _Holder], reported: Collection[int], nproc: int) -> list[Waiting]:
    """The ranks of ``range(nproc)`` not in ``reported``, each with its holder's times (a rank
    with no holder counts as connected: the round's own limit applies to it)."""
    out: list[Waiting] = []
    for k in range(nproc):
        if k in reported:
            continue
        h = holders.get(k)
        out.append(
            Waiting(k, True, 0.0, 0.0) if h is None else Waiting(k, h.connected, h.spawned, h.assigned_at)
        )
    return out


def overdue(
    waiting: list[Waiting], round_started: float, now: float, recovery_timeout: float, start_timeout: float
) -> list[int]:
    """The ranks of ``waiting`` past their limit at ``now``, in rank order.

    A connected rank has ``recovery_timeout`` from the later of the round's start and its
    assignment. A process still starting has ``start_timeout`` from its spawn, then the same
    ``recovery_timeout`` (its agent should have judged it long before; this only bounds a round
    whose agent never does), and never less than the round's own ``recovery_timeout``.
    """
    late: list[int] = []
    for w in sorted(waiting, key=lambda w: w.rank):
        if w.connected:
            limit = max(round_started, w.assigned_at) + recovery_timeout
        else:
            limit = max(round_started, w.spawned + start_timeout) + recovery_timeout
        if now > limit:
            late.append(w.rank)
    return late
