"""A new coordinator's state, rebuilt from what the agents and the workers report: pure.

After a takeover the new coordinator knows nothing but the reports: each voting agent lists its
host's processes (:class:`ProcReport`), and each worker that reconnects says who it is
(:class:`WorkerReport`). :func:`rebuild` turns them into the ranks, the spares, the processes to
kill and the generation to form next. See docs/architecture.md, "Coordinator failover".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Finished", "ProcReport", "Rebuilt", "WorkerReport", "rebuild"]


@dataclass(frozen=True)
class ProcReport:
    """A live process, as its agent reported it in its vote."""

    worker_id: int
    host: int  # the agent id
    role: str  # worker | spare
    pid: int
    store_address: str = ""
    # it had said hello before the loss; one still starting has the succession from its agent's
    # environment and reconnects once up: nobody waits for it, and a spare among them is kept
    connected: bool = True


@dataclass(frozen=True)
class WorkerReport:
    """A process that reconnected, as it described itself in its hello."""

    worker_id: int
    rank: int | None  # None: a spare that holds no rank
    generation: int  # the newest generation it formed (-1: none yet)
    committed_step: int
    ready: bool = False  # a spare that finished warming up
    aborted: int = -1  # the newest generation it stopped for (a round in flight, or a report lost)
    step: int = -1  # the step it was at
    done: bool = False  # it finished its loop; it leaves once the new coordinator speaks


@dataclass(frozen=True)
class Finished:
    """A worker that left after finishing its loop, as its agent reported it in its vote: the
    lost coordinator had acknowledged its Done but not yet ended the job."""

    worker_id: int
    host: int  # the agent id
    rank: int
    code: int  # its exit code (non-zero: the script failed after its loop)


@dataclass(frozen=True)
class Rebuilt:
    ranks: dict[int, int]  # rank -> the worker id holding it
    missing: list[int]  # ranks nobody holds: spares take them in the first round
    spares: list[int]  # idle spares (worker ids)
    ready: list[int]  # the spares among them that are warm
    kill: list[int]  # processes nobody can vouch for, or that lost a rank to a newer claim
    generation: int  # the generation the first round forms (past any round in flight)
    formed: bool  # some generation had formed: there is state to keep
    next_worker_id: int
    finished: dict[int, Finished]  # rank -> the worker that held it and left after its loop


def _better(a: WorkerReport, b: WorkerReport) -> bool:
    """Whether claim ``a`` on a rank beats ``b``: the newer generation (the older one has been
    replaced), then the further committed step, then the lower worker id (any fixed order)."""
    return (a.generation, a.committed_step, -a.worker_id) > (b.generation, b.committed_step, -b.worker_id)


def rebuild(
    procs: Iterable[ProcReport],
    workers: Iterable[WorkerReport],
    nproc: int,
    finished: Iterable[Finished] = (),
) -> Rebuilt:
    """The rebuilt state. Only processes an agent reported count: the new coordinator can kill
    those, and a worker whose host did not vote belongs to a host that fences itself. A rank
    whose worker left after finishing is neither held nor missing: it is done."""
    if nproc < 1:
        raise ValueError(f"nproc={nproc}: a job has at least one rank")
    known = {p.worker_id: p for p in procs}
    said = {w.worker_id: w for w in workers if w.worker_id in known}
    claims: dict[int, WorkerReport] = {}
    # never reconnected: nobody can vouch for it. A spare that was still starting is the
    # exception: it has the succession from its agent and says hello once it is up, and no
    # rank depends on it meanwhile (a starting worker's rank goes to a spare instead)
    kill: set[int] = {
        wid for wid, p in known.items() if wid not in said and (p.connected or p.role != "spare")
    }
    spares: list[int] = []
    for w in said.values():
        if w.rank is None:
            if known[w.worker_id].role == "spare":
                spares.append(w.worker_id)
            else:
                kill.add(w.worker_id)  # a worker without a rank: it never joined; nobody needs it
            continue
        if not 0 <= w.rank < nproc:
            kill.add(w.worker_id)  # a rank of another job size: never ours
            continue
        held = claims.get(w.rank)
        if held is None or _better(w, held):
            if held is not None:
                kill.add(held.worker_id)
            claims[w.rank] = w
        else:
            kill.add(w.worker_id)
    newest = max((w.generation for w in claims.values()), default=-1)
    # a round may have been in flight, or a rank stopped by itself (a peer died) and its report
    # went to the lost coordinator: that target is spent (those ranks would not report for it
    # again), so the first round after the failover goes past it
    aborted = max((w.aborted for w in said.values()), default=-1)
    left = {f.rank: f for f in finished if 0 <= f.rank < nproc and f.rank not in claims}
    ids = set(known) | set(said) | {f.worker_id for f in left.values()}
    return Rebuilt(
        ranks={r: w.worker_id for r, w in sorted(claims.items())},
        missing=[r for r in range(nproc) if r not in claims and r not in left],
        spares=sorted(spares),
        ready=sorted(wid for wid in spares if said[wid].ready),
        kill=sorted(kill),
        generation=max(newest, aborted) + 1,
        formed=newest >= 0 or bool(left),
        next_worker_id=max(ids, default=-1) + 1,
        finished=dict(sorted(left.items())),
    )
