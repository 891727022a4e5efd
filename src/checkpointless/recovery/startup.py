"""How a worker process joins its job, before ``job.steps()``: under the launcher (a worker or a
hot spare waiting for a rank), under plain torchrun, or run plainly as a world of one.

Functions of the :class:`~checkpointless.recovery.job.Job` they set up, kept apart from its
public API in ``job.py`` (as recover.py keeps the recovery round, driver.py the step loop): ``init()``
picks one of :func:`connect`, :func:`join_torchrun` and :func:`standalone`, and
``job.device_mesh()`` calls :func:`sharded_copies` once a mesh shards the state.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from checkpointless.comm.work import waiting_since
from checkpointless.events import get_logger, setup_logging
from checkpointless.faults.inject import Injector, parse_faults
from checkpointless.protocol import Assign, Prefetch, Prepare, SpareReady
from checkpointless.recovery.commit_log import CommitLog
from checkpointless.recovery.link import set_parent_death_signal
from checkpointless.recovery.process import warm_up
from checkpointless.recovery.torchrun import join_torchrun_group, torchrun_warning

if TYPE_CHECKING:
    from checkpointless.recovery.job import Job

__all__ = ["connect", "join_torchrun", "sharded_copies", "standalone"]

log = get_logger()


def connect(job: Job) -> None:
    """Under the launcher: serve our rendezvous keys, connect, wait for a rank (a spare pages in
    and prefetches meanwhile), then set up what the launcher's assignment asks for."""
    assert job.env is not None
    set_parent_death_signal()
    # Pay lazy first-use costs before the launcher starts timing our heartbeats: a spare
    # must not pay them after a fault, and a heavy import can hold the GIL for seconds.
    warm_up()
    if job.env.store_port:
        # serve our rendezvous keys from the start: peers may look us up the moment the
        # launcher names us in a peer table, and a refused connection means "dead"
        from checkpointless.rendezvous import KeyServer

        server = KeyServer(
            host=job.env.host,
            port=job.env.store_port,
            secret=job.env.secret,
            listen_fd=job.env.store_fd,
        )
        server.start()
        job.recovery.store_state["server"] = server
    comm = job.comm
    job.recovery.connect(job.env, lambda: job.clock.heartbeat(comm.in_collective_since or waiting_since()))
    if job.env.role == "spare":
        log.info("spare %d ready, waiting for a rank", job.env.worker_id)
        job.recovery.send(SpareReady())
    msg = _wait_for_rank(job)
    if "checkpointless.data.spare_cache" in sys.modules:  # we have a rank: stop prefetching
        sys.modules["checkpointless.data.spare_cache"].stop()
    job.rank = msg.rank
    job.world_size = msg.world_size
    job.placement = (msg.local_rank, msg.local_world_size, msg.node_rank)
    job.recovery.report_gen = msg.generation
    # A spare given a rank lost during start-up, before the job's first state sync, is no
    # replacement: no peer holds what the original would have restored (the script's own
    # checkpoint, with R = 1 the only copy of this shard), so it starts as the original would.
    job.is_replacement = job.env.role == "spare" and not msg.initial
    setup_logging(f"rank {job.rank}")
    job._events = CommitLog(
        job.env.run_dir / f"rank-{job.rank}.jsonl", rank=job.rank, worker=job.env.worker_id
    )  # rotated: bounded whatever the job's length
    if job.comm.backend == "nccl":
        torch.cuda.set_device(job.rank % torch.cuda.device_count())
    job.replicas.configure(msg, job.rank, job.env.job_id)
    job.divergence_every = msg.divergence_check
    specs = parse_faults(list(msg.faults), job.world_size)
    job.guard.injector = Injector(specs, job.rank, set(msg.fired), job.recovery.announce_fault)


def _wait_for_rank(job: Job) -> Assign:
    """A spare's wait (a worker's is short): its rank, meanwhile paging in and prefetching."""
    assert job.env is not None and job.recovery.link is not None
    while True:
        msg = job.recovery.link.wait_for((Assign, Prepare, Prefetch), time.monotonic() + 10 * 365 * 86400.0)
        if isinstance(msg, Assign):
            return msg
        if isinstance(msg, Prefetch):  # fill this host's batch cache for the ranks we may take
            # imported here: only spares on spare hosts need it (and a script that registered
            # a recipe, data/spare_cache.py, has imported it already)
            from checkpointless.data import spare_cache

            spare_cache.hint(job.env.job_id, msg.step, list(msg.ranks), msg.world_size)
            continue
        job.replicas.prepare(msg.state_bytes)


def standalone(job: Job) -> None:
    """Run plainly: a world of one, formed at once from a store in this process."""
    store = dist.HashStore()
    job.comm.rebuild(0, store, 0, 1, time.monotonic() + 30)
    job.generation = 0


def join_torchrun(job: Job) -> None:
    """Started by plain torchrun: the job's default group and communicator form once from
    torchrun's store, as one job without recovery (recovery/torchrun.py says why)."""
    timeout = datetime.timedelta(seconds=job.rendezvous_timeout)
    job.rank, job.world_size, store, own_default = join_torchrun_group(timeout)
    setup_logging(f"rank {job.rank}")
    if job.comm.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", job.rank)) % torch.cuda.device_count())
    deadline = time.monotonic() + job.rendezvous_timeout
    job._torchrun_store = dist.PrefixStore("checkpointless/", store)
    if own_default:  # torch's default group is the job's, as under the launcher: a mesh adopts it
        job._install_default_group().configure(0, job._torchrun_store, deadline, None)
    job.comm.rebuild(0, job._torchrun_store, job.rank, job.world_size, deadline)
    job.generation = 0
    job.under_torchrun = True
    log.warning("%s", torchrun_warning(job.rank, job.world_size))


def sharded_copies(job: Job) -> None:
    """On a mesh with S > 1 each rank holds a different shard: its own snapshots, checkpoints
    and buddy copies (``ReplicaKeeper.shard``)."""
    assert job.groups.mesh is not None
    per_host = job.placement[1] if job.placement[1] > 0 else job.world_size
    job_id = job.env.job_id if job.env is not None else None
    job.replicas.shard(
        job.rank, job.world_size, per_host, job.groups.mesh.shape, job.rendezvous_timeout, job_id
    )
