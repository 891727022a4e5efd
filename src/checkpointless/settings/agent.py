"""A host agent's settings: the flags of ``checkpointless agent``.

The agent learns the job's own settings from the coordinator's welcome
(:class:`~checkpointless.settings.job.JobSettings`); these are only what it needs to find the
coordinator and to say who it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from checkpointless.settings.spec import flag

__all__ = ["AgentSettings"]


@dataclass(frozen=True)
class AgentSettings:
    coordinator: str = flag(metavar="HOST:PORT", help="the coordinator's control address")
    host: str = flag(metavar="ADDR", help="this host's address: its processes listen on it")
    secret_file: str = flag(metavar="F", help="the job's secret (the coordinator's <run dir>/secret)")
    node_order: int | None = flag(
        None,
        metavar="N",
        help="placement hint: hosts with lower N become lower node ranks",
        unset=True,
        doc_default="`$SLURM_NODEID`, else arrival",
    )
    connect_timeout: float = flag(60.0, metavar="S", help="seconds to wait for the coordinator")
    rejoin: bool = flag(
        True, name="--no-rejoin", invert=True, help="exit once fenced instead of rejoining as a spare host"
    )

    def order(self) -> int:
        """The placement hint: --node-order, else the node's place in a Slurm allocation, else -1
        (the order in which agents arrive)."""
        if self.node_order is not None:
            return self.node_order
        env = os.environ.get("SLURM_NODEID", "")
        return int(env) if env.isdigit() else -1
