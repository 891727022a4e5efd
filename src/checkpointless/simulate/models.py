"""Pure cost models: checkpoint intervals, scaling laws, recovery plans and first-order goodput.

Nothing here holds state or draws random numbers, so each formula can be tested on its own and
the event simulation (``des.py``) and the closed-form estimate below use the very same recovery
plans: when they disagree, the difference is the timing effects only the simulation captures
(faults during a recovery, spare pool exhaustion, interrupted saves).
"""

from __future__ import annotations

import math
from enum import Enum
from typing import NamedTuple

from checkpointless.errors import ConfigError
from checkpointless.simulate.calibration import Calibration, CommModel
from checkpointless.simulate.failures import Blast, Detection, FailureCause, FailureModel
from checkpointless.simulate.topology import JobShape, switch_fallback_fraction

__all__ = [
    "BADPUT_BUCKETS",
    "Bucket",
    "IntervalRule",
    "Phase",
    "Policy",
    "analytic_goodput",
    "checkpoint_interval",
    "comm_start_s",
    "daly_interval",
    "detect_s",
    "expected_loss_per_fault",
    "expected_spare_wait_s",
    "fallback_probability",
    "inprocess_phases",
    "load_cost_s",
    "policy_interval",
    "recovery_plan",
    "restart_phases",
    "save_cost_s",
    "step_wall_s",
    "transfer_cost_s",
    "young_interval",
]


class Policy(str, Enum):
    CHECKPOINT_RESTART = "checkpoint-restart"
    CHECKPOINTLESS = "checkpointless"


class IntervalRule(str, Enum):
    YOUNG = "young"
    DALY = "daly"


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
    OTHER = "other"  # steady per-step cost of being recoverable


BADPUT_BUCKETS: tuple[Bucket, ...] = tuple(b for b in Bucket if b is not Bucket.PRODUCTIVE)


class Phase(NamedTuple):
    """One stretch of a recovery: which bucket it is charged to, what it is, how long."""

    bucket: Bucket
    label: str
    seconds: float


# ----------------------------------------------------------------------------------------------
# Checkpoint interval
# ----------------------------------------------------------------------------------------------
def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{name}={value} must be a finite number > 0")


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young (1974): compute time between checkpoints that minimises expected waste, sqrt(2CM)."""
    _check_positive(save_s=save_s, mtbf_s=mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order optimum; close to Young's when the save is short against the MTBF."""
    _check_positive(save_s=save_s, mtbf_s=mtbf_s)
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = save_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - save_s


def checkpoint_interval(
    rule: IntervalRule, save_s: float, mtbf_s: float, step_s: float, max_s: float = math.inf
) -> float:
    """The interval actually used: the rule's optimum, capped at ``max_s``, in whole steps.

    Saves happen between steps, so the interval is rounded to a whole number of steps (>= 1).
    """
    ideal = young_interval(save_s, mtbf_s) if rule is IntervalRule.YOUNG else daly_interval(save_s, mtbf_s)
    ideal = min(ideal, max_s)
    return max(1, round(ideal / step_s)) * step_s


def policy_interval(
    policy: Policy,
    rule: IntervalRule,
    failures: FailureModel,
    shape: JobShape,
    cal: Calibration,
    max_s: float,
) -> float:
    """Checkpoint interval of a policy: optimal against the faults that need the checkpoint.

    Checkpoint-restart rolls back on every fault. Checkpointless rolls back only on a fallback,
    so its checkpoints protect against a much longer MTBF and are taken far less often; with no
    fallback cause at all it still saves every ``max_s`` (a job keeps some checkpoint anyway).
    """
    mtbf = failures.job_mtbf_s(shape.gpus)
    if policy is Policy.CHECKPOINTLESS:
        p_fb = fallback_probability(failures, shape)
        mtbf = mtbf / p_fb if p_fb > 0 else math.inf
    save = save_cost_s(shape, cal)
    step = step_wall_s(policy, shape, cal)
    if math.isinf(mtbf):
        return max(1, round(max_s / step)) * step
    return checkpoint_interval(rule, save, mtbf, step, max_s)


# ----------------------------------------------------------------------------------------------
# Scaling models
# ----------------------------------------------------------------------------------------------
def comm_start_s(model: CommModel, fixed_s: float, gpus: int, cal: Calibration) -> float:
    """Time to form the communicator over ``gpus`` ranks under a scaling model."""
    if model is CommModel.STORE_LINEAR:
        return fixed_s + cal.store_per_rank_s * gpus
    if model is CommModel.ROOTLESS_LOG:
        return fixed_s + cal.rootless_log_s * math.log2(max(gpus, 2))
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
def restart_phases(shape: JobShape, cal: Calibration, spare_wait_s: float) -> list[Phase]:
    """A full job restart from the last checkpoint, after the fault has been detected.

    Waiting for replacement nodes overlaps with requeueing the job, so the longer of the two
    counts.
    """
    return [
        Phase(Bucket.INFRA_RECOVERY, "requeue / wait for nodes", max(cal.requeue_s, spare_wait_s)),
        Phase(Bucket.PROGRAM_STARTUP, "process start", cal.restart_s),
        Phase(
            Bucket.INITIALISATION,
            "communicator init",
            comm_start_s(cal.init_model, cal.init_s, shape.gpus, cal),
        ),
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
) -> list[Phase]:
    """Every phase from the fault to the first productive step (lost work is charged apart).

    ``fallback`` (checkpointless only) means the state cannot come from a peer, or the in-process
    retry will fail, so the job restarts from its own (less frequent) checkpoint.
    """
    detect = Phase(Bucket.INFRA_RECOVERY, "detect", detect_s(cause, cal))
    if policy is Policy.CHECKPOINT_RESTART:
        return [detect, *restart_phases(shape, cal, spare_wait_s)]
    abort = Phase(Bucket.INFRA_RECOVERY, "abort", cal.abort_s)
    if not fallback:
        return [detect, abort, *inprocess_phases(shape, cal, spare_wait_s, lost_state)]
    if cause.recurring:
        # The in-process retry is tried first (the job cannot know the bug will recur): it costs a
        # recovery plus one step that fails again, then a second detection.
        retry = inprocess_phases(shape, cal, 0.0, lost_state=False)
        failed = Phase(
            Bucket.WASTED_PROGRESS, "re-run step that fails again", step_wall_s(policy, shape, cal)
        )
        again = Phase(Bucket.INFRA_RECOVERY, "detect again", detect_s(cause, cal))
        return [detect, abort, *retry, failed, again, abort, *restart_phases(shape, cal, spare_wait_s)]
    return [detect, abort, *restart_phases(shape, cal, spare_wait_s)]


# ----------------------------------------------------------------------------------------------
# Closed-form estimate
# ----------------------------------------------------------------------------------------------
def _cause_fallback_probability(cause: FailureCause, shape: JobShape) -> float:
    if cause.blast is Blast.JOB:
        return 1.0 if cause.recurring else 0.0
    if cause.blast is Blast.SWITCH:
        return switch_fallback_fraction(shape)
    # One node holds one copy; only a job without a second copy loses the state.
    return 1.0 if shape.replicas == 1 else 0.0


def _nodes_needed(cause: FailureCause, shape: JobShape) -> int:
    if cause.blast is Blast.JOB:
        return 0
    if cause.blast is Blast.SWITCH:
        return min(shape.switch_nodes, shape.nodes)
    return 1


def expected_spare_wait_s(cause: FailureCause, shape: JobShape) -> float:
    """First-order wait for nodes: none if the (full) pool covers the fault, else one repair time."""
    return shape.replace_s if _nodes_needed(cause, shape) > shape.spares else 0.0


def fallback_probability(failures: FailureModel, shape: JobShape) -> float:
    """Share of faults after which checkpointless needs its checkpoint (single faults only)."""
    return sum(
        share * _cause_fallback_probability(c, shape)
        for share, c in zip(failures.shares(), failures.causes, strict=True)
    )


def expected_loss_per_fault(
    policy: Policy, failures: FailureModel, shape: JobShape, cal: Calibration, interval_s: float
) -> float:
    """Mean wall time a single fault costs: its recovery plan plus the work it throws away.

    The fault lands uniformly in time, so a rollback to the last checkpoint loses on average half
    an interval, and an in-process recovery half a step. The spare pool is assumed full when
    the fault comes, so only a fault needing more nodes than the pool holds waits (one repair).
    """
    step = step_wall_s(policy, shape, cal)
    total = 0.0
    for share, cause in zip(failures.shares(), failures.causes, strict=True):
        lost_state = cause.blast is not Blast.JOB
        p_fb = 1.0 if policy is Policy.CHECKPOINT_RESTART else _cause_fallback_probability(cause, shape)
        wait = expected_spare_wait_s(cause, shape)
        cost = 0.0
        if p_fb > 0:
            plan = recovery_plan(
                policy, cause, shape, cal, fallback=True, lost_state=lost_state, spare_wait_s=wait
            )
            cost += p_fb * (sum(p.seconds for p in plan) + interval_s / 2.0)
        if p_fb < 1:
            plan = recovery_plan(
                policy, cause, shape, cal, fallback=False, lost_state=lost_state, spare_wait_s=wait
            )
            cost += (1.0 - p_fb) * (sum(p.seconds for p in plan) + step / 2.0)
        total += share * cost
    return total


def analytic_goodput(
    policy: Policy, failures: FailureModel, shape: JobShape, cal: Calibration, interval_s: float
) -> float:
    """First-order goodput: 1 - save share - fault share, times the per-step efficiency."""
    save = save_cost_s(shape, cal)
    mtbf = failures.job_mtbf_s(shape.gpus)
    loss = expected_loss_per_fault(policy, failures, shape, cal, interval_s)
    step = step_wall_s(policy, shape, cal)
    g = 1.0 - save / (interval_s + save) - loss / mtbf
    return max(0.0, g) * (shape.step_s / step)
