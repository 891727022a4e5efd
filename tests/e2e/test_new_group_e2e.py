"""Groups that a script makes itself under ``checkpointless run``: ``dist.new_group([0, 1])``, a
Lightning-style ``dist.new_group(backend="gloo", timeout=10000 days)``,
``dist.new_subgroups_by_enumeration`` and ``dist.split_group`` (of the world, and of a subgroup),
each used inside the step, survive a SIGKILL and an
exception that leave peers waiting in those groups' collectives; every rank ends bitwise equal
(weights and every step's reduced metrics) to the fault-free run. A group that one rank never
makes ends the job with an error naming it. Megatron-Core's ``parallel_state`` makes every group
of a 3-D (TP 2 x PP 2) layout the same way and survives the same faults."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, read_digests, run_job, torchrun_env
from tests.helpers.reference import ReferenceRuns

NOWHERE = Path("/nonexistent")
SCRIPT = ROOT / "tests" / "scripts" / "new_groups.py"
MISSING = ROOT / "tests" / "scripts" / "missing_group.py"
ARGS = ["--steps", "40"]  # the job of the first two tests, whose fault-free run they share


@pytest.mark.timeout(300)
def test_script_groups_survive_kill_and_exception_bitwise(tmp_path: Path, reference: ReferenceRuns) -> None:
    args = ARGS
    ref = reference(3, data=NOWHERE, script=SCRIPT, script_args=args)
    # after its forward: rank 1 dies at step 12 while ranks 0 and 2 wait in the split groups'
    # all-reduces; rank 0 raises at step 25 while the others wait there; a spare takes rank 1's
    # place and makes the same groups (split ones included) again
    faults = ["kill:rank=1:step=12:site=forward", "raise:rank=0:step=25:site=forward"]
    res = run_job(tmp_path / "run", NOWHERE, 3, 1, faults, script=SCRIPT, script_args=args, timeout=240)
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=3)
    assert len(res.of("fault_injected")) == 2 and len(res.of("recovery")) >= 2, res.output[-4000:]
    # the peers were woken inside the split groups (keyed g<name>.r<ranks>), which each step
    # reduces on first, not only in the gradients' all-reduce: rank 1's kill leaves rank 0 in the
    # split of [0, 1] (named by its parent, #1) and rank 2 in the world's split #5 over [0, 2]
    woken = ("CommAborted: group g1_split0_0.r0.1 ", "CommAborted: group g5.r0.2 ")
    assert all(w in res.output for w in woken), res.output[-6000:]
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.timeout(200)
def test_script_groups_under_plain_torchrun_match_the_job(tmp_path: Path, reference: ReferenceRuns) -> None:
    # under plain torchrun the first generation forms in init(), so each group forms as it is
    # made; the same script ends with the same weights and metrics as under checkpointless run
    # (the fault-free run of the test above: 40 steps, not the 15 this once ran its own with)
    args = ARGS
    ref = reference(3, data=NOWHERE, script=SCRIPT, script_args=args)
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "3", str(SCRIPT), *args]
    cmd += ["--digest-out", str(tmp_path / "torchrun.digest-{rank}")]
    proc = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert read_digests(tmp_path, "torchrun.digest-") == {r: ref.digest for r in range(3)}


@pytest.mark.timeout(120)
def test_a_group_one_rank_never_makes_is_named(tmp_path: Path) -> None:
    res = run_job(tmp_path / "run", NOWHERE, 2, 0, script=MISSING, script_args=[], timeout=100)
    assert res.rc != 0
    # the group, its ranks and the rank that did not make it, well before the recovery timeout
    assert "dist.new_group #2 over ranks [0, 1] was made by ranks [0] but not by ranks [1]" in res.output, (
        res.output[-4000:]
    )
    assert "never reported" not in res.output, res.output[-4000:]


MEGATRON = ROOT / "tests" / "scripts" / "megatron_groups.py"
MEGATRON_ARGS = ["--steps", "12", "--tp", "2", "--pp", "2"]


@pytest.mark.timeout(240)
def test_megatron_parallel_state_groups_survive_kill_and_exception_bitwise(
    tmp_path: Path, reference: ReferenceRuns
) -> None:
    # 4 ranks, TP 2 x PP 2 (DP 1), Megatron's order tp-cp-ep-dp-pp: its ~20 groups (TP, PP, DP,
    # CP, EP, embedding, model-parallel, their gloo twins) made by dist.new_group after init();
    # each step reduces the loss over ten of them. Rank 1 dies in its forward, as its peers wait
    # in those groups; rank 2 raises there later; the spare makes every group again
    import megatron.core

    assert megatron.core.__version__ == "0.16.1", "the `megatron` extra pins what this test ran against"
    ref = reference(4, data=NOWHERE, script=MEGATRON, script_args=MEGATRON_ARGS)
    faults = ["kill:rank=1:step=4:site=forward", "raise:rank=2:step=8:site=forward"]
    res = run_job(
        tmp_path / "run", NOWHERE, 4, 1, faults, script=MEGATRON, script_args=MEGATRON_ARGS, timeout=200
    )
    assert res.rc == 0, res.output[-6000:]
    assert sorted(ref.digests) == [0, 1, 2, 3] and res.digests == ref.digests, "weights or group sums differ"
    assert len(res.of("fault_injected")) == 2 and len(res.of("recovery")) >= 2, res.output[-4000:]
    assert "CommAborted: group g" in res.output, "no peer was woken inside one of Megatron's groups"
    assert not res.left_behind(), "processes of the job were left behind"
