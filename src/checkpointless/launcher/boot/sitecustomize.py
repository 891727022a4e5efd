"""Root-less start-up for a script that knows nothing of checkpointless (the launcher's --plain).

The launcher puts this folder first on PYTHONPATH of its workers, so Python imports this module at
start-up. It changes nothing until the script imports ``torch.distributed.rendezvous``; then it
replaces the ``env://`` rendezvous handler, so an unchanged ``dist.init_process_group("gloo")``
gets a root-less store (every rank serves its own keys; no TCPStore on rank 0) built from the peer
table the launcher handed over in the environment.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

_TARGET = "torch.distributed.rendezvous"


def _rootless_env_handler(url: str, timeout: Any = None, **kwargs: Any) -> Any:
    import datetime

    from checkpointless.rendezvous import KeyServer, PeerTable, RootlessStore

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    secret = Path(os.environ["CHECKPOINTLESS_SECRET_FILE"]).read_bytes().strip()
    fd = os.environ.get("CHECKPOINTLESS_STORE_FD")
    server = KeyServer(
        host=os.environ.get("CHECKPOINTLESS_HOST", "127.0.0.1"),
        port=int(os.environ["CHECKPOINTLESS_STORE_PORT"]),
        secret=secret,
        listen_fd=int(fd) if fd else None,  # bound by the launcher for the whole job
    )
    server.start()
    store = RootlessStore(
        rank=rank,
        world_size=world,
        peers=PeerTable(os.environ["CHECKPOINTLESS_PEERS"].split(",")),
        secret=secret,
        prefix=f"attempt{os.environ.get('CHECKPOINTLESS_ATTEMPT', '0')}/",
        timeout=timeout or datetime.timedelta(seconds=60),
        server=server,
    )
    os.environ["CHECKPOINTLESS_RENDEZVOUS"] = type(store).__name__  # for the script and tests to see
    # c10d keeps only the C++ half of a Python store: without a Python reference its methods
    # vanish, and every group made after init_process_group (dist.new_group, a device mesh's
    # groups) fails inside torch with "Not implemented"
    _STORES.append(store)
    yield (store, rank, world)


_STORES: list[Any] = []  # every store handed to torch, alive for the life of the process


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module  # type: ignore[union-attr]

        def exec_module(module: ModuleType) -> None:
            original(module)
            module._rendezvous_handlers["env"] = _rootless_env_handler  # type: ignore[attr-defined]

        loader.exec_module = exec_module  # type: ignore[method-assign,union-attr]
        return spec


if os.environ.get("CHECKPOINTLESS_PLAIN") == "1" and "CHECKPOINTLESS_PEERS" in os.environ:
    sys.meta_path.insert(0, _PatchAfterImport())
