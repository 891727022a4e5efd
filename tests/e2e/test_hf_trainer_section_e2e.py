"""CheckpointlessTrainer: a fault on one rank after its boundary section has done all its work.

Each run is tests/scripts/hf_epoch_eval.py (a 2-layer GPT-2, 3 epochs of 4 optimizer steps,
gradient accumulation 2, an evaluation and a checkpoint at each epoch's end, the best checkpoint
loaded at the end) on 2 ranks and 1 spare. The fault fires as the boundary's section returns on
one rank (``--inject ...:site=section``): its evaluation is logged, its checkpoint written and
its log lines shown on every rank, and only the step loop's closing barrier is left. The section
is redone on every rank from the state it began with, which the Trainer keeps until the section
has closed on every rank together (``Section.closed``): had it let that state go as its own work
ended, the redo would append the evaluation to the log history a second time. Every rank's
weights, optimizer state, log history, evaluation metrics, best checkpoint and every checkpoint
file must equal the fault-free run's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.e2e.test_hf_epoch_eval_e2e import checkpoints, summaries
from tests.helpers.jobs import ROOT, JobResult, start_job
from tests.helpers.reference import ReferenceRuns

pytest.importorskip("transformers", reason="the `hf` extra is not installed")

SCRIPT = ROOT / "tests" / "scripts" / "hf_epoch_eval.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def outputs(folder: Path) -> tuple[list[str], dict[str, str]]:
    """The script's arguments and environment for a run whose files go to ``folder``."""
    env = {**OFFLINE, "HF_EPOCH_OUT": str(folder / "summary-{rank}.json")}
    return ["--output-dir", str(folder / "out")], env


@pytest.fixture(scope="module")
def ref(reference: ReferenceRuns, tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    args, env = outputs(tmp_path_factory.mktemp("hf-section-ref"))
    res = reference(2, script=SCRIPT, script_args=args, env=env)
    # checkpoints() and summaries() read beside a run's folder: here, the folder named above
    return dataclasses.replace(res, run_dir=Path(env["HF_EPOCH_OUT"]).parent / "run")


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "fault",
    [
        # rank 1, after the first epoch's evaluation and checkpoint-4
        pytest.param("raise:rank=1:step=4:site=section", id="raise-rank1-epoch1"),
        # rank 0 (which writes the checkpoints), after the last epoch's end: the best checkpoint
        # is loaded there, in the same section
        pytest.param("raise:rank=0:step=12:site=section", id="raise-rank0-end", marks=pytest.mark.soak),
    ],
)
def test_a_fault_as_trainers_section_returns_redoes_it_from_its_start(
    tmp_path: Path, ref: JobResult, fault: str
) -> None:
    args, env = outputs(tmp_path)
    res = start_job(
        tmp_path / "run", tmp_path / "unused", 2, 1, [fault], script_args=args, script=SCRIPT,
        hang_timeout=6, env=env,
    ).finish(150)  # fmt: skip
    assert res.rc == 0, res.output[-6000:]
    assert res.fired(fault) and res.of("recovery"), res.output[-4000:]
    assert "the evaluation and checkpoint at global step" in res.output  # redone from its start
    res.assert_same_weights(ref, nproc=2)  # the best checkpoint's weights, optimizer, log history
    assert summaries(res) == summaries(ref), "evaluation metrics or the best checkpoint differ"
    assert checkpoints(res) == checkpoints(ref), "Trainer's checkpoints differ"
    assert res.output.count("'eval_loss'") == ref.output.count("'eval_loss'") == 3
    assert not res.left_behind(), "processes of the job were left behind"
