"""The audit's judgement (checkpointless/audit/compare.py) and its fault choice, without processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpointless.audit.compare import (
    Difference,
    Fingerprint,
    RunPrints,
    first_difference,
    judge,
    parse_lines,
)
from checkpointless.audit.run import AuditSettings, choose_faults, command
from checkpointless.errors import ConfigError

pytestmark = pytest.mark.timeout(30)


def run(label: str, steps: int = 4, ranks: int = 2, fault: str | None = None, **changes: str) -> RunPrints:
    """A run whose (rank, step) has state "s{step}" and grads "g{step}"; ``changes`` maps
    "state_R_S" / "grads_R_S" to another value."""
    out = RunPrints(label, fault)
    for s in range(steps):
        for r in range(ranks):
            state = changes.get(f"state_{r}_{s}", f"s{s}")
            grads = changes.get(f"grads_{r}_{s}", f"g{s}")
            out.add(Fingerprint(s, r, state, grads))
    return out


def test_equal_runs_have_no_difference_and_the_report_is_ok() -> None:
    assert first_difference(run("a"), run("b")) is None
    rep = judge(run("a"), run("b"), [run("f", fault="kill:rank=1:step=2")])
    assert rep.ok and rep.deterministic and rep.steps == 4 and rep.ranks == 2


def test_the_first_difference_is_the_earliest_step_then_the_lowest_rank() -> None:
    other = run("b", grads_1_1="x", state_0_2="y", state_1_3="z")
    assert first_difference(run("a"), other) == Difference(1, 1, "grads")
    assert first_difference(run("a"), run("b", state_0_2="y")) == Difference(2, 0, "state")


def test_the_inputs_are_compared_before_the_gradients_and_name_the_data_order() -> None:
    a, b = run("a"), run("b")
    a.add(Fingerprint(4, 0, "s4", "g4", "batch"))
    b.add(Fingerprint(4, 0, "s4", "other-grads", "other-batch"))
    assert first_difference(a, b) == Difference(4, 0, "inputs")
    (f,) = judge(a, b, []).findings
    assert "batch" in f.cause and "not a function of the step" in f.cause
    faulted = run("f", fault="kill:rank=0:step=3")
    faulted.add(Fingerprint(4, 0, "s4", "g4", "other-batch"))
    same = run("b2")
    same.add(Fingerprint(4, 0, "s4", "g4", "batch"))
    (g,) = judge(a, same, [faulted]).findings
    assert g.difference == Difference(4, 0, "inputs") and "step.index" in g.cause


def test_a_missing_step_and_a_recommitted_step_that_differs_count() -> None:
    short = run("b", steps=3)
    assert first_difference(run("a"), short) == Difference(3, 0, "missing")
    again = run("b")
    again.add(Fingerprint(2, 1, "other", "g2"))  # committed again after a recovery, differently
    assert first_difference(run("a"), again) == Difference(2, 1, "state")


def test_fault_free_runs_that_differ_are_reported_and_no_fault_run_is_judged() -> None:
    rep = judge(run("a"), run("b", grads_0_0="t"), [run("f", fault="kill:rank=0:step=2", state_1_3="q")])
    assert not rep.ok and not rep.deterministic
    (f,) = rep.findings
    assert f.label == "b" and f.difference == Difference(0, 0, "grads")
    assert "not deterministic without faults" in f.cause and "time" in f.cause


def test_a_faulted_run_names_its_fault_and_the_likely_cause() -> None:
    bad = run("f", fault="raise:rank=1:step=2", grads_1_2="x")
    rep = judge(run("a"), run("b"), [bad, run("g", fault="kill:rank=0:step=3")])
    assert rep.deterministic and not rep.ok
    (f,) = rep.findings
    assert (f.label, f.fault, f.difference) == ("f", "raise:rank=1:step=2", Difference(2, 1, "grads"))
    assert "job.track()" in f.cause and "job.generator" in f.cause


def test_a_difference_before_the_fault_says_the_script_is_flaky() -> None:
    rep = judge(run("a"), run("b"), [run("f", fault="kill:rank=0:step=3", state_0_1="x")])
    assert "before the fault" in rep.findings[0].cause


def test_a_failed_run_and_a_fault_that_never_fired_are_findings() -> None:
    failed = run("a")
    failed.rc = 1
    assert not judge(failed, run("b"), []).ok
    unfired = run("f", fault="kill:rank=0:step=3")
    unfired.fired = False
    (f,) = judge(run("a"), run("b"), [unfired]).findings
    assert "never fired" in f.cause


def test_parse_lines_reads_the_fingerprint_files_format() -> None:
    lines = [
        '{"step": 3, "rank": 1, "state": "ab", "grads": null, "inputs": "x"}',
        "",
        '{"step": 0, "rank": 0, "state": "cd", "grads": "ef"}',
    ]
    assert parse_lines(lines) == [Fingerprint(3, 1, "ab", None, "x"), Fingerprint(0, 0, "cd", "ef")]


def test_faults_are_drawn_from_the_seed_within_the_steps_and_ranks() -> None:
    faults = choose_faults(20, steps=8, nproc=3, seed=5)
    assert faults == choose_faults(20, steps=8, nproc=3, seed=5)
    for f in faults:
        kind, rank, step = f.split(":")
        assert kind in ("kill", "raise")
        assert 0 <= int(rank.removeprefix("rank=")) < 3 and 2 <= int(step.removeprefix("step=")) <= 7


@pytest.mark.parametrize(
    ("field", "value", "word"),
    [("nproc", 1, "--nproc"), ("steps", 2, "--steps"), ("fault_runs", -1, "--fault-runs")],
)
def test_bad_settings_name_the_bad_value(tmp_path: Path, field: str, value: int, word: str) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(ConfigError, match=word):
        AuditSettings(script, (), **{field: value}).check()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not a file"):
        AuditSettings(tmp_path / "missing.py", ()).check()


def test_the_run_command_gives_each_run_its_folder_and_a_spare_only_with_a_fault(tmp_path: Path) -> None:
    s = AuditSettings(tmp_path / "t.py", ("--out", "{run}/snap.pt", "--steps", "50"), nproc=3)
    free = command(s, tmp_path / "fault-free-1", None)
    assert free[free.index("--nproc") + 1] == "3" and free[free.index("--spares") + 1] == "0"
    assert "--inject" not in free
    assert free[-4:] == ["--out", f"{tmp_path}/fault-free-1/snap.pt", "--steps", "50"]
    faulted = command(s, tmp_path / "fault-1", "kill:rank=1:step=3")
    assert faulted[faulted.index("--inject") + 1] == "kill:rank=1:step=3"
    assert faulted[faulted.index("--spares") + 1] == "1"
    assert faulted[faulted.index("--run-dir") + 1] == str(tmp_path / "fault-1" / "run")
