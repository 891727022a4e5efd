"""Degraded mode, end to end (issue 39): a DDP job of 4 ranks with no spares loses rank 2, goes
on with 3 (rank 0 trains slot 2's micro-batch as a second pass of each step, and takes part in
the gradient all-reduce as slot 2's rank too), then grows back to 4 once the spare it started is
ready; every rank ends with bitwise the fault-free run's weights, and every (slot, step) trained
the fault-free run's batch. With --min-replicas 4 the same loss, with a spare that never comes,
fails the job with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import SCRIPTS, JobResult, run_job
from tests.helpers.reference import ReferenceRuns

pytestmark = pytest.mark.timeout(150)

SCRIPT = SCRIPTS / "degraded_dp.py"
# long enough after the kill at step 10 (50 steps of >= 50 ms) for the spare the coordinator
# starts to be ready before the job ends, also on 2 loaded cores (30 x 30 ms was not, once)
STEPS = 60
ARGS = ["--steps", str(STEPS), "--sleep", "0.05"]


NOWHERE = Path("/nonexistent")  # the script makes its data in memory


def _run(tmp_path: Path, name: str, extra: list[str], faults: list[str], args: list[str] = ARGS) -> JobResult:
    return run_job(
        tmp_path / name,
        NOWHERE,
        nproc=4,
        spares=0,
        faults=faults,
        extra=extra,
        script=SCRIPT,
        script_args=args,
        timeout=120,
    )


def test_a_lost_rank_shrinks_the_job_then_a_spare_grows_it_back_bitwise(
    tmp_path: Path, reference: ReferenceRuns
) -> None:
    ref = reference(4, data=NOWHERE, script=SCRIPT, script_args=ARGS, timeout=120)
    res = _run(tmp_path, "degraded", ["--when-no-spare", "shrink"], ["kill:rank=2:step=10"])
    assert res.rc == 0, res.output[-4000:]
    widths = [e["width"] for e in res.events() if e["event"] == "width"]
    assert widths == [3, 4], f"expected to shrink to 3 and grow back to 4: {widths}"
    plans = [e for e in res.events() if e["event"] == "plan" and e.get("holders")]
    assert plans and plans[0]["holders"] == [[2, 0]], plans
    assert [e["rank"] for e in res.events() if e["event"] == "grow"] == [2]
    res.assert_same_weights(ref, 4)
    want = ref.trained_batches()
    assert sorted(want) == [(slot, step) for slot in range(4) for step in range(STEPS)]
    assert res.trained_batches() == want, "a (slot, step) trained another batch than without the fault"


def test_below_min_replicas_the_job_fails_with_the_reason(tmp_path: Path) -> None:
    res = _run(
        tmp_path,
        "floor",
        ["--when-no-spare", "shrink", "--min-replicas", "4", "--spare-wait", "2"],
        ["kill:rank=2:step=5"],
        [*ARGS, "--spares-never-ready"],
    )
    assert res.rc == 1, res.output[-3000:]
    (end,) = [e for e in res.events() if e["event"] == "job_end"]
    assert "going on would leave 3 of 4 replicas, fewer than --min-replicas 4" in end["error"], end
    assert not [e for e in res.events() if e["event"] == "width"]
