"""Durable DCP checkpoints: exact round trips (tensors, optimizer and scheduler dicts, RNG), the
asynchronous writer's consistency rule, a writer killed mid-save leaving the previous checkpoint
usable, the flag's parsing, and a real job whose every rank dies (no snapshots) finishing
bitwise identical to the fault-free run."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from checkpointless.errors import ConfigError, StateTransferError
from checkpointless.launcher.model import LaunchConfig
from checkpointless.state.durable import (
    CheckpointEvery,
    CheckpointWriter,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    parse_every,
    remove_partial,
    restore_checkpoint,
    save_checkpoint,
)
from checkpointless.state.snapshot import capture_rng, collect_state, restore_rng
from checkpointless.state.staging import guarded_pointers
from tests.e2e.test_faults_e2e import check_recovered
from tests.helpers.jobs import EXAMPLE, run_job
from tests.helpers.writer_kill import kill_writer_repeatedly


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.BatchNorm1d(300), torch.nn.Linear(300, 8))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=7)
    for _ in range(2):
        net(torch.randn(4, 300)).sum().backward()
        opt.step()
        sched.step()
    return net, opt, sched


def _flat(net: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.clone() for t in net.state_dict().values()]
    out += [v.clone() for st in opt.state.values() for v in st.values()]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    # bitwise: compare the bytes, so -0.0 vs 0.0 or NaN payloads would count as different
    return all(
        x.dtype == y.dtype and x.shape == y.shape and bytes(x.numpy().tobytes()) == bytes(y.numpy().tobytes())
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.timeout(60)
def test_checkpoint_restores_model_optimizer_scheduler_and_rng_bitwise(tmp_path: Path) -> None:
    net, opt, sched = _trained()
    objects: dict[str, Any] = {"model": net, "optimizer": opt, "scheduler": sched}
    rng = capture_rng()
    want = _flat(net, opt)
    want_opt = {k: v for k, v in opt.state_dict().items() if k != "state"}
    want_sched = sched.state_dict()
    draws = (torch.rand(3), random.random(), np.random.rand())
    restore_rng(rng)  # back where the checkpoint takes them
    info = save_checkpoint(tmp_path / "ck", 4, collect_state(objects, 4, rng))
    assert info.step == 4 and info.nbytes > 700_000 and list_checkpoints(tmp_path / "ck") == [4]
    # change everything: another update, scheduler step, RNG draws
    net(torch.randn(4, 300)).sum().backward()
    opt.step()
    sched.step()
    torch.rand(9), random.random(), np.random.rand()
    stats = restore_checkpoint(objects, tmp_path / "ck", 4)
    assert stats["in_place"] > 0, "tensors should land in the live model's own memory"
    assert _same(want, _flat(net, opt))
    got_opt = {k: v for k, v in opt.state_dict().items() if k != "state"}
    assert got_opt == want_opt and sched.state_dict() == want_sched
    assert sorted(opt.state_dict()["state"]) == list(range(6)), "integer keys of the optimizer state survive"
    assert (
        torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1] and np.random.rand() == draws[2]
    )


@pytest.mark.timeout(60)
def test_fresh_optimizer_receives_its_state_from_the_checkpoint(tmp_path: Path) -> None:
    # a spare's optimizer has never stepped: its state dict is empty, the checkpoint's is not
    net, opt, _ = _trained()
    save_checkpoint(tmp_path, 2, collect_state({"model": net, "optimizer": opt}, 2, capture_rng()))
    torch.manual_seed(5)
    net2 = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.BatchNorm1d(300), torch.nn.Linear(300, 8))
    opt2 = torch.optim.AdamW(net2.parameters(), lr=1e-2, betas=(0.8, 0.95))
    restore_checkpoint({"model": net2, "optimizer": opt2}, tmp_path, 2)
    assert _same(_flat(net, opt), _flat(net2, opt2))


@pytest.mark.timeout(60)
def test_async_writer_is_consistent_although_the_update_runs_right_after(tmp_path: Path) -> None:
    net, opt, _ = _trained()
    objects: dict[str, Any] = {"model": net, "optimizer": opt}
    want = _flat(net, opt)
    writer = CheckpointWriter(tmp_path, CheckpointEvery(steps=3))
    assert writer.due(6, time.monotonic()) and not writer.due(4, time.monotonic()) and not writer.due(0, 0.0)
    assert writer.start(6, collect_state(objects, 6, capture_rng()), guarded_pointers([opt]))
    assert not writer.start(9, collect_state(objects, 9, capture_rng()), set()), "one save in flight at most"
    writer.wait_staged(30)
    net(torch.randn(4, 300)).sum().backward()
    opt.step()  # changes every guarded tensor: the checkpoint must not see it
    assert writer.wait_idle(30)
    info = writer.take_published()
    assert info is not None and info.step == 6 and info.to_json()["bytes"] == info.nbytes
    state, _ = load_checkpoint(tmp_path, 6)
    net.load_state_dict(state["objects"]["model"])
    opt.load_state_dict(state["objects"]["optimizer"])
    assert _same(want, _flat(net, opt))
    writer.close(10)


@pytest.mark.timeout(30)
def test_per_rank_writers_of_a_sharded_job_fall_due_at_the_same_step(tmp_path: Path) -> None:
    # Two ranks' writers saving every 10 s, each rank committing a step 2 ms after the other.
    # Counted from each writer's own start, their saves would fall on different steps wherever
    # the writers started apart; on the shared wall clock both fall due at the first step after
    # each 10 s boundary, so every rank has a checkpoint of that step.
    every = CheckpointEvery(seconds=10.0)
    a = CheckpointWriter(tmp_path / "a", every, aligned=True)
    b = CheckpointWriter(tmp_path / "b", every, aligned=True)
    assert a._interval is not None and b._interval is not None
    boundary = 1_000_000.0  # a wall-clock time on a 10 s boundary; the writers began before it
    a._interval = b._interval = int(boundary // 10) - 1
    steps = [(k, boundary - 7.9 + 0.4 * k) for k in range(1, 60)]  # steps of 0.4 s
    due_a = [k for k, w in steps if a.due(k, 0.0, wall=w)]
    due_b = [k for k, w in steps if b.due(k, 0.0, wall=w + 0.002)]
    assert due_a == due_b == [20, 45], (due_a, due_b)
    # rank 0's writer of a data-parallel job counts from its own last save
    c = CheckpointWriter(tmp_path / "c", every)
    assert not c.due(1, time.monotonic()) and c.due(1, time.monotonic() + 10.0)


@pytest.mark.timeout(60)
def test_keeps_the_newest_two_and_refuses_an_unreadable_one(tmp_path: Path) -> None:
    for s in (3, 6, 9):
        save_checkpoint(tmp_path, s, {"step": s, "x": torch.full((5,), float(s))})
    assert list_checkpoints(tmp_path) == [6, 9]
    # a .tmp holding DCP's metadata (killed just before the rename) is still not a checkpoint
    (tmp_path / "step-12.tmp").mkdir()
    (tmp_path / "step-12.tmp" / ".metadata").write_bytes(b"x")
    assert list_checkpoints(tmp_path) == [6, 9]
    for f in checkpoint_path(tmp_path, 9).iterdir():
        if f.name != ".metadata":
            f.write_bytes(b"garbage")
    with pytest.raises(StateTransferError, match="unreadable"):
        load_checkpoint(tmp_path, 9)
    assert list_checkpoints(tmp_path) == [6], "a refused checkpoint is moved aside so the older one is used"
    state, _ = load_checkpoint(tmp_path, 6)
    assert state["step"] == 6 and torch.equal(state["x"], torch.full((5,), 6.0))
    assert remove_partial(tmp_path) == 1 and not (tmp_path / "step-12.tmp").exists()


_SAVER_LOOP = """
import sys, torch
from pathlib import Path
from checkpointless.state.durable import list_checkpoints, save_checkpoint
big = torch.zeros(16 << 20, dtype=torch.uint8)
# on from the newest checkpoint an earlier attempt left: saving a step that exists fails at its
# rename, and the .tmp that leaves would pass for a kill that landed mid-save
step = max(list_checkpoints(Path(sys.argv[1])), default=0) + 2
while True:
    big.fill_(step % 251)
    save_checkpoint(Path(sys.argv[1]), step, {"step": step, "big": big, "small": torch.full((7,), step)})
    print(step, flush=True)
    step += 2
"""


@pytest.mark.timeout(120)
def test_writer_killed_mid_save_leaves_the_previous_checkpoint_usable(tmp_path: Path) -> None:
    d = tmp_path / "ck"

    def check() -> None:
        steps = list_checkpoints(d)
        assert 1 <= len(steps) <= 2, os.listdir(d)
        for s in steps:  # every directory that looks complete is complete
            state, _ = load_checkpoint(d, s)
            assert state["step"] == s and bool((state["big"] == s % 251).all())
            assert torch.equal(state["small"], torch.full((7,), s))

    mid_save = kill_writer_repeatedly(
        _SAVER_LOOP,
        d,
        attempts=8,
        pause=lambda attempt: 0.02 + 0.04 * attempt,
        mid_write=lambda names: any(n.endswith(".tmp") or ".old-" in n for n in names),
        check=check,
    )
    assert mid_save, "no kill landed while a checkpoint was being written"
    save_checkpoint(d, 10_000, {"step": 10_000})
    assert not [n for n in os.listdir(d) if not n.startswith("step-") or "." in n], os.listdir(d)


@pytest.mark.timeout(10)
def test_checkpoint_every_parses_steps_and_times_and_refuses_the_rest(tmp_path: Path) -> None:
    assert parse_every("0").off and parse_every("300") == CheckpointEvery(steps=300)
    assert parse_every("10m") == CheckpointEvery(seconds=600.0) and parse_every("1.5h").seconds == 5400.0
    assert parse_every("90s").to_text() == "90s"
    for bad in ("-3", "ten", "5d", "2.5", "0.2s", ""):
        with pytest.raises(ConfigError, match="--checkpoint-every") as err:
            parse_every(bad)
        assert "10m" in str(err.value), "the message names the accepted forms"
    a_file = tmp_path / "f"
    a_file.write_text("")
    cfg = LaunchConfig(script=str(EXAMPLE), checkpoint_every="3", checkpoint_dir=a_file / "sub")
    with pytest.raises(ConfigError, match=r"--checkpoint-dir .* is not a directory"):
        cfg.validate()
    cfg = LaunchConfig(script=str(EXAMPLE), checkpoint_every="soon")
    with pytest.raises(ConfigError, match="'soon'"):
        cfg.validate()


@pytest.mark.timeout(300)
def test_every_rank_killed_without_snapshots_restores_from_the_checkpoint(
    tmp_path: Path, corpus: Path, reference: Any
) -> None:
    ref = reference(3)
    run_dir = tmp_path / "run"
    # killall: as step 3 begins, each rank waits for the others and for rank 0's checkpoint of
    # step 3 to be complete, then every process holding a rank SIGKILLs itself
    res = run_job(
        run_dir,
        corpus,
        nproc=3,
        spares=3,
        faults=["killall:step=3"],
        extra=["--snapshot-every", "0", "--checkpoint-every", "3"],
        timeout=240,
    )
    check_recovered(res, ref)
    assert {e["rank"] for e in res.of("fault_injected") if e["kind"] == "killall"} == {0, 1, 2}
    assert {e["rank"] for e in res.of("spare_assigned")} == {0, 1, 2}, "every rank must have been replaced"
    plans = [p for p in res.of("plan") if p.get("from_checkpoint")]
    assert plans and plans[0]["target_step"] == 3 and plans[0]["receivers"] == [0, 1, 2], res.of("plan")
    assert res.of("recovery")[-1]["transport"] == "checkpoint"
    job = res.of("job_start")[0]["job"] if res.of("job_start") else res.events()[0]["job"]
    ckdir = run_dir / "checkpoints" / job
    kept = list_checkpoints(ckdir)
    # the replacement rank 0 went on saving during the replay (step 3's own was already there)
    assert 1 <= len(kept) <= 2 and kept[-1] >= 6, (
        f"checkpoints are kept after the job, the newest two: {kept}"
    )
    assert not [n for n in os.listdir(ckdir) if "." in n], "no partial save is left behind"
