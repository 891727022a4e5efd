"""The checkpointless model follows the system as built (session 32): the communicator is rebuilt,
and after a fallback started again, through the root-less rendezvous, and a bug that recurs in
the same processes is retried in process as often as the worker retries a step before the job
stops. The old assumptions stay reachable (``store_based``, ``step_retries=1``)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import fields, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.comm.handle import GLOO_CONNECT_VAR, gloo_connect
from checkpointless.errors import ConfigError
from checkpointless.recovery.job import init
from checkpointless.settings import JobSettings
from checkpointless.simulate.calibration import Calibration, CommModel, calibration_from_mapping
from checkpointless.simulate.capacity import AfterRetries, CapacityPolicy, NoSparePolicy
from checkpointless.simulate.command import build_parser, main
from checkpointless.simulate.des import SimConfig, simulate_run
from checkpointless.simulate.failures import Blast, FailureCause, FailureModel, Fault
from checkpointless.simulate.models import fallback_probability
from checkpointless.simulate.plans import (
    Bucket,
    Phase,
    Policy,
    comm_start_s,
    detect_s,
    inprocess_phases,
    recovery_plan,
    recurring_retries,
    restart_phases,
    step_wall_s,
)
from checkpointless.simulate.report import store_based
from checkpointless.simulate.topology import JobShape

RECURRING = FailureCause("bug", 1.0, Blast.JOB, recurring=True)


def _total(phases: Sequence[Phase]) -> float:
    return sum(p.seconds for p in phases)


@pytest.mark.timeout(30)
def test_defaults_are_the_launchers_own() -> None:
    """If the launcher's defaults change, the model's must follow (docs/goodput.md says where)."""
    cal = Calibration()
    launcher = {f.name: f.default for f in fields(JobSettings)}
    # the launcher's default --rendezvous rootless forms every generation, the first one too,
    # and its gloo groups connect lazily unless CHECKPOINTLESS_GLOO_CONNECT=full
    assert launcher["rendezvous"] == "rootless"
    assert cal.rebuild_model is CommModel.ROOTLESS_LAZY
    assert cal.restart_model is CommModel.ROOTLESS_LAZY
    # checkpoint-restart is torchrun's: one TCPStore
    assert cal.init_model is CommModel.STORE_LINEAR
    # the worker retries a raising step this often, and the coordinator's budget stops the job
    # at the same raise
    assert cal.step_retries == inspect.signature(init).parameters["max_step_retries"].default
    assert cal.step_retries == launcher["max_repeat_faults"] == launcher["max_step_failures"]


@pytest.mark.timeout(5)
def test_the_lazy_rebuild_model_is_the_workers_default_gloo_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(GLOO_CONNECT_VAR, raising=False)
    assert gloo_connect() == "lazy"
    assert Calibration().rebuild_model is CommModel.ROOTLESS_LAZY


@pytest.mark.timeout(30)
def test_the_chosen_policys_defaults_are_the_launchers_no_spare_defaults() -> None:
    launcher = {f.name: f.default for f in fields(JobSettings)}
    args = build_parser().parse_args([])
    assert args.no_spare_policy == launcher["when_no_spare"] == NoSparePolicy.WAIT.value
    assert args.spare_wait == launcher["spare_wait"]
    assert args.min_replicas == launcher["min_replicas"]
    # the launcher runs its built-in host checks unless told --health-builtins off
    assert (args.health_check == "on") == (launcher["health_builtins"] != "off")
    # as built, after its retries a recurring bug's ranks start again in fresh processes, on by
    # default in the launcher
    assert CapacityPolicy().after_retries is AfterRetries.RESPAWN
    assert launcher["fresh_process_retries"] > 0


@pytest.mark.timeout(5)
def test_the_store_based_what_if_puts_both_back_on_one_store() -> None:
    base = SimConfig()
    cal = store_based(base).cal
    assert (cal.rebuild_model, cal.restart_model) == (CommModel.STORE_LINEAR, CommModel.STORE_LINEAR)
    assert (
        replace(cal, rebuild_model=base.cal.rebuild_model, restart_model=base.cal.restart_model) == base.cal
    )


@pytest.mark.timeout(5)
@settings(max_examples=60, deadline=None)
@given(
    retries=st.integers(min_value=0, max_value=6),
    gpus=st.sampled_from([16, 2304, 16384, 100_000]),
    model=st.sampled_from(list(CommModel)),
)
def test_a_recurring_bug_costs_its_retries_then_a_restart(retries: int, gpus: int, model: CommModel) -> None:
    shape = JobShape(gpus=gpus)
    cal = replace(Calibration(), step_retries=retries, restart_model=model)
    plan = recovery_plan(
        Policy.CHECKPOINTLESS, RECURRING, shape, cal, fallback=True, lost_state=False, spare_wait_s=0.0
    )
    one = _total(inprocess_phases(shape, cal, 0.0, lost_state=False))
    one += step_wall_s(Policy.CHECKPOINTLESS, shape, cal) + detect_s(RECURRING, cal) + cal.abort_s
    restart = _total(restart_phases(shape, cal, 0.0, model))
    assert _total(plan) == pytest.approx(detect_s(RECURRING, cal) + cal.abort_s + retries * one + restart)
    # each retry re-runs the step that fails again: wasted, not productive
    wasted = [p for p in plan if p.bucket is Bucket.WASTED_PROGRESS]
    assert len(wasted) == retries
    # a retry is a round, the step failing again, a second detection and abort
    per_retry = len(inprocess_phases(shape, cal, 0.0, lost_state=False)) + 3
    assert len(recurring_retries(shape, cal, RECURRING)) == per_retry * retries
    # the restart forms its communicator through the model asked for, not checkpoint-restart's
    init = [p.seconds for p in plan if p.label == "communicator init"]
    assert init == [pytest.approx(comm_start_s(model, cal.init_s, gpus, cal))]


@pytest.mark.timeout(5)
@settings(max_examples=40, deadline=None)
@given(gpus=st.sampled_from([16, 2304, 16384, 100_000]))
def test_checkpoint_restart_keeps_its_store_whatever_the_checkpointless_launcher_does(gpus: int) -> None:
    shape, cal = JobShape(gpus=gpus), Calibration()
    plan = recovery_plan(
        Policy.CHECKPOINT_RESTART, RECURRING, shape, cal, fallback=True, lost_state=False, spare_wait_s=0.0
    )
    init = [p.seconds for p in plan if p.label == "communicator init"]
    assert init == [pytest.approx(cal.init_s + cal.store_per_rank_s * gpus)]
    # and it never retries in process: the fault restarts it at once
    assert not [p for p in plan if p.bucket is Bucket.WASTED_PROGRESS]


@pytest.mark.timeout(5)
@given(retries=st.integers(min_value=0, max_value=4))
@settings(max_examples=10, deadline=None)
def test_the_simulation_charges_each_failed_retry(retries: int) -> None:
    shape = JobShape(gpus=2304, spare_nodes=6)
    failures = FailureModel(causes=(RECURRING,), bad_repair_fraction=0.0)
    cfg = SimConfig(
        shape=shape,
        failures=failures,
        cal=replace(Calibration(), step_retries=retries),
        days=1.0,
        capacity=CapacityPolicy(after_retries=AfterRetries.STOP),  # --fresh-process-retries 0
    )
    res = simulate_run(cfg, Policy.CHECKPOINTLESS, [Fault(20_000.0, 0, ())])
    assert (res.faults, res.fallbacks) == (1, 1)
    plan = recovery_plan(
        Policy.CHECKPOINTLESS, RECURRING, shape, cfg.cal, fallback=True, lost_state=False, spare_wait_s=0.0
    )
    recovering = sum(res.seconds[b] for b in Bucket if b is not Bucket.PRODUCTIVE)
    # the plan, the work since the last save (wasted), the saves and the per-step bookkeeping
    assert recovering >= _total(plan)
    assert sum(res.seconds.values()) == pytest.approx(res.wall_s)


@pytest.mark.timeout(5)
def test_step_retries_from_a_calibration_file_and_its_bad_values() -> None:
    cal = calibration_from_mapping({"step_retries": 1, "restart_model": "store-linear"})
    assert (cal.step_retries, cal.restart_model) == (1, CommModel.STORE_LINEAR)
    for bad in (2.5, -1, True, 10_000):
        with pytest.raises(ConfigError, match="step_retries"):
            calibration_from_mapping({"step_retries": bad})
    with pytest.raises(ConfigError, match="restart_model"):
        calibration_from_mapping({"restart_model": "carrier-pigeon"})


@pytest.mark.timeout(5)
def test_the_command_line_rendezvous_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args([]).rendezvous == "rootless"
    assert build_parser().parse_args(["--rendezvous", "tcp"]).rendezvous == "tcp"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--rendezvous", "etcd"])
    assert "etcd" in capsys.readouterr().err
    # a tiny study runs under either
    assert build_parser().parse_args(["--rendezvous", "rootless-full"]).rendezvous == "rootless-full"
    for flag in ("rootless", "rootless-full", "tcp"):
        argv = ["--gpus", "16", "--days", "1", "--seeds", "1", "--no-sensitivity", "--rendezvous", flag]
        assert main(argv) == 0


@pytest.mark.timeout(5)
@given(retries=st.integers(min_value=0, max_value=4), gpus=st.sampled_from([16, 2304, 100_000]))
@settings(max_examples=20, deadline=None)
def test_the_respawn_what_if_pays_the_retries_and_a_round_with_state_not_a_restart(
    retries: int, gpus: int
) -> None:
    shape = JobShape(gpus=gpus)
    cal = replace(Calibration(), step_retries=retries)
    plan = recovery_plan(
        Policy.CHECKPOINTLESS, RECURRING, shape, cal, fallback=False, lost_state=False, spare_wait_s=0.0
    )
    respawn = inprocess_phases(shape, cal, 0.0, lost_state=True)
    expected = detect_s(RECURRING, cal) + cal.abort_s + _total(recurring_retries(shape, cal, RECURRING))
    assert _total(plan) == pytest.approx(expected + _total(respawn))
    labels = [p.label for p in plan]
    assert "spare swap" in labels and "peer state transfer" in labels
    assert "requeue / wait for nodes" not in labels and "checkpoint load" not in labels


@pytest.mark.timeout(5)
def test_under_respawn_a_recurring_bug_no_longer_falls_back() -> None:
    failures = FailureModel(causes=(RECURRING,), bad_repair_fraction=0.0)
    shape = JobShape(gpus=2304, spare_nodes=6)
    stop, respawn = CapacityPolicy(after_retries=AfterRetries.STOP), CapacityPolicy()
    assert fallback_probability(failures, shape, stop) == 1.0
    assert fallback_probability(failures, shape, None) == 0.0  # the default is as built: respawn
    assert fallback_probability(failures, shape, respawn) == 0.0
    base = SimConfig(shape=shape, failures=failures, days=1.0, capacity=stop)
    trace = [Fault(20_000.0, 0, ())]
    built = simulate_run(base, Policy.CHECKPOINTLESS, trace)
    what_if = simulate_run(replace(base, capacity=respawn), Policy.CHECKPOINTLESS, trace)
    assert (built.fallbacks, what_if.fallbacks) == (1, 0)
    assert what_if.goodput > built.goodput
    plan = recovery_plan(
        Policy.CHECKPOINTLESS, RECURRING, shape, base.cal, fallback=False, lost_state=False, spare_wait_s=0.0
    )
    recovering = sum(what_if.seconds[b] for b in Bucket if b is not Bucket.PRODUCTIVE)
    assert recovering >= _total(plan)
    assert sum(what_if.seconds.values()) == pytest.approx(what_if.wall_s)
