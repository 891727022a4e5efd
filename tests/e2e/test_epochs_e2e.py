"""job.epochs() through recoveries that cross an epoch's end (tests/scripts/epochs_sched.py).

3 ranks, 48 samples in batches of 4: 4 steps per epoch, 3 epochs. Rank 1 is killed 1 s after its
update of step 3, the last of epoch 0; the others have applied theirs and wait in the metric's
all-reduce after it, so the recovery resumes at step 4 (rolled forward). The survivors
step their scheduler for epoch 0 as they leave the recovery, after they sent the replacement its
state: the replacement must step it too, or it trains epoch 1 at epoch 0's learning rate.

The other way: FSDP 1x2 without buddy copies, a snapshot every 4 steps and 6 steps per epoch.
Rank 1 is killed at step 7 (epoch 1); its shard exists only in the snapshot of step 4 (epoch 0),
so both ranks roll back there. The survivor leaves epoch 1's inner loop and its scheduler step
(the per-epoch work) runs as it does; that step must change nothing, or every later epoch trains
at half the learning rate of the fault-free run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, run_job

SCRIPT = ROOT / "tests" / "scripts" / "epochs_sched.py"
NOWHERE = Path("/nonexistent")


@pytest.mark.timeout(300)
def test_a_rolled_forward_epoch_end_steps_the_replacements_scheduler_too(tmp_path: Path) -> None:
    ref = run_job(tmp_path / "ref", NOWHERE, nproc=3, spares=0, script=SCRIPT, script_args=[])
    assert ref.rc == 0 and ref.digest is not None, ref.output[-4000:]
    # (not `kill:...:site=optimizer`: an abort could reach a slow survivor before its own update,
    # and that rank would then receive too, a plan that does not roll forward everywhere)
    res = run_job(tmp_path / "run", NOWHERE, 3, 1, script=SCRIPT, script_args=["--die-after-update", "3"])
    assert res.rc == 0, res.output[-6000:]
    plans = [p for p in res.of("plan") if p["generation"] > 0]
    assert plans and plans[0]["target_step"] == 4 and plans[0]["receivers"] == [1], plans
    assert [e["rank"] for e in res.of("spare_assigned")] == [1]
    res.assert_same_weights(ref, 3)
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.timeout(300)
def test_a_rollback_to_an_earlier_epoch_undoes_the_abandoned_epochs_work(tmp_path: Path) -> None:
    fsdp = ["--mesh", "1,2"]
    ref = run_job(tmp_path / "ref", NOWHERE, nproc=2, spares=0, script=SCRIPT, script_args=fsdp)
    assert ref.rc == 0 and len(ref.digests) == 2, ref.output[-4000:]
    res = run_job(
        tmp_path / "run", NOWHERE, 2, 1, script=SCRIPT, script_args=fsdp, faults=["kill:rank=1:step=7"],
        extra=["--buddy-copies", "off", "--snapshot-every", "4"],
    )  # fmt: skip
    assert res.rc == 0, res.output[-6000:]
    plans = [p for p in res.of("plan") if p["generation"] > 0]
    assert plans and plans[0]["target_step"] == 4 and plans[0].get("own_snapshot") == [0, 1], plans
    assert res.digests == ref.digests, "every rank's shards must equal the fault-free run's"
    assert "rank 0 abandoned epoch 1" in res.output, "the survivor's epoch 1 was left by a rollback"
    assert "abandoned epoch" not in ref.output
    assert "marked abandoned" not in res.output, "the replayed epoch is not abandoned"
    assert not res.left_behind(), "processes of the job were left behind"
