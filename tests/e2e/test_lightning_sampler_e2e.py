"""A Lightning job whose ranks shuffle their own data, through a kill, bitwise on every rank.

tests/scripts/lightning_sampler.py: ``Trainer(use_distributed_sampler=False)``, a shuffled
``DataLoader`` per rank, each rank seeded with its own seed (its permutation and its dropout
masks its own), 2 ranks and 1 spare, 8 steps an epoch, 12 steps. Rank 0 is killed in step 10,
in the second epoch: its replacement walks Lightning's loop across the first epoch's end, where
the epoch's ``RandomSampler`` draws its permutation (integrations/_lightning_samplers.py). It
must train every step on the fault-free run's batch and end with its weights.

Rank 0 also writes a ``CSVLogger``: its replacement must log into the job's version directory
(integrations/_lightning_loggers.py), and the file must hold each step once, as the fault-free
run's does.

Before the kill, rank 0 raises in the backward pass of step 9: every rank replays that batch,
and rank 1, which logged the batch's ``on_epoch`` sum in the attempt, must count it once (its
epoch's sum equals the fault-free run's).
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, JobResult, start_job

pytest.importorskip("lightning", reason="the `lightning` extra is not installed")

SCRIPT = ROOT / "tests" / "scripts" / "lightning_sampler.py"


def run(run_dir: Path, corpus: Path, faults: list[str]) -> JobResult:
    args = ["--print-batches", "--log-dir", str(run_dir.parent / "logs")]
    job = start_job(run_dir, corpus, 2, 1, faults, script_args=args, script=SCRIPT, hang_timeout=6)
    return job.finish(120)


def epoch_sum(res: JobResult, rank: int) -> str:
    found = re.findall(rf"epoch metric rank={rank} x_sum=(\S+)", res.output)
    assert len(found) == 1, res.output[-4000:]
    return found[0]


def logged(res: JobResult) -> tuple[list[str], list[dict[str, str]]]:
    """The logger's version directories, and the rows of the loss per step."""
    root = res.run_dir.parent / "logs" / "lit"
    versions = sorted(p.name for p in root.iterdir())
    with (root / versions[0] / "metrics.csv").open(newline="") as f:
        rows = [{"step": r["step"], "loss": r["loss"]} for r in csv.DictReader(f) if r["loss"]]
    return versions, rows


@pytest.mark.timeout(200)
def test_per_rank_shuffle_and_logger_survive_a_kill_of_rank0(tmp_path: Path, corpus: Path) -> None:
    (tmp_path / "ref").mkdir()
    (tmp_path / "fault").mkdir()
    ref = run(tmp_path / "ref" / "run", corpus, [])
    assert ref.rc == 0, ref.output[-4000:]
    want = ref.trained_batches()
    assert len(want) == 2 * 12, "every rank trains on one batch per step"
    assert want[(0, 0)] != want[(1, 0)], "each rank shuffles with its own seed"

    res = run(
        tmp_path / "fault" / "run", corpus, ["raise:rank=0:step=9:site=backward", "kill:rank=0:step=10"]
    )
    assert res.rc == 0, res.output[-6000:]
    assert res.of("spare_assigned") and "Lightning's loop catches up" in res.output
    # a per-rank RandomSampler's order is not a function of the epoch: the replacement walks
    assert "by re-reading its DataLoader from the start (the sampler RandomSampler" in res.output
    res.assert_same_weights(ref, nproc=2)
    assert res.trained_batches() == want, "some rank trained on other samples than the fault-free run"
    assert epoch_sum(res, 1) == epoch_sum(ref, 1), "a replayed batch counted twice in an on_epoch metric"

    versions, rows = logged(res)
    assert versions == ["version_0"], f"rank 0's replacement logged into a new version: {versions}"
    ref_versions, ref_rows = logged(ref)
    assert ref_versions == ["version_0"]
    assert [r["step"] for r in rows] == [str(s) for s in range(12)], "each step logged once"
    assert rows == ref_rows, "the logged losses differ from the fault-free run's"
