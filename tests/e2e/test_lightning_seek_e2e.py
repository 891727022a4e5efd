"""A replacement seeks Lightning's loop (no walk from batch 0) in a fit with a ``ReduceLROnPlateau``
scheduler, in a fit resumed from a Lightning checkpoint, and in a fit with two training loaders,
through a real SIGKILL, bitwise.

examples/lightning_gpt.py on 3 ranks (and 1 spare in the faulted runs), validating every 2 batches
(``val_loss``, reduced over the ranks) and halving the learning rate on it every 3 batches
(``--plateau 3``, ``mode="max"``: nearly every call halves it, so its state shows in the weights):

- rank 1 is SIGKILLed in step 2: its replacement seeks to batch 2, whose plateau step reads the
  ``val_loss`` of the validation after batch 1, before its step: it must get it with the replica
  (the seek runs no validation; a walk would run it with step 2's weights);
- the fault-free run's ``last.ckpt`` (step 5, epoch 0 batch 5, written as that batch ended) is
  resumed (``fit(ckpt_path="last")``) fault-free and with rank 0 SIGKILLed in step 9: the
  replacement restores the checkpoint and seeks from step 5 to 9, which the resumed fit reads as
  its DataLoader's batch 4 (it reads its first epoch from the loader's first batch).

Each faulted run must end with every rank's weights, Lightning loop counters and checkpoint files
equal to its fault-free run's, every (rank, step) trained on the fault-free run's batch, each
process having read the samples of the batches it trained and no other, and its log saying the
replacement sought its step. Each pair of jobs runs at once. The two loaders' job is described
at its test.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.e2e.test_lightning_e2e import _paths, _same, assert_reads_only_trained_batches, assert_same_loops
from tests.helpers.jobs import ROOT, JobResult, RunningJob, start_job

pytest.importorskip("lightning", reason="the `lightning` extra is not installed")

SCRIPT = ROOT / "examples" / "lightning_gpt.py"
ARGS = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--global-batch", "12"]
ARGS += ["--print-batches", "--print-reads", "--val-every", "2", "--plateau", "3"]
PLATEAU_KILL = "kill:rank=1:step=2"
RESUMED_KILL = "kill:rank=0:step=9"
LOADERS = ROOT / "tests" / "scripts" / "lightning_loaders.py"
# each rank killed once: in epoch 0 after the shorter loader started again, and in epoch 1
LOADERS_KILLS = ["kill:rank=1:step=7", "kill:rank=0:step=12"]


def pair(root: Path, corpus: Path, fault: str, steps: int, resume_from: Path | None) -> dict[str, JobResult]:
    """The fault-free run and the one with ``fault``, at once; each with its own checkpoint
    directory (a copy of ``resume_from``'s ``last.ckpt``, which it resumes from, if given)."""
    jobs: dict[str, RunningJob] = {}
    for name, faults, spares in (("ref", [], 0), ("kill", [fault], 1)):
        ckpt = root / name / "ckpt"
        ckpt.mkdir(parents=True)
        args = [*ARGS, "--steps", str(steps), "--ckpt-dir", str(ckpt)]
        if resume_from is not None:
            shutil.copy(resume_from / "last.ckpt", ckpt / "last.ckpt")
            args.append("--resume")
        jobs[name] = start_job(
            root / name / "run", corpus, 3, spares, faults, script_args=args, script=SCRIPT, hang_timeout=6
        )
    out = {name: job.finish(150) for name, job in jobs.items()}
    for name, res in out.items():
        assert not res.left_behind(), f"{name}: processes of the job were left behind"
    return out


@pytest.fixture(scope="module")
def plateau(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict[str, JobResult]:
    return pair(tmp_path_factory.mktemp("lightning-plateau"), corpus, PLATEAU_KILL, 8, None)


def assert_survived_by_seeking(res: JobResult, ref: JobResult, fault: str, caught_up: str) -> None:
    assert ref.rc == 0, ref.output[-4000:]
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=3)
    assert res.trained_batches() == ref.trained_batches(), "a rank trained on other samples"
    assert res.fired(fault) and res.of("spare_assigned"), res.output[-4000:]
    assert caught_up in res.output, res.output[-4000:]
    assert_reads_only_trained_batches(res, replaced=1)
    assert_same_loops(res, ref)
    assert_same_checkpoints(res, ref)


def assert_same_checkpoints(res: JobResult, ref: JobResult) -> None:
    """Rank 0's checkpoint files hold the fault-free run's (each run writes its own directory)."""
    import torch

    got_dir, want_dir = res.run_dir.parent / "ckpt", ref.run_dir.parent / "ckpt"
    names = sorted(p.name for p in want_dir.glob("*.ckpt"))
    assert "last.ckpt" in names and sorted(p.name for p in got_dir.glob("*.ckpt")) == names, names
    for name in names:
        got = torch.load(got_dir / name, weights_only=False)
        want = torch.load(want_dir / name, weights_only=False)
        for key in ("global_step", "epoch", "loops", "lr_schedulers"):
            assert _same(got[key], want[key]), f"{name}: {key} differs"
        assert _same(_paths(got["callbacks"], str(got_dir)), _paths(want["callbacks"], str(want_dir)))
        assert _same(got["state_dict"], want["state_dict"]), f"{name}: weights differ"


@pytest.mark.timeout(200)
def test_a_replacement_seeks_past_a_plateau_schedulers_validation_bitwise(
    plateau: dict[str, JobResult],
) -> None:
    ref, res = plateau["ref"], plateau["kill"]
    assert_survived_by_seeking(
        res,
        ref,
        PLATEAU_KILL,
        "catches up from 0 by seeking to epoch 0, batch 2 (no batch before it is read)",
    )


@pytest.mark.timeout(200)
def test_a_replacement_seeks_in_a_fit_resumed_from_a_checkpoint_bitwise(
    plateau: dict[str, JobResult], tmp_path: Path, corpus: Path
) -> None:
    ckpt = plateau["ref"].run_dir.parent / "ckpt"
    resumed = pair(tmp_path, corpus, RESUMED_KILL, 12, ckpt)
    ref, res = resumed["ref"], resumed["kill"]
    assert min(step for _, step in ref.trained_batches()) == 5, "the fit resumes at the checkpoint's step"
    assert_survived_by_seeking(
        res,
        ref,
        RESUMED_KILL,
        "catches up from 5 by seeking to epoch 0, batch 9 (no batch before it is read)",
    )


@pytest.mark.timeout(200)
def test_a_replacement_seeks_both_of_two_training_loaders_bitwise(tmp_path: Path) -> None:
    """tests/scripts/lightning_loaders.py (2 ranks, 2 spares): two training loaders, the shorter
    started again by Lightning every 3 batches; each replacement puts each loader at its own batch
    (step 7: 7 and 1; step 12, in epoch 1: 2 and 2)."""
    jobs = {}
    for name, faults, spares in (("ref", [], 0), ("kill", LOADERS_KILLS, 2)):
        (tmp_path / name).mkdir()  # the script makes its own data: no corpus
        jobs[name] = start_job(
            tmp_path / name / "run", tmp_path, 2, spares, faults, script_args=[], script=LOADERS
        )
    ref, res = (jobs[name].finish(150) for name in ("ref", "kill"))
    assert ref.rc == 0, ref.output[-4000:]
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=2)
    assert len(ref.trained_batches()) == 2 * 14
    assert res.trained_batches() == ref.trained_batches(), "a rank trained on other samples"
    for fault in LOADERS_KILLS:
        assert res.fired(fault), (fault, res.output[-4000:])
    for caught_up in ("from 0 by seeking to epoch 0, batch 7", "from 0 by seeking to epoch 1, batch 2"):
        assert caught_up in res.output, res.output[-4000:]
    # each process read from both loaders the samples of the batches it trained, and no other
    reads = re.findall(r"reads rank=(\d+) long=(\d+) short=(\d+) trained=(\d+)", res.output)
    assert sorted(r[0] for r in reads) == ["0", "1"], res.output[-4000:]
    for _, long, short, trained in reads:
        assert int(long) == int(short) == 2 * int(trained), reads
    pattern = r"loops rank=(\d+) ([0-9a-f]{16})"
    got, want = dict(re.findall(pattern, res.output)), dict(re.findall(pattern, ref.output))
    assert sorted(want) == ["0", "1"] and got == want, (got, want)
    for job in (ref, res):
        assert not job.left_behind(), "processes of the job were left behind"
