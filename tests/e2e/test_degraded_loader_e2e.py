"""Degraded mode with a script written the normal way (issue 39): ``job.loader(DataLoader(...,
sampler=DistributedSampler(rank=job.rank)))``, ``step.batch``, a ``job.generator`` dropout
stream and dropout from torch's global generator seeded per rank, nothing about slots. A job of
4 ranks with no spares loses rank 2 (SIGKILL); its spare takes a while to start, so the job runs
degraded for several steps, across divergence checks (``--divergence-check 3``): rank 0 trains
slot 2's batch, read by the job's loader from slot 2's share, with rank 2's dropout stream and
rank 2's global generators (taken over from its record, recovery/slot_rng.py), and gives its
digest for slot 2 in the check; the spare that takes slot 2 back resumes the generators rank 0
kept for it. Every rank ends with bitwise the fault-free run's weights, and every (slot, step)
trained the fault-free run's batch and mask. Then: a BatchLoader script, a script's own
collective (refused with the reason), a holder that must receive state."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.helpers.jobs import SCRIPTS, JobResult, assert_batches_but_cut, run_job
from tests.helpers.reference import ReferenceRuns

pytestmark = pytest.mark.timeout(150)

SCRIPT = SCRIPTS / "degraded_loader.py"
STEPS = 60
ARGS = ["--steps", str(STEPS), "--sleep", "0.03", "--spare-delay", "1.5", "--global-dropout"]
CHECK = ["--divergence-check", "3"]
SHRINK = ["--when-no-spare", "shrink"]


NOWHERE = Path("/nonexistent")  # the script makes its data in memory


def _clean(reference: ReferenceRuns) -> JobResult:
    """The fault-free run the tests of this file share (the session's reference runs)."""
    return reference(4, data=NOWHERE, script=SCRIPT, script_args=ARGS, extra=CHECK, timeout=120)


def _run(
    tmp_path: Path,
    name: str,
    extra: list[str],
    faults: list[str],
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> JobResult:
    return run_job(
        tmp_path / name,
        NOWHERE,
        nproc=4,
        spares=0,
        faults=faults,
        extra=[*CHECK, *extra],
        script=SCRIPT,
        script_args=ARGS if args is None else args,
        timeout=120,
        env=env,
    )


def _trained_as_without_the_fault(res: JobResult, ref: JobResult, also_cut: Iterable[int] = ()) -> None:
    """Every (slot, step) line the run printed is the fault-free run's batch, and a line is
    missing only at a step a round cut off (``assert_batches_but_cut``; seen under the suite's
    load: the step the grow-back round cut in on)."""
    assert_batches_but_cut(
        res.trained_batches(), ref.trained_batches(), res.cut_steps() | set(also_cut), "trained"
    )


def test_a_job_loader_script_trains_the_held_slot_s_batches_bitwise(
    tmp_path: Path, reference: ReferenceRuns
) -> None:
    ref = _clean(reference)
    # and rank 0 raises as slot 2's pass all-reduces at step 12: the step is replayed, slot 2's
    # pass from slot 2's generators as the step began
    res = _run(tmp_path, "degraded", SHRINK, ["kill:rank=2:step=6", "raise:rank=0:step=12:site=allreduce"])
    assert res.rc == 0, res.output[-4000:]
    widths = [e["width"] for e in res.events() if e["event"] == "width"]
    assert widths == [3, 4], f"expected to shrink to 3 and grow back to 4: {widths}"
    # slot 2's passes run by its holder, rank 0, over several steps and divergence checks
    held = sorted({int(s) for s in re.findall(r"batch rank=2 step=(\d+) [0-9a-f]{16} by=0", res.output)})
    assert len(held) >= 4, f"slot 2 was held for too few steps to test anything: {held}"
    assert any((s + 1) % 3 == 0 for s in held), f"no divergence check while degraded: {held}"
    assert 12 in held and res.recovery_from(0, 12) is not None, "the raise did not hit a held step"
    assert not res.of("divergence"), res.of("divergence")
    assert not res.of("inexact"), "a slot resumed without its own generators"
    res.assert_same_weights(ref, 4)
    want = ref.trained_batches()
    assert sorted(want) == [(slot, step) for slot in range(4) for step in range(STEPS)]
    _trained_as_without_the_fault(res, ref)


def test_a_batch_picked_from_job_rank_in_the_loop_is_the_held_slot_s_and_one_from_a_rank_read_before_is_reported(
    tmp_path: Path, reference: ReferenceRuns
) -> None:
    """A script that picks its batches by hand from a rank, exactly the DistributedSampler's
    (``--rank-batches``), and no job loader. Reading ``job.rank`` inside the loop, the held
    pass gets slot 2 (recovery/held_pass.py): every (slot, step) and every rank's weights are
    the fault-free run's. Reading ``dist.get_rank()`` once before the loop, the held pass trains
    rank 0's batch again: that cannot be made exact, so it is reported (an ``inexact`` event and
    job_end's account, once), not silent."""
    ref = _clean(reference)
    inside = _run(tmp_path, "inside", SHRINK, ["kill:rank=2:step=6"], [*ARGS, "--rank-batches", "inside"])
    assert inside.rc == 0, inside.output[-4000:]
    assert [e["width"] for e in inside.of("width")] == [3, 4], inside.of("width")
    held = re.findall(r"batch rank=2 step=(\d+) [0-9a-f]{16} by=0", inside.output)
    assert len(held) >= 4, f"slot 2 was held for too few steps to test anything: {held}"
    assert not inside.of("inexact"), inside.of("inexact")
    inside.assert_same_weights(ref, 4)
    _trained_as_without_the_fault(inside, ref)

    short = ["--steps", "16", "--sleep", "0.03", "--spare-delay", "30", "--global-dropout"]
    before = _run(tmp_path, "before", SHRINK, ["kill:rank=2:step=6"], [*short, "--rank-batches", "before"])
    assert before.rc == 0, before.output[-4000:]
    assert [e["width"] for e in before.of("width")] == [3], before.of("width")
    (inexact,) = before.of("inexact")  # once for the slot, not at every held step
    assert (inexact["rank"], inexact["step"], inexact["what"]) == (0, 6, "batch"), inexact
    assert "held slot 2" in inexact["detail"] and "job.rank" in inexact["detail"], inexact
    (end,) = before.of("job_end")
    assert [(e["rank"], e["what"]) for e in end["inexact"]] == [(0, "batch")], end


def test_a_batch_loader_of_the_job_s_share_serves_the_held_slot_s_share_bitwise(
    tmp_path: Path, corpus: Path
) -> None:
    """The examples/train_gpt.py way: a BatchLoader built for ``dp_rank=job.rank`` with a
    shared-memory cache, ``loader.batch(step.index)``. Its held slot's passes read slot 2's
    share (from slot 2's cache directory), not rank 0's a second time."""
    runs = {}
    for name, extra, faults in (("clean", [], []), ("degraded", SHRINK, ["kill:rank=2:step=6"])):
        runs[name] = run_job(
            tmp_path / name,
            corpus,
            nproc=4,
            spares=0,
            faults=faults,
            extra=extra,
            script=SCRIPT,
            script_args=[*ARGS, "--tokens"],
            timeout=120,
        )
        assert runs[name].rc == 0, runs[name].output[-4000:]
    ref, res = runs["clean"], runs["degraded"]
    assert [e["width"] for e in res.of("width")] == [3, 4], res.of("width")
    held = re.findall(r"batch rank=2 step=(\d+) [0-9a-f]{16} by=0", res.output)
    assert len(held) >= 4, f"slot 2 was held for too few steps to test anything: {held}"
    assert not res.of("inexact"), "the loader's held reads count as the slot's batch"
    res.assert_same_weights(ref, 4)
    _trained_as_without_the_fault(res, ref)


@pytest.mark.parametrize("metric", ["job", "dist"])
def test_a_collective_of_the_script_s_own_ends_a_degraded_job_with_the_reason(
    tmp_path: Path, metric: str
) -> None:
    """A step that all-reduces a metric (``job.all_reduce``, or ``dist.all_reduce`` on torch's
    default group) cannot run degraded: the held slot's part would come from a pass still to
    run. The holder's collective raises a ConfigError that names why, and the job ends with it
    at once instead of every rank waiting in the collective."""
    res = run_job(
        tmp_path / metric,
        tmp_path / "unused-data",
        nproc=3,
        spares=0,
        faults=["kill:rank=2:step=3"],
        extra=SHRINK,
        script=SCRIPT,
        script_args=["--steps", "20", "--sleep", "0.01", "--spare-delay", "30", "--metric", metric],
        timeout=60,
    )
    assert res.rc == 1, res.output[-3000:]
    assert [e["width"] for e in res.of("width")] == [2], res.of("width")
    (end,) = res.of("job_end")
    assert "holds the lost slots [2] (degraded mode)" in end["error"], end


def test_a_holder_that_must_receive_state_receives_it_once_and_the_job_goes_on_bitwise(
    tmp_path: Path, reference: ReferenceRuns
) -> None:
    """Rank 0 raises half-way through step 3's update, and rank 2 dies as it joins the recovery
    from that: rank 0 must receive its peers' state, and it also holds slot 2. The slot reports
    its holder's state; were it a second receiver, the sender would wait on it for good (seen:
    every member stuck in the state transfer). One receipt, then the job trains on, bitwise.

    Rank 2 dies in the recovery, not in step 3's update beside rank 0: there, rank 0's abort
    could reach it before its update (under CI's load it did), so step 3 was never re-run and
    the kill never fired."""
    faults = ["raise:rank=0:step=3:site=optimizer", "kill:rank=2:site=recovery"]
    ref = _clean(reference)
    # gloo's full mesh: each generation's groups connect every pair as they form, so rank 2's
    # death fails generation 1 before rank 0's state arrives, and the degraded generation must
    # give it. Under lazy connection (the default) generation 1 forms without rank 2, rank 0
    # receives there, and the degraded round has nobody to send to: the path under test is
    # then only reached by chance
    res = _run(tmp_path, "degraded", SHRINK, faults, env={"CHECKPOINTLESS_GLOO_CONNECT": "full"})
    assert res.rc == 0, res.output[-4000:]
    plan = next(e for e in res.of("plan") if e.get("holders"))
    assert plan["holders"] == [[2, 0]] and 0 in plan["receivers"] and 2 not in plan["receivers"], plan
    res.assert_same_weights(ref, 4)
    _trained_as_without_the_fault(res, ref, also_cut=[3])  # step 3's update was cut by the faults


def test_a_group_the_script_made_ends_a_degraded_job_with_the_reason(tmp_path: Path) -> None:
    """A script that made a group of every rank with ``dist.new_group`` (as Lightning does for
    its prepare_data), never used in a step: the degraded generation cannot form it (the held
    slot has no process to join it), and every rank waited out the formation's deadline in
    every round. The job now ends at once with the reason."""
    res = run_job(
        tmp_path / "group",
        tmp_path / "unused-data",
        nproc=3,
        spares=0,
        faults=["kill:rank=2:step=3"],
        extra=SHRINK,
        script=SCRIPT,
        script_args=["--steps", "20", "--sleep", "0.01", "--spare-delay", "5", "--make-group"],
        timeout=60,
    )
    assert res.rc == 1, res.output[-3000:]
    (end,) = res.of("job_end")
    assert (
        "degraded mode cannot go on: dist.new_group #1 over ranks [0, 1, 2] includes the lost slot(s) [2]"
        in (end["error"])
    ), end
