"""The cluster environment CheckpointlessStrategy gives Lightning: ranks come from the job.

Lightning asks its environment for the world size, the ranks and a main address; under
checkpointless the launcher has started every process and ``checkpointless.init()`` has made
torch's default group, so every answer comes from the :class:`~checkpointless.recovery.job.Job`
and Lightning's own settings (``devices``, ``num_nodes``) change nothing.
"""

from __future__ import annotations

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment

from checkpointless.errors import ConfigError
from checkpointless.recovery.job import Job

__all__ = ["CheckpointlessEnvironment"]


class CheckpointlessEnvironment(ClusterEnvironment):
    """Ranks come from the checkpointless launcher, which also starts every process."""

    def __init__(self, job: Job) -> None:
        self._job = job

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        # unused: checkpointless.init() has already made torch's default group (a resilient one,
        # recovery/default_group.py), so Lightning never connects to a main address
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return False  # chosen explicitly by CheckpointlessStrategy, never auto-detected

    def world_size(self) -> int:
        return self._job.world_size

    def set_world_size(self, size: int) -> None:
        pass  # the launcher decides (--nproc); Lightning's `devices` flag does not

    def global_rank(self) -> int:
        return self._job.rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self._job.rank  # every rank of a job runs on one host today

    def node_rank(self) -> int:
        return 0

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_nodes != 1:
            raise ConfigError(
                f"Trainer(num_nodes={num_nodes}): a checkpointless job runs on one host; "
                "leave num_nodes at 1 and set the number of ranks with `checkpointless run --nproc`"
            )
