"""Recovery decisions are pure functions: situations in, actions out."""

from __future__ import annotations

import pytest

from checkpointless.coordinator.rules.decisions import (
    MemberReport,
    SpareAction,
    plan_recovery,
    spare_policy,
)
from checkpointless.coordinator.rules.hangs import WorkerHealth, find_hung
from checkpointless.errors import NotRecoverableError

pytestmark = pytest.mark.timeout(10)


def test_replay_when_nobody_applied_the_update() -> None:
    plan = plan_recovery([MemberReport(0, 7, True), MemberReport(1, -1, False), MemberReport(2, 7, True)])
    assert (plan.target_step, plan.source, plan.receivers) == (7, 0, (1,))


def test_roll_forward_when_some_rank_finished_its_update() -> None:
    # rank 2 applied step 7's update before the fault surfaced: nobody may undo it
    plan = plan_recovery([MemberReport(0, 7, True), MemberReport(1, 7, True), MemberReport(2, 8, True)])
    assert (plan.target_step, plan.source, plan.receivers) == (8, 2, (0, 1))


def test_rank_that_faulted_mid_update_receives() -> None:
    plan = plan_recovery([MemberReport(0, 4, True), MemberReport(1, 4, False), MemberReport(2, 4, True)])
    assert plan.receivers == (1,) and plan.source == 0


def test_initial_generation_syncs_from_rank_zero() -> None:
    plan = plan_recovery([MemberReport(r, 0, True) for r in range(4)], initial=True)
    assert (plan.source, plan.receivers) == (0, (1, 2, 3))


def test_no_valid_replica_is_a_clear_error() -> None:
    with pytest.raises(NotRecoverableError, match="no rank holds a valid replica"):
        plan_recovery([MemberReport(0, 3, False), MemberReport(1, -1, False)])


def test_members_must_be_contiguous_ranks() -> None:
    with pytest.raises(NotRecoverableError):
        plan_recovery([MemberReport(0, 1, True), MemberReport(2, 1, True)])


def test_silent_process_is_the_culprit() -> None:
    ws = [WorkerHealth(0, 100.0, 100.0, True), WorkerHealth(1, 80.0, 80.0, False)]
    culprits, why = find_hung(ws, now=100.5, hang_timeout=10)
    assert culprits == [1] and "heartbeat" in why


def test_busy_rank_outside_collective_is_the_culprit_not_the_waiters() -> None:
    ws = [
        WorkerHealth(0, 100.0, 85.0, True),
        WorkerHealth(1, 100.0, 85.0, False),
        WorkerHealth(2, 100.0, 85.0, True),
    ]
    assert find_hung(ws, now=100.0, hang_timeout=10)[0] == [1]


def test_everyone_waiting_means_no_culprit() -> None:
    ws = [WorkerHealth(r, 100.0, 50.0, True) for r in range(3)]
    culprits, why = find_hung(ws, now=100.0, hang_timeout=10)
    assert culprits == [] and "waiting" in why


def test_healthy_job_has_no_culprit() -> None:
    ws = [WorkerHealth(r, 100.0, 99.0, False) for r in range(3)]
    assert find_hung(ws, now=100.0, hang_timeout=10) == ([], "")


def test_spare_policy() -> None:
    assert spare_policy(ready=2, starting=0, needed=2, waited=0, wait_limit=60).action == SpareAction.ASSIGN
    d = spare_policy(ready=0, starting=0, needed=1, waited=0, wait_limit=60)
    assert d.action == SpareAction.WAIT and d.spawn == 1
    d = spare_policy(ready=1, starting=1, needed=3, waited=5, wait_limit=60)
    assert d.action == SpareAction.WAIT and d.spawn == 1
    d = spare_policy(ready=0, starting=1, needed=1, waited=61, wait_limit=60)
    assert d.action == SpareAction.FAIL and "--spares" in d.reason and "--spare-wait" in d.reason


def test_progress_limit_scales_separately_from_heartbeat_silence() -> None:
    # steps take long here: 30 s without progress is fine when the limit is 40 s ...
    ws = [WorkerHealth(0, 100.0, 70.0, False), WorkerHealth(1, 100.0, 70.0, True)]
    assert find_hung(ws, now=100.0, hang_timeout=10, progress_limit=40) == ([], "")
    # ... but a silent process is still caught by the heartbeat limit
    ws = [WorkerHealth(0, 85.0, 85.0, False), WorkerHealth(1, 100.0, 99.0, True)]
    assert find_hung(ws, now=100.0, hang_timeout=10, progress_limit=40)[0] == [0]


def test_no_stall_while_a_rank_is_going_quiet() -> None:
    # rank 1 was stopped 1.5 s ago: not silent long enough to be named, but a stall must not be
    # declared for the others, who are only waiting for it
    ws = [WorkerHealth(0, 100.0, 80.0, True), WorkerHealth(1, 97.5, 80.0, True)]
    assert find_hung(ws, now=100.0, hang_timeout=10) == ([], "")


def test_bucket_plan_is_reverse_ordered_capped_and_small_first() -> None:
    from checkpointless.comm.data_parallel import plan_buckets

    mb = 1 << 20
    sizes = [4 * mb, 1 * mb, 1 * mb, 30 * mb, 2 * mb]
    assert plan_buckets(sizes, cap_bytes=25 * mb, first_cap_bytes=1 * mb) == [[4], [3], [2, 1, 0]]
    assert plan_buckets(sizes, cap_bytes=25 * mb) == [[4], [3], [2, 1, 0]]
    assert plan_buckets([mb] * 4, cap_bytes=2 * mb, first_cap_bytes=1 * mb) == [[3], [2, 1], [0]]


def test_no_stall_while_one_rank_still_progressed_recently() -> None:
    # ranks 0 and 1 wait in the all-reduce; rank 2 entered the step a moment later and is busy:
    # it is not yet past the limit, so nobody must be declared stalled before it is named
    ws = [
        WorkerHealth(0, 100.0, 89.0, True),
        WorkerHealth(1, 100.0, 89.0, True),
        WorkerHealth(2, 100.0, 91.0, False),
    ]
    assert find_hung(ws, now=100.0, hang_timeout=10) == ([], "")


def test_every_replica_gone_restores_the_newest_snapshot_on_every_rank() -> None:
    # all three ranks were replaced by spares; two members see snapshots (the newest wins)
    plan = plan_recovery(
        [MemberReport(0, -1, False, 6), MemberReport(1, -1, False, 4), MemberReport(2, -1, False, None)]
    )
    assert (plan.target_step, plan.from_snapshot, plan.receivers) == (6, True, (0, 1, 2))
    assert plan.to_json()["from_snapshot"] is True


def test_survivors_ahead_of_the_snapshot_load_it_too() -> None:
    # rank 1 faulted mid-update at step 9 (invalid, but ahead): it must go back to the snapshot
    plan = plan_recovery([MemberReport(0, -1, False, 8), MemberReport(1, 9, False, 8)])
    assert (plan.target_step, plan.from_snapshot, plan.receivers) == (8, True, (0, 1))


def test_a_valid_replica_wins_over_a_snapshot() -> None:
    plan = plan_recovery([MemberReport(0, 7, True, 6), MemberReport(1, -1, False, 6)])
    assert (plan.target_step, plan.from_snapshot, plan.source, plan.receivers) == (7, False, 0, (1,))
    assert "from_snapshot" not in plan.to_json()


def test_no_replica_and_no_snapshot_names_the_setting() -> None:
    with pytest.raises(NotRecoverableError, match="snapshot-every"):
        plan_recovery([MemberReport(0, 3, False, None), MemberReport(1, -1, False, None)])


def _lost(rank: int, snap: int | None, ckpt: int | None, committed: int = -1) -> MemberReport:
    return MemberReport(rank, committed, False, snapshot_step=snap, checkpoint_step=ckpt)


def test_no_replica_and_no_snapshot_restores_the_newest_checkpoint_on_every_rank() -> None:
    # --snapshot-every 0 (or the host's memory was lost): the durable checkpoint is what is left
    plan = plan_recovery([_lost(0, None, 9), _lost(1, None, 6), _lost(2, None, None, committed=11)])
    assert (plan.target_step, plan.source, plan.receivers) == (9, -1, (0, 1, 2))
    assert plan.from_checkpoint and not plan.from_snapshot
    assert plan.to_json()["from_checkpoint"] is True and "from_snapshot" not in plan.to_json()


def test_the_newer_of_snapshot_and_checkpoint_wins_and_a_tie_goes_to_the_snapshot() -> None:
    newer_ckpt = plan_recovery([_lost(0, 4, 10), _lost(1, 4, 10)])
    assert (newer_ckpt.target_step, newer_ckpt.from_checkpoint, newer_ckpt.from_snapshot) == (10, True, False)
    newer_snap = plan_recovery([_lost(0, 12, 10), _lost(1, None, 10)])
    assert (newer_snap.target_step, newer_snap.from_snapshot, newer_snap.from_checkpoint) == (12, True, False)
    tie = plan_recovery([_lost(0, 10, 10), _lost(1, 10, 10)])
    assert tie.from_snapshot and not tie.from_checkpoint  # memory is faster to read than the disk


def test_a_valid_replica_wins_over_a_checkpoint() -> None:
    plan = plan_recovery([MemberReport(0, 7, True, None, 9), _lost(1, None, 9)])
    assert (plan.target_step, plan.source, plan.from_checkpoint) == (7, 0, False)
    assert "from_checkpoint" not in plan.to_json()


def test_nothing_left_names_both_settings() -> None:
    with pytest.raises(NotRecoverableError, match=r"--snapshot-every.*--checkpoint-every"):
        plan_recovery([_lost(0, None, None, committed=3), _lost(1, None, None)])


# -- sharded meshes: rank r holds shard r % S in replica group r // S ------------------------------
def _mesh_reports(
    shape: tuple[int, int], states: dict[int, tuple[int, bool]], step: int = 5
) -> list[MemberReport]:
    n = shape[0] * shape[1]
    return [MemberReport(r, *states.get(r, (step, True)), mesh=shape) for r in range(n)]


def test_sharded_receiver_takes_its_own_shard_from_the_other_replica_group() -> None:
    # HSDP 2x2: rank 1 (shard 1, group 0) died; rank 3 holds shard 1 in group 1
    plan = plan_recovery(_mesh_reports((2, 2), {1: (-1, False)}))
    assert plan.target_step == 5 and plan.receivers == (1,)
    assert plan.source_of() == {1: 3}
    assert plan.to_json()["sources"] == [[1, 3]]


def test_whole_replica_group_lost_is_recovered_from_the_other_group() -> None:
    plan = plan_recovery(_mesh_reports((2, 2), {0: (-1, False), 1: (-1, False)}))
    assert plan.source_of() == {0: 2, 1: 3}


def test_several_receivers_of_one_shard_spread_over_its_holders() -> None:
    # 4 replica groups x 2 shards; shard 0 lost in groups 0 and 1: holders 4 and 6 send one each
    plan = plan_recovery(_mesh_reports((4, 2), {0: (-1, False), 2: (-1, False)}))
    assert plan.source_of() == {0: 4, 2: 6}


def test_sharded_target_is_a_step_every_shard_holds() -> None:
    # rank 0 applied step 5's update (at 6); shard 1's only valid holder (rank 3) is at 5:
    # everybody resumes at 5, and rank 0 takes shard 0 at step 5 from rank 2
    plan = plan_recovery(_mesh_reports((2, 2), {0: (6, True), 1: (-1, False)}))
    assert plan.target_step == 5 and plan.source_of() == {0: 2, 1: 3}


def test_sharded_initial_generation_syncs_each_shard_from_replica_group_zero() -> None:
    plan = plan_recovery([MemberReport(r, 0, True, mesh=(2, 2)) for r in range(4)], initial=True)
    assert plan.source_of() == {2: 0, 3: 1}
    plan = plan_recovery([MemberReport(r, 0, True, mesh=(1, 4)) for r in range(4)], initial=True)
    assert plan.receivers == () and plan.source_of() == {}


def test_a_resumed_sharded_job_starts_at_the_step_its_shards_were_restored_from() -> None:
    # every rank restored its shard of step 7 and passed start=7: the job starts there, not at 0
    plan = plan_recovery([MemberReport(r, 7, True, mesh=(2, 2)) for r in range(4)], initial=True)
    assert plan.target_step == 7 and plan.source_of() == {2: 0, 3: 1}
    plan = plan_recovery([MemberReport(r, 7, True, mesh=(1, 4)) for r in range(4)], initial=True)
    assert plan.target_step == 7 and plan.receivers == ()


def test_the_first_sync_takes_each_shard_from_its_lowest_valid_holder() -> None:
    # rank 0 failed while the first sync loaded its state (invalid): shard 0 comes from rank 2
    reports = [MemberReport(r, 7, r != 0, mesh=(2, 2)) for r in range(4)]
    plan = plan_recovery(reports, initial=True)
    assert plan.target_step == 7 and plan.source_of() == {0: 2, 3: 1}
    # without a mesh: the lowest valid rank's state and step, as DDP's broadcast from rank 0
    plan = plan_recovery(
        [MemberReport(0, -1, False), MemberReport(1, 7, True), MemberReport(2, 0, True)], initial=True
    )
    assert (plan.target_step, plan.source, plan.receivers) == (7, 1, (0, 2))


def test_shards_restored_from_different_steps_are_refused_at_the_start() -> None:
    # a model of shard 0 at step 7 and shard 1 at step 0 never existed: refuse, never train on it
    reports = [MemberReport(r, 7 if r % 2 == 0 else 0, True, mesh=(2, 2)) for r in range(4)]
    with pytest.raises(NotRecoverableError, match=r"rank 0: 7, rank 1: 0.*job.steps\(start=\)"):
        plan_recovery(reports, initial=True)
    # without a mesh only the reference's step counts (the others take its whole state)
    plan = plan_recovery([MemberReport(0, 7, True), MemberReport(1, 0, True)], initial=True)
    assert plan.target_step == 7


def test_a_shard_with_no_valid_holder_at_the_start_is_an_error() -> None:
    reports = [MemberReport(r, 7, r not in (1, 3), mesh=(2, 2)) for r in range(4)]
    with pytest.raises(NotRecoverableError, match=r"shard\(s\) \[1\]"):
        plan_recovery(reports, initial=True)


def test_fsdp_without_replicas_ends_with_a_clear_error_never_a_wrong_shard() -> None:
    reports = _mesh_reports((1, 4), {2: (-1, False)})
    reports = [MemberReport(r.rank, r.committed_step, r.valid, snapshot_step=3, mesh=(1, 4)) for r in reports]
    with pytest.raises(NotRecoverableError, match=r"ranks \[2\].*R >= 2"):
        plan_recovery(reports)


def test_sharded_checkpoint_fallback_takes_the_newest_step_every_rank_has() -> None:
    # Nothing in memory is left (R = 1, no copies). Each rank writes its own shard's checkpoints
    # and keeps the newest two: rank 1's save of step 9 was still being written when the fault
    # came. Step 6 is the newest that every rank has.
    have = {0: (6, 9), 1: (3, 6), 2: (6, 9), 3: (6, 9)}
    reports = [
        MemberReport(r, 10 if r else -1, r != 0, checkpoint_step=max(s), checkpoint_steps=s, mesh=(1, 4))
        for r, s in have.items()
    ]
    plan = plan_recovery(reports)
    assert plan.from_checkpoint and plan.target_step == 6 and plan.receivers == (0, 1, 2, 3)
    # no step that every rank has: the documented error, never shards of different steps
    reports = [
        MemberReport(
            r,
            s.checkpoint_step or 0,
            s.valid,
            checkpoint_step=s.checkpoint_step,
            checkpoint_steps=(s.checkpoint_step,) if s.checkpoint_step else (),
            mesh=(1, 4),
        )
        for r, s in enumerate(reports)
    ]
    with pytest.raises(NotRecoverableError, match="no replica, no buddy copy"):
        plan_recovery(reports)


def test_data_parallel_mesh_falls_back_to_the_snapshot() -> None:
    # S = 1: every rank holds the whole model, so rank 0's snapshot serves everyone
    reports = [MemberReport(r, -1, False, snapshot_step=3, mesh=(2, 1)) for r in range(2)]
    plan = plan_recovery(reports)
    assert plan.from_snapshot and plan.target_step == 3 and plan.source_of() == {}


def test_ranks_that_disagree_about_the_mesh_are_refused() -> None:
    reports = [MemberReport(0, 5, True, mesh=(2, 2)), MemberReport(1, 5, True, mesh=(1, 2))]
    with pytest.raises(NotRecoverableError, match="disagree about the device mesh"):
        plan_recovery(reports)


def test_a_first_step_waiting_in_a_collective_gets_no_compile_allowance() -> None:
    # a replacement in its first step, deadlocked with the survivors (all in collectives): a
    # stall after the ordinary limit, not after the first step's (compile) allowance
    ws = [
        WorkerHealth(0, 100.0, 85.0, True),
        WorkerHealth(1, 100.0, 85.0, True, first_step=True),
        WorkerHealth(2, 100.0, 85.0, True),
    ]
    culprits, why = find_hung(ws, now=100.0, hang_timeout=10, first_step_limit=600)
    assert culprits == [] and "waiting" in why
    # the same rank busy outside any collective (compiling) keeps its allowance, and the
    # survivors waiting for it are not a stall
    ws[1] = WorkerHealth(1, 100.0, 85.0, False, first_step=True)
    assert find_hung(ws, now=100.0, hang_timeout=10, first_step_limit=600) == ([], "")
