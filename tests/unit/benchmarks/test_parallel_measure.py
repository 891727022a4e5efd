"""benchmarks/parallel_measure.py's readers: the step gaps that the step-time ratio is made of leave
out a torchrun baseline's DCP saves (else (a) would be compared with checkpointing, not with plain
torchrun), and a job that ``--jobs`` leaves out keeps its figures, dated, instead of vanishing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks" / "baseline"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import parallel_measure as pm


def write_log(run_dir: Path, rank: int, events: list[dict[str, object]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"rank": rank, **e}) for e in events]
    (run_dir / f"rank-{rank}.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.timeout(30)
def test_step_gaps_leave_out_warm_up_and_the_gap_that_holds_a_save(tmp_path: Path) -> None:
    # steps 0..7 one second apart on rank 0; rank 1 commits 0.1 s later (the step is done when
    # the last rank commits); a save after step 5 ("step 6") makes the gap 5 -> 6 last 3 s
    times = {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0, 6: 8.0, 7: 9.0}
    for rank, lag in ((0, 0.0), (1, 0.1)):
        events: list[dict[str, object]] = [
            {"time": t + lag, "event": "commit", "step": s} for s, t in times.items()
        ]
        events.append({"time": 5.5, "event": "save", "step": 6})
        write_log(tmp_path, rank, events)
    assert pm.step_gaps(tmp_path) == [1.0, 1.0, 1.0]  # 3->4, 4->5, 6->7; not 5->6


@pytest.mark.timeout(30)
def test_the_ratio_of_equal_designs_is_one_and_its_interval_holds_one() -> None:
    gaps = [0.10, 0.11, 0.09, 0.10, 0.12, 0.10, 0.095]
    r = pm.median_ratio(gaps, list(gaps))
    assert r["ratio"] == 1.0
    assert r["lo"] <= 1.0 <= r["hi"]
    assert pm.median_ratio(gaps[:2], gaps)["ratio"] is None  # too few gaps: no figure, no guess


@pytest.mark.timeout(30)
def test_a_job_left_out_keeps_its_figures_with_the_run_that_made_them(tmp_path: Path) -> None:
    machine = {"date": "2026-12-07T02:42:09+00:00", "git": "531bc9f"}
    legacy = {  # the result file from before the PP job: the 3-D job at the top level
        "command": "python benchmarks/parallel_recovery.py",
        "machine": machine,
        **{k: {"k": k} for k in ("params", "summary", "tables", "notes", "runs")},
    }
    path = tmp_path / "parallel_recovery.json"
    path.write_text(json.dumps(legacy))
    kept = pm.carried_jobs(path, ["pp"])
    assert list(kept) == ["3d"]
    assert kept["3d"]["summary"] == {"k": "summary"}
    assert kept["3d"]["measured"] == {"command": legacy["command"], **machine}
    assert pm.carried_jobs(path, ["3d", "pp"]) == {}  # both rerun: nothing old is kept
    assert pm.carried_jobs(tmp_path / "absent.json", ["pp"]) == {}


@pytest.mark.timeout(30)
def test_one_repeat_decides_no_step_time_target() -> None:
    # a tight interval over one run's gaps is not the spread between runs: no verdict from it
    one = {"ratio": {"ratio": 0.9, "lo": 0.85, "hi": 0.95, "n": [30, 30]},
           "paired": {"median": 0.9, "min": 0.9, "max": 0.9, "n": 1}}  # fmt: skip
    assert "undecided, one repeat" in pm.step_note("PP", one)
    three = {**one, "paired": {"median": 0.9, "min": 0.8, "max": 1.2, "n": 3}}
    assert "target ≤ 1.02: undecided;" in pm.step_note("PP", three)  # the repeats reach past 1.02
    met = {**one, "paired": {"median": 0.9, "min": 0.88, "max": 0.97, "n": 3}}
    assert "target ≤ 1.02: met;" in pm.step_note("PP", met)


@pytest.mark.timeout(30)
def test_cpu_per_step_leaves_out_a_save_and_the_gaps_beside_it(tmp_path: Path) -> None:
    # steps 0..14 one second apart, but the save after step 5 ("step 6") takes 3 s and 5 s of
    # CPU; outside it the job burns 0.5 s of CPU a second, sampled every 0.2 s
    times = {s: float(s) if s <= 5 else s + 2.0 for s in range(15)}
    for rank in (0, 1):
        events: list[dict[str, object]] = [
            {"time": t, "event": "commit", "step": s} for s, t in times.items()
        ]
        events.append({"time": 5.5, "event": "save", "step": 6})
        write_log(tmp_path, rank, events)

    def cpu(t: float) -> float:
        return 0.5 * t + 5.0 * min(max(t - 5.0, 0.0), 3.0) / 3.0

    samples = [(i * 0.2, cpu(i * 0.2)) for i in range(int(16.8 / 0.2) + 1)]
    (tmp_path / "cpu.json").write_text(json.dumps({"samples": samples, "method": "test", "error": None}))
    got = pm.step_cpu(tmp_path)
    assert got["cpu_per_step_s"] == pytest.approx(0.5)  # the save's 5 s counted in no step
    assert got["cpu_gaps"] == 8  # 3->4 and 7->8 .. 13->14; not 4->5, 5->6 (the save), 6->7
    (tmp_path / "cpu.json").write_text(json.dumps({"samples": samples, "method": "x", "error": "lost"}))
    assert pm.step_cpu(tmp_path) == {"cpu_per_step_s": None, "cpu_error": "lost"}  # no figure, no guess


@pytest.mark.timeout(30)
def test_the_cpu_ratio_needs_three_repeats_for_a_verdict() -> None:
    def step(pairs: list[tuple[float, float]]) -> dict[str, object]:
        ours, theirs = [a for a, _ in pairs], [b for _, b in pairs]
        paired = [a / b for a, b in pairs]
        cpu = {"a": pm.bl.summary(ours), "b10": pm.bl.summary(theirs), "paired": pm.bl.summary(paired)}
        return {"cpu": {**cpu, "ratio": pm.bl.ratio_ci(paired)}}

    assert "undecided (fewer than 3 rounds)" in pm.cpu_note("PP", step([(0.101, 0.1), (0.1, 0.1)]))
    assert ": met;" in pm.cpu_note("PP", step([(0.1, 0.1), (0.1005, 0.1), (0.1, 0.1002)]))
    assert ": NOT met;" in pm.cpu_note("PP", step([(0.12, 0.1), (0.118, 0.1), (0.121, 0.1)]))
    assert "not measured" in pm.cpu_note("PP", {"cpu": {"paired": {"n": 0}}})
