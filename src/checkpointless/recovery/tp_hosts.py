"""The warning for a job whose tensor-parallel groups span hosts (comm/mesh_hosts.py's check).

Called as the job learns its mesh (``job.device_mesh()``, or the script's own ``init_device_mesh``
learned from its DTensors as ``job.steps()`` begins). Rank 0 of the job's first processes says it
once, as a human warning and a ``tp_spans_hosts`` event in its event log; a replacement does not
say it again. The job runs on: a TP group across hosts is correct, only slow.
"""

from __future__ import annotations

import os

from checkpointless.comm.mesh_coords import MeshLayout
from checkpointless.comm.mesh_hosts import spanning_groups, spanning_warning
from checkpointless.events import get_logger
from checkpointless.recovery.member import Member

__all__ = ["hosts_per_rank", "warn_if_tp_spans_hosts"]

log = get_logger()


def hosts_per_rank(member: Member) -> int:
    """How many ranks share a host: the launcher's placement (``--nproc-per-node``), torchrun's
    ``LOCAL_WORLD_SIZE``, else the whole job on one host."""
    if member.placement[1] > 0:
        return member.placement[1]
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) > 0 else member.world_size


def warn_if_tp_spans_hosts(member: Member, layout: MeshLayout) -> None:
    """On rank 0 (not a replacement): warn when a "tp" group of ``layout`` spans hosts."""
    if member.rank != 0 or member.is_replacement:
        return
    per_host = hosts_per_rank(member)
    spans = spanning_groups(layout, per_host)
    if not spans:
        return
    log.warning("%s", spanning_warning(layout, per_host, spans))
    events = member.record.events
    if events is None:  # not under the launcher: the line alone
        return
    events.emit(
        "tp_spans_hosts",
        mesh=dict(zip(layout.names, layout.shape, strict=True)),
        per_host=per_host,
        groups=[{"dim": s.dim, "ranks": list(s.ranks), "hosts": list(s.hosts)} for s in spans[:8]],
        spanning=len(spans),
    )
