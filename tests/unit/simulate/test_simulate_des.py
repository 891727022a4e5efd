"""Tests of the goodput event simulation, the report and its command line."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from checkpointless.errors import ConfigError
from checkpointless.simulate import main
from checkpointless.simulate.capacity import AfterRetries
from checkpointless.simulate.des import SimConfig, SparePool, simulate_run
from checkpointless.simulate.failures import FailureModel, Fault, sample_faults
from checkpointless.simulate.models import (
    Bucket,
    Policy,
    analytic_goodput,
    load_cost_s,
    policy_interval,
    recovery_plan,
    save_cost_s,
)
from checkpointless.simulate.topology import JobShape

CAUSE = {c.name: i for i, c in enumerate(FailureModel().causes)}


def _cfg(gpus: int = 2304, days: float = 10.0, rate_x: float = 1.0) -> SimConfig:
    base = SimConfig(shape=JobShape(gpus=gpus), days=days)
    failures = replace(base.failures, rate_per_gpu_hour=base.failures.rate_per_gpu_hour * rate_x)
    return replace(base, failures=failures)


def _run(cfg: SimConfig, policy: Policy, seed: int) -> float:
    return simulate_run(cfg, policy, sample_faults(cfg.failures, cfg.shape, cfg.horizon_s, seed)).goodput


# --- conservation of time ----------------------------------------------------------------------
@pytest.mark.timeout(20)
@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize(
    ("gpus", "rate_x"), [(16, 1.0), (2304, 1.0), (16384, 1.0), (2304, 60.0), (64, 400.0)]
)
def test_buckets_add_up_to_wall_time(policy: Policy, gpus: int, rate_x: float) -> None:
    cfg = _cfg(gpus, days=5.0, rate_x=rate_x)  # the high rates force faults during recoveries
    res = simulate_run(cfg, policy, sample_faults(cfg.failures, cfg.shape, cfg.horizon_s, 3))
    assert res.wall_s == pytest.approx(cfg.horizon_s)
    assert sum(res.seconds.values()) == pytest.approx(res.wall_s, rel=1e-9)
    assert min(res.seconds.values()) > -1e-6
    assert 0.0 <= res.goodput <= 1.0


# --- exact accounting of a single fault ----------------------------------------------------------
@pytest.mark.timeout(10)
def test_checkpoint_restart_loses_work_since_last_save() -> None:
    cfg = _cfg(2304, days=1.0)
    interval = policy_interval(
        Policy.CHECKPOINT_RESTART, cfg.interval_rule, cfg.failures, cfg.shape, cfg.cal, 1e9
    )
    save = save_cost_s(cfg.shape, cfg.cal)
    t = 2 * (interval + save) + 0.4 * interval  # in the third compute stretch
    res = simulate_run(cfg, Policy.CHECKPOINT_RESTART, [Fault(t, CAUSE["gpu"], (5,))])
    assert res.seconds[Bucket.WASTED_PROGRESS] == pytest.approx(0.4 * interval)
    plan = recovery_plan(
        Policy.CHECKPOINT_RESTART,
        cfg.failures.causes[CAUSE["gpu"]],
        cfg.shape,
        cfg.cal,
        fallback=True,
        lost_state=True,
        spare_wait_s=0.0,
    )
    recovery = sum(v for b, v in res.seconds.items() if b not in (Bucket.PRODUCTIVE, Bucket.CHECKPOINT_SAVE))
    assert recovery - 0.4 * interval == pytest.approx(sum(p.seconds for p in plan))
    assert res.seconds[Bucket.CHECKPOINT_RESTORE] == pytest.approx(load_cost_s(cfg.shape, cfg.cal))


@pytest.mark.timeout(10)
def test_fault_during_save_voids_it() -> None:
    cfg = _cfg(2304, days=1.0)
    interval = policy_interval(
        Policy.CHECKPOINT_RESTART, cfg.interval_rule, cfg.failures, cfg.shape, cfg.cal, 1e9
    )
    t = interval + 0.5 * save_cost_s(cfg.shape, cfg.cal)
    res = simulate_run(cfg, Policy.CHECKPOINT_RESTART, [Fault(t, CAUSE["host"], (0,))])
    assert res.seconds[Bucket.WASTED_PROGRESS] == pytest.approx(interval)


@pytest.mark.timeout(10)
def test_checkpointless_loses_at_most_the_current_step() -> None:
    cfg = _cfg(2304, days=1.0)
    step = cfg.shape.step_s + cfg.cal.step_overhead_s
    t = 100 * step + 0.7 * step
    res = simulate_run(cfg, Policy.CHECKPOINTLESS, [Fault(t, CAUSE["gpu"], (5,))])
    assert res.fallbacks == 0
    assert res.seconds[Bucket.WASTED_PROGRESS] == pytest.approx(0.7 * step)
    assert res.seconds[Bucket.CHECKPOINT_RESTORE] < 5.0  # peer transfer, no file load


# --- fallback to a checkpoint ----------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_fault_spanning_every_replica_falls_back_to_checkpoint() -> None:
    cfg = _cfg(16, days=1.0)  # two nodes: one per replica group, both behind one switch
    res = simulate_run(cfg, Policy.CHECKPOINTLESS, [Fault(40_000.0, CAUSE["network-switch"], (0, 1))])
    assert res.fallbacks == 1
    assert res.seconds[Bucket.CHECKPOINT_RESTORE] == pytest.approx(load_cost_s(cfg.shape, cfg.cal))
    assert res.seconds[Bucket.WASTED_PROGRESS] > 100 * cfg.shape.step_s  # back to the last save


@pytest.mark.timeout(10)
def test_second_fault_on_the_twin_during_recovery_falls_back() -> None:
    cfg = _cfg(16, days=1.0)
    one = simulate_run(cfg, Policy.CHECKPOINTLESS, [Fault(40_000.0, CAUSE["gpu"], (0,))])
    assert one.fallbacks == 0
    # Node 1 holds the other copy of node 0's shard and dies before node 0's state is restored.
    two = [Fault(40_000.0, CAUSE["gpu"], (0,)), Fault(40_005.0, CAUSE["host"], (1,))]
    res = simulate_run(cfg, Policy.CHECKPOINTLESS, two)
    assert res.fallbacks == 1
    assert res.seconds[Bucket.CHECKPOINT_RESTORE] >= load_cost_s(cfg.shape, cfg.cal)


@pytest.mark.timeout(10)
def test_recurring_software_bug_falls_back_transient_does_not() -> None:
    # the launcher with --fresh-process-retries 0: a recurring bug stops the job after its retries
    base = _cfg(2304, days=1.0)
    cfg = replace(base, capacity=replace(base.capacity, after_retries=AfterRetries.STOP))
    rec = simulate_run(cfg, Policy.CHECKPOINTLESS, [Fault(30_000.0, CAUSE["software-recurring"], ())])
    tra = simulate_run(cfg, Policy.CHECKPOINTLESS, [Fault(30_000.0, CAUSE["software-transient"], ())])
    assert (rec.fallbacks, tra.fallbacks) == (1, 0)
    assert rec.goodput < tra.goodput


# --- spares ----------------------------------------------------------------------------------------
@pytest.mark.timeout(5)
def test_spare_pool_waits_for_replacement_when_empty() -> None:
    pool = SparePool(1, 100.0)
    assert pool.take(0.0, 1) == 0.0
    assert pool.take(10.0, 1) == pytest.approx(90.0)  # the node sent away at t=0 is back at 100
    assert pool.take(500.0, 0) == 0.0
    assert pool.free == 1  # the second repaired node is back; the first was used at t=10


@pytest.mark.timeout(10)
def test_no_spares_costs_goodput() -> None:
    cfg = _cfg(2304, days=10.0)
    none = replace(cfg, shape=replace(cfg.shape, spare_nodes=0))
    for policy in Policy:
        assert _run(none, policy, 1) < _run(cfg, policy, 1)


# --- seeds, monotonicity, agreement with the closed form ------------------------------------------------
@pytest.mark.timeout(10)
def test_seeds_reproducible() -> None:
    cfg = _cfg(4096, days=10.0)
    for policy in Policy:
        assert _run(cfg, policy, 11) == _run(cfg, policy, 11)
    assert _run(cfg, Policy.CHECKPOINT_RESTART, 11) != _run(cfg, Policy.CHECKPOINT_RESTART, 12)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("policy", list(Policy))
def test_goodput_falls_as_failure_rate_rises(policy: Policy) -> None:
    means = [
        statistics.fmean(_run(_cfg(2304, days=10.0, rate_x=x), policy, s) for s in range(3))
        for x in (0.5, 1, 2, 4, 8)
    ]
    assert all(a > b for a, b in itertools.pairwise(means)), means


@pytest.mark.timeout(20)
@pytest.mark.parametrize("gpus", [2304, 16384])
def test_simulation_agrees_with_closed_form(gpus: int) -> None:
    # 60 days: the closed form assumes the spare pool's first (healthy) hosts are long used up
    cfg = _cfg(gpus, days=60.0)
    for policy in Policy:
        sim = statistics.fmean(_run(cfg, policy, s) for s in range(3))
        interval = policy_interval(
            policy, cfg.interval_rule, cfg.failures, cfg.shape, cfg.cal, cfg.max_interval_s
        )
        assert sim == pytest.approx(
            analytic_goodput(policy, cfg.failures, cfg.shape, cfg.cal, interval), abs=0.01
        )


@pytest.mark.timeout(20)
def test_headline_at_2304_gpus() -> None:
    cfg = _cfg(2304, days=30.0)
    cr = statistics.fmean(_run(cfg, Policy.CHECKPOINT_RESTART, s) for s in range(3))
    cl = statistics.fmean(_run(cfg, Policy.CHECKPOINTLESS, s) for s in range(3))
    assert cl >= 0.98
    assert cl > cr + 0.005


@pytest.mark.timeout(5)
def test_unsorted_trace_and_bad_days_rejected() -> None:
    cfg = _cfg(16, days=1.0)
    with pytest.raises(ConfigError, match="sorted"):
        simulate_run(cfg, Policy.CHECKPOINTLESS, [Fault(10.0, 0, (0,)), Fault(5.0, 0, (1,))])
    with pytest.raises(ConfigError, match="days=0"):
        SimConfig(days=0)


# --- command line -------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_main_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        ["--gpus", "16,1024", "--focus-gpus", "2304", "--days", "3", "--seeds", "2", "--out", str(tmp_path)]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "| 2,304 |" in out and "hang timeout 60 s" in out
    data = json.loads((tmp_path / "goodput.json").read_text())
    assert data["headline"]["gpus"] == 2304
    assert 0.0 < data["headline"]["checkpoint_restart_goodput"] <= 1.0
    assert {r["gpus"] for r in data["sweep"]} == {16, 1024, 2304}
    assert (tmp_path / "goodput.png").stat().st_size > 10_000
    assert "Command:" in (tmp_path / "goodput.md").read_text()


@pytest.mark.timeout(10)
def test_main_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--gpus", "100", "--no-plot"]) == 2
    assert "gpus=100" in capsys.readouterr().err
    bad = tmp_path / "c.json"
    bad.write_text('{"nope": 1}')
    assert main(["--gpus", "16", "--calibration", str(bad), "--no-plot"]) == 2
    assert "unknown calibration key 'nope'" in capsys.readouterr().err
    assert math.isfinite(SimConfig().horizon_s)
