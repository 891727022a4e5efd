"""Divergence caught, evaluation protected, resume from the script's own checkpoint: real jobs.

tests/scripts/adopt_more.py trains 12 steps on 3 ranks, evaluating after every 5th step. Every
faulted run must end with every rank's weights bitwise equal to the fault-free run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, JobResult, run_job
from tests.helpers.reference import ReferenceRuns

SCRIPT = ROOT / "tests" / "scripts" / "adopt_more.py"
NPROC = 3
BASE = ["--steps", "12", "--eval-every", "5"]
NOWHERE = Path("/nonexistent")


def sections(res: JobResult) -> dict[tuple[int, int], list[list[str]]]:
    """(rank, boundary step) -> the evaluation batches of each completed evaluation there."""
    out: dict[tuple[int, int], list[list[str]]] = {}
    for r in range(NPROC):
        for e in res.events(f"rank-{r}.jsonl"):
            if e["event"] == "section":
                out.setdefault((e["rank"], e["step"]), []).append(e["eval"])
    return out


def check(res: JobResult, ref: JobResult, first: int = 0) -> None:
    assert res.rc == 0, res.output[-6000:]
    res.assert_same_weights(ref, nproc=NPROC)
    want = {k: v for k, v in ref.batches().items() if k[1] >= first}
    assert res.batches() == want, "some rank trained on other samples than the fault-free run"
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.timeout(300)
def test_one_ranks_silent_drift_is_caught_named_and_healed(tmp_path: Path, reference: ReferenceRuns) -> None:
    ref = reference(NPROC, data=NOWHERE, script=SCRIPT, script_args=BASE)
    # rank 1 nudges one weight after its update of step 4; the check after step 4 (5 commits) runs
    args = [*BASE, "--perturb-step", "4"]
    res = run_job(
        tmp_path / "run",
        NOWHERE,
        NPROC,
        1,
        extra=["--divergence-check", "5"],
        script=SCRIPT,
        script_args=args,
    )
    check(res, ref)  # healed before it fed any gradient: the fault-free run's weights exactly
    seen = [e for r in range(NPROC) for e in res.events(f"rank-{r}.jsonl") if e["event"] == "divergence"]
    assert seen and all(e["ranks"] == [1] and e["step"] == 4 for e in seen), seen
    faults = res.of("fault")
    assert any(f.get("rank") == 1 and "divergence" in str(f) for f in faults), faults
    plans = [p for p in res.of("plan") if p["generation"] > 0]
    assert plans and plans[0]["receivers"] == [1] and plans[0]["target_step"] == 5, plans
    assert not res.of("spare_assigned"), "a divergent rank is healed in place, not replaced"


@pytest.mark.timeout(300)
def test_without_the_check_the_drift_goes_unnoticed(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    args = [*BASE, "--perturb-step", "4"]
    res = run_job(
        tmp_path / "run",
        NOWHERE,
        NPROC,
        0,
        extra=["--divergence-check", "0"],
        script=SCRIPT,
        script_args=args,
    )
    assert res.rc == 0, res.output[-4000:]
    assert res.digest is None, "the replicas should disagree: the test's perturbation did nothing"


@pytest.mark.timeout(300)
# raise under `make soak`: the kill's evaluation is redone on every rank through the same round,
# with a replacement joining mid-evaluation on top
@pytest.mark.parametrize(
    "fault",
    [["--kill-in-eval", "10"], pytest.param(["--raise-in-eval", "5"], marks=pytest.mark.soak)],
    ids=["kill", "raise"],
)
def test_a_fault_during_evaluation_redoes_it_on_every_rank(
    tmp_path: Path, reference: ReferenceRuns, fault: list[str]
) -> None:
    ref = reference(NPROC, data=NOWHERE, script=SCRIPT, script_args=BASE)
    res = run_job(tmp_path / "run", NOWHERE, NPROC, 1, script=SCRIPT, script_args=[*BASE, *fault])
    check(res, ref)
    assert res.of("recovery"), res.output[-4000:]
    got, want = sections(res), sections(ref)
    assert sorted(want) == [(r, s) for r in range(NPROC) for s in (5, 10)], want
    # every evaluation completed once per rank and boundary, on exactly the fault-free batches
    assert got == want, (got, want)
    if fault[0] == "--kill-in-eval":
        assert [e["rank"] for e in res.of("spare_assigned")] == [1]


@pytest.mark.timeout(300)
def test_resume_from_the_scripts_own_checkpoint_and_a_replacement_does_not_load_it(
    tmp_path: Path, reference: ReferenceRuns
) -> None:
    ref = reference(NPROC, data=NOWHERE, script=SCRIPT, script_args=BASE)
    ckpt = tmp_path / "ckpt.pt"
    first = run_job(
        tmp_path / "first",
        NOWHERE,
        NPROC,
        0,
        script=SCRIPT,
        script_args=[*BASE, "--steps", "7", "--save", str(ckpt)],
    )
    assert first.rc == 0 and ckpt.exists(), first.output[-4000:]
    log = tmp_path / "loads"
    args = [*BASE, "--resume", str(ckpt), "--load-log", str(log)]
    res = run_job(
        tmp_path / "run", NOWHERE, NPROC, 1, ["kill:rank=2:step=9"], script=SCRIPT, script_args=args
    )
    check(res, ref, first=7)
    assert [e["rank"] for e in res.of("spare_assigned")] == [2]
    loads = log.read_text().split()
    assert sorted(loads[0::2]) == ["0", "1", "2"], f"only the original ranks load the checkpoint: {loads}"
    steps = sorted({s for (_, s) in res.batches()})
    assert steps == list(range(7, 12)), f"the resumed job ran steps {steps}, not 7..11"
    epochs = {
        s: e["epoch"]
        for r in range(NPROC)
        for e in res.events(f"rank-{r}.jsonl")
        if e["event"] == "commit" and (s := e["step"]) is not None
    }
    # 64 samples over 3 ranks in batches of 4: 5 steps per epoch
    assert epochs[7] == 1 and epochs[10] == 2, epochs
