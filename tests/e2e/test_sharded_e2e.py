"""Sharded jobs (torch's FSDP2 over job.device_mesh) through real faults, bitwise on every shard.

Each test runs examples/train_gpt.py --fsdp R,S under the launcher (4 ranks, gloo, CPU; one with
--compile, inductor), injects a real fault and checks that every rank's final *shards* (not rank
0's alone) are bit for bit those of the fault-free run, that every (rank, step) trained on the
fault-free run's batch, and that a receiver took its state from a holder of its own shard in the
other replica group. FSDP 1x4 without buddy copies (--buddy-copies off) has nothing to recover
from: it must end with the documented error, never a wrong result (with buddy copies:
tests/e2e/test_buddy_e2e.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.jobs import EXAMPLE, ROOT, TINY, JobResult, read_digests, run_job, torchrun_env
from tests.helpers.paths import SCRIPTS
from tests.helpers.reference import ReferenceRuns

HSDP = [*TINY, "--fsdp", "2,2"]


@pytest.fixture()
def hsdp_reference(reference: ReferenceRuns) -> JobResult:
    """The fault-free HSDP 2x2 run (computed once per session)."""
    res = reference(4, script_args=HSDP, replicated=False)
    d = res.digests
    # replicas of a shard agree, and the two shards differ: these really are shards
    assert d[0] == d[2] and d[1] == d[3] and d[0] != d[1], d
    return res


def check_shards(res: JobResult, ref: JobResult) -> None:
    assert res.rc == 0, res.output[-6000:]
    wrong = {
        r: (res.digests.get(r, "none")[:12], d[:12])
        for r, d in ref.digests.items()
        if res.digests.get(r) != d
    }
    assert not wrong, f"final shards differ from the fault-free run's on ranks {wrong}"
    assert res.batches() == ref.batches(), "some rank trained on other samples than the fault-free run"
    # a fault in step 0 can land before the coordinator has heard every rank form generation 0
    # (the others are still reporting): start-up absorbs it, and must say so
    assert res.of("recovery") or res.startup_faults(), res.output[-4000:]
    assert not res.left_behind(), "processes of the job were left behind"


def under_torchrun(
    tmp_path: Path, script: Path, args: list[str], timeout: float
) -> tuple[str, dict[int, str]]:
    """``script args`` on 4 ranks under plain torchrun, which must succeed: its output and every
    rank's digest."""
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "4", str(script), *args]
    cmd += ["--digest-out", str(tmp_path / "torchrun.digest-{rank}")]
    proc = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out, read_digests(tmp_path, "torchrun.digest-")


@pytest.mark.timeout(300)
def test_hsdp_under_plain_torchrun_ends_with_the_same_shards_as_under_checkpointless_run(
    tmp_path: Path, corpus: Path, hsdp_reference: JobResult
) -> None:
    # One job without recovery: the mesh's groups form once from torchrun's store, and each rank
    # starts from its shard's holder in the first replica group, as the launcher's first round does
    out, got = under_torchrun(tmp_path, EXAMPLE, [*HSDP, "--data", str(corpus)], timeout=240)
    assert out.count("started by torchrun, so this job runs WITHOUT in-process recovery") == 4, out[-4000:]
    assert got == hsdp_reference.digests, f"shards differ from the same job under checkpointless run: {got}"


@pytest.mark.timeout(240)
def test_ranks_seeded_apart_start_from_their_shards_holder_under_both_launchers(
    tmp_path: Path, corpus: Path
) -> None:
    # Every rank builds its own initial weights (seeded by rank), so the replicas of a shard
    # agree at the end only if each rank took its shard's state from the first replica group's
    # holder as the job started: under checkpointless run (the first round) and under torchrun
    # (recovery/torchrun.py), alike.
    script = SCRIPTS / "hsdp_start.py"
    res = run_job(tmp_path / "run", corpus, nproc=4, spares=0, script=script, script_args=[], timeout=120)
    assert res.rc == 0, res.output[-4000:]
    d = res.digests
    assert sorted(d) == [0, 1, 2, 3] and d[0] == d[2] and d[1] == d[3] and d[0] != d[1], d
    out, got = under_torchrun(tmp_path, script, [], timeout=100)
    assert got == d, f"under torchrun the shards differ from checkpointless run's: {got} against {d}"
    # the mesh reused the default group init() had formed from torchrun's store (formed twice,
    # the first one stayed parked with its gloo threads for the whole job)
    parks = sorted(re.findall(r"rank (\d): default group parks (\d+) item", out))
    assert parks == [(str(r), "0") for r in range(4)], out[-3000:]


def fault_plans(res: JobResult) -> list[dict[int, int]]:
    """receiver -> source of every recovery plan after the first generation."""
    return [{r: s for r, s in e.get("sources", [])} for e in res.of("plan") if e["generation"] > 0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "fault,receivers",
    [
        # rank 1 (shard 1) takes shard 1 from rank 3. `make soak`: the same kill, with the same
        # source checked, is test_uneven_shards_in_mixed_precision_are_recovered_bitwise's
        # hsdp-replica case, and test_gradient_accumulation / test_activation_checkpointing kill
        # rank 1 of this mesh too
        pytest.param("kill:rank=1:step=4", {1: 3}, marks=pytest.mark.soak),
        # raised inside FSDP's reduce-scatter. `make soak`: the same raise (rank 2, backward)
        # is the second fault of test_gradient_accumulation, test_activation_checkpointing and
        # test_compiled_blocks, each checked bitwise
        pytest.param("raise:rank=2:step=3:site=backward", None, marks=pytest.mark.soak),
        ("raise:rank=1:step=4:site=optimizer", {1: 3}),  # half-updated: its shard is invalid
        ("raise:rank=3:step=3:site=forward", None),  # inside the forward's all-gathers
        ("kill:rank=1:step=0", {1: 3}),  # the very first step on the mesh
    ],
    ids=["sigkill", "raise-in-reduce-scatter", "raise-mid-optimizer", "raise-in-forward", "first-step"],
)
def test_hsdp_fault_is_recovered_from_the_replica_peer(
    tmp_path: Path, corpus: Path, hsdp_reference: JobResult, fault: str, receivers: dict[int, int] | None
) -> None:
    res = run_job(tmp_path / "run", corpus, nproc=4, spares=1, faults=[fault], script_args=HSDP, timeout=100)
    check_shards(res, hsdp_reference)
    assert len(res.of("fault_injected")) == 1, res.output[-4000:]
    if receivers is not None and not res.startup_faults():
        # the named ranks must take their shards from those sources; a rank of the other replica
        # group that was caught mid-update by the abort may receive as well (timing-dependent)
        plans = fault_plans(res)
        assert any(all(p.get(r) == src for r, src in receivers.items()) for p in plans), plans


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "faults",
    [
        # `make soak`: the stopped rank is found by the launcher's hang detection (test_faults_e2e's
        # sigstop-hang and busy-loop-hang) and replaced as a killed one is, which this mesh's kills
        # check (test_uneven_shards' hsdp-replica, test_gradient_accumulation)
        pytest.param(["hang:rank=3:step=4"], marks=pytest.mark.soak),
        # rank 1 dawdles first, so every peer has committed step 3 and the round is for step 4
        [
            "slow:rank=1:step=4:seconds=1",
            "kill:rank=1:step=4:site=forward",
            "kill:rank=2:step=4:site=recovery",
        ],
    ],
    ids=["sigstop", "second-fault-during-recovery"],
)
def test_hsdp_hang_and_fault_during_recovery(
    tmp_path: Path, corpus: Path, hsdp_reference: JobResult, faults: list[str]
) -> None:
    res = run_job(tmp_path / "run", corpus, nproc=4, spares=2, faults=faults, script_args=HSDP, timeout=100)
    check_shards(res, hsdp_reference)
    assert len(res.of("fault_injected")) == len(faults), res.output[-4000:]
    assert res.of("spare_assigned"), "a dead or stopped rank must be replaced by a spare"


@pytest.mark.timeout(120)
def test_hsdp_whole_replica_group_lost_is_recovered_from_the_other_group(
    tmp_path: Path, corpus: Path, hsdp_reference: JobResult
) -> None:
    faults = ["kill:rank=0:step=4", "kill:rank=1:step=4"]  # replica group 0 is ranks 0 and 1
    res = run_job(tmp_path / "run", corpus, nproc=4, spares=2, faults=faults, script_args=HSDP, timeout=100)
    check_shards(res, hsdp_reference)
    # each took its own shard from the other group (one plan, or two if the kills were apart)
    got: dict[int, int] = {}
    for plan in fault_plans(res):
        got.update(plan)
    assert got.get(0) == 2 and got.get(1) == 3, fault_plans(res)


@pytest.mark.timeout(90)
def test_fsdp_without_replica_ends_with_the_documented_error(tmp_path: Path, corpus: Path) -> None:
    res = run_job(
        tmp_path / "run",
        corpus,
        nproc=4,
        spares=1,
        faults=["kill:rank=2:step=4"],
        # no buddy copies and no snapshot before step 50: the shard exists nowhere else
        extra=["--buddy-copies", "off"],
        script_args=[*TINY, "--fsdp", "1,4"],
        timeout=80,
    )
    assert res.rc != 0, "an FSDP job that lost its only copy of a shard must not go on"
    assert "no replica, no buddy copy and no snapshot" in res.output, res.output[-4000:]
    assert "R >= 2" in res.output and "--buddy-copies" in res.output, res.output[-4000:]
    assert not res.digests, f"no rank may finish with a result: {res.digests}"
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.timeout(120)
def test_hsdp_divergence_check_compares_only_replicas_of_a_shard(
    tmp_path: Path, corpus: Path, hsdp_reference: JobResult
) -> None:
    # A check every 3 steps: each rank hashes its own shards (DTensors' local tensors) and only
    # the two replicas of one shard are compared; the two shards differ by design, so a healthy
    # run reports no divergence and trains exactly the fault-free shards.
    res = run_job(
        tmp_path / "run", corpus, nproc=4, spares=0, extra=["--divergence-check", "3"],
        script_args=HSDP, timeout=110,
    )  # fmt: skip
    assert res.rc == 0, res.output[-4000:]
    assert res.digests == hsdp_reference.digests
    assert not res.of("divergence") and not res.of("recovery"), res.output[-4000:]


# Uneven shards (dim 33, 3 heads: the attention's 99-row projection and every 33-wide norm split
# unevenly over 2 or 4 ranks, so FSDP2 pads and ranks hold shards of different sizes) in bfloat16
# mixed precision (parameters gathered and computed in bf16, gradients reduced in fp32, the
# sharded state and the optimizer fp32): what users of FSDP2 write for real models.
UNEVEN_BF16 = [*TINY, "--dim", "33", "--heads", "3", "--param-dtype", "bfloat16"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "mesh,fault,extra",
    [
        ("2,2", "kill:rank=1:step=4", []),  # from the replica peer (rank 3)
        # from its buddy copy (`make soak`: the same staging as the buddy e2e tests, 20 s)
        pytest.param("1,4", "kill:rank=2:step=4", ["--buddy-copies", "on"], marks=pytest.mark.soak),
    ],
    ids=["hsdp-replica", "fsdp-buddy"],
)
def test_uneven_shards_in_mixed_precision_are_recovered_bitwise(
    tmp_path: Path, corpus: Path, mesh: str, fault: str, extra: list[str]
) -> None:
    args = [*UNEVEN_BF16, "--fsdp", mesh]
    ref = run_job(tmp_path / "ref", corpus, nproc=4, spares=0, extra=extra, script_args=args, timeout=90)
    assert ref.rc == 0, ref.output[-4000:]
    assert sorted(ref.digests) == [0, 1, 2, 3] and len(set(ref.digests.values())) == (
        2 if mesh == "2,2" else 4
    )
    res = run_job(
        tmp_path / "run", corpus, nproc=4, spares=1, faults=[fault], extra=extra, script_args=args, timeout=90
    )
    check_shards(res, ref)
    assert len(res.of("fault_injected")) == 1 and res.of("spare_assigned"), res.output[-4000:]
    plans = [e for e in res.of("plan") if e["generation"] > 0]
    if mesh == "2,2":
        assert any([1, 3] in p.get("sources", []) for p in plans), plans  # same shard, other replica
    else:
        assert any(2 in p.get("from_copy", []) and [2, 3] in p["sources"] for p in plans), plans


def ref_then_faults(
    tmp_path: Path,
    corpus: Path,
    args: list[str],
    faults: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
) -> tuple[JobResult, JobResult]:
    """The HSDP 2x2 job ``args`` without faults, then with ``faults`` (one spare): every rank's
    shards of the second bitwise those of the first, every fault injected, a spare used."""
    ref = run_job(tmp_path / "ref", corpus, nproc=4, spares=0, script_args=args, timeout=timeout, env=env)
    assert ref.rc == 0, ref.output[-4000:]
    assert sorted(ref.digests) == [0, 1, 2, 3] and len(set(ref.digests.values())) == 2, ref.digests
    res = run_job(
        tmp_path / "run", corpus, nproc=4, spares=1, faults=faults, script_args=args, timeout=timeout, env=env
    )
    check_shards(res, ref)
    assert len(res.of("fault_injected")) == len(faults) and res.of("spare_assigned"), res.output[-4000:]
    return ref, res


@pytest.mark.soak  # `make soak`: inductor compiles every block in every process, 130 s on 2 cores
@pytest.mark.timeout(300)
def test_compiled_blocks_are_recovered_bitwise(tmp_path: Path, corpus: Path) -> None:
    # torchtitan's recipe: every block compiled by inductor, then fully_shard. A killed rank's
    # replacement compiles again on its first step (from inductor's cache: the same kernels), and
    # the healthy ranks abort out of a reduce-scatter issued between compiled backward graphs.
    args = [*HSDP, "--compile"]
    # the cache under the test's folder: nothing left in /tmp, and the faulted run reuses the
    # reference's kernels as a replacement on a real host reuses the job's
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    faults = ["kill:rank=1:step=3", "raise:rank=2:step=6:site=backward"]
    _, res = ref_then_faults(tmp_path, corpus, args, faults, timeout=200, env=env)
    assert any((tmp_path / "inductor").rglob("*.py")), "inductor compiled nothing: the blocks ran eagerly"
    assert any([1, 3] in p.get("sources", []) for p in res.of("plan")), res.of("plan")


@pytest.mark.timeout(240)
def test_gradient_accumulation_is_recovered_bitwise(tmp_path: Path, corpus: Path) -> None:
    # Three micro-batches per step, gradients reduced only after the last
    # (set_requires_gradient_sync), in bf16 mixed precision: FSDP2 keeps the first two's sum as
    # unsharded fp32 gradients (unsharded_accumulated_grad; in full precision, the unsharded
    # parameters' .grad). A kill lands while a peer holds such a sum (rank 3 meets the dead rank 1
    # only in the last micro-batch's all-reduce), an exception inside the last micro-batch's
    # reduce-scatter with its own; the replay must start the step's sum from nothing everywhere.
    args = [*HSDP, "--global-batch", "24", "--grad-accum", "3", "--param-dtype", "bfloat16"]
    ref_then_faults(tmp_path, corpus, args, ["kill:rank=1:step=3", "raise:rank=2:step=6:site=backward"], 100)


@pytest.mark.timeout(240)
def test_activation_checkpointing_is_recovered_bitwise(tmp_path: Path, corpus: Path) -> None:
    # Every block's activations recomputed in backward (torch.utils.checkpoint): FSDP2 all-gathers
    # each block's parameters a second time inside backward, so the peers of a rank killed in its
    # backward abort out of a recompute's all-gather or a reduce-scatter with FSDP2 mid-backward,
    # and a replayed step must reproduce the recompute's dropout masks from the saved RNG state.
    args = [*HSDP, "--activation-checkpointing"]
    faults = ["kill:rank=1:step=3:site=backward", "raise:rank=2:step=6:site=backward"]
    runs = ref_then_faults(tmp_path, corpus, args, faults, 100)
    # the flag is honoured (recompute gives the same bits as none, so the digests cannot show
    # it): every committed step of every rank, replays included, ran each block's forward again
    # inside its backward
    layers = int(HSDP[HSDP.index("--layers") + 1])
    for res in runs:
        commits = res.commits()
        assert len({(e["rank"], e["step"]) for e in commits}) == 4 * 10, "every rank's every step"
        assert {e.get("recomputed") for e in commits} == {layers}, commits
