"""Recovery plans: the phases a job goes through after a fault (or to grow back), and what each
costs under the calibration and the job's shape.

Pure functions; the event simulation (``des.py``) and the closed form (``models.py``) use the same
plans, so their differences are the timing effects only the simulation has.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import NamedTuple

from checkpointless.simulate.calibration import Calibration, CommModel
from checkpointless.simulate.failures import Detection, FailureCause
from checkpointless.simulate.topology import JobShape

__all__ = [
    "BADPUT_BUCKETS",
    "Bucket",
    "Phase",
    "Policy",
    "comm_start_s",
    "detect_s",
    "grow_phases",
    "inprocess_phases",
    "lazy_keys_read",
    "lazy_peers",
    "load_cost_s",
    "recovery_plan",
    "recurring_retries",
    "restart_phases",
    "save_cost_s",
    "shrink_phases",
    "step_wall_s",
    "transfer_cost_s",
]


class Policy(str, Enum):
    CHECKPOINT_RESTART = "checkpoint-restart"
    CHECKPOINTLESS = "checkpointless"


class Bucket(str, Enum):
    """Where wall time goes; the badput ones follow Google's ml-goodput-measurement categories."""

    PRODUCTIVE = "productive"
    INITIALISATION = "initialisation"  # communicator start-up or rebuild
    PROGRAM_STARTUP = "program_startup"  # process start, imports, model build, first-step warm-up
    DATA_LOADING = "data_loading"  # data pipeline restart after a disruption
    CHECKPOINT_SAVE = "checkpoint_save"  # blocking part of saves
    CHECKPOINT_RESTORE = "checkpoint_restore"  # file load, or state received from a peer
    WASTED_PROGRESS = "wasted_progress"  # steps computed and then lost to a rollback
    INFRA_RECOVERY = "infra_recovery"  # detection, abort, requeue, waiting for a node, swap
    DEGRADED = "degraded"  # capacity missing while fewer replicas compute the whole batch
    OTHER = "other"  # steady per-step cost of being recoverable


BADPUT_BUCKETS: tuple[Bucket, ...] = tuple(b for b in Bucket if b is not Bucket.PRODUCTIVE)


class Phase(NamedTuple):
    """One stretch of a recovery: which bucket it is charged to, what it is, how long."""

    bucket: Bucket
    label: str
    seconds: float


# ----------------------------------------------------------------------------------------------
# Scaling models
# ----------------------------------------------------------------------------------------------
def lazy_peers(rank: int, n: int, collectives: tuple[str, ...] = ("allreduce", "barrier")) -> set[int]:
    """The peers whose rendezvous keys ``rank`` of ``n`` reads when gloo connects lazily.

    gloo (torch 2.13) reads a peer's key when a collective first needs that peer: its ring
    all-reduce (and point-to-point sends along it) needs the two neighbours, its barrier (a
    dissemination barrier) the ranks 2^k before and after for each of its ceil(log2 n) rounds;
    a broadcast's binomial tree stays within the barrier's partners. Held to gloo itself in
    tests/unit/comm/test_gloo_connect.py.
    """
    if n < 1 or not 0 <= rank < n:
        raise ValueError(f"rank {rank} is not in a group of {n}")
    peers: set[int] = set()
    if "allreduce" in collectives:
        peers |= {(rank - 1) % n, (rank + 1) % n}
    if "barrier" in collectives:
        for k in range(math.ceil(math.log2(n)) if n > 1 else 0):
            peers |= {(rank - 2**k) % n, (rank + 2**k) % n}
    return peers - {rank}


def lazy_keys_read(n: int, collectives: tuple[str, ...] = ("allreduce", "barrier")) -> int:
    """How many keys one rank reads in a generation of ``n`` ranks under gloo's lazy connection.

    Every rank reads as many (the pattern is the same, shifted by the rank), and as many ranks
    read each rank's key (the pattern is symmetric)."""
    return len(lazy_peers(0, n, collectives))


def comm_start_s(model: CommModel, fixed_s: float, gpus: int, cal: Calibration) -> float:
    """Time to form the communicator over ``gpus`` ranks under a scaling model."""
    if model is CommModel.STORE_LINEAR:
        return fixed_s + cal.store_per_rank_s * gpus
    if model is CommModel.ROOTLESS_LOG:
        return fixed_s + cal.rootless_log_s * math.log2(max(gpus, 2))
    if model is CommModel.ROOTLESS_MEASURED:
        batches = math.ceil(gpus / 128)
        return fixed_s + cal.rootless_per_rank_s * (gpus - 1) + 3 * cal.rootless_rtt_s * batches
    if model is CommModel.ROOTLESS_LAZY:
        # each rank reads lazy_keys_read(N) keys and its own key is read by as many ranks, each
        # read two requests (gloo's wait, then its get: benchmarks/results/rendezvous_lazy.json),
        # at the measured per-request cost of the full mesh's owner and reader; the barrier's
        # rounds are sequential: a read and a connect, 3 round trips each
        rounds = math.ceil(math.log2(gpus)) if gpus > 1 else 0
        reads = 2 * lazy_keys_read(gpus)
        return fixed_s + cal.rootless_per_rank_s * reads + 3 * cal.rootless_rtt_s * rounds
    return fixed_s


def save_cost_s(shape: JobShape, cal: Calibration) -> float:
    """Blocking time of one save: one copy of the state through the store's write bandwidth."""
    return cal.save_s + shape.checkpoint_gb / cal.storage_write_gbps


def load_cost_s(shape: JobShape, cal: Calibration) -> float:
    """Time to read one copy of the state back from the checkpoint store."""
    return cal.load_s + shape.checkpoint_gb / cal.storage_read_gbps


def transfer_cost_s(shape: JobShape, cal: Calibration) -> float:
    """Peer transfer to the replaced GPUs; each one pulls its own shard over its own link.

    Replaced GPUs receive in parallel from distinct healthy twins, so the time is one GPU's state
    over one GPU's bandwidth whatever the number of replaced GPUs.
    """
    return cal.transfer_s + shape.state_gb_per_gpu / cal.peer_gbps


def detect_s(cause: FailureCause, cal: Calibration) -> float:
    return cal.hang_timeout_s if cause.detection is Detection.HANG else cal.detect_s


def step_wall_s(policy: Policy, shape: JobShape, cal: Calibration) -> float:
    """Wall time of one step; checkpointless pays a small bookkeeping cost on every step."""
    extra = cal.step_overhead_s if policy is Policy.CHECKPOINTLESS else 0.0
    return shape.step_s + extra


# ----------------------------------------------------------------------------------------------
# Recovery plans
# ----------------------------------------------------------------------------------------------
def restart_phases(
    shape: JobShape, cal: Calibration, spare_wait_s: float, model: CommModel | None = None
) -> list[Phase]:
    """A full job restart from the last checkpoint, after the fault has been detected.

    Waiting for replacement nodes overlaps with requeueing the job, so the longer of the two
    counts. ``model``: how the restarted job forms its communicator (default ``cal.init_model``,
    checkpoint-restart's; a checkpointless job's own launcher restarts with ``cal.restart_model``).
    """
    init = cal.init_model if model is None else model
    return [
        Phase(Bucket.INFRA_RECOVERY, "requeue / wait for nodes", max(cal.requeue_s, spare_wait_s)),
        Phase(Bucket.PROGRAM_STARTUP, "process start", cal.restart_s),
        Phase(Bucket.INITIALISATION, "communicator init", comm_start_s(init, cal.init_s, shape.gpus, cal)),
        Phase(Bucket.CHECKPOINT_RESTORE, "checkpoint load", load_cost_s(shape, cal)),
        Phase(Bucket.DATA_LOADING, "data loader cold start", cal.restart_data_s),
        Phase(Bucket.PROGRAM_STARTUP, "first step after restart", cal.restart_first_step_s),
    ]


def inprocess_phases(shape: JobShape, cal: Calibration, spare_wait_s: float, lost_state: bool) -> list[Phase]:
    """Checkpointless recovery after detection and abort: swap, rebuild, receive, re-run.

    ``lost_state`` is False for job-wide software faults: every rank still holds its state, so
    nothing is swapped or transferred.
    """
    phases: list[Phase] = []
    if lost_state:
        phases.append(Phase(Bucket.INFRA_RECOVERY, "wait for a spare node", spare_wait_s))
        phases.append(Phase(Bucket.INFRA_RECOVERY, "spare swap", cal.swap_s))
    rebuild = comm_start_s(cal.rebuild_model, cal.rebuild_s, shape.gpus, cal)
    phases.append(Phase(Bucket.INITIALISATION, "communicator rebuild", rebuild))
    if lost_state:
        phases.append(Phase(Bucket.CHECKPOINT_RESTORE, "peer state transfer", transfer_cost_s(shape, cal)))
    phases.append(Phase(Bucket.DATA_LOADING, "data resume", cal.data_resume_s))
    phases.append(Phase(Bucket.PROGRAM_STARTUP, "first step after recovery", cal.first_step_s))
    return phases


def recovery_plan(
    policy: Policy,
    cause: FailureCause,
    shape: JobShape,
    cal: Calibration,
    *,
    fallback: bool,
    lost_state: bool,
    spare_wait_s: float,
    gave_up_after_s: float = 0.0,
    shrink: bool = False,
) -> list[Phase]:
    """Every phase from the fault to the first productive step (lost work is charged apart).

    ``fallback`` (checkpointless only) means the state cannot come from a peer, or the in-process
    retries of a recurring bug will fail and the job stops (``AfterRetries.STOP``, the launcher with ``--fresh-process-retries 0``), or no host came within the no-spare policy's wait (``gave_up_after_s``), so
    the job restarts from its own (less frequent) checkpoint. ``shrink``: no spare host took the
    lost place, and the job goes on with fewer replicas (after waiting ``spare_wait_s`` for one,
    under ``--when-no-spare wait``).
    """
    detect = Phase(Bucket.INFRA_RECOVERY, "detect", detect_s(cause, cal))
    if policy is Policy.CHECKPOINT_RESTART:
        return [detect, *restart_phases(shape, cal, spare_wait_s)]
    abort = Phase(Bucket.INFRA_RECOVERY, "abort", cal.abort_s)
    if not fallback:
        if shrink:
            return [detect, *shrink_phases(shape, cal, spare_wait_s)]
        if cause.recurring:
            # only under AfterRetries.RESPAWN (a what-if, not built): after its retries the
            # raising ranks start again as fresh spares, which must receive the step's state
            respawn = inprocess_phases(shape, cal, spare_wait_s, lost_state=True)
            return [detect, abort, *recurring_retries(shape, cal, cause), *respawn]
        return [detect, abort, *inprocess_phases(shape, cal, spare_wait_s, lost_state)]
    restart = restart_phases(shape, cal, spare_wait_s, cal.restart_model)
    if gave_up_after_s > 0:
        gave_up = Phase(Bucket.INFRA_RECOVERY, "wait for a spare host, then fail", gave_up_after_s)
        return [detect, abort, gave_up, *restart]
    if cause.recurring:
        return [detect, abort, *recurring_retries(shape, cal, cause), *restart]
    return [detect, abort, *restart]


def recurring_retries(shape: JobShape, cal: Calibration, cause: FailureCause) -> list[Phase]:
    """What a bug that fires again in the same processes costs before the job gives up on it.

    The job cannot know the bug will recur: the raising rank stays in its process (the
    coordinator replaces only a rank whose process is gone: rounds.py:on_stopped records an
    exception with ``replace=False``) and the step is retried in process ``cal.step_retries``
    times, each a round without a swap or a transfer (every rank's state is valid), the step
    failing again and being detected and aborted again. Then the job stops and is started again
    (the restart that follows), as tests/e2e/test_launcher.py's recurring exception shows.
    """
    one = [
        *inprocess_phases(shape, cal, 0.0, lost_state=False),
        Phase(Bucket.WASTED_PROGRESS, "re-run step that fails again", step_wall_s(Policy.CHECKPOINTLESS, shape, cal)),
        Phase(Bucket.INFRA_RECOVERY, "detect again", detect_s(cause, cal)),
        Phase(Bucket.INFRA_RECOVERY, "abort", cal.abort_s),
    ]  # fmt: skip
    return one * cal.step_retries


def shrink_phases(shape: JobShape, cal: Calibration, waited_s: float = 0.0) -> list[Phase]:
    """After detection: go on with fewer replicas. One recovery round: abort, swap the spares that
    are there (survivors of a dropped replica stand in for the others), rebuild, re-plan the
    micro-batches, first step; or the measured ``shrink_s``. ``waited_s``: the wait for a spare
    host that came first (``--when-no-spare wait``)."""
    waited = (
        [Phase(Bucket.INFRA_RECOVERY, "wait for a spare host, then shrink", waited_s)] if waited_s > 0 else []
    )
    if cal.shrink_s is not None:
        return [*waited, Phase(Bucket.INFRA_RECOVERY, "shrink (measured)", cal.shrink_s)]
    abort = Phase(Bucket.INFRA_RECOVERY, "abort", cal.abort_s)
    return [abort, *waited, *inprocess_phases(shape, cal, 0.0, lost_state=True)]


def grow_phases(shape: JobShape, cal: Calibration) -> list[Phase]:
    """Hosts join at a step boundary: one recovery round without a fault (nothing to detect or
    abort): rebuild, state to the new hosts, data, first step; or the measured ``grow_s``."""
    if cal.grow_s is not None:
        return [Phase(Bucket.INITIALISATION, "grow (measured)", cal.grow_s)]
    return [
        Phase(Bucket.INITIALISATION, "communicator rebuild (grow)", comm_start_s(cal.rebuild_model, cal.rebuild_s, shape.gpus, cal)),
        Phase(Bucket.CHECKPOINT_RESTORE, "state to the new hosts", transfer_cost_s(shape, cal)),
        Phase(Bucket.DATA_LOADING, "data resume", cal.data_resume_s),
        Phase(Bucket.PROGRAM_STARTUP, "first step at full width", cal.first_step_s),
    ]  # fmt: skip
