"""Real jobs, real faults: every run must end bitwise identical to the fault-free run.

Each test starts the launcher with worker and spare processes, injects a real fault (an
exception, SIGKILL, os._exit, SIGSTOP, a busy loop, ...) and checks: the job succeeded, every
rank's final weights' SHA-256 equals the fault-free run's, every (rank, step) trained on exactly the
batch of the fault-free run, a recovery was recorded, and no process of the job is left.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.jobs import TINY, JobResult, assert_batches_but_cut, fault_at, run_job
from tests.helpers.paths import SCRIPTS


def check_recovered(res: JobResult, ref: JobResult, recoveries: int = 1, cut: bool = False) -> None:
    """With ``cut``: a (rank, step) line may be missing at a step a recovery round cut off
    (``JobResult.cut_steps``), for jobs where a rank's process can die in its update while its
    peers' updates stand; the weights, compared besides, say that step was trained exactly."""
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=len(ref.digests))
    if cut:
        assert_batches_but_cut(res.batches(), ref.batches(), res.cut_steps())
    else:
        assert res.batches() == ref.batches(), "some rank trained on other samples than the fault-free run"
    recs = res.of("recovery")
    # a fault that start-up absorbed (step 0, before generation 0 formed everywhere) is named there
    assert len(recs) + len(res.startup_faults()) >= recoveries, res.output[-6000:]
    assert not res.left_behind(), "processes of the job were left behind"
    shm = res.of("job_start")[0]["shm"]
    assert shm.startswith("/dev/shm/checkpointless-") and not Path(shm).exists(), "shared memory left behind"


CASES: list[tuple[str, list[str]]] = [
    # `make soak` (SOAK_CASES): the same abort and replay as raise-backward's, a step earlier;
    # an exception at the forward site stays in `make test` in test_new_group_e2e,
    # test_lightning_e2e and test_hf_e2e
    ("raise-forward", ["raise:rank=1:step=3:site=forward"]),
    ("raise-backward", ["raise:rank=2:step=4:site=backward"]),
    ("raise-allreduce", ["raise:rank=0:step=5:site=allreduce"]),
    ("raise-mid-optimizer", ["raise:rank=1:step=4:site=optimizer"]),
    ("sigkill", ["kill:rank=1:step=4"]),
    ("os-exit", ["exit:rank=2:step=6"]),
    ("sigstop-hang", ["hang:rank=1:step=5"]),
    ("busy-loop-hang", ["spin:rank=2:step=3"]),
    ("first-step", ["kill:rank=0:step=0"]),
    # in the final barrier (step 10 of 10): the survivors meet in the barrier again after the
    # recovery; one that ran a step instead aborted the job with a collective size mismatch
    ("final-barrier", ["kill:rank=1:step=10:site=allreduce"]),
    # rank 1 dawdles 1 s into step 4 before it dies, so the others have committed step 3 and the
    # recovery is for step 4 (killed as it started step 4, a peer could still be finishing step
    # 3's commit: the round then targets step 3 and the second fault never came)
    (
        "second-fault-during-recovery",
        [
            "slow:rank=1:step=4:seconds=1",
            "kill:rank=1:step=4:site=forward",
            "kill:rank=2:step=4:site=recovery",
        ],
    ),
]


# `make soak` (SOAK_CASES): every case but the second fault during a recovery runs in `make test`
# inside one of the MERGED jobs below, at its rank and site (some at another step), with the same
# per-fault assertions (test_faults_in_one_job_are_each_survived_bitwise); one job per fault here
# pays a launch and a reference comparison per case for the same code paths
SOAK_CASES = {name for name, _ in CASES} - {"second-fault-during-recovery"}

# Several faults in one job, each at its own step: every recovery is told apart by the rank and
# step of the fault it recovered from, and each is asserted as its single-fault case asserts it.
MERGED: list[tuple[str, list[tuple[str, str]]]] = [
    (
        "exceptions-and-deaths",
        [
            ("first-step", "kill:rank=0:step=0"),
            ("raise-backward", "raise:rank=2:step=2:site=backward"),
            ("sigkill", "kill:rank=1:step=4"),
            ("raise-allreduce", "raise:rank=0:step=5:site=allreduce"),
            ("os-exit", "exit:rank=2:step=6"),
            # rank 2 raises at step 7 each time its process runs it (a fault that lives in the
            # process): its in-process retries are used up (its raise at step 2 counts toward the
            # budget too), a fresh process takes rank 2 and trains on (rules/respawn.py)
            ("wedged-process", "wedge:rank=2:step=7"),
            ("raise-mid-optimizer", "raise:rank=1:step=8:site=optimizer"),
            ("final-barrier", "kill:rank=1:step=10:site=allreduce"),
        ],
    ),
    # a spinning rank is found by its missing step progress (--hang-timeout), a stopped one by its
    # process state
    ("hangs", [("busy-loop-hang", "spin:rank=2:step=3"), ("sigstop-hang", "hang:rank=1:step=7")]),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "name,faults",
    [pytest.param(n, f, id=n, marks=[pytest.mark.soak] if n in SOAK_CASES else []) for n, f in CASES],
)
def test_fault_is_survived_bitwise(
    tmp_path: Path, corpus: Path, reference: Any, name: str, faults: list[str]
) -> None:
    ref = reference(3)
    spares = 2 if "second" in name else 1
    res = run_job(tmp_path / "run", corpus, nproc=3, spares=spares, faults=faults)
    check_recovered(res, ref)
    assert len(res.of("fault_injected")) == len(faults)
    if faults[0].startswith(("kill", "exit", "hang", "spin")):
        assert res.of("spare_assigned"), "a dead or hung rank must be replaced by a spare"
        if name == "first-step" and res.startup_faults():
            return  # generation 0 had not formed everywhere yet: start-up replaced the rank
        rec = res.of("recovery")[-1]
        # the spare received the state over the direct stream, and its first batch was timed
        assert rec["transport"] == "stream" and rec["state_bytes"] > 0, rec
        assert 0 <= rec["first_batch_s"] < rec["downtime_s"], rec
        if name != "first-step":  # before the first commit nobody knows the state's size yet
            assert "paged in" in res.output, "the spare should have paged in room for the state"
    if name == "final-barrier":
        # one recovery, one spare: the survivors met the spare in the barrier again (one that
        # ran a step there instead sent a gradient all-reduce into it: gloo aborted the spare)
        assert "EnforceNotMet" not in res.output, res.output[-6000:]
        assert len(res.of("spare_assigned")) == 1 and len(res.of("recovery")) == 1, res.output[-6000:]
    if "optimizer" in name:
        plans = [p for p in res.of("plan") if p["generation"] > 0]
        assert 1 in plans[0]["receivers"], "a rank that faulted mid-update must receive state"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("faults", [pytest.param([f for _, f in cases], id=job) for job, cases in MERGED])
def test_faults_in_one_job_are_each_survived_bitwise(
    tmp_path: Path, corpus: Path, reference: Any, faults: list[str]
) -> None:
    names = {f: n for _, cases in MERGED for n, f in cases}
    ref = reference(3)
    res = run_job(tmp_path / "run", corpus, nproc=3, spares=2, faults=faults, timeout=200)
    check_recovered(res, ref)  # and below: a recovery from each fault (two may share one)
    assert len(res.of("fault_injected")) == len(faults), res.of("fault_injected")
    recs = res.of("recovery")
    for spec in faults:
        name, (rank, step) = names[spec], fault_at(spec)
        assert res.fired(spec), (spec, res.of("fault_injected"))
        if name == "wedged-process":
            check_wedged_process(res, rank, step)
            continue
        rec = res.recovery_from(rank, step)
        absorbed = name == "first-step" and any(
            f["rank"] == rank and f.get("step") == step for f in res.startup_faults()
        )
        assert rec is not None or absorbed, f"{name}: no recovery from it:\n{res.output[-6000:]}"
        if spec.startswith(("kill", "exit", "hang", "spin")):
            spares = [e for e in res.of("spare_assigned") if e["rank"] == rank]
            if rec is not None:
                spares = [e for e in spares if e["generation"] == rec["generation"]]
            assert spares, f"{name}: a dead or hung rank must be replaced by a spare"
            if rec is None:
                continue  # generation 0 had not formed everywhere yet: start-up replaced the rank
            # the spare received the state over the direct stream, and its first batch was timed
            assert rec["transport"] == "stream" and rec["state_bytes"] > 0, (name, rec)
            assert 0 <= rec["first_batch_s"] < rec["downtime_s"], (name, rec)
            if name != "first-step":  # before the first commit nobody knows the state's size yet
                paged = f"[spare {spares[0]['worker']}] paged in"
                assert paged in res.output, f"{name}: the spare should have paged in room for the state"
        if name == "final-barrier":
            # one recovery, one spare: the survivors met the spare in the barrier again (one that
            # ran a step there instead sent a gradient all-reduce into it: gloo aborted the spare)
            assert rec is not None and "EnforceNotMet" not in res.output, res.output[-6000:]
            later = [r for r in recs if r["generation"] >= rec["generation"]]
            spares_after = [e for e in res.of("spare_assigned") if e["generation"] >= rec["generation"]]
            assert len(later) == 1 and len(spares_after) == 1, res.output[-6000:]
        if "optimizer" in name:
            assert rec is not None
            plans = [p for p in res.of("plan") if p["generation"] == rec["generation"]]
            assert plans and rank in plans[0]["receivers"], (
                "a rank that faulted mid-update must receive state"
            )


def check_wedged_process(res: JobResult, rank: int, step: int) -> None:
    """``wedge:rank=R:step=S``: the step raised in the rank's process until its in-process retries
    were used up (a recovery from each try), then once more in a fresh process (a spare given the
    rank), which trained on."""
    [respawn] = res.of("respawn")
    assert (respawn["ranks"], respawn["step"]) == ([rank], step) and respawn["retries"] >= 1, respawn
    tries = [f for f in res.of("fault") if f["rank"] == rank and f.get("step") == step]
    assert len(tries) == respawn["retries"] + 1, tries
    recs = [
        r for r in res.of("recovery") if any(f["rank"] == rank and f.get("step") == step for f in r["faults"])
    ]
    assert recs and len(recs) <= len(tries), recs  # a recovery from each try (some may share one)
    spares = [e for e in res.of("spare_assigned") if e["rank"] == rank]
    assert any(e["generation"] == recs[-1]["generation"] for e in spares), (spares, recs[-1])


@pytest.mark.timeout(240)
def test_two_workers_fail_together_with_two_spares(tmp_path: Path, corpus: Path, reference: Any) -> None:
    ref = reference(4)
    res = run_job(
        tmp_path / "run", corpus, nproc=4, spares=2, faults=["kill:rank=1:step=5", "kill:rank=3:step=5"]
    )
    check_recovered(res, ref)
    assert {e["rank"] for e in res.of("spare_assigned")} == {1, 3}


@pytest.mark.timeout(240)
def test_spare_killed_while_waiting_is_replaced(tmp_path: Path, corpus: Path, reference: Any) -> None:
    """The spare dies before it is needed: the pool refills, and a later fault still recovers."""
    ref = reference(3)
    # the spare (worker id 3) SIGKILLs itself while it waits: --inject aims at ranks, and a spare
    # has none yet, so the test script does it (tests/scripts/spare_suicide.py)
    res = run_job(
        tmp_path / "run",
        corpus,
        nproc=3,
        spares=1,
        faults=["kill:rank=2:step=7"],
        script=SCRIPTS / "spare_suicide.py",
    )
    check_recovered(res, ref)
    assert res.of("spare_lost"), "the launcher must notice the lost spare"


@pytest.mark.timeout(240)
def test_central_store_rendezvous_moves_state_over_gloo(tmp_path: Path, corpus: Path, reference: Any) -> None:
    """Under --rendezvous tcp there is no key server to stream through: the spare receives the
    state over the new generation's gloo group instead, still verified and bitwise."""
    ref = reference(3)
    res = run_job(
        tmp_path / "run",
        corpus,
        nproc=3,
        spares=1,
        faults=["kill:rank=2:step=4"],
        extra=["--rendezvous", "tcp"],
    )
    check_recovered(res, ref)
    rec = res.of("recovery")[-1]
    assert rec["transport"] == "gloo" and rec["state_bytes"] > 0, rec


@pytest.mark.soak  # 45 s; the sharded case (tests/e2e/test_sharded_e2e.py) stays in `make test`
@pytest.mark.timeout(300)
def test_compiled_model_is_recovered_bitwise(tmp_path: Path, corpus: Path) -> None:
    # Every block compiled by inductor, under the data-parallel communicator: the healthy rank
    # aborts out of an all-reduce fed by a compiled backward's gradients and re-runs the step
    # through the same kernels; the killed rank's replacement compiles again (from inductor's
    # cache, kept under the test's folder) on its first step.
    args = [*TINY, "--compile"]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    ref = run_job(tmp_path / "ref", corpus, nproc=2, spares=0, script_args=args, timeout=200, env=env)
    assert ref.rc == 0 and sorted(ref.digests) == [0, 1], ref.output[-4000:]
    assert any((tmp_path / "inductor").rglob("*.py")), "inductor compiled nothing: the blocks ran eagerly"
    faults = ["raise:rank=0:step=3:site=allreduce", "kill:rank=1:step=6"]
    res = run_job(
        tmp_path / "run", corpus, nproc=2, spares=1, faults=faults, script_args=args, timeout=200, env=env
    )
    check_recovered(res, ref, recoveries=2)
    assert len(res.of("fault_injected")) == 2 and res.of("spare_assigned"), res.output[-4000:]
