"""A Lightning job that loses every replica, twice, and restores its snapshot each time, bitwise.

tests/scripts/lightning_every_replica.py on 2 ranks and 2 spares, 16 steps (an epoch is 12),
``--snapshot-every 2``:

- at step 4 every process is SIGKILLed at once (rank 0 sleeps 4 s as step 4 begins, the snapshot
  of step 4 is written meanwhile, rank 1 waits for it in the all-reduce): no process is left, and
  both spares restore the snapshot and seek a fresh Lightning loop to step 4;
- at step 13 both ranks raise half-way through their update (the script's planted fault): both
  processes live, but neither holds a whole state, so the job goes back to the snapshot of step
  12, and each rank, its Lightning loop past step 12, leaves (``LoopAheadOfState``) for a spare
  that seeks to step 12, the first batch of the second epoch.

Every rank must end with the fault-free run's weights, optimizer state, learning rate, callback
state and ``global_step``; every (rank, step) trained on the fault-free run's batch (the steps
the restores redo included); and each process read exactly the samples of the batches it trained.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, JobResult, alive, kill_every_rank_after_snapshot, start_job

pytest.importorskip("lightning", reason="the `lightning` extra is not installed")

SCRIPT = ROOT / "tests" / "scripts" / "lightning_every_replica.py"
ARGS = ["--steps", "16", "--print-batches"]


def run(run_dir: Path, corpus: Path, faults: list[str], spares: int, extra: list[str]) -> JobResult:
    job = start_job(run_dir, corpus, 2, spares, faults, extra, script_args=extra_args(run_dir), script=SCRIPT)
    return job.finish(150)


def extra_args(run_dir: Path) -> list[str]:
    if run_dir.name == "ref":
        return ARGS
    markers = run_dir.parent / "markers"
    markers.mkdir(exist_ok=True)
    return [*ARGS, "--fail-update", "13", "--marker-dir", str(markers)]


@pytest.mark.timeout(300)
def test_lightning_job_that_loses_every_replica_restores_its_snapshot_bitwise(
    tmp_path: Path, corpus: Path
) -> None:
    ref = run(tmp_path / "ref", corpus, [], 0, [])
    assert ref.rc == 0 and sorted(ref.digests) == [0, 1], ref.output[-4000:]
    run_dir = tmp_path / "run"
    stop = threading.Event()
    killer = threading.Thread(target=kill_every_rank_after_snapshot, args=(run_dir, 4, stop, 2), daemon=True)
    killer.start()
    try:
        res = run(run_dir, corpus, ["slow:rank=0:step=4:seconds=4"], 2, ["--snapshot-every", "2"])
    finally:
        stop.set()
        killer.join(timeout=5)
    assert res.rc == 0, res.output[-6000:]
    # the restore of step 12 may be planned again once the ranks that left are replaced (no
    # process holds a state then either)
    plans = [(p["target_step"], p["receivers"]) for p in res.of("plan") if p.get("from_snapshot")]
    assert [t for t, _ in plans][:2] == [4, 12] and {t for t, _ in plans} == {4, 12}, res.of("plan")
    assert all(r == [0, 1] for _, r in plans), res.of("plan")
    left = sorted(f["rank"] for f in res.of("fault") if "LoopAheadOfState" in f.get("detail", ""))
    assert left == [0, 1], res.output[-6000:]
    assert sorted(e["rank"] for e in res.of("spare_assigned")) == [0, 0, 1, 1], res.of("spare_assigned")
    res.assert_same_weights(ref, nproc=2)  # weights, optimizer, lr, callback state, global_step
    assert res.trained_batches() == ref.trained_batches(), (
        "some rank trained on other samples than the fault-free run"
    )
    # each replacement sought its step (no sample before it read), and read what it trained
    assert res.output.count("by seeking to epoch 0, batch 4") == 2, res.output[-6000:]
    assert res.output.count("by seeking to epoch 1, batch 0") == 2, res.output[-6000:]
    reads = re.findall(r"reads rank=(\d+) samples=(\d+) trained=(\d+)x2", res.output)
    assert sorted(int(r) for r, _, _ in reads) == [0, 1], res.output[-4000:]
    assert all(int(s) == 2 * int(t) for _, s, t in reads), reads
    assert not [p for p in res.pids() if alive(p)], "processes of the job were left behind"
