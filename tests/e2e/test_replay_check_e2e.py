"""A replayed step whose loss differs from its interrupted attempt's is reported as the job runs
(recovery/replay_check.py, issue 38), and a faithful replay is not.

tests/scripts/replay_loss.py records an all-reduced loss after its forward; rank 1 is SIGKILLed
in its backward of step 4, after that all-reduce: rank 0 recorded the interrupted attempt's loss
and waits in the gradient all-reduce, nobody updated, so the recovery replays step 4 with a spare
as rank 1. With a time-seeded data order (the planted non-determinism) the spare trains other
samples than the killed rank did; with an order seeded from the rank it trains the same ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import SCRIPTS, JobResult, run_job

NOWHERE = Path("/nonexistent")
SCRIPT = SCRIPTS / "replay_loss.py"
KILL = "kill:rank=1:step=4:site=backward"


def _run(tmp_path: Path, order: str) -> JobResult:
    args = ["--steps", "8", "--order", order]
    res = run_job(tmp_path / "run", NOWHERE, 2, 1, [KILL], script=SCRIPT, script_args=args, timeout=120)
    assert res.rc == 0, res.output[-6000:]
    assert res.fired(KILL) and res.of("spare_assigned"), res.output[-4000:]
    assert not res.left_behind(), "processes of the job were left behind"
    return res


def _replayed_step_4(res: JobResult) -> dict[str, object]:
    """Rank 0's commit of step 4 (the survivor's replay: it was interrupted, never committed)."""
    commits = [e for e in res.commits() if (e["rank"], e["step"]) == (0, 4)]
    assert len(commits) == 1, commits
    return commits[0]


@pytest.mark.timeout(200)
def test_a_time_seeded_replacement_is_reported_as_it_replays(tmp_path: Path) -> None:
    res = _run(tmp_path, "time")
    assert _replayed_step_4(res).get("replay_loss") == "differs", res.commits()
    events = res.of("replay_differs")
    assert [(e["rank"], e["step"]) for e in events] == [(0, 4)], events
    assert events[0]["interrupted"] != events[0]["replayed"], events
    end = res.of("job_end")[-1]
    assert [(x["rank"], x["step"], x["what"]) for x in end["inexact"]] == [(0, 4, "replay")], end
    assert "may differ from the run without the faults" in res.output, res.output[-3000:]


@pytest.mark.timeout(200)
def test_a_faithful_replay_is_checked_and_not_reported(tmp_path: Path) -> None:
    res = _run(tmp_path, "fixed")
    assert _replayed_step_4(res).get("replay_loss") == "same", res.commits()  # the check ran
    assert not res.of("replay_differs"), res.of("replay_differs")
    assert not res.of("job_end")[-1]["inexact"], res.of("job_end")[-1]
    assert "replayed to loss" not in res.output, res.output[-3000:]
    # the ranks agree on every step's (all-reduced) loss, the replay's included
    losses: dict[int, set[float]] = {}
    for e in res.commits():
        losses.setdefault(e["step"], set()).add(e["loss"])
    assert sorted(losses) == list(range(8)) and all(len(v) == 1 for v in losses.values()), losses
