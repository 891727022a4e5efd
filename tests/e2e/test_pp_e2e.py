"""Pipeline parallel on a 2-D mesh (dp 2 x pp 2) through real faults, bitwise on every rank.

tests/scripts/pp_mlp.py makes its mesh with torch's ``init_device_mesh``, cuts an MLP into two
``PipelineStage``s over "pp" and runs them with ``Schedule1F1B`` (``ScheduleGPipe`` with
--schedule gpipe) over 4 microbatches; its two replicas over "dp" average their gradients over
the dp group. It tracks its schedule (``job.track(..., schedule=schedule)``), which names the
pipeline group: the state of rank r is stage ``r % 2`` of replica ``r // 2``. Under the launcher
(4 ranks, 1 spare, gloo, CPU) ranks raise in forward (inside the schedule, between the stages'
sends and receives), in backward, inside a receive and half-way through the optimizer update,
and stage ranks are killed mid-schedule and inside a send (the ``p2p`` fault site); every rank's final parameters and AdamW state must be bit for bit the
fault-free run's, and a rank that received state must have taken it from the rank holding its
own stage in the other replica. The reference is the same training with torch alone; the
fault-free run under the launcher and the adopted script under plain torchrun equal it too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, JobResult, read_digests, run_job, torchrun_env
from tests.helpers.paths import SCRIPTS
from tests.helpers.reference import ReferenceRuns

PP_SCRIPT = SCRIPTS / "pp_mlp.py"
ARGS = ["--steps", "8", "--schedule", "1f1b"]
PP = 2  # rank r is (dp=r // PP, pp=r % PP)


@pytest.fixture()
def pp_reference(reference: ReferenceRuns) -> JobResult:
    """The ground truth: the same training with torch alone, no checkpointless (--plain starts it
    torchrun-style), once per session. Every run of the adopted script must end equal to it."""
    res = reference(
        4, script=PP_SCRIPT, script_args=[*ARGS, "--torch-only"], extra=["--plain"], replicated=False
    )
    d = res.digests
    # the two replicas of each stage agree, and the two stages differ: really a pipeline
    assert sorted(d) == [0, 1, 2, 3] and d[0] == d[2] and d[1] == d[3] and d[0] != d[1], d
    return res


def expected_batches(steps: int = 8) -> dict[tuple[int, int], str]:
    """(rank, step) -> the digest of the batch it must train on: its replica's (torch alone
    records none, so they come from the script's own batch function)."""
    spec = importlib.util.spec_from_file_location("pp_mlp", PP_SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(script)
    finally:
        del sys.modules[spec.name]
    out: dict[tuple[int, int], str] = {}
    for rank in range(4):
        for step in range(steps):
            x, _ = script.batch(step, rank // PP)
            out[(rank, step)] = hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16]
    return out


def state_sources(res: JobResult) -> list[dict[int, int]]:
    """receiver -> source of every recovery plan after the first generation."""
    return [{r: s for r, s in e.get("sources", [])} for e in res.of("plan") if e["generation"] > 0]


def assert_same_stages(res: JobResult, ref: JobResult) -> None:
    assert res.rc == 0, res.output[-6000:]
    wrong = {
        r: (res.digests.get(r, "none")[:12], d[:12])
        for r, d in ref.digests.items()
        if res.digests.get(r) != d
    }
    assert not wrong, f"final stage states differ from the fault-free run's on ranks {wrong}"
    assert res.batches() == expected_batches(), "some rank trained on other samples than torch alone"
    for plan in state_sources(res):  # a source holds the receiver's stage, in another replica
        for r, s in plan.items():
            assert s % PP == r % PP and s // PP != r // PP, (r, s)
    assert not res.left_behind(), "processes of the job were left behind"


# one job, six faults, each replayed from unchanged state; fault -> {receiver: source} of its plan
MERGED: list[tuple[str, dict[int, int]]] = [
    # a raise inside (dp=0, pp=1)'s receive of microbatch 0's activation: (dp=0, pp=0) is left
    # waiting in its receive of that microbatch's gradient; no state moves. In step 1, after a
    # step without a fault: the first receive is the first thing stage 1 does in a step, so
    # right after a step that ends in a fault it could fire in the same round as that fault
    ("raise:rank=1:step=1:site=p2p", {}),
    # a raise in stage 0's forward of replica 1 (stage 1 waits in its receive): no state moves
    ("raise:rank=2:step=2:site=forward", {}),
    # a raise in stage 1's backward of replica 0, after its loss of microbatch 0 went backward
    # (the replay must not reuse the abandoned attempt's microbatch losses)
    ("raise:rank=1:step=3:site=backward", {}),
    # a SIGKILL of (dp=1, pp=0) inside its send of microbatch 0's activation, while (dp=1, pp=1)
    # waits for it in its receive: the spare takes stage 0 from (dp=0, pp=0)
    ("kill:rank=2:step=4:site=p2p", {2: 0}),
    # a SIGKILL of (dp=1, pp=1) in its backward, mid-schedule: the spare takes stage 1's state
    # from (dp=0, pp=1), and every stage prepares its schedule afresh with the newcomer
    ("kill:rank=3:step=5:site=backward", {3: 1}),
    # a raise half-way through (dp=0, pp=0)'s update: its stage comes back from (dp=1, pp=0)
    ("raise:rank=0:step=6:site=optimizer", {0: 2}),
]


@pytest.mark.timeout(150)
def test_pp_faults_in_every_phase_are_recovered_from_the_same_stage_bitwise(
    tmp_path: Path, corpus: Path, pp_reference: JobResult
) -> None:
    faults = [f for f, _ in MERGED]
    res = run_job(
        tmp_path / "run", corpus, nproc=4, spares=1, faults=faults, script=PP_SCRIPT, script_args=ARGS,
        timeout=120,
    )  # fmt: skip
    assert_same_stages(res, pp_reference)
    assert len(res.of("recovery")) == len(faults), res.output[-4000:]
    res.assert_each_fault_recovered(MERGED)
    # the raise came out of torch's receive, issued by the schedule
    raised = res.output.partition("[rank 1 step 1] step 1 raised InjectedFault")[2].partition("[launcher]")[0]
    assert "fwd_recv" in raised and "in irecv" in raised, res.output[-4000:]


@pytest.mark.soak
@pytest.mark.timeout(200)
def test_pp_fault_free_run_equals_the_same_training_with_torch_alone(
    reference: ReferenceRuns, pp_reference: JobResult
) -> None:
    # the job's first state sync copied each stage from its holder in the first replica, never
    # rank 0's stage onto every rank
    res = reference(4, script=PP_SCRIPT, script_args=ARGS, replicated=False)
    assert res.digests == pp_reference.digests
    assert res.batches() == expected_batches() and not res.of("recovery")


@pytest.mark.soak
@pytest.mark.timeout(200)
def test_pp_adopted_script_under_plain_torchrun_equals_checkpointless_run(
    tmp_path: Path, pp_reference: JobResult
) -> None:
    # one job without recovery: the mesh's groups form once from torchrun's store, and each rank
    # starts from its stage's holder in the first replica (recovery/torchrun.py)
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "4"]
    cmd += [str(PP_SCRIPT), *ARGS, "--digest-out", str(tmp_path / "torchrun.digest-{rank}")]
    proc = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert read_digests(tmp_path, "torchrun.digest-") == pp_reference.digests


@pytest.mark.soak
@pytest.mark.timeout(200)
def test_gpipe_kill_of_the_first_stage_and_raise_in_the_last_stage_bitwise(
    tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    # GPipe (every forward, then every backward): a SIGKILL of (dp=0, pp=1) inside its first
    # receive of step 1 (stage 0 goes on sending its forwards, then waits for a gradient), a
    # SIGKILL of (dp=0, pp=0) in its forward (stage 1 waits in a receive from it), then a raise
    # in (dp=1, pp=1)'s forward, at the loss
    args = ["--steps", "8", "--schedule", "gpipe"]
    ref = reference(4, script=PP_SCRIPT, script_args=args, replicated=False)
    faults = [
        "kill:rank=1:step=1:site=p2p",
        "kill:rank=0:step=3:site=forward",
        "raise:rank=3:step=5:site=forward",
    ]
    res = run_job(
        tmp_path / "run", corpus, nproc=4, spares=1, faults=faults, script=PP_SCRIPT, script_args=args,
        timeout=120,
    )  # fmt: skip
    assert_same_stages(res, ref)
    assert state_sources(res) == [{1: 3}, {0: 2}, {}], state_sources(res)


@pytest.mark.soak
@pytest.mark.timeout(250)
def test_interleaved_schedule_two_stages_per_rank_recovers_bitwise(
    tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    # ScheduleInterleaved1F1B, four stages, two per rank (pp 0: stages 0 and 2): four of the
    # 1F1B job's faults and a raise inside (dp=1, pp=0)'s first send of step 4 (after a step
    # that all ranks replayed, so that it has a round of its own), against the same training
    # with torch alone
    args = ["--steps", "8", "--schedule", "interleaved"]
    ref = reference(
        4, script=PP_SCRIPT, script_args=[*args, "--torch-only"], extra=["--plain"], replicated=False
    )
    faults = [
        "raise:rank=2:step=2:site=forward",
        "raise:rank=1:step=3:site=backward",
        "raise:rank=2:step=4:site=p2p",
        "kill:rank=3:step=5:site=backward",
        "raise:rank=0:step=6:site=optimizer",
    ]
    res = run_job(
        tmp_path / "run", corpus, nproc=4, spares=1, faults=faults, script=PP_SCRIPT, script_args=args,
        timeout=120,
    )  # fmt: skip
    assert_same_stages(res, ref)
    assert len(res.of("recovery")) == len(faults), res.output[-4000:]
    assert state_sources(res) == [{}, {}, {}, {3: 1}, {0: 2}], state_sources(res)


@pytest.mark.soak
@pytest.mark.timeout(300)
def test_dp_by_pp_by_tp_recovers_by_stage_and_tp_coordinates_bitwise(
    tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    # dp 2 x pp 2 x tp 2 on 8 ranks: each stage tensor-parallel (Colwise, Rowwise) inside the
    # pipeline. The DTensors name tp, the tracked schedule's group names pp: rank r's state is its
    # (pp, tp) coordinates r % 4. A SIGKILL of (1, 0, 1) in backward, where a stage's TP
    # all-reduce is aborted inside torch's stage (re-raised as a RuntimeError: still a peer's
    # fault, not the rank's own), then a raise in (0, 1, 0)'s forward
    args = ["--steps", "8", "--schedule", "1f1b", "--tp"]
    ref = reference(
        8, script=PP_SCRIPT, script_args=[*args, "--torch-only"], extra=["--plain"], replicated=False
    )
    d = ref.digests
    assert sorted(d) == list(range(8)) and all(d[r] == d[r + 4] for r in range(4)), d
    assert len({d[r] for r in range(4)}) == 4, d
    faults = ["kill:rank=5:step=4:site=backward", "raise:rank=2:step=6:site=forward"]
    res = run_job(
        tmp_path / "run", corpus, nproc=8, spares=1, faults=faults, script=PP_SCRIPT, script_args=args,
        timeout=200,
    )  # fmt: skip
    assert res.rc == 0, res.output[-6000:]
    assert res.digests == d, "final states differ from torch alone's"
    assert len(res.of("recovery")) == 2, res.output[-4000:]
    plans = state_sources(res)
    assert plans == [{5: 1}, {}], plans
    own_faults = [line for line in res.output.splitlines() if "FAULT rank" in line and "exception" in line]
    assert len(own_faults) == 1 and "rank 2" in own_faults[0], own_faults
