"""Capacity: spare hosts, their repair and health check, and running with fewer replicas.

What a job does when a host is lost and no spare host is ready (``NoSparePolicy``):

- ``wait``: wait for a repaired host, up to ``spare_wait_s``; past it the job fails and restarts
  from its last checkpoint (the restart also waits for hosts). The launcher's behaviour today is
  ``wait`` with ``--spare-wait 60``; the simulator's model so far waited without a limit.
- ``fail``: ``wait`` with no wait at all.
- ``shrink`` (degraded mode): the job goes on with fewer data-parallel replicas. The global batch
  stays the same: the survivors compute the missing replicas' micro-batches, so a step takes
  ``full width / remaining width`` times as long (the ideal; the measured slowdown will replace
  it once the issue's benchmark exists). Below ``min_replicas`` it fails as ``fail`` does. When
  hosts return, it grows back at a step boundary.

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
    "CapacityPolicy",
    "Fleet",
    "Host",
    "NoSparePolicy",
    "dropped_replicas",
    "extra_faults_per_host_loss",
    "fill_count",
    "replicas_at_work",
    "slowdown",
]


class NoSparePolicy(str, Enum):
    """What a job does when a host is lost and no spare host is ready."""

    SHRINK = "shrink"
    WAIT = "wait"
    FAIL = "fail"


@dataclass(frozen=True)
class CapacityPolicy:
    """The no-spare policy and the admission of hosts (the launcher's flags of the same names)."""

    no_spare: NoSparePolicy = NoSparePolicy.WAIT
    spare_wait_s: float = math.inf  # ``wait``: longest wait for hosts before the job fails
    min_replicas: int = 1  # ``shrink``: fewer data-parallel replicas at work than this fails the job
    health_check: bool = False  # a host that fails the check is quarantined, never promoted

    def __post_init__(self) -> None:
        if math.isnan(self.spare_wait_s) or self.spare_wait_s < 0:
            raise ConfigError(f"spare_wait_s={self.spare_wait_s} must be >= 0 seconds (inf: no limit)")
        if self.min_replicas < 1:
            raise ConfigError(f"min_replicas={self.min_replicas} must be >= 1")

    @property
    def wait_limit_s(self) -> float:
        """How long a lost host's replacement is waited for before the job fails."""
        return 0.0 if self.no_spare is NoSparePolicy.FAIL else self.spare_wait_s


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


def slowdown(shape: JobShape, holes: int) -> float:
    """Wall time of a step relative to full width: full width / remaining width (ideal)."""
    left = replicas_at_work(shape, holes)
    return shape.dp_width / left if left > 0 else math.inf


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
