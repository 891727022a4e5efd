"""A sharded job that resumes from its own checkpoint, with a rank lost during start-up.

The script (tests/scripts/fsdp_resume.py) restores one file per rank and passes the saved step
to ``job.steps(start=)``. The job must start at that step (not at 0), and a spare that takes a
rank lost before the job's first state sync must restore that rank's shard itself: with R = 1
nobody else holds it. Compared with an uninterrupted run of all the steps, bitwise on every rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import JobResult, run_job
from tests.helpers.paths import SCRIPTS

SCRIPT = SCRIPTS / "fsdp_resume.py"


def _run(run_dir: Path, corpus: Path, mesh: str, args: list[str], spares: int = 0) -> JobResult:
    r, s = (int(n) for n in mesh.split(","))
    nproc = r * s
    res = run_job(
        run_dir, corpus, nproc=nproc, spares=spares, script=SCRIPT, script_args=["--mesh", mesh, *args]
    )
    assert res.rc == 0, res.output[-6000:]
    assert sorted(res.digests) == list(range(nproc)), res.digests
    assert not res.left_behind(), "processes of the job were left behind"
    return res


@pytest.mark.timeout(300)
# the HSDP 2x2 mesh under `make soak`: the same resume and start-up loss, where a replica peer
# could serve the lost shard; on 1x2 (kept) nobody else holds it, so the spare must restore it
@pytest.mark.parametrize("mesh,lost", [pytest.param("2,2", 0, marks=pytest.mark.soak), ("1,2", 1)])
def test_resumed_sharded_job_starts_at_its_step_through_a_rank_lost_at_start_up(
    tmp_path: Path, corpus: Path, mesh: str, lost: int
) -> None:
    ref = _run(tmp_path / "ref", corpus, mesh, ["--steps", "12"])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _run(tmp_path / "first", corpus, mesh, ["--steps", "7", "--save", str(ckpt)])
    log, marker = tmp_path / "loads", tmp_path / "died"
    args = ["--steps", "12", "--resume", str(ckpt), "--load-log", str(log)]
    res = _run(
        tmp_path / "run", corpus, mesh, [*args, "--die-at-start", str(lost), "--marker", str(marker)], 1
    )
    assert marker.exists(), "the rank meant to die at start-up never did"
    assert res.startup_faults(), res.output[-4000:]
    assert [e["rank"] for e in res.of("spare_assigned")] == [lost]
    # the lost rank's spare restored the checkpoint as its original had: no peer held it first
    loads = sorted(int(x) for x in log.read_text().split())
    assert loads == sorted([*range(len(ref.digests)), lost]), loads
    steps = {(c["rank"], c["step"]) for c in res.commits()}
    want = {(r, s) for r in ref.digests for s in range(7, 12)}
    assert steps == want, f"the resumed job ran {sorted(steps)}, not steps 7..11 on every rank"
    wrong = {r: (res.digests[r][:12], d[:12]) for r, d in ref.digests.items() if res.digests[r] != d}
    assert not wrong, f"final shards differ from the uninterrupted 12-step run's on ranks {wrong}"
