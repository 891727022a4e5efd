"""Recovery decisions as pure functions: observed state in, an action out. No I/O here.

Everything the launcher decides during a fault goes through these functions, so each rule can be
unit-tested by feeding it a situation and checking the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from checkpointless.errors import NotRecoverableError

__all__ = [
    "MemberReport",
    "RecoveryPlan",
    "SpareAction",
    "plan_recovery",
    "spare_policy",
]


@dataclass(frozen=True)
class MemberReport:
    """What a member of the next generation says about its state when it stops."""

    rank: int
    committed_step: int  # number of steps whose parameter update this rank has applied
    valid: bool  # False: it died, or faulted in the middle of its own update, or is new
    # the newest complete shared-memory snapshot this member can see on its host (None: none)
    snapshot_step: int | None = None
    # the newest complete durable (DCP) checkpoint this member can see (None: none, or off)
    checkpoint_step: int | None = None
    # every complete durable checkpoint it can see, oldest first (on a sharded mesh its own
    # shard's: the plan needs a step that every rank has)
    checkpoint_steps: tuple[int, ...] = ()
    # (replicate, shard) sizes of the job's device mesh (None: replicated data parallel); rank r
    # holds shard coordinate r % shard in replica group r // shard (row-major, comm/mesh.py)
    mesh: tuple[int, int] | None = None
    # (owner rank, step) of every verified buddy copy this member keeps for others (state/buddy_keeper.py)
    copies: tuple[tuple[int, int], ...] = ()
    # steps of this rank's own shared-memory snapshots on its host (per-rank, on a sharded mesh)
    own_snapshots: tuple[int, ...] = ()
    # the protected sections whose closing barrier it passed at the boundary after
    # ``committed_step`` steps (rules/sections.py)
    sections_closed: tuple[str, ...] = ()
    # the boundary those are at when not ``committed_step`` (a replacement's predecessor's)
    sections_step: int | None = None
    # (section, ranks) that entered its closing barrier there, unknown whether they passed it
    sections_entered: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # the sections whose closing barrier it entered at ``committed_step`` and failed
    sections_left: tuple[str, ...] = ()


@dataclass(frozen=True)
class RecoveryPlan:
    target_step: int  # every rank resumes by running this step
    source: int  # the rank that sends state; -1 when the state comes from a snapshot
    receivers: tuple[int, ...]  # ranks that take the source's state (or load the snapshot)
    from_snapshot: bool = False  # every rank loads the snapshot of target_step, then replays
    from_checkpoint: bool = False  # every rank loads the durable checkpoint of target_step, then replays
    # (receiver, source) pairs when receivers take state from different ranks (a sharded mesh:
    # each from a holder of its own shard); empty: every receiver takes ``source``'s state
    sources: tuple[tuple[int, int], ...] = ()
    # receivers whose source sends the buddy copy it keeps for them, not its own state
    from_copy: tuple[int, ...] = ()
    # receivers that load their own per-rank snapshot of target_step (no source)
    own_snapshot: tuple[int, ...] = ()

    def source_of(self) -> dict[int, int]:
        """receiver -> the rank it takes state from (empty for snapshot and checkpoint plans)."""
        if self.from_snapshot or self.from_checkpoint:
            return {}
        if self.sources or self.own_snapshot:
            return dict(self.sources)
        return {r: self.source for r in self.receivers}

    def kind_of(self, receiver: int) -> str:
        """How ``receiver`` gets its state: replica, copy, own_snapshot (or the plan's kind)."""
        if self.from_snapshot:
            return "snapshot"
        if self.from_checkpoint:
            return "checkpoint"
        if receiver in self.own_snapshot:
            return "own_snapshot"
        return "copy" if receiver in self.from_copy else "replica"

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "target_step": self.target_step,
            "source": self.source,
            "receivers": list(self.receivers),
        }
        if self.sources:
            out["sources"] = [list(pair) for pair in self.sources]
        if self.from_copy:
            out["from_copy"] = list(self.from_copy)
        if self.own_snapshot:
            out["own_snapshot"] = list(self.own_snapshot)
        if self.from_snapshot:
            out["from_snapshot"] = True
        if self.from_checkpoint:
            out["from_checkpoint"] = True
        return out


def plan_recovery(reports: list[MemberReport], initial: bool = False) -> RecoveryPlan:
    """Choose where training resumes and who sends state to whom.

    Data-parallel replicas hold identical state at the same step, and one step's all-reduce
    makes every rank that applied the update hold the *same* new state. So resume at the newest
    step any valid replica has reached (a rank that finished its update never has to undo it),
    and let every rank that is behind, invalid or new receive from the lowest such rank. At the
    job's first generation (``initial``) the lowest valid rank's state is the reference (rank 0's
    unless it failed), as DDP's broadcast, and its committed step is where the job starts
    (non-zero when the script resumed); on a mesh, each shard's (:func:`_plan_initial`).

    When no replica is valid, the newest complete shared-memory snapshot any member can see is
    the state: every rank loads it (survivors too, since they may be ahead of it) and the steps
    since are replayed, which is exact because a step is a pure function of its index. A valid
    replica always wins over a snapshot: it is never older than the newest snapshot.

    Below the snapshots lies the durable checkpoint (``--checkpoint-every``): used the same way
    when it is newer than every snapshot (fewer steps to replay), or when no snapshot is left; on
    a tie the snapshot wins, since it is read from memory, not from disk.
    """
    if not reports:
        raise NotRecoverableError("no members to plan a recovery for")
    ranks = sorted(r.rank for r in reports)
    if ranks != list(range(len(ranks))):
        raise NotRecoverableError(f"generation members are not ranks 0..{len(ranks) - 1}: {ranks}")
    mesh = _common_mesh(reports)
    if initial:
        return _plan_initial(reports, 1 if mesh is None else mesh[1])
    if mesh is not None:
        return _plan_sharded(reports, mesh)
    valid = [r for r in reports if r.valid]
    if not valid:
        return _fallback(reports, ranks)
    target = max(r.committed_step for r in valid)
    source = min(r.rank for r in valid if r.committed_step == target)
    receivers = tuple(
        r.rank for r in sorted(reports, key=lambda r: r.rank) if not r.valid or r.committed_step != target
    )
    return RecoveryPlan(target, source, receivers)


def _fallback(reports: list[MemberReport], ranks: list[int]) -> RecoveryPlan:
    """No rank holds what is needed: every rank loads a snapshot or a checkpoint, or the job ends."""
    snaps = [r.snapshot_step for r in reports if r.snapshot_step is not None]
    ckpts = [r.checkpoint_step for r in reports if r.checkpoint_step is not None]
    if snaps and (not ckpts or max(snaps) >= max(ckpts)):
        return RecoveryPlan(max(snaps), -1, tuple(ranks), from_snapshot=True)
    if ckpts:
        return RecoveryPlan(max(ckpts), -1, tuple(ranks), from_checkpoint=True)
    raise NotRecoverableError(
        "no rank holds a valid replica of the training state (every replica faulted or is new), "
        "no intact shared-memory snapshot is left (--snapshot-every) and no complete durable "
        "checkpoint exists (--checkpoint-every); keep snapshots on, and on a cluster add "
        "--checkpoint-every with --checkpoint-dir on shared storage"
    )


def _common_mesh(reports: list[MemberReport]) -> tuple[int, int] | None:
    meshes = {r.mesh for r in reports}
    if len(meshes) > 1:
        detail = ", ".join(f"rank {r.rank}: {r.mesh}" for r in reports)
        raise NotRecoverableError(
            f"ranks disagree about the device mesh ({detail}); every rank must call "
            "job.device_mesh() with the same shape before job.steps()"
        )
    mesh = meshes.pop()
    if mesh is not None and mesh[0] * mesh[1] != len(reports):
        raise NotRecoverableError(
            f"device mesh {mesh[0]}x{mesh[1]} does not cover the generation's {len(reports)} ranks"
        )
    return mesh


def _plan_initial(reports: list[MemberReport], shards: int) -> RecoveryPlan:
    """The job's first state sync, as DDP's broadcast at construction: for each shard coordinate
    (one, without a mesh) the lowest valid rank that holds it is the reference, and every other
    rank takes its shard's reference's state and start step.

    The start step is the one the script passed to ``job.steps(start=)`` after restoring its own
    checkpoint (0 when it did not). On a mesh every reference restored one shard, so they must
    agree on it: shards of different steps would make a model that no run ever had. Without a
    mesh only the reference's counts (the other ranks take its whole state), as DDP takes rank
    0's. A valid rank is one that ran the script's start-up itself, a process that took a rank
    lost during start-up included (recovery/startup.py); a rank into which an earlier attempt of
    this sync failed to load a state is not, and a coordinate with no valid rank left is an error,
    never a shard of unknown provenance."""
    refs: dict[int, MemberReport] = {}
    for r in sorted(reports, key=lambda m: m.rank):
        if r.valid and r.rank % shards not in refs:
            refs[r.rank % shards] = r
    missing = sorted(set(range(shards)) - set(refs))
    if missing:
        raise NotRecoverableError(
            f"no valid rank holds shard(s) {missing} at the job's start (reports: "
            f"{[(r.rank, r.committed_step, r.valid) for r in reports]}); every holder of those "
            "shards failed while the job's first state sync loaded it; start the job again"
        )
    starts = {max(0, r.committed_step) for r in refs.values()}
    if len(starts) > 1:
        detail = ", ".join(f"rank {r.rank}: {max(0, r.committed_step)}" for r in refs.values())
        raise NotRecoverableError(
            f"the ranks that hold the shards start from different steps ({detail}); each restored "
            "its shard of a checkpoint of another step. Restore one checkpoint on every rank and "
            "pass its step to job.steps(start=) everywhere"
        )
    start = starts.pop()
    pairs = tuple((r.rank, refs[r.rank % shards].rank) for r in sorted(reports, key=lambda m: m.rank))
    pairs = tuple((r, src) for r, src in pairs if r != src)
    if shards == 1:
        return RecoveryPlan(start, refs[0].rank, tuple(r for r, _ in pairs))
    return RecoveryPlan(start, refs[0].rank, tuple(r for r, _ in pairs), sources=pairs)


def _plan_sharded(reports: list[MemberReport], mesh: tuple[int, int]) -> RecoveryPlan:
    """The plan for a (replicate, shard) mesh: every rank that does not hold its shard at the
    target step gets it from the best holder left, in this order (docs/fault-model.md):

    1. a *replica*: a valid rank of another replica group with the same shard coordinate
       (rank r holds shard ``r % S``) at the target step, the least loaded (lowest on a tie), so
       ranks recovered together draw from different sources;
    2. a *buddy copy*: a member that keeps a verified copy of this rank's state at the target
       step (state/buddy.py; the copy is of the rank, so of its shard);
    3. its *own snapshot*: this rank's per-rank shared-memory snapshot of the target step, seen
       on its host (a survivor rolling back, or a replacement on the same host).

    A survivor (a valid rank past the target) that has its own state of the target step (an
    undo copy, or its snapshot) restores that first: it is in its own memory, so nothing crosses
    the network, where a rollback would otherwise have every survivor's keeper send it a shard.

    The target is the newest step at which every rank has one of these (or holds it itself): a
    rank ahead of it receives and replays, exactly as a replica behind the target does in data
    parallelism. A shard whose holder and buddy are both lost falls through to the snapshot, then
    to an older step. With ``S = 1`` every rank holds the whole model and rank 0's snapshot or
    checkpoint serves everyone as in data parallelism; with ``S > 1`` and nothing left the job
    ends with an error naming the ranks, never going on with a missing shard.
    """
    ranks = sorted(r.rank for r in reports)
    shards = mesh[1]
    keepers: dict[tuple[int, int], list[int]] = {}  # (owner, step) -> members keeping that copy
    for m in reports:
        for owner, step in m.copies:
            if owner != m.rank:
                keepers.setdefault((owner, step), []).append(m.rank)
    valid = [r for r in reports if r.valid]
    candidates = {r.committed_step for r in valid} | {s for _, s in keepers}
    candidates |= {s for m in reports for s in m.own_snapshots}
    for step in sorted(candidates, reverse=True):
        plan = _assign_sources(reports, shards, step, keepers)
        if plan is not None:
            return plan
    if shards == 1:
        return _fallback(reports, ranks)
    # Each rank writes its own shard's checkpoints, asynchronously, and keeps the newest few: a
    # fault can land while some rank's newest is still being written, or after a rank skipped
    # one (its previous save still running). The newest step that every rank has is the state.
    common = set.intersection(*(_checkpoints_of(r) for r in reports))
    if common:
        # every rank loads its own (per-rank) checkpoint of that step: its own shard
        return RecoveryPlan(max(common), -1, tuple(ranks), from_checkpoint=True)
    newest = max((r.committed_step for r in valid), default=0)
    stuck = [r.rank for r in reports if not (r.valid and r.committed_step == newest)]
    raise NotRecoverableError(
        f"ranks {stuck} of the {mesh[0]}x{shards} mesh have no replica, no buddy copy and no "
        f"snapshot of their shard at a step every rank can reach (valid ranks and steps: "
        f"{[(r.rank, r.committed_step) for r in valid]}, buddy copies: {sorted(keepers)}); a "
        "shard whose holder and buddy were lost together (adjacent ranks of the ring, or hosts) "
        "cannot be rebuilt (docs/fault-model.md); run with more than one replica group "
        "(job.device_mesh(..., (R, S)) with R >= 2), keep --buddy-copies on, and keep "
        "--snapshot-every on so a rank whose host survives has its own snapshot (and "
        "--checkpoint-every as the last resort)"
    )


def _checkpoints_of(r: MemberReport) -> set[int]:
    steps = set(r.checkpoint_steps)
    if r.checkpoint_step is not None:
        steps.add(r.checkpoint_step)
    return steps


def _assign_sources(
    reports: list[MemberReport], shards: int, step: int, keepers: dict[tuple[int, int], list[int]]
) -> RecoveryPlan | None:
    """Sources for every rank at ``step`` (replica, then buddy copy, then own snapshot), or None
    if some rank has none."""
    holders = [r.rank for r in reports if r.valid and r.committed_step == step]
    load: dict[int, int] = {}
    pairs: list[tuple[int, int]] = []
    copies: list[int] = []
    own: list[int] = []
    for r in sorted(reports, key=lambda m: m.rank):
        if r.rank in holders:
            continue
        peers = [h for h in holders if h % shards == r.rank % shards]
        kept = [k for k in keepers.get((r.rank, step), []) if k != r.rank]
        if step in r.own_snapshots and r.valid:
            # a survivor rolling back has its own state of that step in memory (an undo copy or
            # its snapshot): restoring it moves nothing over the network, where a keeper or a
            # replica would send it the whole shard (every survivor at once, after a rollback)
            own.append(r.rank)
        elif peers or kept:
            src = min(peers or kept, key=lambda h: (load.get(h, 0), h))
            load[src] = load.get(src, 0) + 1
            pairs.append((r.rank, src))
            if not peers:
                copies.append(r.rank)
        elif step in r.own_snapshots:
            own.append(r.rank)
        else:
            return None
    receivers = tuple(sorted([p[0] for p in pairs] + own))
    return RecoveryPlan(
        step,
        min(holders) if holders else -1,
        receivers,
        sources=tuple(pairs),
        from_copy=tuple(copies),
        own_snapshot=tuple(own),
    )


class SpareAction(Enum):
    ASSIGN = "assign"  # a ready spare takes the rank now
    WAIT = "wait"  # a spare is starting (or may start); wait, up to the deadline
    FAIL = "fail"  # stop the job with a clear error


@dataclass(frozen=True)
class SpareDecision:
    action: SpareAction
    spawn: int = 0  # new spare processes to start now
    reason: str = field(default="")


def spare_policy(ready: int, starting: int, needed: int, waited: float, wait_limit: float) -> SpareDecision:
    """What to do when ``needed`` ranks must be replaced.

    Documented policy (docs/operations.md): ready spares are used at once. If too few are
    ready, start as many new spare processes as are missing and wait for them, up to
    ``wait_limit`` seconds in all; then stop the job with an error that says how many spares were
    missing and which setting to raise. Never wait without a deadline.
    """
    if ready >= needed:
        return SpareDecision(SpareAction.ASSIGN)
    if waited < wait_limit:
        return SpareDecision(
            SpareAction.WAIT,
            spawn=max(0, needed - ready - starting),
            reason=f"waiting for {needed - ready} spare(s) to start",
        )
    return SpareDecision(
        SpareAction.FAIL,
        reason=(
            f"{needed} rank(s) need a replacement but only {ready} spare(s) were ready after "
            f"waiting {waited:.0f} s; keep more hot spares with --spares, allow longer with --spare-wait, "
            "or go on with fewer replicas meanwhile with --when-no-spare wait"
        ),
    )
