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
- the spare pool can run dry, and then the job waits for a replaced node.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from checkpointless.errors import ConfigError
from checkpointless.simulate.calibration import Calibration
from checkpointless.simulate.failures import FailureModel, Fault
from checkpointless.simulate.models import (
    Bucket,
    IntervalRule,
    Phase,
    Policy,
    policy_interval,
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

    @property
    def goodput(self) -> float:
        return self.seconds[Bucket.PRODUCTIVE] / self.wall_s


class SparePool:
    """Hot spare nodes. Each node taken is replaced by a repaired one ``replace_s`` later."""

    def __init__(self, free: int, replace_s: float) -> None:
        self.free = free
        self.replace_s = replace_s
        self._arrivals: list[float] = []  # times at which a node joins the pool

    def take(self, now: float, count: int) -> float:
        """Take ``count`` nodes at ``now``; return how long the job waits for the last one."""
        while self._arrivals and self._arrivals[0] <= now:
            heapq.heappop(self._arrivals)
            self.free += 1
        # The failed nodes leave for repair now; each comes back as a healthy node later.
        for _ in range(count):
            heapq.heappush(self._arrivals, now + self.replace_s)
        if self.free >= count:
            self.free -= count
            return 0.0
        missing = count - self.free
        self.free = 0
        last = now
        for _ in range(missing):
            last = heapq.heappop(self._arrivals)
        return last - now


class _Run:
    """Mutable state of one run; ``simulate_run`` is the public entry point."""

    def __init__(self, cfg: SimConfig, policy: Policy) -> None:
        self.cfg, self.policy = cfg, policy
        shape, cal = cfg.shape, cfg.cal
        self.step = step_wall_s(policy, shape, cal)
        self.overhead = 1.0 - shape.step_s / self.step  # share of running time that is bookkeeping
        self.interval = policy_interval(
            policy, cfg.interval_rule, cfg.failures, shape, cal, cfg.max_interval_s
        )
        self.save_cost = save_cost_s(shape, cal)
        self.ledger = dict.fromkeys(Bucket, 0.0)
        self.t = 0.0
        self.uncommitted = 0.0  # running time since the last completed save
        self.step_phase = 0.0  # running time into the current step
        self.pending: set[int] = set()  # nodes whose state has not been restored yet
        self.restarting = False  # a full restart is under way (no processes to recover in)
        self.pool = SparePool(shape.spares, shape.replace_s)
        self.faults = self.fallbacks = self.spare_waits = self.saves = 0

    # -- running -------------------------------------------------------------------------------
    def _compute(self, d: float) -> None:
        self.ledger[Bucket.PRODUCTIVE] += d * (1.0 - self.overhead)
        self.ledger[Bucket.OTHER] += d * self.overhead
        self.uncommitted += d
        self.step_phase = (self.step_phase + d) % self.step
        self.t += d

    def _lose(self, d: float) -> None:
        """Work already charged as productive turns out to be wasted."""
        self.ledger[Bucket.PRODUCTIVE] -= d * (1.0 - self.overhead)
        self.ledger[Bucket.OTHER] -= d * self.overhead
        self.ledger[Bucket.WASTED_PROGRESS] += d

    def run_until(self, stop: float) -> None:
        while self.t < stop:
            if self.interval - self.uncommitted <= _EPS:
                d = min(self.save_cost, stop - self.t)
                self.ledger[Bucket.CHECKPOINT_SAVE] += d
                self.t += d
                if d < self.save_cost:
                    return  # cut short by a fault (which voids it) or by the end of the run
                self.uncommitted = 0.0
                self.saves += 1
                continue
            self._compute(min(self.interval - self.uncommitted, stop - self.t))

    # -- faults --------------------------------------------------------------------------------
    def on_fault(self, fault: Fault) -> list[Phase]:
        cfg = self.cfg
        cause = cfg.failures.causes[fault.cause]
        self.faults += 1
        wait = self.pool.take(self.t, len(fault.nodes))
        if wait > 0:
            self.spare_waits += 1
        lost = self.pending | set(fault.nodes)
        if self.policy is Policy.CHECKPOINT_RESTART:
            fallback = True
        else:
            fallback = self.restarting or cause.recurring or spans_all_replicas(lost, cfg.shape)
            self.fallbacks += fallback
        if fallback:
            self._lose(self.uncommitted)
            self.uncommitted = 0.0
            self.pending = set()
            self.restarting = True
        else:
            self._lose(self.step_phase)
            self.uncommitted -= self.step_phase
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
        )

    def recovered(self) -> None:
        self.pending = set()
        self.restarting = False

    # -- main loop -----------------------------------------------------------------------------
    def execute(self, faults: Sequence[Fault]) -> RunResult:
        horizon = self.cfg.horizon_s
        phases: deque[Phase] = deque()
        i = 0
        while self.t < horizon:
            next_fault = faults[i].time_s if i < len(faults) else math.inf
            stop = min(next_fault, horizon)
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
            # A fault is due now (a running job or a recovery is interrupted by it).
            phases = deque(self.on_fault(faults[i]))
            i += 1
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
        )


def simulate_run(cfg: SimConfig, policy: Policy, faults: Sequence[Fault]) -> RunResult:
    """Simulate ``cfg`` under ``policy`` through the fault trace ``faults`` (sorted by time)."""
    if any(b.time_s < a.time_s for a, b in itertools.pairwise(faults)):
        raise ConfigError("faults must be sorted by time; use sample_faults() to make a trace")
    return _Run(cfg, policy).execute(faults)
