"""Pure cost models: checkpoint intervals and first-order (closed-form) goodput.

Nothing here holds state or draws random numbers, so each formula can be tested on its own and
the event simulation (``des.py``) and the closed-form estimate below use the very same recovery
plans (``plans.py``, whose names this module re-exports): when they disagree, the difference is
the timing effects only the simulation captures (faults during a recovery, spare pool
exhaustion, interrupted saves, time spent degraded beyond one repair).
"""

from __future__ import annotations

import math
from enum import Enum

from checkpointless.errors import ConfigError
from checkpointless.simulate.calibration import Calibration
from checkpointless.simulate.capacity import (
    AfterRetries,
    CapacityPolicy,
    WidthAction,
    extra_faults_per_host_loss,
    fill_count,
    hosts_to_keep,
    no_spare_action,
    slowdown,
)
from checkpointless.simulate.failures import Blast, FailureCause, FailureModel
from checkpointless.simulate.plans import (
    BADPUT_BUCKETS,
    Bucket,
    Phase,
    Policy,
    comm_start_s,
    detect_s,
    grow_phases,
    inprocess_phases,
    load_cost_s,
    recovery_plan,
    restart_phases,
    save_cost_s,
    shrink_phases,
    step_wall_s,
    transfer_cost_s,
)
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
    "grow_phases",
    "inprocess_phases",
    "load_cost_s",
    "policy_interval",
    "recovery_plan",
    "restart_phases",
    "save_cost_s",
    "shrink_phases",
    "step_wall_s",
    "transfer_cost_s",
    "young_interval",
]


class IntervalRule(str, Enum):
    YOUNG = "young"
    DALY = "daly"


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
    capacity: CapacityPolicy | None = None,
) -> float:
    """Checkpoint interval of a policy: optimal against the faults that need the checkpoint.

    Checkpoint-restart rolls back on every fault. Checkpointless rolls back only on a fallback,
    so its checkpoints protect against a much longer MTBF and are taken far less often; with no
    fallback cause at all it still saves every ``max_s`` (a job keeps some checkpoint anyway).
    """
    mtbf = failures.job_mtbf_s(shape.gpus)
    if policy is Policy.CHECKPOINTLESS:
        p_fb = fallback_probability(failures, shape, capacity)
        mtbf = mtbf / p_fb if p_fb > 0 else math.inf
    save = save_cost_s(shape, cal)
    step = step_wall_s(policy, shape, cal)
    if math.isinf(mtbf):
        return max(1, round(max_s / step)) * step
    return checkpoint_interval(rule, save, mtbf, step, max_s)


# ----------------------------------------------------------------------------------------------
# Closed-form estimate
# ----------------------------------------------------------------------------------------------
def _nodes_needed(cause: FailureCause, shape: JobShape) -> int:
    if cause.blast is Blast.JOB:
        return 0
    if cause.blast is Blast.SWITCH:
        return min(shape.switch_nodes, shape.nodes)
    return 1


# a hole the full pool cannot fill: waiting for its repair, going on degraded, or a restart
_MODE = {WidthAction.ASSIGN: "wait", WidthAction.SHRINK: "shrink", WidthAction.FAIL: "fail"}


def _no_spare(cause: FailureCause, shape: JobShape, capacity: CapacityPolicy | None) -> tuple[str, float]:
    """With a full pool, what a checkpointless job does about this cause's lost hosts, and the
    wait before it: "swap" (enough spares), "wait" (for a repair), "fail" (restart) or "shrink"."""
    needed = _nodes_needed(cause, shape)
    if needed <= shape.spares:
        return "swap", 0.0
    cap = capacity if capacity is not None else CapacityPolicy()
    floor = hosts_to_keep(shape.dp_width, needed, shape.dp_group_nodes, cap.min_replicas)
    # the spares there now keep --min-replicas at work, or the repairs bring them in one repair time
    shrink = math.inf if floor is None else (0.0 if floor <= shape.spares else shape.replace_s)
    action, waited = no_spare_action(cap, wait_to_cover_s=shape.replace_s, wait_to_shrink_s=shrink)
    return _MODE[action], waited


def _cause_fallback_probability(
    cause: FailureCause, shape: JobShape, capacity: CapacityPolicy | None = None
) -> float:
    if cause.blast is Blast.JOB:
        stops = (capacity or CapacityPolicy()).after_retries is AfterRetries.STOP
        return 1.0 if cause.recurring and stops else 0.0
    if _no_spare(cause, shape, capacity)[0] == "fail":
        return 1.0
    if cause.blast is Blast.SWITCH:
        return switch_fallback_fraction(shape)
    # One node holds one copy; only a job without a second copy loses the state.
    return 1.0 if shape.replicas == 1 else 0.0


def expected_spare_wait_s(cause: FailureCause, shape: JobShape) -> float:
    """First-order wait for nodes: none if the (full) pool covers the fault, else one repair time."""
    return shape.replace_s if _nodes_needed(cause, shape) > shape.spares else 0.0


def fallback_probability(
    failures: FailureModel, shape: JobShape, capacity: CapacityPolicy | None = None
) -> float:
    """Share of faults after which checkpointless needs its checkpoint (single faults only)."""
    return sum(
        share * _cause_fallback_probability(c, shape, capacity)
        for share, c in zip(failures.shares(), failures.causes, strict=True)
    )


def _cause_loss(
    policy: Policy,
    cause: FailureCause,
    shape: JobShape,
    cal: Calibration,
    interval_s: float,
    capacity: CapacityPolicy | None,
) -> float:
    """Mean wall time one fault of ``cause`` costs, with a full spare pool when it comes."""
    step = step_wall_s(policy, shape, cal)
    lost_state = cause.blast is not Blast.JOB
    cl = policy is Policy.CHECKPOINTLESS
    p_fb = _cause_fallback_probability(cause, shape, capacity) if cl else 1.0
    wait = expected_spare_wait_s(cause, shape)
    mode, waited = _no_spare(cause, shape, capacity) if cl else ("wait", 0.0)
    cost = 0.0
    if p_fb > 0:
        limit = min(wait, waited) if mode == "fail" else 0.0
        plan = recovery_plan(
            policy, cause, shape, cal, fallback=True, lost_state=lost_state,
            spare_wait_s=wait - limit, gave_up_after_s=limit,
        )  # fmt: skip
        cost += p_fb * (sum(p.seconds for p in plan) + interval_s / 2.0)
    if p_fb < 1:
        if mode == "shrink":
            # a round to shrink, the missing capacity until the repair, a round to grow back
            cap = capacity if capacity is not None else CapacityPolicy()
            needed = _nodes_needed(cause, shape)
            holes = needed - fill_count(needed, shape.spares, shape.dp_group_nodes)
            plan = [*recovery_plan(policy, cause, shape, cal, fallback=False, lost_state=True,
                                   spare_wait_s=waited, shrink=True), *grow_phases(shape, cal)]  # fmt: skip
            factor = slowdown(shape, holes, cap.design, cal.extra_pass_ratio)
            extra = max(0.0, shape.replace_s - waited) * (1.0 - 1.0 / factor)
        else:
            plan = recovery_plan(
                policy, cause, shape, cal, fallback=False, lost_state=lost_state, spare_wait_s=wait
            )
            extra = 0.0
        cost += (1.0 - p_fb) * (sum(p.seconds for p in plan) + extra + step / 2.0)
    return cost


def expected_loss_per_fault(
    policy: Policy,
    failures: FailureModel,
    shape: JobShape,
    cal: Calibration,
    interval_s: float,
    capacity: CapacityPolicy | None = None,
) -> float:
    """Mean wall time a single fault costs: its recovery plan plus the work it throws away.

    The fault lands uniformly in time, so a rollback to the last checkpoint loses on average half
    an interval, and an in-process recovery half a step. The spare pool is assumed full when
    the fault comes, so only a fault needing more nodes than the pool holds waits (one repair),
    or, under the no-spare policy, fails or shrinks. Without a health check each lost host also
    brings ``q / (1 - q)`` faults of a badly repaired host back (charged as one-GPU faults).
    """
    shares = failures.shares()
    total = sum(
        share * _cause_loss(policy, c, shape, cal, interval_s, capacity)
        for share, c in zip(shares, failures.causes, strict=True)
    )
    if capacity is None or not capacity.health_check:
        hosts_lost = sum(
            share * _nodes_needed(c, shape) for share, c in zip(shares, failures.causes, strict=True)
        )
        host_cause = failures.causes[failures.host_fault_cause()]
        again = extra_faults_per_host_loss(failures.bad_repair_fraction) * hosts_lost
        total += again * _cause_loss(policy, host_cause, shape, cal, interval_s, capacity)
    return total


def analytic_goodput(
    policy: Policy,
    failures: FailureModel,
    shape: JobShape,
    cal: Calibration,
    interval_s: float,
    capacity: CapacityPolicy | None = None,
) -> float:
    """First-order goodput: 1 - save share - fault share, times the per-step efficiency."""
    save = save_cost_s(shape, cal)
    mtbf = failures.job_mtbf_s(shape.gpus)
    loss = expected_loss_per_fault(policy, failures, shape, cal, interval_s, capacity)
    step = step_wall_s(policy, shape, cal)
    g = 1.0 - save / (interval_s + save) - loss / mtbf
    return max(0.0, g) * (shape.step_s / step)
