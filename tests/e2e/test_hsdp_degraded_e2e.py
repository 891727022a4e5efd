"""Degraded mode on an HSDP mesh, end to end (issue 39): an FSDP2 job on a 2x2 (replicate, shard)
mesh of 4 ranks with no spare ready loses rank 2. Its whole replica group leaves (rank 3 is
stopped); ranks 0 and 1 each train the lost group's micro-batch of their shard coordinate as a
second pass of every step, the replicate all-reduce finished locally (comm/folded.py); once two
spares are ready the group comes back whole, each spare taking its shard from the rank of the same
coordinate. Every rank's final shards, and every (slot, step)'s batch, equal the fault-free run's.

The same on a 3-D mesh the script made itself with ``init_device_mesh`` (dp 2 x FSDP 2 x TP 2,
8 ranks, tests/scripts/tp_mlp.py --hsdp 2): the lost rank's replica group of 4 leaves, each
survivor holds the slot of its own (shard, tp) coordinate, its script-made dp group is folded on
it and the lost group's own tp and shard groups are not formed (comm/group_catalog.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import SCRIPTS, assert_batches_but_cut, run_job
from tests.helpers.reference import ReferenceRuns

pytestmark = pytest.mark.timeout(150)

SCRIPT = SCRIPTS / "hsdp_degraded.py"
STEPS = 30
# the spares the shrink starts are ready ~1.5 s later: about 10 degraded steps of >= 2 x 50 ms
ARGS = ["--steps", str(STEPS), "--sleep", "0.05", "--spare-delay", "1.5"]
NOWHERE = Path("/nonexistent")  # the script makes its data in memory


def test_a_lost_rank_takes_its_replica_group_out_and_the_group_grows_back_bitwise(
    tmp_path: Path, reference: ReferenceRuns
) -> None:
    ref = reference(4, data=NOWHERE, script=SCRIPT, script_args=ARGS, replicated=False, timeout=120)
    # replicas of a shard agree and the two shards differ: these really are shards
    assert ref.digests[0] == ref.digests[2] != ref.digests[1] == ref.digests[3], ref.digests
    res = run_job(
        tmp_path / "run",
        NOWHERE,
        nproc=4,
        spares=0,
        faults=["kill:rank=2:step=4"],
        extra=["--when-no-spare", "shrink"],
        script=SCRIPT,
        script_args=ARGS,
        timeout=120,
    )
    assert res.rc == 0, res.output[-6000:]
    widths = [e["width"] for e in res.of("width")]
    assert widths == [2, 4], f"expected to shrink to one replica group and grow back: {widths}"
    plans = [e for e in res.of("plan") if e.get("holders")]
    assert plans and plans[0]["holders"] == [[2, 0], [3, 1]], plans
    assert sorted(e["rank"] for e in res.of("grow")) == [2, 3]
    # the spares took their shards from the ranks of the same coordinate (a holder whose update
    # the grow round cut off may receive too)
    grown = [e for e in res.of("plan") if not e.get("holders") and e["generation"] > plans[0]["generation"]]
    assert grown and {2: 0, 3: 1}.items() <= dict(map(tuple, grown[0]["sources"])).items(), grown
    held = {(e["slot"], e["step"]) for e in res.commits() if e["event"] == "slot_commit"}
    assert len(held) >= 2 * 3, f"too few degraded steps to check anything: {sorted(held)}"
    wrong = {
        r: (res.digests.get(r, "none")[:12], d[:12])
        for r, d in ref.digests.items()
        if res.digests.get(r) != d
    }
    assert not wrong, f"final shards differ from the fault-free run's on ranks {wrong}"
    want = ref.trained_batches()
    assert sorted(want) == [(slot, step) for slot in range(4) for step in range(STEPS)]
    # a pass cut off by a round (the fault's step; the step the shrink or the grow round cut in
    # on, where an update may already have been applied and is then rolled forward) may lack its
    # line and its commit; the weights above say those updates are the fault-free run's
    cut = res.cut_steps() | {4}
    assert_batches_but_cut(res.trained_batches(), want, cut, "trained")
    assert_batches_but_cut(res.batches(), ref.batches(), cut)
    assert not res.left_behind(), "processes of the job were left behind"


TP_SCRIPT = SCRIPTS / "tp_mlp.py"
# dp 2 x shard 2 x tp 2: rank r is (r // 4, r // 2 % 2, r % 2); the spares the shrink starts are
# ready 2 s later, so the job runs degraded for several steps before it grows back. Each step lasts
# at least 0.2 s: with 20 steps left after the fault, the job outlasts the spares' delay (the full
# suite once saw every degraded step done within 2.3 s, and no growth to test)
TP_STEPS = 24
TP_ARGS = ["--steps", str(TP_STEPS), "--hsdp", "2", "--spare-delay", "2", "--step-sleep", "0.2"]


@pytest.mark.timeout(240)
def test_a_3d_mesh_the_script_made_loses_a_replica_group_and_grows_it_back_bitwise(
    tmp_path: Path, corpus: Path, reference: ReferenceRuns
) -> None:
    ref = reference(8, script=TP_SCRIPT, script_args=TP_ARGS, replicated=False, timeout=200)
    d = ref.digests
    assert sorted(d) == list(range(8)) and all(d[r] == d[r + 4] for r in range(4)), d
    res = run_job(
        tmp_path / "run",
        corpus,
        nproc=8,
        spares=0,
        faults=["kill:rank=5:step=4"],
        extra=["--when-no-spare", "shrink"],
        script=TP_SCRIPT,
        script_args=TP_ARGS,
        timeout=200,
    )
    assert res.rc == 0, res.output[-6000:]
    widths = [e["width"] for e in res.of("width")]
    assert widths == [4, 8], f"expected to shrink to one replica group and grow back: {widths}"
    plans = [e for e in res.of("plan") if e.get("holders")]
    # each lost (shard, tp) state is held by the survivor of the same coordinates
    assert plans and plans[0]["holders"] == [[4, 0], [5, 1], [6, 2], [7, 3]], plans
    assert sorted(e["rank"] for e in res.of("grow")) == [4, 5, 6, 7]
    grown = [e for e in res.of("plan") if not e.get("holders") and e["generation"] > plans[0]["generation"]]
    assert grown and {4: 0, 5: 1, 6: 2, 7: 3}.items() <= dict(map(tuple, grown[0]["sources"])).items(), grown
    held = {(e["slot"], e["step"]) for e in res.commits() if e["event"] == "slot_commit"}
    assert len(held) >= 4 * 3, f"too few degraded steps to check anything: {sorted(held)}"
    wrong = {r: (res.digests.get(r, "none")[:12], v[:12]) for r, v in d.items() if res.digests.get(r) != v}
    assert not wrong, f"final shards differ from the fault-free run's on ranks {wrong}"
    want = ref.batches()
    assert sorted(want) == [(slot, step) for slot in range(8) for step in range(TP_STEPS)]
    assert_batches_but_cut(res.batches(), want, res.cut_steps() | {4})
    assert not res.left_behind(), "processes of the job were left behind"
