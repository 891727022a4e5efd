"""Degraded mode with a script written the normal way (issue 39): ``job.loader(DataLoader(...,
sampler=DistributedSampler(rank=job.rank)))``, ``step.batch`` and a ``job.generator`` dropout
stream, nothing about slots. A job of 4 ranks with no spares loses rank 2 (SIGKILL); its spare
takes a while to start, so the job runs degraded for several steps, across divergence checks
(``--divergence-check 3``): rank 0 trains slot 2's batch, read by the job's loader from slot 2's
share, with rank 2's dropout stream, and gives its digest for slot 2 in the check. Every rank
ends with bitwise the fault-free run's weights, and every (slot, step) trained the fault-free
run's batch and mask."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.jobs import SCRIPTS, JobResult, run_job

pytestmark = pytest.mark.timeout(150)

SCRIPT = SCRIPTS / "degraded_loader.py"
STEPS = 60
ARGS = ["--steps", str(STEPS), "--sleep", "0.03", "--spare-delay", "1.5"]
CHECK = ["--divergence-check", "3"]
SHRINK = ["--when-no-spare", "shrink"]


def _run(tmp_path: Path, name: str, extra: list[str], faults: list[str]) -> JobResult:
    return run_job(
        tmp_path / name,
        tmp_path / "unused-data",
        nproc=4,
        spares=0,
        faults=faults,
        extra=[*CHECK, *extra],
        script=SCRIPT,
        script_args=ARGS,
        timeout=120,
    )


def test_a_job_loader_script_trains_the_held_slot_s_batches_bitwise(tmp_path: Path) -> None:
    ref = _run(tmp_path, "clean", [], [])
    assert ref.rc == 0, ref.output[-3000:]
    res = _run(tmp_path, "degraded", SHRINK, ["kill:rank=2:step=6"])
    assert res.rc == 0, res.output[-4000:]
    widths = [e["width"] for e in res.events() if e["event"] == "width"]
    assert widths == [3, 4], f"expected to shrink to 3 and grow back to 4: {widths}"
    # slot 2's passes run by its holder, rank 0, over several steps and divergence checks
    held = sorted({int(s) for s in re.findall(r"batch rank=2 step=(\d+) [0-9a-f]{16} by=0", res.output)})
    assert len(held) >= 4, f"slot 2 was held for too few steps to test anything: {held}"
    assert any((s + 1) % 3 == 0 for s in held), f"no divergence check while degraded: {held}"
    assert not res.of("divergence"), res.of("divergence")
    res.assert_same_weights(ref, 4)
    want = ref.trained_batches()
    assert sorted(want) == [(slot, step) for slot in range(4) for step in range(STEPS)]
    assert res.trained_batches() == want, (
        "a (slot, step) trained another batch or mask than without the fault"
    )


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
    res.assert_same_weights(ref, 4)
    assert res.trained_batches() == ref.trained_batches()
