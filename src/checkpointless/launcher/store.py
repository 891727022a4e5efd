"""The rendezvous a coordinator offers its workers: how they find each other's key servers."""

from __future__ import annotations

import socket
from typing import Any

from checkpointless.launcher.model import LaunchConfig

__all__ = ["JobStore"]


class JobStore:
    """The job's rendezvous, as the coordinator describes it to every worker.

    Root-less (the default) needs nothing here: every rank serves its own keys. The store-based
    fallback (``--rendezvous tcp``) is a ``torch.distributed.TCPStore`` this process hosts for
    as long as it lives.
    """

    def __init__(self, cfg: LaunchConfig) -> None:
        self.listener: socket.socket | None = None
        self.store: Any = None  # the TCPStore, for --rendezvous tcp
        if cfg.rendezvous == "rootless":
            self.description: dict[str, Any] = {"kind": "rootless", "timeout": cfg.recovery_timeout}
            return
        import torch.distributed as dist  # only the store-based fallback pays for this import

        # The TCP store authenticates nobody, so it must at least listen on the job's interface
        # only (torch would bind every interface): bind the socket ourselves and hand it over.
        listener = socket.create_server((cfg.host, 0), backlog=512)
        self.listener = listener  # owned by us; closed with the store
        self.store = dist.TCPStore(
            cfg.host,
            listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
        self.description = {
            "kind": "tcp",
            "host": cfg.host,
            "port": self.store.port,
            "timeout": cfg.recovery_timeout,
        }

    def close(self) -> None:
        """Stop offering the store (the launcher itself leaves it to the end of its process)."""
        if self.listener is not None:
            self.listener.close()
        self.store = None
