"""Capacity: spare hosts, their repair and health check, and running with fewer replicas.

What a job does when a host is lost and no spare host is ready (``NoSparePolicy``, the same rule
as the launcher's ``--when-no-spare``, ``coordinator/rules/width.py``):

- ``shrink`` (degraded mode): the job goes on at once with fewer data-parallel replicas. The
  global batch stays the same: the survivors also train the missing replicas' micro-batches, so
  a step takes longer (:func:`step_factor`). When hosts return, it grows back at a step boundary.
- ``wait`` (the launcher's default): wait up to ``spare_wait_s`` for a host; if none comes, shrink.
- ``fail``: wait up to ``spare_wait_s``; if none comes, the job fails and restarts from its last
  checkpoint (the restart also waits for hosts). This is the launcher before issue 39.

Below ``min_replicas`` (or with a single replica) no policy shrinks: the job waits up to
``spare_wait_s`` and then fails, as the launcher does.

Counting model (a simplification, stated in docs/goodput.md): the job has ``holes`` positions
without a host. The hosts of a dropped replica that still live become spares for the others, so
a job with ``h`` holes drops ``ceil(h / nodes per replica)`` replicas, not one per hole.

Repairs: a host sent away comes back ``replace_s`` later. A share ``q`` of repairs comes back still
faulty (``FailureModel.bad_repair_fraction``). With a health check such a host is quarantined at
once and sent back; without one it is promoted and fails again as soon as it trains.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from enum import Enum

from checkpointless.errors import ConfigError
from checkpointless.simulate.topology import JobShape

__all__ = [
    "AfterRetries",
    "CapacityPolicy",
    "DegradedDesign",
    "Fleet",
    "Host",
    "NoSparePolicy",
    "SparePool",
    "WidthAction",
    "dropped_replicas",
    "extra_faults_per_host_loss",
    "fill_count",
    "hosts_to_keep",
    "no_spare_action",
    "replicas_at_work",
    "slowdown",
    "step_factor",
]


class NoSparePolicy(str, Enum):
    """What a job does when a host is lost and no spare host is ready (``--when-no-spare``)."""

    SHRINK = "shrink"  # go on at once with fewer replicas
    WAIT = "wait"  # wait up to spare_wait_s for a host, then shrink
    FAIL = "fail"  # wait up to spare_wait_s for a host, then fail to the checkpoint


class DegradedDesign(str, Enum):
    """How the survivors train a dropped replica's micro-batches (what sets the degraded step).

    ``bitwise`` is this repository's design (docs/fault-model.md, "Degraded mode"): a survivor
    holds the lost slot whole and trains its micro-batch as an extra accumulation pass, each
    slot's gradient reduced on its own so that the weights stay bitwise the fault-free run's; the
    most loaded holder sets the step. ``split`` is the issue's ideal, full width / remaining
    width: the lost micro-batches spread over every survivor (not bitwise; not built).
    """

    BITWISE = "bitwise"
    SPLIT = "split"


class AfterRetries(str, Enum):
    """What a job does once a step that keeps raising has used its in-process retries.

    ``respawn`` is the launcher as built (``--fresh-process-retries``, coordinator/rules/respawn.py):
    the raising ranks are started again as fresh spare processes that take the state of the step
    from a copy held outside them (a peer replica, a snapshot), and the job goes on without a
    restart. Its limit counts within ``--fault-window`` steps, which the modelled fault rates never
    reach. The model takes a recurring software fault to live in its process, so the fresh process
    cures it; a deterministic bug in the script stops any system and is outside the model.
    ``stop`` is the launcher before that (``--fresh-process-retries 0``): the worker's
    ``max_step_retries`` and the coordinator's fault budget end the job, and it is started again
    from its checkpoint.
    """

    STOP = "stop"
    RESPAWN = "respawn"


@dataclass(frozen=True)
class CapacityPolicy:
    """The no-spare policy and the admission of hosts (the launcher's flags of the same names)."""

    no_spare: NoSparePolicy = NoSparePolicy.WAIT
    spare_wait_s: float = math.inf  # longest wait for hosts before the policy shrinks or fails
    min_replicas: int = 1  # fewer data-parallel replicas at work than this is a failure
    health_check: bool = False  # a host that fails the check is quarantined, never promoted
    design: DegradedDesign = DegradedDesign.BITWISE
    after_retries: AfterRetries = AfterRetries.RESPAWN  # a recurring bug: --fresh-process-retries

    def __post_init__(self) -> None:
        if math.isnan(self.spare_wait_s) or self.spare_wait_s < 0:
            raise ConfigError(f"spare_wait_s={self.spare_wait_s} must be >= 0 seconds (inf: no limit)")
        if self.min_replicas < 1:
            raise ConfigError(f"min_replicas={self.min_replicas} must be >= 1")

    @property
    def wait_limit_s(self) -> float:
        """How long a lost host's replacement is waited for before the job shrinks or fails
        (``shrink`` waits only when it may not shrink)."""
        return self.spare_wait_s


class WidthAction(str, Enum):
    """What a fault's round does about the hosts it lost (the launcher's ``WidthAction``)."""

    ASSIGN = "assign"  # spare hosts take every lost place (possibly after a wait)
    SHRINK = "shrink"  # fewer replicas go on (possibly after a wait)
    FAIL = "fail"  # the job fails and restarts from its checkpoint (after the wait)


def no_spare_action(
    policy: CapacityPolicy, *, wait_to_cover_s: float, wait_to_shrink_s: float
) -> tuple[WidthAction, float]:
    """The round's action and how long it waits before it, as the launcher decides it.

    ``wait_to_cover_s``: until enough spare hosts are ready to fill the lost places without a
    replica fewer at work (0: they are; ``inf``: never). ``wait_to_shrink_s``: until going on
    degraded keeps at least ``min_replicas`` (0: it does now; ``inf``: never). The launcher
    re-decides each time a spare becomes ready (``coordinator/rules/width.py``'s
    ``width_decision``); this is that sequence of decisions in one call. Hosts that cover win;
    ``shrink`` goes on as soon as it may; ``wait`` and ``fail`` wait up to ``spare_wait_s``, then
    ``wait`` shrinks if it may, and otherwise the job fails.
    """
    cover, shrink, limit = wait_to_cover_s, wait_to_shrink_s, policy.wait_limit_s
    if cover <= 0:
        return WidthAction.ASSIGN, 0.0
    if policy.no_spare is NoSparePolicy.SHRINK and shrink < cover and shrink <= limit:
        return WidthAction.SHRINK, shrink
    if cover <= limit:
        return WidthAction.ASSIGN, cover
    if policy.no_spare is not NoSparePolicy.FAIL and shrink <= limit:
        return WidthAction.SHRINK, limit
    return WidthAction.FAIL, limit


def hosts_to_keep(width: float, holes: int, group_nodes: int, replicas: float) -> int | None:
    """Spare hosts that ``holes`` hostless positions need for ``replicas`` to stay at work
    (``None``: no number does, the job is narrower than that)."""
    droppable = math.floor(width - replicas + 1e-9)
    if droppable < 0:
        return None
    return max(0, holes - group_nodes * droppable)


# ----------------------------------------------------------------------------------------------
# Pure functions of the width
# ----------------------------------------------------------------------------------------------
def dropped_replicas(holes: int, group_nodes: int) -> int:
    """Replicas out of work with ``holes`` hostless positions (survivors fill the others' holes)."""
    if holes < 0 or group_nodes < 1:
        raise ConfigError(f"holes={holes} must be >= 0 and group_nodes={group_nodes} >= 1")
    return -(-holes // group_nodes)


def replicas_at_work(shape: JobShape, holes: int) -> float:
    return shape.dp_width - dropped_replicas(holes, shape.dp_group_nodes)


def step_factor(width: float, dropped: int, design: DegradedDesign, extra_pass: float) -> float:
    """Wall time of a degraded step over the full-width step, ``dropped`` of ``width`` replicas out.

    ``extra_pass``: what one more accumulation pass adds, as a share of the full step (the
    forward and backward only; the all-reduce and the optimizer step run once). Measured 0.83 for
    the bitwise design (``Calibration.extra_pass_ratio``); 1 gives the issue's ideal. ``bitwise``:
    the ``dropped`` slots go to the ``width - dropped`` survivors, at most ``ceil(dropped / left)``
    each, and the most loaded one sets the step. ``split``: every survivor trains
    ``dropped / left`` of a micro-batch more.
    """
    if dropped < 0 or extra_pass < 0 or width <= 0:
        raise ConfigError(f"width={width} must be > 0, dropped={dropped} and extra_pass={extra_pass} >= 0")
    left = width - dropped
    if left <= 0:
        return math.inf
    passes = math.ceil(dropped / left) if design is DegradedDesign.BITWISE else dropped / left
    return 1.0 + extra_pass * passes


def slowdown(
    shape: JobShape, holes: int, design: DegradedDesign = DegradedDesign.SPLIT, extra_pass: float = 1.0
) -> float:
    """Wall time of a step with ``holes`` hostless positions relative to full width.

    The defaults give the issue's ideal, full width / remaining width.
    """
    return step_factor(shape.dp_width, dropped_replicas(holes, shape.dp_group_nodes), design, extra_pass)


def fill_count(holes: int, free: int, group_nodes: int) -> int:
    """Spare hosts worth putting into ``holes``: only as many as bring a dropped replica back.

    A host that cannot complete a replica is kept as a spare for the next fault instead.
    """
    if free < 0:
        raise ConfigError(f"free={free} must be >= 0")
    after = group_nodes * dropped_replicas(max(0, holes - free), group_nodes)
    return max(0, holes - after)


def extra_faults_per_host_loss(bad_fraction: float) -> float:
    """Expected faults a lost host causes again when nothing stops a faulty repair from training.

    A repair comes back faulty with probability q, fails again, is repaired again, ...:
    q + q^2 + ... = q / (1 - q).
    """
    return bad_fraction / (1.0 - bad_fraction)


# ----------------------------------------------------------------------------------------------
# The hosts outside the job: spares and repairs
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Host:
    """A host ready to be promoted. ``bad``: it will fail again; ``repair_u``: its next repair's draw."""

    bad: bool = False
    repair_u: float = 1.0


class Fleet:
    """Spare hosts ready to promote, and hosts away for repair (returning at known times)."""

    def __init__(self, spares: int, replace_s: float, bad_fraction: float, health_check: bool) -> None:
        self.free: deque[Host] = deque(Host() for _ in range(spares))
        self.replace_s = replace_s
        self.bad_fraction = bad_fraction
        self.health_check = health_check
        self.quarantined = 0  # repairs turned back by the health check
        self._repairs: list[tuple[float, int, float]] = []  # (back at, tie-break, repair draw)
        self._seq = itertools.count()

    def _returned(self, back_at: float, u: float) -> Host | None:
        """A host back from repair: usable, or (with a health check) quarantined and sent back."""
        q = self.bad_fraction
        if u >= q:
            return Host()
        # u / q is again uniform on [0, 1): it decides the next repair of the same host
        again = u / q if u > 0 else 1.0
        if self.health_check:
            self.quarantined += 1
            self.send_to_repair(back_at, 1, again)
            return None
        return Host(bad=True, repair_u=again)

    def arrive(self, now: float) -> None:
        """Hosts whose repair has finished by ``now`` join the spares (or quarantine)."""
        while self._repairs and self._repairs[0][0] <= now:
            back_at, _, u = heapq.heappop(self._repairs)
            host = self._returned(back_at, u)
            if host is not None:
                self.free.append(host)

    def _usable_returns(self, now: float) -> list[float]:
        """When the hosts away now come back usable, earliest first, without taking any: a return
        the health check turns back comes again one repair later (as in :meth:`_returned`)."""
        self.arrive(now)
        heap = list(self._repairs)
        seq = itertools.count(len(heap))
        times: list[float] = []
        while heap:
            at, _, u = heapq.heappop(heap)
            if u < self.bad_fraction and self.health_check:
                heapq.heappush(
                    heap, (at + self.replace_s, next(seq), u / self.bad_fraction if u > 0 else 1.0)
                )
            else:
                times.append(at)
        return times

    def ready_by(self, now: float, deadline: float) -> int:
        """Spare hosts ready by ``deadline``: now's and the repairs back usable by then."""
        return len(self.free) + sum(1 for at in self._usable_returns(now) if at <= deadline)

    def ready_at(self, now: float, count: int) -> float:
        """When ``count`` spare hosts will be ready (``now`` if they are; ``inf`` if never)."""
        missing = count - self.available(now)
        if missing <= 0:
            return now
        times = self._usable_returns(now)
        return times[missing - 1] if missing <= len(times) else math.inf

    def next_return_s(self) -> float:
        return self._repairs[0][0] if self._repairs else math.inf

    def send_to_repair(self, now: float, count: int, repair_u: float) -> None:
        for _ in range(count):
            heapq.heappush(self._repairs, (now + self.replace_s, next(self._seq), repair_u))

    def available(self, now: float) -> int:
        self.arrive(now)
        return len(self.free)

    def take_ready(self, now: float, count: int) -> list[Host]:
        """Up to ``count`` spares ready now, earliest returned first."""
        self.arrive(now)
        return [self.free.popleft() for _ in range(min(count, len(self.free)))]

    def take(self, now: float, count: int) -> tuple[list[Host], float]:
        """``count`` hosts, waiting for repairs if too few are ready; returns them and the wait."""
        hosts = self.take_ready(now, count)
        last = now
        while len(hosts) < count and self._repairs:
            back_at, _, u = heapq.heappop(self._repairs)
            host = self._returned(back_at, u)
            if host is not None:
                hosts.append(host)
                last = back_at
        return hosts, last - now


class SparePool:
    """Hot spare nodes. Each node taken is replaced by a repaired one ``replace_s`` later.

    The simple pool of the wait policy (kept for its unit test and for callers); the simulation
    itself uses :class:`Fleet`, which adds repairs that fail.
    """

    def __init__(self, free: int, replace_s: float) -> None:
        self._fleet = Fleet(free, replace_s, 0.0, health_check=False)

    @property
    def free(self) -> int:
        return len(self._fleet.free)

    def take(self, now: float, count: int) -> float:
        """Take ``count`` nodes at ``now``; return how long the job waits for the last one."""
        self._fleet.send_to_repair(now, count, 1.0)
        return self._fleet.take(now, count)[1]
