"""Shared-memory snapshots: exact round trips, corrupt bytes refused, a killed writer harmless, and
real jobs that lose every replica: one whose every rank dies at once (inside an update, then as a
step begins) and then raises at once, finishing bitwise identical to the fault-free run, and one
that has no snapshot to start from, ending with the reason."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointless.errors import StateTransferError
from checkpointless.state.codec import layout
from checkpointless.state.shm_dir import list_snapshots, snapshot_path
from checkpointless.state.shm_snapshot import SnapshotWriter, restore_snapshot
from checkpointless.state.snapshot import (
    capture_rng,
    collect_state,
    host_copy,
    land,
    landing_zone,
    restore_rng,
    restore_state,
)
from checkpointless.state.snapshot_file import load_snapshot, write_snapshot
from checkpointless.state.staging import guarded_pointers
from tests.e2e.test_faults_e2e import check_recovered
from tests.helpers.jobs import run_job
from tests.helpers.writer_kill import kill_writer_repeatedly


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # one tensor over codec's 1 MiB solo limit, so solo and packed messages are interleaved
    net = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.LayerNorm(600), torch.nn.Linear(600, 8))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(torch.randn(4, 600)).sum().backward()
    opt.step()
    return net, opt


def _flat(net: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.clone() for t in net.state_dict().values()]
    out += [v.clone() for st in opt.state.values() for v in st.values()]
    return out


@pytest.mark.timeout(30)
def test_snapshot_restores_model_optimizer_and_rng_exactly(tmp_path: Path) -> None:
    net, opt = _trained()
    objects: dict[str, Any] = {"model": net, "optimizer": opt}
    rng = capture_rng()
    expected_draw = torch.rand(3)
    want = _flat(net, opt)
    writer = SnapshotWriter(tmp_path / "job" / "snapshots", every=2)
    assert writer.due(4) and not writer.due(3) and not writer.due(0)
    assert writer.start(4, collect_state(objects, 4, rng), guarded_pointers([opt]))
    writer.wait_copied(10)
    # the guarded tensors may change once the copy is done: the snapshot must not see it
    net(torch.randn(4, 600)).sum().backward()
    opt.step()
    assert writer.wait_idle(10)
    info = writer.take_published()
    assert info is not None and info.step == 4 and info.to_json()["bound_bytes"] == 2 * info.nbytes
    assert list_snapshots(writer.directory) == [4]
    torch.rand(5)  # move the RNG on: the restore must put it back
    stats = restore_snapshot(objects, writer.directory, 4)
    assert stats["bytes"] > 4_000_000
    assert all(torch.equal(a, b) for a, b in zip(want, _flat(net, opt), strict=True))
    assert torch.equal(torch.rand(3), expected_draw)


@pytest.mark.timeout(30)
def test_a_host_copy_is_put_back_into_the_live_tensors() -> None:
    # job.epochs() holds such a copy through an abandoned epoch's work (recovery/epochs.py): put
    # back, the values must be exact and the model's and optimizer's tensors the same objects,
    # or an optimizer on a device would hold two copies of its state while it loads
    net, opt = _trained()
    objects: dict[str, Any] = {"model": net, "optimizer": opt}
    want = _flat(net, opt)
    held = host_copy(collect_state(objects, 4, capture_rng()))
    expected_draw = torch.rand(3)
    live = [id(v) for st in opt.state.values() for v in st.values()]
    net(torch.randn(4, 600)).sum().backward()
    opt.step()  # the abandoned epoch's work moves everything on
    _, rng = restore_state(objects, land(held, landing_zone(objects, 9, capture_rng())))
    restore_rng(rng)
    assert all(torch.equal(a, b) for a, b in zip(want, _flat(net, opt), strict=True))
    assert [id(v) for st in opt.state.values() for v in st.values()] == live
    assert torch.equal(torch.rand(3), expected_draw)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["data", "header"])
def test_corrupt_snapshot_is_refused_and_the_older_one_still_loads(tmp_path: Path, where: str) -> None:
    net, opt = _trained()
    objects: dict[str, Any] = {"model": net, "optimizer": opt}
    d = tmp_path / "job" / "snapshots"
    write_snapshot(d, 2, layout(collect_state(objects, 2, capture_rng())))
    write_snapshot(d, 4, layout(collect_state(objects, 4, capture_rng())))
    assert list_snapshots(d) == [2, 4]
    path = snapshot_path(d, 4)
    raw = bytearray(path.read_bytes())
    pos = len(raw) - 100 if where == "data" else 30
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(StateTransferError, match=r"corrupt|checksum") as err:
        load_snapshot(d, 4)
    assert "refused and removed" in str(err.value)
    assert list_snapshots(d) == [2], "a refused snapshot must be removed so the next plan uses the older"
    state, _ = load_snapshot(d, 2)
    assert state["step"] == 2


_WRITER_LOOP = """
import sys, torch
from pathlib import Path
from checkpointless.state.codec import layout
from checkpointless.state.snapshot_file import write_snapshot
state = {"step": 0, "big": torch.zeros(8 << 20, dtype=torch.uint8), "small": torch.zeros(7)}
step = 2
while True:
    state["step"] = step
    state["big"].fill_(step % 251)
    state["small"].fill_(step)
    write_snapshot(Path(sys.argv[1]), step, layout(state))
    print(step, flush=True)
    step += 2
"""


@pytest.mark.timeout(90)
def test_writer_killed_mid_write_leaves_the_last_snapshot_usable(tmp_path: Path) -> None:
    d = tmp_path / "job" / "snapshots"

    def check() -> None:
        steps = list_snapshots(d)
        assert 1 <= len(steps) <= 2, steps  # memory bound: never more than two slots
        state, _ = load_snapshot(d, steps[-1])
        s = state["step"]
        assert s == steps[-1] and bool((state["big"] == s % 251).all()) and bool((state["small"] == s).all())

    mid_write = kill_writer_repeatedly(
        _WRITER_LOOP,
        d,
        attempts=6,
        pause=lambda attempt: 0.05 + 0.03 * attempt,
        mid_write=lambda names: any(n.startswith(".writing-") for n in names),
        check=check,
    )
    assert mid_write, "no kill landed while a snapshot was being written"
    # the next writer removes what the killed one left and keeps at most two snapshots
    write_snapshot(d, 10_000, layout({"step": 10_000, "x": torch.ones(3)}))
    assert not [n for n in os.listdir(d) if n.startswith(".writing-")]
    assert len(list_snapshots(d)) == 2


# every rank SIGKILLed half-way through step 4's update (some parameters already changed on each):
# no rank holds a clean state of step 4 or of step 3. The snapshot of step 4 is the state as step 4
# began, before its update, so the job resumes at step 4 and trains step 4's batches once.
KILLED_IN_UPDATE = "killall:step=4:site=optimizer"
# every rank raises half-way through step 8's update, each time its process runs it (a fault that
# lives in the process): once all have raised there no rank holds the state, and its in-process
# retries and then its fresh processes start from the snapshot. (Raised as the step begins, a
# rank still holds the state, and the ranks replaced first receive it from one not yet replaced:
# whether a snapshot is needed then depends on the order the limits are reached in.)
WEDGED = [f"wedge:rank={r}:step=8:site=optimizer" for r in range(3)]


@pytest.mark.timeout(300)
def test_every_rank_killed_at_once_or_raising_at_once_restores_from_the_snapshot(
    tmp_path: Path, corpus: Path, reference: Any
) -> None:
    """Three ways to lose every replica in one job, each restored from the newest shared-memory
    snapshot: every rank SIGKILLed inside step 4's update and, in another round, as step 6
    begins (by spares), then every rank raising in step 8's update until its in-process retries
    are used up (coordinator/rules/respawn.py: fresh processes are tried only because a snapshot
    is left)."""
    ref = reference(3)
    run_dir = tmp_path / "run"
    # killall: at its step and site, every rank waits for rank 0's snapshot of that step to be
    # written and for the others to get there, then every process holding a rank SIGKILLs itself
    res = run_job(
        run_dir,
        corpus,
        nproc=3,
        spares=3,
        faults=[KILLED_IN_UPDATE, "killall:step=6", *WEDGED],
        extra=["--snapshot-every", "2"],
        timeout=240,
    )
    # every rank's weights and committed batches; a rank's wedged process may be the last to raise
    # in step 8's update, after fresh peers finished theirs: the next round resumes at step 9 and
    # that rank's line for step 8 is never written (its gradient was in the step; the weights say
    # so), hence cut=True (steps 3 and 4, which cut=True would also excuse, are counted below)
    check_recovered(res, ref, recoveries=3, cut=True)
    fired = {(e["id"], e["rank"]) for e in res.of("fault_injected") if e["kind"] == "killall"}
    ids = ["killall:rank=None:step=4:site=optimizer", "killall:rank=None:step=6:site=step"]
    assert fired == {(i, r) for i in ids for r in range(3)}, fired
    plans = [p for p in res.of("plan") if p.get("from_snapshot")]
    # each kill: all at once, one round whose faults are every rank's SIGKILL at its step (none
    # survived), every rank replaced by a spare and restored from the snapshot of that step
    rounds = [r for r in res.of("recovery") if any(f["kind"] == "killed" for f in r["faults"])]
    assert [r["faults"][0]["step"] for r in rounds] == [4, 6], [r["faults"] for r in rounds]
    for killed, step in zip(rounds, (4, 6), strict=True):
        assert sorted((f["rank"], f["kind"], f["step"]) for f in killed["faults"]) == [
            (r, "killed", step) for r in range(3)
        ], killed["faults"]
        replaced = [e["rank"] for e in res.of("spare_assigned") if e["generation"] == killed["generation"]]
        assert sorted(replaced) == [0, 1, 2], "every rank must have been replaced"
        [after_kill] = [p for p in plans if p["generation"] == killed["generation"]]
        assert after_kill["target_step"] == step and after_kill["receivers"] == [0, 1, 2], plans
        assert killed["transport"] == "snapshot", killed
    # the kill inside step 4's update: its interrupted pass committed nothing and the restore went
    # back to step 4, no further, so every rank committed steps 3 and 4 once each
    commits = [(e["rank"], e["step"]) for e in res.commits()]
    assert {(r, s): commits.count((r, s)) for r in range(3) for s in (3, 4)} == {
        (r, s): 1 for r in range(3) for s in (3, 4)
    }, sorted(commits)
    # the raises: every rank raised in step 8's update, was retried in its process, then replaced
    # by a fresh process, and the state came back from the snapshot (no rank held it)
    assert {e["rank"] for e in res.of("fault_injected") if e["kind"] == "wedge"} == {0, 1, 2}
    assert {r for e in res.of("respawn") for r in e["ranks"]} == {0, 1, 2}, res.of("respawn")
    raised = {f["rank"] for f in res.of("fault") if f["kind"] == "exception" and f.get("step") == 8}
    assert raised, res.of("fault")
    late = [p for p in plans if p["generation"] > rounds[-1]["generation"]]
    assert late and all(p["receivers"] == [0, 1, 2] and p["target_step"] in (6, 8) for p in late), plans
    assert "restored the shared-memory snapshot of step" in res.output, res.output[-4000:]
    assert len(res.of("spare_assigned")) == 9, res.of("spare_assigned")
    snaps = [e["snapshot"] for e in res.events("rank-0.jsonl") if "snapshot" in e]
    assert snaps and all(s["bound_bytes"] == 2 * s["bytes"] for s in snaps)


@pytest.mark.timeout(120)
def test_every_rank_raising_without_a_snapshot_ends_with_the_reason(tmp_path: Path, corpus: Path) -> None:
    """Every rank raising in one step's update with no snapshot and no checkpoint: no copy of the
    state is left for a retry in process or in fresh processes, and the job ends saying so, with
    the fix, instead of training on from a half-updated model."""
    res = run_job(
        tmp_path / "run",
        corpus,
        nproc=3,
        spares=3,
        faults=[f"wedge:rank={r}:step=2:site=optimizer" for r in range(3)],
        extra=["--snapshot-every", "0"],
        timeout=100,
    )
    assert res.rc != 0, res.output[-4000:]
    [end] = res.of("job_end")
    assert end["status"] == "failed", end
    why = end["error"]
    # the first round finds no valid replica (the usual end); should a rank have been aborted
    # before its update began, the retries run out first and the respawn rule says the same
    assert any(
        text in why
        for text in (
            "no rank holds a valid replica",
            "were not tried: nothing would be left",
            "fresh processes could not be tried",
        )
    ), why
    assert "--snapshot-every" in why and "--checkpoint-every" in why, why
    assert not [p for p in res.of("plan") if p.get("from_snapshot")], res.of("plan")
    assert not res.digests, "no rank may finish the job"
    assert not res.left_behind(), "processes of the job were left behind"


@pytest.mark.timeout(30)
def test_codec_packs_small_tensors_that_follow_a_solo_one_into_the_pack() -> None:
    # regression: small tensors laid out after a >= 1 MiB tensor were addressed into its message
    from checkpointless.state.codec import unpack

    tree = {"a": torch.arange(5.0), "big": torch.ones(300_000), "b": torch.arange(7.0)}
    lay = layout(tree)
    back = unpack(lay.manifest, lay.messages)
    assert all(torch.equal(back[k], v) for k, v in tree.items())
