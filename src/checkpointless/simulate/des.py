"""Discrete-event simulation of one training job under one recovery policy.

The job alternates between running (steps, with a blocking save every checkpoint interval) and
recovering (a list of phases from ``models.recovery_plan``). Events are the faults of a sampled
trace, the ends of recovery phases and saves, and nodes returning to the spare pool. Every second
of wall time is charged to exactly one bucket, so the buckets always add up to the wall time;
work that is later thrown away is moved from the productive bucket to ``wasted_progress`` at the
moment it is lost.

Timing effects that the closed-form estimate ignores and this simulation keeps:
- a fault during a recovery starts a new recovery (what was spent so far stays spent);
- a fault during a save voids that save;
- a second fault that hits the other copy of a shard still waiting for its state turns an
  in-process recovery into a fallback;
- the spare pool can run dry, and then the no-spare policy applies: the job waits for a repaired
  node, fails to its checkpoint, or goes on with fewer replicas and grows back at a step boundary
  when hosts return (``capacity.py``);
- a badly repaired host that nothing checks fails again once it trains.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from checkpointless.errors import ConfigError
from checkpointless.simulate.calibration import Calibration
from checkpointless.simulate.capacity import (
    AfterRetries,
    CapacityPolicy,
    Fleet,
    Host,
    SparePool,
    WidthAction,
    dropped_replicas,
    fill_count,
    hosts_to_keep,
    no_spare_action,
    replicas_at_work,
    slowdown,
)
from checkpointless.simulate.failures import FailureModel, Fault
from checkpointless.simulate.models import IntervalRule, policy_interval
from checkpointless.simulate.plans import (
    Bucket,
    Phase,
    Policy,
    grow_phases,
    recovery_plan,
    save_cost_s,
    step_wall_s,
)
from checkpointless.simulate.topology import JobShape, spans_all_replicas

__all__ = ["RunResult", "SimConfig", "SparePool", "simulate_run"]

_EPS = 1e-9


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulated run depends on except the policy and the fault trace."""

    shape: JobShape = field(default_factory=JobShape)
    failures: FailureModel = field(default_factory=FailureModel)
    cal: Calibration = field(default_factory=Calibration)
    days: float = 30.0
    interval_rule: IntervalRule = IntervalRule.YOUNG
    max_interval_s: float = 86400.0  # save at least daily even when nothing needs it
    # the no-spare policy and host admission; checkpoint-restart always waits for its hosts
    capacity: CapacityPolicy = field(default_factory=CapacityPolicy)

    def __post_init__(self) -> None:
        if not math.isfinite(self.days) or self.days <= 0:
            raise ConfigError(f"days={self.days} must be a finite number > 0; e.g. 30")
        if not self.max_interval_s > 0:
            raise ConfigError(f"max_interval_s={self.max_interval_s} must be > 0")

    @property
    def horizon_s(self) -> float:
        return self.days * 86400.0


@dataclass(frozen=True)
class RunResult:
    """Outcome of one run: seconds per bucket and counts of what happened."""

    policy: Policy
    gpus: int
    wall_s: float
    seconds: dict[Bucket, float]
    interval_s: float
    faults: int
    fallbacks: int
    spare_waits: int
    saves: int
    shrinks: int = 0  # times the job went on with fewer replicas
    grows: int = 0  # times it grew back
    quarantined: int = 0  # repaired hosts the health check turned back
    bad_hosts_promoted: int = 0  # badly repaired hosts that trained (and failed again)
    min_replicas_seen: float = math.nan  # fewest data-parallel replicas at work

    @property
    def goodput(self) -> float:
        return self.seconds[Bucket.PRODUCTIVE] / self.wall_s


class _Placement(NamedTuple):
    """How the lost hosts of one fault were replaced."""

    wait_s: float = 0.0  # waited for repaired hosts (before the in-process recovery or restart)
    gave_up_after_s: float = 0.0  # waited this long for a spare host, then failed
    failed: bool = False  # the no-spare policy failed the job: restart from the checkpoint
    shrank: bool = False  # the job goes on with fewer replicas


class _Run:
    """Mutable state of one run; ``simulate_run`` is the public entry point."""

    def __init__(self, cfg: SimConfig, policy: Policy) -> None:
        self.cfg, self.policy = cfg, policy
        shape, cal = cfg.shape, cfg.cal
        # checkpoint-restart has no degraded mode or health check: it waits for its hosts
        self.cap = cfg.capacity if policy is Policy.CHECKPOINTLESS else CapacityPolicy()
        self.step = step_wall_s(policy, shape, cal)
        self.overhead = 1.0 - shape.step_s / self.step  # share of running time that is bookkeeping
        self.interval = policy_interval(
            policy, cfg.interval_rule, cfg.failures, shape, cal, cfg.max_interval_s, self.cap
        )
        self.save_cost = save_cost_s(shape, cal)
        self.ledger = dict.fromkeys(Bucket, 0.0)
        self.t = 0.0
        self.uncommitted = 0.0  # running time since the last completed save
        self.at_risk = dict.fromkeys(Bucket, 0.0)  # how that running time was charged
        self.save_done = 0.0  # blocking save time spent on the save under way
        self.step_phase = 0.0  # running time into the current step
        self.pending: set[int] = set()  # nodes whose state has not been restored yet
        self.restarting = False  # a full restart is under way (no processes to recover in)
        self.fleet = Fleet(
            shape.spares, shape.replace_s, cfg.failures.bad_repair_fraction, self.cap.health_check
        )
        self.holes = 0  # job positions without a host (degraded mode)
        # when the hosts the job has taken from repairs are there: a fault during that wait
        # starts a new plan, which still waits for them
        self.hosts_at = 0.0
        self.factor = 1.0  # step wall time over the full-width step time
        self.grow_at = math.inf  # step boundary at which hosts that returned join
        self.promoted_bad: list[tuple[int, float]] = []  # (position, repair draw) of bad hosts
        self.again: list[tuple[float, int, Fault]] = []  # faults of bad hosts, a heap
        self.seq = itertools.count()
        self.faults = self.fallbacks = self.spare_waits = self.saves = 0
        self.shrinks = self.grows = self.bad_promoted = 0
        self.min_width = shape.dp_width

    # -- running -------------------------------------------------------------------------------
    def _compute(self, d: float) -> None:
        useful = d / self.factor
        parts = {
            Bucket.PRODUCTIVE: useful * (1.0 - self.overhead),
            Bucket.OTHER: useful * self.overhead,
            Bucket.DEGRADED: d - useful,
        }
        for bucket, v in parts.items():
            self.ledger[bucket] += v
            self.at_risk[bucket] += v
        self.uncommitted += d
        self.step_phase = (self.step_phase + d) % (self.step * self.factor)
        self.t += d

    def _lose_all(self) -> None:
        """Everything since the last completed save is thrown away (a rollback)."""
        for bucket, v in self.at_risk.items():
            self.ledger[bucket] -= v
            self.ledger[Bucket.WASTED_PROGRESS] += v
        self.at_risk = dict.fromkeys(Bucket, 0.0)
        self.uncommitted = 0.0

    def _lose_step(self) -> None:
        """The interrupted step is thrown away; it ran at the current width throughout."""
        d = self.step_phase
        useful = d / self.factor
        parts = {
            Bucket.PRODUCTIVE: useful * (1.0 - self.overhead),
            Bucket.OTHER: useful * self.overhead,
            Bucket.DEGRADED: d - useful,
        }
        for bucket, v in parts.items():
            self.ledger[bucket] -= v
            self.at_risk[bucket] -= v
            self.ledger[Bucket.WASTED_PROGRESS] += v
        self.uncommitted -= d

    def run_until(self, stop: float) -> None:
        while self.t < stop:
            if self.interval - self.uncommitted <= _EPS:
                d = min(self.save_cost - self.save_done, stop - self.t)
                self.ledger[Bucket.CHECKPOINT_SAVE] += d
                self.t += d
                self.save_done += d
                if self.save_done < self.save_cost - _EPS:
                    return  # paused by an event; a fault voids it
                self.uncommitted = self.save_done = 0.0
                self.at_risk = dict.fromkeys(Bucket, 0.0)
                self.saves += 1
                continue
            self._compute(min(self.interval - self.uncommitted, stop - self.t))

    # -- hosts -----------------------------------------------------------------------------------
    def _promote(self, hosts: list[Host], positions: Sequence[int]) -> None:
        """Hosts take job positions; a badly repaired one will fail there once it trains."""
        for k, host in enumerate(hosts):
            if host.bad:
                pos = positions[k % len(positions)] if positions else 0
                self.promoted_bad.append((pos, host.repair_u))
                self.bad_promoted += 1

    def _set_holes(self, holes: int) -> None:
        self.holes = holes
        self.factor = slowdown(self.cfg.shape, holes, self.cap.design, self.cfg.cal.extra_pass_ratio)
        self.min_width = min(self.min_width, replicas_at_work(self.cfg.shape, holes))

    def _place(self, nodes: tuple[int, ...]) -> _Placement:
        """Find hosts for the lost ``nodes`` under the no-spare policy (``no_spare_action``)."""
        shape, cap, fleet, g = self.cfg.shape, self.cap, self.fleet, self.cfg.shape.dp_group_nodes
        holes = self.holes + len(nodes)
        before = replicas_at_work(shape, self.holes)
        # hosts that keep every replica at work that was at work (the survivors of a replica
        # already dropped stand in for the rest), and hosts that keep --min-replicas at work
        need = max(0, holes - g * dropped_replicas(self.holes, g))
        floor = hosts_to_keep(shape.dp_width, holes, g, cap.min_replicas)
        ready = fleet.available(self.t)
        action, waited = no_spare_action(
            cap,
            wait_to_cover_s=fleet.ready_at(self.t, need) - self.t,
            wait_to_shrink_s=math.inf if floor is None else fleet.ready_at(self.t, floor) - self.t,
        )
        if action is WidthAction.ASSIGN:
            # the ready spares that bring back the most replicas, or the hosts waited for
            hosts, wait = fleet.take(self.t, max(need, fill_count(holes, ready, g)))
            self._promote(hosts, nodes)
            self._set_holes(holes - len(hosts))
            return _Placement(wait_s=wait)
        if action is WidthAction.SHRINK:
            hosts, _ = fleet.take(self.t, fill_count(holes, fleet.ready_by(self.t, self.t + waited), g))
            self._promote(hosts, nodes)
            self._set_holes(holes - len(hosts))
            return _Placement(wait_s=waited, shrank=replicas_at_work(shape, self.holes) < before)
        # fail: the restart waits for every missing host
        hosts, wait = fleet.take(self.t, holes)
        self._promote(hosts, nodes)
        self._set_holes(0)
        return _Placement(max(0.0, wait - waited), waited, failed=True)

    # -- faults --------------------------------------------------------------------------------
    def on_fault(self, fault: Fault) -> list[Phase]:
        cfg = self.cfg
        cause = cfg.failures.causes[fault.cause]
        self.faults += 1
        self.grow_at = math.inf  # re-planned once this recovery is over
        self.save_done = 0.0  # a save under way is void
        self.fleet.send_to_repair(self.t, len(fault.nodes), fault.repair_u)
        place = self._place(fault.nodes) if fault.nodes else _Placement()
        waited_for = place.wait_s + place.gave_up_after_s if not place.shrank else 0.0
        wait = max(place.wait_s, self.hosts_at - self.t - place.gave_up_after_s)
        self.hosts_at = max(self.hosts_at, self.t + waited_for)
        if wait > 0:
            self.spare_waits += 1
        lost = self.pending | set(fault.nodes)
        if self.policy is Policy.CHECKPOINT_RESTART:
            fallback = True
        else:
            stops = cause.recurring and cfg.capacity.after_retries is AfterRetries.STOP
            fallback = self.restarting or stops or place.failed or spans_all_replicas(lost, cfg.shape)
            self.fallbacks += fallback
        shrank = place.shrank and not fallback
        self.shrinks += shrank
        if fallback:
            self._lose_all()
            self.pending = set()
            self.restarting = True
        else:
            self._lose_step()
            self.pending = lost
        self.step_phase = 0.0
        return recovery_plan(
            self.policy,
            cause,
            cfg.shape,
            cfg.cal,
            fallback=fallback,
            lost_state=bool(lost),
            spare_wait_s=wait,
            gave_up_after_s=place.gave_up_after_s,
            shrink=shrank,
        )

    def recovered(self) -> None:
        self.pending = set()
        self.restarting = False
        # a badly repaired host fails in its first step of training
        when = self.t + 0.5 * self.step * self.factor
        cause = self.cfg.failures.host_fault_cause()
        for pos, u in self.promoted_bad:
            heapq.heappush(self.again, (when, next(self.seq), Fault(when, cause, (pos,), u)))
        self.promoted_bad = []

    # -- growing back ------------------------------------------------------------------------------
    def next_wake(self) -> float:
        """When the job should look at returned hosts: only while it is short of hosts."""
        if self.holes == 0:
            return math.inf
        return min(self.grow_at, self.fleet.next_return_s())

    def on_wake(self) -> list[Phase]:
        g = self.cfg.shape.dp_group_nodes
        fill = fill_count(self.holes, self.fleet.available(self.t), g)
        if fill == 0:
            self.grow_at = math.inf
            return []
        if self.grow_at == math.inf:  # hosts are there: join at the end of the current step
            self.grow_at = self.t + (self.step * self.factor - self.step_phase)
            if self.grow_at > self.t + _EPS:
                return []
        self.grow_at = math.inf
        self._promote(self.fleet.take_ready(self.t, fill), ())
        self._set_holes(self.holes - fill)
        self.grows += 1
        self.step_phase = 0.0
        return grow_phases(self.cfg.shape, self.cfg.cal)

    # -- main loop -----------------------------------------------------------------------------
    def execute(self, faults: Sequence[Fault]) -> RunResult:
        horizon = self.cfg.horizon_s
        phases: deque[Phase] = deque()
        i = 0
        while self.t < horizon:
            trace_t = faults[i].time_s if i < len(faults) else math.inf
            again_t = self.again[0][0] if self.again else math.inf
            fault_t = max(min(trace_t, again_t), self.t)
            wake_t = max(self.next_wake(), self.t) if not phases else math.inf
            stop = min(fault_t, wake_t, horizon)
            if phases:
                bucket, label, left = phases[0]
                if self.t + left <= stop:
                    self.ledger[bucket] += left
                    self.t += left
                    phases.popleft()
                    if not phases:
                        self.recovered()
                    continue
                self.ledger[bucket] += stop - self.t
                phases[0] = Phase(bucket, label, left - (stop - self.t))
                self.t = stop
            else:
                self.run_until(stop)
            if self.t >= horizon:
                break
            if self.t >= fault_t:  # a running job or a recovery is interrupted by a fault
                if trace_t <= again_t:
                    fault = faults[i]
                    i += 1
                else:
                    fault = heapq.heappop(self.again)[2]
                phases = deque(self.on_fault(fault))
            elif self.t >= wake_t:
                phases = deque(self.on_wake())
        return RunResult(
            policy=self.policy,
            gpus=self.cfg.shape.gpus,
            wall_s=self.t,
            seconds=self.ledger,
            interval_s=self.interval,
            faults=self.faults,
            fallbacks=self.fallbacks,
            spare_waits=self.spare_waits,
            saves=self.saves,
            shrinks=self.shrinks,
            grows=self.grows,
            quarantined=self.fleet.quarantined,
            bad_hosts_promoted=self.bad_promoted,
            min_replicas_seen=self.min_width,
        )


def simulate_run(cfg: SimConfig, policy: Policy, faults: Sequence[Fault]) -> RunResult:
    """Simulate ``cfg`` under ``policy`` through the fault trace ``faults`` (sorted by time)."""
    if any(b.time_s < a.time_s for a, b in itertools.pairwise(faults)):
        raise ConfigError("faults must be sorted by time; use sample_faults() to make a trace")
    return _Run(cfg, policy).execute(faults)
