"""Unit tests of the goodput simulation's pure parts: formulas, placement, faults, calibration."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from checkpointless.errors import ConfigError
from checkpointless.simulate.calibration import (
    Calibration,
    CommModel,
    calibration_from_mapping,
    load_calibration,
)
from checkpointless.simulate.capacity import AfterRetries, CapacityPolicy
from checkpointless.simulate.failures import (
    LLAMA3_CAUSES,
    LLAMA3_RATE_PER_GPU_HOUR,
    Blast,
    Detection,
    FailureCause,
    FailureModel,
    sample_faults,
)
from checkpointless.simulate.models import (
    Bucket,
    IntervalRule,
    Policy,
    checkpoint_interval,
    comm_start_s,
    daly_interval,
    detect_s,
    expected_loss_per_fault,
    fallback_probability,
    recovery_plan,
    restart_phases,
    young_interval,
)
from checkpointless.simulate.topology import JobShape, spans_all_replicas, switch_fallback_fraction


# --- checkpoint interval ------------------------------------------------------------------------
@pytest.mark.timeout(5)
def test_young_interval_is_sqrt_2cm() -> None:
    assert young_interval(10.0, 5000.0) == pytest.approx(math.sqrt(100_000.0))
    # Quadrupling the save cost doubles the interval.
    assert young_interval(40.0, 5000.0) == pytest.approx(2 * young_interval(10.0, 5000.0))


@pytest.mark.timeout(5)
def test_daly_close_to_young_when_save_is_cheap_and_capped_when_not() -> None:
    y, d = young_interval(10.0, 5000.0), daly_interval(10.0, 5000.0)
    assert d < y and d == pytest.approx(y, rel=0.03)
    assert daly_interval(300.0, 100.0) == 100.0  # save longer than 2 MTBF: interval = MTBF


@pytest.mark.timeout(5)
@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_interval_rejects_bad_inputs(bad: float) -> None:
    with pytest.raises(ConfigError, match="save_s"):
        young_interval(bad, 100.0)
    with pytest.raises(ConfigError, match="mtbf_s"):
        daly_interval(1.0, bad)


@pytest.mark.timeout(5)
def test_checkpoint_interval_whole_steps_and_cap() -> None:
    t = checkpoint_interval(IntervalRule.YOUNG, 10.0, 5000.0, step_s=7.0)
    assert t % 7.0 == pytest.approx(0.0) and abs(t - math.sqrt(100_000.0)) <= 3.5
    assert checkpoint_interval(IntervalRule.YOUNG, 10.0, 1e12, step_s=5.0, max_s=100.0) == 100.0
    assert checkpoint_interval(IntervalRule.YOUNG, 1e-6, 1.0, step_s=5.0) == 5.0  # never below one step


# --- expected loss per fault -------------------------------------------------------------------
def _one_cause(blast: Blast, detection: Detection = Detection.FAST, recurring: bool = False) -> FailureModel:
    # every repair comes back healthy: these tests are about one fault's own cost
    cause = FailureCause("only", 1.0, blast, detection, recurring)
    return FailureModel(causes=(cause,), bad_repair_fraction=0.0)


@pytest.mark.timeout(5)
def test_expected_loss_checkpoint_restart_is_restart_plus_half_interval() -> None:
    shape, cal = JobShape(gpus=2304), Calibration()
    restart = cal.detect_s + sum(p.seconds for p in restart_phases(shape, cal, 0.0))
    loss = expected_loss_per_fault(Policy.CHECKPOINT_RESTART, _one_cause(Blast.NODE), shape, cal, 1200.0)
    assert loss == pytest.approx(restart + 600.0)
    # A hang is only noticed at the watchdog timeout.
    hang = expected_loss_per_fault(
        Policy.CHECKPOINT_RESTART, _one_cause(Blast.NODE, Detection.HANG), shape, cal, 1200.0
    )
    assert hang - loss == pytest.approx(cal.hang_timeout_s - cal.detect_s)


@pytest.mark.timeout(5)
def test_expected_loss_checkpointless_half_step_unless_no_second_copy() -> None:
    shape, cal = JobShape(gpus=2304), Calibration()
    node = _one_cause(Blast.NODE)
    inproc = recovery_plan(
        Policy.CHECKPOINTLESS, node.causes[0], shape, cal, fallback=False, lost_state=True, spare_wait_s=0.0
    )
    loss = expected_loss_per_fault(Policy.CHECKPOINTLESS, node, shape, cal, 7200.0)
    assert loss == pytest.approx(sum(p.seconds for p in inproc) + (shape.step_s + cal.step_overhead_s) / 2)
    assert loss < 120.0  # the published "under 2 minutes" class of recovery
    # With a single copy of the state every node fault must go back to the checkpoint.
    single = replace(shape, replicas=1)
    loss1 = expected_loss_per_fault(Policy.CHECKPOINTLESS, node, single, cal, 7200.0)
    assert loss1 > 3600.0 + sum(p.seconds for p in restart_phases(single, cal, 0.0, cal.restart_model))


@pytest.mark.timeout(5)
def test_recurring_bug_pays_failed_retry_then_restart() -> None:
    shape, cal = JobShape(), Calibration()
    cause = _one_cause(Blast.JOB, recurring=True).causes[0]
    plan = recovery_plan(
        Policy.CHECKPOINTLESS, cause, shape, cal, fallback=True, lost_state=False, spare_wait_s=0
    )
    labels = [p.label for p in plan]
    assert "re-run step that fails again" in labels and "checkpoint load" in labels
    assert "peer state transfer" not in labels  # no rank lost its state


# --- scaling models ----------------------------------------------------------------------------
@pytest.mark.timeout(5)
def test_comm_start_models_scale_as_documented() -> None:
    cal = Calibration()
    lin = [comm_start_s(CommModel.STORE_LINEAR, 2.0, n, cal) for n in (1024, 2048)]
    log = [comm_start_s(CommModel.ROOTLESS_LOG, 2.0, n, cal) for n in (1024, 2048)]
    assert lin[1] - lin[0] == pytest.approx(1024 * cal.store_per_rank_s)
    assert log[1] - log[0] == pytest.approx(cal.rootless_log_s)
    assert comm_start_s(CommModel.ROOTLESS_CONST, 2.0, 16384, cal) == 2.0
    # The published order of magnitude: store-based start-up of ~8k ranks takes minutes.
    assert 60.0 < comm_start_s(CommModel.STORE_LINEAR, cal.init_s, 8192, cal) < 300.0


# --- placement and fallback --------------------------------------------------------------------
@pytest.mark.timeout(5)
def test_spans_all_replicas() -> None:
    shape = JobShape(gpus=64)  # 8 nodes, two groups of 4: node i and i+4 hold the same shard
    assert not spans_all_replicas([0], shape)
    assert not spans_all_replicas([0, 1, 2, 3], shape)  # a whole replica group, the other intact
    assert spans_all_replicas([1, 5], shape)
    assert not spans_all_replicas([1, 6], shape)
    assert spans_all_replicas([3], replace(shape, replicas=1))


@pytest.mark.timeout(5)
def test_switch_faults_fall_back_only_when_a_switch_spans_replicas() -> None:
    assert switch_fallback_fraction(JobShape(gpus=16)) == 1.0  # 2 nodes behind one switch
    assert switch_fallback_fraction(JobShape(gpus=2304)) == 0.0
    small = FailureModel(causes=(FailureCause("sw", 1.0, Blast.SWITCH),))
    assert fallback_probability(small, JobShape(gpus=16)) == 1.0
    # at 2,304 GPUs only a recurring bug falls back, and only with --fresh-process-retries 0
    share = next(c.weight for c in LLAMA3_CAUSES if c.recurring) / sum(c.weight for c in LLAMA3_CAUSES)
    stop = CapacityPolicy(after_retries=AfterRetries.STOP)
    assert fallback_probability(FailureModel(), JobShape(gpus=2304), stop) == pytest.approx(share)
    assert fallback_probability(FailureModel(), JobShape(gpus=2304)) == 0.0


@pytest.mark.timeout(5)
def test_job_shape_validation_names_the_value() -> None:
    with pytest.raises(ConfigError, match="gpus=100"):
        JobShape(gpus=100)
    with pytest.raises(ConfigError, match="spare_fraction"):
        JobShape(spare_fraction=2.0)
    assert JobShape(gpus=2304).spares == math.ceil(288 * 0.02)
    assert JobShape(gpus=16, hbm_gb=80).state_gb_per_gpu == 80.0  # capped at the GPU's memory


# --- failure model and traces ------------------------------------------------------------------
@pytest.mark.timeout(5)
def test_llama3_rate_and_mix() -> None:
    model = FailureModel()
    assert sum(c.weight for c in model.causes) == pytest.approx(419)
    # 16,384 GPUs: one interruption every ~3.1 h, as reported.
    assert model.job_mtbf_s(16384) / 3600 == pytest.approx(54 * 24 / 419)
    assert pytest.approx(1.97e-5, rel=0.01) == LLAMA3_RATE_PER_GPU_HOUR
    hang = next(c for c in model.causes if c.detection is Detection.HANG)
    assert hang.weight / 419 == pytest.approx(0.017, abs=0.001)
    with pytest.raises(ConfigError, match="rate_per_gpu_hour"):
        FailureModel(rate_per_gpu_hour=0.0)


@pytest.mark.timeout(10)
def test_sample_faults_seeded_and_poisson() -> None:
    model, shape = FailureModel(), JobShape(gpus=16384)
    horizon = 200 * 86400.0
    a, b = sample_faults(model, shape, horizon, 7), sample_faults(model, shape, horizon, 7)
    assert a == b
    assert a != sample_faults(model, shape, horizon, 8)
    expected = horizon / model.job_mtbf_s(shape.gpus)
    assert abs(len(a) - expected) < 4 * math.sqrt(expected)
    assert all(x.time_s < y.time_s for x, y in itertools.pairwise(a))
    for f in a:
        blast = model.causes[f.cause].blast
        assert (blast is Blast.JOB) == (f.nodes == ())
        assert all(0 <= n < shape.nodes for n in f.nodes)
    # Same seed, double rate: the same causes and places, at half the times.
    fast = sample_faults(replace(model, rate_per_gpu_hour=2 * model.rate_per_gpu_hour), shape, horizon, 7)
    assert [(f.cause, f.nodes) for f in fast[:50]] == [(f.cause, f.nodes) for f in a[:50]]
    assert fast[10].time_s == pytest.approx(a[10].time_s / 2)


# --- calibration -------------------------------------------------------------------------------
@pytest.mark.timeout(5)
def test_calibration_file_overrides_named_costs(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(
        json.dumps(
            {
                "detect_s": 1.5,
                "rebuild_s": 0.03,
                "save_s": 0.4,
                "_machine": "2 cores",
                "rebuild_model": "rootless-log",
            }
        )
    )
    cal = load_calibration(path)
    assert (cal.detect_s, cal.rebuild_s, cal.save_s) == (1.5, 0.03, 0.4)
    assert cal.rebuild_model is CommModel.ROOTLESS_LOG
    assert cal.restart_s == Calibration().restart_s  # unnamed keys keep their defaults


@pytest.mark.timeout(5)
def test_calibration_transfer_bytes_sets_bandwidth() -> None:
    cal = calibration_from_mapping({"transfer_s": 0.5, "transfer_bytes": 2e9})
    assert cal.peer_gbps == pytest.approx(4.0) and cal.transfer_s == 0.0


@pytest.mark.timeout(5)
@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"detect": 1.0}, "unknown calibration key 'detect'"),
        ({"abort_s": -1.0}, "abort_s=-1.0"),
        ({"peer_gbps": 0}, "peer_gbps=0"),
        ({"save_s": "fast"}, "save_s='fast'"),
        ({"init_model": "magic"}, "init_model='magic'"),
        ({"transfer_bytes": 1e9}, "transfer_bytes"),
    ],
)
def test_calibration_rejects_bad_values(data: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        calibration_from_mapping(data)


@pytest.mark.timeout(5)
def test_calibration_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_calibration(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_calibration(bad)


@pytest.mark.timeout(5)
def test_detection_by_cause() -> None:
    cal = Calibration(detect_s=3.0, hang_timeout_s=99.0)
    assert detect_s(FailureCause("a", 1, Blast.NODE), cal) == 3.0
    assert detect_s(FailureCause("b", 1, Blast.NODE, Detection.HANG), cal) == 99.0
    assert Bucket.PRODUCTIVE.value == "productive"
