"""Coordinators for tests that drive it as the pure state machine it is: no process, no socket,
no clock; the test plays the shell (spawns, connections, messages, time) and reads the commands.

One place builds them, so that a change to how a coordinator is made is made here once.
"""

from __future__ import annotations

from typing import Any

from checkpointless.coordinator import Coordinator, Spawn
from checkpointless.launcher.model import LaunchConfig
from checkpointless.protocol import SpareReady

from .paths import SCRIPTS

__all__ = ["SCRIPT", "formed_host_job", "host_coordinator", "new_coordinator"]

SCRIPT = str(SCRIPTS / "slow_steps.py")  # never run here: the config only needs a script to name
# the rendezvous a coordinator hands its workers: root-less, as the launcher's default
RENDEZVOUS: dict[str, Any] = {"kind": "rootless", "timeout": 60}


def new_coordinator(nproc: int = 3, spares: int = 1, **cfg: Any) -> Coordinator:
    """A coordinator of a job of ``nproc`` ranks and ``spares`` spares on this host, not started
    (``cfg``: any other LaunchConfig field)."""
    return Coordinator(
        LaunchConfig(script=SCRIPT, nproc=nproc, spares=spares, **cfg), "job", dict(RENDEZVOUS)
    )


def host_coordinator(
    spares: int = 2, orders: tuple[int, int, int] = (0, 1, 2), validate: bool = False, **flags: Any
) -> tuple[Coordinator, list[Spawn]]:
    """2 hosts x 2 ranks and a spare host (10.0.0.<host>), agents on every host and none local,
    a 3 s lease, started at t = 100: the coordinator and the workers' spawns it asked for.

    ``orders``: each host's --node-order (host 0's first); ``validate``: check the config first,
    as the CLI does (``flags`` are other LaunchConfig fields).
    """
    cfg = LaunchConfig(
        script=SCRIPT, nproc=4, spares=spares, nnodes=2, nproc_per_node=2, spare_nodes=1,
        local_agent=False, lease=3, **flags,
    )  # fmt: skip
    if validate:
        cfg.validate()
    c = Coordinator(cfg, "job", dict(RENDEZVOUS))
    for host, order in enumerate(orders):
        c.add_host(host, f"10.0.0.{host}", True, 100.0, order)
    c.start(100.0)
    return c, [x for x in c.drain() if isinstance(x, Spawn)]


def formed_host_job(ready: int = 2, **flags: Any) -> tuple[Coordinator, list[int]]:
    """``host_coordinator``'s job with generation 0 formed at t = 101 and its two spares on the
    spare host, ``ready`` of them ready: the coordinator and the spares' worker ids.

    Workers 0-1 hold ranks 0-1 on host 0, workers 2-3 ranks 2-3 on host 1. Generation 0 is set as
    formed rather than played through a round (rounds are tested in test_coordinator.py).
    """
    c, spawns = host_coordinator(validate=True, **flags)
    for s in spawns:
        c.on_started(s.worker_id, f"10.0.0.{s.host}:{30000 + s.worker_id}")
        c.on_connected(s.worker_id, 100.0)
    c.round = None
    c.generation = 0
    for m in c.procs.values():
        m.joined = True
    c.spares.refill(101.0)
    spares: list[int] = []
    for s in [x for x in c.drain() if isinstance(x, Spawn)]:
        assert s.host == 2, s
        c.on_started(s.worker_id, f"10.0.0.2:{30000 + s.worker_id}")
        c.on_connected(s.worker_id, 101.0)
        if len(spares) < ready:
            c.on_message(s.worker_id, SpareReady(), 101.0, 1e9)
        spares.append(s.worker_id)
    c.drain()
    return c, spares
