"""A second real public script, adopted: pytorch/examples' minGPT-ddp (its Trainer, its
CharDataset, its config; ported to CPU/gloo in examples/adopted/mingpt_adopted/) keeps its own
DataLoader with ``DistributedSampler(dataset)``, survives a kill, an exception and an exception
inside the optimizer update, and every rank ends bitwise equal to the fault-free run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.corpus import write_words
from tests.helpers.jobs import ROOT, run_job

NOWHERE = Path("/nonexistent")
MAIN = ROOT / "examples" / "adopted" / "mingpt_adopted" / "main.py"


@pytest.mark.timeout(400)
# without AMP under `make soak`: the float16 case runs the same script, faults and checks, and
# its optimizer fault lands after the GradScaler's unscale_ as well
@pytest.mark.parametrize("amp", [pytest.param("off", marks=pytest.mark.soak), "float16"])
def test_mingpt_adopted_survives_kill_exception_and_optimizer_fault_bitwise(tmp_path: Path, amp: str) -> None:
    """With ``amp`` on, the script's own autocast (float16, as upstream) and GradScaler: the fault
    inside the optimizer update lands after the scaler's unscale_, the case that used to diverge."""
    text = write_words(tmp_path / "input.txt")
    mixed = [] if amp == "off" else ["trainer_config.use_amp=True", f"trainer_config.amp_dtype={amp}"]

    def args(name: str) -> list[str]:
        return [f"data_config.path={text}", f"trainer_config.snapshot_path={tmp_path / name}.pt", *mixed]

    ref = run_job(tmp_path / "ref", NOWHERE, 2, 0, script=MAIN, script_args=args("ref"), timeout=200)
    assert ref.rc == 0 and ref.digest is not None, ref.output[-4000:]
    # 2 epochs of 67 steps; the faults fall in both, and the eval pass runs between them
    faults = ["kill:rank=1:step=20", "raise:rank=0:step=60", "raise:rank=1:step=90:site=optimizer"]
    res = run_job(tmp_path / "run", NOWHERE, 2, 1, faults, script=MAIN, script_args=args("run"), timeout=300)
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=2)
    assert len(res.of("fault_injected")) == 3 and len(res.of("recovery")) >= 3, res.output[-4000:]
    assert not res.left_behind(), "processes of the job were left behind"
    # the Trainer's own snapshot after each epoch, written by rank 0 as in the original
    assert (tmp_path / "run.pt").exists()
