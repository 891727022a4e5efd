"""Trainer's evaluation is protected: a fault during it is recovered and the evaluation done again.

Each run is examples/hf_trainer.py through tests/scripts/hf_eval_faults.py (a 2-layer GPT-2,
``CheckpointlessTrainer``, gradient accumulation 2, 8 steps, ``eval_strategy="steps"`` every 4
steps) on 2 ranks and 1 spare, with a SIGKILL or an exception in the middle of an evaluation. It
must end with every rank's weights, optimizer state and log history, and every rank's logged
evaluation metrics, equal to the fault-free run's, each evaluation logged once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, JobResult, start_job

pytest.importorskip("transformers", reason="the `hf` extra is not installed")

SCRIPT = ROOT / "tests" / "scripts" / "hf_eval_faults.py"
ARGS = ["--steps", "8", "--accumulation", "2", "--eval-steps", "4", "--record-batches"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def run(run_dir: Path, fault: str | None, spares: int = 1) -> JobResult:
    env = {
        **OFFLINE,
        "HF_EVAL_OUT": str(run_dir.parent / "eval-{rank}.json"),
        "HF_EVAL_MARK": str(run_dir.parent / "fired"),
    }
    if fault:
        env["HF_EVAL_FAULT"] = fault
    args = [*ARGS, "--output-dir", str(run_dir.parent / "out")]
    job = start_job(
        run_dir, run_dir.parent / "unused", 2, spares, [], script_args=args, script=SCRIPT,
        hang_timeout=6, env=env,
    )  # fmt: skip
    return job.finish(150)


def evaluations(res: JobResult) -> dict[int, list[dict[str, float]]]:
    """rank -> the evaluation entries of its final log history (timings left out)."""
    return {r: json.loads((res.run_dir.parent / f"eval-{r}.json").read_text()) for r in range(2)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    res = run(tmp_path_factory.mktemp("hf-eval-ref") / "run", None, spares=0)
    assert res.rc == 0, res.output[-4000:]
    assert sorted(res.digests) == [0, 1] and res.digest, res.digests
    evals = evaluations(res)
    assert [e["step"] for e in evals[0]] == [4, 8] and evals[0] == evals[1], evals
    return res


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "fault",
    [
        # `make soak`, as the raise below: `make test` has a SIGKILL in the middle of an
        # evaluation, redone and its line printed once, in test_hf_epoch_eval_e2e's merged job
        # (the same boundary section, at an epoch's end instead of every 4 steps)
        pytest.param("kill:1:4", id="sigkill-in-eval", marks=pytest.mark.soak),
        # at the last boundary, where the end of training (on_epoch_end) is part of the section
        pytest.param("raise:0:8", id="raise-in-eval", marks=pytest.mark.soak),
    ],
)
def test_a_fault_during_evaluation_is_recovered_and_the_evaluation_redone(
    tmp_path: Path, reference: JobResult, fault: str
) -> None:
    res = run(tmp_path / "run", fault)
    assert res.rc == 0, res.output[-6000:]
    assert (tmp_path / "fired").exists() and f"fault in evaluation: {fault.split(':')[0]}" in res.output
    assert res.of("recovery"), res.output[-4000:]
    res.assert_same_weights(reference, nproc=2)  # weights, optimizer state and log history
    assert evaluations(res) == evaluations(reference), "the logged evaluation metrics differ"
    assert res.batches() == reference.batches(), "some rank trained on other micro-batches"
    # each evaluation's line printed once, as without the fault; the interrupted one started over
    assert res.output.count("'eval_loss'") == reference.output.count("'eval_loss'") == 2
    assert res.output.count("{'loss'") == reference.output.count("{'loss'") == 8
    assert "the evaluation and checkpoint at global step" in res.output
    if fault.startswith("kill"):
        assert [e["rank"] for e in res.of("spare_assigned")] == [1]
    assert not res.left_behind(), "processes of the job were left behind"
