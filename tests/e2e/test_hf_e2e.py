"""The Hugging Face Trainer example under `checkpointless run`, with real faults, bitwise on every rank.

Each run is examples/hf_trainer.py (a 2-layer GPT-2 built from a config, data from memory,
``CheckpointlessTrainer`` with gradient accumulation 2 and a checkpoint every 4 steps) on 3 ranks
and 1 spare. It must end with every rank's weights, optimizer state and log history equal to a
fault-free run's, every (rank, step) must have trained on the fault-free run's micro-batches, and
Trainer's checkpoint files must equal the fault-free run's.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, JobResult, fault_at, start_job

pytest.importorskip("transformers", reason="the `hf` extra is not installed")

SCRIPT = ROOT / "examples" / "hf_trainer.py"
# Three ranks, where torch's DDP's bucket layout can decide a sum: gloo's ring all-reduce starts
# each chunk of a bucket at another rank, so it adds the ranks' parts of an element in an order
# set by the element's place in its bucket, and a
# replacement whose DDP reduced in another layout than the survivors' would end with other
# weights (of two ranks' parts, a + b = b + a would hide that)
NPROC = 3
ARGS = ["--steps", "10", "--accumulation", "2", "--save-steps", "4", "--record-batches"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# what each rank logs as its training starts: the model Trainer trains is torch's DDP
TORCH_DDP = "Trainer trains a torch.nn.parallel.distributed.DistributedDataParallel"


def run(run_dir: Path, faults: list[str], spares: int = 1) -> JobResult:
    args = [*ARGS, "--output-dir", str(run_dir.parent / "out")]
    job = start_job(
        run_dir, run_dir.parent / "unused", NPROC, spares, faults, script_args=args, script=SCRIPT,
        hang_timeout=6, env=OFFLINE,
    )  # fmt: skip
    return job.finish(200)  # 3 ranks and a spare on two shared cores


def checkpoint_files(res: JobResult) -> dict[str, str]:
    """Relative path -> SHA-256 of every file Trainer wrote under its output_dir, except
    training_args.bin, which pickles the run's own output_dir."""
    out_dir = res.run_dir.parent / "out"
    return {
        str(p.relative_to(out_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out_dir.rglob("*"))
        if p.is_file() and p.name != "training_args.bin"
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    res = run(tmp_path_factory.mktemp("hf-ref") / "run", [], spares=0)
    assert res.rc == 0, res.output[-4000:]
    assert sorted(res.digests) == list(range(NPROC)) and res.digest, res.digests
    assert len(res.batches()) == NPROC * 10, "every rank commits one optimizer step per step"
    files = checkpoint_files(res)
    assert {f.split("/")[0] for f in files} == {"checkpoint-4", "checkpoint-8", "checkpoint-10"}, files
    assert "checkpoint-8/model.safetensors" in files and f"checkpoint-8/rng_state_{NPROC - 1}.pth" in files
    assert res.output.count(TORCH_DDP) == NPROC, "Trainer must train through its own (torch's) DDP"
    return res


CASES = [
    pytest.param("kill:rank=1:step=5", id="sigkill"),
    pytest.param("raise:rank=1:step=3:site=forward", id="raise-forward"),
    pytest.param("raise:rank=0:step=4:site=backward", id="raise-backward", marks=pytest.mark.soak),
    # rank 0 (which writes the checkpoints) fails inside its update of step 3; rank 1 finishes
    # it, so rank 0 is rolled forward, receives rank 1's state and must still write checkpoint-4
    pytest.param("raise:rank=0:step=3:site=optimizer", id="raise-mid-optimizer"),
    pytest.param("hang:rank=1:step=6", id="sigstop-hang", marks=pytest.mark.soak),
    # rank 0 writes the checkpoints; its replacement joins after checkpoint-4 and writes the rest
    pytest.param("kill:rank=0:step=6", id="rank0-killed-after-a-save", marks=pytest.mark.soak),
]


# `make test` runs sigkill, raise-forward (at step 7 here: rank 0's update of step 3 fails in the
# same job), raise-backward (at step 8) and raise-mid-optimizer in one job (MERGED), each fault asserted as its own case asserts
# it (test_trainer_faults_in_one_job_are_each_survived_bitwise); every single-fault case runs under
# `make soak` only
MERGED = [
    "raise:rank=0:step=3:site=optimizer",  # raise-mid-optimizer
    "kill:rank=1:step=5",  # sigkill
    "raise:rank=1:step=7:site=forward",  # raise-forward
    "raise:rank=0:step=8:site=backward",  # raise-backward: DDP's reducer left mid-backward
]


@pytest.mark.timeout(420)  # the reference job (module fixture) included
def test_trainer_faults_in_one_job_are_each_survived_bitwise(tmp_path: Path, reference: JobResult) -> None:
    res = run(tmp_path / "run", MERGED)
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(reference, nproc=NPROC)  # weights, optimizer state and log history
    assert res.batches() == reference.batches(), "some rank trained on other micro-batches"
    assert len(res.of("fault_injected")) == len(MERGED), res.output[-4000:]
    assert checkpoint_files(res) == checkpoint_files(reference), "Trainer's checkpoints differ"
    # one log line per optimizer step, as without the faults: a replay is not logged twice
    assert res.output.count("{'loss'") == reference.output.count("{'loss'") == 10
    assert res.output.count(TORCH_DDP) == NPROC + 1, "every rank and the replacement train torch's DDP"
    for fault in MERGED:
        rank, step = fault_at(fault)
        rec = res.recovery_from(rank, step)
        assert res.fired(fault) and rec is not None, (fault, res.output[-4000:])
        if fault.startswith(("kill", "hang")):
            spares = [
                e
                for e in res.of("spare_assigned")
                if (e["rank"], e["generation"]) == (rank, rec["generation"])
            ]
            assert spares, f"{fault}: a dead or hung rank must be replaced by a spare"
            assert "Trainer's data seeks there" in res.output
        if "optimizer" in fault:
            plans = [p for p in res.of("plan") if p["generation"] == rec["generation"]]
            assert plans and rank in plans[0]["receivers"], (
                "a rank that faulted mid-update must receive state"
            )
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.soak
@pytest.mark.timeout(200)
@pytest.mark.parametrize("fault", CASES)
def test_trainer_fault_is_survived_bitwise(tmp_path: Path, reference: JobResult, fault: str) -> None:
    res = run(tmp_path / "run", [fault])
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(reference, nproc=NPROC)  # weights, optimizer state and log history
    assert res.batches() == reference.batches(), "some rank trained on other micro-batches"
    assert len(res.of("fault_injected")) == 1 and res.of("recovery"), res.output[-4000:]
    assert checkpoint_files(res) == checkpoint_files(reference), "Trainer's checkpoints differ"
    # one log line per optimizer step, as without the fault: a replay is not logged twice
    assert res.output.count("{'loss'") == reference.output.count("{'loss'") == 10
    if fault.startswith(("kill", "hang")):
        assert res.of("spare_assigned"), "a dead or hung rank must be replaced by a spare"
        assert "Trainer's data seeks there" in res.output
    if "optimizer" in fault:
        plans = [p for p in res.of("plan") if p["generation"] > 0]
        assert 0 in plans[0]["receivers"], "a rank that faulted mid-update must receive state"
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.soak
@pytest.mark.timeout(200)
def test_resume_from_checkpoint_then_a_kill_matches_the_uninterrupted_run(
    tmp_path: Path, reference: JobResult
) -> None:
    """resume_from_checkpoint (every copy lost: the job starts again from Trainer's files) still
    works, and a replacement in the resumed job receives state instead of reading the files."""
    start = reference.run_dir.parent / "out" / "checkpoint-4"
    args = [*ARGS, "--output-dir", str(tmp_path / "out"), "--resume", str(start)]
    job = start_job(
        tmp_path / "run", tmp_path / "unused", NPROC, 1, ["kill:rank=1:step=6"], script_args=args,
        script=SCRIPT, hang_timeout=6, env=OFFLINE,
    )  # fmt: skip
    res = job.finish(150)
    assert res.rc == 0, res.output[-6000:]
    assert res.of("spare_assigned") and "Trainer's data seeks there" in res.output
    ref, got = checkpoint_files(reference), checkpoint_files(res)
    rng = [f"rng_state_{r}.pth" for r in range(NPROC)]
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", *rng):
        for step in (8, 10):
            key = f"checkpoint-{step}/{name}"
            assert got[key] == ref[key], f"{key} differs from the uninterrupted run's"
    assert {b: d for b, d in res.batches().items() if b[1] >= 4} == {
        b: d for b, d in reference.batches().items() if b[1] >= 4
    }


@pytest.mark.timeout(120)
def test_trainer_runs_plainly_as_a_job_of_one(tmp_path: Path) -> None:
    """Without the launcher, CheckpointlessTrainer is a one-process job that trains as Trainer."""
    cmd = [sys.executable, str(SCRIPT), "--steps", "3", "--output-dir", str(tmp_path / "out")]
    env = {**os.environ, **OFFLINE}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("{'loss'") == 3 and "final state sha256" in proc.stdout, proc.stdout
