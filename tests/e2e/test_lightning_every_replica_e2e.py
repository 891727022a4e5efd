"""A Lightning job that loses every replica, twice, and restores its snapshot or its durable
checkpoint each time, bitwise.

tests/scripts/lightning_every_replica.py on 2 ranks and 2 spares, 16 steps (an epoch is 12), two
faults in one job:

- at step 4 every process is SIGKILLed at once (``--inject killall:step=4``: as step 4 begins,
  each rank waits for the other and for the copy of step 4 to be written, then kills itself): no
  process is left, and both spares restore the copy and seek a fresh Lightning loop to step 4;
- at step 13 both ranks raise half-way through their update (the script's planted fault): both
  processes live, but neither holds a whole state, so the job goes back to its copy of step 12
  (or 8), and each rank, its Lightning loop past that step, leaves (``LoopAheadOfState``) for a
  spare that seeks to it.

Where the copies come from (``CASES``): in ``make test``, ``--snapshot-every 6 --checkpoint-every
4``: the kill goes back to the durable checkpoint of step 4 (newer than every snapshot), the
fault in step 13 to the shared-memory snapshot of step 12 (a tie with the checkpoint of 12, if it
is published yet, goes to the snapshot). Under ``make soak`` the job also runs with snapshots
alone (``--snapshot-every 2``) and with the checkpoint alone (``--snapshot-every 0``: step 13's
fault goes back to the newest checkpoint published by then, 12, or 8 while rank 0's save of 12,
off the training thread, was not finished).

Every rank must end with the fault-free run's weights, optimizer state, learning rate, callback
state and ``global_step``; every (rank, step) trained on the fault-free run's batch (the steps
the restores redo included); and each process read exactly the samples of the batches it trained.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, JobResult, start_job
from tests.helpers.reference import ReferenceRuns

pytest.importorskip("lightning", reason="the `lightning` extra is not installed")

SCRIPT = ROOT / "tests" / "scripts" / "lightning_every_replica.py"
ARGS = ["--steps", "16", "--print-batches"]
PER_EPOCH = 12  # batches of 2 per rank: 48 samples over 2 ranks


def fault_free(reference: ReferenceRuns) -> JobResult:
    """The fault-free run (no spare, no fault), made once for every case."""
    return reference(2, script=SCRIPT, script_args=ARGS)


def run_faulted(run_dir: Path, corpus: Path, extra: list[str]) -> JobResult:
    """Both faults in one job: every process killed as step 4 begins, once the copy of step 4
    (a snapshot or a durable checkpoint, whichever is due) is written and both ranks are there,
    and every rank failing in its update of step 13 (once per rank: a marker file)."""
    markers = run_dir.parent / "markers"
    markers.mkdir()
    args = [*ARGS, "--fail-update", "13", "--marker-dir", str(markers)]
    kill = ["killall:step=4"]
    return start_job(run_dir, corpus, 2, 2, kill, extra, script_args=args, script=SCRIPT).finish(150)


def check_bitwise(res: JobResult, ref: JobResult, targets: list[int]) -> None:
    """What every case must show: the fault-free run's end on every rank, its batch at every
    (rank, step), every rank replaced twice, and each replacement put at its restored step by a
    seek (no sample before it read) and reading only what it trained."""
    assert res.rc == 0, res.output[-6000:]
    assert sorted(e["rank"] for e in res.of("fault_injected") if e["kind"] == "killall") == [0, 1]
    left = sorted(f["rank"] for f in res.of("fault") if "LoopAheadOfState" in f.get("detail", ""))
    assert left == [0, 1], res.output[-6000:]
    assert sorted(e["rank"] for e in res.of("spare_assigned")) == [0, 0, 1, 1], res.of("spare_assigned")
    res.assert_same_weights(ref, nproc=2)  # weights, optimizer, lr, callback state, global_step
    assert res.trained_batches() == ref.trained_batches(), (
        "some rank trained on other samples than the fault-free run"
    )
    for target in targets:
        epoch, batch = divmod(target, PER_EPOCH)
        assert res.output.count(f"by seeking to epoch {epoch}, batch {batch} ") == 2, res.output[-6000:]
    reads = re.findall(r"reads rank=(\d+) samples=(\d+) trained=(\d+)x2", res.output)
    assert sorted(int(r) for r, _, _ in reads) == [0, 1], res.output[-4000:]
    assert all(int(s) == 2 * int(t) for _, s, t in reads), reads
    assert not res.left_behind(), "processes of the job were left behind"


@dataclass(frozen=True)
class Case:
    """Where the job keeps its copies, and where each fault is expected to go back to."""

    extra: tuple[str, ...]
    kill_from: str  # "snapshot" or "checkpoint": the source the kill's restore reads
    fault_from: str  # the source of the restore after step 13's fault
    fault_targets: tuple[int, ...]  # the steps it may go back to


CASES = [
    pytest.param(
        Case(("--snapshot-every", "6", "--checkpoint-every", "4"), "checkpoint", "snapshot", (12,)),
        id="checkpoint-then-snapshot",
    ),
    pytest.param(
        Case(("--snapshot-every", "2"), "snapshot", "snapshot", (12,)),
        id="snapshots", marks=pytest.mark.soak,
    ),
    pytest.param(
        Case(("--snapshot-every", "0", "--checkpoint-every", "4"), "checkpoint", "checkpoint", (8, 12)),
        id="checkpoints", marks=pytest.mark.soak,
    ),
]  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_lightning_job_that_loses_every_replica_restores_bitwise(
    tmp_path: Path, corpus: Path, reference: ReferenceRuns, case: Case
) -> None:
    ref = fault_free(reference)
    res = run_faulted(tmp_path / "run", corpus, list(case.extra))
    # the restore after step 13's fault may be planned again once the ranks that left are
    # replaced (no process holds a state then either)
    plans = [
        ("snapshot" if p.get("from_snapshot") else "checkpoint", p["target_step"], p["receivers"])
        for p in res.of("plan")
        if p.get("from_snapshot") or p.get("from_checkpoint")
    ]
    assert plans[:1] == [(case.kill_from, 4, [0, 1])], res.of("plan")
    later = plans[1:]
    assert later and all(src == case.fault_from and r == [0, 1] for src, _, r in later), res.of("plan")
    # the spares seek to the last plan's step (an earlier one saw only ranks that then left)
    assert all(t in case.fault_targets for _, t, _ in later), res.of("plan")
    transports = [
        e["transport"] for e in res.of("recovery") if e.get("transport") in ("snapshot", "checkpoint")
    ]
    assert transports[:1] == [case.kill_from], res.of("recovery")
    check_bitwise(res, ref, [4, later[-1][1]])
