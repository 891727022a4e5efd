"""Tensor parallel on a 2-D mesh (dp 2 x tp 2) through real faults, bitwise on every rank's shards.

tests/scripts/tp_mlp.py makes its mesh with torch's ``init_device_mesh`` and splits an MLP over
"tp" with ``parallelize_module`` (Colwise, then Rowwise); its two replicas over "dp" average
their gradients over the dp group. Under the launcher (4 ranks, 1 spare, gloo, CPU) a rank is
killed or a step raises; every rank's final parameters and AdamW state must be bit for bit the
fault-free run's, and a rank that received state must have taken it from the rank with its own
tp coordinate in the other replica, never from another tp shard. The fault-free run itself must
equal the same training under torch alone and the adopted script under plain torchrun. With
--fsdp (FSDP2 over dp after the TP split) no two ranks share a state, and a killed rank's comes
back from its buddy copy. With --hsdp 2 the mesh has three dimensions (replicate 2 x FSDP 2 x
TP 2, 8 ranks) and a rank's state is named by its (shard, tp) coordinates; with --seq the
model has SequenceParallel norms and loss parallel.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, JobResult, read_digests, run_job, torchrun_env
from tests.helpers.paths import SCRIPTS
from tests.helpers.reference import ReferenceRuns

TP_SCRIPT = SCRIPTS / "tp_mlp.py"
ARGS = ["--steps", "8"]
TP = 2  # rank r is (dp=r // TP, tp=r % TP)


@pytest.fixture()
def tp_reference(reference: ReferenceRuns) -> JobResult:
    """The fault-free dp 2 x tp 2 run (once per session)."""
    res = reference(4, script=TP_SCRIPT, script_args=ARGS, replicated=False)
    d = res.digests
    # the two replicas of each tp shard agree, and the two tp shards differ: really shards
    assert sorted(d) == [0, 1, 2, 3] and d[0] == d[2] and d[1] == d[3] and d[0] != d[1], d
    return res


def state_sources(res: JobResult) -> list[dict[int, int]]:
    """receiver -> source of every recovery plan after the first generation."""
    return [{r: s for r, s in e.get("sources", [])} for e in res.of("plan") if e["generation"] > 0]


# `make test` runs the faults of the three cases below in one job (MERGED; the backward raise at
# step 3 there, the forward one at step 2), each recovery's plan checked as its own case checks it
# (test_tp_faults_in_one_job_are_each_recovered_from_the_same_tp_coordinate_bitwise); the cases
# one job each run under `make soak` only
MERGED: list[tuple[str, dict[int, int]]] = [
    ("raise:rank=2:step=2:site=forward", {}),
    ("raise:rank=1:step=3:site=backward", {}),
    ("kill:rank=1:step=4", {1: 3}),
    ("raise:rank=0:step=5:site=optimizer", {0: 2}),
]


@pytest.mark.timeout(150)
def test_tp_faults_in_one_job_are_each_recovered_from_the_same_tp_coordinate_bitwise(
    tmp_path: Path, corpus: Path, tp_reference: JobResult
) -> None:
    faults = [f for f, _ in MERGED]
    res = run_job(
        tmp_path / "run",
        corpus,
        nproc=4,
        spares=1,
        faults=faults,
        script=TP_SCRIPT,
        script_args=ARGS,
        timeout=120,
    )
    assert res.rc == 0, res.output[-6000:]
    wrong = {
        r: (res.digests.get(r, "none")[:12], d[:12])
        for r, d in tp_reference.digests.items()
        if res.digests.get(r) != d
    }
    assert not wrong, f"final shards differ from the fault-free run's on ranks {wrong}"
    assert res.batches() == tp_reference.batches(), (
        "some rank trained on other samples than the fault-free run"
    )
    assert len(res.of("recovery")) == len(faults), res.output[-4000:]
    res.assert_each_fault_recovered(MERGED)
    for plan in state_sources(
        res
    ):  # whatever the plan, a source holds the receiver's tp shard in another replica
        for r, s in plan.items():
            assert s % TP == r % TP and s // TP != r // TP, (r, s)
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.soak
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "faults,receivers",
    [
        # the spare takes (dp=0, tp=1) and gets tp shard 1 from (dp=1, tp=1)
        (["kill:rank=1:step=4"], {1: 3}),
        # in forward (its Rowwise all-reduce) and in backward (the Colwise input's all-reduce):
        # each replayed in process, nobody receives state
        (["raise:rank=2:step=3:site=forward", "raise:rank=1:step=5:site=backward"], {}),
        # half-updated: (dp=0, tp=0)'s shard is invalid and comes back from (dp=1, tp=0)
        (["raise:rank=0:step=5:site=optimizer"], {0: 2}),
    ],
    ids=["sigkill", "raise-in-forward-and-backward", "raise-mid-optimizer"],
)
def test_tp_fault_is_recovered_from_the_same_tp_coordinate_bitwise(
    tmp_path: Path, corpus: Path, tp_reference: JobResult, faults: list[str], receivers: dict[int, int]
) -> None:
    res = run_job(
        tmp_path / "run",
        corpus,
        nproc=4,
        spares=1,
        faults=faults,
        script=TP_SCRIPT,
        script_args=ARGS,
        timeout=100,
    )
    assert res.rc == 0, res.output[-6000:]
    wrong = {
        r: (res.digests.get(r, "none")[:12], d[:12])
        for r, d in tp_reference.digests.items()
        if res.digests.get(r) != d
    }
    assert not wrong, f"final shards differ from the fault-free run's on ranks {wrong}"
    assert res.batches() == tp_reference.batches(), (
        "some rank trained on other samples than the fault-free run"
    )
    assert len(res.of("recovery")) == len(faults), res.output[-4000:]
    plans = state_sources(res)
    assert plans and plans[0] == receivers, plans
    for plan in plans:  # whatever the plan, a source holds the receiver's tp shard in another replica
        for r, s in plan.items():
            assert s % TP == r % TP and s // TP != r // TP, (r, s)
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.timeout(150)
def test_fsdp_by_tp_lost_rank_comes_back_from_its_buddy_copy_bitwise(
    tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    # fully_shard over dp after the TP split: every DTensor is sharded along both dimensions, so
    # no two ranks hold the same state (R = 1) and the killed rank's comes from its buddy copy
    args = [*ARGS, "--fsdp"]
    ref = reference(4, script=TP_SCRIPT, script_args=args, replicated=False)
    assert sorted(ref.digests) == [0, 1, 2, 3] and len(set(ref.digests.values())) == 4, ref.digests
    res = run_job(
        tmp_path / "run",
        corpus,
        nproc=4,
        spares=1,
        faults=["kill:rank=1:step=4"],
        script=TP_SCRIPT,
        script_args=args,
        timeout=100,
    )
    assert res.rc == 0, res.output[-6000:]
    assert res.digests == ref.digests, "final shards differ from the fault-free run's"
    plans = [e for e in res.of("plan") if e["generation"] > 0]
    assert plans and plans[0]["from_copy"] == [1], plans


HSDP_TP = [*ARGS, "--hsdp", "2"]  # (dp 2, shard 2, tp 2): rank r is (r // 4, r // 2 % 2, r % 2)


@pytest.fixture()
def hsdp_tp_reference(reference: ReferenceRuns) -> JobResult:
    """The fault-free 3-D run: 8 ranks, 4 states (one per (shard, tp)), each held by both dp."""
    res = reference(8, script=TP_SCRIPT, script_args=HSDP_TP, replicated=False)
    d = res.digests
    assert sorted(d) == list(range(8)) and all(d[r] == d[r + 4] for r in range(4)), d
    assert len({d[r] for r in range(4)}) == 4, d
    return res


@pytest.mark.timeout(150)
def test_replicate_by_fsdp_by_tp_on_a_3d_mesh_recovers_by_shard_and_tp_coordinates(
    tmp_path: Path, corpus: Path, hsdp_tp_reference: JobResult
) -> None:
    # replicate 2 x FSDP 2 x TP 2, FSDP2's HSDP over (dp, shard) after the TP split: the state
    # is named by its (shard, tp) coordinates and replicated over dp. A kill of (1, 0, 1), then
    # a raise in backward (inside FSDP2's reduce-scatter or TP's all-reduce, wherever the
    # others are) on another rank, in one job. The divergence check every 2 steps compares only
    # the two replicas of each (shard, tp) state: the four states differ by design
    faults = ["kill:rank=5:step=4", "raise:rank=2:step=6:site=backward"]
    res = run_job(
        tmp_path / "run",
        corpus,
        nproc=8,
        spares=1,
        faults=faults,
        extra=["--divergence-check", "2"],
        script=TP_SCRIPT,
        script_args=HSDP_TP,
        timeout=120,
    )
    assert res.rc == 0, res.output[-6000:]
    assert res.digests == hsdp_tp_reference.digests, "final shards differ from the fault-free run's"
    assert len(res.of("recovery")) == 2 and not res.of("divergence"), res.output[-4000:]
    plans = state_sources(res)
    assert plans[0] == {5: 1}, plans  # (dp 1, shard 0, tp 1) from (dp 0, shard 0, tp 1)
    for plan in plans:
        assert all(s % 4 == r % 4 and s != r for r, s in plan.items()), plans


@pytest.mark.soak
@pytest.mark.timeout(200)
def test_replicate_by_fsdp_by_tp_equals_the_same_training_with_torch_alone(
    tmp_path: Path, corpus: Path, hsdp_tp_reference: JobResult
) -> None:
    res = run_job(
        tmp_path / "torch",
        corpus,
        nproc=8,
        spares=0,
        extra=["--plain"],
        script=TP_SCRIPT,
        script_args=[*HSDP_TP, "--torch-only"],
        timeout=180,
    )
    assert res.rc == 0, res.output[-6000:]
    assert res.digests == hsdp_tp_reference.digests


@pytest.mark.timeout(200)
def test_sequence_parallel_and_loss_parallel_recover_to_torch_alone_bitwise(
    tmp_path: Path, corpus: Path
) -> None:
    # SequenceParallel norms leave Partial gradients that AdamW would all-reduce inside its
    # step; the job settles them before the update guard, so a raise half-way through rank 0's
    # update leaves the other ranks' updates whole (rank 0 takes its shard from rank 2). A kill
    # first, in the same job. The fault-free reference is torch alone.
    args = [*ARGS, "--seq"]
    ref = run_job(
        tmp_path / "torch", corpus, nproc=4, spares=0, extra=["--plain"], script=TP_SCRIPT,
        script_args=[*args, "--torch-only"], timeout=150,
    )  # fmt: skip
    assert ref.rc == 0, ref.output[-6000:]
    d = ref.digests
    assert sorted(d) == [0, 1, 2, 3] and d[0] == d[2] and d[1] == d[3] and d[0] != d[1], d
    faults = ["kill:rank=2:step=3", "raise:rank=0:step=5:site=optimizer"]
    res = run_job(
        tmp_path / "run", corpus, nproc=4, spares=1, faults=faults, script=TP_SCRIPT, script_args=args,
        timeout=100,
    )  # fmt: skip
    assert res.rc == 0, res.output[-6000:]
    assert res.digests == ref.digests, "final shards differ from torch alone's"
    assert state_sources(res) == [{2: 0}, {0: 2}], state_sources(res)


@pytest.mark.timeout(200)
def test_tp_equals_the_same_training_with_torch_alone(
    tmp_path: Path, corpus: Path, tp_reference: JobResult
) -> None:
    # torch alone (no checkpointless; --plain starts it torchrun-style) is the ground truth: the
    # job's first state sync copied each tp shard from its holder in the first replica, never
    # rank 0's shard onto every rank (the shapes agree, so nothing else would notice)
    res = run_job(
        tmp_path / "torch",
        corpus,
        nproc=4,
        spares=0,
        extra=["--plain"],
        script=TP_SCRIPT,
        script_args=[*ARGS, "--torch-only"],
        timeout=150,
    )
    assert res.rc == 0, res.output[-6000:]
    assert res.digests == tp_reference.digests


@pytest.mark.timeout(200)
def test_tp_adopted_script_under_plain_torchrun_equals_checkpointless_run(
    tmp_path: Path, tp_reference: JobResult
) -> None:
    # one job without recovery: the script's mesh groups form once from torchrun's store, and
    # each rank starts from its tp shard's holder in the first replica (recovery/torchrun.py)
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "4"]
    cmd += [str(TP_SCRIPT), *ARGS, "--digest-out", str(tmp_path / "torchrun.digest-{rank}")]
    proc = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert read_digests(tmp_path, "torchrun.digest-") == tp_reference.digests
