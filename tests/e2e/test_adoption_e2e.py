"""Scripts written the way users write them, under real faults.

tests/scripts/adopt.py trains through a plain DataLoader (2 workers, DistributedSampler), and
optionally AMP with a GradScaler, per-rank dropout from job.generator, an early break. Each faulted
run must end with every rank's weights bitwise equal to the fault-free run's, and every (rank,
step) must have trained on the fault-free run's batch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, JobResult, alive, run_job
from tests.helpers.reference import ReferenceRuns
from tests.helpers.zygote import ENABLE_ENV


@pytest.fixture(autouse=True)
def fresh_interpreters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launcher here a fresh interpreter: processes_with_key finds a job's processes by
    the environment they were started with (/proc/PID/environ), and a launcher forked from the
    test zygote would give them the zygote's."""
    monkeypatch.setenv(ENABLE_ENV, "0")


SCRIPT = ROOT / "tests" / "scripts" / "adopt.py"
NPROC = 2
NOWHERE = Path("/nonexistent")  # the script makes its own data
# 64 samples over 2 ranks in batches of 4: 8 steps per epoch, 20 steps = 2.5 epochs
BASE = ["--steps", "20", "--samples", "64", "--batch", "4", "--workers", "2"]


def check_bitwise(res: JobResult, ref: JobResult, faults: int) -> None:
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=NPROC)
    assert res.batches() == ref.batches(), "some rank trained on other samples than the fault-free run"
    assert len(res.of("fault_injected")) == faults, res.output[-4000:]
    assert len(res.of("recovery")) >= faults, res.output[-4000:]
    assert not res.left_behind(), "processes of the job were left behind"
    # other jobs may be running on this machine: look for this job's private name only
    shm_name = (res.run_dir.parent / (res.run_dir.name + ".digest-shm")).read_text().strip()
    assert shm_name.startswith(f"checkpointless-{os.geteuid()}-")
    assert not (Path("/dev/shm") / shm_name).exists(), "shared memory left behind"
    # DataLoader workers are not the launcher's children: find them by the job's private key,
    # which every process of the job inherits. A worker whose rank died leaves by torch's own
    # watchdog within about 5 s.
    key = shm_name.rsplit("-", 1)[1].encode()
    deadline = time.monotonic() + 20
    while (left := processes_with_key(key)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of the job (DataLoader workers?) were left behind: {left}"


def processes_with_key(key: bytes) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"CHECKPOINTLESS_SHM_KEY=" + key in env and alive(int(d.name)):
                out.append(int(d.name))
    return out


def commits(res: JobResult, field: str) -> dict[tuple[int, int], object]:
    out: dict[tuple[int, int], object] = {}
    for r in range(NPROC):
        for e in res.events(f"rank-{r}.jsonl"):
            if e["event"] == "commit" and field in e:
                out[(e["rank"], e["step"])] = e[field]
    return out


@pytest.mark.timeout(300)
def test_dataloader_with_workers_survives_kills_mid_epoch_and_at_epoch_boundary(
    tmp_path: Path, reference: ReferenceRuns
) -> None:
    ref = reference(NPROC, data=NOWHERE, script=SCRIPT, script_args=BASE)
    # step 5 is inside epoch 0; step 8 is the first batch of epoch 1
    faults = ["kill:rank=1:step=5", "kill:rank=0:step=8"]
    res = run_job(tmp_path / "run", Path("/nonexistent"), NPROC, 2, faults, script=SCRIPT, script_args=BASE)
    check_bitwise(res, ref, faults=2)
    assert {e["rank"] for e in res.of("spare_assigned")} == {0, 1}, "each killed rank is taken by a spare"
    epochs = commits(res, "epoch")
    assert {epochs[(0, s)] for s in range(20)} == {0, 1, 2}, "the run should span three epochs"
    # the batches of an epoch differ from the next epoch's: set_epoch() was called
    batches = res.batches()
    assert batches[(0, 0)] != batches[(0, 8)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "amp",
    [
        # `make soak`: autocast without a GradScaler; float16 below runs the same autocast and
        # fault with the scaler (and clipping) on top, and bf16 mixed precision under FSDP2 is
        # test_sharded_e2e's uneven-shards case
        pytest.param(["--amp", "bfloat16"], marks=pytest.mark.soak),
        ["--amp", "float16", "--clip"],
    ],
    ids=["bfloat16", "float16-unscale-and-clip"],
)
def test_grad_scaler_exact_through_a_fault_inside_the_optimizer_step(
    tmp_path: Path, reference: ReferenceRuns, amp: list[str]
) -> None:
    args = [*BASE, "--workers", "0", *amp]
    ref = reference(NPROC, data=NOWHERE, script=SCRIPT, script_args=args)
    faults = ["raise:rank=1:step=4:site=optimizer"]
    res = run_job(tmp_path / "run", Path("/nonexistent"), NPROC, 1, faults, script=SCRIPT, script_args=args)
    check_bitwise(res, ref, faults=1)
    plans = [p for p in res.of("plan") if p["generation"] > 0]
    assert 1 in plans[0]["receivers"], "the rank that faulted mid-update must receive the state"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loader", [[], ["--stateful"]], ids=["DataLoader", "StatefulDataLoader"])
def test_augmentation_and_dropout_on_the_global_generator_are_exact_through_a_replay(
    tmp_path: Path, reference: ReferenceRuns, loader: list[str]
) -> None:
    # Without workers the batch's augmentation draws from torch's global generator inside the
    # step, before dropout does. The survivors replay step 6 with the batch they hold (nothing is
    # read again), and the replacement reads it at a seek: the step's dropout must draw the same
    # numbers as without the fault everywhere, so the read may not move the step's stream.
    args = [*BASE, "--workers", "0", "--augment", *loader]
    ref = reference(NPROC, data=NOWHERE, script=SCRIPT, script_args=args)
    faults = ["kill:rank=1:step=6"]
    res = run_job(tmp_path / "run", Path("/nonexistent"), NPROC, 1, faults, script=SCRIPT, script_args=args)
    check_bitwise(res, ref, faults=1)


@pytest.mark.timeout(300)
def test_per_rank_generator_streams_are_reproduced_by_a_replacement(
    tmp_path: Path, reference: ReferenceRuns
) -> None:
    args = [*BASE, "--workers", "0", "--rank-dropout"]
    ref = reference(NPROC, data=NOWHERE, script=SCRIPT, script_args=args)
    masks = commits(ref, "mask")
    assert all(masks[(0, s)] != masks[(1, s)] for s in range(20)), "ranks should draw different masks"
    faults = ["kill:rank=1:step=6"]
    res = run_job(tmp_path / "run", Path("/nonexistent"), NPROC, 1, faults, script=SCRIPT, script_args=args)
    check_bitwise(res, ref, faults=1)
    assert commits(res, "mask") == masks, "the replacement drew another dropout mask"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", [["--break-after", "6"], ["--stop-at", "6"]], ids=["break", "job.stop"])
def test_leaving_the_loop_early_ends_the_job_cleanly(
    tmp_path: Path, reference: ReferenceRuns, how: list[str]
) -> None:
    # ends after step 6 committed: the same weights as a run of 7 steps
    ref = reference(NPROC, data=NOWHERE, script=SCRIPT, script_args=[*BASE, "--workers", "0", "--steps", "7"])
    args = [*BASE, "--workers", "0", *how]
    res = run_job(tmp_path / "run", Path("/nonexistent"), NPROC, 1, script=SCRIPT, script_args=args)
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=NPROC)
    assert res.batches() == ref.batches()
    assert not res.of("fault"), "leaving early must not count as a fault"
    assert not res.of("spare_assigned") and not res.of("recovery"), res.output[-4000:]
    end = res.of("job_end")
    assert end and end[-1]["status"] == "ok", end
