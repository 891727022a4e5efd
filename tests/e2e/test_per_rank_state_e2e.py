"""Every rank's own generators outlive its process (issue 38): a nanoGPT-style script whose
randomness is all per rank and all global (batches from ``torch.randint`` seeded ``1337 + rank``,
rank-0-only evaluation batches drawn from the same generator in a section, ``nn.Dropout``,
Python's and NumPy's generators), with no ``job.generator``, ends bitwise equal to the fault-free
run on every rank through a kill (a spare takes the rank) and through exceptions (in-process
recovery, one rank receiving its replica's state).

Before the generators were kept per rank, both faulted runs ended with rc 0 and with weights that
agreed between the ranks but differed from the fault-free run's: a rank that received its state
took the sender's generators."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import SCRIPTS, JobResult, run_job
from tests.helpers.reference import ReferenceRuns

NOWHERE = Path("/nonexistent")
SCRIPT = SCRIPTS / "nanogpt_global_rng.py"
ARGS = ["--steps", "24", "--eval-every", "4"]


def _run(tmp_path: Path, reference: ReferenceRuns, faults: list[str]) -> tuple[JobResult, JobResult]:
    ref = reference(2, data=NOWHERE, script=SCRIPT, script_args=ARGS)
    res = run_job(tmp_path / "run", NOWHERE, 2, 1, faults, script=SCRIPT, script_args=ARGS, timeout=120)
    assert res.rc == 0, res.output[-6000:]
    assert len(res.of("recovery")) >= len(faults), res.output[-4000:]
    assert "no record of rank" not in res.output, res.output[-4000:]
    return ref, res


def _per_rank_batches(ref: JobResult) -> None:
    """The test means something only if the ranks' streams differ (per-rank seeds, no copy)."""
    batches = ref.batches()
    assert batches and all(batches[(0, s)] != batches[(1, s)] for s in range(24)), batches


@pytest.mark.timeout(300)
def test_kills_resume_the_killed_ranks_own_generators(tmp_path: Path, reference: ReferenceRuns) -> None:
    """Rank 1 killed half-way through its update of step 9 (rank 0 has updated: the step rolls
    forward, and rank 1's replacement resumes the streams as they stood at the update), then
    rank 0 as step 16 begins, just after its evaluation drew from its generator (the section
    at step 16's boundary): each replacement resumes the killed rank's own streams."""
    ref, res = _run(tmp_path, reference, ["kill:rank=1:step=9:site=optimizer", "kill:rank=0:step=16"])
    _per_rank_batches(ref)
    receivers = [p for e in res.of("recovery") for p in [e.get("transfer_parts") or {}] if p.get("role")]
    assert {p["rank"] for p in receivers if p["role"] == "receiver"} == {0, 1}, receivers
    res.assert_same_weights(ref, nproc=2)
    # every rank's every committed batch, replays included (rank 1's step 9 has no commit
    # event: it was lost inside the update, and the step was rolled forward)
    got, want = res.batches(), ref.batches()
    assert {k: want[k] for k in got} == got and set(want) - set(got) <= {(1, 9)}


@pytest.mark.timeout(300)
def test_exceptions_restore_each_ranks_own_generators(tmp_path: Path, reference: ReferenceRuns) -> None:
    """An exception half-way through rank 1's update (it receives its replica's state from rank 0
    and must keep its own generators) and one in rank 0's step (both replay it from their own)."""
    ref, res = _run(tmp_path, reference, ["raise:rank=1:step=9:site=optimizer", "raise:rank=0:step=17"])
    parts = [e.get("transfer_parts") or {} for e in res.of("recovery")]
    assert any(p.get("rank") == 1 and p.get("role") == "receiver" for p in parts), parts
    res.assert_same_weights(ref, nproc=2)
    assert res.batches() == ref.batches()
