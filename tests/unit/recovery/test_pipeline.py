"""Pipeline parallel (recovery/pipeline.py): which ranks hold the same stage, and a schedule's
restart after an abandoned step.

The layout is pure. The schedules are torch's own: on torch's fake process group (no peers) for
the layouts a tracked schedule gives, and on a gloo group of one rank for a restart, where one
stage is both first and last, so a step runs without any peer.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from checkpointless.comm.mesh_coords import MeshLayout
from checkpointless.errors import ConfigError
from checkpointless.recovery.pipeline import (
    is_schedule,
    pipeline_layout,
    restart_schedule,
    schedules_layout,
    with_pipeline_dim,
)

pytestmark = pytest.mark.timeout(60)


def test_a_pipeline_group_of_consecutive_ranks_names_the_state_by_stage() -> None:
    layout = pipeline_layout([2, 3], rank=3, world_size=4)
    assert (layout.names, layout.shape, layout.replicate) == (("dp", "pp"), (2, 2), frozenset({"dp"}))
    assert layout.plan_shape() == (2, 2)  # rank r: stage r % 2 of replica r // 2
    assert [layout.state_coordinates(r) for r in range(4)] == [(0,), (1,), (0,), (1,)]
    assert layout.holders(3) == [1] and layout.holders(0) == [2]
    # four stages, two replicas: rank 6 is stage 2 of replica 1, held also by rank 2
    assert pipeline_layout([4, 5, 6, 7], rank=6, world_size=8).holders(6) == [2]


@pytest.mark.parametrize(
    "ranks,rank,world,says",
    [
        ([0, 2], 0, 4, "put the pipeline dimension last"),  # ("pp", "dp"): pp is not the last dim
        ([1, 0], 1, 4, "consecutive ranks [0, 1]"),  # stages in another order than the ranks
        ([0, 1, 2], 0, 4, "does not divide"),
    ],
)
def test_a_pipeline_group_that_is_not_a_block_of_the_mesh_is_refused(
    ranks: list[int], rank: int, world: int, says: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        pipeline_layout(ranks, rank, world)


def test_is_schedule_knows_only_pipelining_schedules() -> None:
    assert not is_schedule(object())
    assert not is_schedule(nn.Linear(2, 2))


@pytest.fixture()
def fake_world() -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_tracked_schedule_names_its_pipeline_dimension(fake_world: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    # rank 5 of (dp 2, pp 2, tp 2) is (1, 0, 1)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    stage = PipelineStage(nn.Linear(4, 4), 0, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=F.mse_loss)
    assert is_schedule(schedule)
    # tensor parallel alone (what the DTensors say) splits tp; the stages' group adds pp
    tp_only = MeshLayout.of(("dp", "pp", "tp"), (2, 2, 2), sharded={"tp"})
    both = with_pipeline_dim(tp_only, mesh, [schedule])
    assert both.replicate == frozenset({"dp"}) and both.plan_shape() == (2, 4)
    assert both.holders(5) == [1]  # (0, 0, 1): the same stage and tp shard in the other replica
    # a pipeline group over (pp, tp) ranks is no block of consecutive ranks: a clear error
    with pytest.raises(ConfigError, match="pipeline dimension last"):
        schedules_layout([schedule], rank=5, world_size=8)


def test_a_pipeline_on_a_group_of_no_mesh_dimension_is_refused(fake_world: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    stage = PipelineStage(nn.Linear(4, 4), 0, 2, torch.device("cpu"), group=dist.new_group([4, 5]))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=F.mse_loss)
    with pytest.raises(ConfigError, match="none of the groups"):
        with_pipeline_dim(MeshLayout.of(("dp", "tp"), (2, 4), sharded={"tp"}), mesh, [schedule])


@pytest.fixture()
def world_of_one() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


class Boom(RuntimeError):
    pass


def _grads(kind: Any, fail_at: int | None, restart: bool) -> list[torch.Tensor]:
    """The gradients of one step over 4 microbatches; with ``fail_at``, a first attempt raises in
    the loss of that microbatch and the step is replayed on the same schedule (``restart``:
    restarted in between, as the job does)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    calls = {"n": 0}

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if fail_at is not None and calls["n"] == fail_at + 1:
            raise Boom("fault in the loss")
        return F.mse_loss(out, target)

    schedule = kind(PipelineStage(model, 0, 1, torch.device("cpu")), n_microbatches=4, loss_fn=loss_fn)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
    if fail_at is not None:
        with pytest.raises(Boom):
            schedule.step(x, target=y)
        model.zero_grad(set_to_none=True)  # the job drops an abandoned step's gradients
        if restart:
            restart_schedule(schedule)
    losses: list[torch.Tensor] = []
    schedule.step(x, target=y, losses=losses)
    assert len(losses) == 4
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("kind", [ScheduleGPipe, Schedule1F1B], ids=["gpipe", "1f1b"])
def test_a_restarted_schedule_replays_the_step_bitwise(world_of_one: None, kind: Any) -> None:
    clean = _grads(kind, None, restart=False)
    replayed = _grads(kind, 2, restart=True)
    assert all(torch.equal(a, b) for a, b in zip(clean, replayed, strict=True))


def test_without_a_restart_the_replay_takes_the_abandoned_attempts_losses(world_of_one: None) -> None:
    # what restart_schedule prevents: GPipe kept microbatches 0 and 1's losses of the first
    # attempt, and the replay's backward of microbatches 0..3 takes losses 0, 1 of the first
    # attempt and 0, 1 of the replay: the gradient of another batch, or an error
    clean = _grads(ScheduleGPipe, None, restart=False)
    try:
        stale = _grads(ScheduleGPipe, 2, restart=False)
    except RuntimeError:
        return
    assert not all(torch.equal(a, b) for a, b in zip(clean, stale, strict=True))


def _wrapped(inner: BaseException) -> RuntimeError:
    """An error as torch's pipeline stage re-raises it: a RuntimeError from the stage's own."""
    try:
        try:
            raise inner
        except BaseException as e:
            raise RuntimeError("[Stage 0] failed to run forward:\n args: ...") from e
    except RuntimeError as outer:
        return outer


def test_an_aborted_collective_inside_a_stage_is_a_comm_failure_not_the_ranks_own() -> None:
    from checkpointless.errors import CommAborted
    from checkpointless.faults.inject import InjectedFault
    from checkpointless.recovery.process import looks_like_comm_error

    # a TP all-reduce aborted inside the stage's forward, or a peer's socket closed under it
    assert looks_like_comm_error(_wrapped(CommAborted("group g3 generation 0 aborted: peer left")))
    assert looks_like_comm_error(_wrapped(RuntimeError("[pair.cc:553] Connection closed by peer")))
    # the stage's own exception stays the rank's own fault
    assert not looks_like_comm_error(_wrapped(InjectedFault("injected fault raise:rank=2:step=2")))
    assert not looks_like_comm_error(_wrapped(ValueError("shapes do not match")))
