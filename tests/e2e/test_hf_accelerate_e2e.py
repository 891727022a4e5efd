"""The Accelerate example under `checkpointless run`, with real faults, bitwise on every rank.

Each run is examples/hf_accelerate.py (a hand-written Accelerate loop: prepare, accumulate with
gradient accumulation 2, backward, a scheduler, 2 epochs of 5 optimizer steps, an evaluation on a
prepared DataLoader after each epoch, protected) on 3 ranks and 1 spare. It must end with every
rank's weights, optimizer state and evaluation losses equal to a fault-free run's, and every
(rank, step) must have trained on the fault-free run's micro-batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, JobResult, fault_at, start_job

pytest.importorskip("accelerate", reason="the `hf` extra is not installed")

SCRIPT = ROOT / "examples" / "hf_accelerate.py"
# Three ranks, where torch's DDP's bucket layout can decide a sum: gloo's ring all-reduce starts
# each chunk of a bucket at another rank, so it adds the ranks' parts of an element in an order
# set by the element's place in its bucket, and a replacement whose DDP reduced in another layout
# than the survivors' would end with other weights (of two ranks' parts, a + b = b + a hides that)
NPROC = 3
# 120 samples an epoch: 10 micro-batches of 4 on each of the 3 ranks, 5 optimizer steps
ARGS = ["--epochs", "2", "--accumulation", "2", "--samples", str(40 * NPROC), "--record-batches"]
EVAL_FAULTS = ROOT / "tests" / "scripts" / "hf_accelerate_eval_faults.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# what each rank logs as it prepares its model: torch's DDP, as accelerate makes it
TORCH_DDP = "the prepared model is a torch.nn.parallel.distributed.DistributedDataParallel"


def run(
    run_dir: Path, faults: list[str], spares: int = 1, bf16: bool = False, eval_fault: str | None = None
) -> JobResult:
    args = ARGS + (["--mixed-precision", "bf16"] if bf16 else [])
    env = {**OFFLINE, "HF_EVAL_MARK": str(run_dir.parent / "fired")}
    if eval_fault:
        env["HF_EVAL_FAULT"] = eval_fault
    job = start_job(
        run_dir, run_dir.parent / "unused", NPROC, spares, faults, script_args=args,
        script=EVAL_FAULTS if eval_fault else SCRIPT, hang_timeout=6, env=env,
    )  # fmt: skip
    return job.finish(150)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    res = run(tmp_path_factory.mktemp("acc-ref") / "run", [], spares=0)
    assert res.rc == 0, res.output[-4000:]
    assert sorted(res.digests) == list(range(NPROC)) and res.digest, res.digests
    assert len(res.batches()) == NPROC * 10, "every rank commits one optimizer step per step"
    assert res.output.count(TORCH_DDP) == NPROC, "prepare() must wrap the model in torch's DDP"
    return res


# `make test` runs sigkill, raise-forward, raise-backward and raise-mid-optimizer in one job
# (MERGED), each fault asserted as its own case asserts it (test_accelerate_loop_faults_in_one_job_
# are_each_survived_bitwise); every single-fault case runs under `make soak` only
MERGED = [
    "raise:rank=1:step=4:site=optimizer",  # raise-mid-optimizer
    "raise:rank=0:step=6:site=forward",  # raise-forward
    "kill:rank=1:step=7",  # sigkill
    "raise:rank=0:step=8:site=backward",  # raise-backward: DDP's reducer left mid-backward
]


@pytest.mark.soak
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "fault",
    [
        # in epoch 1: the replacement's loop passes epoch 0 and gets its evaluation from the state
        pytest.param("kill:rank=1:step=7", id="sigkill"),
        pytest.param("raise:rank=0:step=6:site=forward", id="raise-forward"),
        pytest.param("raise:rank=1:step=7:site=backward", id="raise-backward"),
        # the epoch's last step: rank 1 is rolled forward into the evaluation rank 0 has begun
        pytest.param("raise:rank=1:step=4:site=optimizer", id="raise-mid-optimizer"),
        pytest.param("hang:rank=1:step=5", id="sigstop-hang"),
    ],
)
def test_accelerate_loop_fault_is_survived_bitwise(tmp_path: Path, reference: JobResult, fault: str) -> None:
    res = run(tmp_path / "run", [fault])
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(reference, nproc=NPROC)  # weights, optimizer state and evaluation losses
    assert res.batches() == reference.batches(), "some rank trained on other micro-batches"
    assert len(res.of("fault_injected")) == 1 and res.of("recovery"), res.output[-4000:]
    assert res.output.count("eval loss") == reference.output.count("eval loss") == 2
    if fault.startswith(("kill", "hang")):
        assert res.of("spare_assigned") and "the training DataLoader seeks there" in res.output
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.timeout(240)
def test_accelerate_loop_faults_in_one_job_are_each_survived_bitwise(
    tmp_path: Path, reference: JobResult
) -> None:
    res = run(tmp_path / "run", MERGED)
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(reference, nproc=NPROC)  # weights, optimizer state and evaluation losses
    assert res.batches() == reference.batches(), "some rank trained on other micro-batches"
    assert len(res.of("fault_injected")) == len(MERGED), res.output[-4000:]
    for fault in MERGED:
        rank, step = fault_at(fault)
        rec = res.recovery_from(rank, step)
        assert res.fired(fault) and rec is not None, (fault, res.output[-4000:])
        if fault.startswith(("kill", "hang")):
            assert [
                e
                for e in res.of("spare_assigned")
                if (e["rank"], e["generation"]) == (rank, rec["generation"])
            ]
            assert "the training DataLoader seeks there" in res.output
    assert res.output.count("eval loss") == reference.output.count("eval loss") == 2
    assert res.output.count(TORCH_DDP) == NPROC + 1, "every rank and the replacement train torch's DDP"
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.soak
@pytest.mark.timeout(300)
def test_bf16_mixed_precision_is_exact_through_a_kill(tmp_path: Path) -> None:
    for sub in ("ref", "kill"):
        (tmp_path / sub).mkdir()
    ref = run(tmp_path / "ref" / "run", [], spares=0, bf16=True)
    assert ref.rc == 0 and ref.digest, ref.output[-4000:]
    res = run(tmp_path / "kill" / "run", ["kill:rank=1:step=6"], bf16=True)
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=NPROC)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "fault",
    [
        # the same mechanism as the Trainer's (a replacement joins the redone section): soak here
        pytest.param("kill:1:5", id="sigkill-in-eval", marks=pytest.mark.soak),
        # the last evaluation, after which the loop ends: end_training() ends the job there
        pytest.param("raise:0:10", id="raise-in-final-eval"),
    ],
)
def test_a_fault_during_a_protected_evaluation_is_recovered_and_it_runs_again(
    tmp_path: Path, reference: JobResult, fault: str
) -> None:
    res = run(tmp_path / "run", [], eval_fault=fault)
    assert res.rc == 0, res.output[-6000:]
    assert (tmp_path / "fired").exists() and f"fault in evaluation: {fault.split(':')[0]}" in res.output
    assert res.of("recovery"), res.output[-4000:]
    res.assert_same_weights(reference, nproc=NPROC)  # weights, optimizer state and evaluation losses
    assert res.batches() == reference.batches(), "some rank trained on other micro-batches"
    assert res.output.count("eval loss") == reference.output.count("eval loss") == 2
    if fault.startswith("kill"):
        assert [e["rank"] for e in res.of("spare_assigned")] == [1]
    assert not res.left_behind(), "processes of the job were left behind"
