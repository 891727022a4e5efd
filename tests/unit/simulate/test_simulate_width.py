"""The simulator's no-spare decision and degraded step (issue 39 part 4) against the launcher's
rule and the measured step: pure functions first, then the event simulation's use of them."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.coordinator.rules.width import NoSparePolicy as LauncherPolicy
from checkpointless.coordinator.rules.width import WidthAction as LauncherAction
from checkpointless.coordinator.rules.width import WidthSituation, width_decision
from checkpointless.errors import ConfigError
from checkpointless.simulate.calibration import Calibration, CommModel
from checkpointless.simulate.capacity import (
    CapacityPolicy,
    DegradedDesign,
    Fleet,
    NoSparePolicy,
    WidthAction,
    hosts_to_keep,
    no_spare_action,
    step_factor,
)
from checkpointless.simulate.des import SimConfig, simulate_run
from checkpointless.simulate.failures import FailureModel, Fault, sample_faults
from checkpointless.simulate.models import analytic_goodput, policy_interval
from checkpointless.simulate.plans import Bucket, Policy, comm_start_s
from checkpointless.simulate.topology import JobShape

GPU = next(i for i, c in enumerate(FailureModel().causes) if c.name == "gpu")
BUG = next(i for i, c in enumerate(FailureModel().causes) if c.name == "software-transient")
LIMITS = (0.0, 30.0, 60.0, 600.0)


# --- the decision, against the launcher's width_decision ------------------------------------------
def _launcher(
    policy: NoSparePolicy, limit: float, min_replicas: int, survivors: int, needed: int, ready0: int,
    arrivals: list[int],
) -> tuple[str, float]:  # fmt: skip
    """What the launcher does: it decides at the start, each time a spare is ready, and at the limit."""
    for t in sorted({0.0, limit, *(float(a) for a in arrivals if a <= limit)}):
        ready = ready0 + sum(1 for a in arrivals if a <= t)
        situation = WidthSituation(
            width=survivors + needed, survivors=survivors, needed=needed, ready=ready, starting=0,
            waited=t, wait_limit=limit, policy=LauncherPolicy(policy.value), min_replicas=min_replicas,
        )  # fmt: skip
        decision = width_decision(situation)
        if decision.action is not LauncherAction.WAIT:
            return decision.action.value, t
    raise AssertionError("the launcher waited past its limit")


def _ready_at(ready0: int, arrivals: list[int], count: int) -> float:
    if count <= ready0:
        return 0.0
    k = count - ready0 - 1
    return float(arrivals[k]) if k < len(arrivals) else float("inf")


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(
    policy=st.sampled_from(list(NoSparePolicy)),
    limit=st.sampled_from(LIMITS),
    min_replicas=st.integers(1, 8),
    survivors=st.integers(0, 8),
    needed=st.integers(1, 6),
    ready0=st.integers(0, 6),
    arrivals=st.lists(st.integers(1, 900), max_size=8).map(sorted),
)
def test_the_decision_is_the_launchers(
    policy: NoSparePolicy, limit: float, min_replicas: int, survivors: int, needed: int, ready0: int,
    arrivals: list[int],
) -> None:  # fmt: skip
    # DDP: a replica is one slot (one "host" per replica), so the simulator's counting model and
    # the launcher's slots coincide; every spare that arrives is one slot filled
    width = survivors + needed
    floor = hosts_to_keep(width, needed, 1, min_replicas)
    action, waited = no_spare_action(
        CapacityPolicy(policy, spare_wait_s=limit, min_replicas=min_replicas),
        wait_to_cover_s=_ready_at(ready0, arrivals, needed),
        wait_to_shrink_s=float("inf") if floor is None else _ready_at(ready0, arrivals, floor),
    )
    assert (action.value, waited) == _launcher(
        policy, limit, min_replicas, survivors, needed, ready0, arrivals
    )


@pytest.mark.timeout(5)
def test_decision_examples() -> None:
    wait60 = CapacityPolicy(NoSparePolicy.WAIT, spare_wait_s=60.0)
    assert no_spare_action(wait60, wait_to_cover_s=0.0, wait_to_shrink_s=0.0) == (WidthAction.ASSIGN, 0.0)
    assert no_spare_action(wait60, wait_to_cover_s=40.0, wait_to_shrink_s=0.0) == (WidthAction.ASSIGN, 40.0)
    assert no_spare_action(wait60, wait_to_cover_s=3600.0, wait_to_shrink_s=0.0) == (WidthAction.SHRINK, 60.0)
    shrink = replace(wait60, no_spare=NoSparePolicy.SHRINK)
    assert no_spare_action(shrink, wait_to_cover_s=3600.0, wait_to_shrink_s=0.0) == (WidthAction.SHRINK, 0.0)
    # below --min-replicas every policy waits, then fails
    for p in (wait60, shrink, replace(wait60, no_spare=NoSparePolicy.FAIL)):
        assert no_spare_action(p, wait_to_cover_s=3600.0, wait_to_shrink_s=float("inf")) == (
            WidthAction.FAIL,
            60.0,
        )
    assert hosts_to_keep(18, 16, 16, 17) == 0 and hosts_to_keep(18, 17, 16, 17) == 1
    assert hosts_to_keep(1, 1, 2, 1) == 1 and hosts_to_keep(1, 1, 2, 2) is None


# --- the degraded step ------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None)
@given(
    width=st.one_of(st.integers(1, 1000).map(float), st.floats(1.0, 1000.0)),
    share=st.floats(0.0, 0.999),
    extra=st.floats(0.0, 1.5),
)
def test_step_factor_properties(width: float, share: float, extra: float) -> None:
    dropped = int(share * width)
    if width - dropped <= 0:
        return
    bitwise = step_factor(width, dropped, DegradedDesign.BITWISE, extra)
    split = step_factor(width, dropped, DegradedDesign.SPLIT, extra)
    assert step_factor(width, 0, DegradedDesign.BITWISE, extra) == 1.0
    assert 1.0 <= split <= bitwise + 1e-12  # whole passes never beat spreading the work
    if dropped + 1 < width:  # one replica more out never speeds a step up
        assert step_factor(width, dropped + 1, DegradedDesign.BITWISE, extra) >= bitwise
        assert step_factor(width, dropped + 1, DegradedDesign.SPLIT, extra) >= split
    if 0 < dropped <= width - dropped:  # each holder holds one slot: one extra pass
        assert bitwise == pytest.approx(1.0 + extra)
    assert step_factor(width, dropped, DegradedDesign.SPLIT, 1.0) == pytest.approx(width / (width - dropped))


@pytest.mark.timeout(5)
def test_step_factor_reproduces_the_measurement() -> None:
    p = Calibration().extra_pass_ratio
    # degraded_step.json: 4 -> 3 ranks, one survivor holds the lost slot: 1.83x the full step
    assert step_factor(4, 1, DegradedDesign.BITWISE, p) == pytest.approx(1.8294)
    # at 16,384 GPUs one of 128 replicas out costs the bitwise design as much as 1 of 4 ...
    assert step_factor(128, 1, DegradedDesign.BITWISE, p) == pytest.approx(1.8294)
    # ... and the ideal almost nothing
    assert step_factor(128, 1, DegradedDesign.SPLIT, 1.0) == pytest.approx(128 / 127)
    assert step_factor(2, 2, DegradedDesign.BITWISE, p) == float("inf")
    with pytest.raises(ConfigError, match="extra_pass=-1"):
        step_factor(4, 1, DegradedDesign.BITWISE, -1.0)


# --- the fleet's look-ahead ------------------------------------------------------------------------
@pytest.mark.timeout(60)
@settings(max_examples=100, deadline=None)
@given(
    free=st.integers(0, 3),
    repairs=st.lists(st.tuples(st.integers(0, 500), st.floats(0.0, 0.999)), max_size=8),
    bad=st.sampled_from([0.0, 0.3]),
    checked=st.booleans(),
    count=st.integers(0, 12),
)
def test_look_ahead_agrees_with_taking(
    free: int, repairs: list[tuple[int, float]], bad: float, checked: bool, count: int
) -> None:
    fleet = Fleet(free, 100.0, bad, health_check=checked)
    for at, u in repairs:
        fleet.send_to_repair(float(at), 1, u)
    now = 50.0
    when = fleet.ready_at(now, count)
    ready_by = {d: fleet.ready_by(now, now + d) for d in (0.0, 100.0, 1000.0)}
    hosts, wait = copy.deepcopy(fleet).take(now, count)
    if len(hosts) == count:
        assert when == pytest.approx(now + wait)
    else:
        assert when == float("inf")
    for d, n in ready_by.items():  # ready_by counts exactly the hosts ready_at says are there
        assert (fleet.ready_at(now, n) <= now + d) and (fleet.ready_at(now, n + 1) > now + d)


# --- the event simulation under the launcher's policies ------------------------------------------------
def _cfg(capacity: CapacityPolicy, spares: int = 0, days: float = 1.0) -> SimConfig:
    shape = JobShape(gpus=2304, spare_nodes=spares, replace_s=3600.0)
    return SimConfig(
        shape=shape, failures=FailureModel(bad_repair_fraction=0.0), days=days, capacity=capacity
    )


@pytest.mark.timeout(10)
def test_wait_waits_its_limit_then_shrinks() -> None:
    wait60 = CapacityPolicy(NoSparePolicy.WAIT, spare_wait_s=60.0, health_check=True)
    shrink = replace(wait60, no_spare=NoSparePolicy.SHRINK)
    trace = [Fault(10_000.0, GPU, (5,))]
    waited, at_once = (simulate_run(_cfg(c), Policy.CHECKPOINTLESS, trace) for c in (wait60, shrink))
    assert (waited.shrinks, waited.grows, waited.fallbacks) == (1, 1, 0)
    assert waited.seconds[Bucket.INFRA_RECOVERY] == pytest.approx(
        at_once.seconds[Bucket.INFRA_RECOVERY] + 60.0
    )
    # the minute not trained at all costs more than the minute trained at 1/1.83 of the speed
    assert at_once.goodput > waited.goodput


@pytest.mark.timeout(10)
def test_wait_takes_a_repair_that_comes_within_the_limit() -> None:
    wait60 = CapacityPolicy(NoSparePolicy.WAIT, spare_wait_s=60.0)
    # the only spare goes at 1,000 s; that host is back at 4,600 s; a host lost at 4,570 s waits 30 s
    trace = [Fault(1000.0, GPU, (5,)), Fault(4570.0, GPU, (9,))]
    res = simulate_run(_cfg(wait60, spares=1), Policy.CHECKPOINTLESS, trace)
    assert (res.shrinks, res.fallbacks, res.spare_waits) == (0, 0, 1)
    assert res.seconds[Bucket.DEGRADED] == 0.0


@pytest.mark.timeout(10)
def test_a_fault_during_the_wait_for_hosts_still_waits_for_them() -> None:
    fail = CapacityPolicy(NoSparePolicy.FAIL, spare_wait_s=60.0)
    lone = [Fault(10_000.0, GPU, (5,))]
    both = [*lone, Fault(11_000.0, BUG, ())]  # a software fault while the restart waits an hour
    one, two = (simulate_run(_cfg(fail), Policy.CHECKPOINTLESS, t) for t in (lone, both))
    assert two.seconds[Bucket.INFRA_RECOVERY] >= one.seconds[Bucket.INFRA_RECOVERY]
    assert two.seconds[Bucket.INFRA_RECOVERY] > 3600.0
    assert two.goodput <= one.goodput


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "capacity",
    [
        CapacityPolicy(NoSparePolicy.WAIT, spare_wait_s=60.0, health_check=True),
        CapacityPolicy(NoSparePolicy.FAIL, spare_wait_s=60.0),
        CapacityPolicy(NoSparePolicy.SHRINK, health_check=True, design=DegradedDesign.SPLIT),
    ],
    ids=["wait-then-shrink", "fail", "shrink-split"],
)
def test_closed_form_follows_the_simulation(capacity: CapacityPolicy) -> None:
    cfg = replace(_cfg(capacity, days=60.0), shape=JobShape(gpus=2304, replace_s=3600.0))
    interval = policy_interval(
        Policy.CHECKPOINTLESS,
        cfg.interval_rule,
        cfg.failures,
        cfg.shape,
        cfg.cal,
        cfg.max_interval_s,
        capacity,
    )
    closed = analytic_goodput(Policy.CHECKPOINTLESS, cfg.failures, cfg.shape, cfg.cal, interval, capacity)
    sims = [
        simulate_run(
            cfg, Policy.CHECKPOINTLESS, sample_faults(cfg.failures, cfg.shape, cfg.horizon_s, s)
        ).goodput
        for s in range(3)
    ]
    assert sum(sims) / len(sims) == pytest.approx(closed, abs=0.01)
    assert all(a >= 0 for a in itertools.chain(sims, [closed]))


@pytest.mark.timeout(5)
def test_measured_rootless_rebuild_is_rendezvous_scales_model() -> None:
    cal = Calibration()
    # benchmarks/results/rendezvous_scale.json, "rootless_s" of its model rows
    for ranks, measured in ((1024, 0.19345), (16384, 3.09805), (100_000, 18.91009)):
        assert comm_start_s(CommModel.ROOTLESS_MEASURED, 0.0, ranks, cal) == pytest.approx(measured, rel=2e-3)
