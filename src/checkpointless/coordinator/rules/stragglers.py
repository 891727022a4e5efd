"""Straggler hosts: which host's ranks are persistently slower than the rest, as a pure rule.

In data parallel training every rank waits for the slowest at each all-reduce, so the wall time
of a step is the same everywhere and says nothing about *who* is slow. What differs is the
*busy* time: a step's duration minus the time the rank spent waiting in collectives. A slow host
(a throttled GPU, a noisy neighbour, a degraded CPU) has a higher busy time; its peers wait
for it. Workers report the busy time of their last committed step in every heartbeat.

The rule, applied once per committed step by the coordinator:

* a host's figure is the median busy time of its ranks; its *ratio* is that figure over the
  median of the other hosts' figures (so one slow host cannot raise its own baseline);
* a host is reported once ``window`` samples in a row are all at or above ``ratio`` (a single
  slow step, a garbage collection or a page-cache miss, is noise, not a straggler);
* hysteresis: a reported host is cleared only after ``window`` samples in a row below
  ``clear_ratio`` (lower than ``ratio``), so a host near the threshold is not reported again
  and again.

Nothing here reads a clock or touches the job: :func:`judge` takes the previous state and the
new sample and returns the next state and what changed.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from checkpointless.errors import ConfigError

__all__ = [
    "HostRatio",
    "RankTiming",
    "StragglerRule",
    "StragglerState",
    "StragglerWatch",
    "Verdict",
    "host_ratios",
    "judge",
]


@dataclass(frozen=True)
class StragglerRule:
    ratio: float = 1.5  # report a host whose busy time is this many times the others'
    window: int = 5  # samples (committed steps) in a row that must agree
    clear_ratio: float = 0.0  # 0: half-way between 1 and ratio

    def __post_init__(self) -> None:
        if not self.ratio > 1.0:
            raise ConfigError(
                f"--straggler-ratio must be above 1 (got {self.ratio}); e.g. --straggler-ratio 1.5"
            )
        if self.window < 1:
            raise ConfigError(f"--straggler-window must be at least 1 step (got {self.window})")
        if self.clear_ratio and not 1.0 <= self.clear_ratio < self.ratio:
            raise ConfigError(f"the clear ratio must be in [1, {self.ratio}) (got {self.clear_ratio})")

    @property
    def clear(self) -> float:
        return self.clear_ratio or (1.0 + self.ratio) / 2


@dataclass(frozen=True)
class HostRatio:
    host: int
    ratio: float  # the host's median busy time over the other hosts' median
    busy_s: float  # the host's median busy time
    others_s: float  # the median of the other hosts' figures


@dataclass(frozen=True)
class StragglerState:
    # per host: the ratios of its last ``window`` samples, oldest first
    history: Mapping[int, tuple[float, ...]] = field(default_factory=dict)
    flagged: frozenset[int] = frozenset()  # hosts reported and not yet cleared


@dataclass(frozen=True)
class Verdict:
    host: int
    ratio: float  # the median of the window's ratios
    window: tuple[float, ...]  # the ratios that decided it
    reported: bool  # True: newly a straggler; False: recovered (cleared)


def host_ratios(busy: Mapping[int, Sequence[float]]) -> dict[int, HostRatio]:
    """Each host's median busy time over the median of the other hosts' medians.

    ``busy`` maps a host to its ranks' busy times; hosts without a figure are left out. With
    fewer than two hosts there is nobody to compare with, so the result is empty."""
    per_host = {h: statistics.median(ts) for h, ts in busy.items() if ts}
    if len(per_host) < 2:
        return {}
    out = {}
    for h, mine in per_host.items():
        others = statistics.median(v for k, v in per_host.items() if k != h)
        # a host whose peers are idle (0 s busy) cannot be judged against them
        if others > 0:
            out[h] = HostRatio(h, mine / others, mine, others)
    return out


def judge(
    state: StragglerState, ratios: Mapping[int, HostRatio], rule: StragglerRule
) -> tuple[StragglerState, list[Verdict]]:
    """Add one sample; return the next state and the hosts newly reported or cleared.

    A host missing from ``ratios`` (no figure this step, or gone) loses its history: a window
    must be samples in a row."""
    history: dict[int, tuple[float, ...]] = {}
    flagged = set(state.flagged & set(ratios))
    verdicts: list[Verdict] = []
    for host in sorted(ratios):
        window = (*state.history.get(host, ()), ratios[host].ratio)[-rule.window :]
        history[host] = window
        if len(window) < rule.window:
            continue
        if host not in flagged and min(window) >= rule.ratio:
            flagged.add(host)
            verdicts.append(Verdict(host, statistics.median(window), window, True))
        elif host in flagged and max(window) < rule.clear:
            flagged.discard(host)
            verdicts.append(Verdict(host, statistics.median(window), window, False))
    return StragglerState(history, frozenset(flagged)), verdicts


@dataclass(frozen=True)
class RankTiming:
    host: int
    rank: int
    step: int | None  # the step the rank is in, from its heartbeat
    busy_s: float | None  # its last committed step's busy time (None: none committed yet)


class StragglerWatch:
    """The coordinator's side: one sample each time the job's slowest rank reaches a new step.

    Heartbeats arrive four times a second whatever the step time, so sampling on every one
    would count the same step many times (and a fast job's steps not at all); the step counter
    makes each sample a new step. Holds the rule's state; reads no clock."""

    def __init__(self, rule: StragglerRule) -> None:
        self.rule = rule
        self.state = StragglerState()
        self._last_step: int | None = None
        # reported hosts whose ranks are to be moved (--swap-stragglers) once a spare host is
        # ready, with their ratio; kept by the coordinator (coordinator/watch.py)
        self.due_moves: dict[int, float] = {}

    @property
    def last_step(self) -> int | None:
        """The step of the newest sample (None: none since the start or the last reset)."""
        return self._last_step

    def reset(self) -> None:
        """A recovery round: the ranks and processes changed; their old windows say nothing."""
        self.state = StragglerState()
        self._last_step = None
        self.due_moves.clear()

    def observe(self, ranks: Sequence[RankTiming]) -> list[tuple[Verdict, list[int]]]:
        """Each verdict with the ranks of its host; empty unless a new step was reached."""
        if not ranks or any(r.step is None or r.busy_s is None for r in ranks):
            return []
        step = min(r.step for r in ranks if r.step is not None)
        if self._last_step is not None and step <= self._last_step:
            return []
        self._last_step = step
        busy: dict[int, list[float]] = {}
        for r in ranks:
            if r.busy_s is not None:
                busy.setdefault(r.host, []).append(r.busy_s)
        self.state, verdicts = judge(self.state, host_ratios(busy), self.rule)
        return [(v, sorted(r.rank for r in ranks if r.host == v.host)) for v in verdicts]
