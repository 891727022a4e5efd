"""How a worker process joins its job, before ``job.steps()``: under the launcher (a worker or a
hot spare waiting for a rank), under plain torchrun, or run plainly as a world of one.

Functions of the :class:`~checkpointless.recovery.member.Member` they set up, below the public API
in ``job.py`` (as recover.py keeps the recovery round, driver.py the step loop): ``init()`` picks
one of :func:`connect`, :func:`join_torchrun` and :func:`standalone` (under the launcher it then
forms the first generation's groups, first_generation.py), and ``job.device_mesh()`` forms the
mesh with :func:`form_mesh`.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from checkpointless.comm.mesh_coords import MeshLayout
from checkpointless.comm.work import waiting_since
from checkpointless.errors import ConfigError, RendezvousError
from checkpointless.events import get_logger, setup_logging
from checkpointless.faults.inject import Injector, parse_faults
from checkpointless.protocol import Assign, Prefetch, Prepare, SpareReady
from checkpointless.recovery.commit_log import CommitLog
from checkpointless.recovery.link import set_parent_death_signal
from checkpointless.recovery.member import Member
from checkpointless.recovery.process import warm_up
from checkpointless.recovery.sharded import SHARD_STATE_NAME, ShardedRun, mesh_shape_error
from checkpointless.recovery.torchrun import join_torchrun_group, torchrun_warning
from checkpointless.recovery.tp_hosts import warn_if_tp_spans_hosts
from checkpointless.recovery.warm_specs import prewarm

__all__ = ["connect", "form_mesh", "join_torchrun", "sharded_copies", "standalone"]

log = get_logger()


def connect(member: Member) -> None:
    """Under the launcher: serve our rendezvous keys, connect, wait for a rank (a spare pages in
    and prefetches meanwhile), then set up what the launcher's assignment asks for."""
    assert member.env is not None
    set_parent_death_signal()
    # Pay lazy first-use costs before the launcher starts timing our heartbeats: a spare
    # must not pay them after a fault, and a heavy import can hold the GIL for seconds.
    warm_up()
    if member.env.store_port:
        # serve our rendezvous keys from the start: peers may look us up the moment the
        # launcher names us in a peer table, and a refused connection means "dead"
        from checkpointless.rendezvous import KeyServer

        server = KeyServer(
            host=member.env.host,
            port=member.env.store_port,
            secret=member.env.secret,
            listen_fd=member.env.store_fd,
        )
        server.start()
        member.recovery.store_state["server"] = server
    comm = member.comm
    member.recovery.connect(
        member.env, lambda: member.clock.heartbeat(comm.in_collective_since or waiting_since())
    )
    if member.env.role == "spare":
        log.info("spare %d ready, waiting for a rank", member.env.worker_id)
        member.recovery.send(SpareReady())
    msg = _wait_for_rank(member)
    if "checkpointless.data.spare_cache" in sys.modules:  # we have a rank: stop prefetching
        sys.modules["checkpointless.data.spare_cache"].stop()
    member.rank = msg.rank
    member.world_size = msg.world_size
    member.placement = (msg.local_rank, msg.local_world_size, msg.node_rank)
    member.recovery.report_gen = msg.generation
    # A spare given a rank lost during start-up, before the job's first state sync, is no
    # replacement: no peer holds what the original would have restored (the script's own
    # checkpoint, with R = 1 the only copy of this shard), so it starts as the original would.
    member.is_replacement = member.env.role == "spare" and not msg.initial
    setup_logging(f"rank {member.rank}")
    member.record.events = CommitLog(
        member.env.run_dir / f"rank-{member.rank}.jsonl", rank=member.rank, worker=member.env.worker_id
    )  # rotated: bounded whatever the job's length
    if member.comm.backend == "nccl":
        torch.cuda.set_device(member.rank % torch.cuda.device_count())
    member.replicas.configure(msg, member.rank, member.env.job_id)
    member.divergence_every = msg.divergence_check
    specs = parse_faults(list(msg.faults), member.world_size)
    member.guard.injector = Injector(
        specs, member.rank, set(msg.fired), member.recovery.announce_fault, member.guard.gather
    )


def _wait_for_rank(member: Member) -> Assign:
    """A spare's wait (a worker's is short): its rank, meanwhile paging in and prefetching."""
    assert member.env is not None and member.recovery.link is not None
    while True:
        msg = member.recovery.link.wait_for(
            (Assign, Prepare, Prefetch), time.monotonic() + 10 * 365 * 86400.0
        )
        if isinstance(msg, Assign):
            return msg
        if isinstance(msg, Prefetch):  # fill this host's batch cache for the ranks we may take
            # imported here: only spares on spare hosts need it (and a script that registered
            # a recipe, data/spare_cache.py, has imported it already)
            from checkpointless.data import spare_cache

            spare_cache.hint(member.env.job_id, msg.step, list(msg.ranks), msg.world_size)
            continue
        if msg.state_bytes:
            member.replicas.prepare(msg.state_bytes)
        if msg.warm is not None:
            _prewarm(msg.warm)


def _prewarm(recipe: dict[str, Any]) -> None:
    """Decide the job's DTensor optimizer step's sharding now, not in a replacement's first step
    (recovery/warm_specs.py); a description this process cannot use only costs that speed-up."""
    try:
        prewarm(recipe)
    except Exception as e:  # never lose a spare over its warm-up
        log.warning("spare warm-up skipped: %s: %s", type(e).__name__, e)


def standalone(member: Member) -> None:
    """Run plainly: a world of one, formed at once from a store in this process."""
    store = dist.HashStore()
    member.comm.rebuild(0, store, 0, 1, time.monotonic() + 30)
    member.generation = 0


def join_torchrun(member: Member) -> None:
    """Started by plain torchrun: the job's default group and communicator form once from
    torchrun's store, as one job without recovery (recovery/torchrun.py says why)."""
    timeout = datetime.timedelta(seconds=member.rendezvous_timeout)
    member.rank, member.world_size, store, own_default = join_torchrun_group(timeout)
    setup_logging(f"rank {member.rank}")
    if member.comm.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", member.rank)) % torch.cuda.device_count())
    deadline = time.monotonic() + member.rendezvous_timeout
    prefixed = member.torchrun_store = dist.PrefixStore("checkpointless/", store)
    if own_default:  # torch's default group is the job's, as under the launcher: a mesh adopts it
        member.install_default_group().configure(0, prefixed, deadline, None)
    member.comm.rebuild(0, prefixed, member.rank, member.world_size, deadline)
    member.generation = 0
    member.under_torchrun = True
    log.warning("%s", torchrun_warning(member.rank, member.world_size))


def sharded_copies(member: Member) -> None:
    """On a mesh with S > 1 each rank holds a different shard: its own snapshots, checkpoints
    and buddy copies (``ReplicaKeeper.shard``)."""
    assert member.groups.mesh is not None
    per_host = member.placement[1] if member.placement[1] > 0 else member.world_size
    job_id = member.env.job_id if member.env is not None else None
    member.replicas.shard(
        member.rank, member.world_size, per_host, member.groups.mesh.shape, member.rendezvous_timeout, job_id
    )


def form_mesh(member: Member, names: tuple[str, ...], shape: tuple[int, ...]) -> Any:
    """``job.device_mesh()``: a mesh over resilient groups, formed at once when nothing else
    will form it (plain torchrun, run plainly); its ``DeviceMesh``."""
    if member.groups.mesh is not None or member.clock.started:
        raise ConfigError("job.device_mesh() can be called once, before job.steps()")
    err = mesh_shape_error(names, shape, member.world_size)
    if err is not None:
        raise err
    timeout = datetime.timedelta(seconds=member.rendezvous_timeout)
    mesh = member.groups.mesh = ShardedRun(
        names,
        shape,
        member.rank,
        member.world_size,
        timeout,
        member.guard.on_collective,
        member.device.type,
        # the mesh's world group is torch's default group, which the job forms in every
        # generation, on every rank alike (a spare that makes its mesh later included)
        world_formed_elsewhere=member.groups.default is not None,
    )
    member.tracked.objects[SHARD_STATE_NAME] = mesh.identity()
    warn_if_tp_spans_hosts(member, MeshLayout.of(names, shape, sharded=names))
    if mesh.shards > 1:
        sharded_copies(member)
    if member.torchrun_store is not None:  # plain torchrun: formed once, from torchrun's store
        deadline = time.monotonic() + member.rendezvous_timeout
        # The mesh's world group is torch's default group, which init() formed already
        # (join_torchrun); forming it again would park a second gloo group, its threads
        # running, for the rest of the job (plain torchrun releases nothing until exit).
        world = mesh.mesh.world
        formed = (world,) if world.generation == 0 and world.aborted is None else ()
        mesh.configure(0, dist.PrefixStore("mesh/", member.torchrun_store), deadline, None, formed)
    elif member.opening is not None:  # under the launcher, in init()'s generation (first_generation.py)
        op, cancel = member.opening, member.recovery.cancel
        try:
            mesh.configure(op.generation, op.store, time.monotonic() + member.rendezvous_timeout, cancel)
        except RendezvousError:
            if not cancel.is_set():
                raise
            # a fault while it formed: the job's start-up goes on in job.steps(), where the
            # next generation forms the mesh with the rest
    elif not member.recovery.connected:  # run plainly: a world of one, formed at once
        mesh.configure(0, dist.HashStore(), time.monotonic() + 30, None)
    return mesh.device_mesh
