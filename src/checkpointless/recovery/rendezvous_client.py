"""How a worker gets the store for a generation's rendezvous, from the launcher's descriptor."""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from checkpointless.config import WorkerEnv
from checkpointless.errors import ConfigError

__all__ = ["make_store"]


def make_store(
    desc: dict[str, Any],
    rank: int,
    world_size: int,
    generation: int,
    cache: dict[str, Any],
    env: WorkerEnv | None,
    shared: list[int] | None = None,
) -> dist.Store:
    """Each generation gets its own key space (``gen<g>/``) so stale keys never mix with new ones.

    ``cache`` keeps per-process objects (a client connection, this process's key server) alive
    across generations. ``shared``: ranks whose keys another rank's key server holds (degraded
    mode's held slots).
    """
    prefix = f"gen{generation}/"
    timeout = datetime.timedelta(seconds=float(desc.get("timeout", 60)))
    kind = desc.get("kind")
    if kind == "rootless":
        from checkpointless.rendezvous import KeyServer, PeerTable, RootlessStore

        if env is None:
            raise ConfigError("a root-less rendezvous needs the launcher's environment")
        server = cache.get("server")
        if server is None:
            server = KeyServer(host=env.host, port=env.store_port, secret=env.secret)
            server.start()
            cache["server"] = server
        old = cache.get("generation")
        if old is not None and old != generation:
            server.drop_prefix(f"gen{old}/")
        cache["generation"] = generation
        return RootlessStore(
            rank=rank,
            world_size=world_size,
            peers=PeerTable(list(desc["peers"]), shared or ()),
            secret=env.secret,
            prefix=prefix,
            timeout=timeout,
            server=server,
            # the launcher binds every listening socket before the process starts, so a refused
            # connection means the process is gone: no need to wait long before saying so
            connect_grace=datetime.timedelta(seconds=0.5),
        )
    if kind == "tcp":
        base = cache.get("tcp")
        if base is None:
            base = dist.TCPStore(desc["host"], int(desc["port"]), is_master=False, timeout=timeout)
            cache["tcp"] = base
        return dist.PrefixStore(prefix, base)
    raise ConfigError(f"unknown rendezvous kind {kind!r} from the launcher")
