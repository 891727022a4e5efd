"""A real public script, adopted: pytorch/examples' DDP tutorial (multigpu_torchrun.py, ported to
CPU/gloo in examples/adopted/) survives a kill, an exception and a fault inside the optimizer step,
and ends with every rank's weights bitwise equal to the fault-free run's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, run_job

NOWHERE = Path("/nonexistent")
TUTORIAL = ROOT / "examples" / "adopted" / "multigpu_torchrun_adopted.py"


@pytest.mark.timeout(400)
def test_ddp_tutorial_adopted_survives_kill_exception_and_optimizer_fault_bitwise(tmp_path: Path) -> None:
    # 2048 samples, 2 ranks, batches of 32: 32 steps an epoch, 3 epochs
    def args(name: str) -> list[str]:
        return ["3", "1", "--snapshot_path", str(tmp_path / f"{name}.pt")]

    ref = run_job(tmp_path / "ref", NOWHERE, 2, 0, script=TUTORIAL, script_args=args("ref"))
    assert ref.rc == 0 and ref.digest is not None, ref.output[-4000:]
    faults = ["kill:rank=1:step=20", "raise:rank=0:step=45", "raise:rank=1:step=70:site=optimizer"]
    res = run_job(
        tmp_path / "run", NOWHERE, 2, 1, faults, script=TUTORIAL, script_args=args("run"), timeout=300
    )
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=2)
    assert len(res.of("fault_injected")) == 3 and len(res.of("recovery")) >= 3, res.output[-4000:]
    assert not res.left_behind(), "processes of the job were left behind"
    # the script's own snapshot after each epoch, written by rank 0 as in the original
    assert (tmp_path / "run.pt").exists()
