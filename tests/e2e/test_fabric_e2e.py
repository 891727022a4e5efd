"""Lightning Fabric under ``checkpointless run`` (issue 38: Fabric fits the same core):
``Fabric(strategy=CheckpointlessFabricStrategy())`` with Fabric's own ``setup``,
``setup_dataloaders``, ``backward``, ``all_reduce`` and ``barrier``, the loop on ``job.steps``.
A SIGKILL, an exception in backward and one inside ``fabric.all_reduce`` are each recovered in
process; every rank ends bitwise equal to the fault-free run (weights, AdamW state and every
step's averaged loss)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import SCRIPTS, run_job
from tests.helpers.reference import ReferenceRuns

SCRIPT = SCRIPTS / "fabric_ddp.py"
ARGS = ["--steps", "30"]


@pytest.mark.timeout(300)
def test_fabric_loop_survives_a_kill_and_exceptions_bitwise(
    tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    ref = reference(2, script=SCRIPT, script_args=ARGS)
    # rank 1 dies as step 12 begins (its peer then waits in the gradients' all-reduce), rank 0
    # raises in its backward at step 20, rank 1 inside fabric.all_reduce of the loss at step 25
    faults = [
        "kill:rank=1:step=12",
        "raise:rank=0:step=20:site=backward",
        "raise:rank=1:step=25:site=allreduce",
    ]
    res = run_job(tmp_path / "run", corpus, 2, 1, faults, script=SCRIPT, script_args=ARGS, timeout=240)
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=2)
    assert all(res.fired(f) for f in faults) and len(res.of("fault_injected")) == 3, res.of("fault_injected")
    assert res.of("spare_assigned"), "the killed rank's place was never given to the spare"
    # rank 0's lines through fabric.print: each step's once, as in the fault-free run
    lines = [x for x in res.output.splitlines() if " loss " in x and x.startswith("step ")]
    want = [x for x in ref.output.splitlines() if " loss " in x and x.startswith("step ")]
    assert lines == want, (lines, want)
    assert not res.left_behind(), "processes of the job were left behind"
